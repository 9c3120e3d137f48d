"""``shoal dev``'s CloudWatch Logs and Lambda metrics: what the functions' EMF documents say,
and which invocations failed, put into the emulated CloudWatch, where the console's Overview
reads them with the same ``GetMetricData`` as deployed (``shoal.overview``).

Deployed, a function prints one EMF document per invocation (``shoal.core.observability``) and
CloudWatch Logs turns it into metric data; Lambda counts the invocations that raised as
``Errors`` (namespace ``AWS/Lambda``, dimension ``FunctionName``). Here the runtime takes each
document as the invocation flushes it (``observability.set_emf_writer``) and each failed
invocation from its sandbox, adds them up per metric and minute (CloudWatch keeps EMF's
metrics at one-minute resolution, so a graph of minutes or more sees the same figures), and
every ``FLUSH_S`` puts what came since as statistic sets (sum, minimum, maximum, samples).
Lambda's ``Throttles`` stay zero: the runtime queues an invocation for a sandbox instead.

The puts are journaled as any write of the emulator, so a restarted ``shoal dev`` graphs what
came before it.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shoal.core.clock import Clock, SystemClock

log = logging.getLogger("shoal-dev.metrics")

#: how often what came in is put into the emulated CloudWatch (the Overview refreshes every
#: few seconds under ``shoal dev``)
FLUSH_S = 2.0
#: PutMetricData's limit of metric data a call
MAX_DATA_PER_PUT = 1000
LAMBDA_NAMESPACE = "AWS/Lambda"

#: (namespace, metric, dimensions sorted by name, unit, minute start in s)
Key = tuple[str, str, tuple[tuple[str, str], ...], str, int]


@dataclass
class Sampled:
    """A statistic set: what CloudWatch keeps of a metric's samples in a minute."""

    total: float
    low: float
    high: float
    samples: int

    def add(self, value: float) -> None:
        self.total += value
        self.low = min(self.low, value)
        self.high = max(self.high, value)
        self.samples += 1

    def merge(self, other: Sampled) -> None:
        self.total += other.total
        self.low = min(self.low, other.low)
        self.high = max(self.high, other.high)
        self.samples += other.samples


def samples(document: Mapping[str, Any]) -> list[tuple[Key, float]]:
    """Each value an EMF document gives, with the metric it is of (as CloudWatch Logs reads
    one: every metric of a directive under each of its dimension sets)."""
    meta = document.get("_aws")
    if not isinstance(meta, Mapping):
        return []
    stamp_ms = int(meta.get("Timestamp") or 0)
    minute = stamp_ms // 60_000 * 60
    out: list[tuple[Key, float]] = []
    for directive in meta.get("CloudWatchMetrics") or []:
        namespace = str(directive.get("Namespace", ""))
        for dimension_set in directive.get("Dimensions") or [[]]:
            dims = tuple(sorted((str(d), str(document.get(d, ""))) for d in dimension_set))
            for metric in directive.get("Metrics") or []:
                name = str(metric.get("Name", ""))
                raw = document.get(name)
                values = raw if isinstance(raw, list) else [raw]
                for value in values:
                    if isinstance(value, int | float) and not isinstance(value, bool):
                        key = (namespace, name, dims, str(metric.get("Unit", "None")), minute)
                        out.append((key, float(value)))
    return out


class LocalMetrics:
    """The documents and failures that came since the last flush, and the thread that puts
    them into the emulated CloudWatch."""

    def __init__(
        self, cloudwatch: Any, *, flush_s: float = FLUSH_S, clock: Clock | None = None
    ) -> None:
        self.cloudwatch = cloudwatch
        self.flush_s = flush_s
        self.clock = clock or SystemClock()
        self._pending: dict[Key, Sampled] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- what comes in (the invocations' threads)

    def take(self, document: Mapping[str, Any]) -> None:
        """An invocation's EMF document (``observability.set_emf_writer``)."""
        self._add(samples(document))

    def failed(self, function_name: str) -> None:
        """An invocation of the deployed function ``function_name`` raised: Lambda's
        ``Errors``."""
        minute = self.clock.now_ms() // 60_000 * 60
        dims = (("FunctionName", function_name),)
        self._add([((LAMBDA_NAMESPACE, "Errors", dims, "Count", minute), 1.0)])

    def _add(self, found: list[tuple[Key, float]]) -> None:
        with self._lock:
            for key, value in found:
                held = self._pending.get(key)
                if held is None:
                    self._pending[key] = Sampled(value, value, value, 1)
                else:
                    held.add(value)

    # -- what goes out (the flusher)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="shoal-dev-metrics", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stops the flusher after one last flush."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.flush_s):
            self.flush()
        self.flush()

    def flush(self) -> int:
        """Puts what came since the last flush; the metric data put. What a failed put held
        waits for the next flush."""
        with self._lock:
            taken, self._pending = self._pending, {}
        by_namespace: dict[str, list[dict[str, Any]]] = {}
        for (namespace, name, dims, unit, minute), sampled in sorted(taken.items()):
            by_namespace.setdefault(namespace, []).append(
                {
                    "MetricName": name,
                    "Dimensions": [{"Name": k, "Value": v} for k, v in dims],
                    "Timestamp": dt.datetime.fromtimestamp(minute, dt.UTC),
                    "Unit": unit,
                    "StatisticValues": {
                        "SampleCount": sampled.samples,
                        "Sum": sampled.total,
                        "Minimum": sampled.low,
                        "Maximum": sampled.high,
                    },
                }
            )
        put = 0
        for namespace, data in by_namespace.items():
            for at in range(0, len(data), MAX_DATA_PER_PUT):
                chunk = data[at : at + MAX_DATA_PER_PUT]
                try:
                    self.cloudwatch.put_metric_data(Namespace=namespace, MetricData=chunk)
                    put += len(chunk)
                except Exception as exc:
                    log.warning(
                        "metrics not put; tried again at the next flush",
                        extra={"error_type": type(exc).__name__},
                    )
                    self._return(namespace, chunk)
        return put

    def _return(self, namespace: str, chunk: list[dict[str, Any]]) -> None:
        with self._lock:
            for datum in chunk:
                dims = tuple((d["Name"], d["Value"]) for d in datum["Dimensions"])
                minute = int(datum["Timestamp"].timestamp())
                key = (namespace, datum["MetricName"], dims, datum["Unit"], minute)
                stats = datum["StatisticValues"]
                back = Sampled(
                    stats["Sum"], stats["Minimum"], stats["Maximum"], stats["SampleCount"]
                )
                held = self._pending.get(key)
                if held is None:
                    self._pending[key] = back
                else:
                    held.merge(back)
