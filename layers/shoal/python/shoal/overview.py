"""The console's Overview (``GET /v1/metrics``): the figures the stack graphs, for the last 15
minutes, hour or day, from CloudWatch, in one ``GetMetricData`` call a view.

The series are the stack's own metrics (``shoal.core.metrics``, namespace ``Shoal``, dimension
``service``; Lambda's ``Errors`` and ``Throttles`` by ``FunctionName``), asked for only where a
function emits them: CloudWatch bills every metric a call names ($0.01 per 1,000), so the
query names the pairs below, not every metric of every function. Under ``shoal dev`` the same
call reaches its emulated CloudWatch, which holds what the functions' EMF documents said
(``shoal.local.metrics``): there is no second set of counters.

Counts are sums over a period, shown per second (messages, pushes) or per minute (errors);
levels (the census's, ``shoal.census``) and the router's lag are the period's maximum. A count
with no datapoint in a period was zero; a level or a lag without one is unknown (a gap).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from botocore.exceptions import BotoCoreError, ClientError

from shoal.aws import clients
from shoal.aws.clients import error_code
from shoal.composite.store import TopicStore
from shoal.core import metrics as names
from shoal.core.clock import Clock, SystemClock
from shoal.core.config import Config
from shoal.core.errors import BadRequest, ServerBusy
from shoal.declarations import DEPLOYMENT, Deployment
from shoal.push.store import PushSubscriptionStore

Unit = Literal["count", "per_second", "per_minute", "ms"]


class InvalidRange(BadRequest):
    code = "invalid_range"


@dataclass(frozen=True)
class Range:
    """A view: how far back, and the period of its points."""

    name: str
    seconds: int
    period_s: int


#: the views; CloudWatch keeps the stack's metrics at one-minute resolution (EMF's standard)
RANGES = {
    r.name: r for r in (Range("15m", 900, 60), Range("1h", 3600, 60), Range("1d", 86400, 300))
}
DEFAULT_RANGE = "1h"
#: push subscriptions whose dead letters are drawn (the census counts as many)
MAX_SUBSCRIPTIONS = 50
#: statuses of CloudWatch's that mean "later": the route answers 503 server_busy
THROTTLED = frozenset(
    {"Throttling", "ThrottlingException", "LimitExceeded", "RequestLimitExceeded"}
)

#: who counts what (the ``service`` dimension): every function that can count a metric, no
#: more. Published: the HTTP API's publishes, the WebSocket API's publish frames, the wills the
#: reaper publishes. Delivered: a get's first hand-out, a WebSocket push's (its get), a push
#: subscription's first POST.
PUBLISHERS = ("publish", "edge", "reaper")
DELIVERERS = ("messages", "pusher", "push")


@dataclass(frozen=True)
class Part:
    """One metric CloudWatch is asked for."""

    namespace: str
    metric: str
    dimensions: tuple[tuple[str, str], ...]
    stat: str

    def query(self, query_id: str, period_s: int) -> dict[str, Any]:
        return {
            "Id": query_id,
            "MetricStat": {
                "Metric": {
                    "Namespace": self.namespace,
                    "MetricName": self.metric,
                    "Dimensions": [{"Name": k, "Value": v} for k, v in self.dimensions],
                },
                "Period": period_s,
                "Stat": self.stat,
            },
            "ReturnData": True,
        }


@dataclass(frozen=True)
class Series:
    """A line of a chart: the sum (counts) or the maximum (levels, lags) of its parts."""

    id: str
    label: str
    unit: Unit
    parts: tuple[Part, ...]
    #: counts are summed over parts and periods; levels and lags are not
    counted: bool = True
    #: the function a part of ``parts`` is, when the series is one function's (errors)
    function: str = ""


@dataclass(frozen=True)
class Chart:
    id: str
    title: str
    unit: Unit
    series: tuple[Series, ...]


@dataclass
class Plan:
    """The charts of one view and the one request that fills them."""

    range: Range
    start: dt.datetime
    end: dt.datetime
    charts: list[Chart]
    #: series that feed a figure, not a chart
    figures: list[Series]
    #: (series, part) of each query id
    queries: dict[str, tuple[Series, Part]] = field(default_factory=dict)

    def request(self) -> dict[str, Any]:
        return {
            "MetricDataQueries": [
                part.query(query_id, self.range.period_s)
                for query_id, (_, part) in self.queries.items()
            ],
            "StartTime": self.start,
            "EndTime": self.end,
            "ScanBy": "TimestampAscending",
        }


def _shoal(metric: str, service: str, stat: str = "Sum", **extra: str) -> Part:
    dims = ((names.DIMENSION, service), *sorted(extra.items()))
    return Part(names.NAMESPACE, metric, dims, stat)


def _lambda(metric: str, function_name: str) -> Part:
    return Part("AWS/Lambda", metric, (("FunctionName", function_name),), "Sum")


def pushers(deployment: Deployment) -> tuple[str, ...]:
    """The functions that post to WebSocket connections (those granted them), which count
    pushes, failed pushes and throttled posts (as ``infra/websocket.py`` sums them)."""
    return tuple(
        f.name for f in deployment.functions if any(g.kind == "connections" for g in f.grants)
    )


def plan(
    range_name: str | None,
    now: dt.datetime,
    config: Config,
    subscriptions: Sequence[str] = (),
    deployment: Deployment = DEPLOYMENT,
) -> Plan:
    """The view ``range_name`` (``15m``, ``1h``, ``1d``; None: ``DEFAULT_RANGE``) ending with
    the period ``now`` is in, for the push subscriptions ``subscriptions``."""
    view = RANGES.get(range_name or DEFAULT_RANGE)
    if view is None:
        raise InvalidRange(
            f"range is one of {', '.join(RANGES)}", allowed=list(RANGES), got=str(range_name)
        )
    declared = {f.name for f in deployment.functions}

    def emitted_by(metric: str, services: Iterable[str], stat: str = "Sum") -> tuple[Part, ...]:
        return tuple(_shoal(metric, s, stat) for s in services if s in declared)

    pushing = pushers(deployment)
    charts = [
        Chart(
            "connections",
            "Connections and sessions",
            "count",
            (
                Series(
                    "connections",
                    "WebSocket connections",
                    "count",
                    emitted_by(names.CONNECTIONS, ["reaper"], "Maximum"),
                    counted=False,
                ),
                Series(
                    "sessions",
                    "connected sessions",
                    "count",
                    emitted_by(names.SESSIONS_CONNECTED, ["reaper"], "Maximum"),
                    counted=False,
                ),
            ),
        ),
        Chart(
            "messages",
            "Messages",
            "per_second",
            (
                Series(
                    "published", "published", "per_second", emitted_by(names.PUBLISHED, PUBLISHERS)
                ),
                Series(
                    "delivered", "delivered", "per_second", emitted_by(names.DELIVERED, DELIVERERS)
                ),
            ),
        ),
        Chart(
            "pushes",
            "WebSocket pushes",
            "per_second",
            (
                Series("pushes", "frames pushed", "per_second", emitted_by(names.PUSHED, pushing)),
                Series(
                    "push_failures",
                    "pushes failed",
                    "per_second",
                    emitted_by(names.PUSH_FAILED, pushing),
                ),
                Series(
                    "posts_throttled",
                    "posts throttled",
                    "per_second",
                    emitted_by(names.POSTS_THROTTLED, pushing),
                ),
            ),
        ),
        Chart(
            "router_lag",
            "Router lag (iterator age)",
            "ms",
            (
                Series(
                    "router_lag",
                    "oldest record of a batch",
                    "ms",
                    emitted_by(names.ROUTER_LAG, ["router"], "Maximum"),
                    counted=False,
                ),
            ),
        ),
        Chart(
            "dead_letters",
            "Dead letters by push subscription",
            "count",
            tuple(
                Series(
                    f"dead_letters:{name}",
                    name,
                    "count",
                    (
                        _shoal(
                            names.DEAD_LETTERS,
                            "reaper",
                            "Maximum",
                            **{names.SUBSCRIPTION_DIMENSION: name},
                        ),
                    ),
                    counted=False,
                )
                for name in list(subscriptions)[:MAX_SUBSCRIPTIONS]
            ),
        ),
    ]
    functions = sorted(n for n in declared if n in config.functions)
    errors = [
        Series(
            f"{kind}:{name}",
            name,
            "per_minute",
            (_lambda(metric, config.functions[name]),),
            function=name,
        )
        for kind, metric in (("errors", "Errors"), ("throttles", "Throttles"))
        for name in functions
    ]
    figures = [
        Series(
            "groups",
            "shared groups",
            "count",
            emitted_by(names.SHARED_GROUPS, ["reaper"], "Maximum"),
            counted=False,
        ),
        *errors,
    ]
    period = view.period_s
    end_s = (int(now.timestamp()) // period + 1) * period
    made = Plan(
        view,
        dt.datetime.fromtimestamp(end_s - view.seconds, dt.UTC),
        dt.datetime.fromtimestamp(end_s, dt.UTC),
        charts,
        figures,
    )
    every = [s for c in charts for s in c.series] + figures
    for series in every:
        for part in series.parts:
            made.queries[f"q{len(made.queries)}"] = (series, part)
    return made


def answer(made: Plan, results: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The view's answer from ``GetMetricData``'s ``MetricDataResults`` (every page's): one
    time axis (each period's start, ms) and each series' values on it."""
    period = made.range.period_s
    start_s = int(made.start.timestamp())
    slots = made.range.seconds // period
    axis = [(start_s + i * period) * 1000 for i in range(slots)]
    raw: dict[str, list[float | None]] = {}
    for result in results:
        found = made.queries.get(str(result.get("Id")))
        if found is None:
            continue
        series, _ = found
        values = raw.setdefault(series.id, [None] * slots)
        for stamp, value in zip(
            result.get("Timestamps", []), result.get("Values", []), strict=False
        ):
            slot = (int(_seconds(stamp)) - start_s) // period
            if not 0 <= slot < slots:
                continue
            held = values[slot]
            if series.counted:
                values[slot] = (held or 0.0) + float(value)
            else:
                values[slot] = float(value) if held is None else max(held, float(value))

    def drawn(series: Series) -> dict[str, Any]:
        values = raw.get(series.id, [None] * slots)
        if series.counted:
            sums = [v or 0.0 for v in values]
            per = {"per_second": 1 / period, "per_minute": 60 / period}.get(series.unit, 1.0)
            shown: list[float | None] = [round(v * per, 6) for v in sums]
            total: float | None = sum(sums)
        else:
            shown = values
            total = None
        latest = next((v for v in reversed(shown) if v is not None), None)
        return {
            "id": series.id,
            "label": series.label,
            "values": shown,
            "total": total,
            "latest": latest,
        }

    charts = [
        {
            "id": c.id,
            "title": c.title,
            "unit": c.unit,
            "series": [drawn(s) for s in c.series],
        }
        for c in made.charts
    ]
    by_function: dict[str, dict[str, float]] = {}
    groups: float | None = None
    for series in made.figures:
        shown = drawn(series)
        if series.function:
            kind = series.id.split(":", 1)[0]
            by_function.setdefault(series.function, {"errors": 0.0, "throttles": 0.0})[kind] = (
                shown["total"] or 0.0
            )
        elif series.id == "groups":
            groups = shown["latest"]
    return {
        "range": made.range.name,
        "period_s": period,
        "start": made.start.isoformat().replace("+00:00", "Z"),
        "end": made.end.isoformat().replace("+00:00", "Z"),
        "timestamps": axis,
        "charts": charts,
        "functions": [
            {"function": name, "errors": int(v["errors"]), "throttles": int(v["throttles"])}
            for name, v in sorted(by_function.items())
        ],
        "groups": None if groups is None else int(groups),
    }


def _seconds(stamp: Any) -> float:
    if isinstance(stamp, dt.datetime):
        return stamp.timestamp()
    return dt.datetime.fromisoformat(str(stamp)).timestamp()


class Overview:
    """``GET /v1/metrics``: the view's series from CloudWatch, and the current figures."""

    def __init__(
        self,
        cloudwatch: Any,
        config: Config,
        topics: TopicStore,
        subscriptions: PushSubscriptionStore,
        *,
        clock: Clock | None = None,
        deployment: Deployment = DEPLOYMENT,
    ) -> None:
        self.cloudwatch = cloudwatch
        self.config = config
        self.topics = topics
        self.subscriptions = subscriptions
        self.clock = clock or SystemClock()
        self.deployment = deployment

    @classmethod
    def from_config(cls, config: Config, clock: Clock | None = None) -> Overview:
        clock = clock or SystemClock()
        return cls(
            clients.client("cloudwatch", config.region),
            config,
            TopicStore.from_config(config),
            PushSubscriptionStore.from_config(config, clock),
            clock=clock,
        )

    def view(self, range_name: str | None) -> dict[str, Any]:
        now = dt.datetime.fromtimestamp(self.clock.now_ms() / 1000, dt.UTC)
        # checked first: a bad range reads nothing
        plan(range_name, now, self.config, (), self.deployment)
        topics = self.topics.scan()
        subs = self._subscriptions()
        made = plan(range_name, now, self.config, subs, self.deployment)
        found = answer(made, self._results(made))
        found["figures"] = {
            "topics": len(topics),
            "storage_topics": sum(len(t.storage_topics) for t in topics),
            "push_subscriptions": len(subs),
            "groups": found.pop("groups"),
        }
        found["source"] = "cloudwatch"
        return found

    def _subscriptions(self) -> list[str]:
        names_: list[str] = []
        after: str | None = None
        while True:
            page, after = self.subscriptions.page(100, after)
            names_ += [s.name for s in page]
            if after is None:
                return sorted(names_)

    def _results(self, made: Plan) -> list[dict[str, Any]]:
        """Every page of the view's one ``GetMetricData`` request."""
        request = made.request()
        out: list[dict[str, Any]] = []
        while True:
            try:
                page = self.cloudwatch.get_metric_data(**request)
            except ClientError as exc:
                if error_code(exc) in THROTTLED:
                    raise ServerBusy("CloudWatch is busy; retry") from exc
                raise
            except BotoCoreError as exc:
                raise ServerBusy("CloudWatch cannot be reached; retry") from exc
            out += page.get("MetricDataResults", [])
            token = page.get("NextToken")
            if not token:
                return out
            request["NextToken"] = token
