"""The push function's work: a push tap's batch (MQ) and a retry queue's batch (RQ).

A batch is taken key by key: one ordering key's messages strictly in order, different keys at
once, up to the subscription's ``parallelism`` (Powertools' BatchProcessor handles records one
by one and would go on past a failed record of a key; ordering needs the whole batch).
Lambda hands a batch back from the lowest failed record, so the answer names the lowest record
at which any key stopped. Records after it that other keys finished come again and are
recognized: by the subscription's cursor (MQ) or by the key's consumed offset (RQ).

Waiting for an attempt time
---------------------------
An RQ entry before its attempt time *holds* its key: the key's later entries wait, other keys
of the batch go on. The invocation then sleeps until the earliest held key is due, at most
``MAX_HOLD_S`` and never past its own deadline, and resumes the keys that came due. Keys still
held are given back to the mapping (a batch item failure for the lowest held record). The
mappings retry without limit (``MaximumRetryAttempts`` -1, so attempts are counted here, in
the group state, never by Lambda) and re-invoke at once: the bounded sleep is what paces them,
so a held key costs an invocation per ``MAX_HOLD_S``, not a busy loop, and never blocks its
shard for longer than its own backoff (bounded by ``max_backoff_s``). With parallelism above 1
the RQ mapping's lanes split keys by partition key (the ordering key), so a held key holds only
the keys of its own lane.

Seals
-----
A tap passes the ordered drain's seal of a shard (``shoal.drain``) for its members only when it
runs one lane: a seal has a partition key of its own, so with several lanes it reaches one lane
while another may still hold earlier records of other keys. A tap of several lanes gives its
batch back from the seal (paced as a hold) until the tap runs one lane, as every tap behind the
produce pointer is made to (``shoal.push_admin.tap_lanes``); the single lane then starts from
the shard's checkpoint, which no unfinished record is past, and reaches the seal only after
every record before it.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from aws_lambda_powertools.utilities.data_classes import KinesisStreamEvent

from shoal.core.clock import Clock, SystemClock
from shoal.core.config import Config
from shoal.core.errors import ServerBusy
from shoal.core.observability import logger
from shoal.delivery_events import EventKind, PerConsumer, Recording
from shoal.drain import RECHECK_MS, PushGate, push_consumer
from shoal.push.model import (
    BLOCKED,
    DLQ,
    MAX_HOLD_S,
    RQ,
    Deliverer,
    DeliveryResult,
    EndpointPolicy,
    Entry,
    GroupState,
    Head,
    HttpDeliverer,
    MainAction,
    Outcome,
    Queue,
    Reservation,
    RetryAction,
    Source,
    decide_main,
    decide_retry,
    decode_entry,
    delivery_request,
    judge,
    main_position,
)
from shoal.push.store import (
    CREATING,
    INFRASTRUCTURE_ERRORS,
    GroupStore,
    Queues,
    ShardCursor,
    Subscription,
    SubscriptionStore,
    Tap,
    parse_queue_stream,
    push_parts,
)
from shoal.records import MalformedRecord, Message, decode_record, is_seal
from shoal.topics.filters import matches

#: an invocation stops starting deliveries this long before Lambda would end it (a delivery
#: takes up to the connect and read timeouts, then two writes)
SAFETY_MS = 12_000
#: conditional writes tried again after a racing change before the record counts as failed
MAX_CONFLICTS = 10
#: a key whose missing entry cannot be repaired is looked at again after this long
GAP_WAIT_MS = 1_000
#: "never" for the ordered drain's start times
FOREVER_MS = 2**62


@dataclass(frozen=True)
class InRecord:
    index: int
    shard: str
    sequence_number: str
    arrival_ms: int
    data: bytes


def _lowest(*stops: int | None) -> int | None:
    return min((s for s in stops if s is not None), default=None)


def parse_event(event: dict[str, Any]) -> tuple[str, list[InRecord]]:
    """The stream name and the records of a Kinesis batch (one shard of one stream)."""
    records: list[InRecord] = []
    stream = ""
    for index, record in enumerate(KinesisStreamEvent(event).records):
        stream = record.event_source_arn.split("/", 1)[1]
        records.append(
            InRecord(
                index=index,
                shard=record.event_id.rsplit(":", 1)[0],
                sequence_number=record.kinesis.sequence_number,
                arrival_ms=int(record.kinesis.approximate_arrival_timestamp * 1000),
                data=record.kinesis.data_as_bytes(),
            )
        )
    return stream, records


@dataclass(frozen=True)
class Budget:
    #: no delivery starts after this
    deadline_ms: int
    #: no waiting for an attempt time beyond this
    hold_until_ms: int


@dataclass(frozen=True)
class MainItem:
    record: int
    message: Message
    main: str
    source: Source


@dataclass(frozen=True)
class QueueItem:
    record: int
    entry: Entry
    source: Source


@dataclass
class KeyWork:
    """One ordering key's part of a batch, worked in order."""

    ordering_key: str
    items: list[Any] = field(default_factory=list)
    state: GroupState = field(default_factory=GroupState)
    position: int = 0
    held_until: int | None = None
    failed: bool = False

    @property
    def stopped_at(self) -> int | None:
        """The record this key stopped at (failed or held), if it did not finish."""
        if self.position < len(self.items) and (self.failed or self.held_until is not None):
            return int(self.items[self.position].record)
        return None


class PushConsumer:
    """Delivers push tap batches and retry queue batches; see the module docstring."""

    def __init__(
        self,
        config: Config,
        subscriptions: SubscriptionStore,
        groups: GroupStore,
        queues: Queues,
        deliverer: Deliverer,
        *,
        clock: Clock | None = None,
        max_hold_s: float = MAX_HOLD_S,
        events: Recording | None = None,
        gate: PushGate | None = None,
    ) -> None:
        self.prefix = config.stream_prefix
        self.subscriptions = subscriptions
        self.groups = groups
        self.queues = queues
        self.deliverer = deliverer
        self.clock = clock or SystemClock()
        self.max_hold_s = max_hold_s
        #: delivery events (``shoal.delivery_events``); None records nothing
        self.events = events
        #: this invocation's recorders, per subscription (set on a per-invocation copy only)
        self._recorders: PerConsumer | None = None
        #: the ordered drain across storage topics (``shoal.drain``); None gates nothing
        self.gate = gate

    @classmethod
    def from_config(cls, config: Config, clock: Clock | None = None) -> PushConsumer:
        clock = clock or SystemClock()
        subscriptions, groups, queues = push_parts(config, clock)
        return cls(
            config,
            subscriptions,
            groups,
            queues,
            HttpDeliverer(EndpointPolicy.from_env(os.environ)),
            clock=clock,
            events=Recording.from_config(config, clock),
            gate=PushGate.from_config(config, clock),
        )

    # -- the entry point ------------------------------------------------------------------

    def handle(self, event: dict[str, Any], remaining_ms: int) -> dict[str, Any]:
        if self.events is not None and self.events.enabled and self._recorders is None:
            return self._recorded(event, remaining_ms)
        stream, records = parse_event(event)
        if not records:
            return {"batchItemFailures": []}
        now = self.clock.now_ms()
        deadline = now + max(remaining_ms - SAFETY_MS, 0)
        budget = Budget(deadline, min(now + int(self.max_hold_s * 1000), deadline))
        queue = parse_queue_stream(self.prefix, stream)
        if queue is None:
            failed = self.consume_main(stream, records, budget)
        elif queue[2] == RQ:
            failed = self.consume_retry(queue[0], queue[1], stream, records, budget)
        else:
            failed = None  # no mapping reads a DLQ; nothing to do if one did
        if failed is None:
            return {"batchItemFailures": []}
        return {"batchItemFailures": [{"itemIdentifier": records[failed].sequence_number}]}

    def _recorded(self, event: dict[str, Any], remaining_ms: int) -> dict[str, Any]:
        """``handle`` with delivery events: a copy of the consumer holds this invocation's
        recorders (invocations share the consumer); each subscription's events are one object,
        keyed by the batch (stream, shard, sequence range), written once the batch is done."""
        worker = copy.copy(self)
        recorders = worker._recorders = PerConsumer(self.events or Recording(None))
        answer = worker.handle(event, remaining_ms)
        stream, records = parse_event(event)
        if records:
            first, last = records[0], records[-1]
            batch = f"{stream}/{first.shard}/{first.sequence_number}-{last.sequence_number}"
            recorders.flush(lambda name: f"push/{name}/{batch}")
        return answer

    def _run(
        self, works: Sequence[KeyWork], step: Callable[[KeyWork], None], parallelism: int
    ) -> None:
        if parallelism <= 1 or len(works) <= 1:
            for work in works:
                step(work)
            return
        with ThreadPoolExecutor(min(parallelism, len(works))) as pool:
            list(pool.map(step, works))

    # -- MQ: a push tap's batch -------------------------------------------------------------

    def consume_main(self, stream: str, records: list[InRecord], budget: Budget) -> int | None:
        """Every member subscription of the stream's tap takes the batch; returns the lowest
        record index any of them stopped at."""
        try:
            tap = self.subscriptions.tap(stream)
            if tap is None or not tap.members:
                return None
            loaded = list(self.subscriptions.load_many(tap.members).values())
            subs = [s for s in loaded if s.active and stream in s.cursors]
        except INFRASTRUCTURE_ERRORS:
            logger.warning("push tap unreadable", extra={"stream": stream})
            return 0
        decoded = [self._decode(r) for r in records]
        # Only a single-lane tap passes a seal: another lane of the shard may still hold
        # earlier records of other keys. A tap behind the produce pointer is refitted to one
        # lane (shoal.push_admin.tap_lanes); until then the batch goes back from the seal, and
        # the members take the records before it as usual.
        unsealed = self._first_seal(records) if tap.lanes > 1 and self.gate is not None else None
        # a member still being created takes the seals too: it may be active before the tap
        # reads on (shoal.drain, push taps)
        creating = [s for s in loaded if s.state == CREATING and stream in s.cursors]
        unmarked = [self._pass_seals(s, stream, records, unsealed) for s in creating]

        def one(sub: Subscription) -> int | None:
            stop = self._main_for(sub, tap, stream, records, decoded, budget=budget)
            return self._pass_seals(sub, stream, records, _lowest(stop, unsealed))

        if len(subs) <= 1:
            stops = [one(s) for s in subs]
        else:
            with ThreadPoolExecutor(min(len(subs), 16)) as pool:
                stops = list(pool.map(one, subs))
        if unsealed is not None:
            self._hold_seal(stream, budget)
        return min((s for s in [*stops, *unmarked, unsealed] if s is not None), default=None)

    @staticmethod
    def _first_seal(records: list[InRecord]) -> int | None:
        return next((r.index for r in records if is_seal(r.data)), None)

    def _hold_seal(self, stream: str, budget: Budget) -> None:
        """Pace a seal given back by a tap of several lanes (the mapping retries at once):
        wait up to the hold budget, asking about once a second whether the tap runs one lane
        now (then the retry should come from that lane without delay)."""
        logger.warning(
            "push seal held: the tap still runs several lanes (a PATCH of any subscription of "
            "the topic refits it)",
            extra={"stream": stream},
        )
        while True:
            now = self.clock.now_ms()
            if now >= budget.hold_until_ms:
                return
            self.clock.sleep(min(RECHECK_MS, budget.hold_until_ms - now) / 1000)
            try:
                tap = self.subscriptions.tap(stream)
            except INFRASTRUCTURE_ERRORS:
                return
            if tap is None or tap.lanes <= 1:
                return

    def _decode(self, record: InRecord) -> list[Message]:
        try:
            return decode_record(record.data)
        except MalformedRecord:
            # the router archives malformed records as such; a push subscription has nothing
            # to deliver from one
            logger.warning(
                "malformed storage record", extra={"sequence_number": record.sequence_number}
            )
            return []

    def _main_for(
        self,
        sub: Subscription,
        tap: Tap,
        stream: str,
        records: list[InRecord],
        decoded: list[list[Message]],
        *,
        budget: Budget,
    ) -> int | None:
        cursor = sub.cursors[stream]
        works: dict[str, KeyWork] = {}
        admitted: list[InRecord] = []
        for record, messages in zip(records, decoded, strict=True):
            if not cursor.admits(record.shard, record.sequence_number, record.arrival_ms):
                continue
            admitted.append(record)
            for index, message in enumerate(messages):
                if not matches(sub.spec.filter, message.topic):
                    continue
                work = works.setdefault(message.ordering_key, KeyWork(message.ordering_key))
                work.items.append(
                    MainItem(
                        record=record.index,
                        message=message,
                        main=main_position(tap.storage_index, record.sequence_number, index),
                        source=Source(stream, record.shard, record.sequence_number, index),
                    )
                )
        if not admitted:
            return None
        if works and not self._drained(sub, tap, budget):
            return admitted[0].index
        try:
            states = self.groups.get_many(sub.name, works)
        except INFRASTRUCTURE_ERRORS:
            logger.warning("group states unreadable", extra={"subscription": sub.name})
            return admitted[0].index
        for key, work in works.items():
            work.state = states[key]
        self._run(list(works.values()), lambda w: self._main_step(sub, w, budget), sub.parallelism)
        stopped = min((s for w in works.values() if (s := w.stopped_at) is not None), default=None)
        if tap.lanes > 1:
            # Other lanes of this shard may hold earlier records: the shard cursor stays, each
            # key's progress is marked instead (shoal.push_store, push taps).
            self._run(list(works.values()), lambda w: self._mark(sub, w), sub.parallelism)
            return stopped
        done = [r for r in admitted if stopped is None or r.index < stopped]
        if done:
            last = done[-1]
            try:
                self.subscriptions.advance(
                    sub.name,
                    sub.generation,
                    stream,
                    last.shard,
                    ShardCursor(last.sequence_number, last.arrival_ms),
                )
            except INFRASTRUCTURE_ERRORS:
                # the records are done; a lagging cursor only makes a re-read skip less
                logger.warning("push cursor not moved", extra={"subscription": sub.name})
        return stopped

    def _drained(self, sub: Subscription, tap: Tap, budget: Budget) -> bool:
        """Whether the subscription may take the tap's storage topic yet (the ordered drain,
        ``shoal.drain.PushGate``): waits for it, asking about once a second, up to the hold
        budget. Held, the batch goes back to the mapping whole (it retries without limit)."""
        if self.gate is None or tap.storage_index == 0 or not sub.spec.ordered:
            return True
        consumer = push_consumer(sub.name, sub.spec.incarnation, sub.generation)

        def start_ms(earlier: str) -> int:
            cursor = sub.cursors.get(earlier)
            if cursor is None:
                return FOREVER_MS  # it reads nothing of that storage topic
            if sub.generation > 0:
                return cursor.from_ms  # a seek: the mapping reads again from there if earlier
            earlier_tap = self.subscriptions.tap(earlier)
            joined = earlier_tap.joined.get(sub.name, 0) if earlier_tap is not None else 0
            return max(cursor.from_ms, joined)

        while True:
            try:
                if self.gate.admits(consumer, tap.stream, start_ms):
                    return True
            except INFRASTRUCTURE_ERRORS:
                logger.warning("push drain unreadable", extra={"subscription": sub.name})
                return False
            now = self.clock.now_ms()
            if now >= budget.hold_until_ms:
                logger.info(
                    "push held for the drain",
                    extra={"subscription": sub.name, "stream": tap.stream},
                )
                return False
            self.clock.sleep(min(RECHECK_MS, budget.hold_until_ms - now) / 1000)

    def _pass_seals(
        self, sub: Subscription, stream: str, records: list[InRecord], stop: int | None
    ) -> int | None:
        """Record the seals the subscription passed in this batch (those before ``stop``), so
        later storage topics open for it; returns ``stop``, or the seal it could not record.
        A tap of several lanes passes none: ``consume_main`` stops it at the first seal."""
        if self.gate is None:
            return stop
        consumer = push_consumer(sub.name, sub.spec.incarnation, sub.generation)
        for record in records:
            if stop is not None and record.index >= stop:
                break
            if not is_seal(record.data):
                continue
            try:
                self.gate.store.mark_passed(stream, consumer, record.shard)
            except INFRASTRUCTURE_ERRORS:
                logger.warning("push seal not recorded", extra={"subscription": sub.name})
                return record.index
        return stop

    def _main_step(self, sub: Subscription, work: KeyWork, budget: Budget) -> None:
        while work.position < len(work.items):
            item: MainItem = work.items[work.position]
            if self.clock.now_ms() >= budget.deadline_ms:
                work.failed = True
                return
            try:
                work.state = self._main_one(sub, work.ordering_key, item, work.state)
            except INFRASTRUCTURE_ERRORS as exc:
                logger.warning(
                    "push delivery stopped",
                    extra={"subscription": sub.name, "error": type(exc).__name__},
                )
                work.failed = True
                return
            work.position += 1

    def _main_one(
        self, sub: Subscription, key: str, item: MainItem, state: GroupState
    ) -> GroupState:
        policy = sub.spec.retry
        result: DeliveryResult | None = None
        for _ in range(MAX_CONFLICTS):
            now = self.clock.now_ms()
            action = decide_main(
                state,
                main=item.main,
                message_id=item.message.message_id,
                generation=sub.generation,
                skip_before_ms=sub.skip_before_ms,
                ordered=sub.spec.ordered,
            )
            if action is MainAction.SKIP:
                return state
            if action is MainAction.REPUT:
                self._put(sub, state.reserved("mq")[-1].entry(item.message))
                return state
            if action is MainAction.DELIVER:
                if result is None:
                    result = self._deliver(sub, item.message, 1)
                outcome = judge(result, policy, 1)
                if outcome is Outcome.DONE:
                    return state
                retry = outcome is Outcome.RETRY
                reservation = self._reservation(
                    state,
                    RQ if retry else DLQ,
                    item.message,
                    item.main,
                    item.source,
                    attempts=1,
                    due_ms=now + policy.backoff_ms(1, item.message.message_id) if retry else now,
                    reason=result.reason,
                    status=result.status,
                )
            else:
                reservation = self._reservation(
                    state,
                    RQ if action is MainAction.FOLLOW_RQ else DLQ,
                    item.message,
                    item.main,
                    item.source,
                    attempts=0,
                    due_ms=now,
                    reason=BLOCKED,
                    status=None,
                )
            saved = self.groups.save(
                sub.name, key, state.reserve("mq", [reservation], generation=sub.generation)
            )
            if saved is None:
                state = self.groups.get(sub.name, key)
                continue
            self._put(sub, reservation.entry(item.message))
            return saved
        raise ServerBusy("the key's group state kept changing")

    def _mark(self, sub: Subscription, work: KeyWork) -> None:
        """Record how far the key got in this batch (a lane's replay then skips it)."""
        if work.position == 0:
            return
        main = work.items[work.position - 1].main
        state = work.state
        try:
            for _ in range(MAX_CONFLICTS):
                new = state.mark(main, sub.generation)
                if new is state:
                    return
                saved = self.groups.save(sub.name, work.ordering_key, new)
                if saved is not None:
                    work.state = saved
                    return
                state = self.groups.get(sub.name, work.ordering_key)
        except INFRASTRUCTURE_ERRORS:
            pass
        # the messages are done; a missing mark only makes a replay deliver them again
        logger.warning("push key mark not written", extra={"subscription": sub.name})

    # -- RQ: a retry queue's batch ----------------------------------------------------------

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
            states = self.groups.get_many(name, works)
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
                fresh = self.groups.get_many(name, [w.ordering_key for w in todo])
            except INFRASTRUCTURE_ERRORS:
                break
            for w in todo:
                w.state = fresh[w.ordering_key]
                w.held_until = None
            self._run(todo, step, sub.parallelism)
        return min((s for w in works.values() if (s := w.stopped_at) is not None), default=None)

    def _retry_step(self, sub: Subscription, work: KeyWork, budget: Budget) -> None:
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
        sub: Subscription,
        key: str,
        entry: Entry,
        source: Source,
        *,
        state: GroupState,
        budget: Budget,
        repairing: bool = False,
    ) -> tuple[GroupState, int | None]:
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
            moved: Reservation | None = None
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
                outcome = judge(result, policy, attempt)
                if outcome is Outcome.DONE:
                    new = state.consume(RQ, entry.n, entry.main)
                elif outcome is Outcome.RETRY:
                    wait = now + policy.backoff_ms(attempt, entry.message.message_id)
                    new = state.retry_later(
                        Head(entry.n, attempt, wait, result.reason, result.status)
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
            saved = self.groups.save(sub.name, key, new)
            if saved is None:
                state = self.groups.get(sub.name, key)
                continue
            if moved is not None:
                self._put(sub, moved.entry(entry.message))
            return saved, wait
        raise ServerBusy("the key's group state kept changing")

    def _repair(
        self, sub: Subscription, key: str, entry: Entry, state: GroupState, budget: Budget
    ) -> tuple[GroupState, int | None]:
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

    # -- shared ---------------------------------------------------------------------------

    def _reservation(
        self,
        state: GroupState,
        queue: Queue,
        message: Message,
        main: str,
        source: Source,
        *,
        attempts: int,
        due_ms: int,
        reason: str | None,
        status: int | None,
        origin_n: int = 0,
    ) -> Reservation:
        return Reservation(
            queue=queue,
            n=state.queue(queue).p.n + 1,
            message_id=message.message_id,
            main=main,
            source=source,
            attempts=attempts,
            due_ms=due_ms,
            reason=reason,
            status=status,
            at_ms=self.clock.now_ms(),
            published_at_ms=message.published_at_ms,
            origin_n=origin_n,
        )

    def _move(
        self,
        state: GroupState,
        entry: Entry,
        source: Source,
        *,
        attempts: int,
        reason: str | None,
        status: int | None,
    ) -> tuple[GroupState, Reservation]:
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

    def _put(self, sub: Subscription, entry: Entry) -> None:
        self.queues.put(sub.queue(entry.queue, self.prefix), entry)
        if self._recorders is not None and entry.queue == DLQ:
            self._record(sub, entry.message, "dead_lettered", entry.attempts, entry.reason)

    def _record(
        self,
        sub: Subscription,
        message: Message,
        event: EventKind,
        attempt: int,
        reason: str | None = None,
    ) -> None:
        assert self._recorders is not None
        self._recorders[sub.name].add(
            event,
            "push",
            sub.name,
            message_id=message.message_id,
            topic=message.topic,
            ordering_key=message.ordering_key,
            published_at=message.published_at_ms,
            qos=message.qos,
            attempt=attempt,
            subscription=sub.spec.filter,
            reason=reason,
        )

    def _deliver(self, sub: Subscription, message: Message, attempt: int) -> DeliveryResult:
        result = self.deliverer.deliver(
            delivery_request(sub.name, sub.spec.endpoint, message, attempt)
        )
        if self._recorders is not None:
            self._record(sub, message, "delivered" if attempt == 1 else "redelivered", attempt)
            if result.ok:
                self._record(sub, message, "acked", attempt)
        if not result.ok:
            logger.info(
                "push delivery failed",
                extra={
                    "subscription": sub.name,
                    "message_id": message.message_id,
                    "attempt": attempt,
                    "reason": result.reason,
                },
            )
        return result
