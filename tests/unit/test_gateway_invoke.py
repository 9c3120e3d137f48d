"""In-process invocation: one invocation per execution environment at a time, as in Lambda."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest
from shoal.declarations import Deployment, FunctionDef
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
