"""Delivery: durable subscriptions, session inboxes, and get/ack exactly once per session.

Subscriptions
-------------
A subscription lives twice, written by one transaction: in the session (``session.subscriptions``
on the registry's head item, conditional on the channel being live) and in the subscription
store the router reads (``shoal.aws.tables.SubscriptionItemModel``). The store is cut into *buckets*
by the filter's first level (``L:<level>``, or ``W`` when it is a wildcard), so the router reads
only the buckets a batch's topics can touch: ``W`` and the first levels of its topics. Each
bucket has a version item bumped by every change and one change record per version (kept a
day), so a router refreshes a bucket incrementally and detects a gap (then reloads it). The
router reads the versions strongly consistent once per batch: a subscription whose subscribe
returned before a publish is in the router's view of every batch holding that message.

A subscription has a *sid* (kept when the same filter is subscribed again); deliveries carry it,
and get drops a delivery whose subscription is gone or was replaced: unsubscribing drops the
subscription's undelivered messages without a write per message. A ``$share/{ShareName}/...``
subscription joins its shared group in the subscribe transaction, and leaves it in the
unsubscribe's (or the ended session's) one; get and ack take in the group streams the session
leases (``shoal.groups``).

Permissions: a requested filter must be *covered* by one of the principal's ``shoal:subscribe``
filters: every topic name the requested filter matches must be matched by the allowed one
(``covers``), with the ``$`` rule (``#`` does not cover ``$SYS/#``).

Inboxes
-------
One DynamoDB partition per session id (a discarded or expired session's inbox is simply never
read again; TTL removes it). The router writes, per session and per batch of one storage shard,
one item holding all the session's deliveries from that batch, keyed ``<source>#<position>``
(source: a digest of stream and shard; position: Kinesis sequence number and the message's
index in its record), so small messages share a write unit. A retried batch writes nothing
twice: the router's per-shard ledger says whether a batch may have been written before, and
then it first reads, per session, how far the session's items already cover (``shoal.fanout``).

Get and ack
-----------
The session's delivery state is one small item (``#state``): a cursor per source (the last
position handed out), the next delivery *ordinal*, the ack floor (every ordinal below it is
done) with the acked ordinals above it, and *runs*: the ranges of positions each get handed
out, with their first ordinal, time and channel. A delivery's id is ``<session id>.<ordinal>``.
Ack marks ordinals done and moves the floor: one small write however many ids. A run whose
messages are not all acked after the ack timeout, or that went to another channel (a
reconnect), is read back from the inbox and delivered again with ``dup`` true; the ordinals are
recomputed the same way, so an id never changes. QoS 0 deliveries are done as they are handed
out (at most once). Consumed deliveries are never deleted one by one: TTL removes them
(``SHOAL_INBOX_RETENTION_S``, 14 days by default, is also how long an offline session's
messages wait).

Every write of the state is conditional on its version, so racing gets and acks of one session
serialize; every call checks first that its channel is the live one. Positions make delivery
idempotent a second time over: a cursor only moves forward, so a delivery written twice (under
another key) is still handed out once. A long poll reads the inbox after 0.1 s, then 1.5 times
later each time (at most every second), so a 20 s wait costs about 25 reads, not 200.

Order: within one source (a storage shard) deliveries are written and handed out in position
order, so messages of one ordering key arrive in publish order. Sources are read one after the
other, earlier storage topics first; after SwitchProduce, a later storage topic's items are
held until the earlier ones are drained and handed out (``shoal.drain``), so a key's order
holds across storage topics too.

Retained messages
-----------------
A subscribe finds the retained messages of a filter through the retained table's
``by_composite`` index: the composite topic the filter's first level names and ``default`` (a
topic published before its composite topic existed), or every composite topic for a wildcard
first level; it matches the topic names in memory, reading at most ``MAX_RETAINED_SCAN`` index
entries per filter, then reads the matching messages strongly consistent. They are written to
the session's inbox in the subscribe's own transaction (source ``ret``, positioned by the
delivery state's version it bumps): at most ``MAX_RETAINED_PER_CALL`` messages and
``MAX_RETAINED_BYTES`` per call, once per topic however many new subscriptions match it.

Ended sessions
--------------
A connect that discards a session, and the reaper when a session expires, remove its
subscriptions from the store (``SubscriptionRetirer``, a ``shoal.sessions.SessionEndHook``). A
connect that dies between its commit and that clean-up leaves them behind: the router then
keeps writing to an inbox no session reads (TTL removes it), which costs writes, never a wrong
delivery.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from shoal.aws import clients, tables
from shoal.aws.dynamo import Dynamo, to_item
from shoal.aws.tables import RetainedModel, TopicModel
from shoal.composite.model import DEFAULT_TOPIC, is_valid_topic_name
from shoal.core.auth import Principal
from shoal.core.clock import Clock, SystemClock
from shoal.core.config import Config
from shoal.core.errors import BadRequest, InvalidFilter, ServerBusy
from shoal.core.observability import logger
from shoal.core.retry import backoff_s
from shoal.sessions import Head, SessionRegistry
from shoal.topics.filters import (
    MULTI_LEVEL,
    SEPARATOR,
    SINGLE_LEVEL,
    first_level,
    is_valid_filter,
    matches,
    parse_shared,
)

if TYPE_CHECKING:
    from shoal.delivery_events import Recording
    from shoal.drain import SessionGate
    from shoal.groups import GroupService, MembershipPlan

SUBSCRIPTIONS_TABLE = "subscriptions"
INBOXES_TABLE = "inboxes"
SESSIONS_TABLE = "sessions"

#: filters per subscribe or unsubscribe call: with their buckets' version and change items and
#: the head they fit one transaction (100 items) with room for retained deliveries
MAX_FILTERS_PER_CALL = 20
#: subscriptions one session may hold (MQTT 5 would answer "quota exceeded")
MAX_SUBSCRIPTIONS_PER_SESSION = 1000
#: retained messages one subscribe call sends at most, and their bytes (one transaction)
MAX_RETAINED_PER_CALL = 1000
MAX_RETAINED_BYTES = 2 * 1024 * 1024
#: retained topic names one subscribe reads from the index per filter before it stops
MAX_RETAINED_SCAN = 10_000
#: how long a bucket's change records stay: a router whose view is older reloads the bucket
CHANGE_TTL_S = 24 * 3600
#: get answers at most this many messages; long polls last at most this long
MAX_GET = 100
MAX_WAIT_MS = 20_000
#: a long poll looks again after 0.1 s, then 1.5 times later each time, at most after 1 s
POLL_INTERVAL_S = 0.1
MAX_POLL_INTERVAL_S = 1.0
#: messages one get looks at (including ones it skips: expired, unsubscribed)
MAX_SCAN_PER_GET = 1000
#: queries one get makes while looking for new messages
MAX_QUERIES_PER_GET = 64
#: ids one ack call takes
MAX_ACK_IDS = 1000
#: optimistic-concurrency attempts on the delivery state or a bucket's version
ATTEMPTS = 8
#: deliveries of one batch for one session share an item up to this size; DynamoDB's limit is
#: 400 KB, and a write unit is 1 KB, so larger items save nothing
MAX_ITEM_BYTES = 64 * 1024
#: larger payloads are kept once in the archive bucket and referenced (an item holds 400 KB)
MAX_INLINE_PAYLOAD = 32 * 1024
PAYLOADS_PREFIX = "payloads"

STATE = "#state"
LEDGER = "#ledger"
VERSION_ITEM = "#v"
WILDCARD_BUCKET = "W"
RETAINED_SOURCE = "ret"
LAST_INDEX = 99_999

DEFAULT_ACK_TIMEOUT_S = 30
DEFAULT_WINDOW = 100
DEFAULT_RETENTION_S = 14 * 24 * 3600


# --- settings ------------------------------------------------------------------------------------


class DeliverySettings(BaseModel):
    """Delivery's knobs, from the environment once per container (the deployment may set them;
    ``shoal dev`` passes its own environment through, so tests can shorten the ack timeout)."""

    model_config = ConfigDict(frozen=True)

    ack_timeout_s: float = Field(default=DEFAULT_ACK_TIMEOUT_S, gt=0)
    #: unacked QoS 1/2 deliveries a session may have (MQTT's receive maximum)
    window: int = Field(default=DEFAULT_WINDOW, ge=1, le=1000)
    retention_s: int = Field(default=DEFAULT_RETENTION_S, ge=60)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> DeliverySettings:
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for name, key in (
            ("ack_timeout_s", "SHOAL_ACK_TIMEOUT_S"),
            ("window", "SHOAL_INFLIGHT_WINDOW"),
            ("retention_s", "SHOAL_INBOX_RETENTION_S"),
        ):
            if env.get(key):
                values[name] = env[key]
        return cls.model_validate(values)


# --- positions, buckets, permissions (no AWS here) -----------------------------------------------


def seq_key(sequence_number: str | int) -> str:
    """A Kinesis sequence number as a string that sorts as the number (length first)."""
    digits = str(int(sequence_number))
    return f"{len(digits):02d}{digits}"


def position(sequence_number: str | int, index: int) -> str:
    """Where a message sits in its source: its record's sequence number, its index in it."""
    return f"{seq_key(sequence_number)}.{index:05d}"


def record_end(sequence_number: str | int) -> str:
    """A position after every message of the record."""
    return position(sequence_number, LAST_INDEX)


def source_id(stream: str, shard: str) -> str:
    """A short, stable name for one storage shard (every inbox key starts with it)."""
    return hashlib.blake2b(f"{stream}/{shard}".encode(), digest_size=6).hexdigest()


def item_key(source: str, first_position: str) -> str:
    return f"{source}#{first_position}"


def split_key(key: str) -> tuple[str, str]:
    source, _, pos = key.partition("#")
    return source, pos


def bucket_of(topic_filter: str) -> str:
    """The store bucket of a filter (without ``$share/...``) or of a topic name."""
    level = first_level(topic_filter)
    if level in (SINGLE_LEVEL, MULTI_LEVEL):
        return WILDCARD_BUCKET
    if len(level.encode("utf-8", "surrogatepass")) > 512:
        # a partition key holds 2,048 bytes
        return "H:" + hashlib.sha256(level.encode("utf-8", "surrogatepass")).hexdigest()
    return "L:" + level


def buckets_for_topic(topic: str) -> tuple[str, str]:
    """The buckets whose filters can match a topic name."""
    return WILDCARD_BUCKET, bucket_of(topic)


def subscription_item(client_id: str, topic_filter: str) -> str:
    """The store key of one client id's subscription to one filter (filters reach 64 KB)."""
    raw = f"{client_id}\x00{topic_filter}".encode("utf-8", "surrogatepass")
    return "s#" + hashlib.blake2b(raw, digest_size=16).hexdigest()


def covers(allowed: str, requested: str) -> bool:
    """Whether every topic name ``requested`` matches is matched by ``allowed`` too.

    Both are filters without ``$share``; an invalid one covers (or is covered by) nothing.
    Level by level: ``#`` in ``allowed`` covers the rest (and the parent level); ``+`` covers
    any one level, ``+`` included; a literal covers only itself. ``#`` in ``requested`` is
    covered only by ``#`` at the same level (or ``+/#`` standing for every topic). A leading
    wildcard in ``allowed`` does not cover a requested ``$`` level, as it matches no ``$``-topic.
    """
    if not is_valid_filter(allowed) or not is_valid_filter(requested):
        return False
    a = allowed.split(SEPARATOR)
    r = requested.split(SEPARATOR)
    for i, level in enumerate(a):
        if level == MULTI_LEVEL:
            return not (i == 0 and r[0].startswith("$"))
        if i >= len(r):
            return False
        wanted = r[i]
        if wanted == MULTI_LEVEL:
            # requested a/#: matches "a" itself, which only a/# covers; # alone: every
            # topic name, which +/# covers as well (a topic has at least one level)
            return (a[i:] == [MULTI_LEVEL]) or (i == 0 and a == [SINGLE_LEVEL, MULTI_LEVEL])
        if level == SINGLE_LEVEL:
            if i == 0 and wanted.startswith("$"):
                return False
            continue
        if wanted != level:
            return False
    return len(a) == len(r)


def may_subscribe(who: Principal, topic_filter: str) -> bool:
    return any(covers(allowed, topic_filter) for allowed in who.subscribe)


# --- requests ------------------------------------------------------------------------------------


class SubscriptionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    filter: str
    qos: StrictInt = Field(default=1, ge=0, le=2)
    no_local: StrictBool = False
    retain_handling: StrictInt = Field(default=0, ge=0, le=2)


class SubscribeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    subscriptions: list[SubscriptionRequest] = Field(min_length=1, max_length=MAX_FILTERS_PER_CALL)


class UnsubscribeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    filters: list[str] = Field(min_length=1, max_length=MAX_FILTERS_PER_CALL)


class AckRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ids: list[str] = Field(max_length=MAX_ACK_IDS)


# --- what the router holds -----------------------------------------------------------------------


@dataclass(frozen=True)
class Subscription:
    """One session's subscription, as the subscription store holds it."""

    key: str
    client_id: str
    session_id: str
    #: as subscribed (``$share/...`` included)
    filter: str
    qos: int
    sid: str
    #: the principal that owns the session (no_local compares it)
    owner: str
    no_local: bool = False
    share: str | None = None
    #: a shared subscription's group incarnation (``shoal.groups``): where the router writes
    group: str | None = None

    @property
    def topic_filter(self) -> str:
        """The filter without ``$share/{ShareName}/``."""
        shared = parse_shared(self.filter)
        return shared[1] if shared else self.filter

    def data(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "client_id": self.client_id,
            "session_id": self.session_id,
            "filter": self.filter,
            "qos": self.qos,
            "sid": self.sid,
            "owner": self.owner,
        }
        if self.no_local:
            out["no_local"] = True
        if self.share is not None:
            out["share"] = self.share
        if self.group is not None:
            out["group"] = self.group
        return out

    @classmethod
    def from_data(cls, key: str, data: Mapping[str, Any]) -> Subscription:
        return cls(
            key=key,
            client_id=str(data["client_id"]),
            session_id=str(data["session_id"]),
            filter=str(data["filter"]),
            qos=int(data["qos"]),
            sid=str(data["sid"]),
            owner=str(data.get("owner", "")),
            no_local=bool(data.get("no_local", False)),
            share=data.get("share"),
            group=data.get("group"),
        )


@dataclass(frozen=True)
class Change:
    """One change of a bucket: a subscription put (or replaced) or deleted."""

    key: str
    subscription: Subscription | None  # None: deleted

    def data(self) -> dict[str, Any]:
        if self.subscription is None:
            return {"k": self.key, "op": "del"}
        return {"k": self.key, "op": "put", "d": self.subscription.data()}

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> Change:
        key = str(data["k"])
        if data.get("op") == "del":
            return cls(key, None)
        return cls(key, Subscription.from_data(key, data["d"]))


# --- inbox contents ------------------------------------------------------------------------------


@dataclass(frozen=True)
class InboxMessage:
    """One delivery in an inbox item."""

    position: str
    message_id: str
    topic: str
    payload: bytes
    #: the granted QoS: min(subscription, message)
    qos: int
    #: the filter that matched (the highest-QoS one when several of the session's did)
    subscription: str
    sid: str
    published_at_ms: int
    expires_at_ms: int | None = None
    properties: Mapping[str, Any] = field(default_factory=dict)
    retain: bool = False
    #: the payload's key in the archive bucket, when it was too large to keep inline
    payload_ref: str | None = None

    def data(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "o": self.position,
            "i": self.message_id,
            "t": self.topic,
            "p": self.payload,
            "q": self.qos,
            "s": self.subscription,
            "g": self.sid,
            "a": self.published_at_ms,
        }
        if self.expires_at_ms is not None:
            out["x"] = self.expires_at_ms
        if self.properties:
            out["pr"] = dict(self.properties)
        if self.retain:
            out["r"] = True
        if self.payload_ref is not None:
            out["ref"] = self.payload_ref
        return out

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> InboxMessage:
        return cls(
            position=str(data["o"]),
            message_id=str(data["i"]),
            topic=str(data["t"]),
            payload=bytes(data.get("p") or b""),
            qos=int(data["q"]),
            subscription=str(data["s"]),
            sid=str(data["g"]),
            published_at_ms=int(data["a"]),
            expires_at_ms=int(data["x"]) if data.get("x") is not None else None,
            properties=dict(data.get("pr") or {}),
            retain=bool(data.get("r", False)),
            payload_ref=data.get("ref"),
        )

    def size(self) -> int:
        """Roughly what it adds to an item (for packing; DynamoDB counts names and values)."""
        props = len(json.dumps(self.properties)) if self.properties else 0
        return (
            60
            + len(self.position)
            + len(self.message_id)
            + len(self.topic.encode("utf-8", "surrogatepass"))
            + len(self.payload)
            + len(self.subscription.encode("utf-8", "surrogatepass"))
            + len(self.sid)
            + props
            + len(self.payload_ref or "")
        )


@dataclass(frozen=True)
class InboxItem:
    session_id: str
    key: str
    messages: tuple[InboxMessage, ...]
    #: the last position this item accounts for (the batch's end: a retry skips up to it)
    covered: str
    expires_at: int
    #: the storage stream, for a storage topic after a topic's first: readers hold it until the
    #: earlier ones are drained (``shoal.drain``); None (not stored) otherwise
    stream: str | None = None

    @property
    def source(self) -> str:
        return split_key(self.key)[0]

    def record(self) -> dict[str, Any]:
        out = {
            "inbox": self.session_id,
            "position": self.key,
            "l": self.covered,
            "m": [m.data() for m in self.messages],
            "expires_at": self.expires_at,
        }
        if self.stream is not None:
            out["st"] = self.stream
        return out

    @classmethod
    def from_record(cls, raw: Mapping[str, Any]) -> InboxItem:
        return cls(
            session_id=str(raw["inbox"]),
            key=str(raw["position"]),
            messages=tuple(InboxMessage.from_data(m) for m in raw.get("m") or []),
            covered=str(raw.get("l", "")),
            expires_at=int(raw.get("expires_at") or 0),
            stream=str(raw["st"]) if raw.get("st") else None,
        )


def pack(
    session_id: str,
    source: str,
    messages: Sequence[InboxMessage],
    covered: str,
    expires_at: int,
    *,
    stream: str | None = None,
) -> list[InboxItem]:
    """Deliveries of one session from one source, in order, as few items as fit.

    The last item accounts for everything up to ``covered``; an earlier one up to its own last
    message (the router writes them in this order, one after the other).
    """
    groups: list[list[InboxMessage]] = [[]]
    size = 0
    for message in messages:
        grow = message.size()
        if groups[-1] and size + grow > MAX_ITEM_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(message)
        size += grow
    items: list[InboxItem] = []
    for n, group in enumerate(groups):
        if not group:
            continue
        last = n == len(groups) - 1
        items.append(
            InboxItem(
                session_id=session_id,
                key=item_key(source, group[0].position),
                messages=tuple(group),
                covered=covered if last else group[-1].position,
                expires_at=expires_at,
                stream=stream,
            )
        )
    return items


# --- the delivery state --------------------------------------------------------------------------


class OrdinalRun(Protocol):
    """Ordinals ``first .. end - 1`` handed out together (a session's or a group stream's run)."""

    @property
    def first(self) -> int: ...

    @property
    def end(self) -> int: ...


R = TypeVar("R", bound=OrdinalRun)


def settle(
    runs: list[R], floor: int, next_ordinal: int, done: set[int]
) -> tuple[int, set[int], list[R]]:
    """Move the floor over done ordinals: the new floor (the first ordinal not done, or
    ``next_ordinal``), the done ordinals above it, and the runs that still hold one not done.
    ``runs`` is sorted in place by first ordinal."""
    runs.sort(key=lambda r: r.first)
    new_floor = next_ordinal
    for run in runs:
        pending = next((o for o in range(max(run.first, floor), run.end) if o not in done), None)
        if pending is not None:
            new_floor = pending
            break
    floor = max(floor, new_floor)
    done = {o for o in done if o >= floor}
    kept = [r for r in runs if any(o not in done for o in range(max(r.first, floor), r.end))]
    return floor, done, kept


@dataclass
class Run:
    """Positions ``(after, upto]`` of one source, handed out by one get as ordinals
    ``first .. first + count - 1`` (every message in that range, delivered or skipped)."""

    first: int
    count: int
    source: str
    after: str
    upto: str
    #: the key of the item holding the run's first message
    start_item: str
    sent_at_ms: int
    channel: str

    @property
    def end(self) -> int:
        return self.first + self.count

    def data(self) -> dict[str, Any]:
        return {
            "o": self.first,
            "c": self.count,
            "s": self.source,
            "f": self.after,
            "t": self.upto,
            "i": self.start_item,
            "a": self.sent_at_ms,
            "h": self.channel,
        }

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> Run:
        return cls(
            first=int(data["o"]),
            count=int(data["c"]),
            source=str(data["s"]),
            after=str(data["f"]),
            upto=str(data["t"]),
            start_item=str(data["i"]),
            sent_at_ms=int(data["a"]),
            channel=str(data["h"]),
        )


def ordinal_ranges(numbers: Iterable[int]) -> list[list[int]]:
    """Ordinals as ``[first, last]`` ranges (how progress items store done ordinals)."""
    out: list[list[int]] = []
    for n in sorted(numbers):
        if out and out[-1][1] == n - 1:
            out[-1][1] = n
        else:
            out.append([n, n])
    return out


def from_ranges(ranges: Iterable[Sequence[Any]]) -> set[int]:
    """The ordinals of ``ordinal_ranges``' answer."""
    out: set[int] = set()
    for lo, hi in ranges:
        out.update(range(int(lo), int(hi) + 1))
    return out


@dataclass
class DeliveryState:
    """One session's delivery state (the ``#state`` item), changed in memory then written."""

    version: int = 0
    next_ordinal: int = 0
    #: every ordinal below is done (acked, QoS 0, or skipped)
    floor: int = 0
    #: done ordinals at or above the floor
    acked: set[int] = field(default_factory=set)
    #: source -> the last position handed out
    cursors: dict[str, str] = field(default_factory=dict)
    #: source -> the key of the item the cursor sits inside of (more messages follow in it)
    partial: dict[str, str] = field(default_factory=dict)
    runs: list[Run] = field(default_factory=list)
    #: composite topic -> how many of its storage topics the session has passed (drained and
    #: handed out: ``shoal.drain``); the later ones' items go out only after those
    drained: dict[str, int] = field(default_factory=dict)

    def done(self, ordinal: int) -> bool:
        return ordinal < self.floor or ordinal in self.acked

    def in_flight(self) -> int:
        """Handed-out ordinals not done (QoS 1/2 deliveries waiting for their ack)."""
        return sum(1 for run in self.runs for o in range(run.first, run.end) if not self.done(o))

    def normalize(self) -> None:
        """Move the floor over done ordinals; forget runs and acks below it."""
        self.floor, self.acked, self.runs = settle(
            self.runs, self.floor, self.next_ordinal, self.acked
        )

    def record(self, session_id: str, expires_at: int) -> dict[str, Any]:
        return {
            "inbox": session_id,
            "position": STATE,
            "v": self.version,
            "n": self.next_ordinal,
            "fl": self.floor,
            "ak": ordinal_ranges(self.acked),
            "cu": dict(self.cursors),
            "pa": dict(self.partial),
            "ru": [r.data() for r in self.runs],
            "dr": dict(self.drained),
            "expires_at": expires_at,
        }

    @classmethod
    def from_record(cls, raw: Mapping[str, Any]) -> DeliveryState:
        acked = from_ranges(raw.get("ak") or [])
        return cls(
            version=int(raw.get("v", 0)),
            next_ordinal=int(raw.get("n", 0)),
            floor=int(raw.get("fl", 0)),
            acked=acked,
            cursors={str(k): str(v) for k, v in (raw.get("cu") or {}).items()},
            partial={str(k): str(v) for k, v in (raw.get("pa") or {}).items()},
            runs=[Run.from_data(r) for r in raw.get("ru") or []],
            drained={str(k): int(v) for k, v in (raw.get("dr") or {}).items()},
        )


def delivery_id(session_id: str, ordinal: int) -> str:
    return f"{session_id}.{ordinal}"


def ordinal_of(session_id: str, delivery: str) -> int | None:
    prefix, _, number = delivery.rpartition(".")
    if prefix != session_id or not number.isdigit():
        return None
    return int(number)


# --- the subscription store ----------------------------------------------------------------------


def change_item(version: int) -> str:
    return f"c#{version:012d}"


class SubscriptionStore:
    """The subscriptions table: bucket versions, change records, subscriptions."""

    def __init__(self, dynamo: Dynamo, table: str) -> None:
        self.dynamo = dynamo
        self.table = table

    @classmethod
    def from_config(cls, config: Config) -> SubscriptionStore:
        return cls(Dynamo.from_config(config), config.table(SUBSCRIPTIONS_TABLE))

    def versions(self, buckets: Iterable[str]) -> dict[str, int]:
        """Each bucket's version (0: never written), strongly consistent, in one call per 100."""
        wanted = sorted(set(buckets))
        found = {b: 0 for b in wanted}
        keys = [{"bucket": b, "item": VERSION_ITEM} for b in wanted]
        for raw in self.dynamo.batch_get(self.table, keys):
            found[str(raw["bucket"])] = int(raw.get("v", 0))
        return found

    def load(self, bucket: str) -> list[Subscription]:
        """Every subscription of a bucket, strongly consistent."""
        rows = self.dynamo.query(
            self.table,
            KeyConditionExpression="#b = :b AND begins_with(#i, :s)",
            ExpressionAttributeNames={"#b": "bucket", "#i": "item"},
            ExpressionAttributeValues=to_item({":b": bucket, ":s": "s#"}),
            ConsistentRead=True,
        )
        return [Subscription.from_data(str(r["item"]), r) for r in rows]

    def changes(self, bucket: str, after: int, upto: int) -> list[Change] | None:
        """The changes that made versions ``after+1 .. upto``; None when one is missing."""
        rows = self.dynamo.query(
            self.table,
            KeyConditionExpression="#b = :b AND #i BETWEEN :lo AND :hi",
            ExpressionAttributeNames={"#b": "bucket", "#i": "item"},
            ExpressionAttributeValues=to_item(
                {":b": bucket, ":lo": change_item(after + 1), ":hi": change_item(upto)}
            ),
            ConsistentRead=True,
        )
        if [int(r["v"]) for r in rows] != list(range(after + 1, upto + 1)):
            return None
        return [Change.from_data(c) for r in rows for c in r.get("changes") or []]

    def parts(
        self, changes: Mapping[str, list[Change]], versions: Mapping[str, int], now_s: int
    ) -> list[dict[str, Any]]:
        """Transaction parts writing ``changes`` as the next version of each bucket."""
        out: list[dict[str, Any]] = []
        for bucket, bucket_changes in sorted(changes.items()):
            old = versions.get(bucket, 0)
            new = old + 1
            if old == 0:
                condition = "attribute_not_exists(#i)"
                values: dict[str, Any] = {":new": new}
            else:
                condition = "#v = :old"
                values = {":new": new, ":old": old}
            out.append(
                {
                    "Update": {
                        "TableName": self.table,
                        "Key": to_item({"bucket": bucket, "item": VERSION_ITEM}),
                        "UpdateExpression": "SET #v = :new",
                        "ConditionExpression": condition,
                        "ExpressionAttributeNames": {"#v": "v", "#i": "item"}
                        if old == 0
                        else {"#v": "v"},
                        "ExpressionAttributeValues": to_item(values),
                    }
                }
            )
            out.append(
                {
                    "Put": {
                        "TableName": self.table,
                        "Item": to_item(
                            {
                                "bucket": bucket,
                                "item": change_item(new),
                                "v": new,
                                "changes": [c.data() for c in bucket_changes],
                                "expires_at": now_s + CHANGE_TTL_S,
                            }
                        ),
                    }
                }
            )
            for change in bucket_changes:
                key = to_item({"bucket": bucket, "item": change.key})
                if change.subscription is None:
                    out.append({"Delete": {"TableName": self.table, "Key": key}})
                else:
                    record = {"bucket": bucket, "item": change.key, "v": new}
                    record |= change.subscription.data()
                    out.append({"Put": {"TableName": self.table, "Item": to_item(record)}})
        return out


# --- the inbox store -----------------------------------------------------------------------------


def ledger_partition(source: str) -> str:
    return f"router#{source}"


class InboxStore:
    """The inboxes table: deliveries, each session's delivery state, the router's ledgers."""

    def __init__(self, dynamo: Dynamo, table: str) -> None:
        self.dynamo = dynamo
        self.table = table

    @classmethod
    def from_config(cls, config: Config) -> InboxStore:
        return cls(Dynamo.from_config(config), config.table(INBOXES_TABLE))

    # -- deliveries

    def put(self, items: Sequence[InboxItem]) -> None:
        """Write items; a session's later items of one source only after its earlier ones, so a
        get never sees a later delivery before an earlier one."""
        rounds: list[list[InboxItem]] = []
        seen: dict[tuple[str, str], int] = {}
        for item in items:
            n = seen.get((item.session_id, item.source), -1) + 1
            seen[(item.session_id, item.source)] = n
            while len(rounds) <= n:
                rounds.append([])
            rounds[n].append(item)
        for batch in rounds:
            self.dynamo.batch_put(self.table, [i.record() for i in batch])

    def put_transaction_part(self, item: InboxItem) -> dict[str, Any]:
        return {"Put": {"TableName": self.table, "Item": to_item(item.record())}}

    def after(self, session_id: str, key: str, *, inclusive: bool, limit: int) -> list[InboxItem]:
        """Up to ``limit`` items of the session from ``key`` on, in key order."""
        operator = ">=" if inclusive else ">"
        rows = self.dynamo.query(
            self.table,
            KeyConditionExpression=f"#p = :p AND #k {operator} :k",
            ExpressionAttributeNames={"#p": "inbox", "#k": "position"},
            ExpressionAttributeValues=to_item({":p": session_id, ":k": key}),
            ConsistentRead=True,
            Limit=limit,
        )
        return [InboxItem.from_record(r) for r in rows]

    def between(self, session_id: str, first: str, last: str) -> list[InboxItem]:
        """The session's items with keys from ``first`` to ``last``, inclusive."""
        rows = self.dynamo.query(
            self.table,
            KeyConditionExpression="#p = :p AND #k BETWEEN :a AND :b",
            ExpressionAttributeNames={"#p": "inbox", "#k": "position"},
            ExpressionAttributeValues=to_item({":p": session_id, ":a": first, ":b": last}),
            ConsistentRead=True,
        )
        return [InboxItem.from_record(r) for r in rows]

    def covered(self, session_id: str, source: str, upto: str) -> str:
        """How far the session's items of ``source`` at or before ``upto`` account for ("" for
        nothing): the router's check before it writes a batch that may have been written."""
        rows = self.dynamo.query(
            self.table,
            KeyConditionExpression="#p = :p AND #k BETWEEN :a AND :b",
            ExpressionAttributeNames={"#p": "inbox", "#k": "position", "#l": "l"},
            ExpressionAttributeValues=to_item(
                {":p": session_id, ":a": f"{source}#", ":b": item_key(source, upto)}
            ),
            ProjectionExpression="#l",
            ConsistentRead=True,
            ScanIndexForward=False,
            Limit=1,
        )
        return str(rows[0].get("l", "")) if rows else ""

    # -- the router's ledger

    def ledger(self, source: str) -> str:
        """The last record position (``seq_key``) the router may have written deliveries for."""
        raw = self.dynamo.get(self.table, {"inbox": ledger_partition(source), "position": LEDGER})
        return str(raw.get("a", "")) if raw else ""

    def advance_ledger(self, source: str, through: str) -> None:
        """Record that deliveries up to ``through`` may exist (only ever forward)."""
        # a failed condition: the ledger is already at or past ``through``
        self.dynamo.conditional(
            "update_item",
            TableName=self.table,
            Key=to_item({"inbox": ledger_partition(source), "position": LEDGER}),
            UpdateExpression="SET #a = :a",
            ConditionExpression="attribute_not_exists(#a) OR #a < :a",
            ExpressionAttributeNames={"#a": "a"},
            ExpressionAttributeValues=to_item({":a": through}),
        )

    # -- the delivery state

    def state(self, session_id: str) -> DeliveryState:
        raw = self.dynamo.get(self.table, {"inbox": session_id, "position": STATE})
        return DeliveryState.from_record(raw) if raw else DeliveryState()

    def in_flight(self, session_id: str) -> int:
        """QoS 1/2 deliveries handed out and not acknowledged (``GET /v1/sessions/{id}``)."""
        return self.state(session_id).in_flight()

    def state_part(
        self, session_id: str, state: DeliveryState, expected: int, expires_at: int
    ) -> dict[str, Any]:
        """A put of ``state`` on condition that the stored one is still version ``expected``."""
        condition = "attribute_not_exists(#v) OR #v = :old" if expected == 0 else "#v = :old"
        return {
            "TableName": self.table,
            "Item": to_item(state.record(session_id, expires_at)),
            "ConditionExpression": condition,
            "ExpressionAttributeNames": {"#v": "v"},
            "ExpressionAttributeValues": to_item({":old": expected}),
        }

    def write_state(
        self, session_id: str, state: DeliveryState, expected: int, expires_at: int
    ) -> bool:
        return self.dynamo.conditional(
            "put_item", **self.state_part(session_id, state, expected, expires_at)
        )


# --- payloads too large for an item --------------------------------------------------------------


class PayloadStore:
    """Large payloads, once per message, in the archive bucket (``payloads/<message id>``)."""

    def __init__(self, s3: Any, bucket: str) -> None:
        self.s3 = s3
        self.bucket = bucket

    @classmethod
    def from_config(cls, config: Config) -> PayloadStore:
        return cls(clients.client("s3", config.region), config.buckets["archive"])

    @staticmethod
    def key(message_id: str) -> str:
        return f"{PAYLOADS_PREFIX}/{message_id}"

    def put(self, message_id: str, payload: bytes) -> str:
        key = self.key(message_id)
        self.s3.put_object(Bucket=self.bucket, Key=key, Body=payload)
        return key

    def get(self, key: str) -> bytes:
        body: bytes = self.s3.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        return body


# --- subscribe and unsubscribe -------------------------------------------------------------------


@dataclass(frozen=True)
class _Accepted:
    request: SubscriptionRequest
    topic_filter: str
    share: str | None
    sid: str
    new: bool


class SubscriptionService:
    """Subscribe and unsubscribe for a live channel, and retained messages on subscribe."""

    def __init__(
        self,
        registry: SessionRegistry,
        subscriptions: SubscriptionStore,
        inbox: InboxStore,
        settings: DeliverySettings,
        *,
        clock: Clock | None = None,
        groups: GroupService | None = None,
    ) -> None:
        self.registry = registry
        self.subscriptions = subscriptions
        self.inbox = inbox
        self.settings = settings
        self.clock = clock or SystemClock()
        #: shared subscriptions join and leave their groups (``shoal.groups``)
        self.groups = groups

    @classmethod
    def from_config(cls, config: Config, clock: Clock | None = None) -> SubscriptionService:
        from shoal.groups import GroupService

        tables.bind(config)
        dynamo = Dynamo.from_config(config)
        return cls(
            SessionRegistry.from_config(config, clock),
            SubscriptionStore(dynamo, config.table(SUBSCRIPTIONS_TABLE)),
            InboxStore(dynamo, config.table(INBOXES_TABLE)),
            DeliverySettings.from_env(),
            clock=clock,
            groups=GroupService.from_config(config, clock, payloads=False),
        )

    # -- subscribe

    def subscribe(
        self, who: Principal, client_id: str, channel: str | None, request: SubscribeRequest
    ) -> dict[str, Any]:
        head = self.registry.require_live(who, client_id, channel)
        granted: list[int | str] = []
        accepted: dict[str, _Accepted] = {}
        held = set(head.subscriptions)
        for wanted in request.subscriptions:
            code = self._check(who, wanted.filter)
            if (
                code is None
                and wanted.filter not in held
                and wanted.filter not in accepted
                and len(held) + len(accepted) >= MAX_SUBSCRIPTIONS_PER_SESSION
            ):
                code = "quota_exceeded"
            if code is not None:
                granted.append(code)
                continue
            shared = parse_shared(wanted.filter)
            existing = head.subscriptions.get(wanted.filter)
            sid = str(existing["sid"]) if existing and existing.get("sid") else _new_sid()
            accepted[wanted.filter] = _Accepted(
                wanted,
                shared[1] if shared else wanted.filter,
                shared[0] if shared else None,
                sid,
                new=existing is None,
            )
            granted.append(wanted.qos)
        if not accepted:
            if granted and all(g == "invalid_filter" for g in granted):
                raise InvalidFilter("no filter of the request is a valid topic filter")
            return {"granted": granted}
        self._commit_subscribe(who, client_id, head, accepted)
        return {"granted": granted}

    def _check(self, who: Principal, text: str) -> str | None:
        try:
            shared = parse_shared(text)
        except InvalidFilter:
            return "invalid_filter"
        topic_filter = shared[1] if shared else text
        if not is_valid_filter(topic_filter):
            return "invalid_filter"
        if not may_subscribe(who, topic_filter):
            return "not_authorized"
        return None

    def _commit_subscribe(
        self, who: Principal, client_id: str, head: Head, accepted: Mapping[str, _Accepted]
    ) -> None:
        session_id = head.session_id or ""
        shared = [text for text, a in accepted.items() if a.share is not None]
        # the join of a shared subscription's group is read again on every attempt
        joining = self.groups if shared else None
        incarnations: Mapping[str, str] = {}
        retained = self._retained(accepted)
        for attempt in range(ATTEMPTS):
            plan = None
            if joining is not None:
                plan = joining.membership(client_id, session_id, joins=shared)
                incarnations = plan.incarnations
            reasons = self._try_subscribe(
                client_id, head, accepted, retained=retained, incarnations=incarnations, plan=plan
            )
            if reasons is None:
                return
            self._after_conflict(who, client_id, channel_of(head), reasons, attempt)
        raise ServerBusy("subscriptions of this session are contended; retry")

    def _try_subscribe(
        self,
        client_id: str,
        head: Head,
        accepted: Mapping[str, _Accepted],
        *,
        retained: list[tuple[_Accepted, RetainedModel]],
        incarnations: Mapping[str, str],
        plan: MembershipPlan | None,
    ) -> list[str] | None:
        """One attempt at the subscribe transaction: None when it committed, else the reasons."""
        session_id = head.session_id or ""
        changes: dict[str, list[Change]] = {}
        options: dict[str, dict[str, Any]] = {}
        for text, a in accepted.items():
            subscription = Subscription(
                key=subscription_item(client_id, text),
                client_id=client_id,
                session_id=session_id,
                filter=text,
                qos=a.request.qos,
                sid=a.sid,
                owner=head.sub,
                no_local=a.request.no_local,
                share=a.share,
                group=incarnations.get(text),
            )
            changes.setdefault(bucket_of(a.topic_filter), []).append(
                Change(subscription.key, subscription)
            )
            option: dict[str, Any] = {
                "qos": a.request.qos,
                "no_local": a.request.no_local,
                "retain_handling": a.request.retain_handling,
                "sid": a.sid,
            }
            if a.share is not None:
                option["share"] = a.share
            if text in incarnations:
                option["group"] = incarnations[text]
            options[text] = option
        now = self.clock.now_ms()
        versions = self.subscriptions.versions(changes)
        parts = [self.registry.repository.subscriptions_part(client_id, head, now, put=options)]
        parts += self.subscriptions.parts(changes, versions, now // 1000)
        if plan is not None:
            parts += plan.parts
        if retained:
            parts += self._retained_parts(session_id, retained, now, room=100 - len(parts))
        return self.subscriptions.dynamo.transact(parts)

    def _after_conflict(
        self, who: Principal, client_id: str, channel: str, reasons: list[str], attempt: int
    ) -> None:
        if reasons and reasons[0] == "ConditionalCheckFailed":
            # the head's condition: the channel is no longer live (this raises)
            self.registry.require_live(who, client_id, channel)
        self.clock.sleep(backoff_s(attempt, 0.01, 0.2))

    # -- retained messages

    def _retained(self, accepted: Mapping[str, _Accepted]) -> list[tuple[_Accepted, RetainedModel]]:
        """Retained messages the new subscriptions get, per retain_handling, in topic order."""
        wanted = [
            a
            for a in accepted.values()
            if a.share is None
            and (a.request.retain_handling == 0 or (a.request.retain_handling == 1 and a.new))
        ]
        if not wanted:
            return []
        chosen: dict[str, tuple[_Accepted, RetainedModel]] = {}
        topics_cache: list[str] | None = None
        for a in wanted:
            level = first_level(a.topic_filter)
            if level in (SINGLE_LEVEL, MULTI_LEVEL):
                if topics_cache is None:
                    topics_cache = sorted(
                        {t.name for t in TopicModel.scan(attributes_to_get=["name"])}
                    )
                composites = [*topics_cache, DEFAULT_TOPIC]
            elif is_valid_topic_name(level):
                # the topic's own composite topic, or `default` (it may have been published
                # before its composite topic existed)
                composites = [level, DEFAULT_TOPIC]
            else:
                # no composite topic has this name ("" of "/a", over 64 characters): `default`
                composites = [DEFAULT_TOPIC]
            keys: list[str] = []
            scanned = 0
            for composite in dict.fromkeys(composites):
                for entry in RetainedModel.by_composite.query(composite):
                    scanned += 1
                    if matches(a.topic_filter, entry.topic):
                        keys.append(entry.key)
                    if scanned >= MAX_RETAINED_SCAN:
                        break
                if scanned >= MAX_RETAINED_SCAN:
                    logger.warning("retained lookup stopped at its bound")
                    break
            for r in RetainedModel.batch_get(keys, consistent_read=True):
                # one delivery per retained message, as for published ones: several new
                # subscriptions of the call matching it send it once, with the highest QoS
                qos = min(a.request.qos, int(r.qos))
                held = chosen.get(r.topic)
                if held is None or qos > min(held[0].request.qos, int(held[1].qos)):
                    chosen[r.topic] = (a, r)
        return [chosen[topic] for topic in sorted(chosen)]

    def _retained_parts(
        self,
        session_id: str,
        retained: list[tuple[_Accepted, RetainedModel]],
        now_ms: int,
        room: int,
    ) -> list[dict[str, Any]]:
        """The state's version bump and the inbox items holding the retained deliveries."""
        state = self.inbox.state(session_id)
        expected = state.version
        state.version += 1
        messages: list[InboxMessage] = []
        total = 0
        for n, (a, r) in enumerate(retained):
            properties = json.loads(r.properties) if r.properties else {}
            expiry = properties.get("message_expiry_s")
            expires_at = None if expiry is None else int(r.published_at_ms) + int(expiry) * 1000
            if expires_at is not None and expires_at <= now_ms:
                continue
            payload = bytes(r.payload or b"")
            if n >= MAX_RETAINED_PER_CALL or total + len(payload) > MAX_RETAINED_BYTES:
                logger.warning("retained messages beyond the per-subscribe bound were not sent")
                break
            total += len(payload)
            messages.append(
                InboxMessage(
                    position=position(state.version, len(messages)),
                    message_id=str(r.message_id),
                    topic=str(r.topic),
                    payload=payload,
                    qos=min(a.request.qos, int(r.qos)),
                    subscription=a.request.filter,
                    sid=a.sid,
                    published_at_ms=int(r.published_at_ms),
                    expires_at_ms=expires_at,
                    properties=properties,
                    retain=True,
                )
            )
        if not messages:
            return []
        expires = now_ms // 1000 + self.settings.retention_s
        items = pack(session_id, RETAINED_SOURCE, messages, record_end(state.version), expires)[
            : max(0, room - 1)
        ]
        parts: list[dict[str, Any]] = [
            {"Put": self.inbox.state_part(session_id, state, expected, expires)}
        ]
        parts += [self.inbox.put_transaction_part(i) for i in items]
        return parts

    # -- unsubscribe

    def unsubscribe(
        self, who: Principal, client_id: str, channel: str | None, request: UnsubscribeRequest
    ) -> dict[str, Any]:
        head = self.registry.require_live(who, client_id, channel)
        results: list[str] = []
        dropping: dict[str, None] = {}
        for text in request.filters:
            if text in head.subscriptions:
                dropping[text] = None
                results.append("success")
            else:
                results.append("no_subscription_existed")
        if dropping:
            changes: dict[str, list[Change]] = {}
            for text in dropping:
                shared = _shared_or_none(text)
                topic_filter = shared[1] if shared else text
                changes.setdefault(bucket_of(topic_filter), []).append(
                    Change(subscription_item(client_id, text), None)
                )
            leaving = {t: head.subscriptions[t] for t in dropping if _shared_or_none(t)}
            for attempt in range(ATTEMPTS):
                now = self.clock.now_ms()
                versions = self.subscriptions.versions(changes)
                parts = [
                    self.registry.repository.subscriptions_part(
                        client_id, head, now, remove=list(dropping)
                    )
                ]
                parts += self.subscriptions.parts(changes, versions, now // 1000)
                plan = None
                if leaving and self.groups is not None:
                    # leaving a group (the last member removes it) rides in the same transaction
                    plan = self.groups.membership(client_id, head.session_id or "", leaves=leaving)
                    parts += plan.parts
                reasons = self.subscriptions.dynamo.transact(parts)
                if reasons is None:
                    if plan is not None and self.groups is not None:
                        self.groups.after(plan)
                    break
                self._after_conflict(who, client_id, channel_of(head), reasons, attempt)
            else:
                raise ServerBusy("subscriptions of this session are contended; retry")
        return {"unsubscribed": results}


class SubscriptionRetirer:
    """Removes an ended session's subscriptions from the store (``SessionEndHook``).

    Only the store: the head is gone or holds the new session. Idempotent; a subscription the
    new session made since (same key, another session id) stays.
    """

    def __init__(
        self,
        subscriptions: SubscriptionStore,
        clock: Clock | None = None,
        groups: GroupService | None = None,
    ) -> None:
        self.subscriptions = subscriptions
        self.clock = clock or SystemClock()
        #: the ended session leaves its shared groups (the last member removes a group)
        self.groups = groups

    @classmethod
    def from_config(cls, config: Config, clock: Clock | None = None) -> SubscriptionRetirer:
        from shoal.groups import GroupService

        groups = GroupService.from_config(config, clock, payloads=False)
        return cls(SubscriptionStore.from_config(config), clock, groups)

    def __call__(self, client_id: str, head: Head) -> int:
        """How many subscriptions it removed."""
        removed = 0
        for text in head.subscriptions:
            shared = _shared_or_none(text)
            bucket = bucket_of(shared[1] if shared else text)
            key = subscription_item(client_id, text)
            for attempt in range(ATTEMPTS):
                now = self.clock.now_ms()
                versions = self.subscriptions.versions([bucket])
                parts = self.subscriptions.parts(
                    {bucket: [Change(key, None)]}, versions, now // 1000
                )
                # the delete only while the item still belongs to the ended session
                delete = parts[-1]["Delete"]
                delete["ConditionExpression"] = "#sid = :sid"
                delete["ExpressionAttributeNames"] = {"#sid": "session_id"}
                delete["ExpressionAttributeValues"] = to_item({":sid": head.session_id})
                plan = None
                if shared is not None and self.groups is not None:
                    plan = self.groups.membership(
                        client_id, head.session_id or "", leaves={text: head.subscriptions[text]}
                    )
                    # first: the subscription's delete stays the last part (checked below)
                    parts = plan.parts + parts
                reasons = self.subscriptions.dynamo.transact(parts)
                if reasons is None:
                    if plan is not None and self.groups is not None:
                        self.groups.after(plan)
                    removed += 1
                    break
                if len(reasons) == len(parts) and reasons[-1] == "ConditionalCheckFailed":
                    break  # gone already, or the new session's own
                self.clock.sleep(backoff_s(attempt, 0.01, 0.2))
        return removed


def channel_of(head: Head) -> str:
    return head.newest.channel


def _shared_or_none(text: str) -> tuple[str, str] | None:
    try:
        return parse_shared(text)
    except InvalidFilter:
        return None


def _new_sid() -> str:
    return os.urandom(4).hex()


# --- get and ack ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Found:
    """A message the scan found: where it is, and the item it is in."""

    source: str
    item: InboxItem
    message: InboxMessage
    last_in_item: bool


@dataclass
class _Plan:
    state: DeliveryState
    out: list[dict[str, Any]] = field(default_factory=list)
    changed: bool = False
    #: new deliveries done without going out, and why (delivery events: ``dropped``)
    dropped: list[tuple[InboxMessage, str]] = field(default_factory=list)


class DeliveryService:
    """Get and ack for a live channel."""

    def __init__(
        self,
        registry: SessionRegistry,
        inbox: InboxStore,
        settings: DeliverySettings,
        clock: Clock | None = None,
        payloads: PayloadStore | None = None,
        *,
        groups: GroupService | None = None,
        events: Recording | None = None,
        drain: SessionGate | None = None,
    ) -> None:
        self.registry = registry
        self.inbox = inbox
        self.settings = settings
        self.clock = clock or SystemClock()
        self.payloads = payloads
        #: the group streams the session leases (``shoal.groups``)
        self.groups = groups
        #: delivery events (``shoal.delivery_events``); None records nothing
        self.events = events
        #: holds items of a later storage topic until the earlier ones are drained and handed
        #: out (``shoal.drain``); None hands out every source as it comes
        self.drain = drain

    @classmethod
    def from_config(cls, config: Config, clock: Clock | None = None) -> DeliveryService:
        from shoal.delivery_events import Recording
        from shoal.drain import SessionGate
        from shoal.groups import GroupService

        events = Recording.from_config(config, clock)
        return cls(
            SessionRegistry.from_config(config, clock),
            InboxStore.from_config(config),
            DeliverySettings.from_env(),
            clock,
            PayloadStore.from_config(config),
            groups=GroupService.from_config(config, clock, events=events),
            events=events,
            drain=SessionGate.from_config(config, clock),
        )

    # -- get

    def get(
        self,
        who: Principal,
        client_id: str,
        channel: str | None,
        max_messages: int = 10,
        wait_ms: int = 0,
    ) -> dict[str, Any]:
        if max_messages < 1:
            raise BadRequest("max is at least 1", field="max")
        if wait_ms < 0:
            raise BadRequest("wait_ms is not negative", field="wait_ms")
        head = self.registry.require_live(who, client_id, channel)
        channel = channel_of(head)
        session_id = head.session_id or ""
        wanted = min(max_messages, MAX_GET)
        deadline = self.clock.now_ms() + min(wait_ms, MAX_WAIT_MS)
        waited = False
        interval = POLL_INTERVAL_S
        # kept across idle polls: a stale copy only costs a failed conditional write
        state: DeliveryState | None = None
        while True:
            out: list[dict[str, Any]] = []
            for attempt in range(ATTEMPTS):
                if state is None:
                    state = self.inbox.state(session_id)
                expected = state.version
                now = self.clock.now_ms()
                plan = self._plan(
                    session_id=session_id,
                    head=head,
                    state=state,
                    channel=channel,
                    wanted=wanted,
                    now=now,
                )
                if not plan.changed:
                    break
                if waited:
                    # time passed: hand nothing to a channel that lost the session meanwhile
                    head = self.registry.require_live(who, client_id, channel)
                plan.state.version = expected + 1
                plan.state.normalize()
                expires = now // 1000 + self.settings.retention_s
                if self.inbox.write_state(session_id, plan.state, expected, expires):
                    out = plan.out
                    self._record_get(session_id, client_id, plan)
                    break
                state = None
                self.clock.sleep(backoff_s(attempt, 0.01, 0.2))
            else:
                raise ServerBusy("this session's deliveries are contended; retry")
            if self.groups is not None and len(out) < wanted:
                out += self.groups.get(session_id, head.subscriptions, wanted - len(out), channel)
            if out:
                return {"messages": out}
            left_ms = deadline - self.clock.now_ms()
            if left_ms <= 0:
                return {"messages": []}
            # each idle poll reads the inbox: back off, so a long wait costs few reads
            self.clock.sleep(min(interval, left_ms / 1000))
            interval = min(interval * 1.5, MAX_POLL_INTERVAL_S)
            waited = True

    def _plan(
        self,
        *,
        session_id: str,
        head: Head,
        state: DeliveryState,
        channel: str,
        wanted: int,
        now: int,
    ) -> _Plan:
        plan = _Plan(state)
        self._redeliver(session_id, plan, channel, wanted, now)
        window_left = self.settings.window - state.in_flight()
        if len(plan.out) < wanted and window_left > 0:
            self._deliver_new(
                session_id=session_id,
                head=head,
                plan=plan,
                channel=channel,
                wanted=wanted,
                window_left=window_left,
                now=now,
            )
        return plan

    def _redeliver(self, session_id: str, plan: _Plan, channel: str, wanted: int, now: int) -> None:
        state = plan.state
        timeout_ms = int(self.settings.ack_timeout_s * 1000)
        for run in sorted(state.runs, key=lambda r: r.first):
            if len(plan.out) >= wanted:
                return
            due = run.channel != channel or run.sent_at_ms + timeout_ms <= now
            if not due:
                continue
            found = self._read_run(session_id, run)
            if found is None:
                # its deliveries are gone (retention ran out): nothing left to redeliver
                logger.warning("in-flight deliveries expired before their ack")
                state.acked.update(range(run.first, run.end))
                plan.changed = True
                continue
            pending = [(n, f) for n, f in enumerate(found) if not state.done(run.first + n)]
            room = wanted - len(plan.out)
            taken = pending[:room]
            for n, f in taken:
                plan.out.append(self._answer(session_id, run.first + n, f.message, True, now))
            plan.changed = True
            if len(taken) == len(pending):
                run.sent_at_ms, run.channel = now, channel
                continue
            # split: the part handed out now, and the rest, still due
            cut = taken[-1][0] + 1
            rest_first = found[cut]
            state.runs.remove(run)
            state.runs.append(
                replace(
                    run,
                    count=cut,
                    upto=found[cut - 1].message.position,
                    sent_at_ms=now,
                    channel=channel,
                )
            )
            state.runs.append(
                replace(
                    run,
                    first=run.first + cut,
                    count=run.count - cut,
                    after=found[cut - 1].message.position,
                    start_item=rest_first.item.key,
                )
            )
            return

    def _read_run(self, session_id: str, run: Run) -> list[_Found] | None:
        """The run's messages in order, exactly as many as it has ordinals (else None)."""
        items = self.inbox.between(session_id, run.start_item, item_key(run.source, run.upto))
        found: dict[str, _Found] = {}
        for item in items:
            for n, m in enumerate(item.messages):
                # a position is one message; the first item holding it is the one handed out
                if run.after < m.position <= run.upto and m.position not in found:
                    found[m.position] = _Found(run.source, item, m, n == len(item.messages) - 1)
        ordered = sorted(found.values(), key=lambda f: f.message.position)
        return ordered if len(ordered) == run.count else None

    def _deliver_new(
        self,
        *,
        session_id: str,
        head: Head,
        plan: _Plan,
        channel: str,
        wanted: int,
        window_left: int,
        now: int,
    ) -> None:
        state = plan.state
        new_runs: dict[str, Run] = {}
        for scanned, found in enumerate(self._scan(session_id, state)):
            if len(plan.out) >= wanted or window_left <= 0 or scanned >= MAX_SCAN_PER_GET:
                break
            message = found.message
            ordinal = state.next_ordinal
            state.next_ordinal += 1
            run = new_runs.get(found.source)
            if run is None:
                run = Run(
                    first=ordinal,
                    count=0,
                    source=found.source,
                    after=state.cursors.get(found.source, ""),
                    upto=message.position,
                    start_item=found.item.key,
                    sent_at_ms=now,
                    channel=channel,
                )
                new_runs[found.source] = run
                state.runs.append(run)
            run.count += 1
            run.upto = message.position
            state.cursors[found.source] = message.position
            if found.last_in_item:
                state.partial.pop(found.source, None)
            else:
                state.partial[found.source] = found.item.key
            plan.changed = True
            if not self._wanted(head, found, now):
                # expired, or its subscription is gone: done without being sent
                state.acked.add(ordinal)
                plan.dropped.append((message, _drop_reason(found, now)))
                continue
            plan.out.append(self._answer(session_id, ordinal, message, False, now))
            if message.qos == 0:
                state.acked.add(ordinal)  # at most once: done as it goes out
            else:
                window_left -= 1

    def _wanted(self, head: Head, found: _Found, now: int) -> bool:
        """Whether a new delivery goes out: not expired, and its subscription still stands."""
        message = found.message
        if message.expires_at_ms is not None and message.expires_at_ms <= now:
            return False
        if found.item.expires_at and found.item.expires_at * 1000 <= now:
            return False
        option = head.subscriptions.get(message.subscription)
        return option is not None and option.get("sid") == message.sid

    def _scan(self, session_id: str, state: DeliveryState) -> Iterator[_Found]:
        """The session's messages after each source's cursor, source by source, in order.

        Consumed items stay until TTL, so when the scan runs into a source's consumed items it
        jumps to that source's cursor (one query per source with old items, no more).
        """
        lower, inclusive = STATE, False
        for _ in range(MAX_QUERIES_PER_GET):
            items = self.inbox.after(session_id, lower, inclusive=inclusive, limit=10)
            if not items:
                return
            jumped = False
            held: str | None = None
            for item in items:
                source = item.source
                cursor = state.cursors.get(source, "")
                fresh = [m for m in item.messages if m.position > cursor]
                held = None
                if (
                    fresh
                    and self.drain is not None
                    and not self.drain.admits(session_id, state, item)
                ):
                    # a later storage topic waits for the earlier ones (``shoal.drain``)
                    held = source
                    continue
                if not fresh:
                    partial = state.partial.get(source)
                    if partial and partial > item.key:
                        lower, inclusive = partial, True
                    else:
                        lower, inclusive = item_key(source, cursor), False
                    if (lower, inclusive) <= (item.key, True):
                        lower, inclusive = item.key, False
                    jumped = True
                    break
                for n, message in enumerate(fresh):
                    yield _Found(source, item, message, n == len(fresh) - 1)
            if not jumped:
                if len(items) < 10:
                    return
                lower, inclusive = items[-1].key, False
                if held is not None:
                    # past the held source's other items in one step, not page by page
                    lower = item_key(held, "~")

    def _answer(
        self, session_id: str, ordinal: int, message: InboxMessage, dup: bool, now: int
    ) -> dict[str, Any]:
        properties = dict(message.properties)
        if message.expires_at_ms is not None:
            # MQTT 5: the expiry a receiver sees is what is left of it
            properties["message_expiry_s"] = max(0, (message.expires_at_ms - now) // 1000)
        payload = message.payload
        if message.payload_ref is not None and self.payloads is not None:
            payload = self.payloads.get(message.payload_ref)
        return {
            "id": delivery_id(session_id, ordinal),
            "message_id": message.message_id,
            "topic": message.topic,
            "payload": base64.b64encode(payload).decode("ascii"),
            "qos": message.qos,
            "retain": message.retain,
            "dup": dup,
            "subscription": message.subscription,
            "properties": properties,
            "published_at": message.published_at_ms,
        }

    def _record_get(self, session_id: str, client_id: str, plan: _Plan) -> None:
        """The delivery events of a get whose state write succeeded: one object, keyed by the
        state version it wrote (a retried get writes another version, so its own object)."""
        if self.events is None or not self.events.enabled:
            return
        from shoal.delivery_events import record_answers

        events = self.events.new()
        record_answers(events, "session", session_id, plan.out, label=client_id)
        for message, reason in plan.dropped:
            events.add(
                "dropped",
                "session",
                session_id,
                message_id=message.message_id,
                topic=message.topic,
                published_at=message.published_at_ms,
                qos=message.qos,
                reason=reason,
                label=client_id,
            )
        events.flush(f"get/{session_id}/{plan.state.version}")

    def _record_ack(self, session_id: str, state: DeliveryState, ordinals: set[int]) -> None:
        """``acked`` for every requested ordinal that is done now, fresh or acked before (so a
        retried ack repairs a crash between its state write and this flush)."""
        if self.events is None or not self.events.enabled:
            return
        done = sorted(o for o in ordinals if o < state.next_ordinal and state.done(o))
        if not done:
            return
        events = self.events.new()
        for ordinal in done:
            events.add("acked", "session", session_id, delivery_id=delivery_id(session_id, ordinal))
        events.flush(f"ack/{session_id}/{state.version}/{done[0]}")

    # -- ack

    def ack(
        self, who: Principal, client_id: str, channel: str | None, request: AckRequest
    ) -> dict[str, Any]:
        head = self.registry.require_live(who, client_id, channel)
        session_id = head.session_id or ""
        # group deliveries (``g-...`` ids) are acked on their streams, fenced by their lease
        grouped = self.groups.ack(session_id, head.subscriptions, request.ids) if self.groups else 0
        ordinals = {o for o in (ordinal_of(session_id, i) for i in request.ids) if o is not None}
        if not ordinals:
            return {"acked": grouped}
        for attempt in range(ATTEMPTS):
            state = self.inbox.state(session_id)
            expected = state.version
            fresh = {o for o in ordinals if o < state.next_ordinal and not state.done(o)}
            if not fresh:
                self._record_ack(session_id, state, ordinals)
                return {"acked": grouped}
            state.acked |= fresh
            state.version = expected + 1
            state.normalize()
            expires = self.clock.now_ms() // 1000 + self.settings.retention_s
            if self.inbox.write_state(session_id, state, expected, expires):
                self._record_ack(session_id, state, ordinals)
                return {"acked": len(fresh) + grouped}
            self.clock.sleep(backoff_s(attempt, 0.01, 0.2))
        raise ServerBusy("this session's deliveries are contended; retry")


def _drop_reason(found: _Found, now: int) -> str:
    message = found.message
    expired = message.expires_at_ms is not None and message.expires_at_ms <= now
    if expired or (found.item.expires_at and found.item.expires_at * 1000 <= now):
        return "expired"
    return "unsubscribed"


# --- for handlers --------------------------------------------------------------------------------


__all__ = [
    "AckRequest",
    "DeliveryService",
    "DeliverySettings",
    "InboxStore",
    "SubscribeRequest",
    "SubscriptionService",
    "SubscriptionStore",
    "UnsubscribeRequest",
    "covers",
]
