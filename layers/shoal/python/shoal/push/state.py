"""The key state: per (push subscription, ordering key), the produced and consumed positions
of RQ and DLQ, the reservations of entries not yet consumed, the retry progress of the RQ head,
and the marks of what the MQ consumer and the replays took (the design calls it the *group
state*; ``shoal.push`` tells the whole story). Pure: ``shoal.push.store.KeyStore`` writes each
transition conditionally on the item's version."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from shoal.push.entries import Entry, Source, topic_of
from shoal.push.model import DLQ, RQ, Queue
from shoal.records import Message


@dataclass(frozen=True)
class Pos:
    n: int = 0
    m: str = ""


@dataclass(frozen=True)
class QueueState:
    p: Pos = Pos()
    c: Pos = Pos()
    #: publish time of the newest entry produced: all pending entries are older (seek skip)
    last_at: int = 0
    #: when the oldest pending entry was produced: a read for it starts here
    since: int = 0

    @property
    def depth(self) -> int:
        return self.p.n - self.c.n

    def blocks(self, skip_before_ms: int) -> bool:
        # Entries published before a seek's time are skipped, so they no longer hold the key.
        return self.depth > 0 and self.last_at >= skip_before_ms

    def item(self) -> dict[str, Any]:
        return {
            "p": [self.p.n, self.p.m],
            "c": [self.c.n, self.c.m],
            "l": self.last_at,
            "s": self.since,
        }

    @classmethod
    def from_item(cls, raw: Mapping[str, Any] | None) -> QueueState:
        if not raw:
            return cls()
        return cls(
            p=Pos(int(raw["p"][0]), str(raw["p"][1])),
            c=Pos(int(raw["c"][0]), str(raw["c"][1])),
            last_at=int(raw.get("l", 0)),
            since=int(raw.get("s", 0)),
        )


@dataclass(frozen=True)
class EntryReservation:
    """An entry a producer reserved: enough to put its record again from its source."""

    queue: Queue
    n: int
    message_id: str
    main: str
    source: Source
    attempts: int
    due_ms: int
    reason: str | None
    status: int | None
    at_ms: int
    published_at_ms: int
    #: the per-key offset in the queue it left (RQ -> DLQ moves), else 0
    origin_n: int = 0

    def entry(self, message: Message) -> Entry:
        return Entry(
            message=message,
            queue=self.queue,
            n=self.n,
            main=self.main,
            attempts=self.attempts,
            due_ms=self.due_ms,
            reason=self.reason,
            status=self.status,
            at_ms=self.at_ms,
        )

    def item(self) -> dict[str, Any]:
        return {
            "q": self.queue,
            "n": self.n,
            "id": self.message_id,
            "m": self.main,
            "src": self.source.item(),
            "a": self.attempts,
            "d": self.due_ms,
            "w": self.reason,
            "s": self.status,
            "t": self.at_ms,
            "pub": self.published_at_ms,
            "o": self.origin_n,
        }

    @classmethod
    def from_item(cls, raw: Mapping[str, Any]) -> EntryReservation:
        return cls(
            queue=RQ if raw["q"] == RQ else DLQ,
            n=int(raw["n"]),
            message_id=str(raw["id"]),
            main=str(raw["m"]),
            source=Source.from_item(raw["src"]),
            attempts=int(raw["a"]),
            due_ms=int(raw["d"]),
            reason=raw.get("w"),
            status=None if raw.get("s") is None else int(raw["s"]),
            at_ms=int(raw["t"]),
            published_at_ms=int(raw["pub"]),
            origin_n=int(raw.get("o", 0)),
        )


#: who made a reservation: the MQ consumer, the RQ consumer (moves to DLQ), a redrive, a replay
Role = Literal["mq", "rq", "rd", "rp"]
#: MQ reservations remembered: one suffices while the tap retries its batch (each put lands
#: before the next reservation); a few more cover a batch a seek abandoned mid-way
MQ_HISTORY = 8


@dataclass(frozen=True)
class RetryHead:
    """Retry progress of the RQ entry at the head of its key."""

    n: int
    attempts: int
    due_ms: int
    reason: str | None
    status: int | None


@dataclass(frozen=True)
class KeyState:
    """The state of one (subscription, ordering key); ``version`` 0 is an absent item."""

    rq: QueueState = QueueState()
    dlq: QueueState = QueueState()
    #: main position of the last message the MQ consumer routed to RQ or DLQ, and the seek
    #: generation it was routed in: a retried batch skips what it routed already
    routed: str = ""
    generation: int = 0
    head: RetryHead | None = None
    #: per storage topic (the main position's first field), the main position of the last
    #: message the MQ consumer finished in ``generation``, written when the push tap runs
    #: several lanes (whose shard cursor cannot move: see ``shoal.push.main_queue``)
    marks: Mapping[str, str] = field(default_factory=dict)
    pending: Mapping[str, tuple[EntryReservation, ...]] = field(default_factory=dict)
    #: per replay (``shoal.push.replay``), the replay position of the key's last message it
    #: reserved: its messages are reserved in that order, so this says which are in RQ already
    replays: Mapping[str, str] = field(default_factory=dict)
    version: int = 0

    def queue(self, name: Queue) -> QueueState:
        return self.rq if name == RQ else self.dlq

    def blocked(self, skip_before_ms: int = 0) -> bool:
        return self.rq.blocks(skip_before_ms) or self.dlq.blocks(skip_before_ms)

    def reserved(self, role: Role) -> tuple[EntryReservation, ...]:
        return self.pending.get(role, ())

    def reservation_for(self, queue: Queue, n: int) -> EntryReservation | None:
        """The reservation that produced offset ``n`` of ``queue``, while one remembers it."""
        for reservations in self.pending.values():
            for r in reservations:
                if r.queue == queue and r.n == n:
                    return r
        return None

    # -- transitions (pure; the repository writes them conditionally) --

    def reserve(
        self, role: Role, reservations: Sequence[EntryReservation], *, generation: int | None = None
    ) -> KeyState:
        """Produce ``reservations`` (consecutive offsets of one queue) and remember them."""
        state = self
        for r in reservations:
            q = state.queue(r.queue)
            assert r.n == q.p.n + 1, "offsets are reserved in order"
            nq = replace(
                q,
                p=Pos(r.n, r.main),
                last_at=max(q.last_at, r.published_at_ms),
                since=r.at_ms if q.depth == 0 else q.since,
            )
            state = replace(state, rq=nq) if r.queue == RQ else replace(state, dlq=nq)
        kept = (
            (*self.reserved(role), *reservations)[-MQ_HISTORY:]
            if role == "mq"
            else tuple(reservations)
        )
        state = replace(state, pending={**self.pending, role: kept})
        if role == "mq" and generation is not None and reservations:
            marks = dict(state.marks) if generation == state.generation else {}
            # routed is handled: the mark of its storage topic moves with it, so routing a
            # later storage topic's message (taps run side by side) forgets nothing of this one
            for r in reservations:
                topic = topic_of(r.main)
                marks[topic] = max(marks.get(topic, ""), r.main)
            state = replace(state, routed=reservations[-1].main, generation=generation, marks=marks)
        return state

    def mark(self, main: str, generation: int) -> KeyState:
        """The MQ consumer finished ``main`` (and every earlier message of the key in its
        storage topic) in seek generation ``generation``."""
        if generation < self.generation:
            return self  # read before a seek: the seek's generation decides
        if generation > self.generation:
            return replace(self, routed="", generation=generation, marks={topic_of(main): main})
        if main <= self.marks.get(topic_of(main), ""):
            return self
        return replace(self, marks={**self.marks, topic_of(main): main})

    def finished(self, main: str, generation: int) -> bool:
        """Whether a mark says the MQ consumer finished ``main`` in this generation."""
        return generation == self.generation and main <= self.marks.get(topic_of(main), "")

    def consume(self, queue: Queue, n: int, main: str) -> KeyState:
        q = self.queue(queue)
        assert n == q.c.n + 1, "offsets are consumed in order"
        nq = replace(q, c=Pos(n, main))
        if queue == RQ:
            head = self.head if self.head is not None and self.head.n != n else None
            return replace(self, rq=nq, head=head)
        return replace(self, dlq=nq)

    def retry_later(self, head: RetryHead) -> KeyState:
        return replace(self, head=head)

    def skip_before(self, skip_before_ms: int) -> KeyState:
        """A seek's fast-forward: a queue whose entries all predate it is consumed at once."""
        state = self
        if self.rq.depth > 0 and self.rq.last_at < skip_before_ms:
            state = replace(state, rq=replace(state.rq, c=state.rq.p), head=None)
        if self.dlq.depth > 0 and self.dlq.last_at < skip_before_ms:
            state = replace(state, dlq=replace(state.dlq, c=state.dlq.p))
        return state

    # -- the item --

    def to_json(self) -> str:
        head = self.head
        return json.dumps(
            {
                "rq": self.rq.item(),
                "dlq": self.dlq.item(),
                "routed": self.routed,
                "gen": self.generation,
                "head": None
                if head is None
                else [head.n, head.attempts, head.due_ms, head.reason, head.status],
                "pending": {
                    role: [r.item() for r in rs] for role, rs in self.pending.items() if rs
                },
                **({"marks": dict(self.marks)} if self.marks else {}),
                **({"replays": dict(self.replays)} if self.replays else {}),
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str, version: int) -> KeyState:
        raw = json.loads(text)
        head = raw.get("head")
        return cls(
            rq=QueueState.from_item(raw.get("rq")),
            dlq=QueueState.from_item(raw.get("dlq")),
            routed=str(raw.get("routed", "")),
            generation=int(raw.get("gen", 0)),
            head=None
            if head is None
            else RetryHead(
                int(head[0]),
                int(head[1]),
                int(head[2]),
                head[3],
                None if head[4] is None else int(head[4]),
            ),
            pending={
                role: tuple(EntryReservation.from_item(r) for r in rs)
                for role, rs in (raw.get("pending") or {}).items()
            },
            marks={str(k): str(v) for k, v in (raw.get("marks") or {}).items()},
            replays={str(k): str(v) for k, v in (raw.get("replays") or {}).items()},
            version=version,
        )
