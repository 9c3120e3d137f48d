"""Pushed delivery: a connected session's deliveries handed to its WebSocket connection.

Whoever writes a connected session's inbox (the router) or frees its window (a connect; an ack
that opened room, ``Pusher.after_ack``) calls ``Pusher.push``. A push is a get
(``shoal.delivery.DeliveryService.get``) for the connection's channel within its window, then
one ``PostToConnection`` per delivery: the get's conditional write of the session's delivery
state hands each delivery out exactly once, as for HTTP, and the inbox stays the one source of
truth. A post that fails loses nothing: the delivery is in flight for that channel and comes
again with ``dup`` on reconnect (another channel) or after the ack timeout, like an unacked
get. One pusher at a time per session (``ConnectionStore``'s push lease) keeps frames in the
order they were handed out.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from shoal.aws import clients
from shoal.aws.clients import error_code
from shoal.core import metrics
from shoal.core.auth import Principal
from shoal.core.clock import Clock, SystemClock
from shoal.core.config import Config
from shoal.core.errors import ShoalError
from shoal.core.observability import count, logger
from shoal.core.retry import backoff_s
from shoal.delivery.events import EventBatch
from shoal.delivery.inbox import LineCache
from shoal.delivery.model import MAX_GET
from shoal.delivery.service import DeliveryService, SessionRead
from shoal.edge.connections import DUE_SHARDS, Connection, ConnectionStore
from shoal.edge.frames import MessageFrame, ServerDisconnectFrame, encode

#: sessions pushed at once by one invocation (a router batch's fan-out): each push waits on
#: its round trips, not on the CPU
PUSH_PARALLELISM = 16
#: rounds one push goes before leaving the rest to the next trigger: a round hands out at most
#: the window, so a client that acks at once is not held in one invocation forever
MAX_ROUNDS = 8
GONE = "GoneException"


@dataclass
class SweepReport:
    #: sessions found due
    swept: int = 0
    #: frames pushed to them (deliveries again, with ``dup``, and any new ones)
    pushed: int = 0
    #: sessions armed again for deliveries still in flight
    armed: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


@dataclass
class _Opened:
    """One session's push after a wave's first step (``Pusher._open``)."""

    #: the push lease's owner
    owner: str
    #: what the first get handed out, to be posted
    messages: list[dict[str, Any]] = field(default_factory=list)
    #: how many of them were posted (``Pusher._post_opened``)
    posted: int = 0
    #: why the first step failed (raised again where the push goes on)
    failed: Exception | None = None
    #: shared-group members the first get handed streams to
    handed: set[str] = field(default_factory=set)


class ConnectionGone(Exception):
    """The connection was closed (``@connections`` answered 410)."""


class PostThrottled(Exception):
    """``@connections`` kept refusing a post as throttled (``LimitExceededException``) past
    ``POST_ATTEMPTS``: the frame did not go; its delivery stays where the inbox has it."""


#: a throttled post is tried this many times in all, with exponential backoff and full
#: jitter between tries (``POST_BACKOFF_S`` doubling up to ``POST_BACKOFF_CAP_S``): at most
#: about 4 s of waiting, then the caller leaves the frame to a later push
POST_ATTEMPTS = 6
POST_BACKOFF_S = 0.05
POST_BACKOFF_CAP_S = 2.0
#: what API Gateway answers a post past the account's request rate (429)
THROTTLED = frozenset({"LimitExceededException", "TooManyRequestsException", "ThrottlingException"})


class Connections:
    """The WebSocket API's ``@connections`` management API."""

    def __init__(self, client: Any, clock: Clock | None = None) -> None:
        self.client = client
        #: sleeps between a throttled post's tries (injected: tests advance it)
        self.clock = clock or SystemClock()

    @classmethod
    def from_config(cls, config: Config) -> Connections | None:
        if not config.connections_endpoint:
            return None
        return cls(
            clients.client(
                "apigatewaymanagementapi",
                config.region,
                "connections",
                endpoint_url=config.connections_endpoint,
            )
        )

    def post(self, connection_id: str, frame: str) -> None:
        """One frame to the connection. API Gateway counts every post against the account's
        request rate, shared by every API of the region, and refuses past it (429): such a
        post is tried again after a jittered, growing wait (never dropped silently), up to
        ``POST_ATTEMPTS``, then ``PostThrottled``."""
        data = frame.encode()
        for attempt in range(POST_ATTEMPTS):
            try:
                self.client.post_to_connection(ConnectionId=connection_id, Data=data)
                return
            except ClientError as exc:
                code = error_code(exc)
                if code == GONE:
                    raise ConnectionGone(connection_id) from exc
                if code not in THROTTLED:
                    raise
                count(metrics.POSTS_THROTTLED)
                if attempt + 1 == POST_ATTEMPTS:
                    raise PostThrottled(connection_id) from exc
                self.clock.sleep(backoff_s(attempt, POST_BACKOFF_S, POST_BACKOFF_CAP_S))

    def close(self, connection_id: str) -> None:
        """Closes the connection (API Gateway then invokes ``$disconnect``); a gone one is
        closed already."""
        try:
            self.client.delete_connection(ConnectionId=connection_id)
        except ClientError as exc:
            if error_code(exc) != GONE:
                raise


class Pusher:
    def __init__(
        self,
        connections: ConnectionStore,
        api: Connections,
        delivery: DeliveryService,
        clock: Clock | None = None,
    ) -> None:
        self.connections = connections
        self.api = api
        self.delivery = delivery
        self.clock = clock or SystemClock()
        #: per thread (``shoal dev`` runs invocations on threads): the shared-group members
        #: handed streams during this invocation, and how deep in pushes it is
        self._local = threading.local()
        # the delivery's groups: gets and acks hand streams over
        self.watch(getattr(delivery, "groups", None))

    def watch(self, groups: object | None) -> None:
        """Pushes the members that the transitions of ``groups`` (a ``GroupService``) hand
        streams to (a lane revoked from one member goes to another when the first acks its
        last): an idle member connected over the WebSocket API runs nothing that would read
        them."""
        store = getattr(groups, "store", None)
        if store is not None:
            store.on_granted = self.handed_over

    def handed_over(self, session_ids: set[str]) -> None:
        """Noted, and pushed when the outermost push of this invocation ends (or at
        ``push_handed_over``): never in the middle of the get that granted them."""
        pending: set[str] | None = getattr(self._local, "pending", None)
        if pending is None:
            pending = self._local.pending = set()
        pending.update(session_ids)

    def push_handed_over(self) -> int:
        """Pushes the members handed streams so far in this invocation; the frames pushed."""
        pushed = 0
        pending: set[str] | None = getattr(self._local, "pending", None)
        # a push of one may hand streams to another: until none is left
        while pending:
            session_ids = set(pending)
            pending.clear()
            try:
                pushed += self.push_sessions(session_ids)
            except (ClientError, BotoCoreError) as exc:
                # the streams wait for the member's next trigger (a message routed to the
                # group pushes every member): the work that granted them is done
                count(metrics.PUSH_FAILED)
                logger.info("handed-over push failed", extra={"error_type": type(exc).__name__})
        return pushed

    def push_sessions(
        self,
        session_ids: Iterable[str],
        lines: LineCache | None = None,
        source: str | None = None,
    ) -> int:
        """Pushes to those of ``session_ids`` that are connected over the WebSocket API (one
        strongly consistent batch read finds them); the frames pushed.

        Sessions are pushed side by side (``PUSH_PARALLELISM`` at once): a push is a few
        round trips (lease, get, post, release), so one after the other a router batch that
        fans out to 1,000 connected sessions would take over a minute deployed (the router's
        timeout) and the last subscriber would wait for all the others. Each session's own
        frames stay in order: one pusher per session holds its lease.

        ``lines``: the archive lines the caller holds (the router's batch), so that the pushes
        fill the deliveries naming them without reading the archive back. ``source``: the
        source the caller just wrote the sessions' deliveries to (the router's shard), where
        each push's first round looks for new ones (``DeliveryService.get``).

        The targets' heads and delivery states are read together first (one batch read for
        up to 50 sessions, ``DeliveryService.read_sessions``), so that each push's first get
        reads neither: under one lock (``shoal dev``) the pushes of a batch wait for each
        other's calls, and deployed each read is a round trip before the frame goes out."""
        targets = self.connections.targets(session_ids)
        if not targets:
            return 0
        read = self._read(targets)
        if len(targets) == 1:
            return self.push(targets[0], lines, source, read.get(targets[0].session_id))
        workers = min(PUSH_PARALLELISM, len(targets))
        pushed = 0
        #: what a session's step raised (a throttled lease, say): the other sessions' pushes
        #: go on to the end, and the first error is raised then (the router's batch is retried)
        errors: list[Exception] = []
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="shoal-push") as pool:

            def each(work: Any, *columns: Iterable[Any]) -> list[Any]:
                # the invocation's context (its metrics, its logger's keys) goes with each
                futures = [
                    pool.submit(contextvars.copy_context().run, work, *args)
                    for args in zip(*columns, strict=True)
                ]
                done: list[Any] = []
                for future in futures:
                    error = future.exception()
                    if error is not None:
                        errors.append(error)  # type: ignore[arg-type]
                    done.append(None if error is not None else future.result())
                return done

            for start in range(0, len(targets), workers):
                wave = targets[start : start + workers]
                batch = self._event_batch()
                opened = each(
                    self._open,
                    wave,
                    [lines] * len(wave),
                    [source] * len(wave),
                    [read.get(c.session_id) for c in wave],
                    [batch] * len(wave),
                )
                self._append(batch, opened)
                # every frame of the wave before any lease goes back: the releases (a write
                # each) wait behind the frames, not the frames behind the releases
                each(self._post_opened, wave, opened)
                finished = each(
                    self._finish, wave, opened, [lines] * len(wave), [source] * len(wave)
                )
                pushed += sum(n or 0 for n in finished)
        if errors:
            raise errors[0]
        return pushed

    def _event_batch(self) -> EventBatch | None:
        recording = self.delivery.events
        return EventBatch(recording) if recording is not None and recording.enabled else None

    def _open(
        self,
        connection: Connection,
        lines: LineCache | None,
        source: str | None,
        read: SessionRead | None,
        batch: EventBatch | None,
    ) -> _Opened | None:
        """A wave's first step for one session: its lease and its first get, whose delivery
        events go to ``batch`` (appended for the whole wave before any frame goes out). None:
        another pusher holds the lease (and goes round once more for us)."""
        owner = self.connections.take_lease(connection)
        if owner is None:
            return None
        opened = _Opened(owner)
        try:
            opened.messages = self._get(connection, lines, source, read, batch)
        except (ShoalError, ClientError, BotoCoreError) as exc:
            opened.failed = exc
        # streams this get handed to shared-group members: pushed by whichever thread finishes
        pending: set[str] | None = getattr(self._local, "pending", None)
        if pending:
            opened.handed = set(pending)
            pending.clear()
        return opened

    @staticmethod
    def _append(batch: EventBatch | None, opened: list[_Opened | None]) -> None:
        """The wave's delivery events, in one append, before its frames: a delivery the log
        does not name is never posted (the audit counts what the events say went out)."""
        if batch is None:
            return
        try:
            batch.flush()
        except (ClientError, BotoCoreError) as exc:
            for o in opened:
                if o is not None and o.failed is None:
                    o.failed = exc

    def _post_opened(self, connection: Connection, opened: _Opened | None) -> None:
        """Posts what a wave's first get handed out (``opened.posted`` counts those gone)."""
        if opened is None or opened.failed is not None:
            return
        try:
            for message in opened.messages:
                self.api.post(connection.connection_id, encode(MessageFrame(**message)))
                opened.posted += 1
        except (ConnectionGone, ClientError, BotoCoreError) as exc:
            opened.failed = exc

    def _finish(
        self,
        connection: Connection,
        opened: _Opened | None,
        lines: LineCache | None,
        source: str | None,
    ) -> int:
        """The rest of a wave's push for one session once its frames went out, as ``push``
        goes on: more gets when the first one filled a page, the release, more rounds."""
        if opened is None:
            return 0
        if opened.handed:
            self.handed_over(opened.handed)
        return self.push(connection, lines, source, opened=opened)

    def _read(self, targets: list[Connection]) -> dict[str, SessionRead]:
        """The targets' heads and states, or nothing when the read failed: each push then
        reads its own, as it would without this."""
        try:
            return self.delivery.read_sessions((c.client_id, c.session_id) for c in targets)
        except (ShoalError, ClientError, BotoCoreError) as exc:
            logger.info("push read failed", extra={"error_type": type(exc).__name__})
            return {}

    def after_ack(
        self, connection: Connection, opened: bool, *, unfinished: bool | None = None
    ) -> int:
        """The push an ack makes: when it opened room for deliveries that wait (``opened``,
        ``DeliveryService.ack_opening``), or a push may have left deliveries behind (it
        stopped early, or died holding the lease: ``ConnectionStore.unfinished``).
        Otherwise every delivery there is went out already, or a live holder is handing it
        out, and a push would take and give back the lease to find nothing (two writes and
        three or four reads), or send the holder round once more for nothing; what comes due
        for redelivery meanwhile is the sweep's. The frames pushed. ``unfinished``: as the
        caller read it already (``ConnectionStore.unfinished_as_read``), not read again."""
        if opened:
            return self.push(connection)
        if unfinished is None:
            unfinished = self.connections.unfinished(connection.session_id)
        return self.push(connection) if unfinished else 0

    def push(
        self,
        connection: Connection,
        lines: LineCache | None = None,
        source: str | None = None,
        read: SessionRead | None = None,
        *,
        held_by: str | None = None,
        opened: _Opened | None = None,
    ) -> int:
        """The connection's deliveries, within its window, in order; the frames pushed. Never
        raises for a failed push: the inbox keeps what it would have carried.

        Handing out a QoS 1/2 delivery arms the session in the due index for its ack timeout
        (in the lease's release: no extra write), so that the reaper's sweep pushes it again
        with ``dup`` if no ack came by then; nothing else would, while the client stays.

        Shared-group members that this push's gets handed streams to are pushed after it.
        ``read``: the session's head and state as read before the lease was taken, where the
        first get starts (a stale state costs that get a failed write and a read again).
        ``held_by``: the lease's owner when the caller holds it already (a connect's bind).
        ``opened``: the lease and first get done already (``push_sessions``' waves)."""
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        try:
            pushed = self._push(connection, lines, source, read, held_by=held_by, opened=opened)
        finally:
            self._local.depth = depth
        if depth == 0:
            pushed += self.push_handed_over()
        return pushed

    def _push(
        self,
        connection: Connection,
        lines: LineCache | None = None,
        source: str | None = None,
        read: SessionRead | None = None,
        *,
        held_by: str | None = None,
        opened: _Opened | None = None,
    ) -> int:
        owner = opened.owner if opened else held_by or self.connections.take_lease(connection)
        if owner is None:
            return 0  # the holder goes round once more for us
        pushed = 0
        due: int | None = None
        held = True
        try:
            if opened is not None and opened.failed is not None:
                # what its get handed out never went out: armed, so that the sweep sends it
                # again after its ack timeout (as a frame lost on the way would be)
                if any(m["qos"] > 0 for m in opened.messages):
                    due = self.clock.now_ms() + self._ack_timeout_ms
                pushed = opened.posted
                raise opened.failed
            for round_ in range(MAX_ROUNDS):
                # the lease was just taken with ``again`` cleared: the first round needs no
                # write of its own (a pusher that came in meanwhile set ``again``, and the
                # release then fails and sends this holder round once more)
                if round_ and not self.connections.next_round(connection, owner):
                    # the lease is another's now (a renewal took it, or it ran out): what this
                    # push handed out is still timed, or only a reconnect would send it again
                    held = False
                    if due is not None:
                        self.connections.arm_session(connection.session_id, due)
                    return pushed
                # the first round looks where the trigger wrote (``source``); a round again
                # (``again``: another trigger came meanwhile, maybe for another source, or an
                # ack opened the window) looks everywhere
                frames, acked_later = self._round(
                    connection,
                    lines,
                    *((source, read) if not round_ else (None, None)),
                    handed=opened.messages if opened is not None and not round_ else None,
                    posted=opened.posted if opened is not None and not round_ else 0,
                )
                pushed += frames
                if acked_later and due is None:
                    due = self.clock.now_ms() + self._ack_timeout_ms
                everywhere = source is None or round_ > 0
                if self.connections.release(connection, owner, due, everywhere=everywhere):
                    held = False
                    return pushed
            # rounds used up: given back below, the next trigger goes on
            return pushed
        except ConnectionGone:
            count(metrics.PUSH_FAILED)
            # no more pushes to it; its own item stays for its $disconnect, which loses the
            # channel (the will's delay starts there)
            if self.connections.forget(connection):
                # a renewal moved the session on meanwhile: what this push handed out stays in
                # flight for the same channel, and comes again after its ack timeout
                self.connections.arm_session(
                    connection.session_id, self.clock.now_ms() + self._ack_timeout_ms
                )
            held = False
            return pushed
        except (ShoalError, ClientError, BotoCoreError) as exc:
            # e.g. the channel was taken over (the newer connection pushes for itself), a
            # shared group's lane contended past its retries, a throttled call
            count(metrics.PUSH_FAILED)
            logger.warning(
                "push stopped",
                extra={
                    "error_type": type(exc).__name__,
                    "code": exc.code
                    if isinstance(exc, ShoalError)
                    else error_code(exc)
                    if isinstance(exc, ClientError)
                    else None,
                },
            )
            return pushed
        finally:
            if held:
                # a lease kept until it runs out (10 s) turns every push meanwhile into a
                # no-op that counts on this holder: when the last trigger came in that time,
                # the session's backlog waited for a trigger that never came
                self.connections.let_go(connection, owner, due)

    @property
    def _ack_timeout_ms(self) -> int:
        return int(self.delivery.settings.ack_timeout_s * 1000)

    def sweep(self, limit_per_shard: int = 500) -> SweepReport:
        """The reaper's part: pushes again the connected sessions whose pushed deliveries
        passed their ack timeout (the due index), and arms each for its next deadline."""
        report = SweepReport()
        now = self.clock.now_ms()
        for shard in range(DUE_SHARDS):
            for session_id, due_at_ms in self.connections.due(shard, now, limit_per_shard):
                # taken off first, so a sweep that dies later loses only the timer (the next
                # push or reconnect hands the deliveries out again)
                if not self.connections.disarm(session_id, due_at_ms):
                    continue
                report.swept += 1
                # most sessions acked in time: one read of the delivery state says so
                following = self._next_deadline(session_id)
                if following is None:
                    continue
                connection = self.connections.target(session_id)
                if connection is None:
                    continue
                if following <= now:
                    report.pushed += self.push(connection)
                    following = self._next_deadline(session_id)
                if following is not None and self.connections.arm(
                    connection, following, earliest=False
                ):
                    report.armed += 1
        # the reaper's group advances (a dead channel's leases) hand streams on too
        report.pushed += self.push_handed_over()
        return report

    def _next_deadline(self, session_id: str) -> int | None:
        """When the earliest of the session's deliveries still in flight comes due again."""
        runs = self.delivery.inbox.state(session_id).runs
        if not runs:
            return None
        return min(r.sent_at_ms for r in runs) + self._ack_timeout_ms

    def _round(
        self,
        connection: Connection,
        lines: LineCache | None = None,
        source: str | None = None,
        read: SessionRead | None = None,
        *,
        handed: list[dict[str, Any]] | None = None,
        posted: int = 0,
    ) -> tuple[int, bool]:
        """The frames pushed, and whether any of them waits for an ack. ``handed``: what this
        round's first get handed out already (``_open``), of which the first ``posted`` went
        out already (``_post_opened``)."""
        pushed = 0
        acked_later = False
        while True:
            gone = 0
            if handed is not None:
                messages, handed, gone = handed, None, posted
            else:
                messages = self._get(connection, lines, source, read)
            # more than one get: the rest of what waits, wherever it is, read again
            source = None
            read = None
            for n, message in enumerate(messages):
                if n >= gone:
                    self.api.post(connection.connection_id, encode(MessageFrame(**message)))
                acked_later = acked_later or message["qos"] > 0
            pushed += len(messages)
            count(metrics.PUSHED, len(messages))
            if len(messages) < MAX_GET:
                # all there was, or the window is full: acks open it again
                return pushed, acked_later

    def _get(
        self,
        connection: Connection,
        lines: LineCache | None,
        source: str | None,
        read: SessionRead | None,
        events: EventBatch | None = None,
    ) -> list[dict[str, Any]]:
        who = Principal(sub=connection.sub, clients=(connection.client_id,))
        messages: list[dict[str, Any]] = self.delivery.get(
            who,
            connection.client_id,
            connection.channel,
            max_messages=MAX_GET,
            window=connection.window,
            lines=lines,
            source=source,
            known=read,
            events=events,
        )["messages"]
        return messages

    def disconnect(self, connection_id: str, reason: str, ref: str | None = None) -> None:
        """Sends the service's ``disconnect`` frame, then closes the connection (MQTT 5
        §3.14: the server's DISCONNECT, then the network connection is closed)."""
        try:
            self.api.post(connection_id, encode(ServerDisconnectFrame(reason=reason, ref=ref)))  # type: ignore[arg-type]
        except ConnectionGone:
            return
        self.api.close(connection_id)
