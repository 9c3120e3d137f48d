"""Where push subscriptions live: their items, group states, queues and event source mappings.

The only push module that speaks to DynamoDB, Kinesis and Lambda (``shoal.push`` is pure).

Push taps
---------
Lambda refuses a second Kinesis mapping of one function on one stream, and a Kinesis event
does not say which mapping sent it, so one mapping per (subscription, storage stream) cannot
work. Each storage stream that push subscriptions read has one *push tap*: one mapping of the
push function, whose invocations serve every member subscription. Each member keeps its own
*cursor* per shard (the last sequence number it processed, and its arrival time) in its
subscription item, plus a ``from`` time; a record at or before the cursor, or older than
``from``, is not for it. A seek moves one member's cursor; a rewind also replaces the tap's
mapping by one that starts no later than every member's position, and the other members skip
what they processed already. A tap also reads each shard once for all its members, where a
mapping per subscription would share Kinesis' five reads per second per shard among them.

A tap's mapping runs ``lanes`` lanes per shard (its ParallelizationFactor): the largest
``parallelism`` of its members, or one behind the produce pointer (only a single-lane tap
passes the ordered drain's seals: ``shoal.push_admin.tap_lanes``). Lanes split a shard by
partition key, which is the ordering key (``shoal.publishing``), so each key stays in order in
its lane, but one lane may run ahead of another: a shard cursor moved by one lane would pass
records another lane still holds. So while ``lanes`` > 1 the cursors stay where they are and
each key's progress is marked in its group state instead (``GroupState.marks``). ``lanes`` is
raised before the mapping runs more lanes and lowered only after it runs fewer, so it never
says fewer lanes than may be running.

Retry queues have a mapping each (the stream names its subscription).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal

from botocore.exceptions import BotoCoreError, ClientError
from pynamodb.exceptions import DeleteError, PutError, PynamoDBException, UpdateError

from shoal.aws.clients import error_code
from shoal.aws.kinesis import OutRecord, StreamInfo, Streams
from shoal.aws.tables import PushGroupModel, PushSubscriptionModel
from shoal.composite.model import StorageTopic, stream_name
from shoal.core.clock import Clock
from shoal.core.config import Config
from shoal.core.errors import ServerBusy
from shoal.core.observability import logger
from shoal.push.model import (
    DLQ,
    RQ,
    Entry,
    GroupState,
    Queue,
    Source,
    Spec,
    decode_entry,
    encode_entry,
    ordering_digest,
    partition_key,
)
from shoal.records import MalformedRecord, Message, decode_record

if TYPE_CHECKING:
    from mypy_boto3_kinesis import KinesisClient
    from mypy_boto3_lambda import LambdaClient

ACTIVE = "active"
CREATING = "creating"
DELETING = "deleting"
TAP_PREFIX = "tap#"
#: a new member starts this long before its creation: Kinesis stamps arrivals by its own clock
SKEW_MS = 5_000
#: tap mapping changes are serialized by a lease this long
LEASE_MS = 30_000
#: how a mapping reads: as the router's, so that nothing is skipped (see shoal.aws.kinesis)
MAPPING: dict[str, Any] = {
    "BatchSize": 100,
    "MaximumBatchingWindowInSeconds": 0,
    "FunctionResponseTypes": ["ReportBatchItemFailures"],
    "BisectBatchOnFunctionError": True,
    "MaximumRetryAttempts": -1,
    "MaximumRecordAgeInSeconds": -1,
}
_PUT_ATTEMPTS = 3


def _conditional_failed(exc: PynamoDBException) -> bool:
    return exc.cause_response_code == "ConditionalCheckFailedException"


# -- subscriptions and taps -----------------------------------------------------------------


@dataclass(frozen=True)
class ShardCursor:
    sequence_number: str
    arrival_ms: int


@dataclass(frozen=True)
class Cursor:
    """A subscription's position in one storage stream."""

    from_ms: int
    shards: Mapping[str, ShardCursor] = field(default_factory=dict)

    def admits(self, shard: str, sequence_number: str, arrival_ms: int) -> bool:
        at = self.shards.get(shard)
        if at is not None and int(sequence_number) <= int(at.sequence_number):
            return False
        return arrival_ms >= self.from_ms

    def position_ms(self, shards: Iterable[str]) -> int:
        """No record of these shards that this subscription still needs arrived before."""
        return min(
            (self.shards[s].arrival_ms if s in self.shards else self.from_ms for s in shards),
            default=self.from_ms,
        )

    @classmethod
    def from_item(cls, raw: Mapping[str, Any]) -> Cursor:
        return cls(
            from_ms=int(raw.get("from", 0)),
            shards={
                shard: ShardCursor(str(c["s"]), int(c["t"]))
                for shard, c in (raw.get("shards") or {}).items()
            },
        )


@dataclass(frozen=True)
class Subscription:
    name: str
    spec: Spec
    parallelism: int
    state: str
    version: int
    generation: int
    skip_before_ms: int
    created_at_ms: int
    cursors: Mapping[str, Cursor]

    @property
    def active(self) -> bool:
        return self.state == ACTIVE

    def queue(self, queue: Queue, prefix: str) -> StorageTopic:
        """The storage topic of RQ or DLQ (one each; a composite topic of their own)."""
        return StorageTopic(
            index=0,
            stream=queue_stream(prefix, self.name, self.spec.incarnation, queue),
            partitions=self.spec.queue_partitions,
            k=1,
        )


def queue_stream(prefix: str, name: str, incarnation: str, queue: Queue) -> str:
    # "." appears in no composite topic name, so a queue's stream can never be a topic's
    return stream_name(prefix, f"{name}.{incarnation}.{queue}", 0)


def parse_queue_stream(prefix: str, stream: str) -> tuple[str, str, Queue] | None:
    """(subscription, incarnation, queue) of a queue's stream name; None for a storage stream."""
    head = f"{prefix}-"
    if not stream.startswith(head):
        return None
    parts = stream[len(head) :].rsplit("-", 1)[0].split(".")
    if len(parts) != 3 or parts[2] not in (RQ, DLQ):
        return None
    queue: Queue = RQ if parts[2] == RQ else DLQ
    return parts[0], parts[1], queue


@dataclass(frozen=True)
class Tap:
    stream: str
    topic: str
    storage_index: int
    members: frozenset[str]
    version: int
    #: lanes per shard the tap's mapping may run (at least its ParallelizationFactor)
    lanes: int = 1
    #: when each member joined (ms; the ordered drain's "began reading", ``shoal.drain``)
    joined: Mapping[str, int] = field(default_factory=dict)


def _subscription(item: PushSubscriptionModel) -> Subscription:
    return Subscription(
        name=item.name,
        spec=Spec.from_json(item.spec or "{}"),
        parallelism=int(item.parallelism or 1),
        state=item.state or CREATING,
        version=int(item.version),
        generation=int(item.generation or 0),
        skip_before_ms=int(item.skip_before_ms or 0),
        created_at_ms=int(item.created_at_ms or 0),
        cursors={stream: Cursor.from_item(raw) for stream, raw in _plain(item.cursors).items()},
    )


def _plain(attribute: Any) -> dict[str, Any]:
    """A raw MapAttribute's value as plain dicts."""
    if attribute is None:
        return {}
    value = attribute.as_dict() if hasattr(attribute, "as_dict") else attribute
    return dict(value)


class SubscriptionStore:
    """Subscription items and tap items (``shoal.aws.tables.PushSubscriptionModel``)."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def load(self, name: str) -> Subscription | None:
        try:
            item = PushSubscriptionModel.get(name, consistent_read=True)
        except PushSubscriptionModel.DoesNotExist:
            return None
        except PynamoDBException as exc:
            raise ServerBusy("the subscription could not be read; retry") from exc
        return _subscription(item) if item.spec else None

    def load_many(self, names: Iterable[str]) -> dict[str, Subscription]:
        wanted = sorted(set(names))
        try:
            items = list(PushSubscriptionModel.batch_get(wanted, consistent_read=True))
        except PynamoDBException as exc:
            raise ServerBusy("subscriptions could not be read; retry") from exc
        return {i.name: _subscription(i) for i in items if i.spec}

    def create(
        self,
        name: str,
        spec: Spec,
        parallelism: int,
        created_at_ms: int,
        streams: Sequence[str],
    ) -> bool:
        """Record a new subscription as ``creating``; False when the name is taken."""
        try:
            PushSubscriptionModel(
                name,
                version=1,
                state=CREATING,
                spec=spec.to_json(),
                parallelism=parallelism,
                generation=0,
                skip_before_ms=0,
                created_at_ms=created_at_ms,
                cursors={s: {"from": created_at_ms - SKEW_MS, "shards": {}} for s in streams},
            ).save(condition=PushSubscriptionModel.name.does_not_exist())
        except PutError as exc:
            if _conditional_failed(exc):
                return False
            raise ServerBusy("the subscription could not be recorded; retry") from exc
        return True

    def _update(self, sub: Subscription, actions: list[Any]) -> bool:
        try:
            PushSubscriptionModel(sub.name).update(
                actions=[*actions, PushSubscriptionModel.version.set(sub.version + 1)],
                condition=PushSubscriptionModel.version == sub.version,
            )
        except UpdateError as exc:
            if _conditional_failed(exc):
                return False
            raise ServerBusy("the subscription could not be changed; retry") from exc
        return True

    def set_state(self, sub: Subscription, state: str) -> bool:
        return self._update(sub, [PushSubscriptionModel.state.set(state)])

    def set_parallelism(self, sub: Subscription, parallelism: int) -> bool:
        return self._update(sub, [PushSubscriptionModel.parallelism.set(parallelism)])

    def add_streams(self, sub: Subscription, streams: Mapping[str, int]) -> bool:
        """Start reading more storage streams (a topic grew), each from the given time."""
        return self._update(
            sub,
            [
                PushSubscriptionModel.cursors[s].set({"from": from_ms, "shards": {}})
                for s, from_ms in streams.items()
            ],
        )

    def seek(self, sub: Subscription, to_ms: int, skip_before_ms: int) -> bool:
        """Every cursor to ``to_ms``, a new generation (in-flight cursor moves fail)."""
        return self._update(
            sub,
            [
                *(
                    PushSubscriptionModel.cursors[s].set({"from": to_ms, "shards": {}})
                    for s in sub.cursors
                ),
                PushSubscriptionModel.generation.set(sub.generation + 1),
                PushSubscriptionModel.skip_before_ms.set(skip_before_ms),
            ],
        )

    def advance(
        self, name: str, generation: int, stream: str, shard: str, cursor: ShardCursor
    ) -> bool:
        """Move one shard's cursor (of the generation that read the batch)."""
        try:
            PushSubscriptionModel(name).update(
                actions=[
                    PushSubscriptionModel.cursors[stream]["shards"][shard].set(
                        {"s": cursor.sequence_number, "t": cursor.arrival_ms}
                    )
                ],
                condition=(PushSubscriptionModel.generation == generation)
                & PushSubscriptionModel.cursors[stream].exists(),
            )
        except UpdateError as exc:
            if _conditional_failed(exc):
                return False
            raise ServerBusy("the cursor could not be moved; retry") from exc
        return True

    def delete(self, name: str) -> None:
        """Delete a ``deleting`` subscription's item (gone already counts as done)."""
        try:
            PushSubscriptionModel(name).delete(
                condition=PushSubscriptionModel.name.does_not_exist()
                | (PushSubscriptionModel.state == DELETING)
            )
        except DeleteError as exc:
            raise ServerBusy("the subscription could not be deleted; retry") from exc

    # -- taps --

    def tap(self, stream: str) -> Tap | None:
        try:
            item = PushSubscriptionModel.get(TAP_PREFIX + stream, consistent_read=True)
        except PushSubscriptionModel.DoesNotExist:
            return None
        except PynamoDBException as exc:
            raise ServerBusy("the push tap could not be read; retry") from exc
        info = json.loads(item.spec or "{}")
        members = _plain(item.members)
        return Tap(
            stream=stream,
            topic=str(info.get("topic", "")),
            storage_index=int(info.get("index", 0)),
            members=frozenset(members),
            version=int(item.version),
            # the tap item keeps its lanes in the subscription items' parallelism attribute
            lanes=int(item.parallelism or 1),
            joined={name: int(at) for name, at in members.items()},
        )

    def join_tap(self, stream: str, topic: str, storage_index: int, name: str) -> None:
        info = json.dumps({"topic": topic, "index": storage_index}, separators=(",", ":"))
        try:
            PushSubscriptionModel(TAP_PREFIX + stream).update(
                actions=[
                    PushSubscriptionModel.spec.set(info),
                    PushSubscriptionModel.members[name].set(self.clock.now_ms()),
                    PushSubscriptionModel.version.add(1),
                ],
                condition=PushSubscriptionModel.members.exists(),
            )
        except UpdateError as exc:
            if not _conditional_failed(exc):
                raise ServerBusy("the push tap could not be changed; retry") from exc
            # the first member: the members map does not exist yet
            try:
                PushSubscriptionModel(
                    TAP_PREFIX + stream,
                    version=1,
                    spec=info,
                    members={name: self.clock.now_ms()},
                ).save(condition=PushSubscriptionModel.name.does_not_exist())
            except PutError as again:
                if not _conditional_failed(again):
                    raise ServerBusy("the push tap could not be changed; retry") from again
                self.join_tap(stream, topic, storage_index, name)

    def set_tap_lanes(self, stream: str, lanes: int) -> None:
        try:
            PushSubscriptionModel(TAP_PREFIX + stream).update(
                actions=[PushSubscriptionModel.parallelism.set(lanes)],
                condition=PushSubscriptionModel.name.exists(),
            )
        except UpdateError as exc:
            if not _conditional_failed(exc):
                raise ServerBusy("the push tap could not be changed; retry") from exc

    def leave_tap(self, stream: str, name: str) -> None:
        try:
            PushSubscriptionModel(TAP_PREFIX + stream).update(
                actions=[
                    PushSubscriptionModel.members[name].remove(),
                    PushSubscriptionModel.version.add(1),
                ],
                condition=PushSubscriptionModel.members.exists(),
            )
        except UpdateError as exc:
            if not _conditional_failed(exc):
                raise ServerBusy("the push tap could not be changed; retry") from exc

    def acquire_tap_lease(self, stream: str, wait_s: float = 10.0) -> str | None:
        """A lease on the tap's mapping (one changer at a time); None if not had in time."""
        token = f"{self.clock.now_ms()}-{id(self)}-{time.monotonic_ns()}"
        deadline = self.clock.now_ms() + int(wait_s * 1000)
        while True:
            now = self.clock.now_ms()
            try:
                PushSubscriptionModel(TAP_PREFIX + stream).update(
                    actions=[
                        PushSubscriptionModel.lease_until_ms.set(now + LEASE_MS),
                        PushSubscriptionModel.lease_token.set(token),
                    ],
                    condition=PushSubscriptionModel.name.exists()
                    & (
                        PushSubscriptionModel.lease_until_ms.does_not_exist()
                        | (PushSubscriptionModel.lease_until_ms < now)
                    ),
                )
                return token
            except UpdateError as exc:
                if not _conditional_failed(exc):
                    raise ServerBusy("the push tap could not be leased; retry") from exc
            if now >= deadline:
                return None
            self.clock.sleep(0.2)

    def release_tap_lease(self, stream: str, token: str) -> None:
        try:
            PushSubscriptionModel(TAP_PREFIX + stream).update(
                actions=[
                    PushSubscriptionModel.lease_until_ms.remove(),
                    PushSubscriptionModel.lease_token.remove(),
                ],
                condition=PushSubscriptionModel.lease_token == token,
            )
        except UpdateError as exc:
            if not _conditional_failed(exc):
                logger.warning("tap lease not released", extra={"stream": stream})


# -- group states ---------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockedKey:
    ordering_key: str
    rq_depth: int
    dlq_depth: int


class GroupStore:
    """Group states (``shoal.aws.tables.PushGroupModel``): consistent reads, conditional writes."""

    def get(self, name: str, ordering_key: str) -> GroupState:
        try:
            item = PushGroupModel.get(name, ordering_digest(ordering_key), consistent_read=True)
        except PushGroupModel.DoesNotExist:
            return GroupState()
        except PynamoDBException as exc:
            raise ServerBusy("the group state could not be read; retry") from exc
        return GroupState.from_json(item.state, int(item.version))

    def get_many(self, name: str, ordering_keys: Iterable[str]) -> dict[str, GroupState]:
        keys = {ordering_digest(k): k for k in ordering_keys}
        out = {k: GroupState() for k in keys.values()}
        if not keys:
            return out
        try:
            for item in PushGroupModel.batch_get(
                [(name, digest) for digest in keys], consistent_read=True
            ):
                out[keys[item.ordering_digest]] = GroupState.from_json(
                    item.state, int(item.version)
                )
        except PynamoDBException as exc:
            raise ServerBusy("group states could not be read; retry") from exc
        return out

    def save(self, name: str, ordering_key: str, state: GroupState) -> GroupState | None:
        """Write ``state`` if the item is still at ``state.version``; None when it moved."""
        version = state.version + 1
        blocked = state.rq.depth > 0 or state.dlq.depth > 0
        item = PushGroupModel(
            name,
            ordering_digest(ordering_key),
            ordering_key=ordering_key,
            version=version,
            state=state.to_json(),
            blocked=name if blocked else None,
            rq_depth=state.rq.depth,
            dlq_depth=state.dlq.depth,
        )
        condition = (
            PushGroupModel.version == state.version
            if state.version
            else PushGroupModel.name.does_not_exist()
        )
        try:
            item.save(condition=condition)
        except PutError as exc:
            if _conditional_failed(exc):
                return None
            raise ServerBusy("the group state could not be written; retry") from exc
        return GroupState.from_json(item.state, version)

    def blocked(self, name: str, limit: int = 10_000) -> Iterator[BlockedKey]:
        try:
            for item in PushGroupModel.blocked_index.query(name, limit=limit):
                yield BlockedKey(
                    item.ordering_key, int(item.rq_depth or 0), int(item.dlq_depth or 0)
                )
        except PynamoDBException as exc:
            raise ServerBusy("blocked keys could not be read; retry") from exc

    def delete_all(self, name: str) -> int:
        count = 0
        try:
            with PushGroupModel.batch_write() as batch:
                for item in PushGroupModel.query(
                    name, attributes_to_get=["name", "ordering_digest"]
                ):
                    batch.delete(item)
                    count += 1
        except PynamoDBException as exc:
            raise ServerBusy("group states could not be deleted; retry") from exc
        return count


# -- queues and mappings --------------------------------------------------------------------


class ReadBudgetExhausted(ServerBusy):
    """A scan used its reads before the shard's end (not an AWS failure)."""


@dataclass(frozen=True)
class StreamRecord:
    shard: str
    sequence_number: str
    arrival_ms: int
    data: bytes


StartingPosition = Literal["TRIM_HORIZON", "LATEST", "AT_TIMESTAMP"]


def push_parts(config: Config, clock: Clock) -> tuple[SubscriptionStore, GroupStore, Queues]:
    """The stores every push service works on (admin, delivery, replay), bound to ``config``."""
    from shoal.aws import tables

    tables.bind(config)
    return SubscriptionStore(clock), GroupStore(), Queues(Streams.from_config(config, clock), clock)


class Queues:
    """RQ/DLQ streams and records, reads by position, and the push function's mappings."""

    def __init__(self, streams: Streams, clock: Clock) -> None:
        self.streams = streams
        self.clock = clock

    @property
    def kinesis(self) -> KinesisClient:
        return self.streams.kinesis

    @property
    def awslambda(self) -> LambdaClient:
        return self.streams.awslambda

    # -- streams --

    def ensure(self, storage: StorageTopic, wait_s: float) -> StreamInfo:
        return self.streams.ensure_stream(storage.stream, storage.partitions, wait_s=wait_s)

    def stream_arn(self, stream: str) -> str | None:
        summary = self._summary(stream)
        return None if summary is None else str(summary["StreamARN"])

    def delete_stream(self, stream: str) -> None:
        try:
            self.kinesis.delete_stream(StreamName=stream, EnforceConsumerDeletion=True)
        except ClientError as exc:
            if error_code(exc) == "ResourceNotFoundException":
                return
            if error_code(exc) == "ResourceInUseException" and self._status(stream) in (
                None,
                "DELETING",
            ):
                return
            # still being created (or resharded): a repeated delete finds it ready
            raise ServerBusy("the stream could not be deleted yet; retry") from exc

    def _status(self, stream: str) -> str | None:
        summary = self._summary(stream)
        return None if summary is None else str(summary["StreamStatus"])

    def _summary(self, stream: str) -> Mapping[str, Any] | None:
        """The stream's description summary; None when it does not exist."""
        try:
            answer = self.kinesis.describe_stream_summary(StreamName=stream)
        except ClientError as exc:
            if error_code(exc) == "ResourceNotFoundException":
                return None
            raise ServerBusy("the stream could not be described; retry") from exc
        return answer["StreamDescriptionSummary"]

    def shards(self, stream: str) -> list[str]:
        """Open shard ids in hash order (partition j is the j-th)."""
        shards: list[Any] = []
        try:
            response = self.kinesis.list_shards(StreamName=stream)
            shards.extend(response["Shards"])
            while response.get("NextToken"):
                response = self.kinesis.list_shards(NextToken=response["NextToken"])
                shards.extend(response["Shards"])
        except ClientError as exc:
            raise ServerBusy("the stream's shards could not be listed; retry") from exc
        open_shards = [
            s for s in shards if "EndingSequenceNumber" not in s.get("SequenceNumberRange", {})
        ]
        open_shards.sort(key=lambda s: int(s["HashKeyRange"]["StartingHashKey"]))
        return [str(s["ShardId"]) for s in open_shards]

    # -- records --

    def put(self, storage: StorageTopic, entry: Entry) -> None:
        """Put one entry in its key's shard; raises ServerBusy if it would not go in.

        A put that timed out may have landed and is put again: the consumer drops an offset it
        has seen, so a duplicate costs nothing but the record.
        """
        key = entry.ordering_key
        record = OutRecord(
            data=encode_entry(entry),
            partition_key=partition_key(key),
            explicit_hash_key=storage.starting_key(storage.partition_for(key)),
        )
        for attempt in range(_PUT_ATTEMPTS):
            if attempt:
                self.clock.sleep(0.05 * 2**attempt)
            if self.streams.put_record(storage.stream, record).ok:
                return
        raise ServerBusy(f"the {entry.queue} entry could not be put; retry")

    def read_at(self, stream: str, shard: str, sequence_number: str) -> bytes | None:
        """The data of one record, or None when the stream no longer holds it."""
        try:
            iterator = self.kinesis.get_shard_iterator(
                StreamName=stream,
                ShardId=shard,
                ShardIteratorType="AT_SEQUENCE_NUMBER",
                StartingSequenceNumber=sequence_number,
            )["ShardIterator"]
            records = self.kinesis.get_records(ShardIterator=iterator, Limit=1)["Records"]
        except ClientError as exc:
            if error_code(exc) in ("ResourceNotFoundException", "InvalidArgumentException"):
                return None
            raise ServerBusy("a record could not be read back; retry") from exc
        if not records or str(records[0]["SequenceNumber"]) != sequence_number:
            return None
        return bytes(records[0]["Data"])

    def read_message(self, source: Source) -> Message | None:
        """A message read again from where a reservation says it is (None: gone or unreadable)."""
        data = self.read_at(source.stream, source.shard, source.sequence_number)
        if data is None:
            return None
        try:
            if source.kind == "queue":
                return decode_entry(data).message
            return decode_record(data)[source.index]
        except (MalformedRecord, IndexError):
            return None

    def scan(
        self,
        stream: str,
        shard: str,
        *,
        after: str | None = None,
        since_ms: int | None = None,
        max_calls: int = 20,
    ) -> Iterator[StreamRecord]:
        """Records of one shard in order: after a sequence number, from a time, or all.

        Stops at the shard's end, or after ``max_calls`` reads (raising ServerBusy, so that a
        caller never mistakes a partial read for the whole shard).
        """
        args: dict[str, Any] = {"StreamName": stream, "ShardId": shard}
        if after is not None:
            args |= {"ShardIteratorType": "AFTER_SEQUENCE_NUMBER", "StartingSequenceNumber": after}
        elif since_ms is not None and since_ms > 0:
            args |= {
                "ShardIteratorType": "AT_TIMESTAMP",
                "Timestamp": datetime.fromtimestamp(since_ms / 1000, UTC),
            }
        else:
            args["ShardIteratorType"] = "TRIM_HORIZON"
        try:
            iterator: str | None = self.kinesis.get_shard_iterator(**args)["ShardIterator"]
            for _ in range(max_calls):
                if iterator is None:
                    return
                response = self.kinesis.get_records(ShardIterator=iterator, Limit=1000)
                for r in response["Records"]:
                    yield StreamRecord(
                        shard=shard,
                        sequence_number=str(r["SequenceNumber"]),
                        arrival_ms=int(r["ApproximateArrivalTimestamp"].timestamp() * 1000),
                        data=bytes(r["Data"]),
                    )
                if not response["Records"] and response.get("MillisBehindLatest", 0) == 0:
                    return
                iterator = response.get("NextShardIterator")
        except ClientError as exc:
            raise ServerBusy("the queue could not be read; retry") from exc
        raise ReadBudgetExhausted("the queue is too long to read in one request; retry")

    # -- event source mappings --

    def mappings(self, stream_arn: str, function: str) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = []
        kwargs: dict[str, Any] = {"EventSourceArn": stream_arn, "FunctionName": function}
        try:
            while True:
                response = self.awslambda.list_event_source_mappings(**kwargs)
                found.extend(dict(m) for m in response.get("EventSourceMappings", []))
                if not response.get("NextMarker"):
                    return sorted(found, key=lambda m: str(m["UUID"]))
                kwargs["Marker"] = response["NextMarker"]
        except ClientError as exc:
            raise ServerBusy("event source mappings could not be listed; retry") from exc

    def create_mapping(
        self,
        stream_arn: str,
        function: str,
        *,
        parallelism: int,
        start: StartingPosition,
        at_ms: int = 0,
    ) -> str:
        options: dict[str, Any] = {
            **MAPPING,
            "ParallelizationFactor": parallelism,
            "StartingPosition": start,
        }
        if start == "AT_TIMESTAMP":
            options["StartingPositionTimestamp"] = datetime.fromtimestamp(at_ms / 1000, UTC)
        try:
            created = self.awslambda.create_event_source_mapping(
                EventSourceArn=stream_arn, FunctionName=function, **options
            )
        except ClientError as exc:
            raise ServerBusy("the event source mapping could not be created; retry") from exc
        return str(created["UUID"])

    def ensure_mapping(
        self,
        stream_arn: str,
        function: str,
        *,
        parallelism: int,
        start: StartingPosition,
        at_ms: int = 0,
    ) -> str:
        """The one mapping of ``function`` on the stream, created if missing (extras removed)."""
        existing = self.mappings(stream_arn, function)
        if not existing:
            self.create_mapping(
                stream_arn, function, parallelism=parallelism, start=start, at_ms=at_ms
            )
            existing = self.mappings(stream_arn, function)
        keep, *extra = [str(m["UUID"]) for m in existing]
        for uuid in extra:
            self.delete_mapping(uuid)
        return keep

    def delete_mapping(self, uuid: str) -> None:
        try:
            self.awslambda.delete_event_source_mapping(UUID=uuid)
        except ClientError as exc:
            if error_code(exc) != "ResourceNotFoundException":
                raise ServerBusy("the event source mapping could not be deleted; retry") from exc

    def set_parallelism(self, uuid: str, parallelism: int) -> None:
        try:
            self.awslambda.update_event_source_mapping(UUID=uuid, ParallelizationFactor=parallelism)
        except ClientError as exc:
            raise ServerBusy("the event source mapping could not be changed; retry") from exc


#: what the push function and the admin treat as "AWS did not answer": retry later
INFRASTRUCTURE_ERRORS = (ServerBusy, PynamoDBException, ClientError, BotoCoreError)
