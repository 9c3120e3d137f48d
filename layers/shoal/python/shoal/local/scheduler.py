"""EventBridge rate schedules, emulated: periodic functions (the reaper) run under ``shoal dev``.

Deployed, a rule ``rate(N seconds)`` invokes the function asynchronously with a "Scheduled
Event" (sample: ``events/scheduled_event.json``). What is copied here:

- the first invocation comes one period after the schedule starts, then one every period,
  timed by the injected clock;
- periods missed while nothing ran (a stopped laptop, a slow handler) are not made up: the
  next invocation is the first one due, and the one after it is on the original grid;
- a function error is retried as Lambda retries asynchronous invocations: the same event
  again after one minute, then after two more, then dropped.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from shoal.core.clock import Clock
from shoal.core.observability import logger
from shoal.declarations import DEPLOYMENT, Deployment
from shoal.local.provision import ACCOUNT_ID, LocalNames

Invoke = Callable[[str, dict[str, Any]], Any]

#: Lambda's asynchronous retries of a function error: after 1 minute, then after 2 more
ASYNC_RETRY_DELAYS_S = (60.0, 120.0)


def schedules_for(
    deployment: Deployment = DEPLOYMENT,
    names: LocalNames | None = None,
    every_s: Mapping[str, int] | None = None,
) -> list[tuple[str, int]]:
    """(function name, every seconds) of each declared schedule, with physical names.

    ``every_s`` overrides a declared period by function name (``shoal dev --schedule``), so a
    developer or a test need not wait a deployed minute for the reaper.
    """
    names = names or LocalNames.for_deployment(deployment)
    overrides = every_s or {}
    unknown = set(overrides) - {f.name for f in deployment.functions if f.schedule_s}
    if unknown:
        raise ValueError(f"no scheduled function named {sorted(unknown)}")
    return [
        (names.functions[f.name], overrides.get(f.name, f.schedule_s))
        for f in deployment.functions
        if f.schedule_s is not None
    ]


def scheduled_event(
    rule_arn: str, at_ms: int, *, region: str, account: str, event_id: str | None = None
) -> dict[str, Any]:
    """The event an EventBridge schedule rule sends its target."""
    return {
        "version": "0",
        "id": event_id or str(uuid.uuid4()),
        "detail-type": "Scheduled Event",
        "source": "aws.events",
        "account": account,
        "time": datetime.fromtimestamp(at_ms / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "region": region,
        "resources": [rule_arn],
        "detail": {},
    }


@dataclass
class _Schedule:
    function_name: str
    every_ms: int
    next_ms: int
    rule_arn: str


@dataclass(frozen=True)
class _Retry:
    due_ms: int
    function_name: str
    event: dict[str, Any]
    #: how many retries this one is (1 or 2)
    attempt: int


class Scheduler:
    """Invokes each scheduled function when its time has come on the clock."""

    def __init__(
        self,
        schedules: Iterable[tuple[str, float]],
        invoke: Invoke,
        clock: Clock,
        *,
        region: str = "us-east-1",
        account: str = ACCOUNT_ID,
        poll_interval_s: float = 0.5,
        retry_delays_s: tuple[float, ...] = ASYNC_RETRY_DELAYS_S,
    ) -> None:
        self._invoke = invoke
        self._clock = clock
        self.region = region
        self.account = account
        self.poll_interval_s = poll_interval_s
        self._retry_delays_ms = [round(d * 1000) for d in retry_delays_s]
        start = clock.now_ms()
        self._schedules: list[_Schedule] = []
        for function_name, every_s in schedules:
            every_ms = round(every_s * 1000)
            if every_ms <= 0:
                raise ValueError(f"schedule of {function_name} must be positive, not {every_s}")
            rule = f"arn:aws:events:{region}:{account}:rule/{function_name}-schedule"
            self._schedules.append(_Schedule(function_name, every_ms, start + every_ms, rule))
        self._retries: list[_Retry] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def next_due_ms(self) -> int | None:
        """When the next invocation (scheduled or retry) is due; None without any."""
        with self._lock:
            times = [s.next_ms for s in self._schedules] + [r.due_ms for r in self._retries]
        return min(times, default=None)

    def run_due(self) -> int:
        """Invoke every function whose time has come; returns the number of invocations."""
        with self._lock:
            now = self._clock.now_ms()
            calls: list[tuple[str, dict[str, Any], int]] = []
            for schedule in self._schedules:
                if now < schedule.next_ms:
                    continue
                event = scheduled_event(
                    schedule.rule_arn, schedule.next_ms, region=self.region, account=self.account
                )
                calls.append((schedule.function_name, event, 0))
                # One invocation however many periods were missed; the grid stays the same.
                missed = (now - schedule.next_ms) // schedule.every_ms
                schedule.next_ms += (missed + 1) * schedule.every_ms
            due = [r for r in self._retries if r.due_ms <= now]
            self._retries = [r for r in self._retries if r.due_ms > now]
            calls.extend((r.function_name, r.event, r.attempt) for r in due)
            for function_name, event, attempt in calls:
                self._call(function_name, event, attempt, now)
        return len(calls)

    def _call(self, function_name: str, event: dict[str, Any], attempt: int, now: int) -> None:
        try:
            self._invoke(function_name, event)
        except Exception as exc:
            retry = attempt < len(self._retry_delays_ms)
            logger.warning(
                "scheduled function failed",
                extra={
                    "function": function_name,
                    "error": type(exc).__name__,
                    "attempt": attempt,
                    "retry": retry,
                },
            )
            if retry:
                due = now + self._retry_delays_ms[attempt]
                self._retries.append(_Retry(due, function_name, event, attempt + 1))

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="shoal-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.error("scheduler thread did not stop")
        self._thread = None

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_interval_s):
            try:
                self.run_due()
            except Exception:
                logger.exception("scheduler round failed")
