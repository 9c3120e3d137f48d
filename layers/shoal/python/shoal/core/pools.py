"""Threads kept across invocations: a warm Lambda environment runs its next invocation on the
threads the last one started, as it keeps its clients.

A ``ThreadPoolExecutor`` made per call starts its threads on every invocation, and each start
waits until the new thread has run (it must take the GIL from whatever else runs). Deployed
that is tens of microseconds a thread; under ``shoal dev``, where one process runs every
function, it waited up to the interpreter's switch interval (5 ms) a thread, twice an
invocation for the pusher, in front of its first post.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TypeVar

T = TypeVar("T")


class Pools:
    """A pool of ``size`` threads for each thread that asks, made on its first use. One per
    invoking thread, not one shared: ``shoal dev`` runs a function's invocations side by side
    in one process, and each keeps its own ``size`` (as each Lambda environment does)."""

    def __init__(self, size: int, prefix: str) -> None:
        self.size = max(1, size)
        self.prefix = prefix
        self._local = threading.local()

    def each(self, step: Callable[[T], None], items: Sequence[T]) -> None:
        """``step`` on every item, ``size`` at a time; the first error raised after all ran.
        One item runs on the caller's thread. Each step runs in a copy of the caller's
        context (an invocation's metrics and logger keys go with it)."""
        if len(items) == 1:
            step(items[0])
            return
        pool: ThreadPoolExecutor | None = getattr(self._local, "pool", None)
        if pool is None:
            pool = self._local.pool = ThreadPoolExecutor(self.size, thread_name_prefix=self.prefix)
        futures = [pool.submit(contextvars.copy_context().run, step, i) for i in items]
        # every step runs to its end before the first error is raised
        wait(futures)
        for done in futures:
            done.result()
