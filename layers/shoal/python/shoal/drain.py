"""Ordered drain across storage topics: seals, drained shards, and the gates of the readers.

After SwitchProduce from T(j-1) to T(j) a key's older messages sit in T(j-1) and its newer ones
in T(j); the router consumes every storage shard on its own, so without a gate a reader could
hand out a T(j) message of a key before that key's last T(j-1) message. The drain closes it:

- **Seal.** Once the switch is in effect and every put that could still land in T(j-1) is over
  (``effective_at_ms`` plus ``seal_grace_ms()``: ``ROUTED_PUT_BOUND_MS``, the longest a put can
  take after its publisher chose the storage topic, which the publish path enforces, plus the
  clock-skew margin: 11 s), the switch-produce call itself (``Sealer.seal_behind``, waiting
  those seconds), or failing that the reaper's next run, puts a *seal record* into every shard
  of T(j-1) (ExplicitHashKey = the shard's starting hash key), then records the shards as sealed.
  A seal holds no message (``{"seal":...,"v":1,"m":[]}``): ``publishing.decode_record`` answers
  no message for it, so the archive, the pipeline and push taps count nothing. A crash before
  the record is written makes the next run seal again; a second seal in a shard is harmless.
- **Drained.** The router, after it wrote the deliveries of a batch holding a seal (everything
  before the seal in that shard is written by then: one batch at a time per shard), adds the
  shard to the storage topic's drained set (an idempotent ``ADD``). A storage topic is *fully
  drained* once it is sealed and every sealed shard is drained; readers cache that forever.
  The marks live in the inboxes table (``drain#<stream>``), off the publishers' path.
- **Sessions** (``SessionGate``): an inbox item of T(j) (the router labels items of storage
  topics after the first with their stream) is handed out only once T(0..j-1) are fully
  drained and the session has been handed every message of theirs; the session's delivery
  state then remembers ``drained[topic] = j`` so the steady state reads nothing more.
- **Shared groups** (``shoal.groups.gate.GroupGate``): a group stream of T(j) yields nothing
  until, for every earlier storage topic, it is fully drained and each of the group's streams of
  it has handed out its last message and has nothing in flight (all acked): another member may
  hold those.
- **Push subscriptions** (``shoal.push.gate.PushGate``): the T(j) tap takes nothing for an
  ordered subscription until its own taps passed the seal of every shard of T(0..j-1) for it
  (``mark_passed``), or it began reading T(i) after the sealer began; ``shoal.push.main_queue``
  holds the batch meanwhile. A tap passes a seal only while it runs one lane (another lane may
  hold earlier records), as the tap of a storage topic behind the produce pointer is made to
  (``shoal.push.admin``).

The router itself never waits: gating is on the read side, so no retry budget is spent on it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from shoal.aws import tables
from shoal.aws.dynamo import Dynamo, to_item
from shoal.aws.kinesis import OutRecord, Streams
from shoal.composite.model import (
    EFFECTIVE_DELAY_MS,
    ROUTED_PUT_BOUND_MS,
    TOPIC_CACHE_TTL_MS,
    CompositeTopic,
    storage_of,
    stream_name,
)
from shoal.core.clock import Clock, SystemClock
from shoal.core.config import Config
from shoal.core.observability import logger
from shoal.records import is_seal, seal_record

#: the drain record of a storage topic in the inboxes table
DRAIN_PREFIX = "drain#"
DRAIN_ITEM = "#drain"
#: a push consumer's seal marks of a stream (same partition as its drain record)
PASSED_ITEM = "#push#"
#: sorts after every position of a source (positions are digits and dots)
SOURCE_END = "~"
#: a reader asks again at most this often whether a storage topic is drained (while it is not)
RECHECK_MS = 1_000


# --- seal records (no AWS here) ----------------------------------------------------------------


def seal_grace_ms(override_s: float | None = None) -> int:
    """How long after a switch is in effect a put routed before it may still land.

    Every put into a storage topic goes through the publish path (publish, and the reaper's
    wills), which ends it within ``ROUTED_PUT_BOUND_MS`` of choosing the storage topic; a
    publisher chose the old one only before the switch was in effect by its own clock, hence
    the margin for clock skew (the delay's margin over the cache TTL).
    """
    if override_s is not None:
        return int(override_s * 1000)
    return ROUTED_PUT_BOUND_MS + EFFECTIVE_DELAY_MS - TOPIC_CACHE_TTL_MS


def due(topic: CompositeTopic, now_ms: int, grace_ms: int) -> list[int]:
    """The storage topics of ``topic`` that may be sealed at ``now_ms``: those before the
    produce pointer, once the last switch is in effect and its grace is over (an earlier
    switch was in effect before the last one was written)."""
    if topic.produce_pointer < 1 or now_ms < topic.effective_at_ms + grace_ms:
        return []
    return list(range(topic.produce_pointer))


# --- the drain records -------------------------------------------------------------------------


@dataclass(frozen=True)
class DrainRecord:
    #: the shards sealed (all of the stream's), None until the sealer finished
    sealed: tuple[str, ...] | None = None
    drained: frozenset[str] = frozenset()
    #: the sealer's time just before it put the seals (None until sealed)
    sealed_at: int | None = None

    @property
    def fully_drained(self) -> bool:
        return self.sealed is not None and set(self.sealed) <= self.drained


def drain_key(stream: str) -> dict[str, str]:
    return {"inbox": DRAIN_PREFIX + stream, "position": DRAIN_ITEM}


class DrainStore:
    """Per storage topic: the shards sealed (by the sealer) and drained (by the router)."""

    def __init__(self, dynamo: Dynamo, table: str) -> None:
        self.dynamo = dynamo
        self.table = table

    @classmethod
    def from_config(cls, config: Config) -> DrainStore:
        return cls(Dynamo.from_config(config), config.table(tables.INBOXES))

    def record(self, stream: str) -> DrainRecord:
        raw = self.dynamo.get(self.table, drain_key(stream))
        if raw is None:
            return DrainRecord()
        sealed = raw.get("sealed")
        return DrainRecord(
            sealed=tuple(str(s) for s in sealed) if sealed is not None else None,
            drained=frozenset(str(s) for s in raw.get("drained") or ()),
            sealed_at=int(raw["sealed_at"]) if raw.get("sealed_at") is not None else None,
        )

    def mark_sealed(self, stream: str, shards: Iterable[str], at_ms: int) -> None:
        """Every shard of ``stream`` holds a seal (the first record of it stays)."""
        self.dynamo.call(
            "update_item",
            TableName=self.table,
            Key=to_item(drain_key(stream)),
            UpdateExpression="SET #s = if_not_exists(#s, :s), #a = if_not_exists(#a, :a)",
            ExpressionAttributeNames={"#s": "sealed", "#a": "sealed_at"},
            ExpressionAttributeValues=to_item({":s": sorted(shards), ":a": at_ms}),
        )

    def mark_drained(self, stream: str, shard: str) -> None:
        """The router routed ``shard``'s seal; idempotent (a set)."""
        self.dynamo.call(
            "update_item",
            TableName=self.table,
            Key=to_item(drain_key(stream)),
            UpdateExpression="ADD #d :d",
            ExpressionAttributeNames={"#d": "drained"},
            ExpressionAttributeValues=to_item({":d": {shard}}),
        )

    def mark_passed(self, stream: str, consumer: str, shard: str) -> None:
        """A push tap took ``shard``'s seal for ``consumer``; idempotent (a set)."""
        self.dynamo.call(
            "update_item",
            TableName=self.table,
            Key=to_item(passed_key(stream, consumer)),
            UpdateExpression="ADD #p :p",
            ExpressionAttributeNames={"#p": "passed"},
            ExpressionAttributeValues=to_item({":p": {shard}}),
        )

    def passed(self, stream: str, consumer: str) -> frozenset[str]:
        """The shards of ``stream`` whose seal a push tap took for ``consumer``."""
        raw = self.dynamo.get(self.table, passed_key(stream, consumer))
        return frozenset(str(s) for s in (raw or {}).get("passed") or ())


def passed_key(stream: str, consumer: str) -> dict[str, str]:
    """A push consumer's seal marks of ``stream``: beside the stream's drain record."""
    return {"inbox": DRAIN_PREFIX + stream, "position": f"{PASSED_ITEM}{consumer}"}


class DrainView:
    """A container's cache of which storage topics are fully drained: true stays true forever
    (nothing is routed into a drained storage topic), false is asked again after RECHECK_MS."""

    def __init__(self, store: DrainStore, clock: Clock) -> None:
        self.store = store
        self.clock = clock
        self._drained: dict[str, tuple[str, ...]] = {}
        self._not_yet: dict[str, int] = {}
        self.reads = 0

    def sealed_shards(self, stream: str) -> tuple[str, ...] | None:
        """The shards of ``stream`` if it is fully drained, else None."""
        known = self._drained.get(stream)
        if known is not None:
            return known
        now = self.clock.now_ms()
        if now - self._not_yet.get(stream, -RECHECK_MS) < RECHECK_MS:
            return None
        self.reads += 1
        record = self.store.record(stream)
        if record.fully_drained and record.sealed is not None:
            self._drained[stream] = record.sealed
            self._not_yet.pop(stream, None)
            return record.sealed
        self._not_yet[stream] = now
        return None


# --- the sealer (the reaper runs it) -----------------------------------------------------------


class Sealer:
    """Puts seals into the storage topics before each topic's produce pointer once due."""

    def __init__(
        self,
        streams: Streams,
        store: DrainStore,
        topics: Callable[[], Iterable[CompositeTopic]],
        clock: Clock | None = None,
        grace_ms: int | None = None,
    ) -> None:
        self.streams = streams
        self.store = store
        self.topics = topics
        self.clock = clock or SystemClock()
        self.grace_ms = seal_grace_ms() if grace_ms is None else grace_ms
        #: streams known sealed: never looked at again by this container
        self._sealed: set[str] = set()

    def run(self) -> int:
        """Seal what is due; how many storage topics were sealed by this run."""
        now = self.clock.now_ms()
        return sum(self._seal_due(topic, now) for topic in self.topics() if topic.created)

    def seal_behind(self, topic: CompositeTopic, max_wait_ms: int) -> int:
        """Just after ``topic``'s switch: wait until no put routed before it can still land,
        then seal the storage topics behind the pointer; how many were sealed. Waits at most
        ``max_wait_ms`` (the caller's budget): beyond, nothing, and the reaper seals later."""
        wait_ms = topic.effective_at_ms + self.grace_ms - self.clock.now_ms()
        if wait_ms > max_wait_ms:
            return 0
        if wait_ms > 0:
            self.clock.sleep(wait_ms / 1000)
        return self._seal_due(topic, self.clock.now_ms())

    def _seal_due(self, topic: CompositeTopic, now: int) -> int:
        sealed = 0
        for index in due(topic, now, self.grace_ms):
            storage = topic.storage_topics[index]
            if storage.stream in self._sealed:
                continue
            if self.store.record(storage.stream).sealed is not None:
                self._sealed.add(storage.stream)
                continue
            if self.seal(storage.stream):
                sealed += 1
        return sealed

    def seal(self, stream: str) -> bool:
        """A seal into every open shard, then the mark; False (try again later) if a put failed.

        Repeating it is harmless: the router marks a shard drained once however many seals it
        holds."""
        now = self.clock.now_ms()
        shards = _open_shards(self.streams, stream)
        for shard_id, start in shards:
            outcome = self.streams.put_record(
                stream, OutRecord(seal_record(stream, shard_id, now), "seal", start)
            )
            if not outcome.ok:
                logger.warning("seal not written", extra={"stream": stream, "shard": shard_id})
                return False
        self.store.mark_sealed(stream, [s for s, _ in shards], now)
        self._sealed.add(stream)
        logger.info("storage topic sealed", extra={"stream": stream, "shards": len(shards)})
        return True


def _open_shards(streams: Streams, stream: str) -> list[tuple[str, int]]:
    shards: list[dict[str, Any]] = []
    response: Any = streams.kinesis.list_shards(StreamName=stream)
    shards += response["Shards"]
    while response.get("NextToken"):
        response = streams.kinesis.list_shards(NextToken=response["NextToken"])
        shards += response["Shards"]
    return sorted(
        (
            (str(s["ShardId"]), int(s["HashKeyRange"]["StartingHashKey"]))
            for s in shards
            if "EndingSequenceNumber" not in s.get("SequenceNumberRange", {})
        ),
        key=lambda s: s[1],
    )


# --- the router's side -------------------------------------------------------------------------


class RouterDrain:
    """What the router does for the drain: labels and drained marks."""

    def __init__(self, store: DrainStore, stream_prefix: str, clock: Clock | None = None) -> None:
        self.store = store
        self.stream_prefix = stream_prefix
        #: which earlier storage topics are drained (``settled``): true is cached forever
        self.view = DrainView(store, clock or SystemClock())

    @classmethod
    def from_config(cls, config: Config, clock: Clock | None = None) -> RouterDrain:
        return cls(DrainStore.from_config(config), config.stream_prefix, clock)

    def label(self, stream: str) -> str | None:
        """The label of inbox items from ``stream``: the stream, when readers must gate it
        (a storage topic after the first); None otherwise (nothing stored)."""
        storage = storage_of(stream, self.stream_prefix)
        return stream if storage is not None and storage[1] > 0 else None

    def push_label(self, stream: str) -> str | None:
        """The label of a push's QoS 0 frames from ``stream``: the stream, for any storage
        topic, the first too. The pusher drops a frame of a storage topic the session has
        already passed (``SessionGate.passed``) or that its gate holds closed."""
        return stream if storage_of(stream, self.stream_prefix) is not None else None

    def settled(self, stream: str) -> bool:
        """Whether every storage topic before ``stream`` is fully drained. Until then the
        gates hold ``stream``'s items back, so a QoS 0 delivery of it to a connected session
        is written as any other (the gate hands it out in its key's order) rather than
        posted past what waits. One read a second at most while not (``DrainView``), none
        after."""
        storage = storage_of(stream, self.stream_prefix)
        if storage is None:
            return True
        topic, index = storage
        return all(
            self.view.sealed_shards(stream_name(self.stream_prefix, topic, earlier)) is not None
            for earlier in range(index)
        )

    def after_batch(self, stream: str, shard: str, records: Iterable[tuple[str, bytes]]) -> bool:
        """Called once a batch's deliveries are written: marks the shard drained if the batch
        held a seal. True if it did."""
        if not any(is_seal(data) for _, data in records):
            return False
        self.store.mark_drained(stream, shard)
        logger.info("storage shard drained", extra={"stream": stream, "shard": shard})
        return True


# --- the readers' gates ------------------------------------------------------------------------
