"""Composite topics as values, and the rules that need no AWS: names, partitions, routing.

A storage topic is a Kinesis stream of P shards with equal hash ranges. The router sends an
ordering key with stable 64-bit hash h to partition ``j = K*h % P + (h // P) % K``: with
B = P / K the topic's base partition count, ``j // K == h % B``, so a key stays in the same
block of partitions (and the same subscription shard for any S dividing B) in every storage
topic whose partitions grew by K. K follows the design: a new storage topic whose partition
count is a multiple of the previous base B gets ``K = new / B``, any other gets K = 1 (a new
base).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict

from shoal.aws.kinesis import even_starting_keys
from shoal.core.errors import InvalidPartitions, InvalidTopicName
from shoal.declarations import DEPLOYMENT

DEFAULT_TOPIC = DEPLOYMENT.default_topic
TOPIC_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: Kinesis' default shard quota per account in the largest regions
MAX_PARTITIONS = 500
#: how long a publisher trusts its cached copy of a topic
TOPIC_CACHE_TTL_MS = 1_000
#: how long after it is written a routing change takes effect: the TTL plus a clock-skew margin
EFFECTIVE_DELAY_MS = 2_000
#: the longest from a publisher choosing a storage topic (reading the produce pointer) to the
#: end of its put into it: the publish path starts no put later than this less one call's bound
#: (``shoal.publish.writer``), so the sealer need wait no longer after a switch (``shoal.drain``)
ROUTED_PUT_BOUND_MS = 10_000


def is_valid_topic_name(name: object) -> bool:
    return isinstance(name, str) and TOPIC_NAME.fullmatch(name) is not None


def validate_topic_name(name: object) -> str:
    if not isinstance(name, str) or not is_valid_topic_name(name):
        raise InvalidTopicName("a topic name is 1-64 of A-Z a-z 0-9 _ -")
    return name


def is_valid_partitions(partitions: object) -> bool:
    if not isinstance(partitions, int) or isinstance(partitions, bool):
        return False
    if not 1 <= partitions <= MAX_PARTITIONS:
        return False
    return partitions <= 3 or partitions % 4 == 0 or partitions % 6 == 0


def validate_partitions(partitions: object) -> int:
    if not isinstance(partitions, int) or not is_valid_partitions(partitions):
        raise InvalidPartitions(
            f"partitions must be 1, 2, 3, or a multiple of 4 or 6, at most {MAX_PARTITIONS}",
            allowed="1, 2, 3, or a multiple of 4 or 6",
            maximum=MAX_PARTITIONS,
        )
    return partitions


def next_k(previous: StorageTopic | None, partitions: int) -> int:
    """K of a new storage topic of ``partitions`` appended after ``previous``."""
    if previous is None:
        return 1
    base = previous.partitions // previous.k
    return partitions // base if partitions % base == 0 else 1


def stable_hash(key: str) -> int:
    """A 64-bit hash of an ordering key, the same in every process and release."""
    return int.from_bytes(
        hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big"
    )


def route(h: int, partitions: int, k: int) -> int:
    """The partition of hash ``h`` in a storage topic of ``partitions`` partitions and ``k``."""
    return k * h % partitions + (h // partitions) % k


def stream_name(prefix: str, topic: str, index: int) -> str:
    return f"{prefix}-{topic}-{index}"


def storage_of(stream: str, prefix: str) -> tuple[str, int] | None:
    """(composite topic, storage topic index) of a stream named "<prefix>-<topic>-<index>"."""
    if not stream.startswith(f"{prefix}-"):
        return None
    topic, _, index = stream[len(prefix) + 1 :].rpartition("-")
    return (topic, int(index)) if topic and index.isdigit() else None


@dataclass(frozen=True)
class StorageTopic:
    index: int
    stream: str
    partitions: int
    k: int
    #: starting hash keys when the stream's split is not the even one
    hash_keys: tuple[int, ...] | None = None

    def partition_for(self, ordering_key: str) -> int:
        return route(stable_hash(ordering_key), self.partitions, self.k)

    def starting_key(self, partition: int) -> int:
        """ExplicitHashKey for ``partition``: its shard's starting hash key."""
        keys = self.hash_keys or even_starting_keys(self.partitions)
        return keys[partition]

    def document(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "stream": self.stream,
            "partitions": self.partitions,
            "k": self.k,
        }

    def record(self) -> dict[str, Any]:
        """As the topics table holds it (``shoal.aws.tables.StorageTopicAttr``)."""
        out: dict[str, Any] = {
            "index": self.index,
            "stream": self.stream,
            "partitions": self.partitions,
            "k": self.k,
        }
        if self.hash_keys:
            # decimal strings: a 128-bit key is beyond DynamoDB's 38 digits of precision
            out["hash_keys"] = [str(k) for k in self.hash_keys]
        return out

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> StorageTopic:
        keys = record.get("hash_keys")
        return cls(
            index=int(record["index"]),
            stream=str(record["stream"]),
            partitions=int(record["partitions"]),
            k=int(record["k"]),
            hash_keys=tuple(int(k) for k in keys) if keys else None,
        )


@dataclass(frozen=True)
class CompositeTopic:
    name: str
    version: int
    produce_pointer: int
    storage_topics: tuple[StorageTopic, ...]
    pending: StorageTopic | None = None
    effective_at_ms: int = 0

    @property
    def created(self) -> bool:
        return bool(self.storage_topics)

    def producing(self, now_ms: int) -> StorageTopic | None:
        """The storage topic a publish at ``now_ms`` writes to; None before the topic exists."""
        if not self.storage_topics:
            return None
        if now_ms >= self.effective_at_ms:
            return self.storage_topics[self.produce_pointer]
        if self.produce_pointer == 0:
            return None
        return self.storage_topics[self.produce_pointer - 1]

    def storage_topic(self, stream: str) -> StorageTopic | None:
        return next((s for s in self.storage_topics if s.stream == stream), None)

    def document(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "produce_pointer": self.produce_pointer,
            "storage_topics": [s.document() for s in self.storage_topics],
        }

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> CompositeTopic:
        pending = record.get("pending")
        return cls(
            name=str(record["name"]),
            version=int(record.get("version", 0)),
            produce_pointer=int(record.get("produce_pointer", 0)),
            storage_topics=tuple(
                StorageTopic.from_record(s) for s in record.get("storage_topics") or []
            ),
            pending=StorageTopic.from_record(pending) if pending else None,
            effective_at_ms=int(record.get("effective_at_ms") or 0),
        )


@dataclass(frozen=True)
class Destination:
    """Where a publish of one MQTT topic name goes right now."""

    topic: CompositeTopic
    storage: StorageTopic


# --- request bodies (the admin function's) ---------------------------------------------------


class CreateTopic(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # Checked by the service, so a wrong type is invalid_topic_name / invalid_partitions too.
    name: Any = None
    partitions: Any = None


class AddStorageTopic(BaseModel):
    model_config = ConfigDict(extra="forbid")

    partitions: Any = None
