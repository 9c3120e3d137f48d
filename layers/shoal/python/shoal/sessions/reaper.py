"""The reaper's sessions work, run on a schedule and by due timers: keepalive expiry (the will
armed or published), wills after their delay (or due at once: a takeover or a session's end
wrote them so), and session expiry."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from shoal.core.clock import Clock, SystemClock
from shoal.core.errors import (
    ShoalError,
)
from shoal.core.observability import logger
from shoal.sessions.model import (
    DUE_SHARDS,
    HEAD,
    WILL_PREFIX,
    WILL_RETRY_MS,
    Head,
    ReapAction,
    reap_action,
)
from shoal.sessions.ports import DueTimer, SessionEndHook, WillPublisher, call_end_hook
from shoal.sessions.repository import SessionRepository
from shoal.sessions.timers import Timer, arm_timer

#: reads of a head a timer came for, when a request of its channel raced the move of its due
#: time (a busy channel writes its last-seen time at most twice a keepalive)
RESCHEDULE_ATTEMPTS = 3


@dataclass
class ReapReport:
    channels_expired: int = 0
    wills_published: int = 0
    wills_dropped: int = 0
    #: wills held for a taken-over channel's close that never came (``HELD_WILL_BOUND_MS``)
    wills_withheld: int = 0
    sessions_ended: int = 0
    rescheduled: int = 0
    contended: int = 0
    failed: int = 0
    #: timers that came before their item was due, armed again for the rest
    rearmed: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


class Reaper:
    """Keepalive expiry, wills after their delay, and session expiry; run on a schedule, and
    on an item when its due timer comes (``on_timers``).

    Every step is a conditional write on what it read, so overlapping runs, duplicate timers
    and racing connects cannot double a step or undo a newer one. A will is claimed before it
    is published and deleted after, so a run that dies in between publishes it again later
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
        timer: DueTimer | None = None,
    ) -> None:
        self.repository = repository
        self.publisher = publisher
        self.clock = clock or SystemClock()
        self.limit_per_shard = limit_per_shard
        self.on_session_end = on_session_end
        #: a dead channel's shared groups advance: its expired leases move to live members
        self.on_channel_expired = on_channel_expired
        #: arms the will an expired channel leaves waiting, and a timer that came early
        #: (``shoal.sessions.timers``); None: the schedule alone
        self.timer = timer

    def run(self) -> ReapReport:
        report = ReapReport()
        now = self.clock.now_ms()
        for shard in range(DUE_SHARDS):
            for client_id, item in self.repository.due(str(shard), now, self.limit_per_shard):
                try:
                    self._reap(client_id, item, now, report)
                except Exception as exc:
                    # one client's failure must not stop the others; its item stays due
                    logger.exception("reaping failed", extra={"error_type": type(exc).__name__})
                    report.failed += 1
        return report

    def on_timers(self, event: Mapping[str, Any]) -> dict[str, Any]:
        """The wills queue's timers (Lambda's SQS event): each item reaped as ``run`` would
        reap it, now that it is due; a timer that came early is armed again for the rest.
        Answers the partial batch response: the timers whose step failed return to the queue
        (the item stays due in the index as well, for the schedule)."""
        report = ReapReport()
        failed: list[dict[str, str]] = []
        for record in event.get("Records") or []:
            try:
                timer = Timer.parse(str(record.get("body") or ""))
            except ValueError:
                # it could only come back: dropped (the schedule reaps whatever it named)
                logger.error("unreadable due timer dropped", extra={"id": record.get("messageId")})
                continue
            try:
                self.on_timer(timer, report)
            except Exception as exc:
                logger.exception("reaping failed", extra={"error_type": type(exc).__name__})
                report.failed += 1
                failed.append({"itemIdentifier": str(record["messageId"])})
        counts = report.as_dict()
        if any(counts.values()):
            logger.info("reaped on time", extra=counts)
        return {"batchItemFailures": failed}

    def on_timer(self, timer: Timer, report: ReapReport) -> None:
        """One timer: its item's step if it is due, else the timer armed again; raises when
        either failed (the timer returns to the queue)."""
        now = self.clock.now_ms()
        if timer.due_at_ms > now:
            # early: SQS delays 15 minutes at most, and the arming function's clock may be a
            # little ahead of this one's. Armed again, or raised: a timer is not dropped
            # before its item is due (it would find a step not due yet, and do nothing)
            if self.timer is None:
                raise RuntimeError("a timer came early and there is no timer to arm again")
            self.timer.arm(timer.client_id, timer.item, timer.due_at_ms)
            report.rearmed += 1
            return
        self._reap(timer.client_id, timer.item, now, report, timer.due_at_ms)

    def _reap(
        self, client_id: str, item: str, now: int, report: ReapReport, timer_due: int | None = None
    ) -> None:
        if item == HEAD:
            self._reap_head(client_id, now, report, timer_due)
        elif item.startswith(WILL_PREFIX):
            self._reap_will(client_id, item, now, report)

    def _reap_head(
        self, client_id: str, now: int, report: ReapReport, timer_due: int | None = None
    ) -> None:
        """``timer_due``: the due time of the timer that came for the head (None: the
        schedule's sweep found it)."""
        for _ in range(RESCHEDULE_ATTEMPTS):
            view = self.repository.read(client_id, consistent=True)
            head = view.head
            if head is None:
                return
            action, due = reap_action(head, now)
            if action is not ReapAction.RESCHEDULE:
                break
            if timer_due is not None and head.due_at_ms != timer_due:
                # a timer the head moved on from (an earlier connect's, or one whose chain
                # the schedule or another timer goes on with): the head's own timer comes
                return
            if head.due_at_ms == due:
                return
            if self.repository.set_due(client_id, head, due):
                report.rescheduled += 1
                self._chain(client_id, head, due, now)
                return
            if timer_due is None:
                return
            # a request of the channel moved its last-seen time meanwhile: read again, so the
            # chain is not dropped (the schedule would find the head only a minute late)
        else:
            return
        if action is ReapAction.EXPIRE_CHANNEL:
            will_due = None
            if head.will is not None:
                # MQTT 5: after the delay, or when the session ends, whichever comes first;
                # both counted from the close (§3.1.3.2.2): when the keepalive ran out, or
                # when API Gateway saw the connection go (a lost head's last-seen time), not
                # when this run got to it (a timer or $disconnect that came late)
                closed = min(now, head.last_seen_ms + head.grace_ms)
                will_due = closed + min(head.will.delay_s, head.session_expiry_s) * 1000
            if not self.repository.expire_channel(client_id, head, now, will_due):
                report.contended += 1
                return
            report.channels_expired += 1
            if head.subscriptions:
                call_end_hook(self.on_channel_expired, client_id, head)
            will = WILL_PREFIX + head.newest.key
            if will_due is not None and will_due <= now:
                self._reap_will(client_id, will, now, report)
            elif will_due is not None:
                # published after its delay by its timer, not by the first scheduled run after
                # it: a run is a minute apart, and a reconnect in between would cancel it
                arm_timer(self.timer, client_id, will, will_due, now)
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

    def _chain(self, client_id: str, head: Head, due: int | None, now: int) -> None:
        """The keepalive's timer goes on to the head's new deadline, for a live channel that
        leaves a will (an HTTP channel: a WebSocket connection's deadline is hours away, past
        ``TIMER_HORIZON_S``, and its loss arms its own timer): the channel expires, and its
        will is armed, when MQTT says (1.5 times the keepalive after the last request,
        [MQTT-3.1.2-22]), not at the schedule's next run. Whoever moves the head's due time
        arms the timer for it, and a timer acts only while the head's due time is its own
        (``_reap_head``), so one chain lives per head."""
        if due is not None and head.connected and head.will is not None:
            arm_timer(self.timer, client_id, HEAD, due, now)

    def _reap_will(self, client_id: str, item: str, now: int, report: ReapReport) -> None:
        will = self.repository.will(client_id, item)
        if will is None or will.due_at_ms > now:
            return
        if will.held_since_ms is not None:
            # held for a close that never came in time: its channel was live when a connect
            # resumed the session, and MQTT withholds the will ([MQTT-3.1.3-9])
            if self.repository.settle_held_will(client_id, will, None):
                report.wills_withheld += 1
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
