"""Positions and queue entries: where a message is in its composite topic (its main position),
where it can be read again (``Source``), and an RQ or DLQ entry as its record carries it."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from shoal.push.model import DLQ, RQ, Queue
from shoal.records import MalformedRecord, Message, decode_record, record_partition_key

#: reasons a message is in the DLQ without an attempt of its own
BLOCKED = "ordering_key_blocked"
#: the reason of an RQ entry a replay of archived messages put there (``shoal.push.replay``):
#: a seek skips it by when it was replayed, not by when its message was published
REPLAYED = "replayed"


def main_position(storage_index: int, sequence_number: str, index: int) -> str:
    """A message's place in its composite topic, comparable as a string within one key."""
    return f"{storage_index:06d}:{int(sequence_number):060d}:{index:05d}"


def topic_of(main: str) -> str:
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
    """A queue record: the storage record format (``shoal.publish``) of its one message,
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
