"""Pushed delivery: connected sessions' deliveries posted to their WebSocket connections.

The pusher function runs ``PushWorker.handle`` on a batch of the push queue's messages (push
work, ``shoal.edge.pushwork``): chunks of sessions whose deliveries to post. For each session
that is connected (and whose connection's answer went out, ``ConnectionStore.ready``) a push
is a get (``shoal.delivery.DeliveryService.get``) for the connection's channel within its
window, then one ``PostToConnection`` per delivery: the get's conditional write of the
session's delivery state hands each delivery out exactly once, as for HTTP, and the inbox
stays the one source of truth. A post that fails loses nothing: the delivery is in flight for
that channel and comes again with ``dup`` on reconnect (another channel) or after the ack
timeout, like an unacked get.

A chunk's work is batched across its sessions: one read of their connections, one batch read
of their heads and delivery states, their first gets side by side (``PushSettings.parallelism``),
the delivery events of those gets in one append before any frame goes, then the posts side
by side, each session's in order. Where the chunk carries the archive lines its deliveries
name, nothing is read back from S3.

Order: one session's pushes never run at once (its pushes share a message group of the FIFO
push queue, ``shoal.edge.pushwork``), so frames leave in the order their deliveries were
handed out, without a lease. A post refused as throttled is tried again with backoff and
jitter (``Connections.post``); past its attempts, what this push handed out and did not post
is made due again (``DeliveryService.unsend``) and the chunk is returned to the queue with a
growing visibility delay: its group waits, so no later delivery of the session overtakes it,
and the retry sends it again, in order, with ``dup``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from contextlib import suppress
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from botocore.exceptions import BotoCoreError, ClientError

from shoal.aws.clients import error_code
from shoal.core import metrics
from shoal.core.auth import Principal
from shoal.core.clock import Clock, SystemClock
from shoal.core.config import DEFAULT_PUSH_PARALLELISM
from shoal.core.errors import ServerBusy, ShoalError
from shoal.core.observability import count, logger
from shoal.core.pools import Pools
from shoal.core.retry import backoff_s
from shoal.delivery.events import EventBatch, record_answers
from shoal.delivery.gate import SessionGate
from shoal.delivery.inbox import Given, LineCache, ordinal_of
from shoal.delivery.model import MAX_GET, Position
from shoal.delivery.service import DeliveryService, SessionRead
from shoal.edge.connections import Connection, ConnectionStore
from shoal.edge.frames import MessageFrame, encode
from shoal.edge.posts import (
    ConnectionGone,
    Connections,
    PostThrottled,
)
from shoal.edge.pushwork import HandOffs, PushQueue, PushWork

#: gets one session's push makes at most: a get hands out at most a page (``MAX_GET``), so a
#: client that acks at once is not held in one invocation for ever (its acks push the rest)
MAX_ROUNDS = 8
#: a session whose items the drain's gate held is pushed again (by the sweep) this much later
DRAIN_RECHECK_MS = 2_000
#: a shared group's copy posted this long after its get handed it out is checked first: its
#: lane may have moved meanwhile and another member acked it (a batch posts only after all its
#: gets; the soak's run J saw a first copy posted 38 s after its hand-out, 20 s after the other
#: member's ack). Deployed, a get and its post are tens of ms apart: no read is added
LATE_POST_MS = 1_000
#: a connection not ready this long after its connect (or renewal) wrote it was left so by an
#: invocation that ended without its mark (the edge's timeout is 29 s): a push that finds it
#: closes it, and the client connects again instead of waiting for pushes that skip it
READY_BOUND_MS = 120_000
#: a chunk returned to the queue is visible again after a jittered, growing delay (by its
#: receive count), at most this long: its group (its sessions' later pushes) waits meanwhile
MAX_RETRY_DELAY_S = 60

T = TypeVar("T")


@dataclass(frozen=True)
class _Qos0:
    """A QoS 0 frame a record carries (written nowhere), and where its message is: the
    record's source and the message's position in it."""

    frame: dict[str, Any]
    source: str | None
    position: str | None
    #: the source's stream when the drain gates it (``PushWork.stream``)
    stream: str | None = None

    def before(self, at: Position | None, gate: SessionGate | None) -> bool:
        """Whether it goes before a delivery at ``at``: one of the same source, later, or one
        of a later storage topic of its composite topic (the gate let that out once the
        session had every inbox item of this one, but this frame is in no inbox)."""
        if at is None:
            return False
        if gate is not None and gate.precedes(self.stream, at.stream):
            return True
        if self.position is None or self.source != at.source:
            return False
        return self.position < at.position


@dataclass
class _Push:
    """One session's push in a batch."""

    session_id: str
    #: the batch's records naming the session, in order
    records: list[int]
    #: where the first get looks (None: everywhere)
    source: str | None
    lines: LineCache
    connection: Connection | None = None
    read: SessionRead | None = None
    #: what the first get handed out, to be posted
    handed: list[dict[str, Any]] = field(default_factory=list)
    #: frames posted
    posted: int = 0
    #: a QoS 1/2 delivery went out: it waits for an ack (the due index is armed for it)
    acked_later: bool = False
    #: the push failed in a way a retry of its chunk mends (throttled, contended, refused)
    failed: Exception | None = None
    #: ordinals handed out and not posted (made due again when the push failed)
    unposted: set[int] = field(default_factory=set)
    #: QoS 0 frames the records carry (written nowhere): posted once, never again, in order
    #: among the deliveries handed out (``positions``)
    direct: list[_Qos0] = field(default_factory=list)
    #: the QoS 0 frames posted
    posted_direct: int = 0
    #: where each delivery the gets handed out is in its source, by id
    positions: dict[str, Position] = field(default_factory=dict)
    #: the first message of each source a full window left waiting (``DeliveryService.get``)
    waiting: dict[str, str] = field(default_factory=dict)
    #: the due index was armed by this push
    armed: bool = False
    #: the shared groups' QoS 1/2 deliveries its gets handed out (``g-`` ids), and those a due
    #: list names: the sweep asks the group about them, not the session's state
    grouped: set[str] = field(default_factory=set)
    armed_grouped: set[str] = field(default_factory=set)
    #: when its last get began (what it handed out is posted after)
    got_at_ms: int = 0
    #: the items its first get may take without reading them back (``Given``)
    given: Given | None = None
    #: sources whose items the drain's gate held back from its gets (``shoal.drain``)
    held: set[str] = field(default_factory=set)
    #: a record naming the session came back from a failed or dead attempt, whose get may
    #: have handed deliveries out and died before the due index timed them
    retried: bool = False


@dataclass
class WorkReport:
    sessions: int = 0
    #: sessions not connected (or not ready): nothing to post
    skipped: int = 0
    frames: int = 0
    failed_records: int = 0


class PushWorker:
    """The pusher function's work: a batch of push-queue messages posted."""

    def __init__(
        self,
        connections: ConnectionStore,
        api: Connections,
        delivery: DeliveryService,
        queue: PushQueue | None = None,
        clock: Clock | None = None,
        *,
        parallelism: int = DEFAULT_PUSH_PARALLELISM,
    ) -> None:
        self.connections = connections
        self.api = api
        self.delivery = delivery
        self.queue = queue
        self.clock = clock or SystemClock()
        #: the threads that push ``PushSettings.parallelism`` sessions at once, kept
        self.pools = Pools(parallelism, "shoal-push")
        #: the members this batch's gets handed group streams to: pushed by their own work
        self.hand_offs = HandOffs(queue)
        self.hand_offs.watch(getattr(delivery, "groups", None))
        #: the report of the batch that finished last, whole: set once its batch is done, as
        #: ``shoal dev`` runs batches side by side on one worker (tests and benches read it)
        self.last = WorkReport()

    # -- the function's event

    def handle(self, event: Mapping[str, Any]) -> dict[str, Any]:
        """An SQS batch (Lambda's event), answered with the records to return to the queue:
        those whose push failed, and every later one of the same message group (FIFO: a
        group's later message must not run before an earlier one succeeded)."""
        records = list(event.get("Records") or [])
        works: list[PushWork | None] = []
        retried = {n for n, record in enumerate(records) if _received(record) > 1}
        for record in records:
            try:
                work = PushWork.parse(str(record.get("body") or ""))
                if _received(record) > 1 and work.direct:
                    # a record back from a failed push: its QoS 0 frames may have gone out
                    # then, and QoS 0 is at most once (MQTT 5 §4.3.1): not posted again
                    work = replace(work, direct={})
                works.append(work)
            except (ValueError, KeyError, TypeError):
                # a body no worker can read would only come back: dropped, and counted
                logger.error("unreadable push work dropped", extra={"id": record.get("messageId")})
                count(metrics.PUSH_FAILED)
                works.append(None)
        failed = self.work(works, retried)
        returned = _fifo_failures(records, failed)
        if returned:
            self._delay(records, returned)
        return {
            "batchItemFailures": [{"itemIdentifier": records[n]["messageId"]} for n in returned]
        }

    def _delay(self, records: list[Mapping[str, Any]], returned: list[int]) -> None:
        """Returned records become visible after a jittered delay growing with their receive
        count, not after the queue's visibility timeout (minutes): best effort."""
        if self.queue is None:
            return
        entries = []
        for n in returned:
            received = _received(records[n])
            delay = round(backoff_s(received, 1.0, MAX_RETRY_DELAY_S))
            entries.append(
                {
                    "Id": str(n),
                    "ReceiptHandle": records[n]["receiptHandle"],
                    "VisibilityTimeout": delay,
                }
            )
        try:
            for start in range(0, len(entries), 10):
                self.queue.sqs.change_message_visibility_batch(
                    QueueUrl=self.queue.url, Entries=entries[start : start + 10]
                )
        except (ClientError, BotoCoreError) as exc:
            logger.info("push retry delay not set", extra={"error_type": type(exc).__name__})

    # -- the work

    def work(self, works: list[PushWork | None], retried: Collection[int] = ()) -> set[int]:
        """Pushes the sessions of ``works`` (the batch's records, in order); the indexes of
        the records whose push failed (to be returned to the queue). ``retried``: the indexes
        of the records the queue gave out before (``_Push.retried``)."""
        report = WorkReport()
        self.hand_offs.begin()
        pushes = _plan(works)
        for push in pushes.values():
            push.retried = any(n in retried for n in push.records)
        report.sessions = len(pushes)
        if not pushes:
            self.last = report
            return set()
        targets = _carried(works, pushes.keys())
        unread = [s for s in pushes if s not in targets]
        if unread:
            targets |= {c.session_id: c for c in self.connections.targets(unread)}
        ready = []
        for push in pushes.values():
            push.connection = targets.get(push.session_id)
            if push.connection is not None and push.connection.ready:
                ready.append(push)
        report.skipped = len(pushes) - len(ready)
        self._close_stranded(
            [p.connection for p in pushes.values() if p.connection and not p.connection.ready]
        )
        if ready:
            reads = self._read(ready)
            for push in ready:
                push.read = reads.get(push.session_id)
            self._push(ready)
        failed = {n for push in ready if push.failed is not None for n in push.records}
        report.frames = sum(p.posted + p.posted_direct for p in ready)
        report.failed_records = len(failed)
        # the members these gets handed group streams to: their own pushes
        self.hand_offs.flush()
        self.last = report
        return failed

    def _close_stranded(self, connections: list[Connection]) -> None:
        """Closes the connections not ready past ``READY_BOUND_MS`` (best effort: the next
        push tries again); their ``$disconnect`` ends the channel as any close does."""
        now = self.clock.now_ms()
        for connection in connections:
            if now - connection.connected_at_ms < READY_BOUND_MS:
                continue
            logger.warning("connection never marked ready: closed")
            try:
                self.api.close(connection.connection_id)
            except (ClientError, BotoCoreError) as exc:
                logger.info("close failed", extra={"error_type": type(exc).__name__})

    def _push(self, pushes: list[_Push]) -> None:
        batch = self._event_batch()
        # the first gets side by side, their events appended together before any frame goes
        self._each(lambda p: self._open(p, batch), pushes)
        if batch is not None:
            try:
                batch.flush()
            except (ClientError, BotoCoreError) as exc:
                # a delivery the log does not name is never posted (the audit counts what the
                # events say went out): made due again, and the chunk retried
                for push in pushes:
                    if push.failed is None and push.handed:
                        push.failed = exc
                        push.unposted = _ordinals(push.session_id, push.handed)
        # the due index before any frame: a worker that dies while posting leaves what it
        # handed out timed, so the sweep sends it again after its ack timeout (one due list
        # for the batch's sessions, one write). A retried record's sessions with deliveries in
        # flight too: the attempt before may have died between its get's state write and
        # this arm (or its get failed after that write), and its retry hands nothing out again
        # before their ack timeout, so nothing else would time them
        self._arm([p for p in pushes if any(m["qos"] > 0 for m in p.handed) or _in_flight(p)])
        self._each(self._post_and_go_on, pushes)
        # a later round's QoS 1/2 of a session not armed yet (or a group's not in its list)
        self._arm([p for p in pushes if p.acked_later or p.grouped])
        self._recheck([p for p in pushes if p.held and p.connection is not None])
        for push in pushes:
            self._settle(push)

    def _each(self, step: Callable[[_Push], None], pushes: list[_Push]) -> None:
        # at parallelism 1 one thread takes them in order while this one waits
        self.pools.each(step, pushes)

    def _open(self, push: _Push, batch: EventBatch | None) -> None:
        """A push's first get, its events to ``batch``."""
        overtaken = self._overtaken(push) + self._gated(push)
        push.got_at_ms = self.clock.now_ms()
        try:
            push.handed = self._get(push, push.source, push.read, batch, given=push.given)
        except (ShoalError, ClientError, BotoCoreError) as exc:
            self._stopped(push, exc)
        push.grouped |= _grouped(push.session_id, push.handed)
        overtaken += self._behind_window(push)
        if (push.direct or overtaken) and batch is not None:
            # the QoS 0 frames' events, appended with the gets' before any frame goes
            events = batch.recording.new()
            frames = [q.frame for q in push.direct]
            record_answers(events, "session", push.session_id, frames, label=_label(push))
            for frame in overtaken:
                events.add(
                    "dropped",
                    "session",
                    push.session_id,
                    message_id=frame["message_id"],
                    topic=frame["topic"],
                    published_at=frame["published_at"],
                    qos=0,
                    reason="overtaken",
                    label=_label(push),
                )
            first = (frames or overtaken)[0]["message_id"]
            batch.add(events, f"qos0/{push.session_id}/{first}")

    def _post_and_go_on(self, push: _Push) -> None:
        """Posts what the first get handed out, then gets and posts more while a page came
        full (the rest waits in the inbox) or while another record named the session."""
        if push.connection is None:
            return
        if push.failed is not None:
            # the QoS 0 frames too: posted before what the retry sends, they could overtake it
            return
        messages = push.handed
        rounds = 0
        #: frames posted before this round's
        before = push.posted
        try:
            while True:
                before = push.posted
                page = len(messages)
                messages = self._not_acked_since(push, messages)
                self._post_in_order(push, messages)
                rounds += 1
                more = page == MAX_GET or (rounds == 1 and len(push.records) > 1)
                if not more or rounds >= MAX_ROUNDS:
                    break
                # a second get looks in every source: what else waits, wherever it is
                push.got_at_ms = self.clock.now_ms()
                messages = self._get(push, None, None, None)
                push.grouped |= _grouped(push.session_id, messages)
            # the QoS 0 frames after everything handed out: their messages are the latest
            # (but for what a later round's full window left waiting)
            self._behind_window(push)
            self._post_direct(push, len(push.direct))
        except ConnectionGone:
            count(metrics.PUSH_FAILED)
            # no more pushes to it; its own item stays for its $disconnect, which loses the
            # channel (the will's delay starts there)
            if self.connections.forget(push.connection):
                # a renewal moved the session on meanwhile: what this push handed out stays in
                # flight for the same channel, and comes again after its ack timeout
                self.connections.arm_session(push.session_id, self._due())
        except PostThrottled as exc:
            count(metrics.PUSH_FAILED)
            push.failed = exc
            push.unposted = _ordinals(push.session_id, messages[push.posted - before :])
        except (ShoalError, ClientError, BotoCoreError) as exc:
            self._stopped(push, exc)

    def _overtaken(self, push: _Push) -> list[dict[str, Any]]:
        """Takes out of ``push.direct`` the QoS 0 frames a later delivery of their source went
        out before (the session's cursor there is past them: an earlier push handed it out
        from the inbox); the frames taken. Posted now they would break the order of their
        ordering key; QoS 0 is at most once (MQTT 5 §4.3.1), so they are dropped."""
        if not push.direct:
            return []
        if push.read is not None:
            cursors = push.read.state.cursors
        else:
            # the batch read failed: the session's own read, before the get moves its cursors
            # (an earlier push may have handed a later message of the frames' keys out)
            try:
                cursors = self.delivery.inbox.state(push.session_id).cursors
            except (ShoalError, ClientError, BotoCoreError) as exc:
                # where the session stands is not known: posted, a frame could come after a
                # later message of its key
                logger.info(
                    "qos 0 frames of an unread session dropped",
                    extra={"error_type": type(exc).__name__},
                )
                unknown = [q.frame for q in push.direct]
                push.direct = []
                return unknown
        kept: list[_Qos0] = []
        late: list[dict[str, Any]] = []
        for q in push.direct:
            cursor = cursors.get(q.source or "")
            if cursor is not None and q.position is not None and q.position < cursor:
                late.append(q.frame)
            else:
                kept.append(q)
        push.direct = kept
        return late

    def _gated(self, push: _Push) -> list[dict[str, Any]]:
        """Takes out of ``push.direct`` the QoS 0 frames that would break the order of the
        drain across storage topics (``shoal.drain``); the frames taken. Dropped (at most
        once, MQTT 5 §4.3.1):
        - a frame of a storage topic the gate holds closed for the session: it has not been
          handed every message of the earlier storage topics yet, and the get holds this
          one's items back, so posted now it would pass earlier messages of its key. The
          router writes such deliveries as any while the earlier storage topics are not
          drained (``RouterDrain.settled``), so this takes only a frame for a session behind
          on them. A gate open stays open;
        - a frame of a storage topic the session has passed: the gate saw no inbox item of
          it left and let a later storage topic's messages out, so posted now it would come
          after later messages of its key (the soak's 30-minute run at 200 clients caught one
          13 s late, behind a push queue 66 s long)."""
        gate = self.delivery.drain
        gated = {q.stream for q in push.direct if q.stream is not None}
        if not gated or gate is None:
            return []
        state = push.read.state if push.read is not None else None
        closed: set[str] = set()
        for stream in gated:
            try:
                # no state read (the batch read failed): only the first storage topic is
                # known to be open, unless this container saw the session pass it
                opens = not gate.passed(push.session_id, state, stream) and (
                    gate.opens(push.session_id, state, stream)
                    if state is not None
                    else gate.first(stream)
                )
            except (ClientError, BotoCoreError):
                opens = False  # not known to be open either
            if not opens:
                closed.add(stream)
        if not closed:
            return []
        late = [q.frame for q in push.direct if q.stream in closed]
        push.direct = [q for q in push.direct if q.stream not in closed]
        logger.info("qos 0 frames held back by the drain dropped", extra={"n": len(late)})
        return late

    def _behind_window(self, push: _Push) -> list[dict[str, Any]]:
        """Takes out of ``push.direct`` the QoS 0 frames that would pass a message the
        session's full window holds back (``DeliveryService.get``'s ``waiting``): QoS 0 is
        not subject to the window (MQTT 5 §4.9), but posted now it would overtake an earlier
        message of its ordering key. Dropped (at most once); the frames taken. A frame of a
        source the get did not look at is dropped too when the window is full: whether a
        message of its source waits is not known."""
        if not push.direct or not push.waiting:
            return []
        kept: list[_Qos0] = []
        late: list[dict[str, Any]] = []
        for q in push.direct:
            held = push.waiting.get(q.source or "")
            looked = q.source == push.source
            if (held is not None and q.position is not None and q.position > held) or (
                held is None and not looked
            ):
                late.append(q.frame)
            else:
                kept.append(q)
        push.direct = kept
        if late:
            logger.info("qos 0 frames held back by a full window dropped", extra={"n": len(late)})
        return late

    def _not_acked_since(self, push: _Push, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``messages`` but the copies sent again (``dup``) that the session acked after this
        push handed them out: an ack written between the hand-out and the post would see its
        id come again after its answer. The soak's runs beside a lagging server had dozens,
        a copy posted up to 20 s after the ack's answer; one (run H, seed 11) was a shared
        group's held QoS 2 delivery, 29 s after. A strongly consistent read of the session's
        state, and one of the group items, only when such a copy goes out (after an ack
        timeout, or on a new connection); if one fails, its copies go out as before (the
        client acks them again, unprocessed). A late post (``LATE_POST_MS``) checks a shared
        group's first copies too."""
        again = [str(m.get("id", "")) for m in messages if m.get("dup")]
        ordinals = {i: o for i in again if (o := ordinal_of(push.session_id, i)) is not None}
        grouped = [i for i in again if i not in ordinals]
        if self.clock.now_ms() - push.got_at_ms > LATE_POST_MS:
            # a late post: a group's first copies too (``LATE_POST_MS``)
            grouped = sorted(_grouped(push.session_id, messages) | set(grouped))
        acked: set[str] = set()
        if ordinals:
            with suppress(ShoalError, ClientError, BotoCoreError):
                state = self.delivery.inbox.state(push.session_id)
                acked |= {i for i, o in ordinals.items() if state.done(o)}
        groups = self.delivery.groups
        if grouped and groups is not None:
            with suppress(ShoalError, ClientError, BotoCoreError):
                done = groups.acked_since_by_member({push.session_id: grouped})
                acked |= done.get(push.session_id, set())
        return [m for m in messages if str(m.get("id")) not in acked] if acked else messages

    def _post_in_order(self, push: _Push, messages: list[dict[str, Any]]) -> None:
        """Posts ``messages``, each after the QoS 0 frames whose messages come before it in
        its source. Those are taken from anywhere in ``push.direct`` (in their order): a push
        of several records holds frames of several sources in record order, and a frame of
        another source ahead of them must not keep them back (the soak at 200 clients, seed
        11, saw a QoS 0 frame posted after a later QoS 1 message of its key so). A frame of an
        earlier storage topic goes before any message of a later one (``_Qos0.before``)."""
        gate = self.delivery.drain
        for message in messages:
            at = push.positions.get(str(message.get("id")))
            ahead: list[_Qos0] = []
            rest: list[_Qos0] = []
            for q in push.direct:
                (ahead if q.before(at, gate) else rest).append(q)
            push.direct = ahead + rest
            self._post_direct(push, len(ahead))
            self._post(push, [message])

    def _post_direct(self, push: _Push, n: int) -> None:
        """Posts the first ``n`` QoS 0 frames: written nowhere, posted and forgotten (at most
        once: a failed post is not tried again)."""
        if n <= 0:
            return
        frames, push.direct = push.direct[:n], push.direct[n:]
        assert push.connection is not None
        posted = 0
        for q in frames:
            try:
                self.api.post(push.connection.connection_id, encode(MessageFrame(**q.frame)))
            except (PostThrottled, ClientError, BotoCoreError) as exc:
                logger.info("qos 0 push lost", extra={"error_type": type(exc).__name__})
                count(metrics.PUSH_FAILED)
                continue
            posted += 1
        push.posted_direct += posted
        count(metrics.PUSHED, posted)

    def _post(self, push: _Push, messages: list[dict[str, Any]]) -> None:
        assert push.connection is not None
        for message in messages:
            self.api.post(push.connection.connection_id, encode(MessageFrame(**message)))
            push.posted += 1
            push.acked_later = push.acked_later or message["qos"] > 0
        count(metrics.PUSHED, len(messages))

    def _arm(self, pushes: list[_Push]) -> None:
        """The due index armed for what waits for an ack: one list of the sessions (the sweep
        goes on from deadline to deadline). Best effort: a lost arm leaves them to the next
        push or a reconnect."""
        sessions = [
            p
            for p in pushes
            if p.connection is not None and (not p.armed or p.grouped - p.armed_grouped)
        ]
        if not sessions:
            return
        grouped = {p.session_id: sorted(p.grouped - p.armed_grouped) for p in sessions}
        try:
            self.connections.arm_sessions(
                (p.session_id for p in sessions), self._due(), grouped=grouped
            )
        except (ClientError, BotoCoreError) as exc:
            logger.info("push arm failed", extra={"error_type": type(exc).__name__})
            return
        for push in sessions:
            push.armed = True
            push.armed_grouped |= push.grouped

    def _recheck(self, pushes: list[_Push]) -> None:
        """Sessions whose gets found items the drain's gate holds (a later storage topic
        while an earlier one drains: ``shoal.drain``) are pushed again by the sweep after
        ``DRAIN_RECHECK_MS``: nothing else would push them once the gate opens, when no
        other message comes to them. One due list for the batch; best effort (the next push
        or a reconnect sends them too)."""
        if not pushes:
            return
        try:
            self.connections.arm_sessions(
                (p.session_id for p in pushes),
                self.clock.now_ms() + DRAIN_RECHECK_MS,
                held=True,
            )
        except (ClientError, BotoCoreError) as exc:
            logger.info("push recheck not armed", extra={"error_type": type(exc).__name__})

    def _settle(self, push: _Push) -> None:
        """After a push: what a failed push handed out and did not post made due again for
        the chunk's retry."""
        if push.connection is None or not push.unposted:
            return
        try:
            self.delivery.unsend(push.session_id, push.unposted)
        except (ShoalError, ClientError, BotoCoreError) as exc:
            logger.warning("push unsend failed", extra={"error_type": type(exc).__name__})
            if push.failed is None:
                push.failed = exc

    def _stopped(self, push: _Push, exc: Exception) -> None:
        """A get or post that raised: a channel taken over or gone pushes nothing more (the
        newer connection pushes for itself); what a retry can mend (contention, throttling)
        returns the chunk to the queue."""
        count(metrics.PUSH_FAILED)
        code = (
            exc.code
            if isinstance(exc, ShoalError)
            else error_code(exc)
            if isinstance(exc, ClientError)
            else None
        )
        expected = isinstance(exc, ShoalError) and not isinstance(exc, ServerBusy)
        # a channel taken over while its push waited is the ordinary race of a reconnect (the
        # 2-hour soak logged 286 in 54 minutes, after its kills): not a warning
        (logger.info if expected else logger.warning)(
            "push stopped", extra={"error_type": type(exc).__name__, "code": code}
        )
        if isinstance(exc, ServerBusy) or not isinstance(exc, ShoalError):
            push.failed = exc

    def _due(self) -> int:
        return self.clock.now_ms() + int(self.delivery.settings.ack_timeout_s * 1000)

    def _event_batch(self) -> EventBatch | None:
        recording = self.delivery.events
        return EventBatch(recording) if recording is not None and recording.enabled else None

    def _read(self, pushes: list[_Push]) -> dict[str, SessionRead]:
        """The sessions' heads and states in one batch read, or nothing when it failed: each
        get then reads its own, as it would without this."""
        try:
            return self.delivery.read_sessions(
                (p.connection.client_id, p.session_id) for p in pushes if p.connection
            )
        except (ShoalError, ClientError, BotoCoreError) as exc:
            logger.info("push read failed", extra={"error_type": type(exc).__name__})
            return {}

    def _get(
        self,
        push: _Push,
        source: str | None,
        read: SessionRead | None,
        events: EventBatch | None,
        *,
        given: Given | None = None,
    ) -> list[dict[str, Any]]:
        connection = push.connection
        assert connection is not None
        who = Principal(sub=connection.sub, clients=(connection.client_id,))
        messages: list[dict[str, Any]] = self.delivery.get(
            who,
            connection.client_id,
            connection.channel,
            max_messages=MAX_GET,
            window=connection.window,
            lines=push.lines,
            source=source,
            known=read,
            events=events,
            given=given,
            positions=push.positions,
            waiting=push.waiting,
            held=push.held,
        )["messages"]
        return messages


def _plan(works: list[PushWork | None]) -> dict[str, _Push]:
    """The batch's sessions, each with the records naming it (in order), where its first get
    looks (the first record's source: another source, or none, looks everywhere) and the
    archive lines the records carry."""
    pushes: dict[str, _Push] = {}
    for n, work in enumerate(works):
        if work is None:
            continue
        for session_id in work.sessions:
            push = pushes.get(session_id)
            if push is None:
                pushes[session_id] = _Push(session_id, [n], work.source, dict(work.lines))
                continue
            push.records.append(n)
            if push.source != work.source:
                push.source = None
            push.lines.update(work.lines)
        for session_id, frames in work.direct.items():
            if session_id in pushes:
                pushes[session_id].direct.extend(
                    _Qos0(
                        {k: v for k, v in f.items() if k != "position"},
                        work.source,
                        f.get("position"),
                        work.stream,
                    )
                    for f in frames
                )
        for session_id, given in work.given.items():
            push = pushes.get(session_id)
            # only a push of one record: two records of one session follow each other
            if push is not None and push.records == [n]:
                push.given = given
    return pushes


def _carried(works: list[PushWork | None], sessions: Collection[str]) -> dict[str, Connection]:
    """The connections the router read for the batch's sessions after its writes, where every
    record naming the session carries one (the latest): a record without one (a reconnect's
    own push, a group's hand-off) may follow a newer connection, which the worker reads."""
    carried: dict[str, Connection] = {}
    unknown: set[str] = set()
    for work in works:
        if work is None:
            continue
        for session_id in work.sessions:
            found = work.connections.get(session_id)
            if found is None:
                unknown.add(session_id)
            else:
                carried[session_id] = found
    return {s: c for s, c in carried.items() if s in sessions and s not in unknown}


def _received(record: Mapping[str, Any]) -> int:
    """How many times the queue gave ``record`` out (1: the first)."""
    return int((record.get("attributes") or {}).get("ApproximateReceiveCount", 1))


def _in_flight(push: _Push) -> bool:
    """Whether a retried push's session may have deliveries in flight that no due list
    times (its state unread: it may)."""
    return push.retried and (push.read is None or bool(push.read.state.runs))


def _grouped(session_id: str, messages: Iterable[Mapping[str, Any]]) -> set[str]:
    """The ids of the shared groups' QoS 1/2 deliveries among ``messages`` (not the session's
    own ordinals): they wait for an ack too, timed by their group's stream."""
    return {
        str(m.get("id"))
        for m in messages
        if m.get("qos", 0) > 0 and ordinal_of(session_id, str(m.get("id", ""))) is None
    }


def _label(push: _Push) -> str | None:
    return push.connection.client_id if push.connection is not None else None


def _ordinals(session_id: str, messages: Iterable[Mapping[str, Any]]) -> set[int]:
    """The session's own ordinals among delivered messages (a group's ``g-`` ids are their
    lanes', which redeliver on their own)."""
    found = (ordinal_of(session_id, str(m.get("id", ""))) for m in messages)
    return {o for o in found if o is not None}


def _fifo_failures(records: list[Mapping[str, Any]], failed: set[int]) -> list[int]:
    """The records to return: the failed ones, and every later record of a group one failed
    in (Lambda's rule for a FIFO queue's partial batch response)."""
    stopped: set[str] = set()
    out: list[int] = []
    for n, record in enumerate(records):
        group = str((record.get("attributes") or {}).get("MessageGroupId", ""))
        if n in failed or group in stopped:
            stopped.add(group)
            out.append(n)
    return out
