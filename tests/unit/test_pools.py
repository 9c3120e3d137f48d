"""``shoal.core.pools``: the pusher's threads kept from one invocation to the next."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from shoal.core.pools import Pools


def _threads(pools: Pools, items: list[int]) -> set[threading.Thread]:
    """The threads that ran the steps (the objects: an ended thread's ident can come again)."""
    seen: set[threading.Thread] = set()
    lock = threading.Lock()

    def step(_: int) -> None:
        with lock:
            seen.add(threading.current_thread())

    pools.each(step, items)
    return seen


def test_a_callers_second_batch_runs_on_the_threads_of_its_first() -> None:
    """A warm environment's next invocation starts no thread: the same ones take it. Each
    batch's steps wait for one another, so a batch takes all three threads."""
    pools = Pools(3, "shoal-test")

    def batch() -> set[threading.Thread]:
        met = threading.Barrier(3, timeout=10)
        seen: set[threading.Thread] = set()

        def step(_: int) -> None:
            seen.add(threading.current_thread())
            met.wait()

        pools.each(step, [1, 2, 3])
        return seen

    first = batch()
    assert len(first) == 3
    assert threading.current_thread() not in first
    assert batch() == first


def test_callers_side_by_side_each_get_their_own_pool() -> None:
    """``shoal dev`` runs invocations side by side in one process: each keeps its ``size``."""
    pools = Pools(2, "shoal-test")
    got: dict[str, set[threading.Thread]] = {}

    def invocation(name: str) -> None:
        got[name] = _threads(pools, list(range(6))) | _threads(pools, list(range(6)))

    callers = [threading.Thread(target=invocation, args=(n,)) for n in ("a", "b")]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert got["a"] and got["b"]
    assert not got["a"] & got["b"]
    assert len(got["a"]) <= 2 and len(got["b"]) <= 2


def test_one_item_runs_on_the_callers_thread_and_errors_come_after_every_step() -> None:
    pools = Pools(4, "shoal-test")
    assert _threads(pools, [1]) == {threading.current_thread()}
    ran: list[int] = []

    def step(n: Any) -> None:
        if n == 0:
            raise RuntimeError("first")
        threading.Event().wait(0.01)
        ran.append(n)

    with pytest.raises(RuntimeError, match="first"):
        pools.each(step, list(range(6)))
    assert sorted(ran) == [1, 2, 3, 4, 5]
