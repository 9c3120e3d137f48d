"""Delivery events: what each consumer was handed and what it acknowledged, archived to S3.

The pipeline's audit (``pipeline/audit.py``) compares these events with the message archive
(``shoal.router.archive``) to prove exactly-once delivery after the fact. A function records events
while it works and writes them once, at the end of its invocation, as ONE JSON-lines object::

    recorder = DeliveryEvents.from_config(config, clock)      # or DeliveryEvents(bucket, clock)
    recorder.add("delivered", "session", session_id, message_id=..., delivery_id=..., ...)
    recorder.flush(f"get/{session_id}/{state_version}")        # one PutObject, or nothing

Events
------
``routed`` the router wrote a delivery for the consumer (so the message matched it);
``delivered`` the consumer was handed the message for the first time; ``redelivered`` handed
again (``dup``: an ack timeout, a reconnect, a retry); ``acked`` the consumer acknowledged it
(for push: the endpoint answered 2xx); ``dead_lettered`` it was parked in a dead-letter queue;
``dropped`` it was routed but will never be handed out, for a reason (expired, unsubscribed,
retained: the session got it as a retained message when it subscribed).

A consumer is ``(consumer_kind, consumer)``: ``session`` + session id, ``group`` + share name
and filter, ``push`` + push subscription id. ``delivery_id`` is the id the consumer acks
(a session's ``<session id>.<ordinal>``, kept across redeliveries); an ``acked`` event may name
only the delivery id, the audit finds the message through the delivery events with that id.
Message attributes the archive holds (ordering key, publish time) are optional here: the audit
takes them from the archive first.

Object keys
-----------
``events/date=<YYYY-MM-DD>/hour=<HH>/<digest of the key hint>.jsonl``, the date and hour of the
earliest ``published_at`` among the object's events. Both parts come from the batch alone, so
a retried invocation that records the same batch writes the same key and overwrites its
earlier object instead of adding a copy; the hint must therefore name the consumer and the
batch's identity (a session and the delivery-state version a get or ack wrote; a stream, shard
and sequence range). Lines carry ``seq`` (their order in the object) and ``batch`` (the hint's
digest): the audit orders acks of one millisecond by them, and drops lines that two objects
hold twice (a batch cut differently on a retry).

Without a configured archive bucket the recorder records nothing: ``add`` and ``flush`` are
no-ops, so functions and tests that do not care need no bucket.

Services hold a ``Recording`` (the bucket and one S3 client per container, made on first use)
and take a fresh recorder from it per invocation (``recording.new()``); a service built
without one records nothing. What each service records, and under which key hint, is listed in
docs/pipeline.md ("What the services record").
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal, get_args

from shoal.aws import clients
from shoal.core.clock import Clock, SystemClock
from shoal.core.config import Config
from shoal.delivery.inbox import InboxMessage

if TYPE_CHECKING:  # type stubs only, not installed in the layer
    from mypy_boto3_s3 import S3Client

EVENTS_PREFIX = "events"
ARCHIVE_BUCKET = "archive"

EventKind = Literal["routed", "delivered", "redelivered", "acked", "dead_lettered", "dropped"]
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


class DeliveryEvents:
    """The events of one invocation, buffered, written as one object by ``flush``.

    Not shared between invocations: make one per invocation (it holds no client of its own
    unless given one; ``from_config`` passes the container's).
    """

    def __init__(
        self,
        bucket: str | None,
        clock: Clock | None = None,
        s3: S3Client | None = None,
        prefix: str = EVENTS_PREFIX,
    ) -> None:
        self.bucket = bucket
        self.clock = clock or SystemClock()
        self.prefix = prefix
        self._s3 = s3
        self._events: list[DeliveryEvent] = []

    @classmethod
    def from_config(
        cls, config: Config, clock: Clock | None = None, s3: S3Client | None = None
    ) -> DeliveryEvents:
        bucket = config.buckets.get(ARCHIVE_BUCKET)
        if s3 is None and bucket:
            s3 = clients.client("s3", config.region)
        return cls(bucket, clock, s3)

    @property
    def enabled(self) -> bool:
        return bool(self.bucket)

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
        if not message_id and not delivery_id:
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

    def key_for(self, key_hint: str) -> str | None:
        """The object key ``flush(key_hint)`` would write now (None: nothing to write)."""
        if not self._events:
            return None
        times = [e.published_at for e in self._events if e.published_at is not None]
        # without a publish time the batch's earliest event time is the next most stable
        anchor = min(times) if times else min(e.at for e in self._events)
        return f"{self.prefix}/{_partition(anchor)}/{hint_digest(key_hint)}.jsonl"

    def body(self, key_hint: str) -> bytes:
        batch = hint_digest(key_hint)
        return b"".join(event.line(n, batch) for n, event in enumerate(self._events))

    def flush(self, key_hint: str) -> str | None:
        """Write the buffered events as one object and forget them; the key, or None if there
        was nothing to write. An S3 error propagates (the caller's invocation fails and is
        retried, which records and writes the same object again)."""
        key = self.key_for(key_hint)
        if key is None or self.bucket is None:
            return None
        body = self.body(key_hint)
        self._client().put_object(
            Bucket=self.bucket, Key=key, Body=body, ContentType="application/x-ndjson"
        )
        self._events.clear()
        return key

    def discard(self) -> None:
        self._events.clear()

    def _client(self) -> S3Client:
        if self._s3 is None:
            raise RuntimeError("a recorder with a bucket needs an S3 client (from_config)")
        return self._s3


class Recording:
    """A container's way to record: the archive bucket and one S3 client, shared by the
    recorders it hands out (``new``: one per invocation). Thread-safe."""

    def __init__(
        self,
        bucket: str | None,
        clock: Clock | None = None,
        s3: S3Client | None = None,
        region: str = "us-east-1",
    ) -> None:
        self.bucket = bucket
        self.clock = clock or SystemClock()
        self.region = region
        self._s3 = s3
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, config: Config, clock: Clock | None = None) -> Recording:
        return cls(config.buckets.get(ARCHIVE_BUCKET), clock, region=config.region)

    @property
    def enabled(self) -> bool:
        return bool(self.bucket)

    def new(self) -> DeliveryEvents:
        return DeliveryEvents(self.bucket, self.clock, self._client() if self.enabled else None)

    def _client(self) -> S3Client:
        with self._lock:
            if self._s3 is None:
                self._s3 = clients.client("s3", self.region)
            return self._s3


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


class PerConsumer:
    """One recorder per consumer for one invocation that serves several (the push function:
    every subscription of a tap takes the batch, some in threads), each flushed as its own
    object."""

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

    def flush(self, key_hint: Callable[[str], str]) -> list[str]:
        """Every consumer's object (``key_hint(consumer)`` names it); the keys written."""
        with self._lock:
            recorders = sorted(self._recorders.items())
        return [key for c, r in recorders if (key := r.flush(key_hint(c))) is not None]
