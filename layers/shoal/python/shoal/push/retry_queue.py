"""The RQ consumer: a retry queue's batch, for the subscription the queue's stream names.

Waiting for an attempt time
---------------------------
An RQ entry before its attempt time *holds* its key: the key's later entries wait, other keys
of the batch go on. The invocation then sleeps until the earliest held key is due, at most
``MAX_HOLD_S`` and never past its own deadline, and resumes the keys that came due. Keys still
held are given back to the mapping (a batch item failure for the lowest held record). The
mappings retry without limit (``MaximumRetryAttempts`` -1, so attempts are counted here, in
the key state, never by Lambda) and re-invoke at once: the bounded sleep is what paces them,
so a held key costs an invocation per ``MAX_HOLD_S``, not a busy loop, and never blocks its
shard for longer than its own backoff (bounded by ``max_backoff_s``). With parallelism above 1
the RQ mapping's lanes split keys by partition key (the ordering key), so a held key holds only
the keys of its own lane.
"""

from __future__ import annotations

from dataclasses import dataclass

from shoal.core import metrics
from shoal.core.errors import ServerBusy
from shoal.core.observability import count, logger
from shoal.push.consumer import MAX_CONFLICTS, Budget, Consumer, InRecord, KeyWork
from shoal.push.decisions import Outcome, RetryAction, decide_retry, judge
from shoal.push.endpoint import DeliveryResult
from shoal.push.entries import BLOCKED, REPLAYED, Entry, Source, decode_entry
from shoal.push.model import DLQ, RQ, PushSubscription
from shoal.push.state import EntryReservation, KeyState, RetryHead
from shoal.push.store import INFRASTRUCTURE_ERRORS
from shoal.records import MalformedRecord

#: a key whose missing entry cannot be repaired is looked at again after this long
GAP_WAIT_MS = 1_000


@dataclass(frozen=True)
class QueueItem:
    record: int
    entry: Entry
    source: Source


class RetryQueueConsumer(Consumer):
    """Delivers retry queue batches; see the module docstring."""

    def consume_retry(
        self,
        name: str,
        incarnation: str,
        stream: str,
        records: list[InRecord],
        budget: Budget,
    ) -> int | None:
        try:
            sub = self.subscriptions.load(name)
        except INFRASTRUCTURE_ERRORS:
            return 0
        if sub is None or sub.spec.incarnation != incarnation or not sub.active:
            # an earlier subscription's queue, or one being deleted: nothing to deliver to
            return None
        works: dict[str, KeyWork] = {}
        for record in records:
            try:
                entry = decode_entry(record.data)
            except MalformedRecord:
                logger.warning(
                    "malformed retry queue record",
                    extra={"subscription": name, "sequence_number": record.sequence_number},
                )
                continue
            work = works.setdefault(entry.ordering_key, KeyWork(entry.ordering_key))
            source = Source(stream, record.shard, record.sequence_number, 0, "queue")
            work.items.append(QueueItem(record.index, entry, source))
        if not works:
            return None
        try:
            states = self.key_states.get_many(name, works)
        except INFRASTRUCTURE_ERRORS:
            return 0
        for key, work in works.items():
            work.state = states[key]

        def step(w: KeyWork) -> None:
            self._retry_step(sub, w, budget)

        every = list(works.values())
        self._run(every, step, sub.parallelism)
        while True:
            held = [w for w in every if w.held_until is not None and not w.failed]
            if not held:
                break
            now = self.clock.now_ms()
            wake = min(w.held_until or now for w in held)
            if wake > now:
                # working the other keys may already have taken us past a key's time
                if now >= budget.hold_until_ms:
                    break
                self.clock.sleep((min(wake, budget.hold_until_ms) - now) / 1000)
                now = self.clock.now_ms()
            todo = [w for w in held if (w.held_until or 0) <= now]
            if not todo:
                break
            try:
                fresh = self.key_states.get_many(name, [w.ordering_key for w in todo])
            except INFRASTRUCTURE_ERRORS:
                break
            for w in todo:
                w.state = fresh[w.ordering_key]
                w.held_until = None
            self._run(todo, step, sub.parallelism)
        return min((s for w in works.values() if (s := w.stopped_at) is not None), default=None)

    def _retry_step(self, sub: PushSubscription, work: KeyWork, budget: Budget) -> None:
        while work.position < len(work.items):
            item: QueueItem = work.items[work.position]
            try:
                state, due = self._retry_one(
                    sub, work.ordering_key, item.entry, item.source, state=work.state, budget=budget
                )
            except INFRASTRUCTURE_ERRORS as exc:
                logger.warning(
                    "push retry stopped",
                    extra={"subscription": sub.name, "error": type(exc).__name__},
                )
                work.failed = True
                return
            work.state = state
            if due is not None:
                work.held_until = due
                return
            work.position += 1
        work.held_until = None

    def _retry_one(
        self,
        sub: PushSubscription,
        key: str,
        entry: Entry,
        source: Source,
        *,
        state: KeyState,
        budget: Budget,
        repairing: bool = False,
    ) -> tuple[KeyState, int | None]:
        """Take one RQ entry; returns the state and, if the key must wait, until when."""
        policy = sub.spec.retry
        results: dict[int, DeliveryResult] = {}
        for _ in range(MAX_CONFLICTS):
            now = self.clock.now_ms()
            decision = decide_retry(
                state,
                entry,
                policy=policy,
                skip_before_ms=sub.skip_before_ms,
                ordered=sub.spec.ordered,
                now_ms=now,
            )
            action = decision.action
            moved: EntryReservation | None = None
            wait: int | None = None
            if action is RetryAction.STALE:
                return state, None
            if action is RetryAction.REPUT:
                self._put(sub, state.reserved("rq")[-1].entry(entry.message))
                return state, None
            if action is RetryAction.GAP:
                if repairing:
                    return state, now + GAP_WAIT_MS
                state, wait = self._repair(sub, key, entry, state, budget)
                if wait is not None:
                    return state, wait
                continue
            if action is RetryAction.WAIT:
                return state, decision.due_ms
            if action is RetryAction.SKIP:
                new = state.consume(RQ, entry.n, entry.main)
            elif action is RetryAction.FOLLOW_DLQ:
                new, moved = self._move(
                    state, entry, source, attempts=decision.attempts, reason=BLOCKED, status=None
                )
            elif action is RetryAction.EXHAUSTED:
                head = state.head
                reason, status = (head.reason, head.status) if head else (entry.reason, None)
                new, moved = self._move(
                    state, entry, source, attempts=decision.attempts, reason=reason, status=status
                )
            else:
                if now >= budget.deadline_ms:
                    raise ServerBusy("no time left in this invocation")
                attempt = decision.attempts + 1
                result = results.get(attempt)
                if result is None:
                    result = results[attempt] = self._deliver(sub, entry.message, attempt)
                    if attempt == 1 and entry.reason == REPLAYED:
                        # an archived message sent again on request (``shoal.push.replay``)
                        count(metrics.REPLAYED)
                outcome = judge(result, policy, attempt)
                if outcome is Outcome.DONE:
                    new = state.consume(RQ, entry.n, entry.main)
                elif outcome is Outcome.RETRY:
                    wait = now + policy.backoff_ms(attempt, entry.message.message_id)
                    new = state.retry_later(
                        RetryHead(entry.n, attempt, wait, result.reason, result.status)
                    )
                else:
                    new, moved = self._move(
                        state,
                        entry,
                        source,
                        attempts=attempt,
                        reason=result.reason,
                        status=result.status,
                    )
            saved = self.key_states.save(sub.name, key, new)
            if saved is None:
                state = self.key_states.get(sub.name, key)
                continue
            if moved is not None:
                self._put(sub, moved.entry(entry.message))
            return saved, wait
        raise ServerBusy("the key's group state kept changing")

    def _repair(
        self, sub: PushSubscription, key: str, entry: Entry, state: KeyState, budget: Budget
    ) -> tuple[KeyState, int | None]:
        """Take the key's entries before ``entry`` that never reached the stream (a producer
        died between its reservation and its put) from where their messages are."""
        for n in range(state.rq.c.n + 1, entry.n):
            reservation = state.reservation_for(RQ, n)
            message = (
                self.queues.read_message(reservation.source) if reservation is not None else None
            )
            if reservation is None or message is None:
                logger.error(
                    "retry queue entry missing and not repairable",
                    extra={"subscription": sub.name, "offset": n},
                )
                return state, self.clock.now_ms() + GAP_WAIT_MS
            state, wait = self._retry_one(
                sub,
                key,
                reservation.entry(message),
                reservation.source,
                state=state,
                budget=budget,
                repairing=True,
            )
            if wait is not None:
                return state, wait
        return state, None

    def _move(
        self,
        state: KeyState,
        entry: Entry,
        source: Source,
        *,
        attempts: int,
        reason: str | None,
        status: int | None,
    ) -> tuple[KeyState, EntryReservation]:
        """Consume the RQ entry and reserve it in DLQ, in one write."""
        consumed = state.consume(RQ, entry.n, entry.main)
        reservation = self._reservation(
            consumed,
            DLQ,
            entry.message,
            entry.main,
            source,
            attempts=attempts,
            due_ms=0,
            reason=reason,
            status=status,
            origin_n=entry.n,
        )
        return consumed.reserve("rq", [reservation]), reservation
