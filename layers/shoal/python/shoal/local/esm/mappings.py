"""The emulator of every Kinesis event source mapping: it reads the mappings through the Lambda
API, polls their shards, hands batches to the functions and keeps the checkpoints (the Lambda
behaviour it copies: ``shoal.local.esm``)."""

from __future__ import annotations

import threading
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import boto3
from botocore.exceptions import ClientError

from shoal.aws.clients import error_code
from shoal.core.clock import Clock
from shoal.core.observability import logger
from shoal.local.checkpoints import CheckpointStore, MemoryCheckpoints, Position
from shoal.local.esm.config import (
    FAN_OUT_FEED_S,
    STARTING_POSITIONS,
    MappingConfig,
    moto_starting_timestamp,
    stream_name_of,
)
from shoal.local.esm.invocation import (
    BatchOutcome,
    Invoke,
    StreamRecord,
    batch_outcome,
    kinesis_event,
    lane_of,
)
from shoal.local.esm.on_failure import Condition, OnFailure
from shoal.local.esm.shards import Batch, Lane, MappingState, ShardState, cut, ready

#: GetRecords returns at most this many records
MAX_GET_RECORDS = 10_000


@dataclass
class _Plan:
    lane: Lane
    batch: Batch
    event: dict[str, Any]


@dataclass
class _Worker:
    thread: threading.Thread
    stop: threading.Event


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
        fan_out_feed_s: float = FAN_OUT_FEED_S,
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
        self._on_failure = OnFailure(self._client, self.region, clock)
        self._roles: dict[str, str] = {}
        self._lock = threading.RLock()
        self._mappings: dict[str, MappingState] = {}
        self.poll_interval_s = poll_interval_s
        #: an idle shard's wait when its mapping reads through a consumer (enhanced fan-out)
        self.fan_out_feed_s = fan_out_feed_s
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
                    raw["StartingPositionTimestamp"] = moto_starting_timestamp(raw)
                config = MappingConfig.from_api(raw)
                if config is not None:
                    configs[config.uuid] = config
        with self._lock:
            for gone in [u for u in self._mappings if u not in configs]:
                self._forget(gone)
            for mapping_uuid, config in configs.items():
                mapping = self._mappings.get(mapping_uuid)
                if mapping is None:
                    mapping = MappingState(config, self._role_of(config.function_arn))
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

    def _reconcile(self, mapping: MappingState, config: MappingConfig) -> None:
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
                    extra={"mapping": config.uuid, "error": error_code(exc)},
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

    def _open_shard(
        self, config: MappingConfig, shard_id: str, parents: tuple[str, ...]
    ) -> ShardState:
        saved = self.checkpoints.load(config.uuid, shard_id)
        shard = ShardState(
            shard_id=shard_id,
            parent_ids=parents,
            start=saved or config.starting_position,
            persisted=saved,
            lanes=[Lane() for _ in range(config.parallelization_factor)],
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
        if to.kind not in STARTING_POSITIONS:
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

    def _step(
        self, mapping: MappingState, shard_id: str, pool: Executor | None
    ) -> tuple[int, bool]:
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
                    extra={"mapping": config.uuid, "shard": shard_id, "error": error_code(exc)},
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

    def _waits_for_parent(self, mapping: MappingState, shard: ShardState) -> bool:
        # Lambda finishes a parent shard before it reads its children (resharding order).
        return any(
            (parent := mapping.shards.get(p)) is not None and not parent.finished
            for p in shard.parent_ids
        )

    def _fetch(self, config: MappingConfig, shard: ShardState) -> bool:
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
            if error_code(exc) == "ExpiredIteratorException":
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

    def _take(
        self, mapping: MappingState, shard: ShardState, lane: Lane, now_ms: int
    ) -> Batch | None:
        config = mapping.config
        while True:
            if lane.current is None:
                if lane.queued:
                    lane.current = lane.queued.popleft()
                elif ready(config, lane, now_ms):
                    lane.current = cut(config, lane, now_ms)
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
        mapping: MappingState,
        shard: ShardState,
        lane: Lane,
        batch: Batch,
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
                Batch(part, failures=batch.failures, invokes=batch.invokes)
                for part in (batch.records[:half], batch.records[half:])
            ]
            lane.queued.extendleft(reversed(halves))
            lane.current = None
            return
        batch.failures += 1
        if 0 <= config.max_retry_attempts < batch.failures:
            self._discard(mapping, shard, batch, batch.records, "RetryAttemptsExhausted")
            lane.current = None

    def _advance(self, mapping: MappingState, shard: ShardState) -> bool:
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
        mapping: MappingState,
        shard: ShardState,
        batch: Batch,
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
        try:
            self._on_failure.send(mapping, shard.shard_id, batch, records, condition)
        except ClientError as exc:
            # Lambda drops the records either way; a missing destination must not stall a shard.
            logger.error(
                "on-failure destination refused the invocation record",
                extra={"mapping": config.uuid, "error": error_code(exc)},
            )

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
                stop.wait(self.idle_wait_s(mapping.config))

    def config(self, mapping_uuid: str) -> MappingConfig | None:
        """The mapping as the last sync read it (None: not known)."""
        with self._lock:
            mapping = self._mappings.get(mapping_uuid)
        return mapping.config if mapping is not None else None

    def idle_wait_s(self, config: MappingConfig) -> float:
        """How long a shard with nothing to do waits before it reads again: the poll interval,
        or on a consumer the enhanced fan-out feed's (its other settings are the mapping's)."""
        return self.fan_out_feed_s if config.fan_out else self.poll_interval_s


def caught_up(session: boto3.Session, checkpoints: CheckpointStore, function_name: str) -> bool:
    """Whether every mapping that invokes ``function_name`` has done every record of its
    stream so far: on every shard, nothing to read after its checkpoint. Read from outside
    the runtime (``shoal pipeline sync`` waits for the archiver this way, through the
    emulator and the state folder's checkpoints)."""
    awslambda = session.client("lambda")
    kinesis = session.client("kinesis")
    found = awslambda.list_event_source_mappings(FunctionName=function_name)
    for mapping in found.get("EventSourceMappings", []):
        stream = stream_name_of(mapping["EventSourceArn"])
        for shard in kinesis.list_shards(StreamName=stream)["Shards"]:
            position = checkpoints.load(mapping["UUID"], shard["ShardId"])
            iterator = kinesis.get_shard_iterator(
                StreamName=stream,
                ShardId=shard["ShardId"],
                **(position or Position("TRIM_HORIZON")).iterator_args(),
            )["ShardIterator"]
            if kinesis.get_records(ShardIterator=iterator, Limit=1)["Records"]:
                return False
    return True
