"""One lock around the emulated AWS backend.

moto applies a conditional write as read-check-write without a lock, so two racing writers can
both pass the condition (measured: 8 threads lost updates in 3 of 3 runs). DynamoDB never does
that, so every request to the emulator goes through ``BACKEND_LOCK``: the embedded server takes
it per request, and in-process tests take it through ``serialized_moto``.
"""

from __future__ import annotations

import threading
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
