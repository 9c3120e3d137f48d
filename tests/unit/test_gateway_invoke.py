"""In-process invocation: one invocation per execution environment at a time, as in Lambda."""

from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest
from shoal.declarations import Deployment, FunctionDef
from shoal.local.context import NotInvoked
from shoal.local.provision import LocalNames
from shoal.local.runtime import Functions

# Module-level state, as Powertools' resolver keeps the current event on a module object: a
# second invocation in the same environment would overwrite the first one's event.
_current: dict[str, Any] = {}


def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    _current["event"] = event
    barrier: threading.Barrier | None = event.get("barrier")
    if barrier is not None:
        barrier.wait(timeout=10)  # both invocations are inside the handler now
    return {
        "n": _current["event"]["n"],
        "function_name": context.function_name,
        "remaining_ms": context.get_remaining_time_in_millis(),
        "request_id": context.aws_request_id,
    }


@dataclass(frozen=True)
class _HandlerHere(FunctionDef):
    """A function whose handler is this test module's ``handler``."""

    @property
    def module(self) -> str:
        return __name__


FN = _HandlerHere(name="probe", handler="app.handler", timeout_s=3)


@pytest.fixture
def functions() -> Functions:
    deployment = Deployment(tables=(), buckets=(), functions=(FN,))
    return Functions(deployment, LocalNames.for_deployment(deployment))


def test_invoke_by_deployed_name_passes_event_and_context(functions: Functions) -> None:
    result = functions.invoke("shoal-probe", {"n": 1})
    assert result["n"] == 1
    assert result["function_name"] == "shoal-probe"
    assert 0 < result["remaining_ms"] <= 3000
    assert result["request_id"]


def test_unknown_function_name_is_refused(functions: Functions) -> None:
    with pytest.raises(KeyError):
        functions.invoke("shoal-nothing", {})


def test_concurrent_invocations_get_separate_environments(functions: Functions) -> None:
    # Given two invocations that are inside the handler at the same time
    barrier = threading.Barrier(2)
    # When both run
    with ThreadPoolExecutor(2) as pool:
        results = list(
            pool.map(lambda n: functions.invoke_def(FN, {"n": n, "barrier": barrier}), [1, 2])
        )
    # Then neither saw the other's event
    assert [r["n"] for r in results] == [1, 2]


def test_sequential_invocations_reuse_one_environment(functions: Functions) -> None:
    first = functions.invoke_def(FN, {"n": 1})
    second = functions.invoke_def(FN, {"n": 2})
    assert (first["n"], second["n"]) == (1, 2)
    assert functions._sandboxes["probe"].created == 1


def test_handler_exception_reaches_the_caller_and_frees_the_environment(
    functions: Functions,
) -> None:
    with pytest.raises(KeyError):
        functions.invoke_def(FN, {})  # no "n": the handler raises
    assert functions.invoke_def(FN, {"n": 3})["n"] == 3
    assert functions._sandboxes["probe"].created == 1


@pytest.fixture
def one_sandbox() -> Functions:
    deployment = Deployment(tables=(), buckets=(), functions=(FN,))
    return Functions(deployment, LocalNames.for_deployment(deployment), max_concurrency=1)


def test_an_invocation_waits_for_a_sandbox_until_its_deadline_and_then_never_runs(
    one_sandbox: Functions, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An API's request waits for a sandbox no longer than API Gateway waits for its
    integration: past its deadline it is refused (``NotInvoked``) and never runs later, where
    it would have spent a sandbox for a client that gave up long ago."""
    ran: list[int] = []
    gate, release = threading.Event(), threading.Event()

    def recorded(event: dict[str, Any], context: Any) -> dict[str, Any]:
        ran.append(event["n"])
        if event.get("hold"):
            gate.set()
            release.wait(timeout=10)
        return {"n": event["n"]}

    monkeypatch.setattr(sys.modules[__name__], "handler", recorded)
    with ThreadPoolExecutor(1) as pool:
        # Given the one sandbox busy
        holder = pool.submit(one_sandbox.invoke_def, FN, {"n": 0, "hold": True})
        assert gate.wait(timeout=10)
        # When another invocation's deadline passes while it waits
        with pytest.raises(NotInvoked):
            one_sandbox.invoke_def(FN, {"n": 1}, deadline=time.monotonic() + 0.2)
        release.set()
        assert holder.result(timeout=10) == {"n": 0}
    # Then it never ran, not even once the sandbox was free, and was not counted
    assert ran == [0]
    assert one_sandbox.invocations["probe"] == 1
    # and an invocation in time runs
    assert one_sandbox.invoke_def(FN, {"n": 2}, deadline=time.monotonic() + 5) == {"n": 2}


def test_an_invocation_whose_caller_has_gone_does_not_run(one_sandbox: Functions) -> None:
    with pytest.raises(NotInvoked):
        one_sandbox.invoke_def(FN, {"n": 1}, abandoned=lambda: True)
    assert one_sandbox.invocations["probe"] == 0
    # its sandbox is free again
    assert one_sandbox.invoke_def(FN, {"n": 2}, abandoned=lambda: False)["n"] == 2
