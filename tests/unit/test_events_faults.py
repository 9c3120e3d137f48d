"""The fault switch (``SHOAL_FAULTS``, ``shoal.core.faults``): off unless set, parsed strictly."""

from __future__ import annotations

import random

import pytest
from shoal.core.config import Config, parse_faults
from shoal.core.faults import ROUTER_STEPS, Faults


def test_faults_are_off_unless_set() -> None:
    # Given an environment without SHOAL_FAULTS
    config = Config.from_env({})
    # Then no invocation ever fails
    faults = Faults.from_config(config, "router")
    assert {faults.plan(ROUTER_STEPS).step for _ in range(200)} == {None}


def test_the_switch_names_functions_probabilities_and_a_seed() -> None:
    # When SHOAL_FAULTS names the router, the push function and a seed
    parsed = parse_faults("router=0.25, push=1,seed=3")
    # Then each gets its probability
    assert parsed == {"router": 0.25, "push": 1.0, "seed": 3.0}


@pytest.mark.parametrize("raw", ["router", "router=1.5", "router=x", "=0.5", "seed=0.5"])
def test_a_malformed_switch_is_an_error_not_a_silent_off(raw: str) -> None:
    with pytest.raises(ValueError, match="SHOAL_FAULTS"):
        parse_faults(raw)


def test_a_failing_invocation_fails_at_one_of_its_steps() -> None:
    # Given a switch that fails every invocation
    faults = Faults(1.0, random.Random(1))
    # Then each plan names one of the steps, and over many plans every step comes up
    steps = {faults.plan(ROUTER_STEPS).step for _ in range(300)}
    assert steps == set(ROUTER_STEPS)


def test_a_seed_makes_the_fates_reproducible() -> None:
    # Given two switches from the same seeded configuration
    config = Config.from_env({"SHOAL_FAULTS": "router=0.5,seed=9"})
    one, two = Faults.from_config(config, "router"), Faults.from_config(config, "router")
    # Then they decide the same, invocation by invocation
    fates = [(one.plan(ROUTER_STEPS).step, two.plan(ROUTER_STEPS).step) for _ in range(50)]
    assert all(a == b for a, b in fates)
    assert {a for a, _ in fates} != {None}
