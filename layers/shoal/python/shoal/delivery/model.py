"""Delivery's values and keys: settings, positions and item keys, subscription buckets and
permissions, request bodies, the subscription the router holds and one delivery of an inbox
item (``InboxMessage``; its encoding is ``shoal.delivery.codec``). No AWS here (the flow is
in ``shoal.delivery.subscriptions`` and ``shoal.delivery.service``).

Permissions: a requested filter must be *covered* by one of the principal's ``shoal:subscribe``
filters: every topic name the requested filter matches must be matched by the allowed one
(``covers``), with the ``$`` rule (``#`` does not cover ``$SYS/#``).
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from shoal.core.auth import Principal
from shoal.topics.filters import (
    MULTI_LEVEL,
    SEPARATOR,
    SINGLE_LEVEL,
    first_level,
    is_valid_filter,
    parse_shared,
)

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


#: an item of deliveries by reference (``ArchiveLine``) stays within one write unit: at about
#: 10 bytes a delivery it holds dozens, and a get's query of four such items reads at most one
#: read unit (4 KB) (``shoal.delivery.inbox.pack``)
MAX_REF_ITEM_BYTES = 1024


PAYLOADS_PREFIX = "payloads"


STATE = "#state"


LEDGER = "#ledger"


VERSION_ITEM = "#v"


WILDCARD_BUCKET = "W"


RETAINED_SOURCE = "ret"


#: how long after its publish a retained message a subscribe sent is remembered, so that a
#: routed copy of it is consumed instead of handed out a second time (``retained_mark``): the
#: router's lag this covers. The router runs about a second behind (its lag alarm fires at a
#: minute); a routed copy arriving later than this goes out too, a duplicate, never a loss
RETAINED_GUARD_S = 3600


#: marks one delivery state keeps at most (about 30 bytes each, and every get writes the
#: state): beyond it the marks that expire first go, which errs toward a duplicate
MAX_RETAINED_MARKS = 256


def retained_mark(sid: str, message_id: str) -> str:
    """A retained message a subscribe sent under subscription ``sid``: 64 bits of the message
    id (a false match would skip a message, so not fewer)."""
    digest = hashlib.blake2b(message_id.encode(), digest_size=8).hexdigest()
    return f"{sid}.{digest}"


LAST_INDEX = 99_999


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


class SubscriptionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    filter: str
    qos: StrictInt = Field(default=1, ge=0, le=2)
    no_local: StrictBool = False
    retain_handling: StrictInt = Field(default=0, ge=0, le=2)
    #: a shared filter's lanes per shard when this subscribe creates its group (how many
    #: members read one shard at once; ``shoal.groups.streams``); a group keeps its count
    lanes: StrictInt | None = Field(default=None, ge=1, le=64)


class SubscribeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    subscriptions: list[SubscriptionRequest] = Field(min_length=1, max_length=MAX_FILTERS_PER_CALL)


class UnsubscribeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    filters: list[str] = Field(min_length=1, max_length=MAX_FILTERS_PER_CALL)


class AckRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ids: list[str] = Field(max_length=MAX_ACK_IDS)


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
    #: the cut, in ms of Kinesis' arrival stamps: the router gives this subscription only
    #: records that arrived after it (a shared one: its group's cut); None: every record
    cut_ms: int | None = None

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
        if self.cut_ms is not None:
            out["cut"] = self.cut_ms
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
            cut_ms=None if data.get("cut") is None else int(data["cut"]),
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


@dataclass(frozen=True)
class ArchiveLine:
    """Where the router archived a message: ``length`` bytes at ``offset`` of the archive
    object ``key`` (one JSON line, ``shoal.router.archive``)."""

    key: str
    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


class Position(NamedTuple):
    """Where a delivery a get handed out is: its source, its position there, and its item's
    storage stream when the drain gates it (``InboxItem.stream``; None for a composite topic's
    first storage topic, or a delivery sent again)."""

    source: str
    position: str
    stream: str | None = None


@dataclass(frozen=True)
class InboxMessage:
    """One delivery in an inbox item.

    A delivery *by reference* (``line`` set) was stored without its message's content: read
    back from its item, its message id, topic, payload, properties and publish time are empty
    (``pending``) until ``filled`` from its archive line (``PayloadStore.fill``).
    """

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
    #: a shared group's copy of a message its publisher keyed: a digest of the ordering key,
    #: which picks the message's lane (``shoal.groups.streams``); None: unkeyed
    key_hash: int | None = None
    #: the message's line in the archive, for a delivery stored by reference
    line: ArchiveLine | None = None

    @property
    def pending(self) -> bool:
        """Read back by reference and not filled from its archive line yet."""
        return self.line is not None and not self.message_id

    def filled(self, line: Mapping[str, Any]) -> InboxMessage:
        """This delivery with the content of its archive line (a parsed JSON line of
        ``shoal.router.archive``); what is per delivery stays as stored."""
        return replace(
            self,
            message_id=str(line["message_id"]),
            topic=str(line["topic"]),
            payload=base64.b64decode(line["payload"]),
            published_at_ms=int(line["published_at"]),
            # as the router keeps them inline: the expiry is per delivery (``expires_at_ms``)
            properties={
                k: v for k, v in (line.get("properties") or {}).items() if k != "message_expiry_s"
            },
        )

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> InboxMessage:
        """A delivery as items stored it before ``shoal.delivery.codec`` (a map under ``m``:
        ``o`` position, ``i`` id, ``t`` topic, ``p`` payload, ``q`` QoS, ``s`` filter, ``g``
        sid, ``a`` publish time, ``x`` expiry, ``pr`` properties, ``r`` retain, ``ref``,
        ``k``)."""
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
            key_hash=int(data["k"]) if data.get("k") is not None else None,
        )

    def size(self) -> int:
        """At least what it adds to an encoded item (``pack`` keeps items under
        ``MAX_ITEM_BYTES`` by it; the encoding is smaller)."""
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
            + (12 if self.key_hash is not None else 0)
        )
