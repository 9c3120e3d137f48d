"""shoal dev's cycle collector: full passes in quiet moments, or at the latest every MAX_GAP_S,
never when nothing was promoted since the last (``shoal.local.collector``)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
from shoal.local.collector import NEVER, Collector, Look, Schedule


def _schedule() -> Schedule:
    return Schedule(0.0, 0.0, quiet_gap_s=10.0, max_gap_s=60.0, quiet_share=0.25)


def test_a_busy_process_gets_its_full_pass_only_at_the_longest_gap() -> None:
    schedule = _schedule()
    # a whole core busy at every look, one a second
    due = [s for s in range(1, 70) if schedule.due(Look(float(s), float(s), promoted=5))]
    assert due[0] == 60


def test_a_quiet_process_gets_its_full_pass_after_the_quiet_gap() -> None:
    schedule = _schedule()
    # busy for 5 s, then a tenth of a core
    cpu = 0.0
    due = []
    for s in range(1, 30):
        cpu += 1.0 if s <= 5 else 0.1
        if schedule.due(Look(float(s), cpu, promoted=5)):
            due.append(s)
            schedule.ran(float(s), cpu)
    assert due == [10, 20]


def test_a_burst_holds_the_pass_until_it_ends() -> None:
    schedule = _schedule()
    cpu = 0.0
    first = None
    for s in range(1, 60):
        cpu += 0.9 if 8 <= s <= 25 else 0.05
        if schedule.due(Look(float(s), cpu, promoted=5)):
            first = s
            break
    assert first == 26


def test_nothing_promoted_since_the_last_pass_is_never_due() -> None:
    schedule = _schedule()
    assert not any(schedule.due(Look(float(s), 0.0, promoted=0)) for s in range(1, 300))


@pytest.fixture
def thresholds() -> Iterator[tuple[int, int, int]]:
    saved = gc.get_threshold()
    yield saved
    gc.set_threshold(*saved)


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_the_collector_takes_cpythons_full_passes_and_gives_them_back(
    thresholds: tuple[int, int, int],
) -> None:
    young0, young1, full = gc.get_threshold()
    collector = Collector(look_every_s=3600)
    collector.start()
    try:
        assert gc.get_threshold() == (young0, young1, NEVER)
    finally:
        collector.stop()
    assert gc.get_threshold() == (young0, young1, full)


def test_a_due_look_frees_the_cycles_of_the_oldest_generation(
    thresholds: tuple[int, int, int],
) -> None:
    now = [0.0]
    collector = Collector(
        clock_s=lambda: now[0],
        cpu_s=lambda: 0.0,
        look_every_s=3600,
        schedule=Schedule(0.0, 0.0, quiet_gap_s=10.0, max_gap_s=60.0),
    )
    young0, young1, _ = gc.get_threshold()
    gc.set_threshold(young0, young1, NEVER)  # no full pass of CPython's own in between
    gc.collect()
    cycle = _Cycle()
    gone = weakref.ref(cycle)
    gc.collect(1)  # the cycle survives into the oldest generation, which counts one promotion
    del cycle
    gc.collect(1)  # the young passes do not walk the oldest generation
    assert gone() is not None
    now[0] = 5.0
    assert not collector.look()  # too soon after the last pass, however quiet
    assert gone() is not None
    now[0] = 11.0
    assert collector.look()
    assert gone() is None
    assert collector.passes == 1
    # nothing promoted since: the next look, however late, runs nothing
    now[0] = 500.0
    assert not collector.look()
