"""Sessions: the linear session registry, and the session state it guards.

Every connect registers a *channel* whose *version* is its connect time (``connected_at_ms``)
with a random nonce breaking ties, so the channels of one client id are totally ordered and the
newest one wins (the EMQX "Linear Session Registry" design, on DynamoDB):

1. an eventually consistent read of the client's partition gives LocalMax, the newest version
   it shows; a connect older than LocalMax is refused at once (``channel_outdated``);
2. the connect decides, as MQTT 5 does, whether it resumes the session (``clean_start`` false
   and an unexpired session: ``session_present``), discards it or starts a new one;
3. one conditional transaction on the client's *head* item commits it: the head must still
   name the newest version (and lifecycle revision) that was read, or be absent. When the
   condition fails, a strongly consistent read gives RealMax: a connect older than RealMax is
   refused; otherwise it retries against the new predecessor, within a time budget, and only
   then answers ``server_busy``. RealMax older than LocalMax means the registry moved
   backwards under the connect (the newest channel deregistered between the reads): it
   aborts, changing nothing.

There is no lock item: a killed invocation leaves at most a registration that nothing names.

The table holds one partition per client id (``shoal.aws.tables.SessionItemModel``):

- ``head``: the newest registration's version key (``newest``), the owning principal (``sub``),
  ``rev`` (bumped by every lifecycle change: connect, disconnect, keepalive expiry),
  ``connected``, ``last_seen_ms``; ``conn``, the live channel's parameters (keepalive,
  ``grace_ms`` = 1.5 x keepalive, session expiry, the armed will); ``session``, the session
  state (``id``, ``subscriptions``; its deliveries live in the inbox), and
  ``session_expires_at_ms`` once disconnected. Keeping the registry head and the session in
  one item makes "the session has exactly one owner" hold by construction, and lets every
  session-scoped write carry the liveness check as its condition (``Expression.live``). Few
  top-level attributes keep the connect's update short.
- ``reg#<version>``: one registration, a bag entry per channel. Deregistration deletes exactly
  its own entry, whose key is its version, so it can never remove a newer registration. A
  connect also deletes the older entries it read (the "takeover end" of those channels).
- ``will#<version>``: a will waiting out its delay after its channel's keepalive expired.

Only registrations count towards LocalMax and RealMax, as in the EIP: once a channel has
disconnected (or its keepalive expired) it holds off no connect, so a reconnect is never
refused for a gateway clock a millisecond behind the previous one.

The reaper finds work through the sparse ``due`` index (see ``shoal.aws.tables.DueIndex``): a head
is indexed while its keepalive runs or its session awaits expiry, a will while it waits.
Heartbeats do not touch the index (that would cost an index write per heartbeat); the reaper
re-indexes a head whose deadline moved when it finds it due early.
"""

from __future__ import annotations

import base64
import binascii
import re
import secrets
import threading
import uuid
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol

from botocore.exceptions import ClientError
from pydantic import BaseModel, ConfigDict, Field, model_validator

from shoal.aws.dynamo import CONDITION_FAILED, Dynamo, Expression, attribute, error_code, from_item
from shoal.core.auth import Principal
from shoal.core.clock import Clock, SystemClock
from shoal.core.config import Config
from shoal.core.errors import (
    BadRequest,
    ChannelOutdated,
    Forbidden,
    InvalidTopic,
    PayloadTooLarge,
    ServerBusy,
    SessionNotFound,
    SessionTakenOver,
    ShoalError,
)
from shoal.core.observability import logger
from shoal.core.retry import backoff_s
from shoal.topics.filters import any_matches, is_publishable_topic

if TYPE_CHECKING:
    from shoal.publish.service import PublishService

TABLE = "sessions"
HEAD = "head"
REG_PREFIX = "reg#"
WILL_PREFIX = "will#"

MAX_U32 = 0xFFFF_FFFF
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
#: shards of the due index; a stable hash of the client id picks one
DUE_SHARDS = 8

_CHANNEL = re.compile(r"(\d{1,15})-([A-Za-z0-9_-]{1,64})", re.ASCII)


# --- versions, requests, the session view (no AWS here) --------------------------------------


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
    if head is not None and alive and not request.clean_start:
        decision, session_id = Decision.RESUME, head.session_id or ""
    else:
        decision = Decision.DISCARD if alive else Decision.NEW
        session_id = uuid.uuid4().hex
    stale = tuple(sorted(v for v in view.registrations if v < ours)[:MAX_CLEANUP])
    # a will that is due or claimed is the reaper's: its delay ran out before this connect
    waiting = tuple(w for w in view.wills if w.claimed_at_ms is None and w.due_at_ms > now_ms)
    waiting = waiting[:MAX_CLEANUP]
    if decision is Decision.RESUME:
        return ConnectPlan(decision, session_id, stale, cancel_wills=waiting)
    return ConnectPlan(decision, session_id, stale, fire_wills=waiting)


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
    channel: str
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


# --- ports -----------------------------------------------------------------------------------


class WillPublisher(Protocol):
    def publish_will(self, sub: str, client_id: str, will: WillMessage, will_id: str) -> None:
        """Publish ``will`` as principal ``sub``; ``will_id`` is the same on every retry."""
        ...


class GroupLeases(Protocol):
    """The session's shared groups (``shoal.groups.GroupService``)."""

    def heartbeat(
        self, session_id: str, subscriptions: Mapping[str, Any]
    ) -> list[dict[str, Any]]: ...

    def describe(
        self, session_id: str, subscriptions: Mapping[str, Any]
    ) -> list[dict[str, Any]]: ...


class InFlight(Protocol):
    """The session's deliveries waiting for their ack (``shoal.delivery.InboxStore``)."""

    def in_flight(self, session_id: str) -> int: ...


class SessionEndHook(Protocol):
    def __call__(self, client_id: str, head: Head) -> object:
        """A session ended (discarded by a connect, or expired): clean up after it."""
        ...


def _ended(hook: SessionEndHook | None, client_id: str, head: Head) -> None:
    if hook is None:
        return
    try:
        hook(client_id, head)
    except Exception as exc:
        logger.warning("cleaning up an ended session failed", extra={"error": type(exc).__name__})


class ServiceWillPublisher:
    """Wills go through the publish path (``shoal.publishing``), exactly once each.

    A will is published as its session's principal with ``publisher_id = "will:<channel>"``
    and ``publisher_seq = 1``: a channel has at most one will, and the publish path answers a
    retry of that pair as a duplicate instead of putting the message again.
    """

    def __init__(self, service: PublishService) -> None:
        self.service = service

    def publish_will(self, sub: str, client_id: str, will: WillMessage, will_id: str) -> None:
        from shoal.publish.request import PublishRequest

        request = PublishRequest(
            topic=will.topic,
            payload=will.payload,
            text=will.text if will.payload is None else None,
            qos=will.qos,
            retain=will.retain,
            publisher_id=f"will:{will_id}",
            publisher_seq=1,
        )
        # the connect checked the topic against the principal's shoal:publish filters
        as_owner = Principal(sub=sub, clients=(client_id,), publish=(will.topic,))
        self.service.publish(as_owner, request)


# --- the DynamoDB repository -----------------------------------------------------------------


def _alias(expr: Expression, name: str) -> str:
    """An alias of one attribute name that may hold any character (a topic filter)."""
    alias = f"#k{len(expr.names)}"
    expr.names[alias] = name
    return alias


def live_condition(expr: Expression, version: Version, sub: str) -> str:
    """The condition every write of a session-scoped call carries: ``version`` is still the
    newest channel of the client id, connected, and the session is ``sub``'s."""
    return (
        f"{expr.n('newest')} = {expr.v(version.key)}"
        f" AND {expr.n('connected')} = {expr.v(True)} AND {expr.n('sub')} = {expr.v(sub)}"
    )


class SessionRepository:
    """The sessions table: every read and conditional write the registry and reaper make."""

    def __init__(self, dynamo: Dynamo, table: str) -> None:
        self.dynamo = dynamo
        self.table = table

    @classmethod
    def from_config(cls, config: Config) -> SessionRepository:
        return cls(Dynamo.from_config(config), config.table(TABLE))

    def _key(self, client_id: str, item: str) -> dict[str, Any]:
        return {"client_id": {"S": client_id}, "item": {"S": item}}

    def _on(
        self,
        client_id: str,
        item: str,
        expr: Expression | None = None,
        condition: str | None = None,
    ) -> dict[str, Any]:
        """A request (or transaction part) addressed to one item."""
        params = (expr or Expression()).params(condition)
        return {"TableName": self.table, "Key": self._key(client_id, item), **params}

    def _transact(self, items: list[dict[str, Any]]) -> bool:
        """All or nothing: False when a condition did not hold or another write interfered."""
        return self.dynamo.transact(items) is None

    # -- reads

    def read(self, client_id: str, *, consistent: bool) -> RegistryView:
        """The client's partition: head, registrations and waiting wills."""
        head: Head | None = None
        registrations: list[Version] = []
        wills: list[ScheduledWill] = []
        expr = Expression()
        request: dict[str, Any] = {
            "TableName": self.table,
            "KeyConditionExpression": f"{expr.n('client_id')} = {expr.v(client_id)}",
            "ConsistentRead": consistent,
            **expr.params(),
        }
        while True:
            page = self.dynamo.call("query", **request)
            for raw in page.get("Items", []):
                item = from_item(raw)
                kind = item["item"]
                if kind == HEAD:
                    head = _head(item)
                elif kind.startswith(REG_PREFIX):
                    registrations.append(Version.parse(kind[len(REG_PREFIX) :]))
                elif kind.startswith(WILL_PREFIX):
                    wills.append(_scheduled_will(item))
            if "LastEvaluatedKey" not in page:
                break
            request["ExclusiveStartKey"] = page["LastEvaluatedKey"]
        return RegistryView(head, tuple(registrations), tuple(wills))

    def head(self, client_id: str) -> Head | None:
        raw = self.dynamo.call("get_item", **{**self._on(client_id, HEAD), "ConsistentRead": True})
        return _head(from_item(raw["Item"])) if "Item" in raw else None

    def will(self, client_id: str, item: str) -> ScheduledWill | None:
        raw = self.dynamo.call("get_item", **{**self._on(client_id, item), "ConsistentRead": True})
        return _scheduled_will(from_item(raw["Item"])) if "Item" in raw else None

    def due(self, shard: str, now_ms: int, limit: int) -> list[tuple[str, str]]:
        """Keys of the items in ``shard`` whose reaper work is due (the index, not a scan)."""
        keys: list[tuple[str, str]] = []
        expr = Expression()
        condition = f"{expr.n('due_shard')} = {expr.v(shard)} AND {expr.n('due_at_ms')} <= "
        request: dict[str, Any] = {
            "TableName": self.table,
            "IndexName": "due",
            "KeyConditionExpression": condition + expr.v(now_ms),
            "Limit": limit,
            **expr.params(),
        }
        while len(keys) < limit:
            page = self.dynamo.call("query", **request)
            keys += [(i["client_id"]["S"], i["item"]["S"]) for i in page.get("Items", [])]
            if "LastEvaluatedKey" not in page:
                break
            request["ExclusiveStartKey"] = page["LastEvaluatedKey"]
        return keys[:limit]

    # -- writes of the registry

    def register(
        self,
        client_id: str,
        *,
        sub: str,
        ours: Version,
        request: ConnectRequest,
        plan: ConnectPlan,
        expected: Head | None,
        now_ms: int,
    ) -> bool:
        """Step 3: one transaction, on condition that the head is still as read."""
        head = Expression().set("newest", ours.key).set("sub", sub)
        head.set("rev", (expected.rev if expected else 0) + 1).set("connected", True)
        head.set("last_seen_ms", now_ms).set("conn", _conn(ours, request))
        head.remove("session_expires_at_ms", "expires_at")
        if request.keepalive_s > 0:
            deadline = now_ms + grace_ms(request.keepalive_s)
            head.set("due_shard", due_shard(client_id)).set("due_at_ms", deadline)
        else:
            head.remove("due_shard", "due_at_ms")
        if plan.decision is not Decision.RESUME:
            fresh = {"id": plan.session_id, "started_at_ms": now_ms}
            head.set("session", {**fresh, "subscriptions": {}})
        if expected is None:
            condition = f"attribute_not_exists({head.n('client_id')})"
        else:
            condition = (
                f"{head.n('newest')} = {head.v(expected.newest.key)}"
                f" AND {head.n('rev')} = {head.v(expected.rev)}"
            )
        registration = Expression()
        items: list[dict[str, Any]] = [
            {"Update": self._on(client_id, HEAD, head, condition)},
            {
                "Put": {
                    "TableName": self.table,
                    "Item": _registration_item(client_id, ours, sub, now_ms),
                    **registration.params(f"attribute_not_exists({registration.n('item')})"),
                }
            },
        ]
        items += [{"Delete": self._on(client_id, REG_PREFIX + v.key)} for v in plan.stale]
        for will in plan.cancel_wills:
            # unless the reaper claimed it meanwhile (which moves its due time)
            cancel = Expression()
            due = f"{cancel.n('due_at_ms')} = {cancel.v(will.due_at_ms)}"
            items.append({"Delete": self._on(client_id, will.item, cancel, due)})
        for will in plan.fire_wills:
            fire = Expression().set("due_at_ms", now_ms)
            due = f"{fire.n('due_at_ms')} = {fire.v(will.due_at_ms)}"
            items.append({"Update": self._on(client_id, will.item, fire, due)})
        return self._transact(items)

    def heartbeat(self, client_id: str, version: Version, sub: str, now_ms: int) -> bool:
        """Refresh the keepalive, on condition that the channel is still the live one."""
        expr = Expression().set("last_seen_ms", now_ms)
        return self.dynamo.conditional(
            "update_item", **self._on(client_id, HEAD, expr, live_condition(expr, version, sub))
        )

    def heartbeat_head(
        self, client_id: str, version: Version, sub: str, now_ms: int
    ) -> Head | None:
        """``heartbeat``, answering the head as written (None: not the live channel). The
        answer costs nothing more than the write, and names the session's groups."""
        expr = Expression().set("last_seen_ms", now_ms)
        request = {
            **self._on(client_id, HEAD, expr, live_condition(expr, version, sub)),
            "ReturnValues": "ALL_NEW",
        }
        try:
            raw = self.dynamo.call("update_item", **request)
        except ClientError as exc:
            if error_code(exc) == CONDITION_FAILED:
                return None
            raise
        return _head(from_item(raw["Attributes"]))

    def update_live(
        self, client_id: str, version: Version, sub: str, expr: Expression, now_ms: int
    ) -> bool:
        """Apply ``expr`` to the head only while ``version`` is ``sub``'s live channel.

        The way every session-scoped write (subscribe, unsubscribe, ...) changes the session:
        a stale channel's write fails its condition and changes nothing. Like any call of the
        channel, it also refreshes the keepalive.
        """
        expr.set("last_seen_ms", now_ms)
        return self.dynamo.conditional(
            "update_item", **self._on(client_id, HEAD, expr, live_condition(expr, version, sub))
        )

    def subscriptions_part(
        self,
        client_id: str,
        head: Head,
        now_ms: int,
        *,
        put: Mapping[str, Mapping[str, Any]] | None = None,
        remove: Iterable[str] = (),
    ) -> dict[str, Any]:
        """A transaction part changing the session's subscriptions (``shoal.delivery``): on
        condition that ``head``'s channel is still live, in the same session."""
        expr = Expression().set("last_seen_ms", now_ms)
        subscriptions = expr.n("session.subscriptions")
        for text, option in (put or {}).items():
            expr.sets.append(f"{subscriptions}.{_alias(expr, text)} = {expr.v(dict(option))}")
        for text in remove:
            expr.removes.append(f"{subscriptions}.{_alias(expr, text)}")
        condition = (
            f"{live_condition(expr, head.newest, head.sub)}"
            f" AND {expr.n('session.id')} = {expr.v(head.session_id)}"
        )
        return {"Update": self._on(client_id, HEAD, expr, condition)}

    def disconnect(self, client_id: str, version: Version, sub: str, now_ms: int) -> bool:
        """A clean disconnect: the will is dropped and the session's expiry starts."""
        head = Expression().set("connected", False)
        head.set_raw("rev", f"{head.n('rev')} + {head.v(1)}")
        # update expressions add but cannot multiply: ``conn`` keeps the expiry in both units
        # so that a disconnect is one write, without reading the head first
        expires_ms = f"{head.v(now_ms)} + {head.n('conn.session_expiry_ms')}"
        head.set_raw("session_expires_at_ms", expires_ms).set_raw("due_at_ms", expires_ms)
        now_s = -(-now_ms // 1000)
        head.set_raw("expires_at", f"{head.v(now_s)} + {head.n('conn.session_expiry_s')}")
        head.set("due_shard", due_shard(client_id)).remove("conn.will")
        return self._transact(
            [
                {"Update": self._on(client_id, HEAD, head, live_condition(head, version, sub))},
                {"Delete": self._on(client_id, REG_PREFIX + version.key)},
            ]
        )

    def deregister(self, client_id: str, version: Version) -> bool:
        """Delete exactly this channel's registration; a newer one has another key."""
        expr = Expression()
        condition = (
            f"{expr.n('channel')} = {expr.v(version.channel)}"
            f" AND {expr.n('connected_at_ms')} = {expr.v(version.connected_at_ms)}"
        )
        return self.dynamo.conditional(
            "delete_item", **self._on(client_id, REG_PREFIX + version.key, expr, condition)
        )

    # -- writes of the reaper

    def expire_channel(
        self, client_id: str, head: Head, now_ms: int, will_due_ms: int | None
    ) -> bool:
        """Disconnect the live channel whose keepalive ran out; schedule its will."""
        expires_ms = now_ms + head.session_expiry_s * 1000
        expr = Expression().set("connected", False).set("rev", head.rev + 1)
        expr.set("session_expires_at_ms", expires_ms).set("expires_at", -(-expires_ms // 1000))
        expr.set("due_shard", due_shard(client_id)).set("due_at_ms", expires_ms)
        expr.remove("conn.will")
        # no call since it was read: a heartbeat in between keeps the channel
        condition = (
            f"{live_condition(expr, head.newest, head.sub)}"
            f" AND {expr.n('rev')} = {expr.v(head.rev)}"
            f" AND {expr.n('last_seen_ms')} = {expr.v(head.last_seen_ms)}"
        )
        items: list[dict[str, Any]] = [
            {"Update": self._on(client_id, HEAD, expr, condition)},
            {"Delete": self._on(client_id, REG_PREFIX + head.newest.key)},
        ]
        if head.will is not None and will_due_ms is not None:
            will = {
                **self._key(client_id, WILL_PREFIX + head.newest.key),
                "channel": attribute(head.channel),
                "sub": attribute(head.sub),
                "will": attribute(head.will.model_dump(exclude_none=True)),
                "due_shard": attribute(due_shard(client_id)),
                "due_at_ms": attribute(will_due_ms),
            }
            items.append({"Put": {"TableName": self.table, "Item": will}})
        return self._transact(items)

    def set_due(self, client_id: str, head: Head, due_at_ms: int | None) -> bool:
        """Move (or drop) the head's place in the due index, if the head did not change."""
        expr = Expression()
        if due_at_ms is None:
            expr.remove("due_shard", "due_at_ms")
        else:
            expr.set("due_shard", due_shard(client_id)).set("due_at_ms", due_at_ms)
        condition = (
            f"{expr.n('rev')} = {expr.v(head.rev)}"
            f" AND {expr.n('last_seen_ms')} = {expr.v(head.last_seen_ms)}"
        )
        return self.dynamo.conditional("update_item", **self._on(client_id, HEAD, expr, condition))

    def end_session(self, client_id: str, head: Head, registrations: Iterable[Version]) -> bool:
        """Delete an ended session's head and the registrations left behind."""
        expr = Expression()
        condition = f"{expr.n('rev')} = {expr.v(head.rev)} AND {expr.n('connected')} = "
        condition += expr.v(False)
        items = [{"Delete": self._on(client_id, HEAD, expr, condition)}]
        leftovers = sorted(registrations)[: MAX_CLEANUP * 3]
        items += [{"Delete": self._on(client_id, REG_PREFIX + v.key)} for v in leftovers]
        return self._transact(items)

    def claim_will(
        self, client_id: str, will: ScheduledWill, now_ms: int, retry_at_ms: int
    ) -> bool:
        """Take a due will for publishing; a resuming connect can no longer cancel it."""
        expr = Expression().set("claimed_at_ms", now_ms).set("due_at_ms", retry_at_ms)
        condition = f"{expr.n('due_at_ms')} = {expr.v(will.due_at_ms)}"
        return self.dynamo.conditional(
            "update_item", **self._on(client_id, will.item, expr, condition)
        )

    def finish_will(self, client_id: str, will: ScheduledWill, claimed_at_ms: int) -> bool:
        expr = Expression()
        condition = f"{expr.n('claimed_at_ms')} = {expr.v(claimed_at_ms)}"
        return self.dynamo.conditional(
            "delete_item", **self._on(client_id, will.item, expr, condition)
        )


def _registration_item(client_id: str, ours: Version, sub: str, now_ms: int) -> dict[str, Any]:
    return {
        "client_id": attribute(client_id),
        "item": attribute(REG_PREFIX + ours.key),
        "channel": attribute(ours.channel),
        "connected_at_ms": attribute(ours.connected_at_ms),
        "sub": attribute(sub),
        "registered_at_ms": attribute(now_ms),
    }


def _conn(ours: Version, request: ConnectRequest) -> dict[str, Any]:
    conn: dict[str, Any] = {
        "connected_at_ms": ours.connected_at_ms,
        "keepalive_s": request.keepalive_s,
        "grace_ms": grace_ms(request.keepalive_s),
        "session_expiry_s": request.session_expiry_s,
        "session_expiry_ms": request.session_expiry_s * 1000,
    }
    if request.will is not None:
        conn["will"] = request.will.model_dump(exclude_none=True)
    return conn


def _head(item: Mapping[str, Any]) -> Head:
    conn = item.get("conn") or {}
    session = item.get("session") or {}
    will = conn.get("will")
    return Head(
        newest=Version.parse(item["newest"]),
        sub=item["sub"],
        rev=item["rev"],
        connected=item["connected"],
        keepalive_s=conn.get("keepalive_s", 0),
        grace_ms=conn.get("grace_ms", 0),
        last_seen_ms=item.get("last_seen_ms", 0),
        will=WillMessage.model_validate(will) if will else None,
        session_id=session.get("id"),
        session_expiry_s=conn.get("session_expiry_s", 0),
        session_expires_at_ms=item.get("session_expires_at_ms"),
        subscriptions=session.get("subscriptions") or {},
        due_at_ms=item.get("due_at_ms"),
    )


def _scheduled_will(item: Mapping[str, Any]) -> ScheduledWill:
    return ScheduledWill(
        version=Version.parse(item["item"][len(WILL_PREFIX) :]),
        message=WillMessage.model_validate(item["will"]),
        due_at_ms=item["due_at_ms"],
        claimed_at_ms=item.get("claimed_at_ms"),
        sub=item.get("sub", ""),
    )


# --- the services ----------------------------------------------------------------------------


@dataclass
class RegistryStats:
    """What connects cost, for the benchmark and metrics: counted per registry instance."""

    connects: int = 0
    #: registration transactions tried, and of those, tried again after a conflict
    attempts: int = 0
    retries: int = 0
    outdated: int = 0
    busy: int = 0
    aborted: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, count in counts.items():
                setattr(self, name, getattr(self, name) + count)

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return {
                "connects": self.connects,
                "attempts": self.attempts,
                "retries": self.retries,
                "outdated": self.outdated,
                "busy": self.busy,
                "aborted": self.aborted,
            }


class SessionRegistry:
    """Connect, disconnect, heartbeat and read sessions; one instance per execution environment."""

    def __init__(
        self,
        repository: SessionRepository,
        clock: Clock | None = None,
        *,
        budget_s: float = CONNECT_BUDGET_S,
        stats: RegistryStats | None = None,
        on_session_end: SessionEndHook | None = None,
        groups: GroupLeases | None = None,
        deliveries: InFlight | None = None,
    ) -> None:
        self.repository = repository
        self.clock = clock or SystemClock()
        self.budget_ms = int(budget_s * 1000)
        self.stats = stats or RegistryStats()
        self.on_session_end = on_session_end
        #: a heartbeat renews the session's group leases too (``shoal.groups``)
        self.groups = groups
        #: the session document counts the deliveries in flight
        self.deliveries = deliveries

    @classmethod
    def from_config(cls, config: Config, clock: Clock | None = None) -> SessionRegistry:
        from shoal.delivery import InboxStore, SubscriptionRetirer

        retirer = SubscriptionRetirer.from_config(config, clock)
        return cls(
            SessionRepository.from_config(config),
            clock,
            on_session_end=retirer,
            groups=retirer.groups,
            deliveries=InboxStore.from_config(config),
        )

    # -- connect

    def connect(
        self,
        who: Principal,
        client_id: str,
        request: ConnectRequest,
        requested_at_ms: int | None = None,
    ) -> Connected:
        who.require_client(client_id)
        check_client_id(client_id)
        now = self.clock.now_ms()
        if request.will is not None:
            _check_will(who, request.will)
        at = request.connected_at_ms
        if at is None:
            at = requested_at_ms if requested_at_ms is not None else now
        if at > now + MAX_CLOCK_AHEAD_MS:
            raise BadRequest(
                "connected_at_ms is ahead of the server's clock", field="connected_at_ms"
            )
        ours = Version.new(at)
        give_up_at = now + self.budget_ms

        view = self.repository.read(client_id, consistent=False)
        local_max = view.newest()
        if local_max is not None and ours < local_max:
            self.stats.add(outdated=1)
            raise ChannelOutdated("a newer connect for this client id exists")
        attempts = 0
        while True:
            attempts += 1
            plan = plan_connect(view, request, who.sub, ours, self.clock.now_ms())
            committed = self.repository.register(
                client_id,
                sub=who.sub,
                ours=ours,
                request=request,
                plan=plan,
                expected=view.head,
                now_ms=self.clock.now_ms(),
            )
            if committed:
                break
            real = self.repository.read(client_id, consistent=True)
            real_max = real.newest()
            step = after_conflict(ours, local_max, real_max)
            if step is ConflictStep.COMMITTED:
                break
            if step is ConflictStep.OUTDATED:
                self.stats.add(attempts=attempts, outdated=1)
                raise ChannelOutdated("a newer connect for this client id exists")
            if step is ConflictStep.ABORT:
                logger.info("connect aborted: the registry moved backwards under it")
                self.stats.add(attempts=attempts, aborted=1)
                raise ServerBusy("the session changed during the connect; retry")
            if self.clock.now_ms() >= give_up_at:
                self.stats.add(attempts=attempts, busy=1)
                raise ServerBusy("too many racing connects for this client id; retry")
            self.stats.add(retries=1)
            self.clock.sleep(backoff_s(attempts, BACKOFF_BASE_MS / 1000, BACKOFF_CAP_MS / 1000))
            view, local_max = real, real_max
        self.stats.add(connects=1, attempts=attempts)
        ended = view.head
        if plan.decision is not Decision.RESUME and ended is not None and ended.subscriptions:
            # the session this connect ended: its subscriptions leave the router's store
            # (best effort: the connect stands; a leftover only costs writes to an inbox no
            # session reads, which TTL removes)
            _ended(self.on_session_end, client_id, ended)
        return Connected(plan.session_present, ours.channel, request.keepalive_s)

    # -- session-scoped calls

    def _scope(self, who: Principal, client_id: str, channel: str | None) -> Version:
        # the principal before the request's shape (``shoal.api.session_call``)
        who.require_client(client_id)
        check_client_id(client_id)
        try:
            return parse_channel(channel)
        except BadRequest:
            self.require_owner(who, client_id)
            raise

    def require_owner(self, who: Principal, client_id: str, *, connecting: bool = False) -> None:
        """403 when another principal holds the client id's session; one read.

        A connect may take over a session that has ended, whoever held it, so for a connect
        only a live session of another principal counts (``plan_connect``).
        """
        head = self.repository.head(client_id)
        if head is None or head.sub == who.sub:
            return
        if connecting and not head.session_alive(self.clock.now_ms()):
            return
        raise Forbidden("the client id's session belongs to another principal")

    def _refuse(self, who: Principal, head: Head | None) -> ShoalError:
        """Why a channel may not act: no session, another principal's, or not the live one."""
        if head is None:
            return SessionNotFound("no session for this client id")
        if head.sub != who.sub:
            return Forbidden("the client id's session belongs to another principal")
        return SessionTakenOver("this channel is no longer the client id's live channel")

    def require_live(self, who: Principal, client_id: str, channel: str | None) -> Head:
        """The head, when ``channel`` is the live channel of ``who``'s session; one read.

        For session-scoped routes that read; writes put ``SessionRepository.update_live``'s
        condition on themselves instead.
        """
        version = self._scope(who, client_id, channel)
        head = self.repository.head(client_id)
        if head is None or head.sub != who.sub or not head.is_live(version):
            raise self._refuse(who, head)
        return head

    def heartbeat(self, who: Principal, client_id: str, channel: str | None) -> dict[str, Any]:
        version = self._scope(who, client_id, channel)
        now = self.clock.now_ms()
        if self.groups is None:
            if not self.repository.heartbeat(client_id, version, who.sub, now):
                raise self._refuse(who, self.repository.head(client_id))
            return {"leases": []}
        head = self.repository.heartbeat_head(client_id, version, who.sub, now)
        if head is None:
            raise self._refuse(who, self.repository.head(client_id))
        # the leases of the session's shared groups are renewed; what changed comes back
        return {"leases": self.groups.heartbeat(head.session_id or "", head.subscriptions)}

    def disconnect(self, who: Principal, client_id: str, channel: str | None) -> None:
        version = self._scope(who, client_id, channel)
        if self.repository.disconnect(client_id, version, who.sub, self.clock.now_ms()):
            return
        head = self.repository.head(client_id)
        if head is None or head.sub == who.sub:
            # a stale channel still ends its own registration (the takeover's end); that
            # touches no other channel's entry and no session state
            self.repository.deregister(client_id, version)
        raise self._refuse(who, head)

    def session(self, who: Principal, client_id: str, channel: str | None) -> dict[str, Any]:
        head = self.require_live(who, client_id, channel)
        document = session_document(client_id, head)
        if self.groups is not None:
            document["groups"] = self.groups.describe(head.session_id or "", head.subscriptions)
        if self.deliveries is not None and head.session_id:
            document["in_flight"] = self.deliveries.in_flight(head.session_id)
        return document


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


def _check_will(who: Principal, will: WillMessage) -> None:
    if not is_publishable_topic(will.topic):
        raise InvalidTopic("the will's topic is not a topic name a client may publish to")
    if len(will.body()) > MAX_WILL_PAYLOAD_BYTES:
        raise PayloadTooLarge(f"a will's payload is at most {MAX_WILL_PAYLOAD_BYTES} bytes")
    if not any_matches(who.publish, will.topic):
        raise Forbidden("the will's topic is outside the principal's shoal:publish filters")


@dataclass
class ReapReport:
    channels_expired: int = 0
    wills_published: int = 0
    wills_dropped: int = 0
    sessions_ended: int = 0
    rescheduled: int = 0
    contended: int = 0
    failed: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


class Reaper:
    """Keepalive expiry, wills after their delay, and session expiry; run on a schedule.

    Every step is a conditional write on what it read, so overlapping runs and racing
    connects cannot double a step or undo a newer one. A will is claimed before it is
    published and deleted after, so a run that dies in between publishes it again later
    (at least once; ``will_id`` lets the publisher drop the duplicate).
    """

    def __init__(
        self,
        repository: SessionRepository,
        publisher: WillPublisher,
        clock: Clock | None = None,
        *,
        limit_per_shard: int = 500,
        on_session_end: SessionEndHook | None = None,
        on_channel_expired: SessionEndHook | None = None,
    ) -> None:
        self.repository = repository
        self.publisher = publisher
        self.clock = clock or SystemClock()
        self.limit_per_shard = limit_per_shard
        self.on_session_end = on_session_end
        #: a dead channel's shared groups advance: its expired leases move to live members
        self.on_channel_expired = on_channel_expired

    def run(self) -> ReapReport:
        report = ReapReport()
        now = self.clock.now_ms()
        for shard in range(DUE_SHARDS):
            for client_id, item in self.repository.due(str(shard), now, self.limit_per_shard):
                try:
                    if item == HEAD:
                        self._reap_head(client_id, now, report)
                    elif item.startswith(WILL_PREFIX):
                        self._reap_will(client_id, item, now, report)
                except Exception as exc:
                    # one client's failure must not stop the others; its item stays due
                    logger.exception("reaping failed", extra={"error_type": type(exc).__name__})
                    report.failed += 1
        return report

    def _reap_head(self, client_id: str, now: int, report: ReapReport) -> None:
        view = self.repository.read(client_id, consistent=True)
        head = view.head
        if head is None:
            return
        action, due = reap_action(head, now)
        if action is ReapAction.RESCHEDULE:
            if head.due_at_ms != due and self.repository.set_due(client_id, head, due):
                report.rescheduled += 1
            return
        if action is ReapAction.EXPIRE_CHANNEL:
            will_due = None
            if head.will is not None:
                # MQTT 5: after the delay, or when the session ends, whichever comes first
                will_due = now + min(head.will.delay_s, head.session_expiry_s) * 1000
            if not self.repository.expire_channel(client_id, head, now, will_due):
                report.contended += 1
                return
            report.channels_expired += 1
            if head.subscriptions:
                _ended(self.on_channel_expired, client_id, head)
            if will_due is not None and will_due <= now:
                self._reap_will(client_id, WILL_PREFIX + head.newest.key, now, report)
            if head.session_expiry_s > 0:
                return
            head = replace(head, connected=False, rev=head.rev + 1, session_expires_at_ms=now)
        if head.subscriptions and self.on_session_end is not None:
            # before the head goes: a failure leaves the head due, so a later run retries
            self.on_session_end(client_id, head)
        if self.repository.end_session(client_id, head, view.registrations):
            report.sessions_ended += 1
        else:
            report.contended += 1

    def _reap_will(self, client_id: str, item: str, now: int, report: ReapReport) -> None:
        will = self.repository.will(client_id, item)
        if will is None or will.due_at_ms > now:
            return
        if not self.repository.claim_will(client_id, will, now, now + WILL_RETRY_MS):
            report.contended += 1
            return
        try:
            self.publisher.publish_will(
                will.sub, client_id, will.message, will_id=will.version.channel
            )
        except ShoalError as exc:
            if exc.status >= 500:
                raise
            # refused for good (say its topic has no composite topic and there is no default):
            # retrying cannot help, so the will is dropped, loudly
            logger.warning("will refused by the publish path", extra={"code": exc.code})
            report.wills_dropped += 1
        else:
            report.wills_published += 1
        self.repository.finish_will(client_id, will, claimed_at_ms=now)
