"""Push subscriptions (Varadhi): HTTP delivery with retry routing MQ -> RQ -> DLQ.

A push subscription delivers every message of its composite topic (the *main queue*, MQ) that
matches its MQTT filter to an HTTP endpoint. A failed delivery goes to the subscription's retry
queue (RQ) with an attempt time; one that cannot succeed goes to its dead-letter queue (DLQ).
RQ and DLQ are composite topics of their own (one storage topic each, routed with the router
formula by ordering key, so one key's entries stay in one shard) that publishers cannot reach.

Group state (the design's terms)
--------------------------------
Per (subscription, ordering key) one item holds, for RQ and for DLQ, the *produced* position
``p`` and the *consumed* position ``c``. A position is (``n``, ``m``): ``n`` is the entry's
offset in the key's own sequence of that queue (1, 2, ...), ``m`` the main position of the
entry's message (main storage topic index, sequence number, index in the record). The per-key
offset stands in for the internal Kinesis offset: it is known before the put (so a reservation
can name it), and a record put twice by a retry carries it twice, which the consumer drops.
A key is *blocked* while ``p != c`` in RQ or DLQ; an ordered subscription sends a blocked
key's later messages behind the pending ones, so no message is overtaken by a later one of its
key, while other keys keep flowing.

Every change is one conditional write on the item's version. A producer first *reserves* the
entry (``p.n + 1``, recorded in ``pending`` with where the message can be read again), then
puts the record; a crash in between is repaired by the retry of the same batch (the producer
finds its own reservation and puts again) or by the consumer, which reads a missing entry from
its source. So no entry is ever put without a reservation (nothing a consumer has to guess
about), and a reserved one is never lost.

Flows
-----
- **MQ** (``shoal.push_delivery``): a non-matching message is skipped; an already routed one
  (main position at or below the key's mark for that storage topic in the same seek
  generation: positions of two storage topics never compare, their taps run side by side) is
  skipped; a blocked key's message follows into RQ (or DLQ, when only DLQ holds the key);
  otherwise it is POSTed: 2xx done; a ``retry_on`` outcome goes to RQ with its attempt time;
  anything else (or ``max_attempts`` 1) to DLQ with the reason.
- **RQ**: entries are taken in per-key order; an entry before its attempt time holds its key
  (the rest of the batch goes on, the mapping gives the held record back); success moves ``c``;
  exhaustion or a non-retryable answer moves the entry to DLQ.
- **DLQ**: listed with reason and attempts; a redrive moves a key's oldest entries, in order,
  into RQ ahead of the key's newer messages; a key whose DLQ drains unblocks.
- **Replay** (``shoal.push_replay``): archived messages reserved into RQ as a redrive reserves
  (reason ``REPLAYED``), idempotently by a per-key mark of the replay.

Attempt times are exponential backoff with jitter, bounded: after attempt ``a`` the next
waits ``b/2 .. b`` with ``b = min(initial * multiplier**(a-1), max)``, the jitter a stable
hash of (message, attempt), so a retried batch computes the same time.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, Literal, Protocol
from urllib.parse import quote, urlsplit

import requests
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError

from shoal.core.errors import (
    InvalidEndpoint,
    InvalidFilter,
    InvalidParallelism,
    InvalidRetryPolicy,
    InvalidSubscriptionName,
)
from shoal.records import MalformedRecord, Message, decode_record, record_partition_key
from shoal.topics.filters import SHARE_PREFIX, is_valid_filter

SUBSCRIPTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: Lambda's ParallelizationFactor ranges 1..10; the same bound caps keys delivered at once
MAX_PARALLELISM = 10
MAX_ENDPOINT_LENGTH = 2048
MAX_ATTEMPTS = 100
MAX_BACKOFF_S = 3600.0
MAX_MULTIPLIER = 10.0
#: an RQ consumer waits for an attempt time at most this long in one invocation, then gives
#: the record back to the mapping (which invokes again at once: waiting here is the pacing)
MAX_HOLD_S = 10.0
#: a queue record's partition key is the ordering key, or its digest when Kinesis' 256-character
#: partition key cannot hold it
MAX_PARTITION_KEY = 256
#: the endpoint's answer is read up to this much, then the connection is dropped
MAX_RESPONSE_BYTES = 64 * 1024
CONNECT_TIMEOUT_S = 2.0
READ_TIMEOUT_S = 5.0

Queue = Literal["rq", "dlq"]
RQ: Queue = "rq"
DLQ: Queue = "dlq"

#: reasons a message is in the DLQ without an attempt of its own
BLOCKED = "ordering_key_blocked"
#: the reason of an RQ entry a replay of archived messages put there (``shoal.push_replay``):
#: a seek skips it by when it was replayed, not by when its message was published
REPLAYED = "replayed"
RETRY_CLASSES = frozenset({"4xx", "5xx", "timeout"})
DEFAULT_RETRY_ON: tuple[int | str, ...] = (429, "5xx", "timeout")


# -- the subscription -----------------------------------------------------------------------


class RetryPolicy(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_attempts: StrictInt = Field(default=5, ge=1, le=MAX_ATTEMPTS)
    initial_backoff_s: float = Field(default=1.0, ge=0, le=MAX_BACKOFF_S)
    max_backoff_s: float = Field(default=60.0, ge=0, le=MAX_BACKOFF_S)
    multiplier: float = Field(default=2.0, ge=1, le=MAX_MULTIPLIER)
    #: status codes, status classes ("4xx", "5xx") and "timeout" (no answer in time, or no
    #: connection) that retry; everything else but 2xx dead-letters at once
    retry_on: tuple[StrictInt | str, ...] = DEFAULT_RETRY_ON

    def retries(self, result: DeliveryResult) -> bool:
        if result.status is None:
            return "timeout" in self.retry_on
        return result.status in self.retry_on or f"{result.status // 100}xx" in self.retry_on

    def backoff_ms(self, attempts: int, salt: str) -> int:
        """How long after attempt ``attempts`` (1-based) the next one waits."""
        ceiling = min(
            self.initial_backoff_s * self.multiplier ** max(attempts - 1, 0), self.max_backoff_s
        )
        digest = hashlib.blake2b(f"{salt}#{attempts}".encode(), digest_size=4).digest()
        fraction = int.from_bytes(digest, "big") / 2**32
        return round(ceiling * 1000 * (0.5 + 0.5 * fraction))


def parse_retry_policy(raw: object) -> RetryPolicy:
    if raw is None:
        return RetryPolicy()
    if not isinstance(raw, dict):
        raise InvalidRetryPolicy("retry must be an object")
    try:
        policy = RetryPolicy.model_validate(raw)
    except ValidationError as exc:
        problems = [
            {"field": ".".join(str(p) for p in e["loc"]), "problem": e["msg"]}
            for e in exc.errors(include_input=False, include_url=False)
        ]
        raise InvalidRetryPolicy("the retry policy does not fit", fields=problems) from None
    if policy.max_backoff_s < policy.initial_backoff_s:
        raise InvalidRetryPolicy("max_backoff_s must be at least initial_backoff_s")
    for item in policy.retry_on:
        if isinstance(item, int) and not 100 <= item <= 599:
            raise InvalidRetryPolicy("retry_on holds status codes 100-599")
        if isinstance(item, str) and item not in RETRY_CLASSES:
            raise InvalidRetryPolicy('retry_on holds status codes, "4xx", "5xx" or "timeout"')
    return policy


def validate_name(name: object) -> str:
    if not isinstance(name, str) or SUBSCRIPTION_NAME.fullmatch(name) is None:
        raise InvalidSubscriptionName("a subscription name is 1-64 of A-Z a-z 0-9 _ -")
    return name


def validate_filter(topic_filter: object) -> str:
    if not isinstance(topic_filter, str) or not is_valid_filter(topic_filter):
        raise InvalidFilter("the filter is not a valid MQTT topic filter")
    if topic_filter.startswith(SHARE_PREFIX):
        raise InvalidFilter("a push subscription takes a plain filter, not $share/...")
    return topic_filter


def validate_parallelism(parallelism: object) -> int:
    if (
        not isinstance(parallelism, int)
        or isinstance(parallelism, bool)
        or not 1 <= parallelism <= MAX_PARALLELISM
    ):
        raise InvalidParallelism(f"parallelism is 1-{MAX_PARALLELISM}", maximum=MAX_PARALLELISM)
    return parallelism


@dataclass(frozen=True)
class EndpointPolicy:
    """Which endpoints a subscription may name.

    Deployed, only ``https://`` to a name or a public address; under ``shoal dev`` also
    ``http://`` to a loopback address, so a developer's local server can receive pushes.
    """

    allow_loopback_http: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> EndpointPolicy:
        # shoal dev points every AWS client at its emulator on loopback; a deployed function
        # never has AWS_ENDPOINT_URL at all. So this is the signal that we run locally.
        endpoint = env.get("AWS_ENDPOINT_URL", "")
        return cls(allow_loopback_http=bool(endpoint) and _is_loopback(urlsplit(endpoint).hostname))

    def validate(self, endpoint: object) -> str:
        if not isinstance(endpoint, str) or not endpoint or len(endpoint) > MAX_ENDPOINT_LENGTH:
            raise InvalidEndpoint(f"the endpoint is a URL of at most {MAX_ENDPOINT_LENGTH} chars")
        try:
            parts = urlsplit(endpoint)
            parts.port  # noqa: B018 - raises on a malformed port
        except ValueError:
            raise InvalidEndpoint("the endpoint is not a URL") from None
        host = parts.hostname
        if not host or parts.username is not None or parts.password is not None:
            raise InvalidEndpoint("the endpoint needs a host and no user or password")
        if parts.fragment or any(c.isspace() for c in endpoint):
            raise InvalidEndpoint("the endpoint holds a fragment or whitespace")
        if parts.scheme == "https":
            if not self.allow_loopback_http and _is_internal(host):
                raise InvalidEndpoint("the endpoint names an internal address")
            return endpoint
        if parts.scheme == "http" and self.allow_loopback_http and _is_loopback(host):
            return endpoint
        raise InvalidEndpoint(
            "the endpoint must be https://"
            + (" (or http:// to loopback under shoal dev)" if self.allow_loopback_http else "")
        )


def _address(host: str | None) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address((host or "").strip("[]"))
    except ValueError:
        return None


def _is_loopback(host: str | None) -> bool:
    if host == "localhost":
        return True
    address = _address(host)
    return address is not None and address.is_loopback


def _is_internal(host: str) -> bool:
    """Loopback, link-local (the instance metadata service), unspecified or multicast."""
    if host == "localhost" or host.endswith(".localhost"):
        return True
    address = _address(host)
    return address is not None and (
        address.is_loopback
        or address.is_link_local
        or address.is_unspecified
        or address.is_multicast
        or address.is_reserved
    )


@dataclass(frozen=True)
class Spec:
    """What a subscription does; everything but ``parallelism`` is fixed at creation."""

    filter: str
    endpoint: str
    ordered: bool
    retry: RetryPolicy
    #: the composite topic it reads
    topic: str
    #: RQ and DLQ: partitions of their storage topic, and what tells their streams apart from
    #: those of an earlier subscription of the same name
    queue_partitions: int = 1
    incarnation: str = "0"

    def same_request(self, other: Spec) -> bool:
        """What a client asked for is the same (a repeated create completes the first)."""
        return (self.filter, self.endpoint, self.ordered, self.retry, self.topic) == (
            other.filter,
            other.endpoint,
            other.ordered,
            other.retry,
            other.topic,
        )

    def to_json(self) -> str:
        return json.dumps(
            {
                "filter": self.filter,
                "endpoint": self.endpoint,
                "ordered": self.ordered,
                "retry": self.retry.model_dump(mode="json"),
                "topic": self.topic,
                "queues": {"partitions": self.queue_partitions, "incarnation": self.incarnation},
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str) -> Spec:
        raw = json.loads(text)
        queues = raw.get("queues") or {}
        return cls(
            filter=raw["filter"],
            endpoint=raw["endpoint"],
            ordered=bool(raw["ordered"]),
            retry=RetryPolicy.model_validate(raw["retry"]),
            topic=raw["topic"],
            queue_partitions=int(queues.get("partitions", 1)),
            incarnation=str(queues.get("incarnation", "0")),
        )


class CreateRequest(BaseModel):
    """POST /v1/subscriptions. Fields are checked by the service, for their own error codes."""

    model_config = ConfigDict(extra="forbid")

    name: Any = None
    filter: Any = None
    endpoint: Any = None
    ordered: StrictBool = True
    retry: Any = None
    parallelism: Any = 1
    #: the composite topic to read; default: the filter's first level when it names one, else
    #: `default` (an extension of API.md: a filter starting with a wildcard reads `default`)
    topic: Any = None


# -- positions and queue entries ------------------------------------------------------------


def main_position(storage_index: int, sequence_number: str, index: int) -> str:
    """A message's place in its composite topic, comparable as a string within one key."""
    return f"{storage_index:06d}:{int(sequence_number):060d}:{index:05d}"


def _topic_of(main: str) -> str:
    """The storage topic field of a main position."""
    return main.partition(":")[0]


def ordering_digest(ordering_key: str) -> str:
    return hashlib.blake2b(
        ordering_key.encode("utf-8", "surrogatepass"), digest_size=16
    ).hexdigest()


def partition_key(ordering_key: str) -> str:
    """The Kinesis partition key of a queue record: the ordering key, so that the mapping's
    parallelization factor keeps one key in one lane (as a storage record's)."""
    return record_partition_key(ordering_key)


@dataclass(frozen=True)
class Source:
    """Where a message can be read again: a record of a storage stream or of a queue."""

    stream: str
    shard: str
    sequence_number: str
    #: the message's index in a storage record (queue records hold one message)
    index: int = 0
    kind: Literal["main", "queue"] = "main"

    def item(self) -> dict[str, Any]:
        return {
            "st": self.stream,
            "sh": self.shard,
            "sq": self.sequence_number,
            "i": self.index,
            "k": self.kind,
        }

    @classmethod
    def from_item(cls, raw: Mapping[str, Any]) -> Source:
        return cls(
            stream=str(raw["st"]),
            shard=str(raw["sh"]),
            sequence_number=str(raw["sq"]),
            index=int(raw["i"]),
            kind="queue" if raw.get("k") == "queue" else "main",
        )


@dataclass(frozen=True)
class Entry:
    """One message in RQ or DLQ, as its record carries it."""

    message: Message
    queue: Queue
    #: the per-key offset in this queue
    n: int
    main: str
    #: attempts made so far
    attempts: int
    #: when the next attempt is due (RQ)
    due_ms: int
    #: why it is here: the last failure (``http_503``, ``timeout``, ...) or ``BLOCKED``
    reason: str | None
    status: int | None
    #: when it entered this queue
    at_ms: int

    @property
    def ordering_key(self) -> str:
        return self.message.ordering_key


def encode_entry(entry: Entry) -> bytes:
    """A queue record: the storage record format (``shoal.publishing``) of its one message,
    with the entry's own fields under ``push`` in the header line."""
    meta = {
        "q": entry.queue,
        "n": entry.n,
        "m": entry.main,
        "a": entry.attempts,
        "d": entry.due_ms,
        "w": entry.reason,
        "s": entry.status,
        "t": entry.at_ms,
    }
    return (
        b'{"v":1,"push":'
        + json.dumps(meta, separators=(",", ":")).encode()
        + b',"m":['
        + entry.message.header()
        + b"]}\n"
        + entry.message.payload
    )


def decode_entry(data: bytes) -> Entry:
    messages = decode_record(data)
    head = json.loads(data.partition(b"\n")[0])
    meta = head.get("push") if isinstance(head, dict) else None
    if not isinstance(meta, dict) or len(messages) != 1 or meta.get("q") not in (RQ, DLQ):
        raise MalformedRecord("not a push queue record")
    try:
        return Entry(
            message=messages[0],
            queue=meta["q"],
            n=int(meta["n"]),
            main=str(meta["m"]),
            attempts=int(meta["a"]),
            due_ms=int(meta["d"]),
            reason=meta.get("w"),
            status=None if meta.get("s") is None else int(meta["s"]),
            at_ms=int(meta["t"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise MalformedRecord(str(exc)) from exc


# -- group state ----------------------------------------------------------------------------


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
class Reservation:
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
    def from_item(cls, raw: Mapping[str, Any]) -> Reservation:
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
class Head:
    """Retry progress of the RQ entry at the head of its key."""

    n: int
    attempts: int
    due_ms: int
    reason: str | None
    status: int | None


@dataclass(frozen=True)
class GroupState:
    """The state of one (subscription, ordering key); ``version`` 0 is an absent item."""

    rq: QueueState = QueueState()
    dlq: QueueState = QueueState()
    #: main position of the last message the MQ consumer routed to RQ or DLQ, and the seek
    #: generation it was routed in: a retried batch skips what it routed already
    routed: str = ""
    generation: int = 0
    head: Head | None = None
    #: per storage topic (the main position's first field), the main position of the last
    #: message the MQ consumer finished in ``generation``, written when the push tap runs
    #: several lanes (whose shard cursor cannot move: see ``shoal.push_delivery``)
    marks: Mapping[str, str] = field(default_factory=dict)
    pending: Mapping[str, tuple[Reservation, ...]] = field(default_factory=dict)
    #: per replay (``shoal.push_replay``), the replay position of the key's last message it
    #: reserved: its messages are reserved in that order, so this says which are in RQ already
    replays: Mapping[str, str] = field(default_factory=dict)
    version: int = 0

    def queue(self, name: Queue) -> QueueState:
        return self.rq if name == RQ else self.dlq

    def blocked(self, skip_before_ms: int = 0) -> bool:
        return self.rq.blocks(skip_before_ms) or self.dlq.blocks(skip_before_ms)

    def reserved(self, role: Role) -> tuple[Reservation, ...]:
        return self.pending.get(role, ())

    def reservation_for(self, queue: Queue, n: int) -> Reservation | None:
        """The reservation that produced offset ``n`` of ``queue``, while one remembers it."""
        for reservations in self.pending.values():
            for r in reservations:
                if r.queue == queue and r.n == n:
                    return r
        return None

    # -- transitions (pure; the repository writes them conditionally) --

    def reserve(
        self, role: Role, reservations: Sequence[Reservation], *, generation: int | None = None
    ) -> GroupState:
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
                topic = _topic_of(r.main)
                marks[topic] = max(marks.get(topic, ""), r.main)
            state = replace(state, routed=reservations[-1].main, generation=generation, marks=marks)
        return state

    def mark(self, main: str, generation: int) -> GroupState:
        """The MQ consumer finished ``main`` (and every earlier message of the key in its
        storage topic) in seek generation ``generation``."""
        if generation < self.generation:
            return self  # read before a seek: the seek's generation decides
        if generation > self.generation:
            return replace(self, routed="", generation=generation, marks={_topic_of(main): main})
        if main <= self.marks.get(_topic_of(main), ""):
            return self
        return replace(self, marks={**self.marks, _topic_of(main): main})

    def finished(self, main: str, generation: int) -> bool:
        """Whether a mark says the MQ consumer finished ``main`` in this generation."""
        return generation == self.generation and main <= self.marks.get(_topic_of(main), "")

    def consume(self, queue: Queue, n: int, main: str) -> GroupState:
        q = self.queue(queue)
        assert n == q.c.n + 1, "offsets are consumed in order"
        nq = replace(q, c=Pos(n, main))
        if queue == RQ:
            head = self.head if self.head is not None and self.head.n != n else None
            return replace(self, rq=nq, head=head)
        return replace(self, dlq=nq)

    def retry_later(self, head: Head) -> GroupState:
        return replace(self, head=head)

    def skip_before(self, skip_before_ms: int) -> GroupState:
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
    def from_json(cls, text: str, version: int) -> GroupState:
        raw = json.loads(text)
        head = raw.get("head")
        return cls(
            rq=QueueState.from_item(raw.get("rq")),
            dlq=QueueState.from_item(raw.get("dlq")),
            routed=str(raw.get("routed", "")),
            generation=int(raw.get("gen", 0)),
            head=None
            if head is None
            else Head(
                int(head[0]),
                int(head[1]),
                int(head[2]),
                head[3],
                None if head[4] is None else int(head[4]),
            ),
            pending={
                role: tuple(Reservation.from_item(r) for r in rs)
                for role, rs in (raw.get("pending") or {}).items()
            },
            marks={str(k): str(v) for k, v in (raw.get("marks") or {}).items()},
            replays={str(k): str(v) for k, v in (raw.get("replays") or {}).items()},
            version=version,
        )


# -- decisions (pure) -----------------------------------------------------------------------


class MainAction(Enum):
    #: routed before (a retried batch, or a record read twice): nothing to do
    SKIP = "skip"
    #: routed before, and its put may not have landed: put the reserved entry again
    REPUT = "reput"
    #: the key is blocked: behind the pending ones
    FOLLOW_RQ = "follow_rq"
    FOLLOW_DLQ = "follow_dlq"
    DELIVER = "deliver"


def decide_main(
    state: GroupState,
    *,
    main: str,
    message_id: str,
    generation: int,
    skip_before_ms: int,
    ordered: bool,
) -> MainAction:
    """What the MQ consumer does with a matching message of a key in ``state``."""
    if state.generation == generation:
        mine = state.reserved("mq")
        if mine and mine[-1].message_id == message_id and mine[-1].main == main:
            return MainAction.REPUT
    # positions compare within one storage topic only: the taps of a topic's storage topics
    # run side by side, so a key's later storage topic may route before its earlier one
    if state.finished(main, generation):
        return MainAction.SKIP
    if ordered:
        # RQ first: while RQ holds the key, DLQ entries of it are older than anything in RQ
        # only until RQ drains into them, so a new message must queue behind RQ's entries.
        if state.rq.blocks(skip_before_ms):
            return MainAction.FOLLOW_RQ
        if state.dlq.blocks(skip_before_ms):
            return MainAction.FOLLOW_DLQ
    return MainAction.DELIVER


class RetryAction(Enum):
    #: consumed before (a duplicate record, or a retried batch)
    STALE = "stale"
    #: consumed by a move to DLQ whose put may not have landed: put the DLQ entry again
    REPUT = "reput"
    #: an earlier offset of the key is missing from the stream: repair it first
    GAP = "gap"
    #: published before the subscription's seek time: consumed without delivery
    SKIP = "skip"
    #: an older message of the key is dead-lettered: behind it in DLQ
    FOLLOW_DLQ = "follow_dlq"
    #: attempts used up (the policy allows fewer than were made): to DLQ
    EXHAUSTED = "exhausted"
    WAIT = "wait"
    DELIVER = "deliver"


@dataclass(frozen=True)
class RetryDecision:
    action: RetryAction
    #: attempts made so far, and when the next is due
    attempts: int = 0
    due_ms: int = 0


def decide_retry(
    state: GroupState,
    entry: Entry,
    *,
    policy: RetryPolicy,
    skip_before_ms: int,
    ordered: bool,
    now_ms: int,
) -> RetryDecision:
    """What the RQ consumer does with ``entry`` of a key in ``state``."""
    consumed = state.rq.c.n
    if entry.n <= consumed or entry.n > state.rq.p.n:
        moved = state.reserved("rq")
        if (
            moved
            and moved[-1].origin_n == entry.n
            and moved[-1].message_id == entry.message.message_id
        ):
            return RetryDecision(RetryAction.REPUT)
        return RetryDecision(RetryAction.STALE)
    if entry.n > consumed + 1:
        return RetryDecision(RetryAction.GAP)
    # a replayed entry counts as published when it was replayed: a seek before the replay
    # must not skip what the replay was asked for
    published = entry.at_ms if entry.reason == REPLAYED else entry.message.published_at_ms
    if published < skip_before_ms:
        return RetryDecision(RetryAction.SKIP)
    if ordered and state.dlq.blocks(skip_before_ms) and entry.main > state.dlq.c.m:
        # DLQ holds an older message of the key (entries reach DLQ in key order, so one newer
        # than DLQ's consumed mark is newer than DLQ's head): never overtake it.
        return RetryDecision(RetryAction.FOLLOW_DLQ, attempts=entry.attempts)
    head = state.head
    attempts, due = (
        (head.attempts, head.due_ms)
        if head is not None and head.n == entry.n
        else (entry.attempts, entry.due_ms)
    )
    if attempts >= policy.max_attempts:
        return RetryDecision(RetryAction.EXHAUSTED, attempts=attempts)
    if now_ms < due:
        return RetryDecision(RetryAction.WAIT, attempts=attempts, due_ms=due)
    return RetryDecision(RetryAction.DELIVER, attempts=attempts, due_ms=due)


class Outcome(Enum):
    DONE = "done"
    RETRY = "retry"
    DEAD = "dead"


def judge(result: DeliveryResult, policy: RetryPolicy, attempt: int) -> Outcome:
    """What attempt ``attempt`` (1-based) of a delivery with ``result`` leads to."""
    if result.ok:
        return Outcome.DONE
    if policy.retries(result) and attempt < policy.max_attempts:
        return Outcome.RETRY
    return Outcome.DEAD


# -- delivery -------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeliveryResult:
    status: int | None = None
    #: "timeout" (no answer in time, or no connection), "redirect" never: a 3xx is a status
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300

    @property
    def reason(self) -> str:
        return f"http_{self.status}" if self.status is not None else self.error or "error"


@dataclass(frozen=True)
class DeliveryRequest:
    endpoint: str
    body: bytes
    headers: Mapping[str, str]
    message_id: str
    ordering_key: str
    attempt: int


class Deliverer(Protocol):
    """Sends one message to an endpoint; never raises for what the endpoint does."""

    def deliver(self, request: DeliveryRequest) -> DeliveryResult: ...


def delivery_request(
    subscription: str, endpoint: str, message: Message, attempt: int
) -> DeliveryRequest:
    body = {
        "id": message.message_id,
        "topic": message.topic,
        "payload": base64.b64encode(message.payload).decode("ascii"),
        "qos": message.qos,
        "retain": message.retain,
        "ordering_key": message.ordering_key,
        "subscription": subscription,
        "properties": message.properties,
        "published_at": message.published_at_ms,
    }
    headers = {
        "Content-Type": "application/json",
        "User-Agent": "shoal-push/1",
        "Shoal-Message-Id": message.message_id,
        "Shoal-Attempt": str(attempt),
        # an ordering key is any string; a header value is latin-1 without controls
        "Shoal-Ordering-Key": quote(message.ordering_key, safe=""),
        "Shoal-Subscription": subscription,
    }
    return DeliveryRequest(
        endpoint=endpoint,
        body=json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode(),
        headers=headers,
        message_id=message.message_id,
        ordering_key=message.ordering_key,
        attempt=attempt,
    )


class HttpDeliverer:
    """POSTs with requests: timeouts, no redirects, no proxies from the environment, and at
    most ``MAX_RESPONSE_BYTES`` of the answer read. The endpoint is checked again here."""

    def __init__(
        self,
        policy: EndpointPolicy,
        *,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        read_timeout_s: float = READ_TIMEOUT_S,
        pool_size: int = 32,
    ) -> None:
        self.policy = policy
        self.timeout = (connect_timeout_s, read_timeout_s)
        self.session = requests.Session()
        # a proxy, netrc or CA bundle from the function's environment must not redirect pushes
        self.session.trust_env = False
        adapter = requests.adapters.HTTPAdapter(pool_connections=pool_size, pool_maxsize=pool_size)
        self.session.mount("https://", adapter)
        self.session.mount("http://", adapter)

    def deliver(self, request: DeliveryRequest) -> DeliveryResult:
        try:
            self.policy.validate(request.endpoint)
        except InvalidEndpoint:
            return DeliveryResult(error="endpoint_refused")
        try:
            with self.session.post(
                request.endpoint,
                data=request.body,
                headers=dict(request.headers),
                timeout=self.timeout,
                allow_redirects=False,
                stream=True,
            ) as response:
                # bounded: the endpoint's answer is not ours to buffer
                response.raw.read(MAX_RESPONSE_BYTES, decode_content=False)
                return DeliveryResult(status=response.status_code)
        except (requests.Timeout, requests.ConnectionError):
            return DeliveryResult(error="timeout")
        except requests.RequestException:
            return DeliveryResult(error="request_failed")
