"""``shoal dev``'s metrics (``shoal.local.metrics``): an EMF document read as CloudWatch Logs
reads it, summed per metric and minute, and put into the emulated CloudWatch, where a
``GetMetricData`` finds what the documents said."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from moto import mock_aws
from shoal.core import metrics
from shoal.core.clock import ManualClock
from shoal.core.observability import InvocationMetrics
from shoal.local.aws import adapt_moto
from shoal.local.metrics import LocalMetrics, samples

MINUTE_MS = 1_796_421_120_000  # 2026-12-04 21:52:00 UTC, a minute's start


def document(service: str, at_ms: int, **counts: int) -> dict[str, Any]:
    """The EMF document an invocation of ``service`` flushes at ``at_ms``."""
    recorded = InvocationMetrics()
    for name, n in counts.items():
        recorded.count(name, n)
    made = recorded.document(service)
    assert made is not None
    made["_aws"]["Timestamp"] = at_ms
    return made


@pytest.fixture
def cloudwatch() -> Iterator[Any]:
    adapt_moto()
    with mock_aws():
        yield boto3.client("cloudwatch", region_name="us-east-1")


def sums(cloudwatch: Any, namespace: str, metric: str, dims: dict[str, str]) -> list[float]:
    start = dt.datetime.fromtimestamp(MINUTE_MS / 1000, dt.UTC)
    answer = cloudwatch.get_metric_data(
        MetricDataQueries=[
            {
                "Id": "q",
                "MetricStat": {
                    "Metric": {
                        "Namespace": namespace,
                        "MetricName": metric,
                        "Dimensions": [{"Name": k, "Value": v} for k, v in dims.items()],
                    },
                    "Period": 60,
                    "Stat": "Sum",
                },
            }
        ],
        StartTime=start,
        EndTime=start + dt.timedelta(minutes=3),
        ScanBy="TimestampAscending",
    )
    return list(answer["MetricDataResults"][0]["Values"])


def test_a_document_gives_each_value_of_each_metric_under_its_dimensions() -> None:
    found = samples(document("publish", MINUTE_MS + 59_999, **{metrics.PUBLISHED: 3}))
    assert found == [
        (("Shoal", metrics.PUBLISHED, (("service", "publish"),), "Count", MINUTE_MS // 1000), 3.0)
    ]
    # something that is not EMF gives nothing
    assert samples({"message": "hello"}) == []


def test_documents_are_summed_per_minute_and_put_once_each_flush(cloudwatch: Any) -> None:
    clock = ManualClock(MINUTE_MS)
    local = LocalMetrics(cloudwatch, clock=clock)
    # Given three invocations' documents over two minutes, and a failed invocation
    local.take(document("publish", MINUTE_MS + 1_000, **{metrics.PUBLISHED: 2}))
    local.take(document("publish", MINUTE_MS + 30_000, **{metrics.PUBLISHED: 5}))
    local.take(document("edge", MINUTE_MS + 61_000, **{metrics.PUBLISHED: 1}))
    local.failed("shoal-router")
    # When they are flushed: one datum per metric, function and minute
    assert local.flush() == 3
    assert local.flush() == 0
    # Then CloudWatch holds what the documents said, by minute and function
    published = {"service": "publish"}
    assert sums(cloudwatch, "Shoal", metrics.PUBLISHED, published) == [7.0]
    assert sums(cloudwatch, "Shoal", metrics.PUBLISHED, {"service": "edge"}) == [1.0]
    errors = sums(cloudwatch, "AWS/Lambda", "Errors", {"FunctionName": "shoal-router"})
    assert errors == [1.0]
    # and a later flush adds to a minute put before
    local.take(document("publish", MINUTE_MS + 2_000, **{metrics.PUBLISHED: 4}))
    local.flush()
    assert sums(cloudwatch, "Shoal", metrics.PUBLISHED, published) == [11.0]


def test_what_a_failed_put_held_is_put_at_the_next_flush(cloudwatch: Any) -> None:
    class Refusing:
        def __init__(self) -> None:
            self.refuse = True

        def put_metric_data(self, **request: Any) -> None:
            if self.refuse:
                raise RuntimeError("the emulator is busy")
            cloudwatch.put_metric_data(**request)

    client = Refusing()
    local = LocalMetrics(client, clock=ManualClock(MINUTE_MS))
    local.take(document("publish", MINUTE_MS, **{metrics.PUBLISHED: 2}))
    assert local.flush() == 0
    local.take(document("publish", MINUTE_MS + 5_000, **{metrics.PUBLISHED: 3}))
    client.refuse = False
    assert local.flush() == 1
    assert sums(cloudwatch, "Shoal", metrics.PUBLISHED, {"service": "publish"}) == [5.0]
