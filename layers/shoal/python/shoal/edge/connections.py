"""Where the WebSocket API's connections are kept: the ``connections`` table.

Two items per connected session (``shoal.aws.tables.ConnectionModel``):

- ``conn#<connection id>``: the client id, principal, channel and session the connection holds,
  read by every frame (API Gateway names the connection, not the session);
- ``session#<session id>``: the connection its deliveries are pushed to, its in-flight
  window, and whether its connection is *ready* (the connect's or renewal's answer went
  out), read by whoever hands its pushes to the push queue (``shoal.edge.pushwork``) and by
  the pusher;

- ``connecting#<connection id>``: the channel a ``connect`` frame is about to register for
  the connection, written before the registration: a ``$disconnect`` that finds no
  ``conn#`` item (the connect crashed between its registration and its bind) loses that
  channel from it. Left to TTL;

and the *due lists* (``due#<id>``, in the sparse ``due`` index): the sessions a push handed
deliveries to that wait for an ack, one item a push, each swept when their ack timeout
passes (``shoal.edge.sweep.PushSweep``). A list names the shared groups' deliveries among
them by id: their progress is the group's, not the session's state.

One pusher at a time per session is the push queue's doing (a session's pushes go through one
message group, ``shoal.edge.pushwork``), not a lease in this table. What remains here is
``ready``: a connection is bound (or a renewal moves the session to it) before its answer is
posted, and the pusher posts nothing to a connection that is not ready, so no delivery
overtakes the CONNACK that opens the session (MQTT 5 [MQTT-3.2.0-1]); the answering frame
marks it ready, then hands the session's first push to the queue, behind any push handed
over meanwhile.
"""

from __future__ import annotations

import json
import secrets
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from botocore.exceptions import ClientError

from shoal.aws import tables
from shoal.aws.clients import error_code
from shoal.aws.dynamo import CONDITION_FAILED, Dynamo, Expression, from_item, to_item
from shoal.core.clock import Clock, SystemClock
from shoal.core.config import Config
from shoal.core.errors import ServerBusy
from shoal.sessions.model import Version
from shoal.sessions.ports import KeptBy

CONNECTION = "conn#"
SESSION = "session#"
CONNECTING = "connecting#"
#: a due list: sessions whose pushed deliveries come due together (``arm_sessions``)
DUE = "due#"
#: a due list of sessions to push again whatever their state: their gets found deliveries the
#: ordered drain's gate held back (``shoal.drain``), which nothing else would push once it opens
DUE_HELD = DUE + "held-"
#: API Gateway closes every connection within two hours; an item left by a lost $disconnect
#: is removed by TTL a little after
MAX_CONNECTION_S = 7200
TTL_MARGIN_S = 3600
#: the due index's partitions (a stable hash of the item's key spreads its writes)
DUE_SHARDS = 8


@dataclass(frozen=True)
class Connection:
    """A connection that answered its ``connect`` frame: the session it holds."""

    connection_id: str
    client_id: str
    sub: str
    channel: str
    session_id: str
    #: the in-flight window: the client's Receive Maximum, at most the service's
    window: int
    connected_at_ms: int
    #: the connection's answer went out: the pusher may post to it (``ConnectionStore.ready``)
    ready: bool = True
    #: when the sweep looks at the session next (the due index), if it is armed
    due_at_ms: int | None = None

    def kept_by(self) -> KeptBy:
        """What keeps the session's shared-group members live while this connection lives
        (``shoal.groups``): API Gateway closes it within two hours, so a keep whose end was
        lost lapses then."""
        until = self.connected_at_ms + MAX_CONNECTION_S * 1000
        return KeptBy(self.connection_id, self.channel, until)

    def record(self, expires_at: int) -> dict[str, Any]:
        return {
            "key": CONNECTION + self.connection_id,
            "client_id": self.client_id,
            "sub": self.sub,
            "channel": self.channel,
            "session_id": self.session_id,
            "window": self.window,
            "connected_at_ms": self.connected_at_ms,
            "expires_at": expires_at,
        }

    def target(self, expires_at: int) -> dict[str, Any]:
        """The session's item: where its deliveries go."""
        return {
            "key": SESSION + self.session_id,
            "connection_id": self.connection_id,
            "client_id": self.client_id,
            "sub": self.sub,
            "channel": self.channel,
            "window": self.window,
            "connected_at_ms": self.connected_at_ms,
            "expires_at": expires_at,
        }

    def carried(self) -> list[Any]:
        """The connection as a push work carries it (``shoal.edge.pushwork``): its fields in
        order, keyed there by the session's id (a router batch's work carries up to a hundred)."""
        return [
            self.connection_id,
            self.client_id,
            self.sub,
            self.channel,
            self.window,
            self.connected_at_ms,
        ]

    @classmethod
    def from_carried(cls, session_id: str, fields: Sequence[Any]) -> Connection:
        connection_id, client_id, sub, channel, window, connected_at_ms = fields
        return cls(
            connection_id=str(connection_id),
            client_id=str(client_id),
            sub=str(sub),
            channel=str(channel),
            session_id=session_id,
            window=int(window),
            connected_at_ms=int(connected_at_ms),
        )

    @classmethod
    def from_record(cls, raw: dict[str, Any], session_id: str | None = None) -> Connection:
        due = raw.get("due_at_ms")
        return cls(
            connection_id=str(raw.get("connection_id") or raw["key"][len(CONNECTION) :]),
            client_id=str(raw["client_id"]),
            sub=str(raw["sub"]),
            channel=str(raw["channel"]),
            session_id=str(session_id or raw["session_id"]),
            window=int(raw["window"]),
            connected_at_ms=int(raw["connected_at_ms"]),
            # an item written before ``ready`` existed was ready: its answer had gone out
            ready=bool(raw.get("ready", True)),
            due_at_ms=int(due) if due is not None else None,
        )


class ConnectionStore:
    def __init__(self, dynamo: Dynamo, table: str, clock: Clock | None = None) -> None:
        self.dynamo = dynamo
        self.table = table
        self.clock = clock or SystemClock()

    @classmethod
    def from_config(cls, config: Config, clock: Clock | None = None) -> ConnectionStore:
        return cls(Dynamo.from_config(config, clock), config.table(tables.CONNECTIONS), clock)

    def _expires(self) -> int:
        return self.clock.now_ms() // 1000 + MAX_CONNECTION_S + TTL_MARGIN_S

    # -- the connection's session

    def connecting(self, connection_id: str, client_id: str, sub: str, channel: str) -> None:
        """Before a ``connect`` frame registers ``channel`` (or a ``renew`` moves it here):
        the channel the connection is about to hold (its session not known yet). A crash
        between the registration and the bind (or the renewal's two moves) leaves the channel
        live and no ``conn#`` item; the ``$disconnect`` then finds this one and loses the
        channel (``connecting_of``), or the channel would stay live for the registry's bound
        on a connection (hours), its will held at the client's next connect for a close that
        had come already. One write a connect; TTL removes it."""
        pending = Connection(
            connection_id=connection_id,
            client_id=client_id,
            sub=sub,
            channel=channel,
            session_id="",
            window=0,
            connected_at_ms=self.clock.now_ms(),
        )
        record = pending.record(self._expires())
        record["key"] = CONNECTING + connection_id
        self.dynamo.call("put_item", TableName=self.table, Item=_item(record))

    def connecting_of(self, connection_id: str) -> Connection | None:
        """What ``connecting`` wrote for the connection (its ``session_id`` empty), or None."""
        raw = self.dynamo.get(self.table, {"key": CONNECTING + connection_id})
        if raw is None:
            return None
        return Connection.from_record({**raw, "connection_id": connection_id})

    def bind(self, connection: Connection) -> bool:
        """The connection holds its session now, and the session's deliveries go to it (one
        transaction: a frame never finds a session whose pushes go elsewhere), not ready until
        its answer went out (``ready``). False, writing nothing, when the session's item names
        a newer channel: a connect that took the session over from this one bound first, and
        this older connect's late bind must not take the item back (the newer connection's
        ``$disconnect`` would find it naming another connection, take that for a takeover,
        and lose nothing: its channel would stay live, its will unpublished)."""
        expires = self._expires()
        version = Version.parse(connection.channel).key
        e = Expression()
        # an item written before ``version`` existed is overwritten, as before
        newer_absent = (
            f"attribute_not_exists({e.n('key')}) OR attribute_not_exists({e.n('version')})"
            f" OR {e.n('version')} < {e.v(version)}"
        )
        target = _item({**connection.target(expires), "version": version, "ready": False})
        refused = self.dynamo.transact(
            [
                {"Put": {"TableName": self.table, "Item": _item(connection.record(expires))}},
                {"Put": {"TableName": self.table, "Item": target, **e.params(newer_absent)}},
            ]
        )
        if refused is None:
            return True
        if refused[1:2] == ["ConditionalCheckFailed"]:
            return False
        # a transaction conflict (another write to either item at once): nothing was
        # written, and the frame sent again binds
        raise ServerBusy("the connection's items are contended; retry")

    def ready(self, connection: Connection) -> bool:
        """The connection's answer went out: pushes may reach it from now. False when the
        session's item names another connection now (or is gone)."""
        e = Expression()
        e.set("ready", True)
        return self.dynamo.conditional(
            "update_item",
            TableName=self.table,
            Key=_key(SESSION + connection.session_id),
            **e.params(f"{e.n('connection_id')} = {e.v(connection.connection_id)}"),
        )

    def move(
        self, connection_id: str, session_id: str, channel: str, sub: str
    ) -> Connection | None:
        """A renewal (``renew``): the session's deliveries go to ``connection_id`` from now,
        on condition that its item names ``channel`` and ``sub`` (None when not: the older
        connection is gone, or the session is held by another channel). The session's item
        keeps its window and due time (deliveries in flight on the older connection stay in
        flight for the same channel); the older connection's item is deleted, so its
        ``$disconnect`` finds nothing to do. Three writes, no transaction: the session's item
        first, so a renewal cut short before its connection's item is written is repeated as
        a whole (its ``renew`` is sent again; the older connection's item is left to its
        ``$disconnect``).

        The moved item is not ready (``ready``) until the renewal's answer went out: nothing
        reaches the new connection before it, as a connect's CONNACK."""
        now = self.clock.now_ms()
        expires = self._expires()
        e = Expression()
        e.set("connection_id", connection_id).set("connected_at_ms", now)
        e.set("expires_at", expires).set("ready", False)
        condition = f"{e.n('channel')} = {e.v(channel)} AND {e.n('sub')} = {e.v(sub)}"
        try:
            raw = self.dynamo.call(
                "update_item",
                TableName=self.table,
                Key=_key(SESSION + session_id),
                ReturnValues="ALL_OLD",
                **e.params(condition),
            )
        except ClientError as exc:
            if error_code(exc) == CONDITION_FAILED:
                return None
            raise
        old = from_item(raw["Attributes"])
        connection = Connection(
            connection_id=connection_id,
            client_id=str(old["client_id"]),
            sub=sub,
            channel=channel,
            session_id=session_id,
            window=int(old["window"]),
            connected_at_ms=now,
            ready=False,
        )
        self.dynamo.call("put_item", TableName=self.table, Item=_item(connection.record(expires)))
        older = str(old.get("connection_id") or "")
        if older and older != connection_id:
            self.dynamo.call("delete_item", TableName=self.table, Key=_key(CONNECTION + older))
        return connection

    def connection(self, connection_id: str, *, consistent: bool = True) -> Connection | None:
        """The connection's item, once its ``connect`` frame bound it to a session (None
        before, and once it is gone). What a bound item says is written once, so an eventually
        consistent read that finds it finds it whole; one may not find it yet."""
        raw = self.dynamo.get(
            self.table, {"key": CONNECTION + connection_id}, consistent=consistent
        )
        return None if raw is None or "session_id" not in raw else Connection.from_record(raw)

    def unbind(self, connection: Connection) -> bool:
        """The connection is gone: the session's item when it still names it, then its own
        (``forget``, then ``remove``). True when a newer connection of the session holds the
        session's item (a takeover: the client's own renewal before API Gateway's 2 hours
        comes this way), False when this one held it or nobody does (a push found the
        connection gone first)."""
        taken_over = self.forget(connection)
        self.remove(connection)
        return taken_over

    def remove(self, connection: Connection) -> None:
        """Deletes the connection's own item: a frame or a ``$disconnect`` that reads it finds
        nothing from then on. Whatever must follow the close goes first: a ``$disconnect``
        run again after a crash (a restarted ``shoal dev`` runs those its ledger still owes)
        finds the connection only while its item is there."""
        self.dynamo.call(
            "delete_item", TableName=self.table, Key=_key(CONNECTION + connection.connection_id)
        )

    def forget(self, connection: Connection) -> bool:
        """The session's deliveries stop going to this connection: the session's item, when it
        names it, is deleted. True when it names a newer connection instead (kept)."""
        expression = Expression()
        params = expression.params(
            f"{expression.n('connection_id')} = {expression.v(connection.connection_id)}"
        )
        # a failed condition says what it found, for the price of the write it is
        found = self.dynamo.conditional_old(
            "delete_item", TableName=self.table, Key=_key(SESSION + connection.session_id), **params
        )
        return bool(found)

    def targets(self, session_ids: Iterable[str]) -> list[Connection]:
        """The connections of those sessions that have one: strongly consistent, so a session
        whose connect frame was answered before an inbox write is never missed by it."""
        keys = [{"key": SESSION + s} for s in sorted(set(session_ids))]
        if not keys:
            return []
        found = self.dynamo.batch_get(self.table, keys, consistent=True)
        return [Connection.from_record(r, r["key"][len(SESSION) :]) for r in found]

    def target(self, session_id: str) -> Connection | None:
        raw = self.dynamo.get(self.table, {"key": SESSION + session_id})
        return None if raw is None else Connection.from_record(raw, session_id)

    def kept_by(self, session_id: str, channel: str) -> KeptBy | None:
        """The connection that holds ``channel`` of the session, as what keeps the session's
        group members live (``shoal.sessions.ports.ConnectionKeeps``): a share subscribed over
        HTTP on a channel a WebSocket connection holds is kept by it, as one subscribed over
        the connection is. None when no connection holds that channel. One read."""
        found = self.target(session_id)
        if found is None or found.channel != channel:
            return None
        return found.kept_by()

    # -- the due index: pushed deliveries whose ack timeout passes while connected

    def arm_sessions(
        self,
        session_ids: Iterable[str],
        due_at_ms: int,
        *,
        held: bool = False,
        grouped: Mapping[str, Sequence[str]] | None = None,
    ) -> bool:
        """The sessions are swept at ``due_at_ms``: one *due list* item names them all
        (``due#<id>``, in the ``due`` index), one write however many sessions a push handed
        deliveries to. A session may sit in several lists (each push arms its own): the sweep
        reads each session's state, so a copy too many costs a read, never a push. False
        when there was nothing to arm. ``held``: a list of sessions the drain's gate held
        deliveries back from (``DUE_HELD``): the sweep pushes them whatever their state.
        ``grouped``: the shared groups' deliveries handed out, by session (``DueList.grouped``):
        in the same item."""
        sessions = sorted(set(session_ids))
        if not sessions:
            return False
        key = (DUE_HELD if held else DUE) + secrets.token_hex(8)
        record: dict[str, Any] = {
            "key": key,
            "due_shard": str(due_shard(key)),
            "due_at_ms": due_at_ms,
            "sessions": sessions,
            "expires_at": self._expires(),
        }
        ids = {s: _runs(i) for s, i in (grouped or {}).items() if i and s in sessions}
        if ids:
            record["grouped"] = json.dumps(ids, sort_keys=True, separators=(",", ":"))
        self.dynamo.call("put_item", TableName=self.table, Item=_item(record))
        return True

    def arm_session(self, session_id: str, due_at_ms: int) -> bool:
        """``arm_sessions`` of one session (a push whose connection was gone after a renewal
        moved the session on still had its deliveries handed out)."""
        return self.arm_sessions([session_id], due_at_ms)

    def due(self, shard: int, now_ms: int, limit: int) -> list[tuple[str, int]]:
        """(key, due at) of the due lists in ``shard`` that are due (the index, never a
        scan), earliest first; a key is a list's (``due#``) or, armed before the lists, a
        session's item (``session#``)."""
        found: list[tuple[str, int]] = []
        e = Expression()
        condition = f"{e.n('due_shard')} = {e.v(str(shard))} AND {e.n('due_at_ms')} <= "
        request: dict[str, Any] = {
            "TableName": self.table,
            "IndexName": "due",
            "KeyConditionExpression": condition + e.v(now_ms),
            "Limit": limit,
            **e.params(),
        }
        while len(found) < limit:
            page = self.dynamo.call("query", **request)
            found += [(i["key"]["S"], int(i["due_at_ms"]["N"])) for i in page.get("Items", [])]
            if "LastEvaluatedKey" not in page:
                break
            request["ExclusiveStartKey"] = page["LastEvaluatedKey"]
        return found[:limit]

    def take_due(self, key: str, due_at_ms: int) -> DueList:
        """Takes a due entry off the index, first (a sweep that dies later loses only the
        timer: the next push or reconnect hands the deliveries out again); the sessions it
        named. Nothing when another sweep took it, or it was armed again meanwhile."""
        if key.startswith(SESSION):
            e = Expression()
            e.remove("due_shard", "due_at_ms")
            taken = self.dynamo.conditional(
                "update_item",
                TableName=self.table,
                Key=_key(key),
                **e.params(f"{e.n('due_at_ms')} = {e.v(due_at_ms)}"),
            )
            return DueList([key[len(SESSION) :]] if taken else [])
        try:
            raw = self.dynamo.call(
                "delete_item",
                TableName=self.table,
                Key=_key(key),
                ConditionExpression="attribute_exists(#s)",
                ExpressionAttributeNames={"#s": "sessions"},
                ReturnValues="ALL_OLD",
            )
        except ClientError as exc:
            if error_code(exc) == CONDITION_FAILED:
                return DueList([])
            raise
        old = from_item(raw.get("Attributes") or {})
        runs = json.loads(str(old["grouped"])) if old.get("grouped") else {}
        grouped = {session: _ids(r) for session, r in runs.items()}
        return DueList([str(s) for s in old.get("sessions") or []], grouped)


@dataclass(frozen=True)
class DueList:
    """A due entry taken off the index: its sessions, and the ids of the shared groups'
    deliveries it was armed for, by session (a group's delivery is done on the group's
    stream, which the session's state does not show: the sweep asks the group)."""

    sessions: list[str]
    grouped: dict[str, list[str]] = field(default_factory=dict)


def _runs(ids: Iterable[str]) -> dict[str, list[list[int]]]:
    """Group delivery ids (``<stream's prefix>.<ordinal>``) as runs of ordinals by prefix: a
    get hands a stream's ordinals out in order, so a list stays a few bytes a stream however
    many deliveries it names (an item holds 400 KB at most)."""
    by_prefix: dict[str, list[int]] = {}
    for text in ids:
        prefix, _, ordinal = text.rpartition(".")
        if prefix and ordinal.isdigit():
            by_prefix.setdefault(prefix, []).append(int(ordinal))
    out: dict[str, list[list[int]]] = {}
    for prefix, ordinals in by_prefix.items():
        runs: list[list[int]] = []
        for o in sorted(set(ordinals)):
            if runs and runs[-1][1] == o - 1:
                runs[-1][1] = o
            else:
                runs.append([o, o])
        out[prefix] = runs
    return out


def _ids(runs: Mapping[str, Sequence[Sequence[int]]]) -> list[str]:
    return [
        f"{p}.{o}" for p, r in runs.items() for first, last in r for o in range(first, last + 1)
    ]


def due_shard(key: str) -> int:
    return zlib.crc32(key.encode()) % DUE_SHARDS


def _key(key: str) -> dict[str, Any]:
    return {"key": {"S": key}}


def _item(record: dict[str, Any]) -> dict[str, Any]:
    return to_item(record)
