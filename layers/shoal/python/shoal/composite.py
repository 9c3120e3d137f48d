"""Composite topics (Varadhi): an ordered list of storage topics and a produce pointer.

A storage topic is a Kinesis stream of P shards with equal hash ranges. The router sends an
ordering key with stable 64-bit hash h to partition ``j = K*h % P + (h // P) % K``: with
B = P / K the topic's base partition count, ``j // K == h % B``, so a key stays in the same
block of partitions (and the same subscription shard for any S dividing B) in every storage
topic whose partitions grew by K. K follows the design: a new storage topic whose partition
count is a multiple of the previous base B gets ``K = new / B``, any other gets K = 1 (a new
base).

Metadata changes are conditional writes on the topic's version. Creating a topic or adding a
storage topic first records the storage topic as ``pending``, then creates its stream, the
router's event source mapping and the push taps of the topic's push subscriptions
(``shoal.push_admin.follow_storage_topic``; all idempotent), then moves it into
``storage_topics``; a crash
anywhere leaves a pending storage topic that repeating the request completes.

Publishers cache topics for ``TOPIC_CACHE_TTL_MS``. So that a cached copy can never route a
message differently from a fresh one, every change that moves where messages go (a new topic
becoming visible, SwitchProduce) takes effect at ``effective_at_ms``, ``EFFECTIVE_DELAY_MS``
after it is written, and publishers apply it by their clock: every container switches at the
same instant (up to clock skew, bounded by the margin between the delay and the TTL), and a
publisher that publishes m1 then m2 can never put m2 in an earlier storage topic than m1. The
admin call returns only once the change is in effect. A storage topic before the produce
pointer receives no record that was routed after ``effective_at_ms``; a put already routed may
still land up to one publish timeout later: the ordered drain (``shoal.drain``) seals a
storage topic only after that, and readers of a later storage topic wait for its seals.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pynamodb.exceptions import PutError, UpdateError

from shoal.aws import tables
from shoal.aws.kinesis import Streams, even_starting_keys
from shoal.aws.tables import StorageTopicAttr, TopicModel
from shoal.core.clock import Clock, SystemClock
from shoal.core.config import Config, get_config
from shoal.core.errors import (
    InvalidPartitions,
    InvalidTopicName,
    NoNextStorageTopic,
    ServerBusy,
    StorageTopicPending,
    TopicExists,
    TopicNotFound,
)
from shoal.core.observability import logger
from shoal.declarations import DEPLOYMENT
from shoal.topics.filters import first_level

DEFAULT_TOPIC = DEPLOYMENT.default_topic
TOPIC_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: Kinesis' default shard quota per account in the largest regions
MAX_PARTITIONS = 500
#: how long a publisher trusts its cached copy of a topic
TOPIC_CACHE_TTL_MS = 1_000
#: how long after it is written a routing change takes effect: the TTL plus a clock-skew margin
EFFECTIVE_DELAY_MS = 2_000
#: a bounded number of optimistic retries before a busy topic answers 503
_MAX_ATTEMPTS = 20
#: entries a publisher caches at most (one per first level it has seen)
_MAX_CACHED = 10_000


# -- pure rules -----------------------------------------------------------------------------


def is_valid_topic_name(name: object) -> bool:
    return isinstance(name, str) and TOPIC_NAME.fullmatch(name) is not None


def validate_topic_name(name: object) -> str:
    if not isinstance(name, str) or not is_valid_topic_name(name):
        raise InvalidTopicName("a topic name is 1-64 of A-Z a-z 0-9 _ -")
    return name


def is_valid_partitions(partitions: object) -> bool:
    if not isinstance(partitions, int) or isinstance(partitions, bool):
        return False
    if not 1 <= partitions <= MAX_PARTITIONS:
        return False
    return partitions <= 3 or partitions % 4 == 0 or partitions % 6 == 0


def validate_partitions(partitions: object) -> int:
    if not isinstance(partitions, int) or not is_valid_partitions(partitions):
        raise InvalidPartitions(
            f"partitions must be 1, 2, 3, or a multiple of 4 or 6, at most {MAX_PARTITIONS}",
            allowed="1, 2, 3, or a multiple of 4 or 6",
            maximum=MAX_PARTITIONS,
        )
    return partitions


def next_k(previous: StorageTopic | None, partitions: int) -> int:
    """K of a new storage topic of ``partitions`` appended after ``previous``."""
    if previous is None:
        return 1
    base = previous.partitions // previous.k
    return partitions // base if partitions % base == 0 else 1


def stable_hash(key: str) -> int:
    """A 64-bit hash of an ordering key, the same in every process and release."""
    return int.from_bytes(
        hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big"
    )


def route(h: int, partitions: int, k: int) -> int:
    """The partition of hash ``h`` in a storage topic of ``partitions`` partitions and ``k``."""
    return k * h % partitions + (h // partitions) % k


def subscription_shard(partition: int, partitions: int, shards: int) -> int:
    """The subscription shard (of ``shards``, dividing ``partitions``) reading ``partition``."""
    return partition // (partitions // shards)


def stream_name(prefix: str, topic: str, index: int) -> str:
    return f"{prefix}-{topic}-{index}"


# -- the topic ------------------------------------------------------------------------------


@dataclass(frozen=True)
class StorageTopic:
    index: int
    stream: str
    partitions: int
    k: int
    #: starting hash keys when the stream's split is not the even one
    hash_keys: tuple[int, ...] | None = None

    def partition_for(self, ordering_key: str) -> int:
        return route(stable_hash(ordering_key), self.partitions, self.k)

    def starting_key(self, partition: int) -> int:
        """ExplicitHashKey for ``partition``: its shard's starting hash key."""
        keys = self.hash_keys or even_starting_keys(self.partitions)
        return keys[partition]

    def document(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "stream": self.stream,
            "partitions": self.partitions,
            "k": self.k,
        }


@dataclass(frozen=True)
class CompositeTopic:
    name: str
    version: int
    produce_pointer: int
    storage_topics: tuple[StorageTopic, ...]
    pending: StorageTopic | None = None
    effective_at_ms: int = 0

    @property
    def created(self) -> bool:
        return bool(self.storage_topics)

    def producing(self, now_ms: int) -> StorageTopic | None:
        """The storage topic a publish at ``now_ms`` writes to; None before the topic exists."""
        if not self.storage_topics:
            return None
        if now_ms >= self.effective_at_ms:
            return self.storage_topics[self.produce_pointer]
        if self.produce_pointer == 0:
            return None
        return self.storage_topics[self.produce_pointer - 1]

    def storage_topic(self, stream: str) -> StorageTopic | None:
        return next((s for s in self.storage_topics if s.stream == stream), None)

    def document(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "produce_pointer": self.produce_pointer,
            "storage_topics": [s.document() for s in self.storage_topics],
        }


def _storage_from(attr: StorageTopicAttr) -> StorageTopic:
    keys = attr.hash_keys
    return StorageTopic(
        index=int(attr.index),
        stream=attr.stream,
        partitions=int(attr.partitions),
        k=int(attr.k),
        hash_keys=tuple(int(k) for k in keys) if keys else None,
    )


def _storage_attr(storage: StorageTopic) -> StorageTopicAttr:
    return StorageTopicAttr(
        index=storage.index,
        stream=storage.stream,
        partitions=storage.partitions,
        k=storage.k,
        hash_keys=[str(k) for k in storage.hash_keys] if storage.hash_keys else None,
    )


def _topic_from(model: TopicModel) -> CompositeTopic:
    return CompositeTopic(
        name=model.name,
        version=int(model.version),
        produce_pointer=int(model.produce_pointer),
        storage_topics=tuple(_storage_from(a) for a in model.storage_topics or []),
        pending=_storage_from(model.pending) if model.pending is not None else None,
        effective_at_ms=int(model.effective_at_ms or 0),
    )


def load_topic(name: str, *, consistent: bool = True) -> CompositeTopic | None:
    try:
        return _topic_from(TopicModel.get(name, consistent_read=consistent))
    except TopicModel.DoesNotExist:
        return None


def scan_topics() -> Iterator[CompositeTopic]:
    """Every topic, created or not (a scan: for the reaper's sealer, never a request path)."""
    return (_topic_from(m) for m in TopicModel.scan())


def _conditional_failed(exc: PutError | UpdateError) -> bool:
    return exc.cause_response_code == "ConditionalCheckFailedException"


# -- the admin service ----------------------------------------------------------------------


class TopicService:
    """Create, read, grow and switch composite topics."""

    def __init__(
        self,
        config: Config,
        streams: Streams,
        clock: Clock | None = None,
        *,
        effective_delay_ms: int = EFFECTIVE_DELAY_MS,
        stream_wait_s: float = 20.0,
    ) -> None:
        self.config = config
        self.streams = streams
        self.clock = clock or SystemClock()
        self.effective_delay_ms = effective_delay_ms
        #: how long a request waits for a new stream to become active (Kinesis takes ~30 s):
        #: an API request gives up in time to answer 503 within API Gateway's 30 s, and
        #: repeating it completes the topic; the deploy-time bootstrap can wait longer
        self.stream_wait_s = stream_wait_s

    @classmethod
    def from_config(cls, config: Config, clock: Clock | None = None) -> TopicService:
        tables.bind(config)
        return cls(config, Streams.from_config(config, clock), clock)

    @property
    def router_function(self) -> str:
        try:
            return self.config.functions["router"]
        except KeyError:
            raise RuntimeError("the configuration names no router function") from None

    def create(self, name: object, partitions: object) -> CompositeTopic:
        name = validate_topic_name(name)
        count = validate_partitions(partitions)
        if not self._reserve_first(name, count):
            raise TopicExists(f"topic {name} exists")
        topic = self._complete(name)
        self._wait_until(topic.effective_at_ms)
        return topic

    def ensure(self, name: str, partitions: int) -> CompositeTopic:
        """The topic, created with ``partitions`` if it does not exist; idempotent."""
        name = validate_topic_name(name)
        count = validate_partitions(partitions)
        existing = load_topic(name)
        if existing is not None and existing.created:
            return existing
        if existing is None:
            self._reserve_first(name, count)
        topic = self._complete(name)
        self._wait_until(topic.effective_at_ms)
        return topic

    def get(self, name: str) -> CompositeTopic:
        topic = load_topic(name) if is_valid_topic_name(name) else None
        if topic is None or not topic.created:
            raise TopicNotFound(f"no topic named {name}")
        return topic

    def list(self) -> list[CompositeTopic]:
        topics = (_topic_from(m) for m in TopicModel.scan())
        return sorted((t for t in topics if t.created), key=lambda t: t.name)

    def add_storage_topic(self, name: str, partitions: object) -> CompositeTopic:
        self.get(name)
        count = validate_partitions(partitions)
        for _ in range(_MAX_ATTEMPTS):
            topic = self.get(name)
            if topic.pending is not None:
                if topic.pending.partitions != count:
                    raise StorageTopicPending(
                        f"a storage topic of {topic.pending.partitions} partitions is being "
                        "added; repeat that request to finish it",
                        partitions=topic.pending.partitions,
                    )
                break  # an earlier request with these partitions crashed or is racing
            last = topic.storage_topics[-1]
            index = last.index + 1
            pending = StorageTopic(
                index=index,
                stream=stream_name(self.config.stream_prefix, name, index),
                partitions=count,
                k=next_k(last, count),
            )
            try:
                TopicModel(name).update(
                    actions=[
                        TopicModel.pending.set(_storage_attr(pending)),
                        TopicModel.version.set(topic.version + 1),
                    ],
                    condition=TopicModel.version == topic.version,
                )
                break
            except UpdateError as exc:
                if not _conditional_failed(exc):
                    raise
        else:
            raise ServerBusy(f"topic {name} is changing; retry")
        return self._complete(name)

    def switch_produce(self, name: str) -> CompositeTopic:
        for _ in range(_MAX_ATTEMPTS):
            topic = self.get(name)
            now = self.clock.now_ms()
            if now < topic.effective_at_ms:
                # an earlier change is not in effect yet: one step at a time
                self._wait_until(topic.effective_at_ms)
                continue
            if topic.produce_pointer + 1 >= len(topic.storage_topics):
                raise NoNextStorageTopic(
                    f"topic {name} produces to its last storage topic; add one first"
                )
            effective = now + self.effective_delay_ms
            try:
                TopicModel(name).update(
                    actions=[
                        TopicModel.produce_pointer.set(topic.produce_pointer + 1),
                        TopicModel.effective_at_ms.set(effective),
                        TopicModel.version.set(topic.version + 1),
                    ],
                    condition=TopicModel.version == topic.version,
                )
            except UpdateError as exc:
                if not _conditional_failed(exc):
                    raise
                continue
            # the push taps of the storage topics left behind drain with one lane (shoal.drain)
            from shoal.push_admin import refit_storage_topics  # it imports this module

            try:
                switched = replace(
                    topic, produce_pointer=topic.produce_pointer + 1, effective_at_ms=effective
                )
                refit_storage_topics(self.config, self.streams, self.clock, switched)
            except Exception:
                # The switch stands: answering an error would invite a second switch. Until a
                # PATCH of any push subscription of the topic refits its taps, a seal taken by a
                # tap of several lanes is given back: later delivery, never out of order.
                logger.exception("push taps not refitted after a switch", extra={"topic": name})
            self._wait_until(effective)
            return self.get(name)
        raise ServerBusy(f"topic {name} is changing; retry")

    # -- internals ---------------------------------------------------------------------

    def _reserve_first(self, name: str, partitions: int) -> bool:
        """Record a new topic with its first storage topic pending; False if it exists.

        A topic still being created with the same partitions counts as ours: an earlier
        request crashed (or is racing), and completing it is idempotent.
        """
        pending = StorageTopic(0, stream_name(self.config.stream_prefix, name, 0), partitions, 1)
        try:
            TopicModel(
                name,
                version=1,
                produce_pointer=0,
                storage_topics=[],
                pending=_storage_attr(pending),
                effective_at_ms=0,
            ).save(condition=TopicModel.name.does_not_exist())
            return True
        except PutError as exc:
            if not _conditional_failed(exc):
                raise
        current = load_topic(name)
        return (
            current is not None
            and not current.created
            and current.pending is not None
            and current.pending.partitions == partitions
        )

    def _complete(self, name: str) -> CompositeTopic:
        """Create the pending storage topic's stream and mapping, then make it a storage topic."""
        for _ in range(_MAX_ATTEMPTS):
            topic = load_topic(name)
            if topic is None:
                raise TopicNotFound(f"no topic named {name}")
            pending = topic.pending
            if pending is None:
                return topic
            info = self.streams.ensure_stream(
                pending.stream, pending.partitions, wait_s=self.stream_wait_s
            )
            self.streams.ensure_router_mapping(info.arn, self.router_function)
            # push subscriptions of the topic read the new stream before it is part of it
            from shoal.push_admin import follow_storage_topic  # it imports this module

            follow_storage_topic(self.config, self.streams, self.clock, topic, pending)
            even = list(info.starting_keys) == even_starting_keys(pending.partitions)
            done = replace(pending, hash_keys=None if even else info.starting_keys)
            effective = topic.effective_at_ms
            if not topic.created:
                # Nothing was routed to the default topic before it existed, so it needs no
                # delay; any other new topic takes over names that went to `default` until now.
                delay = 0 if name == DEFAULT_TOPIC else self.effective_delay_ms
                effective = self.clock.now_ms() + delay
            try:
                TopicModel(name).update(
                    actions=[
                        TopicModel.storage_topics.set(
                            [_storage_attr(s) for s in (*topic.storage_topics, done)]
                        ),
                        TopicModel.pending.remove(),
                        TopicModel.effective_at_ms.set(effective),
                        TopicModel.version.set(topic.version + 1),
                    ],
                    condition=TopicModel.version == topic.version,
                )
            except UpdateError as exc:
                if not _conditional_failed(exc):
                    raise
                continue
            logger.info(
                "storage topic added",
                extra={"topic": name, "index": done.index, "partitions": done.partitions},
            )
            return replace(
                topic,
                version=topic.version + 1,
                storage_topics=(*topic.storage_topics, done),
                pending=None,
                effective_at_ms=effective,
            )
        raise ServerBusy(f"topic {name} is changing; retry")

    def _wait_until(self, ms: int) -> None:
        remaining = ms - self.clock.now_ms()
        if remaining > 0:
            self.clock.sleep(remaining / 1000)


def ensure_default_topic(
    config: Config | None = None,
    *,
    partitions: int | None = None,
    clock: Clock | None = None,
    streams: Streams | None = None,
) -> CompositeTopic:
    """Create the `default` composite topic unless it exists; idempotent.

    ``shoal dev`` calls it at every start (a start hook: ``ensure_default_topic(config)``), the
    stack's bootstrap custom resource at deploy. ``partitions`` defaults to the configured
    count; an existing topic is kept as it is.
    """
    config = config or get_config()
    tables.bind(config)
    service = TopicService(
        config, streams or Streams.from_config(config, clock), clock, stream_wait_s=240.0
    )
    return service.ensure(DEFAULT_TOPIC, partitions or config.default_partitions)


# -- the publishers' view -------------------------------------------------------------------


@dataclass(frozen=True)
class Destination:
    """Where a publish of one MQTT topic name goes right now."""

    topic: CompositeTopic
    storage: StorageTopic


class TopicDirectory:
    """A publisher container's cache of composite topics, fresh within TOPIC_CACHE_TTL_MS.

    Misses are read strongly consistent in one BatchGetItem for the first level and `default`
    together, so most publishes of a warm container read no metadata at all.
    """

    def __init__(self, clock: Clock, ttl_ms: int = TOPIC_CACHE_TTL_MS) -> None:
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
        if len(self._entries) + len(names) > _MAX_CACHED:
            self._entries.clear()
        found = {m.name: _topic_from(m) for m in TopicModel.batch_get(names, consistent_read=True)}
        for name in names:
            # read_at was taken before the read, so an entry never looks fresher than it is
            self._entries[name] = (read_at, found.get(name))
