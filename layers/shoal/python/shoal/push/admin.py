"""Push subscriptions (admin): create, describe, list, change, delete, seek, list and redrive
the DLQ (the DLQ's part: ``shoal.push.dead_letters``).

Creating a subscription records it as ``creating``, then creates its RQ and DLQ streams, the
RQ's mapping and its membership in the push tap of each storage stream of its topic (all
idempotent), and marks it ``active``; a crash anywhere leaves a ``creating`` subscription that
repeating the same request completes. Deleting undoes it in reverse: it marks the subscription
``deleting`` (a conditional write; from then on the push function skips it and no other change
is accepted), leaves its taps (a tap without live members loses its mapping), removes the RQ's
mapping, the RQ and DLQ streams and the key states, each step idempotent, and deletes the
item last; a crash anywhere leaves a ``deleting`` subscription that repeating the delete
finishes.

A storage topic added to the composite topic later is followed without a PATCH: completing it
(``shoal.composite``) calls ``TapHooks.storage_topic_added``, which adds it to every
subscription of the topic and places its tap, before the storage topic becomes part of the
topic.

A tap runs as many lanes per shard as its most parallel member asks, except the tap of a
storage topic behind the produce pointer, which runs one (``tap_lanes``: only a single-lane tap
passes the ordered drain's seals, ``shoal.push.main_queue``). SwitchProduce refits the taps
it leaves behind (``TapHooks.produce_switched``); if that fails after the switch, the seals wait
(late, never out of order) until a PATCH of any subscription of the topic refits its taps.

Seek: a subscription's MQ position moves to a time, to the earliest record or to the latest.
Each cursor starts again at that time under a new generation (so an invocation that read the
batch before the seek cannot move it back); a rewind also replaces the push tap's mapping by
one that starts at that time (or earlier, for another member). Lambda cannot move a mapping:
a new one (``StartingPosition`` AT_TIMESTAMP / TRIM_HORIZON) is the only way back, and the
same calls work over ``shoal dev``'s emulator. RQ and DLQ only move forward: entries of
messages published before the seek time are skipped (as a Pub/Sub seek acks them).
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterable
from typing import Any

from shoal.aws.kinesis import Streams
from shoal.composite.model import DEFAULT_TOPIC, CompositeTopic, StorageTopic, is_valid_topic_name
from shoal.composite.store import TopicStore
from shoal.core.clock import Clock, SystemClock
from shoal.core.config import Config
from shoal.core.errors import (
    BadRequest,
    InvalidCursor,
    InvalidSeek,
    InvalidTopicName,
    ServerBusy,
    SubscriptionExists,
    SubscriptionNotFound,
    TopicNotFound,
)
from shoal.core.observability import logger
from shoal.push.api import CreateRequest, RedriveRequest, SeekRequest, UpdateRequest, parse_time
from shoal.push.dead_letters import DeadLetters
from shoal.push.endpoint import EndpointPolicy
from shoal.push.model import (
    ACTIVE,
    CREATING,
    DELETING,
    DLQ,
    RQ,
    PushSubscription,
    Spec,
    Tap,
    parse_retry_policy,
    validate_filter,
    validate_name,
    validate_parallelism,
)
from shoal.push.queues import Queues
from shoal.push.store import KeyStore, PushSubscriptionStore, push_parts
from shoal.topics.filters import MULTI_LEVEL, SINGLE_LEVEL, first_level

#: blocked keys a description lists (the depths count every blocked key)
MAX_LISTED_KEYS = 100
_MAX_CONFLICTS = 10
#: subscriptions a page of ``GET /v1/subscriptions`` holds by default, and at most
DEFAULT_LIST_PAGE = 50
MAX_LIST_PAGE = 100


def _base36(number: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        number, rest = divmod(number, 36)
        out = digits[rest] + out
        if not number:
            return out


def _encode_page_token(after: str) -> str:
    """Opaque to the caller: the name the page ended at (the table's own order)."""
    raw = json.dumps({"a": after}, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_page_token(token: object) -> str:
    try:
        text = str(token)
        after = json.loads(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))["a"]
    except (binascii.Error, ValueError, KeyError, TypeError):
        raise InvalidCursor("the page token is not one this service handed out") from None
    if not isinstance(after, str) or not after:
        raise InvalidCursor("the page token is not one this service handed out")
    return after


def tap_lanes(parallelisms: Iterable[int], storage_index: int, produce_pointer: int) -> int:
    """Lanes per shard of the tap of storage topic ``storage_index``: the largest parallelism
    of its live members, but one once the produce pointer is past it.

    A storage topic behind the pointer is drained with one lane: its seals (``shoal.drain``)
    are passed only by a single-lane tap, as a seal taken by one lane says nothing about the
    records of other keys that another lane of its shard may still hold. The pointer is read
    as written, before the switch is in effect: fewer lanes are never wrong, only slower, and
    only for the switch's effective delay.
    """
    if storage_index < produce_pointer:
        return 1
    return max(parallelisms, default=1)


class PushAdmin:
    def __init__(
        self,
        config: Config,
        subscriptions: PushSubscriptionStore,
        key_states: KeyStore,
        queues: Queues,
        *,
        clock: Clock | None = None,
        endpoints: EndpointPolicy | None = None,
        stream_wait_s: float = 20.0,
        topics: TopicStore | None = None,
    ) -> None:
        self.config = config
        self.topics = topics or TopicStore.from_config(config)
        self.prefix = config.stream_prefix
        self.subscriptions = subscriptions
        self.key_states = key_states
        self.queues = queues
        self.clock = clock or SystemClock()
        self.endpoints = endpoints or EndpointPolicy.from_config(config)
        #: how long a request waits for new queue streams (as shoal.composite's)
        self.stream_wait_s = stream_wait_s
        self.dlq = DeadLetters(self.prefix, subscriptions, key_states, queues, self.clock)

    @classmethod
    def from_config(cls, config: Config, clock: Clock | None = None) -> PushAdmin:
        clock = clock or SystemClock()
        return cls(config, *push_parts(config, clock), clock=clock)

    @property
    def push_function(self) -> str:
        try:
            return self.config.functions["push"]
        except KeyError:
            raise RuntimeError("the configuration names no push function") from None

    # -- create -----------------------------------------------------------------------------

    def create(self, request: CreateRequest) -> dict[str, Any]:
        name = validate_name(request.name)
        topic_filter = validate_filter(request.filter)
        endpoint = self.endpoints.validate(request.endpoint)
        policy = parse_retry_policy(request.retry)
        parallelism = validate_parallelism(request.parallelism)
        topic = self._source_topic(request.topic, topic_filter)
        now = self.clock.now_ms()
        spec = Spec(
            filter=topic_filter,
            endpoint=endpoint,
            ordered=request.ordered,
            retry=policy,
            topic=topic.name,
            queue_partitions=topic.storage_topics[-1].partitions,
            incarnation=_base36(now),
        )
        streams = [s.stream for s in topic.storage_topics]
        if not self.subscriptions.create(name, spec, parallelism, now, streams):
            existing = self.subscriptions.load(name)
            if (
                existing is None
                or existing.state != CREATING
                or not existing.spec.same_request(spec)
            ):
                raise SubscriptionExists(f"a push subscription named {name} exists")
        sub = self._complete(name, topic)
        return self._document(sub)

    def _source_topic(self, requested: object, topic_filter: str) -> CompositeTopic:
        if requested is not None:
            if not isinstance(requested, str) or not is_valid_topic_name(requested):
                raise InvalidTopicName("a topic name is 1-64 of A-Z a-z 0-9 _ -")
            candidates = [requested]
        else:
            level = first_level(topic_filter)
            literal = level not in (SINGLE_LEVEL, MULTI_LEVEL) and is_valid_topic_name(level)
            candidates = [level, DEFAULT_TOPIC] if literal else [DEFAULT_TOPIC]
        for candidate in candidates:
            topic = self.topics.load(candidate)
            if topic is not None and topic.created:
                return topic
        raise TopicNotFound(f"no composite topic {candidates[0]} to read")

    def _complete(self, name: str, topic: CompositeTopic) -> PushSubscription:
        sub = self.subscriptions.require(name)
        if sub.state == DELETING:
            raise SubscriptionNotFound(f"push subscription {name} is being deleted")
        for queue in (RQ, DLQ):
            self.queues.ensure(sub.queue(queue, self.prefix), self.stream_wait_s)
        rq_arn = self.queues.stream_arn(sub.queue(RQ, self.prefix).stream)
        if rq_arn is None:
            raise ServerBusy("the retry queue is not there yet; retry")
        self.queues.ensure_mapping(
            rq_arn, self.push_function, parallelism=sub.parallelism, start="TRIM_HORIZON"
        )
        for storage in topic.storage_topics:
            self.subscriptions.join_tap(storage.stream, topic.name, storage.index, name)
            self._settle_tap(storage.stream)
        # a storage topic added since the request read the topic: its completion looked for
        # members of the taps before this one joined them
        self._follow_topic(self.subscriptions.require(name))
        sub = self.subscriptions.require(name)
        for _ in range(_MAX_CONFLICTS):
            if sub.state == ACTIVE:
                return sub
            if sub.state == DELETING:
                raise SubscriptionNotFound(f"push subscription {name} is being deleted")
            if self.subscriptions.set_state(sub, ACTIVE):
                logger.info("push subscription created", extra={"subscription": name})
                return self.subscriptions.require(name)
            sub = self.subscriptions.require(name)
        raise ServerBusy("the subscription is changing; retry")

    # -- the push taps ----------------------------------------------------------------------

    def _settle_tap(self, stream: str, *, restart_at: int | None = None) -> None:
        """Make the tap's mapping fit its members: none without members, else one that starts
        no later than any member's position and runs ``tap_lanes`` lanes; ``restart_at``
        replaces it (a rewind)."""
        token = self.subscriptions.acquire_tap_lock(stream)
        if token is None:
            raise ServerBusy("the push tap is being changed; retry")
        try:
            tap = self.subscriptions.tap(stream)
            arn = self.queues.stream_arn(stream)
            if tap is None or arn is None:
                return
            mappings = self.queues.mappings(arn, self.push_function)
            existing = [str(m["UUID"]) for m in mappings]
            members = self.subscriptions.load_many(tap.members) if tap.members else {}
            live = [s for s in members.values() if s.state != DELETING]
            if not live:
                for uuid in existing:
                    self.queues.delete_mapping(uuid)
                return
            topic = self.topics.load(tap.topic) if tap.topic else None
            lanes = tap_lanes(
                [s.parallelism for s in live],
                tap.storage_index,
                topic.produce_pointer if topic is not None else 0,
            )
            if existing and restart_at is None:
                for uuid in existing[1:]:
                    self.queues.delete_mapping(uuid)
                self._fit_lanes(tap, mappings[0], lanes)
                return
            shards = self.queues.shards(stream)
            positions = [s.cursors[stream].position_ms(shards) for s in live if stream in s.cursors]
            if restart_at is not None:
                positions.append(restart_at)
            start = min(positions, default=self.clock.now_ms())
            for uuid in existing:
                self.queues.delete_mapping(uuid)
            if lanes > tap.lanes:
                self.subscriptions.set_tap_lanes(stream, lanes)
            # a second before: arrival times within one shard are only roughly in order, and
            # what a member processed already it skips by its cursor
            if start <= 1_000:
                self.queues.create_mapping(
                    arn, self.push_function, parallelism=lanes, start="TRIM_HORIZON"
                )
            else:
                self.queues.create_mapping(
                    arn,
                    self.push_function,
                    parallelism=lanes,
                    start="AT_TIMESTAMP",
                    at_ms=start - 1000,
                )
            if lanes < tap.lanes:
                self.subscriptions.set_tap_lanes(stream, lanes)
            logger.info(
                "push tap mapping placed",
                extra={"stream": stream, "start_ms": start, "lanes": lanes},
            )
        finally:
            self.subscriptions.release_tap_lock(stream, token)

    def _fit_lanes(self, tap: Tap, mapping: dict[str, Any], lanes: int) -> None:
        """The tap's mapping to ``lanes`` lanes per shard; the tap's ``lanes`` is raised
        before the mapping runs more and lowered after it runs fewer (``shoal.push.store``)."""
        factor = int(mapping.get("ParallelizationFactor") or 1)
        if lanes > tap.lanes:
            self.subscriptions.set_tap_lanes(tap.stream, lanes)
        if factor != lanes:
            self.queues.set_parallelism(str(mapping["UUID"]), lanes)
            logger.info("push tap lanes changed", extra={"stream": tap.stream, "lanes": lanes})
        if lanes < tap.lanes:
            self.subscriptions.set_tap_lanes(tap.stream, lanes)

    def refit_behind(self, topic: CompositeTopic) -> None:
        """Fit the taps of ``topic``'s storage topics behind its produce pointer (one lane each:
        ``tap_lanes``); SwitchProduce calls it through ``TapHooks.produce_switched``."""
        for storage in topic.storage_topics[: topic.produce_pointer]:
            # settled even at one lane: a settle that read the pointer before the switch may
            # still be raising the lanes under the tap's lock, and this one waits for it
            if self.subscriptions.tap(storage.stream) is not None:
                self._settle_tap(storage.stream)

    # -- describe, update, delete ------------------------------------------------------------

    def describe(self, name: str) -> dict[str, Any]:
        sub = self.subscriptions.require(name)
        doc = self._document(sub)
        listed: list[str] = []
        retry_depth = dlq_depth = count = 0
        for blocked in self.key_states.blocked(name):
            count += 1
            retry_depth += blocked.rq_depth
            dlq_depth += blocked.dlq_depth
            if len(listed) < MAX_LISTED_KEYS:
                listed.append(blocked.ordering_key)
        doc |= {
            "blocked_keys": sorted(listed),
            "blocked_key_count": count,
            "retry_depth": retry_depth,
            "dlq_depth": dlq_depth,
        }
        return doc

    def list_page(self, limit: object, page_token: object) -> dict[str, Any]:
        """A page of subscriptions (Pub/Sub's ``projects.subscriptions.list``), each as
        ``describe`` answers it but without ``blocked_keys``, ``blocked_key_count``,
        ``retry_depth`` and ``dlq_depth``: those take a Query of the blocked-key index per
        subscription, where the rest of a document comes from its one item."""
        try:
            count = DEFAULT_LIST_PAGE if limit is None else int(str(limit))
        except ValueError:
            count = 0
        if not 1 <= count <= MAX_LIST_PAGE:
            raise BadRequest(f"limit is 1-{MAX_LIST_PAGE}", maximum=MAX_LIST_PAGE)
        after = _decode_page_token(page_token) if page_token else None
        subs, last = self.subscriptions.page(count, after)
        return {
            "subscriptions": [self._document(sub) for sub in subs],
            "next_page_token": None if last is None else _encode_page_token(last),
        }

    def _document(self, sub: PushSubscription) -> dict[str, Any]:
        def queue_document(queue: str) -> dict[str, Any]:
            storage = sub.queue(RQ if queue == RQ else DLQ, self.prefix)
            return CompositeTopic(
                name=f"{sub.name}.{queue}",
                version=0,
                produce_pointer=0,
                storage_topics=(storage,),
            ).document()

        return {
            "name": sub.name,
            "filter": sub.spec.filter,
            "endpoint": sub.spec.endpoint,
            "ordered": sub.spec.ordered,
            "retry": sub.spec.retry.model_dump(mode="json"),
            "parallelism": sub.parallelism,
            "topic": sub.spec.topic,
            "state": sub.state,
            "created_at": sub.created_at_ms,
            "generation": sub.generation,
            "retry_queue": queue_document(RQ),
            "dead_letter_queue": queue_document(DLQ),
        }

    def update(self, name: str, request: UpdateRequest) -> dict[str, Any]:
        parallelism = validate_parallelism(request.parallelism)
        for _ in range(_MAX_CONFLICTS):
            sub = self.subscriptions.require(name)
            if not sub.active:
                raise SubscriptionNotFound(f"push subscription {name} is {sub.state}")
            if sub.parallelism == parallelism or self.subscriptions.set_parallelism(
                sub, parallelism
            ):
                break
        else:
            raise ServerBusy("the subscription is changing; retry")
        rq_arn = self.queues.stream_arn(sub.queue(RQ, self.prefix).stream)
        if rq_arn is not None:
            for mapping in self.queues.mappings(rq_arn, self.push_function):
                if int(mapping.get("ParallelizationFactor") or 1) != parallelism:
                    self.queues.set_parallelism(str(mapping["UUID"]), parallelism)
        sub = self.subscriptions.require(name)
        for stream in sub.cursors:
            self._settle_tap(stream)
        self._follow_topic(sub)
        return self.describe(name)

    def _follow_topic(self, sub: PushSubscription) -> None:
        """Read storage topics the topic gained after the subscription was made (and one
        being added whose stream exists: its completion may have missed this subscription)."""
        topic = self.topics.load(sub.spec.topic)
        if topic is None:
            return
        storages = list(topic.storage_topics)
        if topic.pending is not None and self.queues.stream_arn(topic.pending.stream):
            storages.append(topic.pending)
        for storage in storages:
            if storage.stream not in sub.cursors:
                self._follow(sub.name, topic.name, storage)

    def _follow(self, name: str, topic: str, storage: StorageTopic) -> None:
        """One subscription reads one more storage stream (all of it: the stream is new)."""
        for _ in range(_MAX_CONFLICTS):
            sub = self.subscriptions.require(name)
            if sub.state == DELETING:
                return
            if storage.stream in sub.cursors or self.subscriptions.add_streams(
                sub, {storage.stream: 0}
            ):
                break
        else:
            raise ServerBusy("the subscription is changing; retry")
        self.subscriptions.join_tap(storage.stream, topic, storage.index, name)
        self._settle_tap(storage.stream)

    def follow_storage_topic(self, topic: CompositeTopic, storage: StorageTopic) -> None:
        """Every subscription of ``topic`` reads ``storage``, which is being added to it.

        The members of the taps of the topic's storage streams are its subscriptions (each
        joins all of them). Every step is idempotent and the tap's mapping is placed under
        the tap's lock, so a completion repeated after a crash ends with one mapping.
        """
        names: set[str] = set()
        for existing in topic.storage_topics:
            tap = self.subscriptions.tap(existing.stream)
            if tap is not None:
                names |= tap.members
        subs = self.subscriptions.load_many(names) if names else {}
        for sub in sorted(subs.values(), key=lambda s: s.name):
            if sub.spec.topic == topic.name and sub.state != DELETING:
                self._follow(sub.name, topic.name, storage)

    def delete(self, name: str) -> None:
        for _ in range(_MAX_CONFLICTS):
            sub = self.subscriptions.require(name)
            if sub.state == DELETING or self.subscriptions.set_state(sub, DELETING):
                break
        else:
            raise ServerBusy("the subscription is changing; retry")
        for stream in sub.cursors:
            self.subscriptions.leave_tap(stream, name)
            self._settle_tap(stream)
        rq, dlq = sub.queue(RQ, self.prefix), sub.queue(DLQ, self.prefix)
        rq_arn = self.queues.stream_arn(rq.stream)
        if rq_arn is not None:
            for mapping in self.queues.mappings(rq_arn, self.push_function):
                self.queues.delete_mapping(str(mapping["UUID"]))
        self.queues.delete_stream(rq.stream)
        self.queues.delete_stream(dlq.stream)
        self.key_states.delete_all(name)
        # last: while the item is there, a repeated delete finds what is left to remove
        self.subscriptions.delete(name)
        logger.info("push subscription deleted", extra={"subscription": name})

    # -- seek -------------------------------------------------------------------------------

    def seek(self, name: str, request: SeekRequest) -> dict[str, Any]:
        if (request.to_time is None) == (request.to is None):
            raise InvalidSeek('give exactly one of "to_time" and "to"')
        now = self.clock.now_ms()
        if request.to is not None:
            if request.to not in ("earliest", "latest"):
                raise InvalidSeek('"to" is "earliest" or "latest"')
            to_ms = 0 if request.to == "earliest" else now
        else:
            parsed = parse_time(request.to_time)
            if parsed is None:
                raise InvalidSeek("to_time is epoch milliseconds or an ISO 8601 time")
            to_ms = parsed
        for _ in range(_MAX_CONFLICTS):
            sub = self.subscriptions.require(name)
            if not sub.active:
                raise SubscriptionNotFound(f"push subscription {name} is {sub.state}")
            rewinds = {}
            for stream, cursor in sub.cursors.items():
                shards = self.queues.shards(stream)
                rewinds[stream] = to_ms < cursor.position_ms(shards)
            skip = max(sub.skip_before_ms, to_ms)
            if self.subscriptions.seek(sub, to_ms, skip):
                break
        else:
            raise ServerBusy("the subscription is changing; retry")
        if skip > sub.skip_before_ms:
            self._skip_pending(name, skip)
        for stream, rewind in rewinds.items():
            if rewind:
                self._settle_tap(stream, restart_at=to_ms)
        logger.info("push subscription sought", extra={"subscription": name, "to_ms": to_ms})
        return {"name": name, "to_time": to_ms, "generation": sub.generation + 1}

    def _skip_pending(self, name: str, skip_before_ms: int) -> None:
        """Consume at once the queues whose entries all predate the seek time (the consumers
        skip the rest entry by entry)."""
        for blocked in list(self.key_states.blocked(name, limit=1_000)):
            state = self.key_states.get(name, blocked.ordering_key)
            skipped = state.skip_before(skip_before_ms)
            if skipped != state:
                # a conflict means a consumer moved the key; it skips by itself
                self.key_states.save(name, blocked.ordering_key, skipped)

    # -- the DLQ ----------------------------------------------------------------------------

    def dead_letters(self, name: str, limit: object, after: object) -> dict[str, Any]:
        return self.dlq.page(name, limit, after)

    def redrive(self, name: str, request: RedriveRequest) -> dict[str, Any]:
        return self.dlq.redrive(name, request)


class TapHooks:
    """The push subscriptions' part in a composite topic's changes
    (``shoal.composite.service.StorageTopicHooks``), passed in by the wiring root."""

    def __init__(self, config: Config, streams: Streams, clock: Clock) -> None:
        self.config = config
        self.streams = streams
        self.clock = clock

    def _admin(self) -> PushAdmin:
        return PushAdmin(
            self.config,
            PushSubscriptionStore.from_config(self.config, self.clock),
            KeyStore.from_config(self.config),
            Queues(self.streams, self.clock),
            clock=self.clock,
        )

    def storage_topic_added(self, topic: CompositeTopic, pending: StorageTopic) -> None:
        """The topic's push subscriptions read ``pending`` too, before it joins the topic."""
        if "push" not in self.config.functions or not topic.storage_topics:
            return  # no push function deployed, or a new topic (no subscription reads it yet)
        self._admin().follow_storage_topic(topic, pending)

    def produce_switched(self, topic: CompositeTopic) -> None:
        """The push taps of the storage topics behind the produce pointer drain with one
        lane (``shoal.drain``). Idempotent; a PATCH of any push subscription of the topic does
        the same for its taps."""
        if "push" not in self.config.functions:
            return  # no push function deployed: no taps
        self._admin().refit_behind(topic)

    def switch_in_effect(self, topic: CompositeTopic) -> None:
        """Nothing more for the taps: they were refitted at the switch."""
        return None
