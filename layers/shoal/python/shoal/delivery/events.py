"""Delivery events: what each consumer was handed and what it acknowledged, archived to S3.

The pipeline's audit (``pipeline/audit.py``) compares these events with the message archive
(``shoal.router.archive``) to prove exactly-once delivery after the fact. A function records events
while it works and appends them once, at the end of its invocation, to the event log (a Kinesis
stream of the stack's own, not a topic's storage stream)::

    recorder = recording.new()                                 # Recording: one per container
    recorder.add("delivered", "session", session_id, message_id=..., delivery_id=..., ...)
    recorder.flush(f"get/{session_id}/{state_version}")        # one PutRecords, or nothing

The archiver (``shoal.delivery.archiver``), mapped to the log with large batches, writes them to
S3 as JSON lines: one object per batch and hour instead of one per call (issue 18: two S3 PUTs
per page of 100 messages were a quarter of a delivery's cost).

Events
------
``routed`` the router wrote a delivery for the consumer (so the message matched it);
``delivered`` the consumer was handed the message for the first time; ``redelivered`` handed
again (``dup``: an ack timeout, a reconnect, a retry); ``acked`` the consumer acknowledged it
(for push: the endpoint answered 2xx); ``dead_lettered`` it was parked in a dead-letter queue;
``dropped`` it was routed but will never be handed out, for a reason (expired, unsubscribed,
retained: the session got it as a retained message when it subscribed).
``ended`` the consumer itself ended, naming no message (a session's end: its expiry, a clean
start, a close with a session expiry of 0; a shared group's removal by its last member): what
it was routed before and did not ack is discarded with it, as MQTT 5 lets a server (§4.1, the
session state ends with the session), and the audit counts those ``dropped``, never lost.

A consumer is ``(consumer_kind, consumer)``: ``session`` + session id, ``group`` + share name
and filter, ``push`` + push subscription id. ``delivery_id`` is the id the consumer acks
(a session's ``<session id>.<ordinal>``, kept across redeliveries); an ``acked`` event may name
only the delivery id, the audit finds the message through the delivery events with that id.
Message attributes the archive holds (ordering key, publish time) are optional here: the audit
takes them from the archive first.

Log records and objects
-----------------------
An invocation's events are one log record (more when they pass Kinesis' 1 MB a record): a
header line (the object partition ``date=<YYYY-MM-DD>/hour=<HH>``, of the earliest
``published_at`` among its events, else the earliest event time; the key hint's digest; the
part) and the event lines, zlib-compressed. Its partition key is the consumer when every event
is one consumer's (so one consumer's events stay in order, in one shard), else the key hint.
The key hint names the consumer and the batch's identity (a session and the delivery-state
version a get or ack wrote; a stream, shard and sequence range), so a retried invocation that
records the same batch writes a record of the same digest: the archiver keeps the last record
of a digest and part within its batch, as an S3 object under a key from the hint was
overwritten before.

The archiver writes ``events/date=<YYYY-MM-DD>/hour=<HH>/<stream>.<shard>.<first>-<last>.jsonl``:
each of its batches' records in order, lines as recorded. Lines carry ``seq`` (their order in
the invocation) and ``batch`` (the hint's digest): the audit orders acks of one millisecond by
them, and drops lines that two objects hold twice (a batch cut differently on a retry).

Without a configured event log the recorder records nothing: ``add`` and ``flush`` are no-ops,
so functions and tests that do not care need no stream.

Services hold a ``Recording`` (the stream and one Kinesis client per container, made on first
use) and take a fresh recorder from it per invocation (``recording.new()``); a service built
without one records nothing. What each service records, and under which key hint, is listed in
docs/pipeline.md ("What the services record").
"""

from __future__ import annotations

import hashlib
import json
import threading
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal, get_args

from shoal.aws import clients
from shoal.aws.kinesis import MAX_RECORD_BYTES, EventLog
from shoal.core.clock import Clock, SystemClock
from shoal.core.config import Config
from shoal.delivery.inbox import InboxMessage

if TYPE_CHECKING:  # type stubs only, not installed in the layer
    from mypy_boto3_kinesis import KinesisClient

EVENTS_PREFIX = "events"
#: the declared stream (``shoal.declarations``) the events are appended to
EVENT_LOG = "events"
#: why a consumer ended (``ended`` events' reason)
SESSION_ENDED = "session_ended"
GROUP_REMOVED = "group_removed"
#: the version of the log records' header
LOG_FORMAT = 1
#: Kinesis' longest partition key (characters)
MAX_PARTITION_KEY = 256
#: a record's event lines before compression: below Kinesis' 1 MB a record with room for the
#: header and partition key (zlib never grows data by more than a few bytes per 16 KB)
MAX_RECORD_LINES_BYTES = MAX_RECORD_BYTES - 16 * 1024

EventKind = Literal[
    "routed", "delivered", "redelivered", "acked", "dead_lettered", "dropped", "ended"
]
ConsumerKind = Literal["session", "group", "push"]
EVENT_KINDS: tuple[str, ...] = get_args(EventKind)
CONSUMER_KINDS: tuple[str, ...] = get_args(ConsumerKind)


@dataclass(frozen=True)
class DeliveryEvent:
    event: str
    consumer_kind: str
    consumer: str
    message_id: str
    #: milliseconds since the epoch when it happened
    at: int
    delivery_id: str | None = None
    topic: str | None = None
    ordering_key: str | None = None
    published_at: int | None = None
    #: the QoS the consumer was granted for this message (min(subscription, message))
    qos: int | None = None
    #: 1 for the first delivery; None where the consumer does not count attempts
    attempt: int | None = None
    #: the filter (or push subscription) that matched
    subscription: str | None = None
    #: why it was dead-lettered or dropped
    reason: str | None = None
    #: a readable name for the consumer (a session's client id)
    label: str | None = None
    #: True on a retained message sent because of a new subscription (MQTT 5 §3.3.1.3): the
    #: audit counts it as a delivery of its own kind, not a second copy of the publish
    retain: bool | None = None

    def line(self, seq: int, batch: str) -> bytes:
        doc: dict[str, Any] = {"event": self.event}
        for k, v in self.__dict__.items():
            if v is not None and k != "event":
                doc[k] = v
        doc["seq"] = seq
        doc["batch"] = batch
        return _encode(doc).encode() + b"\n"


#: one encoder for every line (``json.dumps`` with options builds a new one per call)
_encode = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def hint_digest(key_hint: str) -> str:
    return hashlib.blake2b(key_hint.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def _partition(ms: int) -> str:
    moment = datetime.fromtimestamp(ms / 1000, UTC)
    return f"date={moment:%Y-%m-%d}/hour={moment:%H}"


@dataclass(frozen=True)
class LogRecord:
    """One log record, decoded: where its lines go and what they are."""

    partition: str
    batch: str
    part: int
    lines: bytes


class MalformedLogRecord(ValueError):
    """A record of the event log that no recorder wrote."""


def decode_log_record(data: bytes) -> LogRecord:
    try:
        text = zlib.decompress(data)
        head, _, lines = text.partition(b"\n")
        header = json.loads(head)
        if header.get("v") != LOG_FORMAT:
            raise MalformedLogRecord(f"log format {header.get('v')!r}")
        partition, batch, part = header["partition"], header["batch"], int(header["part"])
    except (zlib.error, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise MalformedLogRecord(f"not a delivery-event record: {type(exc).__name__}") from exc
    if not isinstance(partition, str) or not partition.startswith("date="):
        raise MalformedLogRecord("no object partition")
    return LogRecord(partition, str(batch), part, lines)


def _partition_key(text: str) -> str:
    return text if len(text) <= MAX_PARTITION_KEY else hint_digest(text)


class DeliveryEvents:
    """The events of one invocation, buffered, appended to the event log by ``flush``.

    Not shared between invocations: make one per invocation (``Recording.new``).
    """

    def __init__(
        self, log: EventLog | None, clock: Clock | None = None, prefix: str = EVENTS_PREFIX
    ) -> None:
        self.log = log
        self.clock = clock or SystemClock()
        self.prefix = prefix
        self._events: list[DeliveryEvent] = []

    @property
    def enabled(self) -> bool:
        return self.log is not None

    def __len__(self) -> int:
        return len(self._events)

    def add(
        self,
        event: EventKind,
        consumer_kind: ConsumerKind,
        consumer: str,
        *,
        message_id: str = "",
        delivery_id: str | None = None,
        topic: str | None = None,
        ordering_key: str | None = None,
        published_at: int | None = None,
        qos: int | None = None,
        attempt: int | None = None,
        subscription: str | None = None,
        reason: str | None = None,
        label: str | None = None,
        at: int | None = None,
        retain: bool | None = None,
    ) -> None:
        # wrong kinds are programming errors: fail in tests, not silently in the archive
        if event not in EVENT_KINDS:
            raise ValueError(f"unknown delivery event {event!r}")
        if consumer_kind not in CONSUMER_KINDS:
            raise ValueError(f"unknown consumer kind {consumer_kind!r}")
        if not message_id and not delivery_id and event != "ended":
            raise ValueError("an event names a message id or a delivery id")
        if not self.enabled:
            return
        self._events.append(
            DeliveryEvent(
                event=event,
                consumer_kind=consumer_kind,
                consumer=consumer,
                message_id=message_id,
                at=self.clock.now_ms() if at is None else at,
                delivery_id=delivery_id,
                topic=topic,
                ordering_key=ordering_key,
                published_at=published_at,
                qos=qos,
                attempt=attempt,
                subscription=subscription,
                reason=reason,
                label=label,
                retain=retain,
            )
        )

    def extend(self, events: Iterable[DeliveryEvent]) -> None:
        """Add events built by the caller (checked by their types, not one by one)."""
        if self.enabled:
            self._events.extend(events)

    def partition(self) -> str | None:
        """The object partition (``date=.../hour=...``) of the buffered events (None: none)."""
        if not self._events:
            return None
        times = [e.published_at for e in self._events if e.published_at is not None]
        # without a publish time the batch's earliest event time is the next most stable
        anchor = min(times) if times else min(e.at for e in self._events)
        return _partition(anchor)

    def records(self, key_hint: str) -> list[tuple[str, bytes]]:
        """The log records (partition key, data) of the buffered events: usually one."""
        partition = self.partition()
        if partition is None:
            return []
        batch = hint_digest(key_hint)
        consumers = {(e.consumer_kind, e.consumer) for e in self._events}
        if len(consumers) == 1:
            kind, consumer = next(iter(consumers))
            key = _partition_key(f"{kind}/{consumer}")
        else:
            key = _partition_key(key_hint)
        parts: list[list[bytes]] = [[]]
        size = 0
        for n, event in enumerate(self._events):
            line = event.line(n, batch)
            if parts[-1] and size + len(line) > MAX_RECORD_LINES_BYTES:
                parts.append([])
                size = 0
            parts[-1].append(line)
            size += len(line)
        out = []
        for number, lines in enumerate(parts):
            header = _encode(
                {"v": LOG_FORMAT, "partition": partition, "batch": batch, "part": number}
            )
            # level 1: a tenth of the time of the default for most of its gain on JSON lines
            data = zlib.compress(header.encode() + b"\n" + b"".join(lines), 1)
            out.append((key, data))
        return out

    def flush(self, key_hint: str) -> int:
        """Append the buffered events to the log and forget them; how many. A Kinesis error
        propagates (the caller's invocation fails and is retried, which records and appends
        the same batch again)."""
        records = self.records(key_hint)
        if not records or self.log is None:
            return 0
        self.log.append(records)
        written = len(self._events)
        self._events.clear()
        return written

    def discard(self) -> None:
        self._events.clear()


class Recording:
    """A container's way to record: the event log's stream and one Kinesis client, shared by
    the recorders it hands out (``new``: one per invocation). Thread-safe."""

    def __init__(
        self,
        stream: str | None,
        clock: Clock | None = None,
        kinesis: KinesisClient | None = None,
        region: str = "us-east-1",
    ) -> None:
        self.stream = stream
        self.clock = clock or SystemClock()
        self.region = region
        self._log: EventLog | None = None
        if stream and kinesis is not None:
            self._log = EventLog(kinesis, stream, self.clock)
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, config: Config, clock: Clock | None = None) -> Recording:
        return cls(config.streams.get(EVENT_LOG), clock, region=config.region)

    @property
    def enabled(self) -> bool:
        return bool(self.stream)

    def new(self) -> DeliveryEvents:
        return DeliveryEvents(self.log() if self.enabled else None, self.clock)

    def log(self) -> EventLog:
        with self._lock:
            if self._log is None:
                assert self.stream
                self._log = EventLog(
                    clients.client("kinesis", self.region), self.stream, self.clock
                )
            return self._log


def record_routed(
    events: DeliveryEvents,
    deliveries: Mapping[str, Sequence[InboxMessage]],
    groups: Mapping[str, tuple[str, str]],
) -> None:
    """The router's ``routed`` events: per target of a batch (a session id, or a group's
    partition, which ``groups`` maps to its group key and incarnation) every delivery it got,
    recorded before a retry drops the ones written already, so a retried batch records the
    same lines."""
    if not events.enabled:
        return
    # the router's hot path: one event per delivery, so one clock read and no per-event checks
    at = events.clock.now_ms()
    for target, messages in deliveries.items():
        group = groups.get(target)
        kind: ConsumerKind = "session" if group is None else "group"
        consumer = target if group is None else group[0]
        events.extend(
            DeliveryEvent(
                event="routed",
                consumer_kind=kind,
                consumer=consumer,
                message_id=m.message_id,
                at=at,
                topic=m.topic,
                published_at=m.published_at_ms,
                qos=m.qos,
                subscription=m.subscription,
            )
            for m in messages
        )


def record_ended(
    recording: Recording | None, kind: ConsumerKind, consumer: str, reason: str, key_hint: str
) -> None:
    """A consumer's ``ended`` event, in its own record (a retried end appends the same
    ``key_hint``: one record); nothing without an enabled recording."""
    if recording is None or not recording.enabled:
        return
    events = recording.new()
    events.add("ended", kind, consumer, reason=reason)
    events.flush(key_hint)


def record_answers(
    events: DeliveryEvents,
    kind: ConsumerKind,
    consumer: str,
    answers: Sequence[Mapping[str, Any]],
    *,
    label: str | None = None,
) -> None:
    """``delivered`` / ``redelivered`` for the messages a get answers (its answer dicts)."""
    for a in answers:
        events.add(
            "redelivered" if a.get("dup") else "delivered",
            kind,
            consumer,
            message_id=str(a["message_id"]),
            delivery_id=str(a["id"]),
            topic=a.get("topic"),
            published_at=a.get("published_at"),
            qos=a.get("qos"),
            subscription=a.get("subscription"),
            label=label,
            # an answer's retain flag is set only on a retained message sent on subscribe
            # (the router hands published ones on with retain 0, §3.3.1.3)
            retain=True if a.get("retain") else None,
        )


class EventBatch:
    """The events of several gets, appended together by ``flush``: a router's fan-out of
    pushes writes one ``PutRecords`` for a wave of sessions before their frames go out, not
    one a session (``shoal.edge.push``). Each get keeps its own log record (its consumer's
    partition key, its own key hint), as if it had flushed alone. Thread-safe."""

    def __init__(self, recording: Recording) -> None:
        self.recording = recording
        self._records: list[tuple[str, bytes]] = []
        self._lock = threading.Lock()

    def add(self, recorder: DeliveryEvents, key_hint: str) -> None:
        """Takes ``recorder``'s events over, as its ``flush(key_hint)`` would have written them."""
        records = recorder.records(key_hint)
        recorder.discard()
        with self._lock:
            self._records += records

    def flush(self) -> int:
        """Appends every added record in one call (a Kinesis error propagates, as from
        ``DeliveryEvents.flush``); the records written."""
        with self._lock:
            records, self._records = self._records, []
        if records:
            self.recording.log().append(records)
        return len(records)


class PerConsumer:
    """One recorder per consumer for one invocation that serves several (the push function:
    every subscription of a tap takes the batch, some in threads), each its own log record
    (its consumer's partition key and batch digest), all appended in one call."""

    def __init__(self, recording: Recording) -> None:
        self.recording = recording
        self._recorders: dict[str, DeliveryEvents] = {}
        self._lock = threading.Lock()

    def __getitem__(self, consumer: str) -> DeliveryEvents:
        with self._lock:
            recorder = self._recorders.get(consumer)
            if recorder is None:
                recorder = self._recorders[consumer] = self.recording.new()
            return recorder

    def flush(self, key_hint: Callable[[str], str]) -> int:
        """Every consumer's events (``key_hint(consumer)`` names each batch); how many."""
        with self._lock:
            recorders = sorted(self._recorders.items())
        records = [r for c, recorder in recorders for r in recorder.records(key_hint(c))]
        if not records:
            return 0
        self.recording.log().append(records)
        written = 0
        for _, recorder in recorders:
            written += len(recorder)
            recorder.discard()
        return written
