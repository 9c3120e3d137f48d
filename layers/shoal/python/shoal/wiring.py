"""The wiring root: where services are composed from ``Config``.

Handlers, ``shoal dev``, tests and benchmarks build their services here, so that the way a
service is put together (its stores, clients, clock and hooks) is written once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from shoal.core.config import Config, get_config

T = TypeVar("T")


class PerConfig(Generic[T]):
    """One object per configuration: a container builds its service (clients, caches) once.

    Tests that load a new configuration (``get_config.cache_clear()``) get a fresh object.
    """

    def __init__(self, factory: Callable[[Config], T]) -> None:
        self._factory = factory
        self._lock = threading.Lock()
        self._held: tuple[Config, T] | None = None

    def __call__(self) -> T:
        config = get_config()
        with self._lock:
            if self._held is None or self._held[0] is not config:
                self._held = (config, self._factory(config))
            return self._held[1]
