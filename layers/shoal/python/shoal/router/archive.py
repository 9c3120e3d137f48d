"""The archive: every batch the router consumes, as JSON lines in S3.

Objects are partitioned ``messages/topic=<composite>/date=<YYYY-MM-DD>/hour=<HH>/`` by the
message's publish time (UTC), and named after the stream, shard and first and last sequence
number of the batch, so a retried batch overwrites its own objects instead of adding copies.
A batch that Lambda splits differently on a retry (bisect) can archive a message twice under
another name; every line carries ``message_id`` and ``sequence_number``, which the pipeline
deduplicates on. A record that is not a Shoal record is archived under ``quarantine/`` rather
than failing the batch: a poison record must not block its shard.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from shoal.aws import clients
from shoal.composite.model import storage_of
from shoal.core.config import Config
from shoal.delivery.model import ArchiveLine
from shoal.records import MalformedRecord, decode_record

if TYPE_CHECKING:
    from aws_lambda_powertools.utilities.parser.models import KinesisDataStreamRecord
    from mypy_boto3_s3 import S3Client

MESSAGES_PREFIX = "messages"
QUARANTINE_PREFIX = "quarantine"


def _hour(ms: int) -> tuple[str, str]:
    moment = datetime.fromtimestamp(ms / 1000, UTC)
    return moment.strftime("%Y-%m-%d"), moment.strftime("%H")


@dataclass
class _Archived:
    sequence_number: int
    #: (object partition, JSON line) for each message of the record
    lines: list[tuple[str, bytes]]


@dataclass
class ArchiveBatch:
    """The lines of one router invocation (one shard), grouped into deterministic objects."""

    stream_prefix: str
    stream: str = ""
    shard: str = ""
    records: list[_Archived] = field(default_factory=list)

    def add(self, record: KinesisDataStreamRecord) -> None:
        self.stream = record.eventSourceARN.rsplit("/", 1)[-1]
        self.shard = record.eventID.split(":", 1)[0]
        data = record.kinesis.data
        assert isinstance(data, bytes)
        sequence = record.kinesis.sequenceNumber
        arrival_ms = int(record.kinesis.approximateArrivalTimestamp * 1000)
        storage = storage_of(self.stream, self.stream_prefix)
        try:
            messages = decode_record(data)
        except MalformedRecord as exc:
            date, hour = _hour(arrival_ms)
            quarantined = {
                "stream": self.stream,
                "shard_id": self.shard,
                "sequence_number": sequence,
                "partition_key": record.kinesis.partitionKey,
                "arrival_ms": arrival_ms,
                "error": str(exc),
                "data": base64.b64encode(data).decode(),
            }
            self.records.append(
                _Archived(
                    int(sequence),
                    [(f"{QUARANTINE_PREFIX}/date={date}/hour={hour}", _json(quarantined))],
                )
            )
            return
        composite, index = storage or (self.stream, -1)
        lines: list[tuple[str, bytes]] = []
        for position, message in enumerate(messages):
            date, hour = _hour(message.published_at_ms)
            line: dict[str, Any] = {
                "message_id": message.message_id,
                "topic": message.topic,
                "composite_topic": composite,
                "storage_topic": index,
                "stream": self.stream,
                "shard_id": self.shard,
                "sequence_number": sequence,
                "position": position,
                "published_at": message.published_at_ms,
                "arrival_ms": arrival_ms,
                "qos": message.qos,
                "retain": message.retain,
                "ordering_key": message.ordering_key,
                # False: no explicit key (ordering_key is the topic); a shared group spreads
                # such messages over its lanes, so the audit checks their order per session only
                "keyed": message.keyed,
                "publisher": message.sub,
                "publisher_id": message.publisher_id,
                "publisher_seq": message.publisher_seq,
                "properties": message.properties,
                "payload": base64.b64encode(message.payload).decode(),
            }
            partition = f"{MESSAGES_PREFIX}/topic={composite}/date={date}/hour={hour}"
            lines.append((partition, _json(line)))
        self.records.append(_Archived(int(sequence), lines))

    def layout(
        self, before_sequence: int | None = None
    ) -> tuple[dict[str, bytes], dict[tuple[int, int], ArchiveLine]]:
        """Object key -> body for the records before ``before_sequence`` (the first failure:
        Lambda hands the batch back from there, and those records are archived then), and
        where each message's line lands in them: (sequence number, index in
        its record) -> line. Inbox items name these lines instead of copying the messages
        (``shoal.delivery.codec``, version 2); the same records give the same objects, so a
        retry that rewrites them leaves every line where an earlier attempt's items say."""
        kept = [
            r
            for r in self.records
            if before_sequence is None or r.sequence_number < before_sequence
        ]
        if not kept:
            return {}, {}
        first, last = kept[0].sequence_number, kept[-1].sequence_number
        bodies: dict[str, list[bytes]] = {}
        sizes: dict[str, int] = {}
        lines: dict[tuple[int, int], ArchiveLine] = {}
        for record in kept:
            for index, (partition, line) in enumerate(record.lines):
                key = f"{partition}/{self.stream}.{self.shard}.{first}-{last}.jsonl"
                offset = sizes.get(key, 0)
                bodies.setdefault(key, []).append(line)
                sizes[key] = offset + len(line)
                if not partition.startswith(QUARANTINE_PREFIX):
                    lines[(record.sequence_number, index)] = ArchiveLine(key, offset, len(line))
        return {key: b"".join(parts) for key, parts in bodies.items()}, lines


def _json(line: dict[str, Any]) -> bytes:
    return json.dumps(line, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


class ArchiveWriter:
    def __init__(self, s3: S3Client, bucket: str, stream_prefix: str) -> None:
        self.s3 = s3
        self.bucket = bucket
        self.stream_prefix = stream_prefix

    @classmethod
    def from_config(cls, config: Config) -> ArchiveWriter:
        s3 = clients.client("s3", config.region)
        return cls(s3, config.buckets["archive"], config.stream_prefix)

    def batch(self) -> ArchiveBatch:
        return ArchiveBatch(self.stream_prefix)

    def write(self, objects: dict[str, bytes]) -> None:
        """Put each object; an error propagates so that Lambda retries the whole batch."""
        for key, body in objects.items():
            self.s3.put_object(
                Bucket=self.bucket, Key=key, Body=body, ContentType="application/x-ndjson"
            )
