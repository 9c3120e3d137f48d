"""Lambda's Kinesis event source mappings, emulated: ``shoal dev`` delivers stream records itself.

moto stores event source mappings but cannot run a function (that needs Docker), so the local
runtime reads the mappings through the Lambda API, reads the streams with GetShardIterator and
GetRecords, and hands each batch to the handler in-process through an injected ``invoke``.
What it copies from Lambda (AWS docs: "Using AWS Lambda with Amazon Kinesis", "Configuring
partial batch response with Kinesis", "Retain discarded batch records"):

- StartingPosition TRIM_HORIZON / LATEST / AT_TIMESTAMP; BatchSize; the 6 MB payload limit;
  MaximumBatchingWindowInSeconds (read from the injected clock); records of one shard in order.
- The event exactly as Lambda sends it (see ``events/kinesis_batch.json``).
- FunctionResponseTypes ["ReportBatchItemFailures"]: a null response, an empty one, or a
  null/empty ``batchItemFailures`` list is complete success; an empty or null
  ``itemIdentifier`` or a bad key name is complete failure; otherwise the records before the
  lowest failed sequence number are done and the batch is retried from there. Two choices
  where the docs are silent: an ``itemIdentifier`` that names no record of the batch, and a
  response that is not an object, are complete failures. Without that response type any
  return value is success.
- A raised exception is a function error: the batch is retried. With BisectBatchOnFunctionError
  a failed batch of two or more records is split in halves, each retried in order, and the
  split does not count towards MaximumRetryAttempts (-1: unlimited); a partial response is not
  split further (the docs: "bisected at the returned sequence number"). Records older than
  MaximumRecordAgeInSeconds (-1: unlimited) are discarded before an invocation. A discarded
  batch ("RetryAttemptsExhausted" / "RecordAgeExceeded") sends the documented invocation record
  to DestinationConfig.OnFailure (SQS queue, SNS topic, or S3 bucket with the whole event as
  ``payload``), then processing moves on.
- ParallelizationFactor N: each shard has N lanes, a record's lane is chosen by its partition
  key, each lane has at most one batch in flight, and the shard's checkpoint only moves past a
  record once every record before it is done (succeeded or discarded).
- A disabled mapping is not polled and resumes from its checkpoint when enabled; a deleted one
  stops and its checkpoints are forgotten. Checkpoints are kept by mapping UUID and shard id
  in a ``CheckpointStore``; records after the checkpoint may be delivered again after a
  restart (at least once, as Lambda).

Not emulated: FilterCriteria, TumblingWindowInSeconds, enhanced fan-out consumers, throttling
and Lambda's backoff between retries (a failed batch is retried on the next round).

``seek`` moves a mapping to TRIM_HORIZON, LATEST or a time. Lambda has no such call (deployed,
the same effect needs a new mapping); push subscriptions' seek uses it locally.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal, cast

import boto3
from botocore.exceptions import ClientError

from shoal.core.clock import Clock
from shoal.core.observability import logger
from shoal.local.checkpoints import CheckpointStore, MemoryCheckpoints, Position, PositionKind

#: invoke(function_name, event) -> the handler's return value; raises on a function error
Invoke = Callable[[str, dict[str, Any]], Any]

#: a synchronous invocation's payload limit, which also bounds a batch
MAX_PAYLOAD_BYTES = 6 * 1024 * 1024
#: GetRecords returns at most this many records
MAX_GET_RECORDS = 10_000
#: the JSON of one record around its data, partition key and sequence number (measured: ~330)
_RECORD_ENVELOPE_BYTES = 400
_ACTIVE_STATES = frozenset({"Creating", "Enabling", "Enabled", "Updating"})
_STARTING_POSITIONS = frozenset({"TRIM_HORIZON", "LATEST", "AT_TIMESTAMP"})

Condition = Literal["RetryAttemptsExhausted", "RecordAgeExceeded"]


# --- configuration, as the Lambda API returns it -------------------------------------------


def stream_name_of(stream_arn: str) -> str:
    """``arn:aws:kinesis:r:a:stream/NAME`` -> NAME."""
    return stream_arn.split(":", 5)[5].split("/")[1]


def function_name_of(function_arn: str) -> str:
    """``arn:aws:lambda:r:a:function:NAME[:qualifier]`` -> NAME (a bare name is returned as is)."""
    parts = function_arn.split(":")
    return parts[6] if len(parts) >= 7 and parts[5] == "function" else function_arn


@dataclass(frozen=True)
class MappingConfig:
    """One Kinesis event source mapping, with Lambda's defaults filled in."""

    uuid: str
    function_arn: str
    stream_arn: str
    state: str
    starting_position: Position
    batch_size: int = 100
    batching_window_s: float = 0.0
    report_item_failures: bool = False
    bisect_on_error: bool = False
    max_retry_attempts: int = -1
    max_record_age_s: int = -1
    parallelization_factor: int = 1
    on_failure: str | None = None

    @property
    def function_name(self) -> str:
        return function_name_of(self.function_arn)

    @property
    def active(self) -> bool:
        return self.state in _ACTIVE_STATES

    @classmethod
    def from_api(cls, raw: dict[str, Any]) -> MappingConfig | None:
        """A mapping from ListEventSourceMappings; None when its source is not a Kinesis stream."""
        source = raw.get("EventSourceArn", "")
        if not source.startswith("arn:") or source.split(":")[2] != "kinesis":
            return None
        # A consumer ARN (enhanced fan-out) reads the same records as its stream here.
        stream_arn = source.split("/consumer/")[0]
        position = raw.get("StartingPosition") or "TRIM_HORIZON"
        raw_stamp = raw.get("StartingPositionTimestamp")
        stamp: float | None = None
        if isinstance(raw_stamp, datetime):
            stamp = raw_stamp.timestamp()
        elif isinstance(raw_stamp, int | float | str):
            stamp = float(raw_stamp)
        if position not in _STARTING_POSITIONS or (position == "AT_TIMESTAMP" and stamp is None):
            # Lambda refuses such a mapping; one that slipped into moto is left alone.
            logger.error("unusable event source mapping", extra={"mapping": raw.get("UUID")})
            return None
        start = Position(
            cast(PositionKind, position), timestamp=stamp if position == "AT_TIMESTAMP" else None
        )
        destination = (raw.get("DestinationConfig") or {}).get("OnFailure", {}).get("Destination")

        def number(key: str, default: int) -> int:
            value = raw.get(key)
            return default if value is None else int(value)

        return cls(
            uuid=raw["UUID"],
            function_arn=raw["FunctionArn"],
            stream_arn=stream_arn,
            state=raw.get("State") or "Enabled",
            starting_position=start,
            batch_size=max(1, number("BatchSize", 100)),
            batching_window_s=float(raw.get("MaximumBatchingWindowInSeconds") or 0),
            report_item_failures="ReportBatchItemFailures"
            in (raw.get("FunctionResponseTypes") or []),
            bisect_on_error=bool(raw.get("BisectBatchOnFunctionError")),
            max_retry_attempts=number("MaximumRetryAttempts", -1),
            max_record_age_s=number("MaximumRecordAgeInSeconds", -1),
            parallelization_factor=min(10, max(1, number("ParallelizationFactor", 1))),
            on_failure=destination or None,
        )


# --- what a function's answer means ---------------------------------------------------------


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


# --- the event Lambda sends ---------------------------------------------------------------


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
            _RECORD_ENVELOPE_BYTES
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
    from shoal.local.context import REGION
    from shoal.local.provision import ACCOUNT_ID

    return kinesis_event(
        [StreamRecord.from_get_records(dict(r)) for r in raw_records],
        shard_id=shard_id,
        stream_arn=f"arn:aws:kinesis:{REGION}:{ACCOUNT_ID}:stream/{stream}",
        region=REGION,
        role_arn=f"arn:aws:iam::{ACCOUNT_ID}:role/shoal-local-lambda",
    )


def _iso(seconds: float) -> str:
    moment = datetime.fromtimestamp(seconds, UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def lane_of(partition_key: str, lanes: int) -> int:
    """The lane of a partition key: stable across processes (not Python's hash())."""
    if lanes == 1:
        return 0
    digest = hashlib.md5(partition_key.encode(), usedforsecurity=False).digest()
    return int.from_bytes(digest[:8], "big") % lanes


# --- per-shard state ------------------------------------------------------------------------


@dataclass
class _Batch:
    records: list[StreamRecord]
    #: failed invocations charged against MaximumRetryAttempts (splits are not charged)
    failures: int = 0
    #: approximateInvokeCount of the on-failure record
    invokes: int = 0
    function_error: bool = False
    request_id: str = field(default_factory=lambda: str(uuid.uuid4()))


@dataclass
class _Lane:
    pending: deque[StreamRecord] = field(default_factory=deque)
    #: halves of a bisected batch, oldest first: they go before anything newer
    queued: deque[_Batch] = field(default_factory=deque)
    #: the batch being tried (first try or retry); None between batches
    current: _Batch | None = None
    window_start_ms: int | None = None

    def buffered(self) -> int:
        held = sum(len(b.records) for b in self.queued)
        return len(self.pending) + held + (len(self.current.records) if self.current else 0)


@dataclass
class _Shard:
    shard_id: str
    parent_ids: tuple[str, ...]
    #: where reading starts: the checkpoint, or the mapping's starting position
    start: Position
    #: the position last written to the checkpoint store
    persisted: Position | None
    lanes: list[_Lane]
    iterator: str | None = None
    last_read: int | None = None
    #: sequence numbers read and not yet done, in shard order
    outstanding: deque[int] = field(default_factory=deque)
    done: set[int] = field(default_factory=set)
    #: the shard is closed and every record of it was read
    end_of_shard: bool = False

    @property
    def finished(self) -> bool:
        return self.end_of_shard and not self.outstanding


@dataclass
class _Mapping:
    config: MappingConfig
    role_arn: str
    shards: dict[str, _Shard] = field(default_factory=dict)
    lock: threading.RLock = field(default_factory=threading.RLock)


@dataclass
class _Plan:
    lane: _Lane
    batch: _Batch
    event: dict[str, Any]


@dataclass
class _Worker:
    thread: threading.Thread
    stop: threading.Event


# --- the emulator ---------------------------------------------------------------------------


class EventSourceMappings:
    """Every Kinesis event source mapping of the emulated account, delivered in-process.

    The core is thread-free: ``sync()`` reads the mappings through the Lambda API,
    ``run_once()`` lets every lane of every shard process at most one batch, ``drain()`` runs
    rounds until nothing moves. ``start()`` / ``stop()`` run the same steps in background
    threads: one poll loop per mapping shard, lanes of one shard invoked concurrently.
    """

    def __init__(
        self,
        session: boto3.Session,
        invoke: Invoke,
        clock: Clock,
        checkpoints: CheckpointStore | None = None,
        *,
        region: str | None = None,
        endpoint_url: str | None = None,
        poll_interval_s: float = 0.5,
        sync_interval_s: float = 1.0,
        max_workers: int = 16,
        join_timeout_s: float = 10.0,
    ) -> None:
        self._session = session
        self._endpoint_url = endpoint_url
        self._invoke = invoke
        self._clock = clock
        self.checkpoints: CheckpointStore = checkpoints or MemoryCheckpoints()
        self.region = region or session.region_name or "us-east-1"
        self._lambda = self._client("lambda")
        self._kinesis = self._client("kinesis")
        self._destinations: dict[str, Any] = {}
        # Destination clients have a lock of their own: a shard's step asks for one while it
        # holds its mapping's lock, and sync() takes the mapping locks under self._lock.
        self._clients_lock = threading.Lock()
        self._queue_urls: dict[str, str] = {}
        self._roles: dict[str, str] = {}
        self._lock = threading.RLock()
        self._mappings: dict[str, _Mapping] = {}
        self.poll_interval_s = poll_interval_s
        self.sync_interval_s = sync_interval_s
        self._max_workers = max_workers
        self._join_timeout_s = join_timeout_s
        self._running = threading.Event()
        self._stopping = threading.Event()
        self._workers: dict[tuple[str, str], _Worker] = {}
        self._retired: list[threading.Thread] = []
        self._sync_thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None

    def _client(self, service: str) -> Any:
        # Clients are made here, on one thread: boto3 sessions are not thread-safe, clients are.
        return self._session.client(service, endpoint_url=self._endpoint_url)  # type: ignore[call-overload]

    # -- reading the mappings ----------------------------------------------------------------

    def sync(self) -> None:
        """Read the mappings from the Lambda API; start, update, pause or forget their state."""
        pages = self._lambda.get_paginator("list_event_source_mappings").paginate()
        configs: dict[str, MappingConfig] = {}
        for page in pages:
            for raw in page.get("EventSourceMappings", []):
                if raw.get("StartingPosition") == "AT_TIMESTAMP" and not raw.get(
                    "StartingPositionTimestamp"
                ):
                    raw["StartingPositionTimestamp"] = _moto_starting_timestamp(raw)
                config = MappingConfig.from_api(raw)
                if config is not None:
                    configs[config.uuid] = config
        with self._lock:
            for gone in [u for u in self._mappings if u not in configs]:
                self._forget(gone)
            for mapping_uuid, config in configs.items():
                mapping = self._mappings.get(mapping_uuid)
                if mapping is None:
                    mapping = _Mapping(config, self._role_of(config.function_arn))
                    self._mappings[mapping_uuid] = mapping
                self._reconcile(mapping, config)

    def _forget(self, mapping_uuid: str) -> None:
        mapping = self._mappings.pop(mapping_uuid)
        with mapping.lock:
            mapping.shards.clear()
        self._retire_workers(mapping_uuid, keep=set())
        # A deleted mapping's position dies with it, as in Lambda.
        self.checkpoints.delete_mapping(mapping_uuid)
        logger.info("event source mapping deleted", extra={"mapping": mapping_uuid})

    def _reconcile(self, mapping: _Mapping, config: MappingConfig) -> None:
        with mapping.lock:
            old = mapping.config
            if (
                old.parallelization_factor != config.parallelization_factor
                or old.stream_arn != config.stream_arn
            ):
                # Lanes are cut by partition key: a new factor starts again from the checkpoint.
                mapping.shards.clear()
            if old.function_arn != config.function_arn:
                mapping.role_arn = self._role_of(config.function_arn)
            mapping.config = config
            if not config.active:
                mapping.shards.clear()
                self._retire_workers(config.uuid, keep=set())
                return
            try:
                shards = self._list_shards(config.stream_arn)
                for shard_id in [s for s in mapping.shards if s not in shards]:
                    del mapping.shards[shard_id]
                for shard_id, parents in shards.items():
                    if shard_id not in mapping.shards:
                        mapping.shards[shard_id] = self._open_shard(config, shard_id, parents)
            except ClientError as exc:
                # A deleted stream, say: the mapping idles until the stream is back.
                logger.warning(
                    "event source mapping's stream is unreadable",
                    extra={"mapping": config.uuid, "error": _code(exc)},
                )
                mapping.shards.clear()
                self._retire_workers(config.uuid, keep=set())
                return
            if self._running.is_set():
                self._retire_workers(config.uuid, keep=set(mapping.shards))
                for shard_id in mapping.shards:
                    self._ensure_worker(config.uuid, shard_id)

    def _list_shards(self, stream_arn: str) -> dict[str, tuple[str, ...]]:
        shards: dict[str, tuple[str, ...]] = {}
        args: dict[str, Any] = {"StreamARN": stream_arn}
        while True:
            page = self._kinesis.list_shards(**args)
            for shard in page.get("Shards", []):
                parents = tuple(
                    p for p in (shard.get("ParentShardId"), shard.get("AdjacentParentShardId")) if p
                )
                shards[shard["ShardId"]] = parents
            token = page.get("NextToken")
            if not token:
                return shards
            args = {"NextToken": token}

    def _open_shard(self, config: MappingConfig, shard_id: str, parents: tuple[str, ...]) -> _Shard:
        saved = self.checkpoints.load(config.uuid, shard_id)
        shard = _Shard(
            shard_id=shard_id,
            parent_ids=parents,
            start=saved or config.starting_position,
            persisted=saved,
            lanes=[_Lane() for _ in range(config.parallelization_factor)],
        )
        # The iterator is taken now, so LATEST means "from when the mapping was picked up".
        shard.iterator = self._iterator(config, shard_id, shard.start)
        return shard

    def _iterator(self, config: MappingConfig, shard_id: str, position: Position) -> str:
        # By name: moto builds an iterator from StreamARN that names no stream ("Stream None").
        response = self._kinesis.get_shard_iterator(
            StreamName=stream_name_of(config.stream_arn),
            ShardId=shard_id,
            **position.iterator_args(),
        )
        return str(response["ShardIterator"])

    def _role_of(self, function_arn: str) -> str:
        if function_arn not in self._roles:
            try:
                fn = self._lambda.get_function(FunctionName=function_arn)
                self._roles[function_arn] = fn["Configuration"].get("Role", "")
            except ClientError:
                return ""
        return self._roles[function_arn]

    # -- positions ----------------------------------------------------------------------------

    def seek(self, mapping_uuid: str, to: Position) -> None:
        """Move a mapping, on every shard, to TRIM_HORIZON, LATEST or AT_TIMESTAMP.

        Batches in flight finish but their results are dropped; records are delivered again
        from the new position (or skipped up to it). The position is saved as the checkpoint,
        so it holds across a restart; a LATEST position is taken at the first read after the
        seek (a restart before any new record was read takes LATEST again).
        """
        if to.kind not in _STARTING_POSITIONS:
            raise ValueError(f"seek takes TRIM_HORIZON, LATEST or AT_TIMESTAMP, not {to.kind}")
        with self._lock:
            mapping = self._mappings.get(mapping_uuid)
        if mapping is None:
            self.sync()
            with self._lock:
                mapping = self._mappings.get(mapping_uuid)
        if mapping is None:
            raise KeyError(f"no Kinesis event source mapping {mapping_uuid}")
        with mapping.lock:
            config = mapping.config
            shards = self._list_shards(config.stream_arn)
            for shard_id in shards:
                self.checkpoints.save(mapping_uuid, shard_id, to)
            mapping.shards.clear()
            if config.active:
                for shard_id, parents in shards.items():
                    mapping.shards[shard_id] = self._open_shard(config, shard_id, parents)
        logger.info("event source mapping moved", extra={"mapping": mapping_uuid, "to": to.kind})

    def checkpoint(self, mapping_uuid: str, shard_id: str) -> Position | None:
        """The saved position of a mapping in a shard (None before anything was read)."""
        return self.checkpoints.load(mapping_uuid, shard_id)

    # -- the synchronous core ----------------------------------------------------------------

    def run_once(self) -> int:
        """Every lane of every shard processes at most one batch; returns records handed over."""
        return self._round()[0]

    def drain(self, max_rounds: int = 100) -> int:
        """Run rounds until one moves nothing (caught up, or waiting for a batching window)."""
        total = 0
        for _ in range(max_rounds):
            handed, moved = self._round()
            total += handed
            if not moved:
                break
        return total

    def _round(self) -> tuple[int, bool]:
        if self._running.is_set():
            raise RuntimeError("run_once/drain cannot run while the background threads do")
        with self._lock:
            work = [
                (m, shard_id)
                for _, m in sorted(self._mappings.items())
                for shard_id in sorted(m.shards)
            ]
        handed, moved = 0, False
        for mapping, shard_id in work:
            h, m = self._step(mapping, shard_id, pool=None)
            handed += h
            moved = moved or m
        return handed, moved

    def _step(self, mapping: _Mapping, shard_id: str, pool: Executor | None) -> tuple[int, bool]:
        """Read, cut batches, invoke (outside the lock), apply the outcomes, checkpoint."""
        with mapping.lock:
            shard = mapping.shards.get(shard_id)
            config = mapping.config
            if shard is None or not config.active or self._waits_for_parent(mapping, shard):
                return 0, False
            try:
                moved = self._fetch(config, shard)
            except ClientError as exc:
                # One unreadable shard must not stop the others; the next round tries again.
                logger.warning(
                    "event source mapping could not read its shard",
                    extra={"mapping": config.uuid, "shard": shard_id, "error": _code(exc)},
                )
                return 0, False
            now_ms = self._clock.now_ms()
            plans: list[_Plan] = []
            for lane in shard.lanes:
                batch = self._take(mapping, shard, lane, now_ms)
                if batch is not None:
                    event = kinesis_event(
                        batch.records,
                        shard_id=shard_id,
                        stream_arn=config.stream_arn,
                        region=self.region,
                        role_arn=mapping.role_arn,
                    )
                    plans.append(_Plan(lane, batch, event))
            moved = self._advance(mapping, shard) or moved
        if not plans:
            return 0, moved

        def call(plan: _Plan) -> BatchOutcome:
            return self._call(config, plan)

        if pool is None or len(plans) == 1:
            outcomes = [call(p) for p in plans]
        else:
            outcomes = list(pool.map(call, plans))

        with mapping.lock:
            if mapping.shards.get(shard_id) is not shard:
                # Sought, disabled or deleted meanwhile: these results belong to nobody.
                return sum(len(p.batch.records) for p in plans), True
            for plan, outcome in zip(plans, outcomes, strict=True):
                self._apply(mapping, shard, plan.lane, plan.batch, outcome)
            self._advance(mapping, shard)
        return sum(len(p.batch.records) for p in plans), True

    def _waits_for_parent(self, mapping: _Mapping, shard: _Shard) -> bool:
        # Lambda finishes a parent shard before it reads its children (resharding order).
        return any(
            (parent := mapping.shards.get(p)) is not None and not parent.finished
            for p in shard.parent_ids
        )

    def _fetch(self, config: MappingConfig, shard: _Shard) -> bool:
        if shard.end_of_shard:
            return False
        buffered = sum(lane.buffered() for lane in shard.lanes)
        cap = config.batch_size * (config.parallelization_factor + 1)
        if buffered >= cap:
            return False
        if shard.iterator is None:
            resume = shard.start if shard.last_read is None else Position.after(shard.last_read)
            shard.iterator = self._iterator(config, shard.shard_id, resume)
        try:
            response = self._kinesis.get_records(
                ShardIterator=shard.iterator, Limit=min(MAX_GET_RECORDS, cap - buffered)
            )
        except ClientError as exc:
            if _code(exc) == "ExpiredIteratorException":
                shard.iterator = None
                return False
            raise
        shard.iterator = response.get("NextShardIterator")
        if shard.iterator is None:
            shard.end_of_shard = True
        records = [StreamRecord.from_get_records(r) for r in response.get("Records", [])]
        if shard.last_read is not None:
            records = [r for r in records if r.seq > shard.last_read]
        if not records:
            return False
        now_ms = self._clock.now_ms()
        factor = len(shard.lanes)
        for record in records:
            lane = shard.lanes[lane_of(record.partition_key, factor)]
            if not lane.pending:
                lane.window_start_ms = now_ms
            lane.pending.append(record)
            shard.outstanding.append(record.seq)
            shard.last_read = record.seq
        if shard.persisted is None or not shard.persisted.kind.endswith("SEQUENCE_NUMBER"):
            # Pin a LATEST or AT_TIMESTAMP start to the first record it reached, so a restart
            # before the first checkpoint resumes at that record, not at a later LATEST.
            shard.persisted = Position.at(records[0].sequence_number)
            self.checkpoints.save(config.uuid, shard.shard_id, shard.persisted)
        return True

    def _ready(self, config: MappingConfig, lane: _Lane, now_ms: int) -> bool:
        if not lane.pending:
            return False
        if len(lane.pending) >= config.batch_size or config.batching_window_s <= 0:
            return True
        if sum(r.size for r in lane.pending) >= MAX_PAYLOAD_BYTES:
            return True
        started = lane.window_start_ms if lane.window_start_ms is not None else now_ms
        return now_ms - started >= config.batching_window_s * 1000

    def _cut(self, config: MappingConfig, lane: _Lane, now_ms: int) -> _Batch:
        records: list[StreamRecord] = []
        size = 0
        while lane.pending and len(records) < config.batch_size:
            nxt = lane.pending[0]
            if records and size + nxt.size > MAX_PAYLOAD_BYTES:
                break
            records.append(lane.pending.popleft())
            size += nxt.size
        # What is left waits for a window of its own, as if the poller had just started.
        lane.window_start_ms = now_ms if lane.pending else None
        return _Batch(records)

    def _take(self, mapping: _Mapping, shard: _Shard, lane: _Lane, now_ms: int) -> _Batch | None:
        config = mapping.config
        while True:
            if lane.current is None:
                if lane.queued:
                    lane.current = lane.queued.popleft()
                elif self._ready(config, lane, now_ms):
                    lane.current = self._cut(config, lane, now_ms)
                else:
                    return None
            batch = lane.current
            if config.max_record_age_s >= 0:
                oldest_ok = now_ms / 1000 - config.max_record_age_s
                expired = [r for r in batch.records if r.arrival < oldest_ok]
                if expired:
                    self._discard(mapping, shard, batch, expired, "RecordAgeExceeded")
                    batch.records = [r for r in batch.records if r.arrival >= oldest_ok]
                    if not batch.records:
                        lane.current = None
                        continue
            return batch

    def _call(self, config: MappingConfig, plan: _Plan) -> BatchOutcome:
        sequence_numbers = [r.seq for r in plan.batch.records]
        try:
            response = self._invoke(config.function_name, plan.event)
        except Exception as exc:
            # The handler's own message may quote a payload: log the error's type only.
            logger.warning(
                "function error in event source mapping batch",
                extra={
                    "mapping": config.uuid,
                    "function": config.function_name,
                    "error": type(exc).__name__,
                    "batch_size": len(sequence_numbers),
                    "first_sequence_number": str(sequence_numbers[0]),
                },
            )
            return BatchOutcome("failure", function_error=True)
        return batch_outcome(response, sequence_numbers, config.report_item_failures)

    def _apply(
        self,
        mapping: _Mapping,
        shard: _Shard,
        lane: _Lane,
        batch: _Batch,
        outcome: BatchOutcome,
    ) -> None:
        config = mapping.config
        batch.invokes += 1
        batch.function_error = outcome.function_error
        if outcome.kind == "success":
            shard.done.update(r.seq for r in batch.records)
            lane.current = None
            return
        if outcome.kind == "partial":
            assert outcome.failed_from is not None
            cut = outcome.failed_from
            shard.done.update(r.seq for r in batch.records if r.seq < cut)
            batch.records = [r for r in batch.records if r.seq >= cut]
        elif config.bisect_on_error and len(batch.records) > 1:
            half = len(batch.records) // 2
            halves = [
                _Batch(part, failures=batch.failures, invokes=batch.invokes)
                for part in (batch.records[:half], batch.records[half:])
            ]
            lane.queued.extendleft(reversed(halves))
            lane.current = None
            return
        batch.failures += 1
        if 0 <= config.max_retry_attempts < batch.failures:
            self._discard(mapping, shard, batch, batch.records, "RetryAttemptsExhausted")
            lane.current = None

    def _advance(self, mapping: _Mapping, shard: _Shard) -> bool:
        """Move the checkpoint past every record whose predecessors are all done."""
        last: int | None = None
        while shard.outstanding and shard.outstanding[0] in shard.done:
            last = shard.outstanding.popleft()
            shard.done.discard(last)
        if last is None:
            return False
        shard.persisted = Position.after(last)
        self.checkpoints.save(mapping.config.uuid, shard.shard_id, shard.persisted)
        return True

    # -- discarded batches -------------------------------------------------------------------

    def _discard(
        self,
        mapping: _Mapping,
        shard: _Shard,
        batch: _Batch,
        records: list[StreamRecord],
        condition: Condition,
    ) -> None:
        config = mapping.config
        shard.done.update(r.seq for r in records)
        logger.warning(
            "event source mapping discarded records",
            extra={
                "mapping": config.uuid,
                "shard": shard.shard_id,
                "condition": condition,
                "batch_size": len(records),
                "first_sequence_number": records[0].sequence_number,
                "last_sequence_number": records[-1].sequence_number,
            },
        )
        if not config.on_failure:
            return
        record = self._invocation_record(mapping, shard.shard_id, batch, records, condition)
        try:
            self._send_on_failure(mapping, shard.shard_id, record, records)
        except ClientError as exc:
            # Lambda drops the records either way; a missing destination must not stall a shard.
            logger.error(
                "on-failure destination refused the invocation record",
                extra={"mapping": config.uuid, "error": _code(exc)},
            )

    def _invocation_record(
        self,
        mapping: _Mapping,
        shard_id: str,
        batch: _Batch,
        records: list[StreamRecord],
        condition: Condition,
    ) -> dict[str, Any]:
        """The document Lambda sends to an on-failure destination for a discarded batch."""
        config = mapping.config
        response: dict[str, Any] = {"statusCode": 200, "executedVersion": "$LATEST"}
        if batch.function_error:
            response["functionError"] = "Unhandled"
        return {
            "requestContext": {
                "requestId": batch.request_id,
                "functionArn": config.function_arn,
                "condition": condition,
                "approximateInvokeCount": batch.invokes,
            },
            "responseContext": response,
            "version": "1.0",
            "timestamp": _iso(self._clock.now_ms() / 1000),
            "KinesisBatchInfo": {
                "shardId": shard_id,
                "startSequenceNumber": records[0].sequence_number,
                "endSequenceNumber": records[-1].sequence_number,
                "approximateArrivalOfFirstRecord": _iso(records[0].arrival),
                "approximateArrivalOfLastRecord": _iso(records[-1].arrival),
                "batchSize": len(records),
                "streamArn": config.stream_arn,
            },
        }

    def _send_on_failure(
        self,
        mapping: _Mapping,
        shard_id: str,
        record: dict[str, Any],
        records: list[StreamRecord],
    ) -> None:
        destination = mapping.config.on_failure or ""
        service = destination.split(":")[2] if destination.count(":") >= 5 else ""
        if service == "sqs":
            self._destination("sqs").send_message(
                QueueUrl=self._queue_url(destination), MessageBody=json.dumps(record)
            )
        elif service == "sns":
            self._destination("sns").publish(TopicArn=destination, Message=json.dumps(record))
        elif service == "s3":
            bucket = destination.split(":")[5]
            now = datetime.fromtimestamp(self._clock.now_ms() / 1000, UTC)
            key = (
                f"aws/lambda/{mapping.config.uuid}/{shard_id}/{now:%Y/%m/%d}/"
                f"{now:%Y-%m-%dT%H.%M.%S}-{uuid.uuid4()}"
            )
            # Only an S3 destination carries the whole event (the docs: "payload").
            payload = kinesis_event(
                records,
                shard_id=shard_id,
                stream_arn=mapping.config.stream_arn,
                region=self.region,
                role_arn=mapping.role_arn,
            )
            body = {**record, "payload": json.dumps(payload)}
            self._destination("s3").put_object(
                Bucket=bucket, Key=key, Body=json.dumps(body).encode()
            )
        else:
            logger.error(
                "unsupported on-failure destination",
                extra={"mapping": mapping.config.uuid, "destination": destination},
            )

    def _destination(self, service: str) -> Any:
        with self._clients_lock:
            if service not in self._destinations:
                self._destinations[service] = self._client(service)
            return self._destinations[service]

    def _queue_url(self, queue_arn: str) -> str:
        if queue_arn not in self._queue_urls:
            _, _, _, _, account, name = queue_arn.split(":", 5)
            url = self._destination("sqs").get_queue_url(
                QueueName=name, QueueOwnerAWSAccountId=account
            )["QueueUrl"]
            self._queue_urls[queue_arn] = url
        return self._queue_urls[queue_arn]

    # -- background threads ------------------------------------------------------------------

    def start(self) -> None:
        """Poll in background threads: one loop per mapping shard, plus one that syncs."""
        if self._running.is_set():
            return
        self._stopping.clear()
        self._pool = ThreadPoolExecutor(self._max_workers, thread_name_prefix="shoal-esm-lane")
        self._running.set()
        try:
            self.sync()
        except Exception:
            self.stop()
            raise
        self._sync_thread = threading.Thread(
            target=self._sync_loop, name="shoal-esm-sync", daemon=True
        )
        self._sync_thread.start()

    def stop(self) -> None:
        """Stop polling and join every thread; a batch in flight is finished first."""
        if not self._running.is_set():
            return
        self._stopping.set()
        # The sync thread goes first: it is the one that starts poll loops.
        if self._sync_thread is not None:
            self._sync_thread.join(self._join_timeout_s)
        threads: list[threading.Thread] = []
        with self._lock:
            for worker in self._workers.values():
                worker.stop.set()
                threads.append(worker.thread)
            self._workers.clear()
            threads.extend(self._retired)
            self._retired.clear()
        for thread in threads:
            thread.join(self._join_timeout_s)
            if thread.is_alive():
                logger.error(
                    "event source mapping thread did not stop", extra={"thread": thread.name}
                )
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._sync_thread = None
        self._running.clear()

    def __enter__(self) -> EventSourceMappings:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def _sync_loop(self) -> None:
        while not self._stopping.wait(self.sync_interval_s):
            try:
                self.sync()
            except Exception:
                logger.exception("event source mapping sync failed")

    def _ensure_worker(self, mapping_uuid: str, shard_id: str) -> None:
        key = (mapping_uuid, shard_id)
        if key in self._workers or self._stopping.is_set():
            return
        stop = threading.Event()
        thread = threading.Thread(
            target=self._poll_loop,
            args=(mapping_uuid, shard_id, stop),
            name=f"shoal-esm-{mapping_uuid[:8]}-{shard_id[-4:]}",
            daemon=True,
        )
        self._workers[key] = _Worker(thread, stop)
        thread.start()

    def _retire_workers(self, mapping_uuid: str, keep: set[str]) -> None:
        with self._lock:
            for key in [k for k in self._workers if k[0] == mapping_uuid and k[1] not in keep]:
                worker = self._workers.pop(key)
                worker.stop.set()
                self._retired.append(worker.thread)

    def _poll_loop(self, mapping_uuid: str, shard_id: str, stop: threading.Event) -> None:
        while not (stop.is_set() or self._stopping.is_set()):
            with self._lock:
                mapping = self._mappings.get(mapping_uuid)
            if mapping is None:
                return
            try:
                _, moved = self._step(mapping, shard_id, pool=self._pool)
            except Exception:
                logger.exception(
                    "event source mapping poll failed",
                    extra={"mapping": mapping_uuid, "shard": shard_id},
                )
                moved = False
            if not moved:
                stop.wait(self.poll_interval_s)


def _moto_starting_timestamp(raw: dict[str, Any]) -> float | None:
    """An AT_TIMESTAMP mapping's time, which moto keeps but leaves out of its answers.

    Read from moto's backend in this process (``mock_aws`` and the embedded server both run
    here); None when that backend is not at hand, and the mapping is then left alone.
    """
    try:
        from moto.awslambda.models import lambda_backends
        from moto.awslambda_simple.models import lambda_simple_backends
    except ImportError:  # pragma: no cover - moto is a dependency of the local runtime
        return None
    parts = str(raw.get("EventSourceMappingArn", "")).split(":")
    if len(parts) < 7:
        return None
    region, account = parts[3], parts[4]
    for backends in (lambda_backends, lambda_simple_backends):
        mapping = backends[account][region].get_event_source_mapping(raw["UUID"])
        stamp = getattr(mapping, "starting_position_timestamp", None)
        if isinstance(stamp, datetime):
            return stamp.timestamp()
        if isinstance(stamp, int | float | str):
            return float(stamp)
    return None


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))
