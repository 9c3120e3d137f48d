"""Composite topics' admin service: create, read, grow and switch.

Metadata changes are conditional writes on the topic's version (``TopicStore``). Creating a
topic or adding a storage topic first records the storage topic as ``pending``, then creates
its stream, the router's event source mapping and whatever else follows a topic's storage
topics (``StorageTopicHooks``: the push subscriptions' taps; all idempotent), then moves it
into ``storage_topics``; a crash anywhere leaves a pending storage topic that repeating the
request completes.

The admin call returns only once a change is in effect (``shoal.composite.directory``). A
storage topic before the produce pointer receives no record that was routed after
``effective_at_ms``; a put already routed may still land up to one publish timeout later: the
ordered drain (``shoal.drain``) seals a storage topic only after that, and readers of a later
storage topic wait for its seals.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

from shoal.aws.kinesis import ROUTER_CONSUMER, Streams, even_starting_keys
from shoal.composite.model import (
    DEFAULT_TOPIC,
    EFFECTIVE_DELAY_MS,
    CompositeTopic,
    StorageTopic,
    is_valid_topic_name,
    next_k,
    stream_name,
    validate_partitions,
    validate_topic_name,
)
from shoal.composite.store import TopicStore
from shoal.core.clock import Clock, SystemClock
from shoal.core.config import Config
from shoal.core.errors import (
    NoNextStorageTopic,
    ServerBusy,
    StorageTopicPending,
    TopicExists,
    TopicNotFound,
)
from shoal.core.observability import logger

#: a bounded number of optimistic retries before a busy topic answers 503
MAX_ATTEMPTS = 20


class StorageTopicHooks(Protocol):
    """What follows a topic's storage topics besides the router (the push subscriptions).

    Composite topics know nothing of their readers: the wiring root passes them in.
    """

    def storage_topic_added(self, topic: CompositeTopic, pending: StorageTopic) -> None:
        """``pending`` is about to become part of ``topic`` (idempotent; retried on a crash)."""
        ...

    def produce_switched(self, topic: CompositeTopic) -> None:
        """``topic``'s produce pointer moved (best effort: the switch stands regardless)."""
        ...

    def switch_in_effect(self, topic: CompositeTopic) -> None:
        """``topic``'s switch is in effect: what is behind the pointer may be sealed (the ordered
        drain, ``shoal.drain``; best effort: the reaper seals it otherwise)."""
        ...


class NoHooks:
    def storage_topic_added(self, topic: CompositeTopic, pending: StorageTopic) -> None:
        return None

    def produce_switched(self, topic: CompositeTopic) -> None:
        return None

    def switch_in_effect(self, topic: CompositeTopic) -> None:
        return None


class TopicService:
    """Create, read, grow and switch composite topics."""

    def __init__(
        self,
        config: Config,
        store: TopicStore,
        streams: Streams,
        clock: Clock | None = None,
        *,
        hooks: StorageTopicHooks | None = None,
        effective_delay_ms: int = EFFECTIVE_DELAY_MS,
        stream_wait_s: float = 20.0,
    ) -> None:
        self.config = config
        self.store = store
        self.streams = streams
        self.clock = clock or SystemClock()
        self.hooks = hooks or NoHooks()
        self.effective_delay_ms = effective_delay_ms
        #: how long a request waits for a new stream to become active (``shoal.wiring``)
        self.stream_wait_s = stream_wait_s

    @property
    def router_function(self) -> str:
        try:
            return self.config.functions["router"]
        except KeyError:
            raise RuntimeError("the configuration names no router function") from None

    def create(self, requested: object, partitions: object) -> CompositeTopic:
        name = validate_topic_name(requested)
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
        existing = self.store.load(name)
        if existing is not None and existing.created:
            return existing
        if existing is None:
            self._reserve_first(name, count)
        topic = self._complete(name)
        self._wait_until(topic.effective_at_ms)
        return topic

    def get(self, name: str) -> CompositeTopic:
        topic = self.store.load(name) if is_valid_topic_name(name) else None
        if topic is None or not topic.created:
            raise TopicNotFound(f"no topic named {name}")
        return topic

    def list(self) -> list[CompositeTopic]:
        return sorted((t for t in self.store.scan() if t.created), key=lambda t: t.name)

    def add_storage_topic(self, name: str, partitions: object) -> CompositeTopic:
        self.get(name)
        count = validate_partitions(partitions)
        for _ in range(MAX_ATTEMPTS):
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
            if self.store.add_pending(topic, pending):
                break
        else:
            raise ServerBusy(f"topic {name} is changing; retry")
        return self._complete(name)

    def switch_produce(self, name: str) -> CompositeTopic:
        for _ in range(MAX_ATTEMPTS):
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
            if not self.store.switch_produce(topic, effective):
                continue
            try:
                switched = replace(
                    topic, produce_pointer=topic.produce_pointer + 1, effective_at_ms=effective
                )
                self.hooks.produce_switched(switched)
            except Exception:
                # The switch stands: answering an error would invite a second switch. Until a
                # PATCH of any push subscription of the topic refits its taps, a seal taken by a
                # tap of several lanes is given back: later delivery, never out of order.
                logger.exception("push taps not refitted after a switch", extra={"topic": name})
            self._wait_until(effective)
            try:
                self.hooks.switch_in_effect(switched)
            except Exception:
                # the switch stands; the reaper's next run seals what this did not
                logger.exception("storage topics not sealed after a switch", extra={"topic": name})
            return self.get(name)
        raise ServerBusy(f"topic {name} is changing; retry")

    # -- internals ---------------------------------------------------------------------

    def _reserve_first(self, name: str, partitions: int) -> bool:
        """Record a new topic with its first storage topic pending; False if it exists.

        A topic still being created with the same partitions counts as ours: an earlier
        request crashed (or is racing), and completing it is idempotent.
        """
        pending = StorageTopic(0, stream_name(self.config.stream_prefix, name, 0), partitions, 1)
        if self.store.reserve(name, pending):
            return True
        current = self.store.load(name)
        return (
            current is not None
            and not current.created
            and current.pending is not None
            and current.pending.partitions == partitions
        )

    def _complete(self, name: str) -> CompositeTopic:
        """Create the pending storage topic's stream and mapping, then make it a storage topic."""
        for _ in range(MAX_ATTEMPTS):
            topic = self.store.load(name)
            if topic is None:
                raise TopicNotFound(f"no topic named {name}")
            pending = topic.pending
            if pending is None:
                return topic
            info = self.streams.ensure_stream(
                pending.stream, pending.partitions, wait_s=self.stream_wait_s
            )
            self._map_router(info.arn)
            # push subscriptions of the topic read the new stream before it is part of it
            self.hooks.storage_topic_added(topic, pending)
            even = list(info.starting_keys) == even_starting_keys(pending.partitions)
            done = replace(pending, hash_keys=None if even else info.starting_keys)
            effective = topic.effective_at_ms
            if not topic.created:
                # Nothing was routed to the default topic before it existed, so it needs no
                # delay; any other new topic takes over names that went to `default` until now.
                delay = 0 if name == DEFAULT_TOPIC else self.effective_delay_ms
                effective = self.clock.now_ms() + delay
            if not self.store.complete(topic, done, effective):
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

    def _map_router(self, stream_arn: str) -> None:
        """The router's mapping of a new storage stream: on the stream (Lambda polls each shard
        about once a second), or with the enhanced fan-out option on the router's consumer of
        it (records pushed within about 70 ms; docs/operations.md, "Latency"). The option
        applies to storage streams made while it is on; a stream keeps the mapping it was
        made with, through grows and switches, until the teardown."""
        if "router" not in self.config.enhanced_fan_out:
            self.streams.ensure_router_mapping(stream_arn, self.router_function)
            return
        consumer = self.streams.ensure_consumer(
            stream_arn, ROUTER_CONSUMER, wait_s=self.stream_wait_s
        )
        try:
            self.streams.ensure_router_mapping(consumer, self.router_function)
        except Exception:
            # a failed make leaves no consumer behind (billed by the shard-hour, read or not);
            # repeating the request registers it again
            self.streams.release_consumer(consumer, self.router_function)
            raise
        # a mapping on the stream itself (an attempt made while the option was off) would route
        # every shard twice; the stream is not part of the topic yet, so it holds no record
        self.streams.drop_router_mappings(stream_arn, self.router_function)

    def _wait_until(self, ms: int) -> None:
        remaining = ms - self.clock.now_ms()
        if remaining > 0:
            self.clock.sleep(remaining / 1000)


def ensure_default_topic(service: TopicService, partitions: int | None = None) -> CompositeTopic:
    """Create the `default` composite topic unless it exists; idempotent.

    ``shoal dev`` calls it at every start, the stack's bootstrap custom resource at deploy.
    ``partitions`` defaults to the configured count; an existing topic is kept as it is.
    """
    return service.ensure(DEFAULT_TOPIC, partitions or service.config.default_partitions)
