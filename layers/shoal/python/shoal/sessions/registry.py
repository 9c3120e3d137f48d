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

Only registrations count towards LocalMax and RealMax, as in the EIP: once a channel has
disconnected (or its keepalive expired) it holds off no connect, so a reconnect is never
refused for a gateway clock a millisecond behind the previous one.

The reaper finds work through the sparse ``due`` index (see ``shoal.aws.tables.DueIndex``): a head
is indexed while its keepalive runs or its session awaits expiry, a will while it waits.
Heartbeats do not touch the index (that would cost an index write per heartbeat); the reaper
re-indexes a head whose deadline moved when it finds it due early.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shoal.core.auth import Principal
from shoal.core.clock import Clock, SystemClock
from shoal.core.errors import (
    BadRequest,
    ChannelOutdated,
    Forbidden,
    ServerBusy,
    SessionNotFound,
    SessionTakenOver,
    ShoalError,
)
from shoal.core.observability import logger
from shoal.core.retry import backoff_s
from shoal.sessions.model import (
    BACKOFF_BASE_MS,
    BACKOFF_CAP_MS,
    CONNECT_BUDGET_S,
    HEAD,
    MAX_CLOCK_AHEAD_MS,
    WILL_PREFIX,
    Channel,
    ConflictStep,
    Connected,
    ConnectPlan,
    ConnectRequest,
    Decision,
    Head,
    Version,
    after_conflict,
    check_client_id,
    check_will,
    grace_ms,
    parse_channel,
    plan_connect,
    session_document,
)
from shoal.sessions.ports import DueTimer, GroupLeases, InFlight, SessionEndHook, call_end_hook
from shoal.sessions.repository import SessionRepository
from shoal.sessions.timers import arm_timer


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
    #: retried connects answered with the channel their earlier try registered
    repeated: int = 0
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
                "repeated": self.repeated,
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
        requests_seen: bool = True,
        timer: DueTimer | None = None,
    ) -> None:
        self.repository = repository
        #: the channel's own requests count for its keepalive (``_seen``); False where the
        #: calls are the service's, not the client's (a push's gets)
        self.requests_seen = requests_seen
        self.clock = clock or SystemClock()
        self.budget_ms = int(budget_s * 1000)
        self.stats = stats or RegistryStats()
        self.on_session_end = on_session_end
        #: a heartbeat renews the session's group leases too (``shoal.groups``)
        self.groups = groups
        #: the session document counts the deliveries in flight
        self.deliveries = deliveries
        #: reaps what a lost connection or a takeover makes due now at once, not at the
        #: reaper's next scheduled run (``shoal.sessions.timers``); None: the schedule alone
        self.timer = timer

    # -- connect

    def connect(
        self,
        who: Principal,
        client_id: str,
        request: ConnectRequest,
        requested_at_ms: int | None = None,
        *,
        on_connection: bool = False,
        before_register: Callable[[Version], None] | None = None,
    ) -> Connected:
        """``on_connection``: the connect came on a WebSocket connection, which keeps the
        session's shared-group members live itself from now (``shoal.edge``): the keeps of a
        channel it takes over are replaced, not ended. An HTTP connect that resumes a session
        from a live channel ends that channel's keeps at once. ``before_register``: told the
        new channel's version once the request passed every check, before it is registered
        (the edge records which channel its connection is about to hold)."""
        who.require_client(client_id)
        check_client_id(client_id)
        now = self.clock.now_ms()
        if request.will is not None:
            check_will(who, request.will)
        at = request.connected_at_ms
        if at is None:
            at = requested_at_ms if requested_at_ms is not None else now
        if at > now + MAX_CLOCK_AHEAD_MS:
            raise BadRequest(
                "connected_at_ms is ahead of the server's clock", field="connected_at_ms"
            )
        ours = Version.new(at)
        give_up_at = now + self.budget_ms

        if on_connection and request.connect_token is not None:
            # a connection's channel is never handed to another request (``_repeated``)
            request = request.model_copy(update={"connect_token": None})
        view = self.repository.read(client_id, consistent=False)
        local_max = view.newest()
        repeated = _repeated(view.head, request, who.sub)
        if repeated is not None:
            self.stats.add(repeated=1)
            return repeated
        if local_max is not None and ours < local_max:
            self.stats.add(outdated=1)
            raise ChannelOutdated("a newer connect for this client id exists")
        if before_register is not None:
            before_register(ours)
        attempts = 0
        while True:
            attempts += 1
            plan = plan_connect(view, request, who.sub, ours, self.clock.now_ms())
            registered_at = self.clock.now_ms()
            committed = self.repository.register(
                client_id,
                sub=who.sub,
                ours=ours,
                request=request,
                plan=plan,
                expected=view.head,
                now_ms=registered_at,
            )
            if committed:
                break
            real = self.repository.read(client_id, consistent=True)
            repeated = _repeated(real.head, request, who.sub)
            if repeated is not None:
                # the earlier try of this connect landed while this one read a stale view
                self.stats.add(attempts=attempts, repeated=1)
                return repeated
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
        self._arm_wills(client_id, plan)
        if request.will is not None and request.keepalive_s > 0 and not on_connection:
            # an HTTP channel that leaves a will: its keepalive's timer, so the channel
            # expires and the will is armed 1.5 times the keepalive after the last request
            # ([MQTT-3.1.2-22]), not at the schedule's next run (``Reaper._chain``)
            deadline = registered_at + grace_ms(request.keepalive_s)
            arm_timer(self.timer, client_id, HEAD, deadline, self.clock.now_ms())
        ended = view.head
        if plan.decision is not Decision.RESUME and ended is not None and ended.subscriptions:
            # the session this connect ended: its subscriptions leave the router's store
            # (best effort: the connect stands; a leftover only costs writes to an inbox no
            # session reads, which TTL removes)
            call_end_hook(self.on_session_end, client_id, ended)
        elif plan.decision is Decision.RESUME and not on_connection:
            self._release_taken_over(ended)
        return Connected(plan.session_present, ours.channel, request.keepalive_s)

    def _arm_wills(self, client_id: str, plan: ConnectPlan) -> None:
        """The wills the committed connect made due at once (the taken-over channel's, and
        those of a session it ended): published now, by their timers, not at the reaper's
        next run (MQTT 5 §3.1.3.2.2). Best effort: the schedule publishes them otherwise."""
        now = self.clock.now_ms()
        wills = [w.item for w in plan.fire_wills]
        if plan.takeover_will is not None and plan.takeover_will.held_since_ms is None:
            # (a held will waits for its channel's $disconnect, not for a timer)
            wills.append(plan.takeover_will.item)
        for item in wills:
            arm_timer(self.timer, client_id, item, now, now)

    def _release_taken_over(self, ended: Head | None) -> None:
        """The live channel this HTTP connect took over may have been a WebSocket
        connection's, whose keeps held the session's group members live: they end now, not at
        that connection's ``$disconnect`` (which comes when API Gateway or the client closes
        it). Best effort: a failure leaves them to that ``$disconnect``, as before."""
        if self.groups is None or ended is None or not ended.connected or not ended.session_id:
            return
        try:
            self.groups.channel_taken_over(ended.session_id, ended.subscriptions, ended.channel)
        except Exception as exc:
            logger.warning(
                "releasing a taken-over channel's members failed",
                extra={"error_type": type(exc).__name__},
            )

    # -- session-scoped calls

    def _scope(self, who: Principal, client_id: str, channel: Channel | None) -> Version:
        # the principal before the request's shape (``shoal.http.caller.session_call``)
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

    def require_live(self, who: Principal, client_id: str, channel: Channel | None) -> Head:
        """The head, when ``channel`` is the live channel of ``who``'s session; one read.

        For session-scoped routes that read; writes put the liveness condition on themselves
        instead (``shoal.sessions.repository.live_condition``).
        """
        return self.live_as_read(who, client_id, channel, self.repository.head(client_id))

    def live_as_read(
        self, who: Principal, client_id: str, channel: Channel | None, head: Head | None
    ) -> Head:
        """``require_live`` on a head the caller read itself (a router's push reads the heads
        of a batch's sessions together, in one batch read, not one read a session)."""
        version = self._scope(who, client_id, channel)
        if head is None or head.sub != who.sub or not head.is_live(version):
            raise self._refuse(who, head)
        self._seen(client_id, version, who.sub, head)
        return head

    def _seen(self, client_id: str, version: Version, sub: str, head: Head) -> None:
        """Any request of the channel counts for its keepalive, as any control packet does
        (MQTT 5 §3.1.2.10), not only a heartbeat: a client that long-polls or acks stays
        connected. Written once half the keepalive has passed since it was last seen, so a
        busy channel writes at most twice a keepalive (a get that found the channel live
        otherwise writes nothing); best effort: a lost race leaves it to the next request."""
        if head.keepalive_s <= 0 or not self.requests_seen:
            return
        now = self.clock.now_ms()
        if now - head.last_seen_ms < head.keepalive_s * 500:
            return
        self.repository.heartbeat(client_id, version, sub, now)

    def heartbeat(self, who: Principal, client_id: str, channel: Channel | None) -> dict[str, Any]:
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

    def renew(self, who: Principal, client_id: str, channel: Channel, keepalive_s: int) -> Head:
        """The live channel moves to a new connection of the same client (``shoal.edge``'s
        renewal before API Gateway's two hours): no new channel, no takeover, so no will
        (the connection was not lost) and the session's deliveries in flight stay in flight.
        The channel's keepalive and its deadline restart. Refused as a session-scoped call is
        when ``channel`` is not ``who``'s live channel, or its connection was lost."""
        version = self._scope(who, client_id, channel)
        head = self.repository.renew(client_id, version, who.sub, self.clock.now_ms(), keepalive_s)
        if head is None:
            raise self._refuse(who, self.repository.head(client_id))
        return head

    def disconnect(self, who: Principal, client_id: str, channel: Channel | None) -> None:
        version = self._scope(who, client_id, channel)
        if self.repository.disconnect(client_id, version, who.sub, self.clock.now_ms()):
            return
        head = self.repository.head(client_id)
        if head is None or head.sub == who.sub:
            # a stale channel still ends its own registration (the takeover's end); that
            # touches no other channel's entry and no session state
            self.repository.deregister(client_id, version)
        raise self._refuse(who, head)

    def lose(
        self, who: Principal, client_id: str, channel: Channel, closed_at_ms: int | None = None
    ) -> Head | None:
        """A channel's connection is gone without a disconnect (at ``closed_at_ms``, never
        later than now): the reaper expires it at once (its timer), publishing the will after
        its delay from the close (MQTT 5 §3.1.2.5, §3.1.3.2.2) unless the session is resumed
        first. The head as written; None when the channel is not the live one any more (a
        takeover, a normal disconnect): nothing to do."""
        version = self._scope(who, client_id, channel)
        now = self.clock.now_ms()
        closed = now if closed_at_ms is None else min(closed_at_ms, now)
        head = self.repository.lose(client_id, version, who.sub, closed)
        if head is not None:
            # the head is due now: its timer expires the channel at once, and arms the will's
            # for its delay (a reconnect within the delay cancels it, as MQTT 5 says), where
            # the reaper's schedule would come a minute later and its will's a minute after
            arm_timer(self.timer, client_id, HEAD, closed, now)
        return head

    def closed_after_takeover(
        self, client_id: str, channel: Channel, closed_at_ms: int | None = None
    ) -> bool | None:
        """A channel a connect took over has closed (at ``closed_at_ms``, never later than
        now): its connection's ``$disconnect`` came after that connect, which held the
        channel's delayed will for it (``shoal.sessions.model.takeover_will``). If the
        connection closed a whole will delay before the connect, the delay ran out with no
        new connection and the will is published now (MQTT 5 §3.1.3.2.2, [MQTT-3.1.2-8]);
        otherwise the connect came within the delay, and it is dropped ([MQTT-3.1.3-9]).
        True: published; False: dropped; None: no will was held (one strongly consistent
        read)."""
        version = parse_channel(channel)
        will = self.repository.will(client_id, WILL_PREFIX + version.key)
        if will is None or will.held_since_ms is None:
            return None
        now = self.clock.now_ms()
        closed = now if closed_at_ms is None else min(closed_at_ms, now)
        if closed + will.message.delay_s * 1000 > will.held_since_ms:
            self.repository.settle_held_will(client_id, will, None)
            return False
        if self.repository.settle_held_will(client_id, will, now):
            arm_timer(self.timer, client_id, will.item, now, now)
        return True

    def session(self, who: Principal, client_id: str, channel: Channel | None) -> dict[str, Any]:
        head = self.require_live(who, client_id, channel)
        document = session_document(client_id, head)
        if self.groups is not None:
            document["groups"] = self.groups.describe(head.session_id or "", head.subscriptions)
        if self.deliveries is not None and head.session_id:
            document["in_flight"] = self.deliveries.in_flight(head.session_id)
        return document

    def view(self, who: Principal, client_id: str) -> dict[str, Any]:
        """The session read-only, without its channel: for an admin, or for the principal that
        holds it (``shoal sessions show``).

        MQTT has no such read (a client sees its session only by connecting, which takes it
        over: MQTT 5 §3.1.4); a broker's admin API has one (EMQX's ``GET /clients/{clientid}``).
        It only reads: the head (one strongly consistent read), the groups and the inbox's
        state, as the channel's own GET does; nothing is renewed, taken over, delivered or
        acked, and the live channel goes on as before. ``channel`` is null: the live channel
        is what a session-scoped call acts as (acks among them), so the view does not hand it
        out. A session that expired and is not removed yet is gone (MQTT 5 §3.1.2.11.2).
        """
        if not who.admin:
            who.require_client(client_id)
        check_client_id(client_id)
        head = self.repository.head(client_id)
        if head is not None and head.sub != who.sub and not who.admin:
            raise Forbidden("the client id's session belongs to another principal")
        if head is None or not head.session_alive(self.clock.now_ms()):
            raise SessionNotFound("no session for this client id")
        document = session_document(client_id, head)
        document["channel"] = None
        if self.groups is not None:
            document["groups"] = self.groups.describe(head.session_id or "", head.subscriptions)
        if self.deliveries is not None and head.session_id:
            document["in_flight"] = self.deliveries.in_flight(head.session_id)
        return document


def _repeated(head: Head | None, request: ConnectRequest, sub: str) -> Connected | None:
    """A retried HTTP connect whose earlier try registered (its answer was lost): that try's
    channel and answer, while it is still the live channel of the same principal. A channel
    since taken over, disconnected or expired is not handed out again: the retry connects as
    any connect does. A WebSocket connect's token is dropped (the connection is its
    channel), so no HTTP connect is handed a connection's channel."""
    if request.connect_token is None or head is None or not head.connected:
        return None
    if head.sub != sub or head.connect_token != request.connect_token:
        return None
    return Connected(head.connect_session_present, head.channel, head.keepalive_s)
