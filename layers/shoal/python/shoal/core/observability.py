"""The one logger every function uses, and the custom metrics of an invocation. Never log
payloads or tokens.

Metrics: code where an event happens calls ``count`` (or ``lag``) once per batch, and the
reaper's census its ``gauge``s; they go into the current invocation's ``InvocationMetrics``,
which ``observed`` (the one wrapper around every handler) creates and flushes once, as EMF
documents through Powertools (one, and one more per extra dimension a gauge names), when the
invocation ends. Outside an invocation (tests of a service, benchmarks that call services
directly, the pipeline) counting does nothing.

Deployed, a document is a line on stdout, which CloudWatch Logs turns into metrics. ``shoal
dev`` takes each document instead (``emf_writer``) and puts it into its emulated CloudWatch,
as CloudWatch Logs would (``shoal.local.metrics``): the figures the console's Overview shows
locally are these same documents.

Why not Powertools' ``Metrics`` object with ``log_metrics``: its metric set is shared by every
instance in the process, and ``shoal dev`` runs every function's invocations in one process
on several threads, so one invocation would flush another's counts under its own service.
An ``EphemeralMetrics`` per invocation, found through a context variable, keeps them apart.

The ``service`` dimension is the function's folder name: ``POWERTOOLS_SERVICE_NAME``, set per
function by the stack (``shoal.declarations.function_environment``); ``shoal dev`` runs every
function in one process, so it names the function of an invocation with ``service_scope``.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import wraps
from typing import Any, TypeVar

from aws_lambda_powertools import Logger
from aws_lambda_powertools.metrics import EphemeralMetrics, MetricUnit
from aws_lambda_powertools.metrics.functions import is_metrics_disabled

from shoal.core import metrics as names

SERVICE_ENV = "POWERTOOLS_SERVICE_NAME"

logger = Logger(service=os.environ.get(SERVICE_ENV) or "shoal")

T = TypeVar("T")
R = TypeVar("R")


#: a gauge's extra dimensions, beside ``service``: (name, value) pairs, sorted
Dimensions = tuple[tuple[str, str], ...]

#: where an invocation's EMF documents go instead of stdout (``shoal dev``: its CloudWatch);
#: None: stdout deployed, the function log at DEBUG when metrics are disabled
EmfWriter = Callable[[dict[str, Any]], None]
_emf_writer: list[EmfWriter] = []


def set_emf_writer(writer: EmfWriter | None) -> None:
    """Send every invocation's EMF documents to ``writer`` (None: back to stdout)."""
    _emf_writer.clear()
    if writer is not None:
        _emf_writer.append(writer)


class InvocationMetrics:
    """One invocation's counts, lags and gauges; thread-safe (the push consumer works keys at
    once)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.lags: dict[str, int] = {}
        #: the last value of each gauge, by its extra dimensions
        self.gauges: dict[Dimensions, dict[str, float]] = {}
        self._lock = threading.Lock()

    def count(self, name: str, n: int) -> None:
        with self._lock:
            self.counts[name] = self.counts.get(name, 0) + n

    def lag(self, name: str, ms: int) -> None:
        # the oldest record of the invocation is its lag
        with self._lock:
            self.lags[name] = max(ms, self.lags.get(name, 0))

    def gauge(self, name: str, value: float, dimensions: Dimensions = ()) -> None:
        # a level, not a sum: the last value stands
        with self._lock:
            self.gauges.setdefault(dimensions, {})[name] = value

    def document(self, service: str) -> dict[str, Any] | None:
        """The EMF document of this invocation's counts, lags and gauges of the ``service``
        dimension alone, or None when there are none."""
        plain = self.gauges.get((), {})
        if not self.counts and not self.lags and not plain:
            return None
        emf = EphemeralMetrics(namespace=names.NAMESPACE, service=service)
        for name, value in sorted(self.counts.items()):
            emf.add_metric(name=name, unit=MetricUnit.Count, value=value)
        for name, value in sorted(self.lags.items()):
            emf.add_metric(name=name, unit=MetricUnit.Milliseconds, value=value)
        for name, level in sorted(plain.items()):
            emf.add_metric(name=name, unit=MetricUnit.Count, value=level)
        return dict(emf.serialize_metric_set())

    def documents(self, service: str) -> list[dict[str, Any]]:
        """Every EMF document of this invocation: ``document``'s, and one per set of extra
        dimensions its gauges name (a document's metrics share its dimensions)."""
        out = [d for d in (self.document(service),) if d is not None]
        for dimensions, levels in sorted(self.gauges.items()):
            if not dimensions:
                continue
            emf = EphemeralMetrics(namespace=names.NAMESPACE, service=service)
            for key, value in dimensions:
                emf.add_dimension(name=key, value=value)
            for name, level in sorted(levels.items()):
                emf.add_metric(name=name, unit=MetricUnit.Count, value=level)
            out.append(dict(emf.serialize_metric_set()))
        return out

    def flush(self, service: str) -> None:
        for document in self.documents(service):
            if _emf_writer:
                # `shoal dev`: its CloudWatch takes the document as CloudWatch Logs would
                _emf_writer[0](document)
            if is_metrics_disabled():
                # `shoal dev` (POWERTOOLS_METRICS_DISABLED): no CloudWatch reads its stdout, so
                # the document goes to the function log at DEBUG instead of among the requests
                logger.debug("metrics", extra={"emf": document})
                continue
            # CloudWatch Logs turns this stdout line into metrics (Embedded Metric Format)
            print(json.dumps(document, separators=(",", ":")), flush=True)


_current: ContextVar[InvocationMetrics | None] = ContextVar("shoal_metrics", default=None)
_service: ContextVar[str | None] = ContextVar("shoal_service", default=None)


def count(name: str, n: int = 1) -> None:
    """Add ``n`` to a count of this invocation (``shoal.core.metrics``); call it per batch."""
    current = _current.get()
    if current is not None and n:
        current.count(name, n)


def lag(name: str, ms: int) -> None:
    """Report the age of a batch's oldest record (the invocation keeps the largest)."""
    current = _current.get()
    if current is not None:
        current.lag(name, max(int(ms), 0))


def gauge(name: str, value: float, **dimensions: str) -> None:
    """Report a level (the census's: connections, sessions, dead letters) with the extra
    ``dimensions`` beside ``service``; each distinct value of one is a billed custom metric, so
    only bounded ones (a push subscription's name, which an admin makes)."""
    current = _current.get()
    if current is not None:
        current.gauge(name, float(value), tuple(sorted(dimensions.items())))


def carried(fn: Callable[[T], R]) -> Callable[[T], R]:
    """``fn`` for a worker thread, counting into the calling thread's invocation (a thread
    pool's threads do not see the caller's context variables)."""
    current = _current.get()

    @wraps(fn)
    def run(arg: T) -> R:
        token = _current.set(current)
        try:
            return fn(arg)
        finally:
            _current.reset(token)

    return run


def service_name() -> str:
    return _service.get() or os.environ.get(SERVICE_ENV) or "shoal"


@contextmanager
def service_scope(service: str) -> Iterator[None]:
    """Name the function an invocation runs in (``shoal dev``: one process, every function)."""
    token = _service.set(service)
    try:
        yield
    finally:
        _service.reset(token)


@contextmanager
def invocation() -> Iterator[InvocationMetrics]:
    """Count into a new ``InvocationMetrics``, flushed once at the end (failed or not)."""
    recorder = InvocationMetrics()
    token = _current.set(recorder)
    try:
        yield recorder
    finally:
        _current.reset(token)
        try:
            recorder.flush(service_name())
        except Exception as error:
            # counting never fails a request (nor hides the error the invocation raised)
            logger.warning("metrics not flushed", extra={"error_type": type(error).__name__})


Handler = Callable[[dict[str, Any], Any], Any]


def observed(handler: Handler) -> Handler:
    """The wrapper of every Lambda entry point: the request id in every log line, and one
    metrics flush per invocation."""
    logged = logger.inject_lambda_context(clear_state=True)(handler)

    @wraps(handler)
    def run(event: dict[str, Any], context: Any) -> Any:
        with invocation():
            return logged(event, context)

    return run
