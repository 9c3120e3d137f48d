"""Emulated EventBridge rate schedules, driven by a manual clock."""

from __future__ import annotations

from typing import Any

import pytest
from shoal.core.clock import ManualClock
from shoal.declarations import DEPLOYMENT, Deployment, FunctionDef
from shoal.local.provision import LocalNames
from shoal.local.scheduler import Scheduler, schedules_for

from tests.helpers import load_event


class Calls:
    def __init__(self, fail: int = 0) -> None:
        self.fail = fail
        self.made: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, function_name: str, event: dict[str, Any]) -> None:
        self.made.append((function_name, event))
        if self.fail:
            self.fail -= 1
            raise RuntimeError("failing")

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.made]


def shape(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(v) for v in value[:1]]
    return type(value).__name__


def test_function_runs_once_each_period_by_the_clock() -> None:
    # Given a function scheduled every 60 s
    clock = ManualClock()
    calls = Calls()
    scheduler = Scheduler([("shoal-reaper", 60)], calls, clock)

    # When the clock moves to just before, to, and past two periods
    clock.advance(59.999)
    assert scheduler.run_due() == 0
    clock.advance(0.001)
    assert scheduler.run_due() == 1
    assert scheduler.run_due() == 0
    clock.advance(60)
    scheduler.run_due()

    # Then the function ran once per period
    assert calls.names == ["shoal-reaper", "shoal-reaper"]


def test_each_schedule_keeps_its_own_period() -> None:
    # Given two functions on different periods
    clock = ManualClock()
    calls = Calls()
    scheduler = Scheduler([("fast", 10), ("slow", 30)], calls, clock)

    # When 30 s pass in steps of 10 s
    for _ in range(3):
        clock.advance(10)
        scheduler.run_due()

    # Then the fast one ran three times, the slow one once
    assert calls.names == ["fast", "fast", "fast", "slow"]


def test_missed_periods_are_not_made_up() -> None:
    # Given a function every 10 s and nothing run for 35 s
    clock = ManualClock()
    calls = Calls()
    scheduler = Scheduler([("f", 10)], calls, clock)
    clock.advance(35)

    # When the scheduler runs
    scheduler.run_due()

    # Then it invokes once, and the next run is on the original grid (at 40 s)
    assert calls.names == ["f"]
    assert scheduler.next_due_ms() == clock.now_ms() + 5_000


def test_event_is_an_eventbridge_scheduled_event() -> None:
    # Given a schedule every minute, started a minute before 2023-11-14T22:13:20Z
    clock = ManualClock(1_700_000_000_000 - 60_000)
    calls = Calls()
    scheduler = Scheduler([("shoal-reaper", 60)], calls, clock)

    # When it comes due
    clock.advance(60)
    scheduler.run_due()

    # Then the event has the sample's shape and the due time
    [(_, event)] = calls.made
    assert shape(event) == shape(load_event("scheduled_event.json"))
    assert event["detail-type"] == "Scheduled Event"
    assert event["source"] == "aws.events"
    assert event["time"] == "2023-11-14T22:13:20Z"
    assert event["resources"] == [
        "arn:aws:events:us-east-1:123456789012:rule/shoal-reaper-schedule"
    ]


def test_failed_invocation_is_retried_after_one_then_two_minutes_then_dropped() -> None:
    # Given a function every hour that fails three times in a row
    clock = ManualClock()
    calls = Calls(fail=3)
    scheduler = Scheduler([("f", 3600)], calls, clock)
    clock.advance(3600)
    scheduler.run_due()

    # When the clock moves one, then two more minutes, then much later
    clock.advance(59)
    scheduler.run_due()
    clock.advance(1)
    scheduler.run_due()
    clock.advance(120)
    scheduler.run_due()
    clock.advance(600)
    scheduler.run_due()

    # Then the same event was tried three times in all, then dropped
    assert calls.names == ["f", "f", "f"]
    assert len({event["id"] for _, event in calls.made}) == 1


def test_declared_schedules_name_physical_functions() -> None:
    # Given a deployment with one scheduled function and one without a schedule
    deployment = Deployment(
        tables=(),
        buckets=(),
        functions=(FunctionDef(name="reaper", schedule_s=15), FunctionDef(name="health")),
    )

    # When the schedules are read / Then they name the deployed function and its period
    names = LocalNames.for_deployment(deployment, prefix="shoal")
    assert schedules_for(deployment, names) == [("shoal-reaper", 15)]


def test_schedule_override_replaces_the_declared_period() -> None:
    # Given the reaper is declared every 60 s, When shoal dev is told reaper=2,
    # Then only its period changes and it keeps its physical name.
    names = LocalNames.for_deployment(DEPLOYMENT)
    declared = dict(schedules_for(DEPLOYMENT, names))
    overridden = dict(schedules_for(DEPLOYMENT, names, {"reaper": 2}))
    assert declared[names.functions["reaper"]] == 60
    assert overridden == {**declared, names.functions["reaper"]: 2}


def test_schedule_override_of_an_unscheduled_function_is_refused() -> None:
    with pytest.raises(ValueError, match="health"):
        schedules_for(DEPLOYMENT, None, {"health": 1})
