"""moto's CloudWatch made to answer ``GetMetricData`` in time (``shoal.local.aws.adapt_moto``
applies it, process-wide and idempotent), with moto's answers (the tests compare them).

moto answers a metric query by walking every period of the asked range and, in each, every
datapoint of the range: periods times datapoints, per query. The console's Overview asks for a
day in 288 periods with about a hundred queries, over what ``shoal dev`` puts in a day (a
datapoint per metric and flush: ``shoal.local.metrics``): tens of millions of comparisons,
seconds, under the emulator's one lock, which every function's call waits on. This sorts each
datapoint into its period once per query instead: the same candidates, filtered by moto's own
tests, summarized by moto's own ``Statistics``, in moto's order.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any


def bucket_metric_queries() -> None:
    """Replace ``CloudWatchBackend.get_metric_data`` by one that puts each datapoint in its
    period at once, for requests of metric queries only (metric math and Metrics Insights
    queries keep moto's own path)."""
    from moto.cloudwatch.models import CloudWatchBackend

    if getattr(CloudWatchBackend.get_metric_data, "_bucketed", False):
        return
    original: Callable[..., list[dict[str, Any]]] = CloudWatchBackend.get_metric_data

    def get_metric_data(
        self: Any,
        queries: list[dict[str, Any]],
        start_time: datetime,
        end_time: datetime,
        scan_by: str = "TimestampAscending",
    ) -> list[dict[str, Any]]:
        if not queries or any("MetricStat" not in q for q in queries):
            return original(self, queries, start_time, end_time, scan_by)
        start_time = start_time.replace(microsecond=0)
        end_time = end_time.replace(microsecond=0)
        if start_time >= end_time:
            # moto's own validation errors
            return original(self, queries, start_time, end_time, scan_by)
        by_name: dict[str, list[Any]] = {}
        for md in self.get_all_metrics():
            if start_time <= md.timestamp < end_time:
                by_name.setdefault(md.name, []).append(md)
        return [
            result
            for result, returned in (
                _metric_query(q, by_name, start_time, end_time, scan_by) for q in queries
            )
            if returned
        ]

    get_metric_data._bucketed = True  # type: ignore[attr-defined]
    # moto's own, which the tests compare with
    get_metric_data._moto = original  # type: ignore[attr-defined]
    CloudWatchBackend.get_metric_data = get_metric_data


def _metric_query(
    query: dict[str, Any],
    by_name: dict[str, list[Any]],
    start_time: datetime,
    end_time: datetime,
    scan_by: str,
) -> tuple[dict[str, Any], bool]:
    """One metric query's result as moto's loop makes it, and whether it is returned."""
    from moto.cloudwatch.models import Dimension, Statistics

    metric_stat = query["MetricStat"]
    query_ns = metric_stat["Metric"]["Namespace"]
    query_name = metric_stat["Metric"]["MetricName"]
    delta = timedelta(seconds=int(metric_stat["Period"]))
    dimensions = [
        Dimension(name=d["Name"], value=d["Value"])
        for d in metric_stat["Metric"].get("Dimensions", [])
    ]
    unit = metric_stat.get("Unit")
    stat = metric_stat["Stat"]
    candidates = by_name.get(query_name, [])
    # moto's filters, in its words: with dimensions the namespace is not compared
    if dimensions:
        wanted = sorted(dimensions)
        candidates = [md for md in candidates if sorted(md.dimensions) == wanted]
    else:
        candidates = [md for md in candidates if md.namespace == query_ns]
    if unit:
        candidates = [md for md in candidates if md.unit == unit]
    periods: dict[int, list[Any]] = {}
    for md in candidates:
        periods.setdefault((md.timestamp - start_time) // delta, []).append(md)
    values: list[Any] = []
    timestamps: list[datetime] = []
    for index in sorted(periods):
        period_start = start_time + index * delta
        if period_start > end_time:
            continue
        stats = Statistics([stat], period_start)
        stats.metric_data = periods[index]
        values.append(stats.get_statistics_for_type(stat))
        timestamps.append(stats.timestamp)
    if scan_by == "TimestampDescending" and timestamps:
        timestamps.reverse()
        values.reverse()
    label = query.get("Label") or f"{query_name} {stat}"
    result = {
        "id": query["Id"],
        "label": label,
        "values": values,
        "timestamps": timestamps,
        "status_code": "Complete",
    }
    return result, bool(query.get("ReturnData", True))
