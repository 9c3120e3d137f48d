"""The Kinesis record codec: what every storage-stream consumer shares.

A record holds messages of one ordering key from one request, in order: a JSON header line
(``{"v":1,"m":[...]}``, one entry per message, each naming its payload's length), then the
payloads one after another. Its partition key is the ordering key (or its digest): Lambda's
parallelization factor splits a shard into lanes by partition key, so one key's records stay
in one lane. A *seal* record of the ordered drain (``shoal.drain``) carries no message; every
decoder skips it.

A retained message is stored as one item keyed by its topic's digest (``Retained``,
``retained_key``): written by the publish path, read by subscribe.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

_RECORD_HEAD = b'{"v":1,"m":['


#: Kinesis' partition key is at most 256 characters; a longer ordering key goes by its digest
MAX_PARTITION_KEY = 256


_RECORD_TAIL = b"]}\n"


class MalformedRecord(ValueError):
    """A Kinesis record that is not a Shoal record."""


@dataclass(frozen=True)
class Message:
    """A published message as a storage topic holds it."""

    message_id: str
    topic: str
    payload: bytes
    qos: int
    retain: bool
    ordering_key: str
    published_at_ms: int
    sub: str
    publisher_id: str | None = None
    publisher_seq: int | None = None
    properties: dict[str, Any] = field(default_factory=dict)
    #: the publisher named its ordering key; an unkeyed message's key is its topic, and a
    #: shared group spreads such messages over its members (``shoal.groups.streams``, lanes)
    keyed: bool = True

    def header(self) -> bytes:
        meta: dict[str, Any] = {
            "id": self.message_id,
            "topic": self.topic,
            "qos": self.qos,
            "retain": self.retain,
            "key": self.ordering_key,
            "at": self.published_at_ms,
            "sub": self.sub,
            "n": len(self.payload),
        }
        if self.publisher_id is not None:
            meta["pid"] = self.publisher_id
            meta["seq"] = self.publisher_seq
        if self.properties:
            meta["props"] = self.properties
        if not self.keyed:
            meta["uk"] = 1
        return json.dumps(meta, separators=(",", ":"), ensure_ascii=False).encode()


def record_size(headers: Sequence[bytes], payload_bytes: int, partition_key: str) -> int:
    """The size Kinesis counts for a record holding these messages."""
    return (
        len(_RECORD_HEAD)
        + sum(len(h) for h in headers)
        + max(len(headers) - 1, 0)
        + len(_RECORD_TAIL)
        + payload_bytes
        + len(partition_key.encode())
    )


def record_partition_key(ordering_key: str) -> str:
    """The Kinesis partition key of a record of this ordering key: the key itself, or its
    digest when Kinesis cannot hold it (the lane of a parallelized mapping follows it)."""
    if 0 < len(ordering_key) <= MAX_PARTITION_KEY:
        return ordering_key
    return hashlib.blake2b(
        ordering_key.encode("utf-8", "surrogatepass"), digest_size=16
    ).hexdigest()


def encode_record(messages: Sequence[Message]) -> bytes:
    """Messages of one ordering key as one record: a JSON header line, then the payloads."""
    return (
        _RECORD_HEAD
        + b",".join(m.header() for m in messages)
        + _RECORD_TAIL
        + b"".join(m.payload for m in messages)
    )


def decode_record(data: bytes) -> list[Message]:
    if data.startswith(b'{"seal":'):
        # a seal of the ordered drain (``shoal.drain``): a control record, no message
        return []
    head, newline, body = data.partition(b"\n")
    if not newline:
        raise MalformedRecord("no header line")
    try:
        doc = json.loads(head)
        if not isinstance(doc, dict) or doc.get("v") != 1:
            raise MalformedRecord("unknown record version")
        messages: list[Message] = []
        offset = 0
        for meta in doc["m"]:
            size = int(meta["n"])
            payload = body[offset : offset + size]
            offset += size
            messages.append(
                Message(
                    message_id=str(meta["id"]),
                    topic=str(meta["topic"]),
                    payload=payload,
                    qos=int(meta["qos"]),
                    retain=bool(meta["retain"]),
                    ordering_key=str(meta["key"]),
                    published_at_ms=int(meta["at"]),
                    sub=str(meta["sub"]),
                    publisher_id=meta.get("pid"),
                    publisher_seq=meta.get("seq"),
                    properties=dict(meta.get("props") or {}),
                    # records written before the flag existed: keyed (their order is kept)
                    keyed=not meta.get("uk"),
                )
            )
    except (ValueError, KeyError, TypeError) as exc:
        raise MalformedRecord(str(exc)) from exc
    if offset != len(body):
        raise MalformedRecord("payload lengths do not add up")
    return messages


#: every seal record starts so: a router tells one by a prefix, without parsing
SEAL_MARK = b'{"seal":'


def seal_record(stream: str, shard: str, at_ms: int) -> bytes:
    """The data of the seal put into ``shard`` of ``stream``: a record with no message."""
    header = {"seal": {"stream": stream, "shard": shard, "at": at_ms}, "v": 1, "m": []}
    return json.dumps(header, separators=(",", ":")).encode() + b"\n"


def is_seal(data: bytes) -> bool:
    return data.startswith(SEAL_MARK)


def retained_key(topic: str) -> str:
    return hashlib.sha256(topic.encode()).hexdigest()


#: the retained item of a cleared topic (a tombstone, which keeps the clear's time so that a
#: late retry of an older retained publish stays out): no message retained
CLEARED = "cleared"


@dataclass(frozen=True)
class Retained:
    """One stored retained message (the item's attributes, ``shoal.aws.tables.RetainedModel``)."""

    topic: str
    composite_topic: str
    message_id: str
    payload: bytes
    qos: int
    published_at_ms: int
    #: the message's properties as JSON text
    properties: str | None = None
    publisher: str | None = None

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Retained:
        return cls(
            topic=str(record["topic"]),
            composite_topic=str(record["composite_topic"]),
            message_id=str(record["message_id"]),
            payload=bytes(record["payload"]),
            qos=int(record["qos"]),
            published_at_ms=int(record["published_at_ms"]),
            properties=record.get("properties"),
            publisher=record.get("publisher"),
        )
