"""One lock around the emulated AWS backend.

moto applies a conditional write as read-check-write without a lock, so two racing writers can
both pass the condition (measured: 8 threads lost updates in 3 of 3 runs). DynamoDB never does
that, so every request to the emulator goes through ``BACKEND_LOCK``: the embedded server takes
it per request, and in-process tests take it through ``serialized_moto``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

BACKEND_LOCK = threading.RLock()


@contextmanager
def serialized_moto() -> Iterator[None]:
    """Serialize every request that moto's in-process stubber (``mock_aws``) answers."""
    from moto.core.botocore_stubber import BotocoreStubber

    original = BotocoreStubber.__call__

    def locked(self: Any, *args: Any, **kwargs: Any) -> Any:
        with BACKEND_LOCK:
            return original(self, *args, **kwargs)

    BotocoreStubber.__call__ = locked
    try:
        yield
    finally:
        BotocoreStubber.__call__ = original


class Turns:
    """Who goes first to the backend lock when calls queue for it.

    Deployed, DynamoDB serves every call at once; here one lock serves them one at a time, so a
    call waits behind every call queued before it. Under load most of that queue is long
    polls' looks (eventually consistent queries that ask whether anything is new): in the
    200-client soak, 45 of the 85 threads waiting for the lock at minute 10, so a push, an ack
    or a publish waited behind them, and a push's frame reached its client after 27 s at the
    median against 5.6 s for a long poll's delivery. A call that may be late by its nature
    (``take_late``) lets the calls that are waiting go first, for at most ``DEFER_MAX_S``; the
    others count themselves while they wait (``pressing``). Without a queue nothing waits."""

    def __init__(self) -> None:
        self._changed = threading.Condition(threading.Lock())
        self._pressing = 0

    @contextmanager
    def pressing(self) -> Iterator[None]:
        """Around a call's wait for the lock: deferring calls wait while any is in here."""
        with self._changed:
            self._pressing += 1
        try:
            yield
        finally:
            with self._changed:
                self._pressing -= 1
                if not self._pressing:
                    self._changed.notify_all()

    def take_late(self, lock: Any, timeout: float) -> bool:
        """``lock`` (``acquire``'s ``timeout``) for a call that may be late: while other calls
        wait for it, and for at most ``DEFER_MAX_S``, it waits for them to have gone first,
        and gives the lock back if it got it while one waits."""
        until = time.monotonic() + DEFER_MAX_S
        while True:
            left = until - time.monotonic()
            if self._pressing and left > 0:
                with self._changed:
                    self._changed.wait_for(lambda: not self._pressing, timeout=left)
            if not lock.acquire(timeout=timeout):
                return False
            if not self._pressing or time.monotonic() >= until:
                return True
            lock.release()


#: the longest an eventually consistent read lets other calls go first (``Turns``): a long
#: poll's look then answers at most this much later a query, under load only
DEFER_MAX_S = 0.25
TURNS = Turns()
