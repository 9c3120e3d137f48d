"""The sessions' due timers without a queue: the delay a timer is sent with, its message, and
when one is armed (``shoal.sessions.timers``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from botocore.exceptions import ClientError
from shoal.sessions.timers import (
    MAX_DELAY_S,
    TIMER_HORIZON_S,
    Timer,
    arm_timer,
    delay_s,
)

NOW = 1_700_000_000_000


@pytest.mark.parametrize(
    ("due_in_ms", "delay"),
    [
        (-60_000, 0),  # due already: at once
        (0, 0),
        (1, 1),  # a fraction of a second rounds up: never handed out before it is due
        (2_300, 3),
        (5_000, 5),
        (MAX_DELAY_S * 1000, MAX_DELAY_S),
        (MAX_DELAY_S * 1000 + 1, MAX_DELAY_S),  # beyond SQS's 15 minutes: 15, then again
        (3 * 3600 * 1000, MAX_DELAY_S),
    ],
)
def test_a_timers_delay_is_the_time_until_due_within_sqss_limits(
    due_in_ms: int, delay: int
) -> None:
    assert delay_s(NOW + due_in_ms, NOW) == delay


def test_a_timer_longer_than_the_longest_delay_is_cut_to_it() -> None:
    # the rest is armed again when the timer comes early
    assert delay_s(NOW + 10_000, NOW, longest_s=2) == 2
    assert delay_s(NOW + 10_000, NOW, longest_s=0) == 0


def test_a_timer_reads_back_as_it_was_written() -> None:
    timer = Timer("sensor-1 ünï", "will#1700000000000-abc", NOW + 5000)
    assert Timer.parse(timer.body()) == timer


@pytest.mark.parametrize(
    "body",
    [
        "",
        "not json",
        "[1]",
        '{"v": 2, "c": "a", "i": "head", "d": 1}',
        '{"v": 1, "c": "a", "i": "head"}',
        '{"v": 1, "c": 1, "i": "head", "d": 1}',
        '{"v": 1, "c": "a", "i": "head", "d": "1"}',
    ],
)
def test_a_body_no_timer_wrote_is_refused(body: str) -> None:
    with pytest.raises(ValueError):
        Timer.parse(body)


@dataclass
class Armed:
    """A ``DueTimer`` that records what it was asked to arm, or refuses as SQS would."""

    timers: list[tuple[str, str, int]] = field(default_factory=list)
    refuse: bool = False

    def arm(self, client_id: str, item: str, due_at_ms: int) -> None:
        if self.refuse:
            raise ClientError({"Error": {"Code": "ServiceUnavailable"}}, "SendMessage")
        self.timers.append((client_id, item, due_at_ms))


def test_an_item_due_within_the_horizon_gets_a_timer() -> None:
    armed = Armed()
    assert arm_timer(armed, "c", "head", NOW, NOW)
    assert arm_timer(armed, "c", "will#v", NOW + TIMER_HORIZON_S * 1000, NOW)
    assert armed.timers == [("c", "head", NOW), ("c", "will#v", NOW + TIMER_HORIZON_S * 1000)]


def test_an_item_due_beyond_the_horizon_is_left_to_the_schedule() -> None:
    # a will delay of days would otherwise be a chain of 15-minute timers all that while
    armed = Armed()
    assert not arm_timer(armed, "c", "will#v", NOW + TIMER_HORIZON_S * 1000 + 1, NOW)
    assert armed.timers == []


def test_a_refused_timer_is_not_an_error_of_the_write_it_follows() -> None:
    assert not arm_timer(Armed(refuse=True), "c", "head", NOW, NOW)


def test_no_timer_arms_nothing() -> None:
    assert not arm_timer(None, "c", "head", NOW, NOW)
