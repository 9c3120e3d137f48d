"""The publishers' view of composite topics: a per-container cache, fresh within a second.

Publishers cache topics for ``TOPIC_CACHE_TTL_MS``. So that a cached copy can never route a
message differently from a fresh one, every change that moves where messages go (a new topic
becoming visible, SwitchProduce) takes effect at ``effective_at_ms``, ``EFFECTIVE_DELAY_MS``
after it is written, and publishers apply it by their clock: every container switches at the
same instant (up to clock skew, bounded by the margin between the delay and the TTL).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from shoal.composite.model import (
    DEFAULT_TOPIC,
    TOPIC_CACHE_TTL_MS,
    CompositeTopic,
    Destination,
    is_valid_topic_name,
)
from shoal.composite.store import TopicStore
from shoal.core.clock import Clock
from shoal.core.errors import TopicNotFound
from shoal.topics.filters import first_level

#: entries a publisher caches at most (one per first level it has seen)
MAX_CACHED = 10_000


class TopicDirectory:
    """A publisher container's cache of composite topics, fresh within TOPIC_CACHE_TTL_MS.

    Misses are read strongly consistent in one BatchGetItem for the first level and `default`
    together, so most publishes of a warm container read no metadata at all.
    """

    def __init__(self, store: TopicStore, clock: Clock, ttl_ms: int = TOPIC_CACHE_TTL_MS) -> None:
        self.store = store
        self.clock = clock
        self.ttl_ms = ttl_ms
        self._entries: dict[str, tuple[int, CompositeTopic | None]] = {}

    def destinations(self, mqtt_topics: Sequence[str]) -> list[Destination | TopicNotFound]:
        now = self.clock.now_ms()
        wanted = {DEFAULT_TOPIC}
        for t in mqtt_topics:
            candidate = first_level(t)
            if is_valid_topic_name(candidate):
                wanted.add(candidate)
        self._refresh([n for n in wanted if not self._fresh(n, now)], now)
        default = self._entries[DEFAULT_TOPIC][1]
        out: list[Destination | TopicNotFound] = []
        for t in mqtt_topics:
            candidate = first_level(t)
            entry = self._entries.get(candidate) if is_valid_topic_name(candidate) else None
            chosen = entry[1] if entry else None
            storage = chosen.producing(now) if chosen else None
            if chosen is None or storage is None:
                chosen, storage = default, default.producing(now) if default else None
            if chosen is None or storage is None:
                out.append(TopicNotFound("no topic for this name and no `default` topic"))
            else:
                out.append(Destination(chosen, storage))
        return out

    def topic(self, name: str) -> CompositeTopic | None:
        """A cached topic (refreshed when stale), for reading back where a message went."""
        now = self.clock.now_ms()
        if not self._fresh(name, now):
            self._refresh([name], now)
        return self._entries[name][1]

    def _fresh(self, name: str, now: int) -> bool:
        entry = self._entries.get(name)
        return entry is not None and now - entry[0] < self.ttl_ms

    def _refresh(self, names: Iterable[str], read_at: int) -> None:
        names = list(names)
        if not names:
            return
        if len(self._entries) + len(names) > MAX_CACHED:
            self._entries.clear()
        found = self.store.load_many(names)
        for name in names:
            # read_at was taken before the read, so an entry never looks fresher than it is
            self._entries[name] = (read_at, found.get(name))
