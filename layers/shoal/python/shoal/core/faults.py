"""Fault injection: a function invocation that fails on purpose, at a random step.

Off unless ``SHOAL_FAULTS`` names the function (``router=0.25``: a quarter of the router's
invocations fail; ``Config.faults``; ``seed=N`` makes the sequence of fates reproducible).
Each failing invocation picks one of its steps at random and raises ``InjectedFault`` there,
so every crash point a real failure can hit (before or after the archive, the inbox writes,
the event flush) is exercised: the retried invocation must then repair it. Never set in a
deployment; ``shoal dev`` passes its environment through.

``SHOAL_CRASH_AT=<function>:<step>`` (``Config.crash_at``) is harder: the whole process exits
at that step, as under kill -9 (no exception handler, no flush), so an end-to-end test can
restart ``shoal dev`` and time how long a client's retry takes to be answered.
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Sequence

from shoal.core.config import Config

#: the router's steps, in the order an invocation passes them
ROUTER_STEPS = (
    "before_archive",
    "after_archive",
    "before_inbox",
    "after_inbox",
    "before_events",
    "after_events",
)


#: the publish path's steps a crash test can stop the process at
PUBLISH_STEPS = ("after_reserve", "after_put")
#: the exit status of a process killed by SIGKILL, as a shell reports it
KILLED = 137


class InjectedFault(RuntimeError):
    """An invocation failed on purpose (``SHOAL_FAULTS``)."""


class FaultPlan:
    """One invocation's fate: the step it fails at, or None."""

    def __init__(self, step: str | None) -> None:
        self.step = step

    def at(self, step: str) -> None:
        if step == self.step:
            raise InjectedFault(f"injected fault at {step}")


class Faults:
    """Per function: the probability an invocation fails, and its random source."""

    def __init__(self, probability: float = 0.0, rng: random.Random | None = None) -> None:
        self.probability = probability
        self._rng = rng or random.Random()
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, config: Config, function: str) -> Faults:
        seed = config.faults.get("seed")
        rng = random.Random(int(seed)) if seed is not None else None
        return cls(config.faults.get(function, 0.0), rng)

    def plan(self, steps: Sequence[str]) -> FaultPlan:
        if self.probability <= 0:
            return FaultPlan(None)
        with self._lock:
            if self._rng.random() >= self.probability:
                return FaultPlan(None)
            return FaultPlan(self._rng.choice(list(steps)))


class CrashPoint:
    """The step of one function where the process dies on purpose (``SHOAL_CRASH_AT``)."""

    def __init__(self, step: str | None = None) -> None:
        self.step = step

    @classmethod
    def from_config(cls, config: Config, function: str) -> CrashPoint:
        name, _, step = config.crash_at.partition(":")
        return cls(step if name == function and step else None)

    def at(self, step: str) -> None:
        if step == self.step:
            os._exit(KILLED)
