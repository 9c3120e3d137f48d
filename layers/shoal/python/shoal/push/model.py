"""A push subscription as it is kept: what it does (``Spec``: filter, endpoint, retry policy,
the topic it reads, its queues), its state and seek generation, its cursors in the storage
streams it reads (``shoal.push.store``, push taps), and the push taps of those streams."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from shoal.composite.model import StorageTopic, stream_name
from shoal.core.errors import (
    InvalidFilter,
    InvalidParallelism,
    InvalidRetryPolicy,
    InvalidSubscriptionName,
)
from shoal.push.endpoint import DeliveryResult
from shoal.topics.filters import SHARE_PREFIX, is_valid_filter

SUBSCRIPTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: Lambda's ParallelizationFactor ranges 1..10; the same bound caps keys delivered at once
MAX_PARALLELISM = 10
MAX_ATTEMPTS = 100
MAX_BACKOFF_S = 3600.0
MAX_MULTIPLIER = 10.0

Queue = Literal["rq", "dlq"]
RQ: Queue = "rq"
DLQ: Queue = "dlq"

#: a subscription's states
ACTIVE = "active"
CREATING = "creating"
DELETING = "deleting"

RETRY_CLASSES = frozenset({"4xx", "5xx", "timeout"})
DEFAULT_RETRY_ON: tuple[int | str, ...] = (429, "5xx", "timeout")


# -- the spec -------------------------------------------------------------------------------


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


# -- the subscription and its taps ----------------------------------------------------------


@dataclass(frozen=True)
class ShardCursor:
    sequence_number: str
    arrival_ms: int


@dataclass(frozen=True)
class Cursor:
    """A subscription's position in one storage stream."""

    from_ms: int
    shards: Mapping[str, ShardCursor] = field(default_factory=dict)

    def admits(self, shard: str, sequence_number: str, arrival_ms: int) -> bool:
        at = self.shards.get(shard)
        if at is not None and int(sequence_number) <= int(at.sequence_number):
            return False
        return arrival_ms >= self.from_ms

    def position_ms(self, shards: Iterable[str]) -> int:
        """No record of these shards that this subscription still needs arrived before."""
        return min(
            (self.shards[s].arrival_ms if s in self.shards else self.from_ms for s in shards),
            default=self.from_ms,
        )

    @classmethod
    def from_item(cls, raw: Mapping[str, Any]) -> Cursor:
        return cls(
            from_ms=int(raw.get("from", 0)),
            shards={
                shard: ShardCursor(str(c["s"]), int(c["t"]))
                for shard, c in (raw.get("shards") or {}).items()
            },
        )


@dataclass(frozen=True)
class PushSubscription:
    name: str
    spec: Spec
    parallelism: int
    state: str
    version: int
    generation: int
    skip_before_ms: int
    created_at_ms: int
    cursors: Mapping[str, Cursor]

    @property
    def active(self) -> bool:
        return self.state == ACTIVE

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> PushSubscription:
        """From its item (``shoal.push.store``), which holds a spec."""
        return cls(
            name=str(record["name"]),
            spec=Spec.from_json(record.get("spec") or "{}"),
            parallelism=int(record.get("parallelism") or 1),
            state=record.get("state") or CREATING,
            version=int(record.get("version") or 0),
            generation=int(record.get("generation") or 0),
            skip_before_ms=int(record.get("skip_before_ms") or 0),
            created_at_ms=int(record.get("created_at_ms") or 0),
            cursors={
                stream: Cursor.from_item(raw)
                for stream, raw in (record.get("cursors") or {}).items()
            },
        )

    def queue(self, queue: Queue, prefix: str) -> StorageTopic:
        """The storage topic of RQ or DLQ (one each; a composite topic of their own)."""
        return StorageTopic(
            index=0,
            stream=queue_stream(prefix, self.name, self.spec.incarnation, queue),
            partitions=self.spec.queue_partitions,
            k=1,
        )


def queue_stream(prefix: str, name: str, incarnation: str, queue: Queue) -> str:
    # "." appears in no composite topic name, so a queue's stream can never be a topic's
    return stream_name(prefix, f"{name}.{incarnation}.{queue}", 0)


def parse_queue_stream(prefix: str, stream: str) -> tuple[str, str, Queue] | None:
    """(subscription, incarnation, queue) of a queue's stream name; None for a storage stream."""
    head = f"{prefix}-"
    if not stream.startswith(head):
        return None
    parts = stream[len(head) :].rsplit("-", 1)[0].split(".")
    if len(parts) != 3 or parts[2] not in (RQ, DLQ):
        return None
    queue: Queue = RQ if parts[2] == RQ else DLQ
    return parts[0], parts[1], queue


@dataclass(frozen=True)
class Tap:
    stream: str
    topic: str
    storage_index: int
    members: frozenset[str]
    version: int
    #: lanes per shard the tap's mapping may run (at least its ParallelizationFactor)
    lanes: int = 1
    #: when each member joined (ms; the ordered drain's "began reading", ``shoal.drain``)
    joined: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def from_record(cls, stream: str, record: Mapping[str, Any]) -> Tap:
        """From its item (``shoal.push.store``): ``spec`` names the topic and storage topic
        index, ``members`` maps each member to when it joined."""
        info = json.loads(record.get("spec") or "{}")
        members: Mapping[str, Any] = record.get("members") or {}
        return cls(
            stream=stream,
            topic=str(info.get("topic", "")),
            storage_index=int(info.get("index", 0)),
            members=frozenset(members),
            version=int(record.get("version") or 0),
            # the tap item keeps its lanes in the subscription items' parallelism attribute
            lanes=int(record.get("parallelism") or 1),
            joined={name: int(at) for name, at in members.items()},
        )
