"""The wiring root: where services are composed from ``Config``.

Handlers, ``shoal dev``, tests and benchmarks build their services here, so that the way a
service is put together (its stores, clients, clock and hooks) is written once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from shoal.aws.kinesis import Streams
from shoal.composite.directory import TopicDirectory
from shoal.composite.service import TopicService
from shoal.composite.store import TopicStore
from shoal.core.clock import Clock, SystemClock
from shoal.core.config import Config, get_config
from shoal.push.admin import TapHooks

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


def topic_service(
    config: Config, clock: Clock | None = None, *, stream_wait_s: float = 20.0
) -> TopicService:
    """Composite topics' admin, with the push subscriptions' taps following their changes.

    ``stream_wait_s``: how long a request waits for a new stream to become active (Kinesis
    takes ~30 s); an API request gives up in time to answer 503 within API Gateway's 30 s and
    repeating it completes the topic, the deploy-time bootstrap can wait longer.
    """
    clock = clock or SystemClock()
    streams = Streams.from_config(config, clock)
    return TopicService(
        config,
        TopicStore.from_config(config),
        streams,
        clock,
        hooks=TapHooks(config, streams, clock),
        stream_wait_s=stream_wait_s,
    )


def topic_directory(config: Config, clock: Clock) -> TopicDirectory:
    return TopicDirectory(TopicStore.from_config(config), clock)
