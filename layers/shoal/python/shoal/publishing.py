"""Publishing: validation, limits, routing, the retained store, and exactly-once by sequence.

Exactly-once Put (publisher_id, publisher_seq), the order of writes
---------------------------------------------------------------------
A publisher's state is one item keyed by (principal sub, publisher_id), so one principal can
never touch another's sequence. A publish with seq s goes through three writes:

1. **Reserve** (conditional UpdateItem ``last_seq == s - 1``): ``last_seq = s`` and a
   *reservation* ``pending[s] = {reserved_at, lease_until, attempt, streams}``. The message id is
   a digest of (sub, publisher_id, seq), so every attempt of that publish carries the same id.
   Of racing retries exactly one wins this write; the others see seq ≤ last.
2. **PutRecord** to the storage topic, started only while the lease has at least
   ``PUT_DEADLINE_MS`` left, with SDK timeouts shorter than that.
3. **Confirm** (UpdateItem conditional on the attempt): remove the reservation.

A request for a seq ≤ last answers 200 ``duplicate`` with the original id once the seq has no
reservation. If it has one whose lease is alive (a racing attempt is between 1 and 3), the
request waits up to ``INFLIGHT_WAIT_MS`` for it to confirm, else answers 503 (retry). If the
lease has expired (the holder crashed or gave up), the request *takes over* the reservation
(conditional on the attempt number), then **reads the stream back**: the shard each earlier
attempt routed to, from ``reserved_at`` to the last lease end (plus a clock-skew margin). A
record with the message id there means step 2 happened before the crash: confirm, no new
record. Otherwise put it now (in the storage topic that is producing now). So a crash between
1 and 2 neither loses the message (the client's retry puts it) nor, between 2 and 3,
publishes it twice (the read-back finds it); the lease makes sure no earlier holder can still
put once the read-back runs. Duplicates in a stream remain possible only when a client retries
a crashed publish after the stream's retention has dropped the window; consumers key their
writes by message id, which absorbs that too.

Where each seq went is answered for duplicates from ``routes`` (the first seq each publisher
sent to each storage topic: storage topics only move forward, so the last one at or before a
seq is where it went) and ``overrides`` (seqs a recovery put elsewhere); the partition follows
from the ordering key.

Kinesis records
---------------
One Kinesis record carries messages of one ordering key from one request, in order (a JSON
header line, then the payloads). Its ``ExplicitHashKey`` is the starting hash key of the key's
partition (that routes it: shard consistent), and its ``PartitionKey`` is the ordering key
(``record_partition_key``): Lambda's parallelization factor splits a shard into lanes by
partition key, so one key's records stay in one lane, in order, however many lanes run (push
subscriptions' ``parallelism``). A key's messages of one record are written all or nothing,
and when a request has more than one record for a key they are written one round at a time: a
record that still fails after the bounded retries fails every later message of its key, so a
retry can never put a later message before an earlier one. Records of different keys go in
the same PutRecords call (which keeps no order among them; none is promised).

A read-back (above) is unaffected: it looks in the partition's shard by message id, whatever
record holds the message.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError
from pydantic import model_validator as _model_validator
from pynamodb.exceptions import DeleteError, PutError, UpdateError

from shoal.aws import tables
from shoal.aws.clients import PUT_CALL_BOUND_MS
from shoal.aws.kinesis import (
    MAX_PUT_RECORDS,
    MAX_PUT_RECORDS_BYTES,
    MAX_RECORD_BYTES,
    OutRecord,
    PutOutcome,
    Streams,
)
from shoal.aws.tables import PublisherModel, RetainedModel
from shoal.composite.directory import TopicDirectory
from shoal.composite.model import DEFAULT_TOPIC, Destination, StorageTopic, is_valid_topic_name
from shoal.composite.store import TopicStore
from shoal.core.auth import Principal
from shoal.core.clock import Clock, SystemClock
from shoal.core.config import Config
from shoal.core.errors import (
    BadRequest,
    Forbidden,
    InvalidPayload,
    InvalidTopic,
    PayloadTooLarge,
    PublisherSeqGap,
    ServerBusy,
    ShoalError,
)
from shoal.core.faults import CrashPoint
from shoal.core.observability import logger
from shoal.records import (
    MalformedRecord,
    Message,
    decode_record,
    encode_record,
    record_partition_key,
    record_size,
)
from shoal.topics.filters import any_matches, first_level, is_publishable_topic

MAX_BATCH = 500
#: a holder starts a Kinesis call only while this much of its lease is left: one call ends
#: (answered or timed out) within ``PUT_CALL_BOUND_MS``, plus a second for the clocks
PUT_DEADLINE_MS = PUT_CALL_BOUND_MS + 1_000
#: a reservation's holder may put only while it holds the lease; a retry takes over after it.
#: Sized from the put's bound, not the function's timeout: a publisher whose request died
#: with its process (a crash, a kill, a Lambda timeout) is answered this long after, at most.
PUBLISH_LEASE_MS = 10_000
#: a duplicate of a publish in flight waits this long for it before answering 503
INFLIGHT_WAIT_MS = 2_000
INFLIGHT_POLL_S = 0.1
#: a read-back window is widened by this much on both sides for clock skew with Kinesis
SKEW_MS = 5_000
#: Kinesis record attempts per round (the first try and the retries of failed records)
PUT_ATTEMPTS = 3
PUT_BACKOFF_S = 0.05
#: a retained message lives in one DynamoDB item (400 KB); leave room for its attributes
MAX_RETAINED_BYTES = 350_000
MAX_PUBLISHER_ID = 128
MAX_SEQ = 2**63 - 1
_MAX_ADMIT_ROUNDS = 100
#: route keys one reservation writes at most (a run is split beyond; keeps expressions small)
_MAX_ROUTE_KEYS = 32

# -- the request ----------------------------------------------------------------------------


class Properties(BaseModel):
    model_config = ConfigDict(extra="forbid")

    content_type: str | None = Field(default=None, max_length=1024)
    #: a name is never empty: moto (DynamoDB under shoal dev) garbles a map key "", and the
    #: inbox of every session the message went to could not be read any more
    user_properties: dict[Annotated[str, Field(min_length=1)], str] = Field(default_factory=dict)
    message_expiry_s: StrictInt | None = Field(default=None, ge=0, le=2**32 - 1)


class PublishRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    topic: str
    payload: str | None = None
    text: str | None = None
    qos: StrictInt = Field(default=1, ge=0, le=2)
    retain: StrictBool = False
    ordering_key: str | None = Field(default=None, min_length=1)
    publisher_id: str | None = Field(
        default=None, min_length=1, max_length=MAX_PUBLISHER_ID, pattern=r"^[^\x00-\x1f\x7f]+$"
    )
    publisher_seq: StrictInt | None = Field(default=None, ge=1, le=MAX_SEQ)
    properties: Properties | None = None

    @_model_validator(mode="after")
    def _publisher_pair(self) -> PublishRequest:
        if (self.publisher_id is None) != (self.publisher_seq is None):
            raise ValueError("publisher_id and publisher_seq come together")
        return self


class BatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    messages: list[Any] = Field(min_length=1, max_length=MAX_BATCH)


def bad_request(error: ValidationError) -> BadRequest:
    """The same answer shoal.api gives a schema error, for one message of a batch."""
    fields = [
        {"field": ".".join(str(p) for p in e["loc"]), "problem": e["msg"]}
        for e in error.errors(include_input=False, include_url=False)
    ]
    return BadRequest("the message does not fit the schema", fields=fields)


# -- the record format ----------------------------------------------------------------------


# -- publisher sequences --------------------------------------------------------------------


def publisher_key(sub: str, publisher_id: str) -> str:
    # the length prefix keeps ("a:b", "c") and ("a", "b:c") apart
    return f"{len(sub)}:{sub}:{publisher_id}"


def sequenced_message_id(key: str, seq: int) -> str:
    """The one message id every attempt of (publisher, seq) carries."""
    return hashlib.blake2b(
        f"{key}#{seq}".encode("utf-8", "surrogatepass"), digest_size=16
    ).hexdigest()


def route_key(composite: str, index: int) -> str:
    return f"{composite}/{index}"


@dataclass(frozen=True)
class Reservation:
    """Seqs lo..hi reserved together, not yet confirmed."""

    lo: int
    hi: int
    reserved_at: int
    lease_until: int
    attempt: int
    #: route keys ("<composite>/<storage topic index>") the attempts so far routed to
    targets: tuple[str, ...]

    def item(self) -> dict[str, Any]:
        return {
            "h": self.hi,
            "r": self.reserved_at,
            "l": self.lease_until,
            "n": self.attempt,
            "t": list(self.targets),
        }

    @classmethod
    def from_item(cls, lo: int, item: dict[str, Any]) -> Reservation:
        return cls(
            lo=lo,
            hi=int(item["h"]),
            reserved_at=int(item["r"]),
            lease_until=int(item["l"]),
            attempt=int(item["n"]),
            targets=tuple(str(s) for s in item.get("t") or ()),
        )


@dataclass(frozen=True)
class PublisherState:
    last_seq: int
    pending: dict[int, Reservation]
    routes: dict[str, int]
    overrides: dict[int, str]

    def reservation_for(self, seq: int) -> Reservation | None:
        return next((r for r in self.pending.values() if r.lo <= seq <= r.hi), None)

    def route_for(self, seq: int, topic: str) -> tuple[str, int] | None:
        """(composite, storage topic index) a settled seq of this MQTT topic went to."""
        override = self.overrides.get(seq)
        if override is not None:
            composite, _, index = override.rpartition("/")
            return composite, int(index)
        candidate = first_level(topic)
        for composite in (candidate, DEFAULT_TOPIC):
            indexes = [
                int(k.rpartition("/")[2])
                for k, first in self.routes.items()
                if k.rpartition("/")[0] == composite and first <= seq
            ]
            if indexes and is_valid_topic_name(composite):
                return composite, max(indexes)
        return None


class Sequences:
    """The publishers table: reservations and confirmations, each one conditional write."""

    def read(self, key: str) -> PublisherState | None:
        try:
            item = PublisherModel.get(key, consistent_read=True)
        except PublisherModel.DoesNotExist:
            return None
        return _state(item)

    def reserve(
        self, key: str, expected_last: int, run: Reservation, routes: dict[str, int]
    ) -> bool:
        """Reserve ``run`` if the last seq is still ``expected_last``; False if it moved."""
        try:
            if expected_last == 0:
                PublisherModel(
                    key,
                    last_seq=run.hi,
                    pending={str(run.lo): run.item()},
                    routes=routes,
                    overrides={},
                ).save(condition=PublisherModel.key.does_not_exist())
            else:
                PublisherModel(key).update(
                    actions=[
                        PublisherModel.last_seq.set(run.hi),
                        PublisherModel.pending[str(run.lo)].set(run.item()),
                        *(
                            PublisherModel.routes[k].set(PublisherModel.routes[k] | first)
                            for k, first in routes.items()
                        ),
                    ],
                    condition=PublisherModel.last_seq == expected_last,
                )
        except (PutError, UpdateError) as exc:
            if exc.cause_response_code == "ConditionalCheckFailedException":
                return False
            raise ServerBusy("the publisher's sequence could not be recorded; retry") from exc
        return True

    def take_over(self, key: str, old: Reservation, new: Reservation) -> bool:
        return self._update(
            key,
            old,
            [PublisherModel.pending[str(old.lo)].set(new.item())],
        )

    def settle(
        self,
        key: str,
        run: Reservation,
        remaining: list[Reservation],
        overrides: dict[int, str],
    ) -> bool:
        """Confirm the seqs of ``run`` outside ``remaining``, which stay reserved (released)."""
        actions: list[Any] = [PublisherModel.pending[str(r.lo)].set(r.item()) for r in remaining]
        if all(r.lo != run.lo for r in remaining):
            actions.append(PublisherModel.pending[str(run.lo)].remove())
        actions += [PublisherModel.overrides[str(s)].set(v) for s, v in overrides.items()]
        return self._update(key, run, actions)

    def _update(self, key: str, run: Reservation, actions: list[Any]) -> bool:
        try:
            PublisherModel(key).update(
                actions=actions,
                condition=PublisherModel.pending[str(run.lo)]["n"] == run.attempt,
            )
        except UpdateError as exc:
            if exc.cause_response_code == "ConditionalCheckFailedException":
                return False
            raise ServerBusy("the publisher's sequence could not be recorded; retry") from exc
        return True


def _state(item: PublisherModel) -> PublisherState:
    pending = item.pending.as_dict() if item.pending else {}
    routes = item.routes.as_dict() if item.routes else {}
    overrides = item.overrides.as_dict() if item.overrides else {}
    return PublisherState(
        last_seq=int(item.last_seq),
        pending={int(lo): Reservation.from_item(int(lo), v) for lo, v in pending.items()},
        routes={str(k): int(v) for k, v in routes.items()},
        overrides={int(k): str(v) for k, v in overrides.items()},
    )


def _ranges(seqs: list[int]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive seqs, in order."""
    out: list[tuple[int, int]] = []
    for s in sorted(seqs):
        if out and out[-1][1] == s - 1:
            out[-1] = (out[-1][0], s)
        else:
            out.append((s, s))
    return out


# -- the retained store ---------------------------------------------------------------------


def retained_key(topic: str) -> str:
    return hashlib.sha256(topic.encode()).hexdigest()


class RetainedStore:
    """The latest retained message per topic name; older publishes never overwrite newer."""

    def apply(self, message: Message, composite: str) -> None:
        newer_or_absent = RetainedModel.key.does_not_exist() | (
            RetainedModel.published_at_ms <= message.published_at_ms
        )
        try:
            if message.payload:
                RetainedModel(
                    retained_key(message.topic),
                    topic=message.topic,
                    composite_topic=composite,
                    message_id=message.message_id,
                    payload=message.payload,
                    qos=message.qos,
                    properties=json.dumps(message.properties) if message.properties else None,
                    published_at_ms=message.published_at_ms,
                    publisher=message.sub,
                ).save(condition=newer_or_absent)
            else:
                RetainedModel(retained_key(message.topic)).delete(condition=newer_or_absent)
        except (PutError, DeleteError) as exc:
            if exc.cause_response_code != "ConditionalCheckFailedException":
                raise ServerBusy("the retained message could not be stored; retry") from exc

    def get(self, topic: str) -> RetainedModel | None:
        try:
            return RetainedModel.get(retained_key(topic), consistent_read=True)
        except RetainedModel.DoesNotExist:
            return None


# -- the service ----------------------------------------------------------------------------


@dataclass(eq=False)
class _Item:
    """One message of a request on its way through the publish path."""

    position: int
    request: PublishRequest | None = None
    payload: bytes = b""
    ordering_key: str = ""
    destination: Destination | None = None
    partition: int = 0
    message_id: str = ""
    published_at: int = 0
    key: str | None = None
    seq: int | None = None
    sub: str = ""
    # outcomes
    error: ShoalError | None = None
    duplicate: bool = False
    answer: tuple[int, int] | None = None  # (storage topic index, partition) of a duplicate
    ticket: _Ticket | None = None
    mirror_of: _Item | None = None
    found: bool = False  # a recovery read the record back: no put
    put_ok: bool = False

    @property
    def storage(self) -> StorageTopic:
        assert self.destination is not None
        return self.destination.storage

    @property
    def route(self) -> str:
        assert self.destination is not None
        return route_key(self.destination.topic.name, self.destination.storage.index)

    @property
    def resolved(self) -> bool:
        return (
            self.error is not None
            or self.ticket is not None
            or self.mirror_of is not None
            or self.answer is not None
        )

    def message(self) -> Message:
        request = self.request
        assert request is not None
        properties = request.properties.model_dump(exclude_none=True) if request.properties else {}
        if not properties.get("user_properties"):
            properties.pop("user_properties", None)
        return Message(
            message_id=self.message_id,
            topic=request.topic,
            payload=self.payload,
            qos=request.qos,
            retain=request.retain,
            ordering_key=self.ordering_key,
            published_at_ms=self.published_at,
            sub=self.sub,
            publisher_id=request.publisher_id,
            publisher_seq=request.publisher_seq,
            properties=properties,
        )


@dataclass(eq=False)
class _Ticket:
    """A reservation this request holds: its messages are put (or read back) and confirmed."""

    key: str
    run: Reservation
    items: list[_Item]
    recovery: bool = False
    #: a recovery reads back where earlier attempts routed, up to this instant
    earlier_targets: tuple[str, ...] = ()
    earlier_lease_end: int = 0


class PublishService:
    def __init__(
        self,
        streams: Streams,
        directory: TopicDirectory,
        clock: Clock | None = None,
        sequences: Sequences | None = None,
        retained: RetainedStore | None = None,
        *,
        crash: CrashPoint | None = None,
    ) -> None:
        self.streams = streams
        self.directory = directory
        self.clock = clock or SystemClock()
        self.sequences = sequences or Sequences()
        self.retained = retained or RetainedStore()
        self.crash = crash or CrashPoint()

    @classmethod
    def from_config(cls, config: Config, clock: Clock | None = None) -> PublishService:
        tables.bind(config)
        clock = clock or SystemClock()
        return cls(
            Streams.from_config(config, clock),
            TopicDirectory(TopicStore.from_config(config), clock),
            clock,
            crash=CrashPoint.from_config(config, "publish"),
        )

    # -- entry points ------------------------------------------------------------------

    def publish(self, who: Principal, request: PublishRequest) -> tuple[int, dict[str, Any]]:
        (item,) = self._run(who, [request])
        if item.error is not None:
            raise item.error
        return self._answer(item)

    def publish_batch(self, who: Principal, messages: Sequence[Any]) -> list[dict[str, Any]]:
        requests: list[PublishRequest | ShoalError] = []
        for raw in messages:
            if not isinstance(raw, dict):
                requests.append(BadRequest("each message must be a JSON object"))
                continue
            try:
                requests.append(PublishRequest.model_validate(raw))
            except ValidationError as exc:
                requests.append(bad_request(exc))
        out: list[dict[str, Any]] = []
        for item in self._run(who, requests):
            if item.error is not None:
                body = item.error.body()
                body["error"]["status"] = item.error.status
                out.append(body)
            else:
                out.append(self._answer(item)[1])
        return out

    # -- the path ----------------------------------------------------------------------

    def _run(self, who: Principal, requests: Sequence[PublishRequest | ShoalError]) -> list[_Item]:
        items = self._prepare(who, requests)
        valid = [i for i in items if i.error is None]
        by_publisher: dict[str, list[_Item]] = {}
        for item in valid:
            if item.key is not None:
                by_publisher.setdefault(item.key, []).append(item)
        tickets: list[_Ticket] = []
        for key, group in by_publisher.items():
            tickets += self._admit(key, group)
        if tickets:
            self.crash.at("after_reserve")
        for ticket in tickets:
            if ticket.recovery:
                self._read_back(ticket)
        to_put = [
            i
            for i in valid
            if i.error is None and i.mirror_of is None and i.answer is None and not i.found
        ]
        self._put(self._within_lease(to_put))
        if to_put:
            self.crash.at("after_put")
        for item in valid:
            if (item.put_ok or item.found) and item.request is not None and item.request.retain:
                try:
                    self.retained.apply(item.message(), item.destination.topic.name)  # type: ignore[union-attr]
                except ServerBusy as exc:
                    item.put_ok, item.found, item.error = False, False, exc
        for ticket in tickets:
            self._settle(ticket)
        for item in items:
            if item.mirror_of is not None:
                first = item.mirror_of
                item.error = first.error
                item.destination, item.partition = first.destination, first.partition
                item.answer = first.answer
                item.duplicate = True
        return items

    def _prepare(
        self, who: Principal, requests: Sequence[PublishRequest | ShoalError]
    ) -> list[_Item]:
        items = [_Item(position=n, sub=who.sub) for n in range(len(requests))]
        checked: list[_Item] = []
        for item, request in zip(items, requests, strict=True):
            if isinstance(request, ShoalError):
                item.error = request
                continue
            item.request = request
            try:
                self._validate(who, item, request)
            except ShoalError as exc:
                item.error = exc
                continue
            checked.append(item)
        if not checked:
            return items
        destinations = self.directory.destinations([i.request.topic for i in checked])  # type: ignore[union-attr]
        now = self.clock.now_ms()
        for item, destination in zip(checked, destinations, strict=True):
            if isinstance(destination, ShoalError):
                item.error = destination
                continue
            item.destination = destination
            item.partition = destination.storage.partition_for(item.ordering_key)
            item.published_at = now
            if item.key is not None and item.seq is not None:
                item.message_id = sequenced_message_id(item.key, item.seq)
            else:
                item.message_id = uuid.uuid4().hex
            size = record_size(
                [item.message().header()],
                len(item.payload),
                record_partition_key(item.ordering_key),
            )
            if size > MAX_RECORD_BYTES:
                item.error = PayloadTooLarge(
                    f"the message takes {size} bytes in its record, over Kinesis' "
                    f"{MAX_RECORD_BYTES}; the payload may take at most "
                    f"{MAX_RECORD_BYTES - (size - len(item.payload))}",
                    limit=MAX_RECORD_BYTES - (size - len(item.payload)),
                )
        return items

    def _validate(self, who: Principal, item: _Item, request: PublishRequest) -> None:
        if not is_publishable_topic(request.topic):
            raise InvalidTopic(
                "a topic name is 1 to 65,535 UTF-8 bytes without wildcards or NUL and does "
                "not start with $"
            )
        if not any_matches(who.publish, request.topic):
            raise Forbidden("the principal may not publish to this topic")
        if request.payload is not None and request.text is not None:
            raise InvalidPayload("send either payload (base64) or text, not both")
        try:
            if request.payload is not None:
                item.payload = base64.b64decode(request.payload, validate=True)
            elif request.text is not None:
                item.payload = request.text.encode("utf-8")
        except (binascii.Error, ValueError) as exc:
            raise InvalidPayload("payload must be base64 (or send text)") from exc
        item.ordering_key = request.ordering_key or request.topic
        for name, value in (
            ("ordering_key", item.ordering_key),
            ("publisher_id", request.publisher_id),
        ):
            if value is not None and not _utf8(value):
                raise BadRequest(f"{name} is not valid UTF-8", field=name)
        if request.properties is not None:
            strings = [request.properties.content_type or ""]
            for k, v in request.properties.user_properties.items():
                strings += [k, v]
            if not all(_utf8(s) for s in strings):
                raise BadRequest("properties must be valid UTF-8", field="properties")
        if request.retain and item.payload:
            props = request.properties.model_dump_json() if request.properties else ""
            size = len(item.payload) + len(request.topic.encode()) + len(props)
            if size > MAX_RETAINED_BYTES:
                raise PayloadTooLarge(
                    f"a retained message (payload, topic and properties) takes at most "
                    f"{MAX_RETAINED_BYTES} bytes",
                    limit=MAX_RETAINED_BYTES,
                )
        if request.publisher_id is not None and request.publisher_seq is not None:
            item.key = publisher_key(who.sub, request.publisher_id)
            item.seq = request.publisher_seq

    # -- sequencing --------------------------------------------------------------------

    def _admit(self, key: str, items: list[_Item]) -> list[_Ticket]:
        """Reserve, recover or answer each sequenced message of one publisher, in order."""
        tickets: list[_Ticket] = []
        state: PublisherState | None = None
        waited_ms = 0
        for _ in range(_MAX_ADMIT_ROUNDS):
            open_items = [i for i in items if not i.resolved]
            if not open_items:
                return tickets
            seqs = [i.seq for i in open_items if i.seq is not None]
            # Optimistic: assume the first seq is the next one; read only when a write fails.
            last = state.last_seq if state is not None else seqs[0] - 1
            if state is None and min(seqs) <= last:
                state = self.sequences.read(key)
                if state is None:
                    state = PublisherState(0, {}, {}, {})
                continue
            now = self.clock.now_ms()
            expected = last + 1
            run: list[_Item] = []
            old: list[_Item] = []
            # a gap is only final once `last` is known to be true (the writes below succeed)
            gaps: list[tuple[_Item, int]] = []
            for item in open_items:
                seq = item.seq
                assert seq is not None
                if seq == expected:
                    run.append(item)
                    expected += 1
                elif last < seq < expected:
                    item.mirror_of = next(r for r in run if r.seq == seq)
                elif seq <= last:
                    old.append(item)
                else:
                    gaps.append((item, expected))
            moved = False
            waiting: list[_Item] = []
            recover: dict[int, list[_Item]] = {}
            if old:
                assert state is not None
                first_of: dict[int, _Item] = {}
                for item in old:
                    assert item.seq is not None
                    if item.seq in first_of:
                        item.mirror_of = first_of[item.seq]
                        continue
                    first_of[item.seq] = item
                    reservation = state.reservation_for(item.seq)
                    if reservation is None:
                        self._answer_duplicate(item, state)
                    elif reservation.lease_until > now:
                        waiting.append(item)
                    else:
                        recover.setdefault(reservation.lo, []).append(item)
            for lo, group in recover.items():
                assert state is not None
                old_run = state.pending[lo]
                targets = tuple(dict.fromkeys((*old_run.targets, *(i.route for i in group))))
                new_run = Reservation(
                    lo=old_run.lo,
                    hi=old_run.hi,
                    reserved_at=old_run.reserved_at,
                    lease_until=now + PUBLISH_LEASE_MS,
                    attempt=old_run.attempt + 1,
                    targets=targets,
                )
                if not self.sequences.take_over(key, old_run, new_run):
                    moved = True
                    break
                for item in group:
                    item.published_at = old_run.reserved_at
                tickets.append(
                    _Ticket(
                        key,
                        new_run,
                        group,
                        recovery=True,
                        earlier_targets=old_run.targets,
                        earlier_lease_end=old_run.lease_until,
                    )
                )
                for item in group:
                    item.ticket = tickets[-1]
            if not moved and run:
                moved = not self._reserve_run(key, last, run, now, tickets)
            if moved:
                state = self.sequences.read(key) or PublisherState(0, {}, {}, {})
                continue
            for item, wanted in gaps:
                item.error = PublisherSeqGap(
                    f"publisher_seq {item.seq} skips ahead; expected {wanted}", expected=wanted
                )
            if waiting:
                if waited_ms >= INFLIGHT_WAIT_MS:
                    assert state is not None
                    for item in waiting:
                        # by the lease's end the holder has confirmed, or a retry takes over
                        held = state.reservation_for(item.seq)  # type: ignore[arg-type]
                        left_ms = held.lease_until - self.clock.now_ms() if held is not None else 0
                        item.error = ServerBusy(
                            "this publish is in flight in another request; retry shortly",
                            retry_after_s=-(-left_ms // 1000),
                        )
                    return tickets
                self.clock.sleep(INFLIGHT_POLL_S)
                waited_ms += int(INFLIGHT_POLL_S * 1000)
                state = self.sequences.read(key) or PublisherState(0, {}, {}, {})
        for item in items:
            if not item.resolved:
                item.error = ServerBusy("the publisher's sequence is contended; retry")
        return tickets

    def _reserve_run(
        self, key: str, last: int, run: list[_Item], now: int, tickets: list[_Ticket]
    ) -> bool:
        """Reserve ``run`` (consecutive seqs after ``last``) in chunks of few route keys."""
        chunks: list[list[_Item]] = [[]]
        keys: set[str] = set()
        for item in run:
            rk = item.route
            if rk not in keys and len(keys) >= _MAX_ROUTE_KEYS:
                chunks.append([])
                keys = set()
            keys.add(rk)
            chunks[-1].append(item)
        expected_last = last
        for chunk in chunks:
            routes: dict[str, int] = {}
            for item in chunk:
                routes.setdefault(item.route, item.seq)  # type: ignore[arg-type]
            lo, hi = chunk[0].seq, chunk[-1].seq
            assert lo is not None and hi is not None
            reservation = Reservation(
                lo=lo,
                hi=hi,
                reserved_at=now,
                lease_until=now + PUBLISH_LEASE_MS,
                attempt=1,
                targets=tuple(dict.fromkeys(i.route for i in chunk)),
            )
            if not self.sequences.reserve(key, expected_last, reservation, routes):
                return False
            ticket = _Ticket(key, reservation, chunk)
            tickets.append(ticket)
            for item in chunk:
                item.ticket = ticket
            expected_last = hi
        return True

    def _answer_duplicate(self, item: _Item, state: PublisherState) -> None:
        assert item.seq is not None and item.request is not None and item.key is not None
        item.message_id = sequenced_message_id(item.key, item.seq)
        item.duplicate = True
        route = state.route_for(item.seq, item.request.topic)
        storage = None
        if route is not None:
            topic = self.directory.topic(route[0])
            if topic is not None and route[1] < len(topic.storage_topics):
                storage = topic.storage_topics[route[1]]
        if storage is None:
            # no record of where it went (cannot happen for a seq this path reserved)
            storage = item.storage
        item.answer = (storage.index, storage.partition_for(item.ordering_key))

    def _read_back(self, ticket: _Ticket) -> None:
        """Find which of a crashed attempt's messages reached their stream already."""
        earlier: list[StorageTopic] = []
        for target in ticket.earlier_targets:
            composite, _, index = target.rpartition("/")
            topic = self.directory.topic(composite)
            if topic is not None and int(index) < len(topic.storage_topics):
                earlier.append(topic.storage_topics[int(index)])
        wanted: dict[tuple[StorageTopic, int], list[_Item]] = {}
        for item in ticket.items:
            for storage in earlier:
                partition = storage.partition_for(item.ordering_key)
                wanted.setdefault((storage, partition), []).append(item)
        since = ticket.run.reserved_at - SKEW_MS
        until = ticket.earlier_lease_end + SKEW_MS
        for (storage, partition), group in wanted.items():
            stream = storage.stream
            ids = {i.message_id: i for i in group if not i.found}
            if not ids:
                continue
            try:
                for data in self.streams.read_window(
                    stream, storage.starting_key(partition), since, until
                ):
                    try:
                        messages = decode_record(data)
                    except MalformedRecord:
                        continue
                    for message in messages:
                        found = ids.pop(message.message_id, None)
                        if found is not None:
                            found.found = True
                            found.answer = (storage.index, partition)
                    if not ids:
                        break
            except ServerBusy as exc:
                for item in group:
                    if not item.found:
                        item.error = exc

    # -- Kinesis -----------------------------------------------------------------------

    def _within_lease(self, items: list[_Item]) -> list[_Item]:
        now = self.clock.now_ms()
        out: list[_Item] = []
        for item in items:
            ticket = item.ticket
            if ticket is not None and now >= ticket.run.lease_until - PUT_DEADLINE_MS:
                item.error = ServerBusy("the publish took too long; retry")
            else:
                out.append(item)
        return out

    def _put(self, items: list[_Item]) -> None:
        if not items:
            return
        # one lane per (stream, partition, ordering key): a record holds one key's messages
        lanes: dict[tuple[str, int, str], list[_Item]] = {}
        for item in items:
            lane = (item.storage.stream, item.partition, item.ordering_key)
            lanes.setdefault(lane, []).append(item)
        packed = {lane: _pack(group) for lane, group in lanes.items()}
        single = sum(len(records) for records in packed.values()) == 1
        failed: set[tuple[str, int, str]] = set()
        busy = ServerBusy("the storage topic did not take the message; retry")
        for index in range(max(len(records) for records in packed.values())):
            round_ = [
                (lane, records[index])
                for lane, records in packed.items()
                if index < len(records) and lane not in failed
            ]
            outcomes = self._put_round(
                [(lane[0], self._record(group), _put_deadline(group)) for lane, group in round_],
                single,
            )
            for (lane, group), outcome in zip(round_, outcomes, strict=True):
                for item in group:
                    item.put_ok = outcome.ok
                    if not outcome.ok:
                        item.error = busy
                if not outcome.ok:
                    failed.add(lane)
        for lane in failed:
            for item in lanes[lane]:
                if not item.put_ok:
                    item.error = busy

    def _record(self, group: list[_Item]) -> OutRecord:
        first = group[0]
        return OutRecord(
            data=encode_record([i.message() for i in group]),
            partition_key=record_partition_key(first.ordering_key),
            explicit_hash_key=first.storage.starting_key(first.partition),
        )

    def _put_round(
        self, records: list[tuple[str, OutRecord, int | None]], single: bool
    ) -> list[PutOutcome]:
        """Put records (of distinct keys), retrying only the failed ones, bounded.

        No call starts for a record past its deadline (its reservation's lease, less what a
        call can take): a put of a sequenced message must end before a retry may take its
        reservation over and read the stream back.
        """
        outcomes: list[PutOutcome] = [PutOutcome(error_code="NotAttempted")] * len(records)
        todo = list(range(len(records)))
        for attempt in range(PUT_ATTEMPTS):
            if attempt:
                self.clock.sleep(PUT_BACKOFF_S * 2 ** (attempt - 1))
            by_stream: dict[str, list[int]] = {}
            for n in todo:
                by_stream.setdefault(records[n][0], []).append(n)
            for stream, indexes in by_stream.items():
                if single:
                    n = indexes[0]
                    if self._in_time(records[n][2]):
                        outcomes[n] = self.streams.put_record(stream, records[n][1])
                    continue
                for chunk in _chunks(indexes, [records[n][1].size for n in indexes]):
                    timely = [n for n in chunk if self._in_time(records[n][2])]
                    if not timely:
                        continue
                    results = self.streams.put_records(stream, [records[n][1] for n in timely])
                    for n, result in zip(timely, results, strict=True):
                        outcomes[n] = result
            # an ambiguous failure is not retried here: the record may be in the stream, and
            # only a read-back (the client's retry of a sequenced publish) can tell
            todo = [
                n
                for n in todo
                if not outcomes[n].ok and not outcomes[n].ambiguous and self._in_time(records[n][2])
            ]
            if not todo:
                break
        return outcomes

    def _in_time(self, deadline_ms: int | None) -> bool:
        return deadline_ms is None or self.clock.now_ms() < deadline_ms

    # -- confirmation ------------------------------------------------------------------

    def _settle(self, ticket: _Ticket) -> None:
        done = {i.seq for i in ticket.items if (i.put_ok or i.found) and i.error is None}
        run = ticket.run
        # Seqs not done (failed, or of the run but not in this request) stay reserved for their
        # own retries, released: a retry may take them over at once and reads back up to now.
        remaining = [s for s in range(run.lo, run.hi + 1) if s not in done]
        released = [
            Reservation(lo, hi, run.reserved_at, self.clock.now_ms(), run.attempt, run.targets)
            for lo, hi in _ranges(remaining)
        ]
        overrides: dict[int, str] = {}
        if ticket.recovery:
            for item in ticket.items:
                if item.put_ok and item.seq is not None:
                    overrides[item.seq] = item.route
        if not self.sequences.settle(ticket.key, run, released, overrides):
            # Another request took the reservation over after this one's lease: it reads the
            # stream back, and this request's puts finished before that lease ended.
            logger.warning("reservation taken over before it was confirmed")

    def _answer(self, item: _Item) -> tuple[int, dict[str, Any]]:
        assert item.request is not None
        if item.answer is not None:
            storage_index, partition = item.answer
        else:
            storage_index, partition = item.storage.index, item.partition
        duplicate = item.duplicate or (item.ticket is not None and item.ticket.recovery)
        body = {
            "message_id": item.message_id,
            "topic": item.request.topic,
            "storage_topic": storage_index,
            "partition": partition,
            "duplicate": duplicate,
        }
        return (200 if duplicate else 201), body


def _put_deadline(group: list[_Item]) -> int | None:
    """The last instant a call may start to put ``group``: its leases' end less a call's bound."""
    leases = [i.ticket.run.lease_until for i in group if i.ticket is not None]
    return min(leases) - PUT_DEADLINE_MS if leases else None


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _pack(items: list[_Item]) -> list[list[_Item]]:
    """Messages of one ordering key, in order, packed into as few records as fit."""
    records: list[list[_Item]] = []
    headers: list[bytes] = []
    payload = 0
    for item in items:
        header = item.message().header()
        if (
            records
            and record_size(
                [*headers, header],
                payload + len(item.payload),
                record_partition_key(item.ordering_key),
            )
            <= MAX_RECORD_BYTES
        ):
            records[-1].append(item)
            headers.append(header)
            payload += len(item.payload)
        else:
            records.append([item])
            headers, payload = [header], len(item.payload)
    return records


def _chunks(indexes: list[int], sizes: list[int]) -> list[list[int]]:
    """Split one PutRecords call's records by Kinesis' count and byte limits, keeping order."""
    chunks: list[list[int]] = [[]]
    total = 0
    for n, size in zip(indexes, sizes, strict=True):
        if chunks[-1] and (
            len(chunks[-1]) >= MAX_PUT_RECORDS or total + size > MAX_PUT_RECORDS_BYTES
        ):
            chunks.append([])
            total = 0
        chunks[-1].append(n)
        total += size
    return chunks
