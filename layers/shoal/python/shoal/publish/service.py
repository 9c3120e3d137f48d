"""The publish path: validation, limits, routing, retained messages, exactly-once by sequence.

Exactly-once Put (publisher_id, publisher_seq), the order of writes
---------------------------------------------------------------------
A publisher's state is one item keyed by (principal sub, publisher_id), so one principal can
never touch another's sequence. A publish with seq s goes through three writes:

1. **Reserve** (conditional UpdateItem ``last_seq == s - 1``): ``last_seq = s`` and a
   *reservation* ``pending[s] = {reserved_at, held_until, attempt, streams}``. The message id is
   a digest of (sub, publisher_id, seq), so every attempt of that publish carries the same id.
   Of racing retries exactly one wins this write; the others see seq ≤ last.
2. **PutRecord** to the storage topic, started only while the hold has at least
   ``PUT_DEADLINE_MS`` left (``shoal.publish.writer``), with SDK timeouts shorter than that.
3. **Confirm** (UpdateItem conditional on the attempt): remove the reservation.

A request for a seq ≤ last answers 200 ``duplicate`` with the original id once the seq has no
reservation. If it has one whose hold is alive (a racing attempt is between 1 and 3), the
request waits up to ``INFLIGHT_WAIT_MS`` for it to confirm, else answers 503 (retry); the
request's later seqs wait and answer with it, so none is put before an earlier one. If the
hold has expired (the holder crashed or gave up), the request *takes over* the reservation
(conditional on the attempt number), then **reads the stream back**: the shard each earlier
attempt routed to, from ``reserved_at`` to the last hold end (plus a clock-skew margin). A
record with the message id there means step 2 happened before the crash: confirm, no new
record. Otherwise put it now (in the storage topic that is producing now). So a crash between
1 and 2 neither loses the message (the client's retry puts it) nor, between 2 and 3,
publishes it twice (the read-back finds it); the hold makes sure no earlier holder can still
put once the read-back runs. Duplicates in a stream remain possible only when a client retries
a crashed publish after the stream's retention has dropped the window; consumers key their
writes by message id, which absorbs that too.

Where each seq went is answered for duplicates from ``routes`` (the first seq each publisher
sent to each storage topic: storage topics only move forward, so the last one at or before a
seq is where it went) and ``overrides`` (where a recovery put or found a seq); the partition follows
from the ordering key.
"""

from __future__ import annotations

import base64
import binascii
import uuid
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from shoal.aws.kinesis import MAX_RECORD_BYTES, Streams
from shoal.composite.directory import TopicDirectory
from shoal.composite.model import StorageTopic
from shoal.composite.store import TopicStore
from shoal.core import metrics
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
from shoal.core.observability import count, logger
from shoal.publish.items import Item, Ticket
from shoal.publish.request import PublishRequest, bad_request
from shoal.publish.retained import MAX_RETAINED_BYTES, RetainedStore
from shoal.publish.sequences import (
    RESERVATION_HOLD_MS,
    PublisherState,
    Reservation,
    Sequences,
    consecutive_runs,
    publisher_key,
    sequenced_message_id,
)
from shoal.publish.writer import RecordWriter
from shoal.records import MalformedRecord, decode_record, record_partition_key, record_size
from shoal.topics.filters import any_matches, is_publishable_topic

#: a duplicate of a publish in flight waits this long for it before answering 503
INFLIGHT_WAIT_MS = 2_000
INFLIGHT_POLL_S = 0.1
#: a read-back window is widened by this much on both sides for clock skew with Kinesis
SKEW_MS = 5_000
_MAX_ADMIT_ROUNDS = 100
#: route keys one reservation writes at most (a run is split beyond; keeps expressions small)
_MAX_ROUTE_KEYS = 32


class PublishService:
    def __init__(
        self,
        streams: Streams,
        directory: TopicDirectory,
        sequences: Sequences,
        retained: RetainedStore,
        clock: Clock | None = None,
        *,
        crash: CrashPoint | None = None,
    ) -> None:
        self.streams = streams
        self.directory = directory
        self.sequences = sequences
        self.retained = retained
        self.clock = clock or SystemClock()
        self.writer = RecordWriter(streams, self.clock)
        self.crash = crash or CrashPoint()

    @classmethod
    def from_config(cls, config: Config, clock: Clock | None = None) -> PublishService:
        clock = clock or SystemClock()
        return cls(
            Streams.from_config(config, clock),
            TopicDirectory(TopicStore.from_config(config), clock),
            Sequences.from_config(config),
            RetainedStore.from_config(config),
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

    def _run(self, who: Principal, requests: Sequence[PublishRequest | ShoalError]) -> list[Item]:
        items = self._prepare(who, requests)
        valid = [i for i in items if i.error is None]
        by_publisher: dict[str, list[Item]] = {}
        for item in valid:
            if item.key is not None:
                by_publisher.setdefault(item.key, []).append(item)
        tickets: list[Ticket] = []
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
        self.writer.put(self.writer.within_hold(to_put))
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
        # one count per request, not per message
        count(metrics.PUBLISHED, sum(1 for i in items if i.error is None and not _duplicate(i)))
        return items

    def _prepare(
        self, who: Principal, requests: Sequence[PublishRequest | ShoalError]
    ) -> list[Item]:
        items = [Item(position=n, sub=who.sub) for n in range(len(requests))]
        checked: list[Item] = []
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
        # taken before the choice: a put must end within ROUTED_PUT_BOUND_MS of it, so the
        # sealer of a storage topic behind the produce pointer can wait that long and no longer
        routed_at = self.clock.now_ms()
        destinations = self.directory.destinations([i.request.topic for i in checked])  # type: ignore[union-attr]
        now = self.clock.now_ms()
        for item, destination in zip(checked, destinations, strict=True):
            if isinstance(destination, ShoalError):
                item.error = destination
                continue
            item.destination = destination
            item.routed_at = routed_at
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

    def _validate(self, who: Principal, item: Item, request: PublishRequest) -> None:
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

    def _admit(self, key: str, items: list[Item]) -> list[Ticket]:
        """Reserve, recover or answer each sequenced message of one publisher, in order."""
        tickets: list[Ticket] = []
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
            run: list[Item] = []
            old: list[Item] = []
            # a gap is only final once `last` is known to be true (the writes below succeed)
            gaps: list[tuple[Item, int]] = []
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
            waiting: list[Item] = []
            recover: dict[int, list[Item]] = {}
            if old:
                assert state is not None
                first_of: dict[int, Item] = {}
                for item in old:
                    assert item.seq is not None
                    if item.seq in first_of:
                        item.mirror_of = first_of[item.seq]
                        continue
                    first_of[item.seq] = item
                    reservation = state.reservation_for(item.seq)
                    if reservation is None:
                        self._answer_duplicate(item, state)
                    elif reservation.held_until > now:
                        waiting.append(item)
                    else:
                        recover.setdefault(reservation.lo, []).append(item)
            # A seq held by a live request (one still running, whose client gave up on it)
            # holds back every later seq of the publisher: put now, a later message would go
            # before the earlier one in its ordering key's partition (the publisher's seqs are
            # its publish order). They wait with it, and are told to retry with it.
            held_from = min((i.seq for i in waiting if i.seq is not None), default=None)
            held_back: list[Item] = []
            if held_from is not None:
                for lo in [lo for lo in recover if lo > held_from]:
                    held_back += recover.pop(lo)
                held_back += run
                run = []
            for lo, group in recover.items():
                assert state is not None
                old_run = state.pending[lo]
                targets = tuple(dict.fromkeys((*old_run.targets, *(i.route for i in group))))
                new_run = Reservation(
                    lo=old_run.lo,
                    hi=old_run.hi,
                    reserved_at=old_run.reserved_at,
                    held_until=now + RESERVATION_HOLD_MS,
                    attempt=old_run.attempt + 1,
                    targets=targets,
                )
                if not self.sequences.take_over(key, old_run, new_run):
                    moved = True
                    break
                for item in group:
                    item.published_at = old_run.reserved_at
                tickets.append(
                    Ticket(
                        key,
                        new_run,
                        group,
                        recovery=True,
                        earlier_targets=old_run.targets,
                        earlier_hold_end=old_run.held_until,
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
                    retry_after_s = 1
                    for item in waiting:
                        # by the hold's end the holder has confirmed, or a retry takes over
                        held = state.reservation_for(item.seq)  # type: ignore[arg-type]
                        left_ms = held.held_until - self.clock.now_ms() if held is not None else 0
                        left_s = -(-left_ms // 1000)
                        item.error = ServerBusy(
                            "this publish is in flight in another request; retry shortly",
                            retry_after_s=left_s,
                        )
                        retry_after_s = max(retry_after_s, left_s)
                    for item in held_back:
                        item.error = ServerBusy(
                            "an earlier publish of this publisher is in flight in another "
                            "request; retry shortly",
                            retry_after_s=retry_after_s,
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
        self, key: str, last: int, run: list[Item], now: int, tickets: list[Ticket]
    ) -> bool:
        """Reserve ``run`` (consecutive seqs after ``last``) in chunks of few route keys."""
        chunks: list[list[Item]] = [[]]
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
                # the messages' own publish time, which a recovery gives them again (their
                # retained copy is ordered by it); taken before ``now``, so the read-back
                # window still starts before any put
                reserved_at=min(i.published_at for i in chunk),
                held_until=now + RESERVATION_HOLD_MS,
                attempt=1,
                targets=tuple(dict.fromkeys(i.route for i in chunk)),
            )
            if not self.sequences.reserve(key, expected_last, reservation, routes):
                return False
            ticket = Ticket(key, reservation, chunk)
            tickets.append(ticket)
            for item in chunk:
                item.ticket = ticket
            expected_last = hi
        return True

    def _answer_duplicate(self, item: Item, state: PublisherState) -> None:
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

    def _read_back(self, ticket: Ticket) -> None:
        """Find which of a crashed attempt's messages reached their stream already."""
        earlier: list[tuple[str, StorageTopic]] = []
        for target in ticket.earlier_targets:
            composite, _, index = target.rpartition("/")
            topic = self.directory.topic(composite)
            if topic is not None and int(index) < len(topic.storage_topics):
                earlier.append((target, topic.storage_topics[int(index)]))
        wanted: dict[tuple[StorageTopic, int], list[Item]] = {}
        routes: dict[StorageTopic, str] = {}
        for item in ticket.items:
            for target, storage in earlier:
                routes[storage] = target
                partition = storage.partition_for(item.ordering_key)
                wanted.setdefault((storage, partition), []).append(item)
        since = ticket.run.reserved_at - SKEW_MS
        until = ticket.earlier_hold_end + SKEW_MS
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
                            found.found_at = routes[storage]
                            found.answer = (storage.index, partition)
                            # as stored: its retained copy is ordered by it
                            found.published_at = message.published_at_ms
                    if not ids:
                        break
            except ServerBusy as exc:
                for item in group:
                    if not item.found:
                        item.error = exc

    # -- confirmation ------------------------------------------------------------------

    def _settle(self, ticket: Ticket) -> None:
        done = {i.seq for i in ticket.items if (i.put_ok or i.found) and i.error is None}
        run = ticket.run
        # Seqs not done (failed, or of the run but not in this request) stay reserved for their
        # own retries, released: a retry may take them over at once and reads back up to now.
        remaining = [s for s in range(run.lo, run.hi + 1) if s not in done]
        released = [
            Reservation(lo, hi, run.reserved_at, self.clock.now_ms(), run.attempt, run.targets)
            for lo, hi in consecutive_runs(remaining)
        ]
        overrides: dict[int, str] = {}
        if ticket.recovery:
            for item in ticket.items:
                if item.seq is None or item.error is not None:
                    continue
                # where a recovery put it, or found it (an earlier recovery's put may have
                # gone past the storage topic ``routes`` names): duplicates answer that place
                if item.put_ok:
                    overrides[item.seq] = item.route
                elif item.found and item.found_at is not None:
                    overrides[item.seq] = item.found_at
        if not self.sequences.settle(ticket.key, run, released, overrides):
            # Another request took the reservation over after this one's hold: it reads the
            # stream back, and this request's puts finished before that hold ended.
            logger.warning("reservation taken over before it was confirmed")

    def _answer(self, item: Item) -> tuple[int, dict[str, Any]]:
        assert item.request is not None
        if item.answer is not None:
            storage_index, partition = item.answer
        else:
            storage_index, partition = item.storage.index, item.partition
        duplicate = _duplicate(item)
        body = {
            "message_id": item.message_id,
            "topic": item.request.topic,
            "storage_topic": storage_index,
            "partition": partition,
            "duplicate": duplicate,
        }
        return (200 if duplicate else 201), body


def _duplicate(item: Item) -> bool:
    """Answered 200 ``duplicate``: a seq seen before, or a crashed publish's put read back."""
    return item.duplicate or (item.ticket is not None and item.ticket.recovery)


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
