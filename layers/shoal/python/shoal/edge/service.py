"""The WebSocket API's routes: a session's life in frames (``shoal.edge.frames``).

Each client frame is answered by the same service as its HTTP route (the session registry,
subscribe, publish, get/ack), acting as the channel its connection holds; the answers and the
errors are the HTTP API's, in frames. A frame's function returns its answer as the route
response, except where deliveries follow the answer (``connect``, ``renew``, ``subscribe``,
``ack``): then it posts the answer first and hands the session's push to the push queue after
(``shoal.edge.pushwork``), so a client never sees a delivery before the CONNACK that opens its
session (MQTT 5 §3.2) or the SUBACK of its retained messages. A connect's or renewal's
connection is marked ready once its answer went out: the pusher posts nothing to it before
(a push handed over between the bind and the answer finds it not ready, and the connect's own
push, behind it in the session's lane, sends what it would have).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from botocore.exceptions import BotoCoreError, ClientError
from pydantic import BaseModel

from shoal.core.auth import Principal
from shoal.core.clock import Clock, SystemClock
from shoal.core.config import DeliverySettings
from shoal.core.errors import (
    BadRequest,
    Conflict,
    ServerBusy,
    SessionNotFound,
    SessionTakenOver,
    ShoalError,
)
from shoal.core.observability import logger
from shoal.core.retry import backoff_s
from shoal.delivery.service import DeliveryService
from shoal.delivery.subscriptions import SubscribeSent, SubscriptionService
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
from shoal.edge.posts import ConnectionGone, Connections, PostThrottled
from shoal.edge.pushwork import HandOffs, PushQueue
from shoal.publish.request import PublishRequest
from shoal.publish.service import PublishService
from shoal.sessions.model import KEEPALIVE_GRACE, ConnectRequest, Head, Version
from shoal.sessions.registry import SessionRegistry

#: the keepalive a WebSocket channel registers with: its grace (``KEEPALIVE_GRACE`` times it)
#: ends past API Gateway's two-hour limit by ``CHANNEL_MARGIN_S``, so only a channel whose
#: connection is surely closed and whose ``$disconnect`` never came is expired by the reaper
CHANNEL_MARGIN_S = 300
CHANNEL_KEEPALIVE_S = math.ceil((MAX_CONNECTION_S + CHANNEL_MARGIN_S) / KEEPALIVE_GRACE)

#: a ``$disconnect`` step refused as busy is tried this many times, backing off from
#: ``DISCONNECT_BACKOFF_S`` up to ``DISCONNECT_BACKOFF_CAP_S``: about 10 s at most, well within
#: the edge function's timeout, and past a burst of throttling
DISCONNECT_ATTEMPTS = 8
DISCONNECT_BACKOFF_S = 0.1
DISCONNECT_BACKOFF_CAP_S = 3.0

T = TypeVar("T")

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
        api: Connections,
        queue: PushQueue,
        settings: DeliverySettings,
        clock: Clock | None = None,
    ) -> None:
        self.registry = registry
        self.subscriptions = subscriptions
        self.publisher = publish
        self.delivery = delivery
        self.connections = connections
        self.api = api
        self.queue = queue
        #: the members this frame's work handed shared-group streams to (a leave, a
        #: subscribe's rebalance, an ack's final progress): handed to the queue at its end
        self.hand_offs = HandOffs(queue)
        for groups in (subscriptions.groups, getattr(delivery, "groups", None)):
            self.hand_offs.watch(groups)
        self.settings = settings
        self.clock = clock or SystemClock()

    # -- the connection's own events

    def disconnected(self, connection_id: str, closed_at_ms: int | None = None) -> None:
        """``$disconnect``: the connection is gone (at ``closed_at_ms``, the event's time, when
        given). Unless a ``disconnect`` frame ended the channel first, it is lost: its will
        follows after the delay, counted from the close (MQTT 5 §3.1.3.2.2), not from when
        the function ran."""
        try:
            connection = self._through_busy(lambda: self.connections.connection(connection_id))
            if connection is not None:
                self._through_busy(lambda: self._disconnected(connection, closed_at_ms))
                return
            # no connection: none connected, or its connect died between its registration
            # and its bind, leaving the channel it registered live (lost from here, as any)
            pending = self._through_busy(lambda: self.connections.connecting_of(connection_id))
            if pending is not None:
                self._through_busy(lambda: self._lost_unbound(pending, closed_at_ms))
        finally:
            # a lost member's groups may hand its streams on
            self.hand_offs.flush()

    def _through_busy(self, step: Callable[[], T]) -> T:
        """``step``, tried again while the store is busy, ``DISCONNECT_ATTEMPTS`` times at most.

        API Gateway invokes ``$disconnect`` once and never again, whatever it answers: a
        ``$disconnect`` given up on a throttle would leave the session connected to a gone
        connection, its will unpublished, until the registry's bound on a connection (hours).
        Each step may run again: unbinding is idempotent, and losing a channel already lost
        changes nothing. A connection's ``ready`` mark, after its answer went out, likewise:
        the client will not send its connect again."""
        for attempt in range(DISCONNECT_ATTEMPTS):
            try:
                return step()
            except (ServerBusy, BotoCoreError):
                if attempt == DISCONNECT_ATTEMPTS - 1:
                    raise
                self.clock.sleep(backoff_s(attempt, DISCONNECT_BACKOFF_S, DISCONNECT_BACKOFF_CAP_S))
        raise AssertionError("unreachable")

    def _disconnected(self, connection: Connection, closed_at_ms: int | None) -> None:
        self._lost(connection, closed_at_ms)
        # the connection's item last: a crash before it (a kill -9 of shoal dev, a function
        # that timed out) leaves it, and the $disconnect run again finds what to redo. The
        # 30-minute soak at 200 clients lost a will this way: killed between the item's
        # delete and the lose, the restart's $disconnect found no connection, and the
        # session stayed connected to a gone connection (its will withheld at the resume)
        self.connections.remove(connection)

    def _lost(self, connection: Connection, closed_at_ms: int | None) -> None:
        """The close's work (each step may run again: ``_through_busy``, a crash)."""
        if self.connections.forget(connection):
            # the session's item names a newer connection: a connect took the session over
            # (the client's own renewal before API Gateway's 2 hours, make-before-break), so
            # this channel is not the live one and losing it would change nothing (a
            # conditional write that fails costs its write unit all the same); the newer
            # connection keeps the session's group members live in this one's place. If
            # that connect came while this connection looked live but was gone, it held
            # this channel's will for this close to decide
            self.registry.closed_after_takeover(
                connection.client_id, connection.channel, closed_at_ms
            )
            return
        self._lose_channel(connection, closed_at_ms)

    def _lost_unbound(self, pending: Connection, closed_at_ms: int | None) -> None:
        """A connection with no ``conn#`` item that was about to hold ``pending.channel``:
        its connect died before its bind, or it held the channel and is done with it (its
        ``$disconnect`` run again, a normal ``disconnect``, or a renewal moved the channel to
        another connection). Lost as any channel, but not while another connection holds it:
        the renewal's channel lives on there."""
        head = self.registry.repository.head(pending.client_id)
        if head is None:
            return
        if head.newest.channel != pending.channel:
            # a newer channel took over: it may have held this channel's will for this close
            self.registry.closed_after_takeover(pending.client_id, pending.channel, closed_at_ms)
            return
        if not head.connected:
            # ended already (a normal disconnect, an expiry): nothing left to lose
            return
        target = self.connections.target(head.session_id) if head.session_id else None
        if target is not None and target.connection_id != pending.connection_id:
            return
        self._lose_channel(pending, closed_at_ms)

    def _lose_channel(self, connection: Connection, closed_at_ms: int | None) -> None:
        """The connection's channel lost (a no-op when it is not the live one: lose is
        conditional), and the group members it kept released."""
        who = Principal(sub=connection.sub, clients=(connection.client_id,))
        head = self.registry.lose(who, connection.client_id, connection.channel, closed_at_ms)
        if head is None:
            # not the live channel any more (an HTTP connect took the session over): the
            # members this connection kept may still be kept by it
            head = self.registry.repository.head(connection.client_id)
            if head is not None and head.newest.channel != connection.channel:
                # a newer channel took over (not a disconnect of this one): it may have held
                # this channel's will for this close
                self.registry.closed_after_takeover(
                    connection.client_id, connection.channel, closed_at_ms
                )
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
            self.hand_offs.flush()

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
        # an ack is the frame of every delivery: it reads its connection at half the read
        # units, and consistently only when that read did not find it (not bound yet to it)
        acking = isinstance(frame, AckFrame)
        connection = self.connections.connection(connection_id, consistent=not acking)
        if connection is None and acking:
            connection = self.connections.connection(connection_id)
        if connection is None:
            raise NotConnected("send connect first: this connection holds no session")
        if isinstance(frame, SubscribeFrame):
            # the groups it joins count the member live while this connection lives
            sent = SubscribeSent()
            answer = self.subscriptions.subscribe(
                who,
                connection.client_id,
                connection.channel,
                frame,
                kept_by=connection.kept_by(),
                sent=sent,
            )
            # retained messages, or a group's streams, follow the SUBACK; nothing else does
            return self._post_then_push(
                connection, encode(SubscribedFrame(ref=frame.ref, **answer)), push=sent.any
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
            # the connection knows its session: its head and its state in one read, not two,
            # eventually consistent (``ack_opening`` reads again what a stale copy would refuse)
            (known,) = self.delivery.read_sessions(
                [(connection.client_id, connection.session_id)], consistent=False
            ).values()
            answer, opened = self.delivery.ack_opening(
                who, connection.client_id, connection.channel, frame, connection.window, known=known
            )
            if frame.ref is None:
                # nothing asked back: the freed window is filled at once
                if opened:
                    self.queue.hand_off({connection.session_id: connection.client_id})
                return Answer()
            return self._post_then_push(
                connection, encode(AckedFrame(ref=frame.ref, **answer)), push=opened
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

        def connecting(version: Version) -> None:
            # what a $disconnect finds if this connect dies between its registration and its
            # bind (``disconnected``)
            self.connections.connecting(connection_id, frame.client_id, who.sub, version.channel)

        # this connection keeps the session's group members from now (``_keep`` below)
        connected = self.registry.connect(
            who,
            frame.client_id,
            request,
            requested_at_ms,
            on_connection=True,
            before_register=connecting,
        )
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
        # not ready until the answer below went out: no delivery before it. Refused when a
        # newer connect took the session over and bound its connection since the read above
        if not self.connections.bind(connection):
            raise SessionTakenOver("this channel is no longer the client id's live channel")
        # after the bind: a keep is ended by its connection's end, which needs the bind's
        # items; a crash between the two leaves the member to its lease, as before keeps
        self._keep(connection, head)
        if previous is not None and previous.connection_id != connection_id:
            # MQTT 5 §4.13 / [MQTT-3.1.4-3]: the older connection is told why, then closed
            self.api.disconnect(previous.connection_id, "session_taken_over")
        answer = ConnectedFrame(
            ref=frame.ref,
            session_present=connected.session_present,
            channel=connected.channel,
            keepalive_s=0,
            receive_maximum=window,
        )
        return self._post_then_push(connection, encode(answer), ready=True)

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
        # killed between the move of the session's item and this connection's item, the
        # session would name a connection no item names: its $disconnect finds this instead
        self.connections.connecting(connection_id, frame.client_id, who.sub, frame.channel)
        moved = self.connections.move(connection_id, head.session_id or "", frame.channel, who.sub)
        if moved is None:
            raise RenewRefused("this channel's connection is gone: send connect")
        # not ready until the answer went out: nothing reaches the new connection before it
        # (as a connect's CONNACK, MQTT 5 [MQTT-3.2.0-1])
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
        return self._post_then_push(moved, encode(answer), ready=True)

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
        self.api.disconnect(connection.connection_id, "normal", ref=frame.ref)
        return Answer()

    def _keep(self, connection: Connection, head: Head) -> None:
        """The session's members of its shared groups are live while ``connection`` is."""
        groups = self.registry.groups
        if groups is not None and head.session_id == connection.session_id:
            groups.keep(connection.session_id, head.subscriptions, connection.kept_by())

    def _release(self, connection: Connection, head: Head | None) -> None:
        """``connection`` ended: the session's group members it kept are not live from now,
        and their streams go to live members at once (``disconnected`` pushes those)."""
        groups = self.registry.groups
        if groups is None or head is None or head.session_id != connection.session_id:
            # no session, or a new one: the ended session's memberships went with it
            return
        groups.connection_ended(connection.session_id, head.subscriptions, connection.connection_id)

    def _post_then_push(
        self, connection: Connection, answer: str, *, ready: bool = False, push: bool = True
    ) -> Answer:
        """Posts the answer, then hands the session's push to the queue (``push``); the route
        response is empty then. ``ready``: the connection (a connect's, a renewal's) is
        marked ready first, so the pusher may post to it. A post that fails for another
        reason than a gone connection (throttled past its tries, answered late) must not turn
        a frame that did its work into an error: the answer goes back as the route response
        instead (API Gateway sends it as the function returns, before the queue's push can
        come)."""
        try:
            self.api.post(connection.connection_id, answer)
        except ConnectionGone:
            if ready:
                # the connection went while it was being bound (or a renewal moved the
                # session to it): its $disconnect may have run before and found nothing to
                # end, so the close's work is done here (run again, it changes nothing)
                self._disconnected(connection, None)
            return Answer()
        except (PostThrottled, ClientError, BotoCoreError) as exc:
            logger.info(
                "answer posted as the route response", extra={"error_type": type(exc).__name__}
            )
            self._push_after(connection, ready=ready, push=push)
            return Answer(answer)
        self._push_after(connection, ready=ready, push=push)
        return Answer()

    def _push_after(self, connection: Connection, *, ready: bool, push: bool) -> None:
        if ready:
            try:
                # the answer went out: a refused mark would leave the client waiting, connected,
                # for pushes that skip its connection until it connects again
                marked = self._through_busy(lambda: self.connections.ready(connection))
            except (ServerBusy, BotoCoreError):
                # so the connection is closed instead, and the client connects again (its
                # session kept); its $disconnect ends the channel as any close does
                logger.warning("connection not marked ready: closed")
                self.api.close(connection.connection_id)
                return
            if not marked:
                # the session moved to another connection meanwhile: that one pushes for itself
                return
        if not (push or ready):
            return
        try:
            self.queue.hand_off({connection.session_id: connection.client_id})
        except (ServerBusy, ClientError, BotoCoreError) as exc:
            # the answer went out and the client will not send its frame again: the sweep
            # hands the push over instead at its next run (a held list: pushed whatever the
            # session's state says), or what waits would wait for the next message or connect
            logger.warning("push left to the sweep", extra={"error_type": type(exc).__name__})
            self.connections.arm_sessions([connection.session_id], self.clock.now_ms(), held=True)


def requested_at(context: Mapping[str, Any]) -> int | None:
    value = context.get("requestTimeEpoch")
    return int(value) if isinstance(value, int | float) else None
