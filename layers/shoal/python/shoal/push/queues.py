"""The queues of push subscriptions on Kinesis and Lambda: RQ and DLQ streams and their
records, reads by position (a reservation's source) and by scan, and the push function's event
source mappings (the push taps' and the retry queues')."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal

from botocore.exceptions import ClientError

from shoal.aws.clients import error_code
from shoal.aws.kinesis import PUSH_MAPPING, OutRecord, StreamInfo, Streams
from shoal.composite.model import StorageTopic
from shoal.core.clock import Clock
from shoal.core.errors import ServerBusy
from shoal.core.retry import backoff_s
from shoal.push.entries import Entry, Source, decode_entry, encode_entry, partition_key
from shoal.records import MalformedRecord, Message, decode_record

if TYPE_CHECKING:
    from mypy_boto3_kinesis import KinesisClient
    from mypy_boto3_lambda import LambdaClient


_PUT_ATTEMPTS = 3
PUT_BACKOFF_S = 0.05
PUT_BACKOFF_CAP_S = 0.4


class ReadBudgetExhausted(ServerBusy):
    """A scan used its reads before the shard's end (not an AWS failure)."""


@dataclass(frozen=True)
class ShardRecord:
    shard: str
    sequence_number: str
    arrival_ms: int
    data: bytes


StartingPosition = Literal["TRIM_HORIZON", "LATEST", "AT_TIMESTAMP"]


class Queues:
    """RQ/DLQ streams and records, reads by position, and the push function's mappings."""

    def __init__(self, streams: Streams, clock: Clock) -> None:
        self.streams = streams
        self.clock = clock

    @property
    def kinesis(self) -> KinesisClient:
        return self.streams.kinesis

    @property
    def awslambda(self) -> LambdaClient:
        return self.streams.awslambda

    # -- streams --

    def ensure(self, storage: StorageTopic, wait_s: float) -> StreamInfo:
        return self.streams.ensure_stream(storage.stream, storage.partitions, wait_s=wait_s)

    def stream_arn(self, stream: str) -> str | None:
        summary = self._summary(stream)
        return None if summary is None else str(summary["StreamARN"])

    def delete_stream(self, stream: str) -> None:
        try:
            self.kinesis.delete_stream(StreamName=stream, EnforceConsumerDeletion=True)
        except ClientError as exc:
            if error_code(exc) == "ResourceNotFoundException":
                return
            if error_code(exc) == "ResourceInUseException" and self._status(stream) in (
                None,
                "DELETING",
            ):
                return
            # still being created (or resharded): a repeated delete finds it ready
            raise ServerBusy("the stream could not be deleted yet; retry") from exc

    def _status(self, stream: str) -> str | None:
        summary = self._summary(stream)
        return None if summary is None else str(summary["StreamStatus"])

    def _summary(self, stream: str) -> Mapping[str, Any] | None:
        """The stream's description summary; None when it does not exist."""
        try:
            answer = self.kinesis.describe_stream_summary(StreamName=stream)
        except ClientError as exc:
            if error_code(exc) == "ResourceNotFoundException":
                return None
            raise ServerBusy("the stream could not be described; retry") from exc
        return answer["StreamDescriptionSummary"]

    def shards(self, stream: str) -> list[str]:
        """Open shard ids in hash order (partition j is the j-th)."""
        shards: list[Any] = []
        try:
            response = self.kinesis.list_shards(StreamName=stream)
            shards.extend(response["Shards"])
            while response.get("NextToken"):
                response = self.kinesis.list_shards(NextToken=response["NextToken"])
                shards.extend(response["Shards"])
        except ClientError as exc:
            raise ServerBusy("the stream's shards could not be listed; retry") from exc
        open_shards = [
            s for s in shards if "EndingSequenceNumber" not in s.get("SequenceNumberRange", {})
        ]
        open_shards.sort(key=lambda s: int(s["HashKeyRange"]["StartingHashKey"]))
        return [str(s["ShardId"]) for s in open_shards]

    # -- records --

    def put(self, storage: StorageTopic, entry: Entry) -> None:
        """Put one entry in its key's shard; raises ServerBusy if it would not go in.

        A put that timed out may have landed and is put again: the consumer drops an offset it
        has seen, so a duplicate costs nothing but the record.
        """
        key = entry.ordering_key
        record = OutRecord(
            data=encode_entry(entry),
            partition_key=partition_key(key),
            explicit_hash_key=storage.starting_key(storage.partition_for(key)),
        )
        for attempt in range(_PUT_ATTEMPTS):
            if attempt:
                self.clock.sleep(backoff_s(attempt, PUT_BACKOFF_S, PUT_BACKOFF_CAP_S))
            if self.streams.put_record(storage.stream, record).ok:
                return
        raise ServerBusy(f"the {entry.queue} entry could not be put; retry")

    def read_at(self, stream: str, shard: str, sequence_number: str) -> bytes | None:
        """The data of one record, or None when the stream no longer holds it."""
        try:
            iterator = self.kinesis.get_shard_iterator(
                StreamName=stream,
                ShardId=shard,
                ShardIteratorType="AT_SEQUENCE_NUMBER",
                StartingSequenceNumber=sequence_number,
            )["ShardIterator"]
            records = self.kinesis.get_records(ShardIterator=iterator, Limit=1)["Records"]
        except ClientError as exc:
            if error_code(exc) in ("ResourceNotFoundException", "InvalidArgumentException"):
                return None
            raise ServerBusy("a record could not be read back; retry") from exc
        if not records or str(records[0]["SequenceNumber"]) != sequence_number:
            return None
        return bytes(records[0]["Data"])

    def read_message(self, source: Source) -> Message | None:
        """A message read again from where a reservation says it is (None: gone or unreadable)."""
        data = self.read_at(source.stream, source.shard, source.sequence_number)
        if data is None:
            return None
        try:
            if source.kind == "queue":
                return decode_entry(data).message
            return decode_record(data)[source.index]
        except (MalformedRecord, IndexError):
            return None

    def scan(
        self,
        stream: str,
        shard: str,
        *,
        after: str | None = None,
        since_ms: int | None = None,
        max_calls: int = 20,
    ) -> Iterator[ShardRecord]:
        """Records of one shard in order: after a sequence number, from a time, or all.

        Stops at the shard's end, or after ``max_calls`` reads (raising ServerBusy, so that a
        caller never mistakes a partial read for the whole shard).
        """
        args: dict[str, Any] = {"StreamName": stream, "ShardId": shard}
        if after is not None:
            args |= {"ShardIteratorType": "AFTER_SEQUENCE_NUMBER", "StartingSequenceNumber": after}
        elif since_ms is not None and since_ms > 0:
            args |= {
                "ShardIteratorType": "AT_TIMESTAMP",
                "Timestamp": datetime.fromtimestamp(since_ms / 1000, UTC),
            }
        else:
            args["ShardIteratorType"] = "TRIM_HORIZON"
        try:
            iterator: str | None = self.kinesis.get_shard_iterator(**args)["ShardIterator"]
            for _ in range(max_calls):
                if iterator is None:
                    return
                response = self.kinesis.get_records(ShardIterator=iterator, Limit=1000)
                for r in response["Records"]:
                    yield ShardRecord(
                        shard=shard,
                        sequence_number=str(r["SequenceNumber"]),
                        arrival_ms=int(r["ApproximateArrivalTimestamp"].timestamp() * 1000),
                        data=bytes(r["Data"]),
                    )
                if not response["Records"] and response.get("MillisBehindLatest", 0) == 0:
                    return
                iterator = response.get("NextShardIterator")
        except ClientError as exc:
            raise ServerBusy("the queue could not be read; retry") from exc
        raise ReadBudgetExhausted("the queue is too long to read in one request; retry")

    # -- event source mappings --

    def mappings(self, stream_arn: str, function: str) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = []
        kwargs: dict[str, Any] = {"EventSourceArn": stream_arn, "FunctionName": function}
        try:
            while True:
                response = self.awslambda.list_event_source_mappings(**kwargs)
                found.extend(dict(m) for m in response.get("EventSourceMappings", []))
                if not response.get("NextMarker"):
                    return sorted(found, key=lambda m: str(m["UUID"]))
                kwargs["Marker"] = response["NextMarker"]
        except ClientError as exc:
            raise ServerBusy("event source mappings could not be listed; retry") from exc

    def create_mapping(
        self,
        stream_arn: str,
        function: str,
        *,
        parallelism: int,
        start: StartingPosition,
        at_ms: int = 0,
    ) -> str:
        options: dict[str, Any] = {
            **PUSH_MAPPING,
            "ParallelizationFactor": parallelism,
            "StartingPosition": start,
        }
        if start == "AT_TIMESTAMP":
            options["StartingPositionTimestamp"] = datetime.fromtimestamp(at_ms / 1000, UTC)
        try:
            created = self.awslambda.create_event_source_mapping(
                EventSourceArn=stream_arn, FunctionName=function, **options
            )
        except ClientError as exc:
            raise ServerBusy("the event source mapping could not be created; retry") from exc
        return str(created["UUID"])

    def ensure_mapping(
        self,
        stream_arn: str,
        function: str,
        *,
        parallelism: int,
        start: StartingPosition,
        at_ms: int = 0,
    ) -> str:
        """The one mapping of ``function`` on the stream, created if missing (extras removed)."""
        existing = self.mappings(stream_arn, function)
        if not existing:
            self.create_mapping(
                stream_arn, function, parallelism=parallelism, start=start, at_ms=at_ms
            )
            existing = self.mappings(stream_arn, function)
        keep, *extra = [str(m["UUID"]) for m in existing]
        for uuid in extra:
            self.delete_mapping(uuid)
        return keep

    def delete_mapping(self, uuid: str) -> None:
        try:
            self.awslambda.delete_event_source_mapping(UUID=uuid)
        except ClientError as exc:
            if error_code(exc) != "ResourceNotFoundException":
                raise ServerBusy("the event source mapping could not be deleted; retry") from exc

    def set_parallelism(self, uuid: str, parallelism: int) -> None:
        try:
            self.awslambda.update_event_source_mapping(UUID=uuid, ParallelizationFactor=parallelism)
        except ClientError as exc:
            raise ServerBusy("the event source mapping could not be changed; retry") from exc
