"""What the push function's two consumers share: the key-by-key work of a batch, and the
reservations, puts and deliveries of one message (with its delivery events).

A batch is taken key by key: one ordering key's messages strictly in order, different keys at
once, up to the subscription's ``parallelism`` (Powertools' BatchProcessor handles records one
by one and would go on past a failed record of a key; ordering needs the whole batch).
Lambda hands a batch back from the lowest failed record, so the answer names the lowest record
at which any key stopped. Records after it that other keys finished come again and are
recognized: by the subscription's cursor (MQ, ``shoal.push.main_queue``) or by the key's
consumed offset (RQ, ``shoal.push.retry_queue``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from shoal.core import metrics
from shoal.core.clock import Clock, SystemClock
from shoal.core.config import Config
from shoal.core.observability import carried, count, logger
from shoal.delivery.events import EventKind, PerConsumer, Recording
from shoal.push.endpoint import Deliverer, DeliveryResult, delivery_request
from shoal.push.entries import Entry, Source
from shoal.push.gate import PushGate
from shoal.push.model import DLQ, PushSubscription, Queue
from shoal.push.queues import Queues
from shoal.push.state import EntryReservation, KeyState
from shoal.push.store import KeyStore, PushSubscriptionStore
from shoal.records import Message

#: an RQ consumer waits for an attempt time at most this long in one invocation, then gives
#: the record back to the mapping (which invokes again at once: waiting here is the pacing)
MAX_HOLD_S = 10.0

#: conditional writes tried again after a racing change before the record counts as failed
MAX_CONFLICTS = 10


@dataclass(frozen=True)
class InRecord:
    index: int
    shard: str
    sequence_number: str
    arrival_ms: int
    data: bytes


@dataclass(frozen=True)
class Budget:
    #: no delivery starts after this
    deadline_ms: int
    #: no waiting for an attempt time beyond this
    hold_until_ms: int


@dataclass
class KeyWork:
    """One ordering key's part of a batch, worked in order."""

    ordering_key: str
    items: list[Any] = field(default_factory=list)
    state: KeyState = field(default_factory=KeyState)
    position: int = 0
    held_until: int | None = None
    failed: bool = False

    @property
    def stopped_at(self) -> int | None:
        """The record this key stopped at (failed or held), if it did not finish."""
        if self.position < len(self.items) and (self.failed or self.held_until is not None):
            return int(self.items[self.position].record)
        return None


class Consumer:
    """The push function's state and the steps both consumers take (``shoal.push.delivery``)."""

    def __init__(
        self,
        config: Config,
        subscriptions: PushSubscriptionStore,
        key_states: KeyStore,
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
        self.key_states = key_states
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

    def _run(
        self, works: Sequence[KeyWork], step: Callable[[KeyWork], None], parallelism: int
    ) -> None:
        if parallelism <= 1 or len(works) <= 1:
            for work in works:
                step(work)
            return
        with ThreadPoolExecutor(min(parallelism, len(works))) as pool:
            list(pool.map(carried(step), works))

    def _reservation(
        self,
        state: KeyState,
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
    ) -> EntryReservation:
        return EntryReservation(
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

    def _put(self, sub: PushSubscription, entry: Entry) -> None:
        self.queues.put(sub.queue(entry.queue, self.prefix), entry)
        if entry.queue == DLQ:
            count(metrics.DEAD_LETTERED)
            if self._recorders is not None:
                self._record(sub, entry.message, "dead_lettered", entry.attempts, entry.reason)

    def _record(
        self,
        sub: PushSubscription,
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

    def _deliver(self, sub: PushSubscription, message: Message, attempt: int) -> DeliveryResult:
        result = self.deliverer.deliver(
            delivery_request(sub.name, sub.spec.endpoint, message, attempt)
        )
        # one POST per count: the counting costs nothing next to it
        count(metrics.DELIVERED if attempt == 1 else metrics.REDELIVERED)
        if result.ok:
            count(metrics.ACKED)
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
