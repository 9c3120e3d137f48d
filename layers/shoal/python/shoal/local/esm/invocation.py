"""A function's side of a mapping: the event Lambda sends for a batch of one shard's records, and
what Lambda makes of the function's answer."""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from shoal.local.context import REGION
from shoal.local.provision import ACCOUNT_ID

#: invoke(function_name, event) -> the handler's return value; raises on a function error
Invoke = Callable[[str, dict[str, Any]], Any]
#: a synchronous invocation's payload limit, which also bounds a batch
MAX_PAYLOAD_BYTES = 6 * 1024 * 1024
#: the JSON of one record around its data, partition key and sequence number (measured: ~330)
RECORD_ENVELOPE_BYTES = 400


@dataclass(frozen=True)
class BatchOutcome:
    kind: Literal["success", "partial", "failure"]
    #: for "partial": the lowest sequence number the function reported as failed
    failed_from: int | None = None
    #: the function raised (Lambda's "Unhandled" function error)
    function_error: bool = False


SUCCESS = BatchOutcome("success")
FAILURE = BatchOutcome("failure")


def batch_outcome(
    response: Any, sequence_numbers: list[int], report_item_failures: bool
) -> BatchOutcome:
    """What Lambda makes of a function's return value for a batch of these sequence numbers."""
    if not report_item_failures or response is None:
        return SUCCESS
    if not isinstance(response, dict):
        return FAILURE
    failures = response.get("batchItemFailures")
    if failures is None:
        return SUCCESS
    if not isinstance(failures, list):
        return FAILURE
    if not failures:
        return SUCCESS
    in_batch = set(sequence_numbers)
    failed: list[int] = []
    for item in failures:
        identifier = item.get("itemIdentifier") if isinstance(item, dict) else None
        if not isinstance(identifier, str) or not identifier.strip().isdigit():
            return FAILURE
        # moto's sequence numbers are small counters, Kinesis' 56-digit ones: compare as ints.
        number = int(identifier)
        if number not in in_batch:
            return FAILURE
        failed.append(number)
    return BatchOutcome("partial", failed_from=min(failed))


@dataclass(frozen=True)
class StreamRecord:
    seq: int
    sequence_number: str
    partition_key: str
    data: bytes
    #: ApproximateArrivalTimestamp, seconds since the epoch
    arrival: float

    @classmethod
    def from_get_records(cls, raw: dict[str, Any]) -> StreamRecord:
        arrival = raw["ApproximateArrivalTimestamp"]
        if isinstance(arrival, datetime):
            arrival = arrival.timestamp()
        return cls(
            seq=int(raw["SequenceNumber"]),
            sequence_number=str(raw["SequenceNumber"]),
            partition_key=raw["PartitionKey"],
            data=bytes(raw["Data"]),
            arrival=float(arrival),
        )

    @property
    def size(self) -> int:
        """Roughly what this record adds to the event's JSON."""
        return (
            RECORD_ENVELOPE_BYTES
            + 4 * ((len(self.data) + 2) // 3)
            + len(self.partition_key)
            + 2 * len(self.sequence_number)
        )


def kinesis_event(
    records: list[StreamRecord],
    *,
    shard_id: str,
    stream_arn: str,
    region: str,
    role_arn: str,
) -> dict[str, Any]:
    """The event Lambda invokes a function with for a batch of one shard's records."""
    return {
        "Records": [
            {
                "kinesis": {
                    "kinesisSchemaVersion": "1.0",
                    "partitionKey": r.partition_key,
                    "sequenceNumber": r.sequence_number,
                    "data": base64.b64encode(r.data).decode("ascii"),
                    "approximateArrivalTimestamp": round(r.arrival, 3),
                },
                "eventSource": "aws:kinesis",
                "eventVersion": "1.0",
                "eventID": f"{shard_id}:{r.sequence_number}",
                "eventName": "aws:kinesis:record",
                "invokeIdentityArn": role_arn,
                "awsRegion": region,
                "eventSourceARN": stream_arn,
            }
            for r in records
        ]
    }


def event_of(
    raw_records: Sequence[Mapping[str, Any]], *, stream: str, shard_id: str
) -> dict[str, Any]:
    """The event for records as GetRecords answers them, from a stream of the emulated account
    (tests and benchmarks that invoke a stream consumer directly)."""
    return kinesis_event(
        [StreamRecord.from_get_records(dict(r)) for r in raw_records],
        shard_id=shard_id,
        stream_arn=f"arn:aws:kinesis:{REGION}:{ACCOUNT_ID}:stream/{stream}",
        region=REGION,
        role_arn=f"arn:aws:iam::{ACCOUNT_ID}:role/shoal-local-lambda",
    )


def iso_time(seconds: float) -> str:
    moment = datetime.fromtimestamp(seconds, UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def lane_of(partition_key: str, lanes: int) -> int:
    """The lane of a partition key: stable across processes (not Python's hash())."""
    if lanes == 1:
        return 0
    digest = hashlib.md5(partition_key.encode(), usedforsecurity=False).digest()
    return int.from_bytes(digest[:8], "big") % lanes
