"""The sessions table: every read and conditional write the registry and the reaper make.

The table holds one partition per client id (``shoal.aws.tables.SessionItemModel``):

- ``head``: the newest registration's version key (``newest``), the owning principal (``sub``),
  ``rev`` (bumped by every lifecycle change: connect, disconnect, loss, keepalive expiry),
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
- ``will#<version>``: a will waiting out its delay after its channel's keepalive expired, or
  due at once: its session ended first, or a connect took its live channel over (MQTT 5
  §3.1.3.2.2, ``shoal.sessions.model.takeover_will``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from botocore.exceptions import ClientError

from shoal.aws import tables
from shoal.aws.dynamo import CONDITION_FAILED, Dynamo, Expression, attribute, error_code, from_item
from shoal.core.config import Config
from shoal.sessions.model import (
    HEAD,
    MAX_CLEANUP,
    REG_PREFIX,
    WILL_PREFIX,
    ConnectPlan,
    ConnectRequest,
    Decision,
    Head,
    RegistryView,
    ScheduledWill,
    Version,
    WillMessage,
    due_shard,
    grace_ms,
)


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


def lost_mark(expr: Expression) -> str:
    """A channel ``lose`` marked lost: keepalive 1 s with no grace, which no connect registers
    (its grace is 1.5 keepalives). A heartbeat must not move such a channel's close later:
    its will's delay runs from the close."""
    return f"{expr.n('conn.keepalive_s')} = {expr.v(1)} AND {expr.n('conn.grace_ms')} = {expr.v(0)}"


class SessionRepository:
    """The sessions table: every read and conditional write the registry and reaper make."""

    def __init__(self, dynamo: Dynamo, table: str) -> None:
        self.dynamo = dynamo
        self.table = table

    @classmethod
    def from_config(cls, config: Config) -> SessionRepository:
        return cls(Dynamo.from_config(config), config.table(tables.SESSIONS))

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

    def head_key(self, client_id: str) -> dict[str, str]:
        """The head item's key (untyped), for a batch read that spans tables."""
        return {"client_id": client_id, "item": HEAD}

    @staticmethod
    def head_of(row: Mapping[str, Any]) -> Head:
        """The head of a head item as a batch read returns it."""
        return _head(row)

    def heads(self, client_ids: Iterable[str]) -> dict[str, Head]:
        """The head items of ``client_ids`` that exist, eventually consistent (a view for an
        operator: 100 keys a call, no condition on them)."""
        keys = [{"client_id": c, "item": HEAD} for c in sorted(set(client_ids))]
        rows = self.dynamo.batch_get(self.table, keys, consistent=False)
        return {str(row["client_id"]): _head(row) for row in rows}

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
        head.set("last_seen_ms", now_ms).set("conn", _conn(ours, request, plan))
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
        if plan.takeover_will is not None:
            # the taken-over channel's will, due now: the reaper publishes it (will_id = its
            # channel). Written with the head, so never without the takeover; the head's
            # condition lets this transaction land once, so the will is written once.
            taken = plan.takeover_will
            item = _will_item(
                client_id,
                taken.version,
                taken.sub,
                taken.message,
                taken.due_at_ms,
                held_since_ms=taken.held_since_ms,
            )
            items.append({"Put": {"TableName": self.table, "Item": item}})
        return self._transact(items)

    def heartbeat(self, client_id: str, version: Version, sub: str, now_ms: int) -> bool:
        """Refresh the keepalive, on condition that the channel is still the live one (and
        not lost: ``lost_mark``)."""
        expr = Expression().set("last_seen_ms", now_ms)
        condition = f"{live_condition(expr, version, sub)} AND NOT ({lost_mark(expr)})"
        return self.dynamo.conditional("update_item", **self._on(client_id, HEAD, expr, condition))

    def renew(
        self, client_id: str, version: Version, sub: str, now_ms: int, keepalive_s: int
    ) -> Head | None:
        """A connection renewed (``shoal.edge``): the live channel's keepalive restarts now,
        its deadline with it, on condition that the channel is live and still has the
        keepalive it registered with: ``lose`` sets a lost connection's to 1, so a channel
        whose connection is gone cannot be renewed (its client connects again, which decides
        the will as MQTT 5 says). The head as written (None: refused); one write."""
        expr = Expression().set("last_seen_ms", now_ms)
        expr.set("due_shard", due_shard(client_id))
        expr.set("due_at_ms", now_ms + grace_ms(keepalive_s))
        condition = (
            f"{live_condition(expr, version, sub)}"
            f" AND {expr.n('conn.keepalive_s')} = {expr.v(keepalive_s)}"
        )
        return self._update_head(client_id, expr, condition)

    def heartbeat_head(
        self, client_id: str, version: Version, sub: str, now_ms: int
    ) -> Head | None:
        """``heartbeat``, answering the head as written (None: not the live channel). The
        answer costs nothing more than the write, and names the session's groups."""
        expr = Expression().set("last_seen_ms", now_ms)
        condition = f"{live_condition(expr, version, sub)} AND NOT ({lost_mark(expr)})"
        return self._update_head(client_id, expr, condition)

    def _update_head(self, client_id: str, expr: Expression, condition: str) -> Head | None:
        """One conditional update of the head, answering it as written (None: the condition
        failed); the answer costs nothing more than the write."""
        request = {**self._on(client_id, HEAD, expr, condition), "ReturnValues": "ALL_NEW"}
        try:
            raw = self.dynamo.call("update_item", **request)
        except ClientError as exc:
            if error_code(exc) == CONDITION_FAILED:
                return None
            raise
        return _head(from_item(raw["Attributes"]))

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

    def lose(self, client_id: str, version: Version, sub: str, now_ms: int) -> Head | None:
        """The live channel's connection was lost without a disconnect (a WebSocket's
        ``$disconnect``): its keepalive is made to have run out now, and the head due, so the
        reaper expires it as it expires any silent channel (the will armed after its delay,
        the session's groups advanced, a session without expiry ended). One write; the head
        as written (None: not the live channel), which costs nothing more. A lifecycle
        change, so it moves ``rev``: a connect that read the head before it decided from a
        channel that looked live (it would hold the will for a ``$disconnect`` that has come
        already), and its write must fail and read again.

        A channel lost already keeps the earlier close (None): a ``$disconnect`` run again
        (a restart's ledger runs it with the restart's time) must not move the close later,
        which would restart the will's delay and let a resume within it drop the will."""
        expr = Expression().set("last_seen_ms", now_ms)
        expr.set_raw("rev", f"{expr.n('rev')} + {expr.v(1)}")
        expr.set("conn.keepalive_s", 1).set("conn.grace_ms", 0)
        expr.set("due_shard", due_shard(client_id)).set("due_at_ms", now_ms)
        condition = (
            f"{live_condition(expr, version, sub)}"
            f" AND (NOT ({lost_mark(expr)}) OR {expr.n('last_seen_ms')} > {expr.v(now_ms)})"
        )
        return self._update_head(client_id, expr, condition)

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
            will = _will_item(client_id, head.newest, head.sub, head.will, will_due_ms)
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

    def settle_held_will(self, client_id: str, will: ScheduledWill, due_at_ms: int | None) -> bool:
        """A will held for its channel's close: due at ``due_at_ms`` (no longer held), or
        deleted (None); on condition that it is still held as read."""
        expr = Expression()
        condition = (
            f"{expr.n('held_since_ms')} = {expr.v(will.held_since_ms)}"
            f" AND {expr.n('due_at_ms')} = {expr.v(will.due_at_ms)}"
        )
        if due_at_ms is None:
            return self.dynamo.conditional(
                "delete_item", **self._on(client_id, will.item, expr, condition)
            )
        expr.set("due_at_ms", due_at_ms).remove("held_since_ms")
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


def _will_item(
    client_id: str,
    version: Version,
    sub: str,
    will: WillMessage,
    due_at_ms: int,
    *,
    held_since_ms: int | None = None,
) -> dict[str, Any]:
    """A ``will#<version>`` item: the will of ``version``'s channel, due at ``due_at_ms``
    (held for its channel's close since ``held_since_ms``, when given)."""
    item = {
        "client_id": attribute(client_id),
        "item": attribute(WILL_PREFIX + version.key),
        "channel": attribute(version.channel),
        "sub": attribute(sub),
        "will": attribute(will.model_dump(exclude_none=True)),
        "due_shard": attribute(due_shard(client_id)),
        "due_at_ms": attribute(due_at_ms),
    }
    if held_since_ms is not None:
        item["held_since_ms"] = attribute(held_since_ms)
    return item


def _conn(ours: Version, request: ConnectRequest, plan: ConnectPlan) -> dict[str, Any]:
    conn: dict[str, Any] = {
        "connected_at_ms": ours.connected_at_ms,
        "keepalive_s": request.keepalive_s,
        "grace_ms": grace_ms(request.keepalive_s),
        "session_expiry_s": request.session_expiry_s,
        "session_expiry_ms": request.session_expiry_s * 1000,
    }
    if request.will is not None:
        conn["will"] = request.will.model_dump(exclude_none=True)
    if request.connect_token is not None:
        # what a retry of this connect is answered (``SessionRegistry.connect``)
        conn["connect_token"] = request.connect_token
        conn["session_present"] = plan.session_present
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
        connect_token=conn.get("connect_token"),
        connect_session_present=bool(conn.get("session_present", False)),
    )


def _scheduled_will(item: Mapping[str, Any]) -> ScheduledWill:
    return ScheduledWill(
        version=Version.parse(item["item"][len(WILL_PREFIX) :]),
        message=WillMessage.model_validate(item["will"]),
        due_at_ms=item["due_at_ms"],
        claimed_at_ms=item.get("claimed_at_ms"),
        sub=item.get("sub", ""),
        held_since_ms=item.get("held_since_ms"),
    )
