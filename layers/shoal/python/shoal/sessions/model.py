"""Sessions' values, no AWS: channel versions, connect requests and wills, the head as read,
the connect and reap decisions, and the session document."""

from __future__ import annotations

import base64
import binascii
import re
import secrets
import uuid
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeAlias

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shoal.core.auth import Principal
from shoal.core.errors import (
    BadRequest,
    Forbidden,
    InvalidTopic,
    PayloadTooLarge,
)
from shoal.topics.filters import any_matches, is_publishable_topic

MAX_U32 = 0xFFFF_FFFF
HEAD = "head"


REG_PREFIX = "reg#"


WILL_PREFIX = "will#"


#: MQTT's keepalive is a two-byte integer
MAX_KEEPALIVE_S = 0xFFFF


#: versions are stored as 15-digit keys (good until the year 33658)
MAX_CONNECTED_AT_MS = 10**15 - 1


MAX_CLIENT_ID_BYTES = 256


#: the will rides in the head item, which DynamoDB caps at 400 KB
MAX_WILL_PAYLOAD_BYTES = 64 * 1024


#: a client-supplied connect time further ahead than this would hold the client id against
#: every real connect until that channel ends
MAX_CLOCK_AHEAD_MS = 60_000


#: the server closes a channel that sent nothing for 1.5 x keepalive (MQTT 5, 3.1.2.10)
KEEPALIVE_GRACE = 1.5


#: how long the newest connect keeps retrying against racing older ones before server_busy
CONNECT_BUDGET_S = 5.0


BACKOFF_BASE_MS = 5


BACKOFF_CAP_MS = 100


#: older registrations and waiting wills one connect cleans up (a transaction holds 100)
MAX_CLEANUP = 25


#: the reaper publishes a claimed will again after this long if its invocation died mid-way
WILL_RETRY_MS = 60_000


#: how long a will held for its channel's close (``ScheduledWill.held_since_ms``) waits for
#: that channel's ``$disconnect``: API Gateway sends it within seconds of the close, ``shoal
#: dev`` under load within minutes; a close that never comes means a live channel was taken
#: over, whose will MQTT withholds
HELD_WILL_BOUND_MS = 600_000

#: shards of the due index; a stable hash of the client id picks one
DUE_SHARDS = 8


_CHANNEL = re.compile(r"(\d{1,15})-([A-Za-z0-9_-]{1,64})", re.ASCII)


#: a channel as the API carries it (the ``Shoal-Channel`` header, ``<connected_at_ms>-<nonce>``):
#: the text form of a ``Version``. A named alias, so signatures say which string they take.
Channel: TypeAlias = str


@dataclass(frozen=True, order=True)
class Version:
    """A registration's version: connect time, then a random nonce breaking ties.

    The nonce makes the channel unguessable and two connects in one millisecond comparable,
    the same way everywhere (lexicographically, after the time).
    """

    connected_at_ms: int
    nonce: str

    @classmethod
    def new(cls, connected_at_ms: int) -> Version:
        return cls(connected_at_ms, secrets.token_urlsafe(16))

    @classmethod
    def parse(cls, text: str) -> Version:
        """A channel (``<ms>-<nonce>``) or a version key (the same with ``ms`` zero-padded)."""
        match = _CHANNEL.fullmatch(text)
        if match is None:
            raise BadRequest("the Shoal-Channel header does not name a channel")
        return cls(int(match.group(1)), match.group(2))

    @property
    def channel(self) -> str:
        """What the client names its channel by (``Shoal-Channel``)."""
        return f"{self.connected_at_ms}-{self.nonce}"

    @property
    def key(self) -> str:
        """The stored form: sorts as the version does."""
        return f"{self.connected_at_ms:015d}-{self.nonce}"


class WillMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    topic: str
    #: base64
    payload: str | None = None
    text: str | None = None
    qos: int = Field(default=1, ge=0, le=2)
    retain: bool = False
    delay_s: int = Field(default=0, ge=0, le=MAX_U32)

    @model_validator(mode="after")
    def _one_body(self) -> WillMessage:
        if self.payload is not None and self.text is not None:
            raise ValueError("give the will's payload or its text, not both")
        if self.payload is not None:
            try:
                base64.b64decode(self.payload, validate=True)
            except binascii.Error as exc:
                raise ValueError("the will's payload must be base64") from exc
        return self

    def body(self) -> bytes:
        if self.payload is not None:
            return base64.b64decode(self.payload)
        return (self.text or "").encode()


class ConnectRequest(BaseModel):
    """The body of ``PUT /v1/sessions/{client_id}``."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    clean_start: bool = True
    session_expiry_s: int = Field(default=0, ge=0, le=MAX_U32)
    keepalive_s: int = Field(default=60, ge=0, le=MAX_KEEPALIVE_S)
    connected_at_ms: int | None = Field(default=None, ge=0, le=MAX_CONNECTED_AT_MS)
    will: WillMessage | None = None
    #: chosen by the client for one connect and kept across its retries: a retry whose
    #: earlier try registered gets that try's channel back, rather than a newer channel
    #: that takes it over (and publishes its will, MQTT 5 §3.1.4)
    connect_token: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9_-]{8,64}$",
        description=(
            "Kept across the retries of one HTTP connect: a retry whose earlier try registered"
            " is answered with that channel while it is live. Ignored on a WebSocket."
        ),
    )


@dataclass(frozen=True)
class Head:
    """The head item: the newest registration and the session it owns."""

    newest: Version
    sub: str
    rev: int
    connected: bool
    keepalive_s: int
    grace_ms: int
    last_seen_ms: int
    will: WillMessage | None
    session_id: str | None
    session_expiry_s: int
    session_expires_at_ms: int | None
    subscriptions: Mapping[str, Any]
    due_at_ms: int | None
    #: the newest channel's connect: its ``connect_token``, and what it answered
    connect_token: str | None = None
    connect_session_present: bool = False

    @property
    def channel(self) -> str:
        return self.newest.channel

    def session_alive(self, now_ms: int) -> bool:
        """A session exists: owned by a live channel, or disconnected and not yet expired."""
        if self.session_id is None:
            return False
        if self.connected:
            return True
        return self.session_expires_at_ms is not None and self.session_expires_at_ms > now_ms

    def is_live(self, version: Version) -> bool:
        return self.connected and self.newest == version


@dataclass(frozen=True)
class ScheduledWill:
    version: Version
    message: WillMessage
    due_at_ms: int
    claimed_at_ms: int | None = None
    #: the principal whose session it was: the will is published as it
    sub: str = ""
    #: held for its channel's close: a connect resumed the session at this instant while the
    #: channel still looked live (its ``$disconnect`` had not run yet). That ``$disconnect``
    #: decides, from when the connection closed: published at once if the delay ran out
    #: before this instant, dropped otherwise (MQTT 5 §3.1.3.2.2). Its due time is only the
    #: bound on waiting for it (``HELD_WILL_BOUND_MS``): past it, dropped, never published
    held_since_ms: int | None = None

    @property
    def item(self) -> str:
        return WILL_PREFIX + self.version.key


@dataclass(frozen=True)
class RegistryView:
    """One read of a client id's partition."""

    head: Head | None = None
    registrations: tuple[Version, ...] = ()
    wills: tuple[ScheduledWill, ...] = ()

    def newest(self) -> Version | None:
        """The newest registration this read shows (LocalMax or RealMax).

        A disconnected (or expired) channel has no registration left, so it no longer holds
        off older connects; the head counts only while its channel is connected.
        """
        live = [self.head.newest] if self.head is not None and self.head.connected else []
        versions = [*self.registrations, *live]
        return max(versions) if versions else None


class Decision(Enum):
    NEW = "new"
    RESUME = "resume"  # takeover: clean_start false and an unexpired session
    DISCARD = "discard"  # clean_start true: the existing session ends


@dataclass(frozen=True)
class ConnectPlan:
    decision: Decision
    session_id: str
    #: older registrations this connect deletes (their channels' takeover end)
    stale: tuple[Version, ...] = ()
    #: waiting wills the resumed session suppresses
    cancel_wills: tuple[ScheduledWill, ...] = ()
    #: waiting wills whose session this connect ends: published at once (MQTT 5, 3.1.3.2.2)
    fire_wills: tuple[ScheduledWill, ...] = ()
    #: the will of the live channel this connect takes over, when it is published now: written
    #: due at once in the connect's transaction, for the reaper (``takeover_will``)
    takeover_will: ScheduledWill | None = None

    @property
    def session_present(self) -> bool:
        return self.decision is Decision.RESUME


def plan_connect(
    view: RegistryView, request: ConnectRequest, sub: str, ours: Version, now_ms: int
) -> ConnectPlan:
    """Step 2: takeover, new session or discard, from what was read."""
    head = view.head
    alive = head is not None and head.session_alive(now_ms)
    if head is not None and alive and head.sub != sub:
        raise Forbidden("the client id's session belongs to another principal")
    # a session whose expiry is 0 ends with its channel (MQTT 5 §3.1.2.11.2): taking that
    # channel over ends it too, so there is nothing to resume and session_present is false
    resumable = alive and head is not None and not (head.connected and head.session_expiry_s == 0)
    if head is not None and resumable and not request.clean_start:
        decision, session_id = Decision.RESUME, head.session_id or ""
    else:
        decision = Decision.DISCARD if alive else Decision.NEW
        session_id = uuid.uuid4().hex
    stale = tuple(sorted(v for v in view.registrations if v < ours)[:MAX_CLEANUP])
    # a will that is due or claimed is the reaper's: its delay ran out before this connect;
    # one held for its channel's close is that channel's $disconnect's to decide
    waiting = tuple(
        w
        for w in view.wills
        if w.claimed_at_ms is None and w.due_at_ms > now_ms and w.held_since_ms is None
    )
    waiting = waiting[:MAX_CLEANUP]
    fired = takeover_will(head, decision, now_ms)
    if decision is Decision.RESUME:
        return ConnectPlan(decision, session_id, stale, cancel_wills=waiting, takeover_will=fired)
    return ConnectPlan(decision, session_id, stale, fire_wills=waiting, takeover_will=fired)


def takeover_will(head: Head | None, decision: Decision, now_ms: int) -> ScheduledWill | None:
    """The will of the live channel a connect takes over, due now when it is published.

    A takeover ends the old channel without a DISCONNECT, so its will stands (MQTT 5
    §3.1.2.5, [MQTT-3.1.4-3]); it is sent after its Will Delay Interval unless the session is
    resumed within it, or at once when the session ends first (§3.1.3.2.2). The new connect
    is that moment: a resumed session (RESUME) withholds a delayed will, and publishes one
    without a delay; a session this connect does not resume (DISCARD: clean start, or a
    session expiry of 0, which ended with its channel) publishes it at once, whatever its
    delay. Only a connected head has a will (a disconnect or keepalive expiry removes it).

    A channel that only looks live may have closed already: its keepalive ran out and the
    reaper has not come yet, or its WebSocket connection went and its ``$disconnect`` has not
    run yet. The first counts from the keepalive's end, as the reaper would: a will whose
    delay ran out before now is published now. The second is not known here, so a resumed
    session's delayed will is held for that ``$disconnect``, which knows when the connection
    closed (``SessionRegistry.closed_after_takeover``).
    """
    if head is None or not head.connected or head.will is None:
        return None
    if decision is Decision.RESUME and head.will.delay_s > 0:
        expired_at = head.last_seen_ms + head.grace_ms
        if expired_at <= now_ms:
            if expired_at + head.will.delay_s * 1000 <= now_ms:
                return ScheduledWill(head.newest, head.will, now_ms, sub=head.sub)
            return None
        return ScheduledWill(
            head.newest, head.will, now_ms + HELD_WILL_BOUND_MS, sub=head.sub, held_since_ms=now_ms
        )
    return ScheduledWill(head.newest, head.will, now_ms, sub=head.sub)


class ConflictStep(Enum):
    COMMITTED = "committed"  # our own transaction landed (an SDK retry saw its condition fail)
    OUTDATED = "outdated"  # a newer connect won: channel_outdated
    ABORT = "abort"  # RealMax older than LocalMax: the registry moved backwards
    RETRY = "retry"  # a newer predecessor: try again against it


def after_conflict(
    ours: Version, local_max: Version | None, real_max: Version | None
) -> ConflictStep:
    """Step 3's answer to a failed condition, from the strongly consistent RealMax."""
    if real_max == ours:
        return ConflictStep.COMMITTED
    if real_max is not None and ours < real_max:
        return ConflictStep.OUTDATED
    if local_max is not None and (real_max is None or real_max < local_max):
        # ours > LocalMax > RealMax: "very unlikely" in the EIP; abort rather than guess
        return ConflictStep.ABORT
    return ConflictStep.RETRY


@dataclass(frozen=True)
class Connected:
    session_present: bool
    channel: Channel
    keepalive_s: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "session_present": self.session_present,
            "channel": self.channel,
            "keepalive_s": self.keepalive_s,
        }


class ReapAction(Enum):
    NOTHING = "nothing"
    EXPIRE_CHANNEL = "expire_channel"
    END_SESSION = "end_session"
    RESCHEDULE = "reschedule"


def reap_action(head: Head, now_ms: int) -> tuple[ReapAction, int | None]:
    """What the reaper does with a head it found due, and when the head is next due."""
    if head.connected:
        if head.keepalive_s == 0:
            return ReapAction.RESCHEDULE, None
        deadline = head.last_seen_ms + head.grace_ms
        if now_ms >= deadline:
            return ReapAction.EXPIRE_CHANNEL, None
        return ReapAction.RESCHEDULE, deadline
    expires = head.session_expires_at_ms
    if expires is None or expires <= now_ms:
        return ReapAction.END_SESSION, None
    return ReapAction.RESCHEDULE, expires


def due_shard(client_id: str) -> str:
    return str(zlib.crc32(client_id.encode()) % DUE_SHARDS)


def grace_ms(keepalive_s: int) -> int:
    return int(keepalive_s * 1000 * KEEPALIVE_GRACE)


def check_client_id(client_id: str) -> None:
    size = len(client_id.encode("utf-8", "surrogatepass"))
    if not 0 < size <= MAX_CLIENT_ID_BYTES or not client_id.isprintable():
        raise BadRequest(f"a client id is 1-{MAX_CLIENT_ID_BYTES} bytes of printable UTF-8")


def parse_channel(header: str | None) -> Version:
    if not header:
        raise BadRequest("this call needs the Shoal-Channel header from the connect answer")
    return Version.parse(header.strip())


def session_document(client_id: str, head: Head) -> dict[str, Any]:
    """The answer of ``GET /v1/sessions/{client_id}``."""
    return {
        "client_id": client_id,
        "channel": head.channel,
        "session_id": head.session_id,
        "connected": head.connected,
        "keepalive_s": head.keepalive_s,
        "session_expiry_s": head.session_expiry_s,
        "expires_at_ms": None if head.connected else head.session_expires_at_ms,
        "subscriptions": [
            {"filter": name, **dict(options)}
            for name, options in sorted(head.subscriptions.items())
        ],
        "groups": [],
        "in_flight": 0,
    }


def check_will(who: Principal, will: WillMessage) -> None:
    if not is_publishable_topic(will.topic):
        raise InvalidTopic("the will's topic is not a topic name a client may publish to")
    if len(will.body()) > MAX_WILL_PAYLOAD_BYTES:
        raise PayloadTooLarge(f"a will's payload is at most {MAX_WILL_PAYLOAD_BYTES} bytes")
    if not any_matches(who.publish, will.topic):
        raise Forbidden("the will's topic is outside the principal's shoal:publish filters")
