"""The archiver: the delivery-event log (``shoal.delivery.events``) written to S3 as JSON lines.

An event source mapping hands it large batches of one log shard (``ARCHIVER_MAPPING``). It
writes one object per hour the batch's events fall in, under the layout the pipeline reads::

    events/date=<YYYY-MM-DD>/hour=<HH>/<stream>.<shard>.<first>-<last>.jsonl

named, as ``shoal.router.archive`` names message objects, after the stream, shard and the
batch's first and last sequence numbers: a retried batch (the same records) writes the same
keys and overwrites its own objects, so a crash between two object writes leaves nothing
twice once the retry is done. A batch Lambda cuts differently on a retry (bisect) writes its
lines again under other names; they keep their ``seq`` and ``batch``, by which the audit
drops lines held twice.

Within a batch, a record whose batch digest and part an earlier record had (an invocation
retried after its append, recording the same batch) replaces it, as an object under the same
key was overwritten when each invocation wrote its own. A record no recorder wrote goes to
``quarantine/`` (with its place in the stream) rather than failing the batch: a poison record
must not block the log.

No BatchProcessor (unlike the router): an object holds lines of many records, so there is no
per-record success to report; the batch succeeds or fails whole, and a retry rewrites it.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from aws_lambda_powertools.utilities.data_classes import KinesisStreamEvent

from shoal.aws import clients
from shoal.core import metrics
from shoal.core.clock import Clock, SystemClock
from shoal.core.config import Config
from shoal.core.observability import count, lag
from shoal.delivery.events import EVENTS_PREFIX, MalformedLogRecord, decode_log_record

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

QUARANTINE_PREFIX = "quarantine"


@dataclass(frozen=True)
class _Lines:
    sequence_number: int
    partition: str
    lines: bytes


class EventArchiver:
    def __init__(
        self, s3: S3Client, bucket: str, clock: Clock | None = None, prefix: str = EVENTS_PREFIX
    ) -> None:
        self.s3 = s3
        self.bucket = bucket
        self.clock = clock or SystemClock()
        self.prefix = prefix

    @classmethod
    def from_config(cls, config: Config, clock: Clock | None = None) -> EventArchiver:
        return cls(clients.client("s3", config.region), config.buckets["archive"], clock)

    def objects(self, event: dict[str, Any]) -> dict[str, bytes]:
        """Object key -> body for one mapping batch (one shard, records in order)."""
        batch = KinesisStreamEvent(event)
        kept: dict[tuple[str, int], _Lines] = {}
        quarantined: list[_Lines] = []
        stream = shard = ""
        sequences: list[int] = []
        for record in batch.records:
            stream = record.event_source_arn.rsplit("/", 1)[-1]
            shard = record.event_id.split(":", 1)[0]
            sequence = int(record.kinesis.sequence_number)
            sequences.append(sequence)
            data = record.kinesis.data_as_bytes()
            try:
                decoded = decode_log_record(data)
            except MalformedLogRecord as exc:
                quarantined.append(
                    _quarantine(record, stream, shard, sequence, data, error=str(exc))
                )
                continue
            # a retried invocation's copy of its batch replaces the first (objects are then
            # ordered by sequence number: the copy stands where it was appended)
            key = (decoded.batch, decoded.part)
            kept.pop(key, None)
            kept[key] = _Lines(sequence, decoded.partition, decoded.lines)
        if not sequences:
            return {}
        name = f"{stream}.{shard}.{min(sequences)}-{max(sequences)}.jsonl"
        bodies: dict[str, list[bytes]] = {}
        for item in sorted(kept.values(), key=lambda lines: lines.sequence_number):
            bodies.setdefault(f"{self.prefix}/{item.partition}/{name}", []).append(item.lines)
        for item in quarantined:
            bodies.setdefault(f"{QUARANTINE_PREFIX}/{item.partition}/{name}", []).append(item.lines)
        return {key: b"".join(parts) for key, parts in bodies.items() if any(parts)}

    def handle(self, event: dict[str, Any]) -> dict[str, Any]:
        """Write the batch's objects; an S3 error propagates, and Lambda retries the batch
        (the same records write the same keys)."""
        records = event.get("Records") or ()
        if records:
            arrived = records[0].get("kinesis", {}).get("approximateArrivalTimestamp")
            if arrived is not None:
                lag(metrics.ARCHIVER_LAG, self.clock.now_ms() - int(float(arrived) * 1000))
        objects = self.objects(event)
        for key, body in objects.items():
            self.s3.put_object(
                Bucket=self.bucket, Key=key, Body=body, ContentType="application/x-ndjson"
            )
        lines = sum(b.count(b"\n") for k, b in objects.items() if k.startswith(self.prefix))
        count(metrics.ARCHIVED_EVENTS, lines)
        return {"batchItemFailures": []}


def _quarantine(
    record: Any, stream: str, shard: str, sequence: int, data: bytes, *, error: str
) -> _Lines:
    arrival_ms = int(record.kinesis.approximate_arrival_timestamp * 1000)
    moment = datetime.fromtimestamp(arrival_ms / 1000, UTC)
    line = {
        "stream": stream,
        "shard_id": shard,
        "sequence_number": str(sequence),
        "partition_key": record.kinesis.partition_key,
        "arrival_ms": arrival_ms,
        "error": error,
        "data": base64.b64encode(data).decode(),
    }
    body = json.dumps(line, separators=(",", ":")).encode() + b"\n"
    return _Lines(sequence, f"date={moment:%Y-%m-%d}/hour={moment:%H}", body)
