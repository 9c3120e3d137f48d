"""The emulated Kinesis event source mappings against the Lambda semantics they copy.

Streams and mappings are made through the real APIs (moto, in process); the handler is a
recording fake. Each record's data is a short label (mostly its number in put order: "1", "2",
...), so a batch reads as the list of its labels.
"""

from __future__ import annotations

import base64
import copy
import json
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import boto3
import pytest
from shoal.core.clock import ManualClock
from shoal.local.checkpoints import FileCheckpoints, Position
from shoal.local.esm.config import FAN_OUT_FEED_S
from shoal.local.esm.invocation import lane_of
from shoal.local.esm.mappings import EventSourceMappings
from shoal.local.provision import LAMBDA_ROLE, LocalNames

from tests.helpers import load_event

FUNCTION = LocalNames.for_deployment().functions["health"]
STREAM = "esm-test"
START_MS = 1_700_000_000_000

Respond = Callable[[dict[str, Any]], Any]


class Recorder:
    """A handler that records each event it gets and answers with ``respond(event)``."""

    def __init__(self, respond: Respond | None = None) -> None:
        self.respond = respond
        self.events: list[dict[str, Any]] = []
        self.functions: list[str] = []
        self.changed = threading.Condition()

    def __call__(self, function_name: str, event: dict[str, Any]) -> Any:
        with self.changed:
            self.functions.append(function_name)
            self.events.append(copy.deepcopy(event))
            self.changed.notify_all()
        return self.respond(event) if self.respond else None

    @property
    def batches(self) -> list[list[str]]:
        with self.changed:
            return [values(e) for e in self.events]

    def wait_for(self, invocations: int, timeout_s: float = 10) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: len(self.events) >= invocations, timeout_s)


def values(event: dict[str, Any]) -> list[str]:
    return [base64.b64decode(r["kinesis"]["data"]).decode() for r in event["Records"]]


def failing_on(*poison: str) -> Respond:
    def respond(event: dict[str, Any]) -> None:
        if set(poison) & set(values(event)):
            raise RuntimeError("poison record")

    return respond


def reporting(*failed: str) -> Respond:
    """Report the records with these values as failed (in this order), the first time only."""
    reported: set[str] = set()

    def respond(event: dict[str, Any]) -> dict[str, Any]:
        seq = {
            v: r["kinesis"]["sequenceNumber"]
            for r, v in zip(event["Records"], values(event), strict=True)
        }
        fresh = [v for v in failed if v in seq and v not in reported]
        reported.update(fresh)
        return {"batchItemFailures": [{"itemIdentifier": seq[v]} for v in fresh]}

    return respond


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(START_MS)


@pytest.fixture
def session(
    aws: boto3.Session, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> Iterator[boto3.Session]:
    # moto stamps arrival times with its own utcnow: tie it to the manual clock (the `aws`
    # fixture already keeps moto from invoking mapped functions through Docker).
    def moto_now() -> datetime:
        return datetime.fromtimestamp(clock.now_ms() / 1000, UTC).replace(tzinfo=None)

    monkeypatch.setattr("moto.kinesis.models.utcnow", moto_now)
    yield aws


def make_stream(session: boto3.Session, shards: int = 1, name: str = STREAM) -> str:
    kinesis = session.client("kinesis")
    kinesis.create_stream(StreamName=name, ShardCount=shards)
    return str(
        kinesis.describe_stream_summary(StreamName=name)["StreamDescriptionSummary"]["StreamARN"]
    )


def put(
    session: boto3.Session,
    items: list[str] | range,
    *,
    key: str = "k",
    keys: list[str] | None = None,
    shards: list[int] | None = None,
    name: str = STREAM,
) -> None:
    """Put the items in order, in one call; ``keys`` and ``shards`` set them per item."""
    kinesis = session.client("kinesis")
    starts: list[str] = []
    if shards is not None:
        listed = kinesis.list_shards(StreamName=name)["Shards"]
        starts = [s["HashKeyRange"]["StartingHashKey"] for s in listed]
    entries: list[Any] = []
    for i, item in enumerate(items):
        entry = {"Data": str(item).encode(), "PartitionKey": keys[i] if keys else key}
        if shards is not None:
            entry["ExplicitHashKey"] = starts[shards[i]]
        entries.append(entry)
    kinesis.put_records(StreamName=name, Records=entries)


def create_mapping(session: boto3.Session, stream_arn: str, **options: Any) -> str:
    options.setdefault("StartingPosition", "TRIM_HORIZON")
    options.setdefault("BatchSize", 10)
    mapping = session.client("lambda").create_event_source_mapping(
        EventSourceArn=stream_arn, FunctionName=FUNCTION, **options
    )
    return str(mapping["UUID"])


def emulator(
    session: boto3.Session, handler: Recorder, clock: ManualClock, **kwargs: Any
) -> EventSourceMappings:
    esm = EventSourceMappings(session, handler, clock, **kwargs)
    esm.sync()
    return esm


def make_queue(session: boto3.Session, name: str = "esm-failures") -> tuple[str, str]:
    sqs = session.client("sqs")
    url = sqs.create_queue(QueueName=name)["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"][
        "QueueArn"
    ]
    return url, arn


def failure_records(session: boto3.Session, url: str) -> list[dict[str, Any]]:
    messages = session.client("sqs").receive_message(QueueUrl=url, MaxNumberOfMessages=10)
    return [json.loads(m["Body"]) for m in messages.get("Messages", [])]


def shape(value: Any) -> Any:
    """The keys of a JSON document, recursively: two events of one kind have one shape."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return type(value).__name__


# --- the event ------------------------------------------------------------------------------


def test_event_has_the_shape_lambda_sends(session: boto3.Session, clock: ManualClock) -> None:
    # Given a mapping on a stream holding two records
    stream_arn = make_stream(session)
    create_mapping(session, stream_arn)
    put(session, ["1", "2"], key="orders/eu/1")
    handler = Recorder()
    esm = emulator(session, handler, clock)

    # When the emulator delivers them
    esm.drain()

    # Then the event has the shape of the sample and the values of a Lambda Kinesis event
    [event] = handler.events
    assert shape(event) == shape(load_event("kinesis_batch.json"))
    first = event["Records"][0]
    role = session.client("iam").get_role(RoleName=LAMBDA_ROLE)["Role"]["Arn"]
    assert first["eventID"] == f"shardId-000000000000:{first['kinesis']['sequenceNumber']}"
    assert first["kinesis"]["partitionKey"] == "orders/eu/1"
    assert first["kinesis"]["approximateArrivalTimestamp"] == START_MS / 1000
    assert first["invokeIdentityArn"] == role
    assert first["eventSourceARN"] == stream_arn
    assert first["awsRegion"] == "us-east-1"
    assert handler.functions == [FUNCTION]
    assert values(event) == ["1", "2"]


# --- order, batch size, batching window, starting position ------------------------------------


def test_records_of_a_shard_arrive_in_order_one_shard_per_batch(
    session: boto3.Session, clock: ManualClock
) -> None:
    # Given two shards with 12 records each, put alternately
    stream_arn = make_stream(session, shards=2)
    create_mapping(session, stream_arn, BatchSize=5)
    put(
        session,
        [f"{shard}{i}" for i in range(12) for shard in "ab"],
        shards=[shard for _ in range(12) for shard in (0, 1)],
    )
    handler = Recorder()

    # When everything is delivered
    emulator(session, handler, clock).drain()

    # Then each batch holds one shard's records, and each shard's records come in put order
    shards_per_batch = [{r["eventID"].split(":")[0] for r in e["Records"]} for e in handler.events]
    assert all(len(shards) == 1 for shards in shards_per_batch)
    seen = [v for batch in handler.batches for v in batch]
    assert [v for v in seen if v.startswith("a")] == [f"a{i}" for i in range(12)]
    assert [v for v in seen if v.startswith("b")] == [f"b{i}" for i in range(12)]


def test_batch_size_caps_each_invocation(session: boto3.Session, clock: ManualClock) -> None:
    # Given 10 records and a batch size of 4
    create_mapping(session, make_stream(session), BatchSize=4)
    put(session, range(1, 11))
    handler = Recorder()

    # When they are delivered
    emulator(session, handler, clock).drain()

    # Then the function gets 4, 4, then 2
    assert handler.batches == [["1", "2", "3", "4"], ["5", "6", "7", "8"], ["9", "10"]]


def test_batching_window_holds_a_partial_batch_until_it_expires(
    session: boto3.Session, clock: ManualClock
) -> None:
    # Given a 5-second batching window and 3 records, fewer than a batch
    create_mapping(session, make_stream(session), BatchSize=10, MaximumBatchingWindowInSeconds=5)
    put(session, ["1", "2", "3"])
    handler = Recorder()
    esm = emulator(session, handler, clock)

    # When the window has not yet passed, nothing is invoked
    esm.run_once()
    clock.advance(4.9)
    esm.run_once()
    assert handler.batches == []

    # Then once it has, the three records go in one batch
    clock.advance(0.1)
    esm.run_once()
    assert handler.batches == [["1", "2", "3"]]


def test_full_batch_does_not_wait_for_the_batching_window(
    session: boto3.Session, clock: ManualClock
) -> None:
    # Given a long batching window and a full batch of records
    create_mapping(session, make_stream(session), BatchSize=3, MaximumBatchingWindowInSeconds=300)
    put(session, ["1", "2", "3"])
    handler = Recorder()

    # When the emulator runs once, without time passing
    emulator(session, handler, clock).run_once()

    # Then the full batch is delivered at once
    assert handler.batches == [["1", "2", "3"]]


def test_trim_horizon_delivers_records_already_in_the_stream(
    session: boto3.Session, clock: ManualClock
) -> None:
    # Given records put before the mapping existed
    stream_arn = make_stream(session)
    put(session, ["old"])
    create_mapping(session, stream_arn, StartingPosition="TRIM_HORIZON")
    put(session, ["new"])
    handler = Recorder()

    # When the mapping is delivered
    emulator(session, handler, clock).drain()

    # Then the older record comes too
    assert handler.batches == [["old", "new"]]


def test_latest_skips_records_already_in_the_stream(
    session: boto3.Session, clock: ManualClock
) -> None:
    # Given records put before a LATEST mapping was picked up
    stream_arn = make_stream(session)
    put(session, ["old"])
    create_mapping(session, stream_arn, StartingPosition="LATEST")
    handler = Recorder()
    esm = emulator(session, handler, clock)

    # When a record arrives afterwards
    put(session, ["new"])
    esm.drain()

    # Then only it is delivered
    assert handler.batches == [["new"]]


def test_at_timestamp_starts_at_the_first_record_of_that_time(
    session: boto3.Session, clock: ManualClock
) -> None:
    # Given three records ten seconds apart
    stream_arn = make_stream(session)
    for value in ["1", "2", "3"]:
        put(session, [value])
        clock.advance(10)
    second_arrival = (START_MS + 10_000) / 1000

    # When a mapping starts at the second record's arrival time
    create_mapping(
        session,
        stream_arn,
        StartingPosition="AT_TIMESTAMP",
        StartingPositionTimestamp=second_arrival,
    )
    handler = Recorder()
    emulator(session, handler, clock).drain()

    # Then delivery starts with the second record
    assert handler.batches == [["2", "3"]]


# --- ReportBatchItemFailures ------------------------------------------------------------------


def test_partial_failure_retries_from_the_failed_record(
    session: boto3.Session, clock: ManualClock
) -> None:
    # Given a function that reports record 7 of 10 as failed, once
    create_mapping(session, make_stream(session), FunctionResponseTypes=["ReportBatchItemFailures"])
    put(session, range(1, 11))
    handler = Recorder(reporting("7"))

    # When the batch is delivered
    emulator(session, handler, clock).drain()

    # Then the next invocation starts at record 7
    assert handler.batches == [[str(i) for i in range(1, 11)], ["7", "8", "9", "10"]]


def test_lowest_reported_sequence_number_is_the_checkpoint(
    session: boto3.Session, clock: ManualClock
) -> None:
    # Given a function that reports records 9 and 7 (in that order) as failed
    create_mapping(session, make_stream(session), FunctionResponseTypes=["ReportBatchItemFailures"])
    put(session, range(1, 11))
    handler = Recorder(reporting("9", "7"))

    # When the batch is delivered
    emulator(session, handler, clock).drain()

    # Then the retry starts at the lowest of them
    assert handler.batches[1] == ["7", "8", "9", "10"]


def test_unusable_failure_report_fails_the_whole_batch(
    session: boto3.Session, clock: ManualClock
) -> None:
    # Given a function that answers its first batch with an empty itemIdentifier
    # (every unusable report is listed in tests/unit/local/test_batch_outcome.py)
    create_mapping(session, make_stream(session), FunctionResponseTypes=["ReportBatchItemFailures"])
    put(session, range(1, 5))
    answers = [{"batchItemFailures": [{"itemIdentifier": ""}]}]
    handler = Recorder(lambda _event: answers.pop() if answers else None)

    # When the batch is delivered
    emulator(session, handler, clock).drain()

    # Then the whole batch is retried
    assert handler.batches == [["1", "2", "3", "4"], ["1", "2", "3", "4"]]


def test_empty_failure_report_is_success(session: boto3.Session, clock: ManualClock) -> None:
    # Given a function that answers with an empty failure list
    create_mapping(session, make_stream(session), FunctionResponseTypes=["ReportBatchItemFailures"])
    put(session, range(1, 5))
    handler = Recorder(lambda _event: {"batchItemFailures": []})

    # When the batch is delivered
    emulator(session, handler, clock).drain()

    # Then it is delivered once
    assert handler.batches == [["1", "2", "3", "4"]]


def test_failure_report_is_ignored_without_report_batch_item_failures(
    session: boto3.Session, clock: ManualClock
) -> None:
    # Given a mapping without ReportBatchItemFailures and a function reporting a failure
    create_mapping(session, make_stream(session))
    put(session, range(1, 5))
    handler = Recorder(lambda _event: {"batchItemFailures": [{"itemIdentifier": ""}]})

    # When the batch is delivered
    emulator(session, handler, clock).drain()

    # Then the answer counts as success
    assert handler.batches == [["1", "2", "3", "4"]]


# --- function errors: retry, bisect, maximum retries, record age, destinations -------------------


def test_function_error_retries_the_same_batch(session: boto3.Session, clock: ManualClock) -> None:
    # Given a function that raises on its first invocation only
    create_mapping(session, make_stream(session))
    put(session, range(1, 5))
    raised: list[bool] = []

    def respond(_event: dict[str, Any]) -> None:
        if not raised:
            raised.append(True)
            raise RuntimeError("first time")

    handler = Recorder(respond)

    # When the batch is delivered
    emulator(session, handler, clock).drain()

    # Then the same batch comes again
    assert handler.batches == [["1", "2", "3", "4"], ["1", "2", "3", "4"]]


def test_bisect_splits_a_failing_batch_in_halves(
    session: boto3.Session, clock: ManualClock
) -> None:
    # Given a function that always fails on record 3 of 8, no retries, bisect on error
    create_mapping(
        session, make_stream(session), BisectBatchOnFunctionError=True, MaximumRetryAttempts=0
    )
    put(session, range(1, 9))
    handler = Recorder(failing_on("3"))

    # When the batch is delivered
    emulator(session, handler, clock).drain()

    # Then failing batches are halved until record 3 stands alone and is discarded
    assert handler.batches == [
        ["1", "2", "3", "4", "5", "6", "7", "8"],
        ["1", "2", "3", "4"],
        ["1", "2"],
        ["3", "4"],
        ["3"],
        ["4"],
        ["5", "6", "7", "8"],
    ]


def test_retries_stop_at_the_maximum_and_the_batch_goes_to_the_on_failure_queue(
    session: boto3.Session, clock: ManualClock
) -> None:
    # Given a function that always fails on "poison", two retries, an on-failure queue
    url, queue_arn = make_queue(session)
    stream_arn = make_stream(session)
    uuid = create_mapping(
        session,
        stream_arn,
        MaximumRetryAttempts=2,
        DestinationConfig={"OnFailure": {"Destination": queue_arn}},
    )
    put(session, ["poison", "other"])
    handler = Recorder(failing_on("poison"))
    esm = emulator(session, handler, clock)

    # When the batch is delivered, then a later record
    esm.drain()
    put(session, ["later"])
    esm.drain()

    # Then the batch was tried 1 + 2 times, its invocation record is in the queue,
    # and processing went on
    assert handler.batches == [["poison", "other"]] * 3 + [["later"]]
    [record] = failure_records(session, url)
    assert record["requestContext"]["condition"] == "RetryAttemptsExhausted"
    assert record["requestContext"]["approximateInvokeCount"] == 3
    assert record["requestContext"]["functionArn"].endswith(f":function:{FUNCTION}")
    assert record["responseContext"]["functionError"] == "Unhandled"
    assert record["KinesisBatchInfo"] == {
        "shardId": "shardId-000000000000",
        "startSequenceNumber": "1",
        "endSequenceNumber": "2",
        "approximateArrivalOfFirstRecord": "2023-11-14T22:13:20.000Z",
        "approximateArrivalOfLastRecord": "2023-11-14T22:13:20.000Z",
        "batchSize": 2,
        "streamArn": stream_arn,
    }
    assert shape(record) == shape(load_event("kinesis_on_failure_record.json"))
    assert esm.checkpoint(uuid, "shardId-000000000000") == Position.after(3)


def test_records_older_than_the_maximum_age_are_discarded(
    session: boto3.Session, clock: ManualClock
) -> None:
    # Given a function that always fails, unlimited retries, a maximum record age of 60 s
    url, queue_arn = make_queue(session)
    create_mapping(
        session,
        make_stream(session),
        MaximumRecordAgeInSeconds=60,
        DestinationConfig={"OnFailure": {"Destination": queue_arn}},
    )
    put(session, ["1", "2"])
    handler = Recorder(failing_on("1"))
    esm = emulator(session, handler, clock)
    esm.run_once()

    # When the records grow older than 60 s, then a new one arrives
    clock.advance(61)
    esm.drain()
    put(session, ["3"])
    esm.drain()

    # Then the old batch was not tried again, its record says why, and the new one flows
    assert handler.batches == [["1", "2"], ["3"]]
    [record] = failure_records(session, url)
    assert record["requestContext"]["condition"] == "RecordAgeExceeded"
    assert record["KinesisBatchInfo"]["batchSize"] == 2


def test_on_failure_bucket_gets_the_record_with_the_whole_event(
    session: boto3.Session, clock: ManualClock
) -> None:
    # Given an S3 on-failure destination and a batch that always fails, no retries
    s3 = session.client("s3")
    s3.create_bucket(Bucket="esm-failures")
    uuid = create_mapping(
        session,
        make_stream(session),
        MaximumRetryAttempts=0,
        DestinationConfig={"OnFailure": {"Destination": "arn:aws:s3:::esm-failures"}},
    )
    put(session, ["poison"])

    # When the batch is discarded
    emulator(session, Recorder(failing_on("poison")), clock).drain()

    # Then an object under Lambda's key layout holds the invocation record and the event
    [obj] = s3.list_objects_v2(Bucket="esm-failures")["Contents"]
    assert obj["Key"].startswith(f"aws/lambda/{uuid}/shardId-000000000000/2023/11/14/")
    body = json.loads(s3.get_object(Bucket="esm-failures", Key=obj["Key"])["Body"].read())
    assert body["requestContext"]["condition"] == "RetryAttemptsExhausted"
    assert values(json.loads(body["payload"])) == ["poison"]


# --- parallelization factor -----------------------------------------------------------------


def keys_in_distinct_lanes(lanes: int, count: int) -> list[str]:
    keys: dict[int, str] = {}
    i = 0
    while len(keys) < count:
        keys.setdefault(lane_of(f"key-{i}", lanes), f"key-{i}")
        i += 1
    return list(keys.values())


def test_parallelization_factor_runs_lanes_together_and_keeps_each_key_in_order(
    session: boto3.Session, clock: ManualClock
) -> None:
    # Given a parallelization factor of 3, and 5 records for each of 3 keys in distinct lanes
    create_mapping(session, make_stream(session), ParallelizationFactor=3, BatchSize=2)
    keys = keys_in_distinct_lanes(3, 3)
    put(
        session,
        [f"{key}/{i}" for i in range(5) for key in keys],
        keys=[key for _ in range(5) for key in keys],
    )
    handler = Recorder()
    esm = emulator(session, handler, clock)

    # When the emulator runs one round, then the rest
    first_round = esm.run_once()
    esm.drain()

    # Then one round handed over a batch per lane, and each key arrived in put order
    assert first_round == 6
    seen = [v for batch in handler.batches for v in batch]
    for key in keys:
        assert [v for v in seen if v.startswith(f"{key}/")] == [f"{key}/{i}" for i in range(5)]


def test_checkpoint_never_passes_an_unfinished_record(
    session: boto3.Session, clock: ManualClock
) -> None:
    # Given two lanes: the first record's key keeps failing, later keys succeed
    uuid = create_mapping(session, make_stream(session), ParallelizationFactor=2)
    stuck, flowing = keys_in_distinct_lanes(2, 2)
    put(session, ["stuck"], key=stuck)
    put(session, ["2", "3", "4"], key=flowing)
    healed = threading.Event()

    def respond(event: dict[str, Any]) -> None:
        if "stuck" in values(event) and not healed.is_set():
            raise RuntimeError("not yet")

    handler = Recorder(respond)
    esm = emulator(session, handler, clock)

    # When the other lane is done but the first record is not
    esm.drain(max_rounds=5)
    assert ["2", "3", "4"] in handler.batches
    assert esm.checkpoint(uuid, "shardId-000000000000") == Position.at(1)

    # Then the checkpoint moves past everything only once the first record is done
    healed.set()
    esm.drain()
    assert esm.checkpoint(uuid, "shardId-000000000000") == Position.after(4)


# --- mapping life cycle ---------------------------------------------------------------------


def test_disabled_mapping_is_not_polled_and_resumes_where_it_stopped(
    session: boto3.Session, clock: ManualClock
) -> None:
    # Given a mapping that delivered one record and was then disabled
    awslambda = session.client("lambda")
    uuid = create_mapping(session, make_stream(session))
    put(session, ["1"])
    handler = Recorder()
    esm = emulator(session, handler, clock)
    esm.drain()
    awslambda.update_event_source_mapping(UUID=uuid, Enabled=False)
    esm.sync()

    # When records arrive while it is disabled
    put(session, ["2", "3"])
    esm.drain()
    assert handler.batches == [["1"]]

    # Then they are delivered once it is enabled again, and record 1 is not
    awslambda.update_event_source_mapping(UUID=uuid, Enabled=True)
    esm.sync()
    esm.drain()
    assert handler.batches == [["1"], ["2", "3"]]


def test_deleted_mapping_stops_and_forgets_its_checkpoints(
    session: boto3.Session, clock: ManualClock
) -> None:
    # Given a mapping that delivered a record
    uuid = create_mapping(session, make_stream(session))
    put(session, ["1"])
    handler = Recorder()
    esm = emulator(session, handler, clock)
    esm.drain()

    # When it is deleted and records arrive
    session.client("lambda").delete_event_source_mapping(UUID=uuid)
    esm.sync()
    put(session, ["2"])
    esm.drain()

    # Then nothing more is delivered and its checkpoint is gone
    assert handler.batches == [["1"]]
    assert esm.checkpoint(uuid, "shardId-000000000000") is None


def test_mapping_of_a_deleted_stream_does_not_stop_the_others(
    session: boto3.Session, clock: ManualClock
) -> None:
    # Given two mappings, and the stream of the first is deleted after the emulator synced
    gone_arn = make_stream(session, name="esm-gone")
    create_mapping(session, gone_arn)
    create_mapping(session, make_stream(session))
    handler = Recorder()
    esm = emulator(session, handler, clock)
    session.client("kinesis").delete_stream(StreamName="esm-gone")

    # When a record arrives on the other stream
    put(session, ["1"])
    esm.drain()

    # Then it is delivered, and the next sync leaves the orphaned mapping idle
    assert handler.batches == [["1"]]
    esm.sync()
    assert esm.drain() == 0


def test_mapping_created_at_run_time_is_picked_up_by_sync(
    session: boto3.Session, clock: ManualClock
) -> None:
    # Given a running emulator that knows no mapping
    handler = Recorder()
    esm = emulator(session, handler, clock)
    stream_arn = make_stream(session)
    put(session, ["1"])

    # When a mapping is created through the Lambda API
    create_mapping(session, stream_arn)
    esm.drain()
    assert handler.batches == []

    # Then the next sync picks it up
    esm.sync()
    esm.drain()
    assert handler.batches == [["1"]]


def test_checkpoints_survive_a_restart(
    session: boto3.Session, clock: ManualClock, tmp_path: Path
) -> None:
    # Given an emulator with a state directory that delivered three records, then died
    create_mapping(session, make_stream(session))
    put(session, ["1", "2", "3"])
    emulator(session, Recorder(), clock, checkpoints=FileCheckpoints(tmp_path)).drain()
    put(session, ["4", "5"])

    # When a new emulator starts over the same directory
    handler = Recorder()
    emulator(session, handler, clock, checkpoints=FileCheckpoints(tmp_path)).drain()

    # Then it resumes after the checkpoint
    assert handler.batches == [["4", "5"]]


def test_records_in_flight_at_a_restart_are_delivered_again(
    session: boto3.Session, clock: ManualClock, tmp_path: Path
) -> None:
    # Given an emulator whose function kept failing on a batch when it died
    create_mapping(session, make_stream(session), BatchSize=2)
    put(session, ["1", "2", "3", "4"])
    emulator(
        session, Recorder(failing_on("3")), clock, checkpoints=FileCheckpoints(tmp_path)
    ).drain(max_rounds=4)

    # When a new emulator starts over the same directory
    handler = Recorder()
    emulator(session, handler, clock, checkpoints=FileCheckpoints(tmp_path)).drain()

    # Then the unfinished batch is delivered again (at least once), the finished one is not
    assert handler.batches == [["3", "4"]]


def test_seek_to_trim_horizon_delivers_the_stream_again(
    session: boto3.Session, clock: ManualClock
) -> None:
    # Given a mapping that delivered everything
    uuid = create_mapping(session, make_stream(session))
    put(session, ["1", "2"])
    handler = Recorder()
    esm = emulator(session, handler, clock)
    esm.drain()

    # When it is moved to TRIM_HORIZON
    esm.seek(uuid, Position("TRIM_HORIZON"))
    esm.drain()

    # Then the records come again
    assert handler.batches == [["1", "2"], ["1", "2"]]


def test_seek_to_latest_skips_undelivered_records(
    session: boto3.Session, clock: ManualClock
) -> None:
    # Given a mapping stuck on a batch its function keeps failing
    uuid = create_mapping(session, make_stream(session))
    put(session, ["1", "2"])
    handler = Recorder(failing_on("1"))
    esm = emulator(session, handler, clock)
    esm.drain(max_rounds=2)

    # When it is moved to LATEST and a record arrives
    esm.seek(uuid, Position("LATEST"))
    put(session, ["3"])
    esm.drain()

    # Then delivery goes on from the new record
    assert handler.batches[-1] == ["3"]
    assert handler.batches.count(["1", "2"]) == 2


# --- background threads --------------------------------------------------------------------


def test_background_threads_deliver_pick_up_new_mappings_and_stop(
    session: boto3.Session, clock: ManualClock
) -> None:
    # Given the emulator polling in the background, with no mapping yet
    handler = Recorder()
    esm = EventSourceMappings(session, handler, clock, poll_interval_s=0.02, sync_interval_s=0.02)
    stream_arn = make_stream(session)
    put(session, ["1"])
    esm.start()
    try:
        # When a mapping is created while it runs
        create_mapping(session, stream_arn)

        # Then the record is delivered without anyone calling sync
        assert handler.wait_for(1)
    finally:
        esm.stop()

    # And no poll thread is left behind
    assert handler.batches == [["1"]]
    assert not [t for t in threading.enumerate() if t.name.startswith("shoal-esm")]


def test_background_lanes_of_one_shard_run_concurrently(
    session: boto3.Session, clock: ManualClock
) -> None:
    # Given a parallelization factor of 2 and a function that waits for a second invocation
    create_mapping(session, make_stream(session), ParallelizationFactor=2)
    first, second = keys_in_distinct_lanes(2, 2)
    put(session, ["a"], key=first)
    put(session, ["b"], key=second)
    barrier = threading.Barrier(2, timeout=10)
    handler = Recorder(lambda _event: barrier.wait())
    esm = EventSourceMappings(session, handler, clock, poll_interval_s=0.02)

    # When both lanes are delivered in the background
    with esm:
        assert handler.wait_for(2)

    # Then both invocations were in the handler at once (the barrier never broke)
    assert not barrier.broken
    assert sorted(handler.batches) == [["a"], ["b"]]


# --- enhanced fan-out -------------------------------------------------------------------------


def consumer_of(session: boto3.Session, stream_arn: str, name: str = "router") -> str:
    kinesis = session.client("kinesis")
    return str(
        kinesis.register_stream_consumer(StreamARN=stream_arn, ConsumerName=name)["Consumer"][
            "ConsumerARN"
        ]
    )


def test_a_mapping_on_a_consumer_reads_its_stream_with_its_own_settings(
    session: boto3.Session, clock: ManualClock, tmp_path: Path
) -> None:
    # Given a mapping whose source is an enhanced fan-out consumer of the stream
    stream_arn = make_stream(session)
    create_mapping(session, consumer_of(session, stream_arn), BatchSize=2)
    put(session, ["1", "2", "3"])
    handler = Recorder()
    esm = emulator(session, handler, clock, checkpoints=FileCheckpoints(tmp_path))

    # When it runs
    esm.drain()

    # Then it delivers the stream's records in order, in batches of its own size, with the
    # stream's ARN as the event source (as Lambda sends a consumer's records)
    assert handler.batches == [["1", "2"], ["3"]]
    assert {r["eventSourceARN"] for e in handler.events for r in e["Records"]} == {stream_arn}

    # And a restart resumes from its checkpoint on the consumer: nothing twice, nothing lost
    put(session, ["4"])
    again = Recorder()
    emulator(session, again, clock, checkpoints=FileCheckpoints(tmp_path)).drain()
    assert again.batches == [["4"]]


def test_a_shard_of_a_consumer_is_read_again_within_the_feeds_70_ms(
    session: boto3.Session, clock: ManualClock
) -> None:
    # Given a mapping on a stream and one on a consumer of another stream
    standard = create_mapping(session, make_stream(session))
    other = make_stream(session, name="esm-fan-out")
    fed = create_mapping(session, consumer_of(session, other))
    esm = emulator(session, Recorder(), clock)

    # Then an idle shard of the consumer's mapping waits 70 ms for records (Kinesis pushes a
    # consumer's records about 70 ms after they arrive), the stream's the poll interval
    on_consumer, on_stream = esm.config(fed), esm.config(standard)
    assert on_consumer is not None and on_stream is not None
    assert esm.idle_wait_s(on_consumer) == FAN_OUT_FEED_S == 0.07
    assert esm.idle_wait_s(on_stream) == esm.poll_interval_s == 0.5
    # And the consumer's mapping keeps every other setting of its own
    assert on_consumer.fan_out and not on_stream.fan_out
    assert on_consumer.stream_arn.endswith(":stream/esm-fan-out")
    assert (on_consumer.batch_size, on_consumer.starting_position.kind) == (10, "TRIM_HORIZON")
