"""The WebSocket API's routes: a session's life in frames (``shoal.edge.frames``).

Each client frame is answered by the same service as its HTTP route (the session registry,
subscribe, publish, get/ack), acting as the channel its connection holds; the answers and the
errors are the HTTP API's, in frames. A frame's function returns its answer as the route
response, except where deliveries follow the answer (``connect``, ``subscribe``, ``ack``): then
it posts the answer first and pushes after, so a client never sees a delivery before the
CONNACK that opens its session (MQTT 5 §3.2) or the SUBACK of its retained messages.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError
from pydantic import BaseModel

from shoal.core.auth import Principal
from shoal.core.clock import Clock, SystemClock
from shoal.core.config import DeliverySettings
from shoal.core.errors import (
    BadRequest,
    Conflict,
    SessionNotFound,
    SessionTakenOver,
    ShoalError,
)
from shoal.core.observability import logger
from shoal.delivery.service import DeliveryService
from shoal.delivery.subscriptions import SubscriptionService
from shoal.edge.connections import MAX_CONNECTION_S, Connection, ConnectionStore
from shoal.edge.frames import (
    AckedFrame,
    AckFrame,
    ConnectedFrame,
    ConnectFrame,
    DisconnectFrame,
    KeepaliveFrame,
    PingFrame,
    PongFrame,
    PublishedFrame,
    PublishFrame,
    RenewFrame,
    SubscribedFrame,
    SubscribeFrame,
    UnsubscribedFrame,
    UnsubscribeFrame,
    encode,
)
from shoal.edge.push import ConnectionGone, Pusher
from shoal.publish.request import PublishRequest
from shoal.publish.service import PublishService
from shoal.sessions.model import KEEPALIVE_GRACE, ConnectRequest, Head
from shoal.sessions.ports import KeptBy
from shoal.sessions.registry import SessionRegistry

#: the keepalive a WebSocket channel registers with: its grace (``KEEPALIVE_GRACE`` times it)
#: ends past API Gateway's two-hour limit by ``CHANNEL_MARGIN_S``, so only a channel whose
#: connection is surely closed and whose ``$disconnect`` never came is expired by the reaper
CHANNEL_MARGIN_S = 300
CHANNEL_KEEPALIVE_S = math.ceil((MAX_CONNECTION_S + CHANNEL_MARGIN_S) / KEEPALIVE_GRACE)

#: the subprotocol a browser offers (with its token as ``bearer.<jwt>``) and gets back
SUBPROTOCOL = "shoal.v1"


class NotConnected(ShoalError):
    """A frame other than ``connect`` before the connection's ``connect`` was answered
    (MQTT 5 §3.1: CONNECT is the first packet)."""

    status = 409
    code = "not_connected"


class RenewRefused(Conflict):
    """A ``renew`` whose channel is not the live channel of a connection the principal holds
    (lost meanwhile, taken over, expired): the client sends ``connect`` instead."""

    code = "renew_refused"


class AlreadyConnected(Conflict):
    """A second ``connect`` on one connection ([MQTT-3.1.0-2]: a protocol error)."""

    code = "already_connected"


def chosen_subprotocol(offered: str | None) -> str | None:
    """The ``Sec-WebSocket-Protocol`` the handshake answers: ``shoal.v1`` when offered."""
    names = [p.strip() for p in (offered or "").split(",")]
    return SUBPROTOCOL if SUBPROTOCOL in names else None


@dataclass(frozen=True)
class Answer:
    """What a frame's function does: the frame it returns (the route response), or None."""

    frame: str | None = None


class EdgeService:
    def __init__(
        self,
        registry: SessionRegistry,
        subscriptions: SubscriptionService,
        publish: PublishService,
        *,
        delivery: DeliveryService,
        connections: ConnectionStore,
        pusher: Pusher,
        settings: DeliverySettings,
        clock: Clock | None = None,
    ) -> None:
        self.registry = registry
        self.subscriptions = subscriptions
        self.publisher = publish
        self.delivery = delivery
        self.connections = connections
        self.pusher = pusher
        self.settings = settings
        self.clock = clock or SystemClock()

    # -- the connection's own events

    def disconnected(self, connection_id: str) -> None:
        """``$disconnect``: the connection is gone. Unless a ``disconnect`` frame ended the
        channel first, it is lost: its will follows after the delay."""
        try:
            self._disconnected(connection_id)
        finally:
            # a lost member's groups may hand its streams on
            self.pusher.push_handed_over()

    def _disconnected(self, connection_id: str) -> None:
        connection = self.connections.connection(connection_id)
        if connection is None:
            return
        if self.connections.unbind(connection):
            # the session's item names a newer connection: a connect took the session over
            # (the client's own renewal before API Gateway's 2 hours, make-before-break), so
            # this channel is not the live one and losing it would change nothing (a
            # conditional write that fails costs its write unit all the same); the newer
            # connection keeps the session's group members live in this one's place
            return
        who = Principal(sub=connection.sub, clients=(connection.client_id,))
        head = self.registry.lose(who, connection.client_id, connection.channel)
        if head is None:
            # not the live channel any more (an HTTP connect took the session over): the
            # members this connection kept may still be kept by it
            head = self.registry.repository.head(connection.client_id)
        self._release(connection, head)

    # -- client frames

    def frame(
        self, connection_id: str, who: Principal, frame: BaseModel, requested_at_ms: int | None
    ) -> Answer:
        try:
            return self._frame(connection_id, who, frame, requested_at_ms)
        finally:
            # the members this frame's work handed shared-group streams to (an ack's final
            # progress, a leave, a subscribe's rebalance): idle, they would not read them
            self.pusher.push_handed_over()

    def _frame(
        self, connection_id: str, who: Principal, frame: BaseModel, requested_at_ms: int | None
    ) -> Answer:
        if isinstance(frame, PingFrame):
            # API Gateway answers ping itself; a $default or direct invocation still answers
            return Answer(encode(PongFrame()))
        if isinstance(frame, KeepaliveFrame):
            return Answer()  # one way, as API Gateway's mock route
        if isinstance(frame, ConnectFrame):
            return self._connect(connection_id, who, frame, requested_at_ms)
        if isinstance(frame, RenewFrame):
            return self._renew(connection_id, who, frame)
        connection = self.connections.connection(connection_id)
        if connection is None:
            raise NotConnected("send connect first: this connection holds no session")
        if isinstance(frame, SubscribeFrame):
            # the groups it joins count the member live while this connection lives
            answer = self.subscriptions.subscribe(
                who, connection.client_id, connection.channel, frame, kept_by=_kept_by(connection)
            )
            return self._post_then_push(
                connection, encode(SubscribedFrame(ref=frame.ref, **answer))
            )
        if isinstance(frame, UnsubscribeFrame):
            answer = self.subscriptions.unsubscribe(
                who, connection.client_id, connection.channel, frame
            )
            return Answer(encode(UnsubscribedFrame.model_validate({"ref": frame.ref, **answer})))
        if isinstance(frame, PublishFrame):
            request = frame.model_dump(exclude={"action", "ref"}, exclude_unset=True)
            _, body = self.publisher.publish(who, PublishRequest.model_validate(request))
            return Answer(encode(PublishedFrame.model_validate({"ref": frame.ref, **body})))
        if isinstance(frame, AckFrame):
            # the connection knows its session: its head, its state and its push mark (whether
            # a push left deliveries behind) in one read, not three
            known, mark = self.delivery.read_session_with(
                connection.client_id,
                connection.session_id,
                *self.connections.session_key(connection.session_id),
            )
            answer, opened = self.delivery.ack_opening(
                who, connection.client_id, connection.channel, frame, connection.window, known=known
            )
            # read before the ack's write, not after: a push that stops early in between marks
            # the session after this read, as it could after a read made later; the next ack,
            # the sweep or a message pushes what it left
            unfinished = self.connections.unfinished_as_read(mark)
            if frame.ref is None:
                # nothing asked back: the freed window is filled at once
                self.pusher.after_ack(connection, opened, unfinished=unfinished)
                return Answer()
            return self._post_then_push(
                connection,
                encode(AckedFrame(ref=frame.ref, **answer)),
                opened=opened,
                unfinished=unfinished,
            )
        if isinstance(frame, DisconnectFrame):
            return self._disconnect(connection, who, frame)
        raise BadRequest("this frame has no handler")

    def _connect(
        self,
        connection_id: str,
        who: Principal,
        frame: ConnectFrame,
        requested_at_ms: int | None,
    ) -> Answer:
        if self.connections.connection(connection_id) is not None:
            raise AlreadyConnected("this connection holds a session already")
        previous = self._previous(frame.client_id)
        # the connection's liveness replaces the client's keepalive: API Gateway closes a
        # silent connection after 10 minutes and $disconnect ends the channel at once. The
        # registry still holds a bound (CHANNEL_BOUND_S) that outlives the longest connection:
        # AWS calls $disconnect best effort, and a channel whose $disconnect never came is
        # expired by the reaper as a lost connection (its will follows), like a keepalive
        request = ConnectRequest.model_validate(
            {
                **frame.model_dump(
                    exclude={"action", "ref", "client_id", "receive_maximum"}, exclude_unset=True
                ),
                "keepalive_s": CHANNEL_KEEPALIVE_S,
            }
        )
        connected = self.registry.connect(who, frame.client_id, request, requested_at_ms)
        head = self.registry.require_live(who, frame.client_id, connected.channel)
        window = min(frame.receive_maximum or self.settings.window, self.settings.window)
        connection = Connection(
            connection_id=connection_id,
            client_id=frame.client_id,
            sub=who.sub,
            channel=connected.channel,
            session_id=head.session_id or "",
            window=window,
            connected_at_ms=self.clock.now_ms(),
        )
        # the push lease comes with the bind: no delivery before the answer below
        holder = self.connections.bind(connection)
        # after the bind: a keep is ended by its connection's end, which needs the bind's
        # items; a crash between the two leaves the member to its lease, as before keeps
        self._keep(connection, head)
        if previous is not None and previous.connection_id != connection_id:
            # MQTT 5 §4.13 / [MQTT-3.1.4-3]: the older connection is told why, then closed
            self.pusher.disconnect(previous.connection_id, "session_taken_over")
        answer = ConnectedFrame(
            ref=frame.ref,
            session_present=connected.session_present,
            channel=connected.channel,
            keepalive_s=0,
            receive_maximum=window,
        )
        return self._post_then_push(connection, encode(answer), held_by=holder)

    def _renew(self, connection_id: str, who: Principal, frame: RenewFrame) -> Answer:
        """The client's own live channel moves to this connection (``RenewFrame``): the
        registry's keepalive restarts (one write) and the session's item names this
        connection (``ConnectionStore.move``); no registry transaction, no takeover frame,
        no will. About half the write units of a ``connect`` that takes the session over."""
        if self.connections.connection(connection_id) is not None:
            raise AlreadyConnected("this connection holds a session already")
        try:
            head = self.registry.renew(who, frame.client_id, frame.channel, CHANNEL_KEEPALIVE_S)
        except (SessionNotFound, SessionTakenOver) as exc:
            raise RenewRefused(f"{exc.message}: send connect") from exc
        taken = self.connections.move(connection_id, head.session_id or "", frame.channel, who.sub)
        if taken is None:
            raise RenewRefused("this channel's connection is gone: send connect")
        # the push lease comes with the move: nothing reaches the new connection before the
        # answer (as a connect's CONNACK, MQTT 5 [MQTT-3.2.0-1])
        moved, owner = taken
        # the session's group members are kept by this connection now (the older one's item
        # is gone, so its $disconnect releases nothing)
        self._keep(moved, head)
        answer = ConnectedFrame(
            ref=frame.ref,
            session_present=True,
            channel=frame.channel,
            keepalive_s=0,
            receive_maximum=moved.window,
        )
        return self._post_then_push(moved, encode(answer), held_by=owner)

    def _previous(self, client_id: str) -> Connection | None:
        """The connection that holds the client id's session now, if any (to be taken over)."""
        head = self.registry.repository.head(client_id)
        if head is None or not head.connected or not head.session_id:
            return None
        return self.connections.target(head.session_id)

    def _disconnect(self, connection: Connection, who: Principal, frame: DisconnectFrame) -> Answer:
        head: Head | None = None
        if frame.with_will:
            # MQTT 5 reason 0x04, "Disconnect with Will Message": as if the connection was lost
            head = self.registry.lose(who, connection.client_id, connection.channel)
        else:
            self.registry.disconnect(who, connection.client_id, connection.channel)
        # before the connection's items go: a crash in between leaves them to $disconnect,
        # which releases the members again
        self._release(connection, head or self.registry.repository.head(connection.client_id))
        self.connections.unbind(connection)
        self.pusher.disconnect(connection.connection_id, "normal", ref=frame.ref)
        return Answer()

    def _keep(self, connection: Connection, head: Head) -> None:
        """The session's members of its shared groups are live while ``connection`` is."""
        groups = self.registry.groups
        if groups is not None and head.session_id == connection.session_id:
            groups.keep(connection.session_id, head.subscriptions, _kept_by(connection))

    def _release(self, connection: Connection, head: Head | None) -> None:
        """``connection`` ended: the session's group members it kept are not live from now,
        and their streams go to live members at once (``disconnected`` pushes those)."""
        groups = self.registry.groups
        if groups is None or head is None or head.session_id != connection.session_id:
            # no session, or a new one: the ended session's memberships went with it
            return
        groups.connection_ended(connection.session_id, head.subscriptions, connection.connection_id)

    def _post_then_push(
        self,
        connection: Connection,
        answer: str,
        *,
        opened: bool | None = None,
        unfinished: bool | None = None,
        held_by: str | None = None,
    ) -> Answer:
        """Posts the answer, then pushes what the session has waiting; the route response is
        empty then. A post that fails for another reason than a gone connection (throttled,
        answered late) must not turn a frame that did its work into an error: the answer goes
        back as the route response instead, and nothing is pushed after it (a delivery must
        not overtake it); the next write, ack or sweep pushes. ``held_by``: the push lease's
        owner when this frame holds it (a connect's), given back if nothing is pushed."""
        try:
            self.pusher.api.post(connection.connection_id, answer)
        except (ConnectionGone, ClientError, BotoCoreError) as exc:
            if held_by is not None:
                # marked unfinished: the next ack (or the sweep, or a message) pushes
                self.connections.let_go(connection, held_by)
            if isinstance(exc, ConnectionGone):
                return Answer()
            logger.info(
                "answer posted as the route response", extra={"error_type": type(exc).__name__}
            )
            return Answer(answer)
        if held_by is not None:
            self.pusher.push(connection, held_by=held_by)
        elif opened is None:
            self.pusher.push(connection)
        else:
            # an ack's: only when it opened room or a push is unfinished
            self.pusher.after_ack(connection, opened, unfinished=unfinished)
        return Answer()


def _kept_by(connection: Connection) -> KeptBy:
    # API Gateway closes a connection within two hours: a keep whose end was lost lapses then
    until = connection.connected_at_ms + MAX_CONNECTION_S * 1000
    return KeptBy(connection.connection_id, connection.channel, until)


def requested_at(context: Mapping[str, Any]) -> int | None:
    value = context.get("requestTimeEpoch")
    return int(value) if isinstance(value, int | float) else None
