"""The soak's drain: how long it waits for the owed to arrive before the verdict."""

from __future__ import annotations

from bench.soak.driver import Settings, drain_goes_on

SETTINGS = Settings(drain_s=240, drain_cap_s=720)


def test_within_its_limit_the_drain_always_looks_again() -> None:
    assert drain_goes_on(SETTINGS, 0, None, None)
    assert drain_goes_on(SETTINGS, 230, 5, 3)


def test_past_its_limit_it_goes_on_only_while_the_missing_fall() -> None:
    # a slow subscriber working through its backlog (run E: 223 missing at the limit,
    # delivered two seconds after the drain gave up)
    assert drain_goes_on(SETTINGS, 250, 223, 273)
    assert not drain_goes_on(SETTINGS, 250, 223, 223)
    assert not drain_goes_on(SETTINGS, 250, 224, 223)
    assert not drain_goes_on(SETTINGS, 250, None, None)
    assert not drain_goes_on(SETTINGS, 250, 5, None)


def test_the_cap_ends_it_whatever_the_progress() -> None:
    assert not drain_goes_on(SETTINGS, 720, 10, 500)
