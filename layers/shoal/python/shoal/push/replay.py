"""Push subscriptions (replay): archived messages into a subscription's retry queue.

A replay (``pipeline.replay``, target ``push:<name>``) hands archived messages, in per-key
archive order, to ``PushReplay.replay``. Each message the subscription's filter matches becomes
an RQ entry due now (attempts 0, so its first POST is attempt 1; reason ``REPLAYED``), reserved
in the key's state exactly as a redrive reserves: the key stays blocked while the entries
are pending, so newer messages of the key (from the push tap or RQ) wait behind them, and they
go out in the order they were reserved. The endpoint sees the original message (its
``Shoal-Message-Id`` is the original id) and can deduplicate against the first delivery. A
replayed entry counts as published when it was replayed: a seek to a time before the replay
leaves it alone, a later one skips it (``shoal.push.decisions.decide_retry``).

Per key and call, three steps:

1. **stage**: the key's messages are put as one storage-format record (``encode_record``) into
   the subscription's DLQ stream, in the key's shard. Nothing consumes that stream; DLQ reads
   skip what is not a queue entry. The staged record is where a reservation says its message
   can be read again (``Source`` kind ``main``, index in the record): an archived message is
   past the storage stream's retention, and the key state has no room for payloads.
2. **reserve**: one conditional write of the key state reserves the entries (role ``rp``) and
   moves the replay's *mark* for the key (``KeyState.replays``: replay -> replay position of
   the last message reserved). Reservations stay in ``pending`` until RQ consumed them, so a
   consumer that meets a gap (a put that never landed, and a newer entry of the key after it)
   repairs it from the staged record, however many replay batches came since.
3. **put**: the entries into RQ.

Idempotence is the mark: the reservation and the mark are one write, and a replay reserves a
key's messages in position order, so a message at or before the mark is in RQ (or reserved,
and repairable) already. Running the same replay again, or again after a crash at any step,
reserves each message at most once for the subscription; a rerun puts again the reserved and
not yet consumed entries of its messages (the consumer drops an offset it has seen), which
covers a crash between reservation and put when no newer entry of the key follows to reveal
the gap. The mark costs one map entry per (key, replay) in an item that is written anyway, and
no read or write of its own; a key keeps the marks of its last ``REPLAY_HISTORY`` replays (a
replay older than that, run again, injects again). The replay's name in the mark is a digest
of the subscription's incarnation and the caller's replay id, so a subscription created again
under the same name gets the replay again.

Bounded: a call takes at most ``MAX_REPLAY_MESSAGES`` messages; a key takes at most
``MAX_UNCONSUMED`` replayed entries RQ has not consumed yet (the item holds their reservations):
the rest of the key's messages come back as ``deferred``, to be passed again (first, in order)
once the subscription has delivered some.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from shoal.aws.kinesis import OutRecord
from shoal.core.clock import Clock, SystemClock
from shoal.core.config import Config
from shoal.core.errors import ServerBusy, SubscriptionNotFound
from shoal.core.observability import logger
from shoal.push.entries import REPLAYED, Source, partition_key
from shoal.push.model import DLQ, RQ, PushSubscription
from shoal.push.queues import Queues
from shoal.push.state import EntryReservation, KeyState
from shoal.push.store import KeyStore, PushSubscriptionStore, push_parts
from shoal.records import Message, encode_record, record_size
from shoal.topics.filters import matches

#: messages one call takes at most; the caller passes the rest in later calls
MAX_REPLAY_MESSAGES = 1_000
#: replayed entries of one key that RQ has not consumed yet, at most (their reservations stay
#: in the key state item until it does)
MAX_UNCONSUMED = 100
#: replays a key remembers (their marks)
REPLAY_HISTORY = 16
#: a staged record stays below Kinesis' 1 MiB record with room to spare
MAX_STAGED_BYTES = 900 * 1024
_MAX_CONFLICTS = 10


@dataclass(frozen=True)
class Archived:
    """One archived message to replay."""

    message: Message
    #: sorts in per-key archive order within one replay (the caller's replay position)
    position: str
    #: the message's main position (``shoal.push.entries.main_position``) when the archive knows it
    main: str = ""


@dataclass
class ReplayReport:
    #: entries reserved and put in RQ by this call
    injected: int = 0
    #: messages an earlier call of this replay took already
    already: int = 0
    #: messages the subscription's filter does not match
    unmatched: int = 0
    #: messages of keys with ``MAX_UNCONSUMED`` replayed entries pending: pass them again
    deferred: list[Archived] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)

    def document(self) -> dict[str, Any]:
        return {
            "injected": self.injected,
            "already": self.already,
            "unmatched": self.unmatched,
            "deferred": len(self.deferred),
            "ordering_keys": self.keys,
        }


def replay_mark(incarnation: str, replay_id: str) -> str:
    """The name of a replay in a key's marks: its id, within one subscription incarnation."""
    return hashlib.blake2b(f"{incarnation}#{replay_id}".encode(), digest_size=8).hexdigest()


class PushReplay:
    def __init__(
        self,
        config: Config,
        subscriptions: PushSubscriptionStore,
        key_states: KeyStore,
        queues: Queues,
        *,
        clock: Clock | None = None,
    ) -> None:
        self.prefix = config.stream_prefix
        self.subscriptions = subscriptions
        self.key_states = key_states
        self.queues = queues
        self.clock = clock or SystemClock()

    @classmethod
    def from_config(cls, config: Config, clock: Clock | None = None) -> PushReplay:
        clock = clock or SystemClock()
        return cls(config, *push_parts(config, clock), clock=clock)

    def replay(self, name: str, replay_id: str, messages: Sequence[Archived]) -> ReplayReport:
        """Reserve and put ``messages`` (in per-key archive order) in the subscription's RQ."""
        if len(messages) > MAX_REPLAY_MESSAGES:
            raise ValueError(f"a replay call takes at most {MAX_REPLAY_MESSAGES} messages")
        sub = self.subscriptions.load(name)
        if sub is None:
            raise SubscriptionNotFound(f"no push subscription named {name}")
        if not sub.active:
            raise SubscriptionNotFound(f"push subscription {name} is {sub.state}")
        report = ReplayReport()
        by_key: dict[str, list[Archived]] = {}
        for item in messages:
            if not matches(sub.spec.filter, item.message.topic):
                report.unmatched += 1
                continue
            by_key.setdefault(item.message.ordering_key, []).append(item)
        mark = replay_mark(sub.spec.incarnation, replay_id)
        for key, items in by_key.items():
            self._replay_key(sub, mark, key, items, report)
        logger.info(
            "archived messages replayed",
            extra={"subscription": name, "count": report.injected, "already": report.already},
        )
        return report

    def _replay_key(
        self,
        sub: PushSubscription,
        mark: str,
        key: str,
        items: list[Archived],
        report: ReplayReport,
    ) -> None:
        state = self.key_states.get(sub.name, key)
        reached = state.replays.get(mark, "")
        done = [a for a in items if a.position <= reached]
        todo = [a for a in items if a.position > reached]
        report.already += len(done)
        if done:
            self._resume(sub, state, done)
        conflicts = 0
        injected = 0
        while todo:
            unconsumed = _unconsumed(state)
            room = MAX_UNCONSUMED - len(unconsumed)
            if room <= 0:
                report.deferred += todo
                break
            chunk = _chunk(todo, room)
            source = self._stage(sub, key, chunk)
            reservations, new = self._reserve(state, mark, chunk, source)
            saved = self.key_states.save(sub.name, key, new)
            if saved is None:
                # another writer moved the key (a consumer, or this replay run twice at once):
                # read again; the mark says what that other run of the replay took
                conflicts += 1
                if conflicts > _MAX_CONFLICTS:
                    raise ServerBusy("the key's group state kept changing; run the replay again")
                state = self.key_states.get(sub.name, key)
                reached = state.replays.get(mark, "")
                todo = [a for a in todo if a.position > reached]
                continue
            rq = sub.queue(RQ, self.prefix)
            for reservation, item in zip(reservations, chunk, strict=True):
                self.queues.put(rq, reservation.entry(item.message))
            injected += len(chunk)
            todo = todo[len(chunk) :]
            state = saved
        report.injected += injected
        if injected:
            report.keys.append(key)

    def _stage(self, sub: PushSubscription, key: str, chunk: Sequence[Archived]) -> Source:
        """Put the chunk's messages as one storage record in the DLQ stream: where its
        reservations can be read again."""
        dlq = sub.queue(DLQ, self.prefix)
        record = OutRecord(
            data=encode_record([a.message for a in chunk]),
            partition_key=partition_key(key),
            explicit_hash_key=dlq.starting_key(dlq.partition_for(key)),
        )
        outcome = self.queues.streams.put_record(dlq.stream, record)
        if not outcome.ok or outcome.shard_id is None or outcome.sequence_number is None:
            raise ServerBusy("the replayed messages could not be staged; run the replay again")
        return Source(dlq.stream, outcome.shard_id, outcome.sequence_number, 0, "main")

    def _reserve(
        self, state: KeyState, mark: str, chunk: Sequence[Archived], staged: Source
    ) -> tuple[list[EntryReservation], KeyState]:
        now = self.clock.now_ms()
        reservations = [
            EntryReservation(
                queue=RQ,
                n=state.rq.p.n + 1 + i,
                message_id=item.message.message_id,
                main=item.main,
                source=replace(staged, index=i),
                attempts=0,
                due_ms=now,
                reason=REPLAYED,
                status=None,
                at_ms=now,
                # the queue's "newest publish time" (what a seek compares) is the replay's
                published_at_ms=now,
            )
            for i, item in enumerate(chunk)
        ]
        new = state.reserve("rp", reservations)
        replays = {k: v for k, v in state.replays.items() if k != mark}
        replays[mark] = chunk[-1].position
        kept = dict(list(replays.items())[-REPLAY_HISTORY:])
        pending = {**new.pending, "rp": (*_unconsumed(state), *reservations)}
        return reservations, replace(new, pending=pending, replays=kept)

    def _resume(self, sub: PushSubscription, state: KeyState, done: Sequence[Archived]) -> None:
        """Put again the entries of ``done`` that an earlier call reserved and RQ has not
        consumed: that call may have died before its puts (the consumer drops duplicates)."""
        messages = {a.message.message_id: a.message for a in done}
        rq = sub.queue(RQ, self.prefix)
        for reservation in _unconsumed(state):
            message = messages.get(reservation.message_id)
            if message is not None:
                self.queues.put(rq, reservation.entry(message))


def _unconsumed(state: KeyState) -> tuple[EntryReservation, ...]:
    return tuple(r for r in state.reserved("rp") if r.n > state.rq.c.n)


def _chunk(todo: Sequence[Archived], room: int) -> list[Archived]:
    """The longest prefix of ``todo`` of at most ``room`` messages that one staged record
    holds (at least one message: a message alone always fits, as it fitted its own record)."""
    out: list[Archived] = []
    headers: list[bytes] = []
    payload = 0
    for item in todo[:room]:
        header = item.message.header()
        size = record_size(
            [*headers, header], payload + len(item.message.payload), item.message.ordering_key
        )
        if out and size > MAX_STAGED_BYTES:
            break
        out.append(item)
        headers.append(header)
        payload += len(item.message.payload)
    return out
