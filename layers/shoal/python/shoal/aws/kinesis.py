"""The Kinesis adapter: storage streams, the router's event source mappings, records in and out.

The only module (with ``shoal.router.archive``) that speaks to Kinesis and Lambda. Client
errors become ``shoal.core.errors`` here; a failed put is an outcome, not an exception,
because the publish path retries exactly the records that failed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeVar

from botocore.exceptions import BotoCoreError, ClientError

from shoal.aws import clients
from shoal.aws.clients import error_code
from shoal.core.clock import Clock, SystemClock
from shoal.core.config import Config
from shoal.core.errors import ServerBusy, StreamConflict
from shoal.core.observability import logger

if TYPE_CHECKING:
    from mypy_boto3_kinesis import KinesisClient
    from mypy_boto3_lambda import LambdaClient

#: Kinesis maps a record to a shard by a 128-bit hash key
HASH_SPACE = 1 << 128
#: Kinesis' limits: a record's data plus partition key, and one PutRecords call
MAX_RECORD_BYTES = 1024 * 1024
T = TypeVar("T")

MAX_PUT_RECORDS = 500
MAX_PUT_RECORDS_BYTES = 5 * 1024 * 1024

#: Every mapping of Shoal's (the router's, push's): unlimited retries and no maximum record age
#: keep DESIGN.md's property 1 (a message is never dropped): a batch that cannot be processed
#: blocks its shard, which the IteratorAge alarm reports, instead of being skipped. Shoal's
#: functions never fail on a malformed record (they archive or dead-letter it), so only an AWS
#: outage blocks a shard. With unlimited retries an on-failure destination would never be
#: used, so none is configured.
NEVER_SKIP: dict[str, Any] = {
    "FunctionResponseTypes": ["ReportBatchItemFailures"],
    "BisectBatchOnFunctionError": True,
    "MaximumRetryAttempts": -1,
    "MaximumRecordAgeInSeconds": -1,
}

#: How the router consumes a storage stream; the invocation sizes of every mapping are
#: declared here, chosen from bench/'s router figures (docs/operations.md, "Router
#: throughput"):
#:
#: - BatchSize 500: a batch writes one inbox item per matching session, and an item costs at
#:   least one write unit, so more records a batch put more deliveries in each item. At the
#:   bench's 12 deliveries a message over 200 sessions, 100 records made 6 deliveries an item
#:   (0.17 WCU each: the floor of one unit an item) and 500 make 30 (0.10). Lambda reads a
#:   shard about once a second, so at a shard's full rate (1,000 records/s) 100 a batch would
#:   need ten invocations a second, one after the other.
#: - MaximumBatchingWindowInSeconds 0: a light shard is delivered at once; a busy one fills
#:   its batches between polls anyway.
#: - ParallelizationFactor 1: one Kinesis record may carry several ordering keys of its
#:   partition (see shoal.publish.writer), so only whole-shard order keeps per-key order.
ROUTER_MAPPING: dict[str, Any] = {
    "StartingPosition": "TRIM_HORIZON",
    "BatchSize": 500,
    "MaximumBatchingWindowInSeconds": 0,
    "ParallelizationFactor": 1,
    **NEVER_SKIP,
}

#: How push reads its tap streams (``shoal.push.queues``; its ParallelizationFactor is the
#: subscription's lanes): 100 records, since each is an HTTP call to the subscriber's
#: endpoint and a batch must end well within the function's timeout.
PUSH_MAPPING: dict[str, Any] = {
    "BatchSize": 100,
    "MaximumBatchingWindowInSeconds": 0,
    **NEVER_SKIP,
}

#: How the archiver reads the event log (``shoal.delivery.archiver``): large batches, since each
#: invocation writes one S3 object per hour its events fall in, whatever its size. A batch ends
#: at 10,000 records, at Lambda's 6 MB invocation payload (records in base64 with their
#: envelope: about 1,100 records of a 100-message page's 3.6 KB), or after 60 s, whichever
#: comes first; each object then holds the events of hundreds to thousands of calls, where
#: each call wrote its own before (issue 18). A batch that fails is bisected and retried forever
#: (NEVER_SKIP, as the router's): the archiver fails only when S3 does, and a skipped batch
#: would be events the audit never sees. The IteratorAge alarm reports a stuck shard.
ARCHIVER_MAPPING: dict[str, Any] = {
    "StartingPosition": "TRIM_HORIZON",
    "BatchSize": 10_000,
    "MaximumBatchingWindowInSeconds": 60,
    "ParallelizationFactor": 1,
    **NEVER_SKIP,
}

#: the router's enhanced fan-out consumer of a storage stream (the option
#: ``SHOAL_ENHANCED_FAN_OUT=router``: docs/operations.md, "Latency"): one per stream, by this name
#: (names are per stream; the grants name it: ``stream/<prefix>-*/consumer/router:*``)
ROUTER_CONSUMER = "router"

KINESIS_THROTTLED = frozenset(
    {
        "ProvisionedThroughputExceededException",
        "LimitExceededException",
        "KMSThrottlingException",
        "ThrottlingException",
        "TooManyRequestsException",
        "InternalFailure",
        "ServiceUnavailable",
    }
)


def _failed(exc: ClientError) -> PutOutcome:
    code = error_code(exc) or "ClientError"
    # a throttled or refused call (4xx) wrote nothing; a server error may have written it
    status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return PutOutcome(error_code=code, ambiguous=not 400 <= status < 500)


def even_starting_keys(partitions: int) -> list[int]:
    """Each shard's starting hash key when ``partitions`` shards split the hash space evenly."""
    step = HASH_SPACE // partitions
    return [i * step for i in range(partitions)]


@dataclass(frozen=True)
class StreamInfo:
    arn: str
    #: the open shards' starting hash keys, in hash order: partition j is shard j
    starting_keys: tuple[int, ...]


@dataclass(frozen=True)
class OutRecord:
    data: bytes
    partition_key: str
    explicit_hash_key: int

    @property
    def size(self) -> int:
        return len(self.data) + len(self.partition_key.encode())


@dataclass(frozen=True)
class PutOutcome:
    shard_id: str | None = None
    sequence_number: str | None = None
    error_code: str | None = None
    #: the record may have been written all the same (a timeout, a 5xx on the whole call);
    #: retrying it could store it twice, so only a caller that can read back may
    ambiguous: bool = False

    @property
    def ok(self) -> bool:
        return self.error_code is None


class Streams:
    """Storage streams and their router mappings, over boto3 Kinesis and Lambda clients."""

    def __init__(
        self,
        kinesis: KinesisClient,
        awslambda: LambdaClient,
        clock: Clock | None = None,
        *,
        writer: KinesisClient | None = None,
    ) -> None:
        self.kinesis = kinesis
        self.awslambda = awslambda
        self.clock = clock or SystemClock()
        #: puts go through a client that never retries by itself: a retried put after a
        #: timeout may store a record twice, so only the publish path decides what to retry
        self.writer = writer or kinesis

    @classmethod
    def from_config(cls, config: Config, clock: Clock | None = None) -> Streams:
        # the writer's bounded timeouts size the publish lease (``PUT_CALL_BOUND_MS``), so a
        # retry after a crash waits seconds, not a minute
        return cls(
            clients.client("kinesis", config.region, "streams"),
            clients.client("lambda", config.region, "streams"),
            clock,
            writer=clients.client("kinesis", config.region, "kinesis_writer"),
        )

    # -- storage streams -----------------------------------------------------------------

    def ensure_stream(self, name: str, partitions: int, *, wait_s: float = 20.0) -> StreamInfo:
        """Create the stream unless it exists, wait until it is active, and read its shards.

        Idempotent, so a topic creation that crashed after creating its stream converges when
        repeated. A stream of that name with another shard count is a conflict, never reused.
        """
        try:
            self.kinesis.create_stream(
                StreamName=name,
                ShardCount=partitions,
                StreamModeDetails={"StreamMode": "PROVISIONED"},
            )
        except ClientError as exc:
            if error_code(exc) in KINESIS_THROTTLED:
                raise ServerBusy("Kinesis refused to create the stream now; retry") from exc
            if error_code(exc) != "ResourceInUseException":
                raise
        deadline = self.clock.now_ms() + int(wait_s * 1000)
        while True:
            summary = self.kinesis.describe_stream_summary(StreamName=name)[
                "StreamDescriptionSummary"
            ]
            if summary["StreamStatus"] == "ACTIVE":
                break
            if self.clock.now_ms() >= deadline:
                raise ServerBusy(f"stream {name} is still {summary['StreamStatus']}; retry")
            self.clock.sleep(1.0)
        starts = sorted(
            int(shard["HashKeyRange"]["StartingHashKey"])
            for shard in self._shards(name)
            if "EndingSequenceNumber" not in shard.get("SequenceNumberRange", {})
        )
        if len(starts) != partitions or (starts and starts[0] != 0):
            raise StreamConflict(
                f"stream {name} exists with {len(starts)} open shards, not {partitions}",
                stream=name,
            )
        return StreamInfo(arn=summary["StreamARN"], starting_keys=tuple(starts))

    def _shards(self, name: str) -> list[dict[str, Any]]:
        shards: list[dict[str, Any]] = []
        response = self.kinesis.list_shards(StreamName=name)
        shards.extend(response["Shards"])  # type: ignore[arg-type]
        while response.get("NextToken"):
            response = self.kinesis.list_shards(NextToken=response["NextToken"])
            shards.extend(response["Shards"])  # type: ignore[arg-type]
        return shards

    # -- the router's event source mappings ------------------------------------------------

    def ensure_router_mapping(self, stream_arn: str, function_name: str) -> str:
        """The UUID of the one mapping from ``stream_arn`` to ``function_name``; idempotent.

        Lambda refuses a second Kinesis mapping for the same function and stream; an emulator
        may not, so racing creators converge by keeping the smallest UUID.
        """
        mappings = self._mappings(stream_arn, function_name)
        if not mappings:
            try:
                self.awslambda.create_event_source_mapping(
                    EventSourceArn=stream_arn, FunctionName=function_name, **ROUTER_MAPPING
                )
            except ClientError as exc:
                if error_code(exc) in KINESIS_THROTTLED:
                    raise ServerBusy("Lambda refused the event source mapping now") from exc
                if error_code(exc) != "ResourceConflictException":
                    raise
            mappings = self._mappings(stream_arn, function_name)
        keep, *extra = sorted(mappings)
        for uuid in extra:
            try:
                self.awslambda.delete_event_source_mapping(UUID=uuid)
            except ClientError as exc:
                if error_code(exc) != "ResourceNotFoundException":
                    raise
        return keep

    def _mappings(self, stream_arn: str, function_name: str) -> list[str]:
        uuids: list[str] = []
        kwargs: dict[str, Any] = {"EventSourceArn": stream_arn, "FunctionName": function_name}
        while True:
            response = self.awslambda.list_event_source_mappings(**kwargs)
            uuids.extend(m["UUID"] for m in response.get("EventSourceMappings", []))
            if not response.get("NextMarker"):
                return uuids
            kwargs["Marker"] = response["NextMarker"]

    def drop_router_mappings(self, source_arn: str, function_name: str) -> int:
        """Delete ``function_name``'s mappings on ``source_arn`` (a stream or a consumer);
        how many there were."""
        uuids = self._mappings(source_arn, function_name)
        for uuid in uuids:
            try:
                self.awslambda.delete_event_source_mapping(UUID=uuid)
            except ClientError as exc:
                if error_code(exc) != "ResourceNotFoundException":
                    raise
        return len(uuids)

    # -- enhanced fan-out consumers --------------------------------------------------------

    def ensure_consumer(self, stream_arn: str, name: str, *, wait_s: float = 20.0) -> str:
        """The ARN of the stream's consumer ``name``, registered unless it is, once it is
        ACTIVE: a consumer still CREATING cannot be read. Idempotent: Kinesis keeps one
        consumer of a name per stream, so racing makers converge on it. A consumer not ACTIVE
        within ``wait_s`` is ServerBusy (repeating the request finds it further on)."""
        deadline = self.clock.now_ms() + int(wait_s * 1000)
        while True:
            found = self._consumer(stream_arn, name)
            if found is None:
                try:
                    self.kinesis.register_stream_consumer(StreamARN=stream_arn, ConsumerName=name)
                    continue
                except ClientError as exc:
                    # ResourceInUse: a racing maker registered it; LimitExceeded: Kinesis
                    # registers five consumers at once per account, five calls a second
                    if error_code(exc) not in ("ResourceInUseException", *KINESIS_THROTTLED):
                        raise
                status = "refused"
            else:
                arn, status = found
                if status == "ACTIVE":
                    return arn
            # CREATING, or DELETING (a failed make's, before this one registers it again)
            if self.clock.now_ms() >= deadline:
                raise ServerBusy(f"the {name} consumer of {stream_arn} is {status}; retry")
            self.clock.sleep(1.0)

    def _consumer(self, stream_arn: str, name: str) -> tuple[str, str] | None:
        """(ARN, status) of the stream's consumer ``name``; None when there is none. Listed,
        not described by name: the listing acts on the stream, which the grants name (a
        consumer's ARN is known only once it exists)."""
        kwargs: dict[str, Any] = {"StreamARN": stream_arn}
        while True:
            response = self.kinesis.list_stream_consumers(**kwargs)
            for consumer in response.get("Consumers", []):
                if consumer["ConsumerName"] == name:
                    return consumer["ConsumerARN"], consumer["ConsumerStatus"]
            if not response.get("NextToken"):
                return None
            kwargs = {"StreamARN": stream_arn, "NextToken": response["NextToken"]}

    def release_consumer(self, consumer_arn: str, function_name: str) -> bool:
        """Deregister a consumer that no mapping of ``function_name`` reads (a failed make's:
        a consumer is billed by the shard-hour whether read or not); True if it was. A consumer
        a mapping reads is kept: a racing make of the same storage topic may have got further."""
        if self._mappings(consumer_arn, function_name):
            return False
        try:
            self.kinesis.deregister_stream_consumer(ConsumerARN=consumer_arn)
        except ClientError as exc:
            if error_code(exc) == "ResourceNotFoundException":
                return False
            raise
        logger.info("consumer of a failed make deregistered", extra={"consumer": consumer_arn})
        return True

    # -- records ---------------------------------------------------------------------------

    def put_record(self, stream: str, record: OutRecord) -> PutOutcome:
        try:
            response = self.writer.put_record(
                StreamName=stream,
                Data=record.data,
                PartitionKey=record.partition_key,
                ExplicitHashKey=str(record.explicit_hash_key),
            )
        except ClientError as exc:
            logger.warning("put_record failed", extra={"stream": stream, "code": error_code(exc)})
            return _failed(exc)
        except BotoCoreError as exc:
            # a timeout is ambiguous: the record may be in the stream
            logger.warning("put_record failed", extra={"stream": stream, "error": type(exc)})
            return PutOutcome(error_code=type(exc).__name__, ambiguous=True)
        return PutOutcome(shard_id=response["ShardId"], sequence_number=response["SequenceNumber"])

    def put_records(self, stream: str, records: Sequence[OutRecord]) -> list[PutOutcome]:
        """One PutRecords call (the caller keeps within 500 records and 5 MiB)."""
        try:
            response = self.writer.put_records(
                StreamName=stream,
                Records=[
                    {
                        "Data": r.data,
                        "PartitionKey": r.partition_key,
                        "ExplicitHashKey": str(r.explicit_hash_key),
                    }
                    for r in records
                ],
            )
        except ClientError as exc:
            logger.warning("put_records failed", extra={"stream": stream, "code": error_code(exc)})
            return [_failed(exc) for _ in records]
        except BotoCoreError as exc:
            logger.warning("put_records failed", extra={"stream": stream, "error": type(exc)})
            return [PutOutcome(error_code=type(exc).__name__, ambiguous=True) for _ in records]
        # a per-record ErrorCode means that record was not added
        return [
            PutOutcome(error_code=r["ErrorCode"])
            if r.get("ErrorCode")
            else PutOutcome(shard_id=r.get("ShardId"), sequence_number=r.get("SequenceNumber"))
            for r in response["Records"]
        ]

    def read_window(
        self, stream: str, explicit_hash_key: int, since_ms: int, until_ms: int
    ) -> Iterator[bytes]:
        """The data of the records that arrived in the shard holding ``explicit_hash_key``
        between ``since_ms`` and ``until_ms`` (inclusive), in order.

        Bounded: a window that needs more GetRecords calls than a publish can afford, or a
        throttled read, is ServerBusy, so the caller answers "retry" rather than guessing.
        """
        shard = next(
            (
                s["ShardId"]
                for s in self._shards(stream)
                if int(s["HashKeyRange"]["StartingHashKey"])
                <= explicit_hash_key
                <= int(s["HashKeyRange"]["EndingHashKey"])
                and "EndingSequenceNumber" not in s.get("SequenceNumberRange", {})
            ),
            None,
        )
        if shard is None:
            raise ServerBusy(f"no open shard of {stream} holds the hash key")
        try:
            iterator: str | None = self.kinesis.get_shard_iterator(
                StreamName=stream,
                ShardId=shard,
                ShardIteratorType="AT_TIMESTAMP",
                Timestamp=datetime.fromtimestamp(since_ms / 1000, UTC),
            )["ShardIterator"]
            for _ in range(_MAX_WINDOW_READS):
                if iterator is None:
                    return
                response = self.kinesis.get_records(ShardIterator=iterator, Limit=1000)
                for record in response["Records"]:
                    arrival = record["ApproximateArrivalTimestamp"]
                    if int(arrival.timestamp() * 1000) > until_ms:
                        return
                    yield record["Data"]
                if not response["Records"] and response.get("MillisBehindLatest", 0) == 0:
                    return
                iterator = response.get("NextShardIterator")
        except ClientError as exc:
            raise ServerBusy("the storage topic could not be read back now; retry") from exc
        raise ServerBusy("the storage topic window is too long to read back now; retry")


#: a recovery read-back gives up (and asks the client to retry) after this many GetRecords
_MAX_WINDOW_READS = 50


class EventLog:
    """Appends to a stream the stack owns (the delivery-event log, ``shoal.delivery.events``).

    Unlike the publish path, a record appended twice here is harmless (the archiver keeps the
    last copy of a batch, the audit drops lines held twice), so a record Kinesis refused is
    put again, a few times; a call that fails as a whole raises as S3's PutObject did before.
    """

    #: puts of the records Kinesis refused (throttling), the first call included
    ATTEMPTS = 3

    def __init__(self, kinesis: KinesisClient, stream: str, clock: Clock | None = None) -> None:
        self.kinesis = kinesis
        self.stream = stream
        self.clock = clock or SystemClock()

    def append(self, records: Sequence[tuple[str, bytes]]) -> None:
        """Put (partition key, data) records, in order per partition key: one PutRecords call
        unless they pass its limits of 500 records and 5 MiB."""
        for chunk in put_chunks(records, [len(data) + len(key.encode()) for key, data in records]):
            pending = list(chunk)
            for attempt in range(self.ATTEMPTS):
                response = self.kinesis.put_records(
                    StreamName=self.stream,
                    Records=[{"PartitionKey": key, "Data": data} for key, data in pending],
                )
                if not response.get("FailedRecordCount"):
                    break
                # a refused record was not added; a later record of its key may have been, so
                # order within a key is kept only up to a retry (the lines keep their ``seq``)
                pending = [
                    record
                    for record, answer in zip(pending, response["Records"], strict=True)
                    if answer.get("ErrorCode")
                ]
                if attempt + 1 < self.ATTEMPTS:
                    self.clock.sleep(0.05 * 2**attempt)
            else:
                logger.warning(
                    "event log records refused",
                    extra={"stream": self.stream, "records": len(pending)},
                )
                # the caller's invocation fails (a get or ack answers 503, a batch is retried)
                raise ServerBusy(f"{len(pending)} delivery-event records refused; retry")


def put_chunks(items: Sequence[T], sizes: Sequence[int]) -> list[list[T]]:
    """Split one PutRecords call's records (``sizes``: each one's bytes) by Kinesis' count and
    byte limits, keeping order."""
    chunks: list[list[T]] = [[]]
    total = 0
    for item, size in zip(items, sizes, strict=True):
        if chunks[-1] and (
            len(chunks[-1]) >= MAX_PUT_RECORDS or total + size > MAX_PUT_RECORDS_BYTES
        ):
            chunks.append([])
            total = 0
        chunks[-1].append(item)
        total += size
    return chunks
