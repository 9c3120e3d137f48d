"""The ordered drain's gate of push subscriptions (``shoal.drain``): whether a push tap may
hand an ordered subscription records of a storage topic after the first."""

from __future__ import annotations

from collections.abc import Callable

from shoal.composite.model import storage_of, stream_name
from shoal.core.clock import Clock, SystemClock
from shoal.core.config import Config
from shoal.drain import DrainStore

#: a push subscription that began reading a storage topic less than this after its sealer began
#: counts as having begun after the seal (clock skew between the reaper and the push admin)
START_MARGIN_MS = 5_000


def push_consumer(name: str, incarnation: str, generation: int) -> str:
    """The drain's name of one reading of a push subscription: a seek (a new generation) takes
    the earlier storage topics' seals again, and a subscription made again under its name
    starts afresh."""
    return f"{name}#{incarnation}#{generation}"


class PushGate:
    """Whether a push subscription may take records of a storage topic after the first.

    A push tap reads its storage stream itself (not the router's inboxes), so the gate asks
    about the subscription's own reading: T(j) is open for it once, for every earlier storage
    topic T(i), its tap took the seal of every shard for it (``DrainStore.mark_passed``), or it
    began reading T(i) after the sealer began (a subscription made, or moved by a seek, after
    the seal reads nothing of T(i) it could put out of order, and may never see the seal).
    True is cached forever per (consumer, storage topic); a seal, once recorded, never changes.
    """

    def __init__(self, store: DrainStore, clock: Clock, stream_prefix: str) -> None:
        self.store = store
        self.clock = clock
        self.stream_prefix = stream_prefix
        #: sealed storage topics: (shards, sealed_at)
        self._sealed: dict[str, tuple[tuple[str, ...], int]] = {}
        #: (consumer, earlier stream) found passed
        self._passed: set[tuple[str, str]] = set()
        self.reads = 0

    @classmethod
    def from_config(cls, config: Config, clock: Clock | None = None) -> PushGate:
        return cls(DrainStore.from_config(config), clock or SystemClock(), config.stream_prefix)

    def admits(self, consumer: str, stream: str, start_ms: Callable[[str], int]) -> bool:
        """True if ``consumer`` may take records of ``stream``; ``start_ms(earlier)`` is when
        it began reading an earlier storage stream (asked only while that is not known passed)."""
        storage = storage_of(stream, self.stream_prefix)
        if storage is None:
            return True
        topic, index = storage
        for earlier_index in range(index):
            earlier = stream_name(self.stream_prefix, topic, earlier_index)
            if (consumer, earlier) in self._passed:
                continue
            if not self._passed_now(consumer, earlier, start_ms):
                return False
            self._passed.add((consumer, earlier))
        return True

    def _passed_now(self, consumer: str, stream: str, start_ms: Callable[[str], int]) -> bool:
        sealed = self._sealed.get(stream)
        if sealed is None:
            self.reads += 1
            record = self.store.record(stream)
            if record.sealed is None:
                return False
            sealed = self._sealed[stream] = (record.sealed, record.sealed_at or 0)
        shards, sealed_at = sealed
        if sealed_at < start_ms(stream) + START_MARGIN_MS:
            return True
        self.reads += 1
        return set(shards) <= self.store.passed(stream, consumer)
