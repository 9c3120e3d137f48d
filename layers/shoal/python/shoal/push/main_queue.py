"""The MQ consumer: a push tap's batch, taken by every member subscription of the tap.

Seals
-----
A tap passes the ordered drain's seal of a shard (``shoal.drain``) for its members only when it
runs one lane: a seal has a partition key of its own, so with several lanes it reaches one lane
while another may still hold earlier records of other keys. A tap of several lanes gives its
batch back from the seal (paced as a hold) until the tap runs one lane, as every tap behind the
produce pointer is made to (``shoal.push.admin.tap_lanes``); the single lane then starts from
the shard's checkpoint, which no unfinished record is past, and reaches the seal only after
every record before it.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from shoal.core.errors import ServerBusy
from shoal.core.observability import carried, logger
from shoal.drain import RECHECK_MS
from shoal.push.consumer import MAX_CONFLICTS, Budget, Consumer, InRecord, KeyWork
from shoal.push.decisions import MainAction, Outcome, decide_main, judge
from shoal.push.endpoint import DeliveryResult
from shoal.push.entries import BLOCKED, Source, main_position
from shoal.push.gate import push_consumer
from shoal.push.model import CREATING, DLQ, RQ, PushSubscription, ShardCursor, Tap
from shoal.push.state import KeyState
from shoal.push.store import INFRASTRUCTURE_ERRORS
from shoal.records import MalformedRecord, Message, decode_record, is_seal
from shoal.topics.filters import matches

#: "never" for the ordered drain's start times
FOREVER_MS = 2**62


@dataclass(frozen=True)
class MainItem:
    record: int
    message: Message
    main: str
    source: Source


def _lowest(*stops: int | None) -> int | None:
    return min((s for s in stops if s is not None), default=None)


class MainQueueConsumer(Consumer):
    """Delivers push tap batches; see the module docstring."""

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
        # lane (shoal.push.admin.tap_lanes); until then the batch goes back from the seal, and
        # the members take the records before it as usual.
        unsealed = self._first_seal(records) if tap.lanes > 1 and self.gate is not None else None
        # a member still being created takes the seals too: it may be active before the tap
        # reads on (shoal.drain, push taps)
        creating = [s for s in loaded if s.state == CREATING and stream in s.cursors]
        unmarked = [self._pass_seals(s, stream, records, unsealed) for s in creating]

        def one(sub: PushSubscription) -> int | None:
            stop = self._main_for(sub, tap, stream, records, decoded, budget=budget)
            return self._pass_seals(sub, stream, records, _lowest(stop, unsealed))

        if len(subs) <= 1:
            stops = [one(s) for s in subs]
        else:
            with ThreadPoolExecutor(min(len(subs), 16)) as pool:
                stops = list(pool.map(carried(one), subs))
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
        sub: PushSubscription,
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
            states = self.key_states.get_many(sub.name, works)
        except INFRASTRUCTURE_ERRORS:
            logger.warning("group states unreadable", extra={"subscription": sub.name})
            return admitted[0].index
        for key, work in works.items():
            work.state = states[key]
        self._run(list(works.values()), lambda w: self._main_step(sub, w, budget), sub.parallelism)
        stopped = min((s for w in works.values() if (s := w.stopped_at) is not None), default=None)
        if tap.lanes > 1:
            # Other lanes of this shard may hold earlier records: the shard cursor stays, each
            # key's progress is marked instead (shoal.push.store, push taps).
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

    def _drained(self, sub: PushSubscription, tap: Tap, budget: Budget) -> bool:
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
        self, sub: PushSubscription, stream: str, records: list[InRecord], stop: int | None
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

    def _main_step(self, sub: PushSubscription, work: KeyWork, budget: Budget) -> None:
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
        self, sub: PushSubscription, key: str, item: MainItem, state: KeyState
    ) -> KeyState:
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
            saved = self.key_states.save(
                sub.name, key, state.reserve("mq", [reservation], generation=sub.generation)
            )
            if saved is None:
                state = self.key_states.get(sub.name, key)
                continue
            self._put(sub, reservation.entry(item.message))
            return saved
        raise ServerBusy("the key's group state kept changing")

    def _mark(self, sub: PushSubscription, work: KeyWork) -> None:
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
                saved = self.key_states.save(sub.name, work.ordering_key, new)
                if saved is not None:
                    work.state = saved
                    return
                state = self.key_states.get(sub.name, work.ordering_key)
        except INFRASTRUCTURE_ERRORS:
            pass
        # the messages are done; a missing mark only makes a replay deliver them again
        logger.warning("push key mark not written", extra={"subscription": sub.name})
