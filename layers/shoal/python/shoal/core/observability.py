"""The one logger every function uses, and the custom metrics of an invocation. Never log
payloads or tokens.

Metrics: code where an event happens calls ``count`` (or ``lag``) once per batch; the counts
go into the current invocation's ``InvocationMetrics``, which ``observed`` (the one wrapper
around every handler) creates and flushes once, as one EMF document through Powertools, when
the invocation ends. Outside an invocation (tests of a service, benchmarks that call services
directly, the pipeline) counting does nothing.

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


class InvocationMetrics:
    """One invocation's counts and lags; thread-safe (the push consumer works keys at once)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.lags: dict[str, int] = {}
        self._lock = threading.Lock()

    def count(self, name: str, n: int) -> None:
        with self._lock:
            self.counts[name] = self.counts.get(name, 0) + n

    def lag(self, name: str, ms: int) -> None:
        # the oldest record of the invocation is its lag
        with self._lock:
            self.lags[name] = max(ms, self.lags.get(name, 0))

    def document(self, service: str) -> dict[str, Any] | None:
        """The EMF document of this invocation, or None when nothing was counted."""
        if not self.counts and not self.lags:
            return None
        emf = EphemeralMetrics(namespace=names.NAMESPACE, service=service)
        for name, value in sorted(self.counts.items()):
            emf.add_metric(name=name, unit=MetricUnit.Count, value=value)
        for name, value in sorted(self.lags.items()):
            emf.add_metric(name=name, unit=MetricUnit.Milliseconds, value=value)
        return dict(emf.serialize_metric_set())

    def flush(self, service: str) -> None:
        document = self.document(service)
        if document is None:
            return
        if is_metrics_disabled():
            # `shoal dev` (POWERTOOLS_METRICS_DISABLED): no CloudWatch reads its stdout, so the
            # document goes to the function log at DEBUG instead of among the request lines
            logger.debug("metrics", extra={"emf": document})
            return
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
