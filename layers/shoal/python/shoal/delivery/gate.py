"""The drain's gate for a session's get: an inbox item of a later storage topic waits until
the session has handed out everything of the earlier ones (``shoal.drain``)."""

from __future__ import annotations

from collections.abc import Iterable

from shoal.aws.dynamo import Dynamo, to_item
from shoal.composite.model import (
    storage_of,
    stream_name,
)
from shoal.core.clock import Clock, SystemClock
from shoal.core.config import Config
from shoal.delivery.inbox import DeliveryState, InboxItem
from shoal.delivery.model import item_key, source_id
from shoal.drain import SOURCE_END, DrainStore, DrainView

#: sessions whose gates this container remembers open (each a few hundred bytes); past it the
#: older half is forgotten, and asked again (one query each) if it comes back
OPENED_MEMORY = 50_000


class SessionGate:
    """Whether a session's get may hand out an inbox item (``shoal.delivery``)."""

    def __init__(self, view: DrainView, dynamo: Dynamo, table: str, stream_prefix: str) -> None:
        self.view = view
        self.dynamo = dynamo
        self.table = table
        self.stream_prefix = stream_prefix
        #: (session id, composite topic): the storage topics the session has passed, as found
        #: here. A session's state remembers them once a get writes it, but a session that is
        #: pushed only QoS 0 frames has no state written, and would query its gate at every
        #: push after a switch. Passing is forever: nothing is routed into a drained storage
        #: topic, and a new session has another id
        self._passed: dict[tuple[str, str], int] = {}
        #: (composite topic, storage topics passed): their inbox sources (``passed_sources``)
        self._passed_sources: dict[tuple[str, int], frozenset[str]] = {}

    @classmethod
    def from_config(cls, config: Config, clock: Clock | None = None) -> SessionGate:
        store = DrainStore.from_config(config)
        return cls(
            DrainView(store, clock or SystemClock()),
            store.dynamo,
            store.table,
            config.stream_prefix,
        )

    def admits(self, session_id: str, state: DeliveryState, item: InboxItem) -> bool:
        """True if the item's storage topic is open for the session. Moves ``state.drained``
        (written with the state) when the session has passed a drained storage topic."""
        return item.stream is None or self.opens(session_id, state, item.stream)

    def opens(self, session_id: str, state: DeliveryState, stream: str) -> bool:
        """True if the storage topic ``stream`` is open for the session: every earlier one of
        its composite topic is drained and handed out to it (``admits``). Also asked for what
        no item holds: a QoS 0 frame the router sent without writing it (``shoal.edge.push``)."""
        storage = storage_of(stream, self.stream_prefix)
        if storage is None:
            return True
        topic, index = storage
        known = (session_id, topic)
        passed = self._passed_count(session_id, state, topic)
        if passed > state.drained.get(topic, 0):
            state.drained[topic] = passed
        while passed < index:
            earlier = stream_name(self.stream_prefix, topic, passed)
            shards = self.view.sealed_shards(earlier)
            if shards is None or not self._handed_out(session_id, state, earlier, shards):
                return False
            passed += 1
            state.drained[topic] = passed
            self._remember(known, passed)
        return True

    def passed(self, session_id: str, state: DeliveryState | None, stream: str) -> bool:
        """True if the session has passed the storage topic ``stream``: every message of it was
        handed out and the gate let a later storage topic's out. A QoS 0 frame of ``stream``
        still in a push (``shoal.edge.push``) would now come after those; the frame is not in
        the inbox, so the gate could not wait for it. No read: what the state (None: not
        read) and this container remember."""
        storage = storage_of(stream, self.stream_prefix)
        if storage is None:
            return False
        topic, index = storage
        return self._passed_count(session_id, state, topic) > index

    def _passed_count(self, session_id: str, state: DeliveryState | None, topic: str) -> int:
        """How many of ``topic``'s storage topics the session has passed, as its state (None:
        not read) or this container remembers it."""
        noted = state.drained.get(topic, 0) if state is not None else 0
        return max(noted, self._passed.get((session_id, topic), 0))

    def precedes(self, stream: str | None, later: str | None) -> bool:
        """True if ``stream`` is an earlier storage topic of ``later``'s composite topic: its
        messages all come before ``later``'s, whatever their positions. No read."""
        if stream is None or later is None:
            return False
        a = storage_of(stream, self.stream_prefix)
        b = storage_of(later, self.stream_prefix)
        return a is not None and b is not None and a[0] == b[0] and a[1] < b[1]

    def first(self, stream: str) -> bool:
        """True if ``stream`` is its composite topic's first storage topic (or none): its gate
        is open for every session, with nothing to read."""
        storage = storage_of(stream, self.stream_prefix)
        return storage is None or storage[1] == 0

    def passed_sources(self, state: DeliveryState) -> frozenset[str]:
        """The inbox sources of every storage topic the session has passed (``state.drained``):
        sealed, routed to the end and handed out to it, so nothing comes to them again. Read
        from this container's cache of drained topics (``DrainView``), which those are in."""
        if not state.drained:
            return frozenset()
        sources: set[str] = set()
        for topic, passed in state.drained.items():
            known = self._passed_sources.get((topic, passed))
            if known is None:
                found: set[str] = set()
                for index in range(passed):
                    stream = stream_name(self.stream_prefix, topic, index)
                    shards = self.view.sealed_shards(stream) or ()
                    found.update(source_id(stream, s) for s in shards)
                known = self._passed_sources[(topic, passed)] = frozenset(found)
            sources |= known
        return frozenset(sources)

    def _remember(self, known: tuple[str, str], passed: int) -> None:
        if len(self._passed) >= OPENED_MEMORY:
            for stale in list(self._passed)[: OPENED_MEMORY // 2]:
                del self._passed[stale]
        self._passed[known] = passed

    def _handed_out(
        self, session_id: str, state: DeliveryState, stream: str, shards: Iterable[str]
    ) -> bool:
        """Whether every message of ``stream`` in the session's inbox was handed out."""
        for shard in shards:
            source = source_id(stream, shard)
            if source in state.partial:
                return False  # the cursor sits inside an item with more after it
            rows = self.dynamo.query(
                self.table,
                KeyConditionExpression="#p = :p AND #k BETWEEN :a AND :b",
                ExpressionAttributeNames={"#p": "inbox", "#k": "position"},
                ExpressionAttributeValues=to_item(
                    {
                        ":p": session_id,
                        # after the cursor's item key: an item starting after the cursor
                        ":a": item_key(source, state.cursors.get(source, "")) + "\x00",
                        ":b": item_key(source, SOURCE_END),
                    }
                ),
                ProjectionExpression="#k",
                ConsistentRead=True,
                Limit=1,
            )
            if rows:
                return False
        return True
