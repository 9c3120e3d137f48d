"""The Overview's query and answer (``shoal.overview``): the views and their periods, the
metrics each series asks for, and how CloudWatch's results become the page's figures."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from shoal.core import metrics
from shoal.core.config import Config
from shoal.declarations import DEPLOYMENT
from shoal.overview import DELIVERERS, PUBLISHERS, InvalidRange, answer, plan, pushers

NOW = dt.datetime(2026, 12, 4, 21, 57, 30, tzinfo=dt.UTC)
CONFIG = Config(functions={f.name: f"stack-{f.name}" for f in DEPLOYMENT.functions})


def queries(made: Any) -> list[dict[str, Any]]:
    return list(made.request()["MetricDataQueries"])


def asked(made: Any, metric: str) -> set[tuple[tuple[str, str], ...]]:
    """The dimensions every query of ``metric`` names."""
    return {
        tuple((d["Name"], d["Value"]) for d in q["MetricStat"]["Metric"]["Dimensions"])
        for q in queries(made)
        if q["MetricStat"]["Metric"]["MetricName"] == metric
    }


@pytest.mark.parametrize(
    ("name", "period", "points", "end"),
    [("15m", 60, 15, (21, 58)), ("1h", 60, 60, (21, 58)), ("1d", 300, 288, (22, 0))],
)
def test_a_view_ends_with_the_period_now_is_in(
    name: str, period: int, points: int, end: tuple[int, int]
) -> None:
    # When a view is asked for at 21:57:30
    request = plan(name, NOW, CONFIG).request()
    # Then its periods are whole, the last one holding now
    assert request["EndTime"] == dt.datetime(2026, 12, 4, *end, tzinfo=dt.UTC)
    assert (request["EndTime"] - request["StartTime"]).total_seconds() == points * period
    assert {q["MetricStat"]["Period"] for q in request["MetricDataQueries"]} == {period}


def test_no_range_is_the_last_hour_and_another_is_refused_by_name() -> None:
    assert plan(None, NOW, CONFIG).range.name == "1h"
    with pytest.raises(InvalidRange) as refused:
        plan("2d", NOW, CONFIG)
    assert refused.value.status == 400
    assert refused.value.body()["error"]["code"] == "invalid_range"
    assert refused.value.body()["error"]["allowed"] == ["15m", "1h", "1d"]


def test_counts_are_asked_of_the_functions_that_count_them_and_levels_of_the_reaper() -> None:
    made = plan("15m", NOW, CONFIG, ["orders", "audit"])
    service = metrics.DIMENSION
    assert asked(made, metrics.PUBLISHED) == {((service, s),) for s in PUBLISHERS}
    assert asked(made, metrics.DELIVERED) == {((service, s),) for s in DELIVERERS}
    # the pushing functions are those granted the WebSocket API's connections
    assert set(pushers(DEPLOYMENT)) == {"edge", "pusher"}
    assert asked(made, metrics.PUSHED) == {((service, s),) for s in pushers(DEPLOYMENT)}
    assert asked(made, metrics.ROUTER_LAG) == {((service, "router"),)}
    assert asked(made, metrics.CONNECTIONS) == {((service, "reaper"),)}
    assert asked(made, metrics.DEAD_LETTERS) == {
        ((service, "reaper"), (metrics.SUBSCRIPTION_DIMENSION, n)) for n in ("orders", "audit")
    }
    # Lambda's errors and throttles of every function, by its deployed name
    assert asked(made, "Errors") == {
        (("FunctionName", f"stack-{f.name}"),) for f in DEPLOYMENT.functions
    }
    stats = {
        q["MetricStat"]["Metric"]["MetricName"]: q["MetricStat"]["Stat"] for q in queries(made)
    }
    assert stats[metrics.PUBLISHED] == stats["Errors"] == "Sum"
    assert stats[metrics.ROUTER_LAG] == stats[metrics.CONNECTIONS] == "Maximum"
    # one request, well inside GetMetricData's 500 queries
    assert len(queries(made)) < 100


def _results(made: Any, wanted: dict[tuple[str, str], list[tuple[int, float]]]) -> list[Any]:
    """GetMetricData's results: (metric, service) -> (minute index, value) datapoints."""
    out = []
    for query_id, (_, part) in made.queries.items():
        service = dict(part.dimensions).get(metrics.DIMENSION, "")
        found = wanted.get((part.metric, service), [])
        out.append(
            {
                "Id": query_id,
                "Timestamps": [made.start + dt.timedelta(minutes=i) for i, _ in found],
                "Values": [v for _, v in found],
            }
        )
    return out


def test_counts_become_rates_and_totals_summed_over_their_functions() -> None:
    made = plan("15m", NOW, CONFIG)
    # Given 30 publishes over HTTP and 6 over the WebSocket API in the last minute, 12 before
    results = _results(
        made,
        {
            (metrics.PUBLISHED, "publish"): [(13, 12.0), (14, 30.0)],
            (metrics.PUBLISHED, "edge"): [(14, 6.0)],
        },
    )
    view = answer(made, results)
    [published] = [
        s
        for c in view["charts"]
        if c["id"] == "messages"
        for s in c["series"]
        if s["id"] == "published"
    ]
    # Then each minute is per second, a minute without data is zero, and the total is a count
    assert published["values"][-2:] == [0.2, 0.6]
    assert published["values"][:13] == [0.0] * 13
    assert (published["total"], published["latest"]) == (48.0, 0.6)
    assert len(view["timestamps"]) == 15 and view["period_s"] == 60


def test_a_level_or_a_lag_without_data_is_a_gap_not_a_zero() -> None:
    made = plan("15m", NOW, CONFIG)
    view = answer(
        made,
        _results(
            made,
            {
                (metrics.ROUTER_LAG, "router"): [(3, 1200.0), (9, 400.0)],
                (metrics.SHARED_GROUPS, "reaper"): [(10, 3.0)],
            },
        ),
    )
    [lag] = [c["series"][0] for c in view["charts"] if c["id"] == "router_lag"]
    assert lag["values"][3] == 1200.0 and lag["values"][9] == 400.0
    assert lag["values"][4] is None and lag["values"][14] is None
    assert (lag["total"], lag["latest"]) == (None, 400.0)
    assert view["groups"] == 3


def test_errors_and_throttles_are_totals_by_function() -> None:
    made = plan("1h", NOW, CONFIG)
    results = []
    for query_id, (series, _) in made.queries.items():
        value = 2.0 if series.id == "errors:router" else 1.0 if series.id == "throttles:edge" else 0
        stamps = [made.start] if value else []
        results.append({"Id": query_id, "Timestamps": stamps, "Values": [value] if value else []})
    functions = {f["function"]: f for f in answer(made, results)["functions"]}
    assert functions["router"] == {"function": "router", "errors": 2, "throttles": 0}
    assert functions["edge"] == {"function": "edge", "errors": 0, "throttles": 1}
    assert set(functions) == {f.name for f in DEPLOYMENT.functions}
