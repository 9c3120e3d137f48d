"""The delivery-event recorder and the archiver: an invocation's events are one log record, and
the archiver writes a batch of records as one object per hour, under the layout and in the line
format the pipeline reads (``events/date=.../hour=.../<key>.jsonl``, lines with ``seq`` and
``batch``), with keys from the batch alone."""

from __future__ import annotations

import json
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import boto3
import pytest
from moto import mock_aws
from shoal.core.clock import ManualClock
from shoal.delivery import events as events_module
from shoal.delivery.archiver import EventArchiver
from shoal.delivery.events import DeliveryEvents, Recording, hint_digest, record_answers
from shoal.local.esm.invocation import StreamRecord, kinesis_event

from tests.helpers import load_event

BUCKET = "archive"
STREAM = "events.shoal"
T0 = 1_700_000_000_000  # 2023-11-14T22:13:20Z
HOUR = 3_600_000


@dataclass
class Account:
    s3: Any
    kinesis: Any
    #: records read so far (the log's one shard), in order
    seen: int = 0

    def recorder(self, clock_ms: int) -> DeliveryEvents:
        return Recording(STREAM, ManualClock(clock_ms), self.kinesis).new()

    def records(self) -> list[dict[str, Any]]:
        [shard] = self.kinesis.list_shards(StreamName=STREAM)["Shards"]
        iterator = self.kinesis.get_shard_iterator(
            StreamName=STREAM, ShardId=shard["ShardId"], ShardIteratorType="TRIM_HORIZON"
        )["ShardIterator"]
        return list(self.kinesis.get_records(ShardIterator=iterator)["Records"])

    def batch(self, raw: list[dict[str, Any]]) -> dict[str, Any]:
        """The event the archiver's mapping sends for ``raw`` (records of the one shard)."""
        return kinesis_event(
            [StreamRecord.from_get_records(dict(r)) for r in raw],
            shard_id="shardId-000000000000",
            stream_arn=f"arn:aws:kinesis:us-east-1:123456789012:stream/{STREAM}",
            region="us-east-1",
            role_arn="arn:aws:iam::123456789012:role/archiver",
        )

    def objects(self) -> dict[str, list[dict[str, Any]]]:
        listed = self.s3.list_objects_v2(Bucket=BUCKET).get("Contents", [])
        return {
            o["Key"]: [
                json.loads(line)
                for line in self.s3.get_object(Bucket=BUCKET, Key=o["Key"])["Body"]
                .read()
                .splitlines()
            ]
            for o in listed
        }


@pytest.fixture
def account(monkeypatch: pytest.MonkeyPatch) -> Iterator[Account]:
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    with mock_aws():
        s3 = boto3.client("s3", region_name="us-east-1")
        s3.create_bucket(Bucket=BUCKET)
        kinesis = boto3.client("kinesis", region_name="us-east-1")
        kinesis.create_stream(StreamName=STREAM, ShardCount=1)
        yield Account(s3, kinesis)


def archiver(account: Account, s3: Any = None) -> EventArchiver:
    return EventArchiver(s3 or account.s3, BUCKET, ManualClock(T0 + HOUR))


def record_get(recorder: DeliveryEvents, session: str = "sess-1", at: int = T0) -> None:
    for n in range(3):
        recorder.add(
            "delivered",
            "session",
            session,
            message_id=f"m{n}",
            delivery_id=f"{session}.{n}",
            published_at=at + n,
            qos=1,
            label="client-1",
        )


def name(raw: list[dict[str, Any]]) -> str:
    return f"{STREAM}.shardId-000000000000.{raw[0]['SequenceNumber']}-{raw[-1]['SequenceNumber']}"


def test_a_flush_is_one_record_archived_as_the_lines_of_before(account: Account) -> None:
    # Given three deliveries recorded in one invocation
    recorder = account.recorder(T0 + 500)
    record_get(recorder)
    # When flushed and the archiver takes the log
    assert recorder.flush("get/sess-1/7") == 3
    raw = account.records()
    archiver(account).handle(account.batch(raw))
    # Then the log got one record, keyed by the consumer, and one object holds the lines,
    # numbered, under the earliest publish hour, named after the batch
    assert len(raw) == 1 and raw[0]["PartitionKey"] == "session/sess-1"
    objects = account.objects()
    assert list(objects) == [f"events/date=2023-11-14/hour=22/{name(raw)}.jsonl"]
    [lines] = objects.values()
    assert [(e["event"], e["message_id"], e["seq"]) for e in lines] == [
        ("delivered", "m0", 0),
        ("delivered", "m1", 1),
        ("delivered", "m2", 2),
    ]
    assert lines[0]["at"] == T0 + 500
    assert lines[0]["batch"] == hint_digest("get/sess-1/7")
    assert "reason" not in lines[0]  # absent fields are left out
    # And the object is the record's lines, byte for byte (after its header line)
    body = zlib.decompress(raw[0]["Data"]).split(b"\n", 1)[1]
    [key] = objects
    assert account.s3.get_object(Bucket=BUCKET, Key=key)["Body"].read() == body


def test_a_batch_writes_one_object_per_hour_its_events_fall_in(account: Account) -> None:
    # Given two invocations' events an hour apart, and a third in the first hour
    for session, at in (("a", T0), ("b", T0 + HOUR), ("c", T0 + 1)):
        recorder = account.recorder(at)
        record_get(recorder, session, at)
        recorder.flush(f"get/{session}/1")
    # When the archiver takes them as one batch
    raw = account.records()
    archiver(account).handle(account.batch(raw))
    # Then two objects, one per hour, each with its invocations' lines in log order
    objects = account.objects()
    assert sorted(objects) == [
        f"events/date=2023-11-14/hour=22/{name(raw)}.jsonl",
        f"events/date=2023-11-14/hour=23/{name(raw)}.jsonl",
    ]
    first, second = (objects[k] for k in sorted(objects))
    assert [e["consumer"] for e in first] == ["a"] * 3 + ["c"] * 3
    assert [e["consumer"] for e in second] == ["b"] * 3


def test_a_retried_invocation_leaves_one_copy_of_its_batch(account: Account) -> None:
    # Given a batch recorded and flushed, then the same batch again (a retry, later)
    first = account.recorder(T0 + 500)
    record_get(first)
    first.flush("router/shoal-default-0/shard-0/1-9")
    retry = account.recorder(T0 + 60_000)
    record_get(retry)
    retry.flush("router/shoal-default-0/shard-0/1-9")
    # When the archiver takes both in one batch
    raw = account.records()
    archiver(account).handle(account.batch(raw))
    # Then the lines are there once, the retry's (as an overwritten object held before)
    [lines] = account.objects().values()
    assert [(e["seq"], e["at"]) for e in lines] == [(n, T0 + 60_000) for n in range(3)]


def test_a_retried_archiver_batch_overwrites_and_a_recut_one_repeats_lines_exactly(
    account: Account,
) -> None:
    # Given two invocations' records in the log
    for session in ("a", "b"):
        recorder = account.recorder(T0)
        record_get(recorder, session)
        recorder.flush(f"get/{session}/1")
    raw = account.records()
    # When the same batch is archived twice (a retry), then cut in halves (a bisect)
    archiver(account).handle(account.batch(raw))
    once = account.objects()
    archiver(account).handle(account.batch(raw))
    assert account.objects() == once
    archiver(account).handle(account.batch(raw[:1]))
    # Then the retry changed nothing, and the half wrote lines held already, under a name of
    # its own, identical to the line for line (same ``batch`` and ``seq``): the lines the
    # audit drops as recorded twice (tests/pipeline/test_audit.py)
    objects = account.objects()
    assert len(objects) == 2
    half = objects[f"events/date=2023-11-14/hour=22/{name(raw[:1])}.jsonl"]
    [whole] = once.values()
    assert half == whole[:3]


class CrashingS3:
    """The S3 client, until the archiver's ``crash_at``-th object write: that one raises (the
    function dies there; the writes before it are done)."""

    def __init__(self, s3: Any, crash_at: int) -> None:
        self.s3 = s3
        self.crash_at = crash_at
        self.puts = 0

    def put_object(self, **kwargs: Any) -> Any:
        self.puts += 1
        if self.puts == self.crash_at:
            raise ConnectionError("the archiver died here")
        return self.s3.put_object(**kwargs)


def test_a_crash_between_two_object_writes_then_the_retry_leaves_each_event_once(
    account: Account,
) -> None:
    # Given a batch whose events fall in two hours (two objects)
    for session, at in (("a", T0), ("b", T0 + HOUR)):
        recorder = account.recorder(at)
        record_get(recorder, session, at)
        recorder.flush(f"get/{session}/1")
    raw = account.records()
    # When the archiver dies after its first object write, and the mapping retries the batch
    with pytest.raises(ConnectionError):
        archiver(account, CrashingS3(account.s3, crash_at=2)).handle(account.batch(raw))
    assert len(account.objects()) == 1
    archiver(account).handle(account.batch(raw))
    # Then every event is in S3 once per key: two objects, each line once
    objects = account.objects()
    assert len(objects) == 2
    seen = Counter((e["consumer"], e["seq"]) for lines in objects.values() for e in lines)
    assert seen == {(c, n): 1 for c in ("a", "b") for n in range(3)}


def test_a_record_no_recorder_wrote_is_quarantined_not_failed(account: Account) -> None:
    # Given a foreign record between two recorded batches
    recorder = account.recorder(T0)
    record_get(recorder)
    recorder.flush("get/sess-1/1")
    account.kinesis.put_record(StreamName=STREAM, Data=b"not zlib", PartitionKey="x")
    # When the archiver takes the batch
    raw = account.records()
    assert archiver(account).handle(account.batch(raw)) == {"batchItemFailures": []}
    # Then the events are archived and the foreign record is kept aside, with its place
    objects = account.objects()
    [quarantined] = [lines for key, lines in objects.items() if key.startswith("quarantine/")]
    assert quarantined[0]["sequence_number"] == raw[1]["SequenceNumber"]
    assert sum(len(v) for k, v in objects.items() if k.startswith("events/")) == 3


def test_events_beyond_a_record_are_several_records_in_order(
    account: Account, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given records smaller than two lines (Kinesis' 1 MB, scaled down)
    monkeypatch.setattr(events_module, "MAX_RECORD_LINES_BYTES", 300)
    recorder = account.recorder(T0)
    record_get(recorder)
    # When flushed
    recorder.flush("get/sess-1/1")
    raw = account.records()
    archiver(account).handle(account.batch(raw))
    # Then one line a record, and the archive holds them in order, numbered as one batch
    assert len(raw) == 3
    [lines] = account.objects().values()
    assert [e["seq"] for e in lines] == [0, 1, 2]


def test_flush_clears_the_buffer_and_an_empty_flush_writes_nothing(account: Account) -> None:
    recorder = account.recorder(T0)
    record_get(recorder)
    recorder.flush("a")
    # When flushed again with nothing new
    assert recorder.flush("b") == 0
    # Then only the first record exists
    assert len(account.records()) == 1


def test_without_an_event_log_the_recorder_does_nothing() -> None:
    # Given no event log configured (and no Kinesis client at all)
    recorder = Recording(None, ManualClock(T0)).new()
    # When events are recorded and flushed
    record_get(recorder)
    # Then nothing is buffered or written
    assert len(recorder) == 0
    assert recorder.flush("x") == 0


@pytest.mark.parametrize(
    ("event", "kind", "ids"),
    [
        ("opened", "session", {"message_id": "m"}),
        ("acked", "mailbox", {"message_id": "m"}),
        ("acked", "session", {}),
    ],
)
def test_a_malformed_event_is_refused(event: str, kind: str, ids: dict[str, str]) -> None:
    recorder = DeliveryEvents(None, ManualClock(T0))
    with pytest.raises(ValueError):
        # deliberately outside the types: what a caller could still pass at run time
        recorder.add(event, kind, "c", **ids)  # type: ignore[arg-type]


def test_a_retained_answer_is_recorded_as_retained(account: Account) -> None:
    # Given a get that answers a published message (retain 0) and a retained one sent because
    # of a new subscription (retain 1, MQTT 5 §3.3.1.3)
    recorder = account.recorder(T0 + 500)
    answers = [
        {"id": "s.1", "message_id": "m1", "retain": False, "dup": False},
        {"id": "s.2", "message_id": "m0", "retain": True, "dup": False},
    ]
    record_answers(recorder, "session", "s", answers)
    recorder.flush("get/s/1")
    archiver(account).handle(account.batch(account.records()))
    [body] = account.objects().values()
    lines = {e["message_id"]: e for e in body}
    # Then only the retained delivery carries the flag the audit reads
    assert lines["m0"]["retain"] is True
    assert "retain" not in lines["m1"]


def test_the_sample_event_archives_a_get_and_its_ack(account: Account) -> None:
    # Given the archiver's sample batch: a get's record and its ack's (events/)
    event = load_event("archiver_kinesis_batch.json")
    # When archived
    assert archiver(account).handle(event) == {"batchItemFailures": []}
    # Then one object of the publish hour, named after the batch, holds both in log order
    [(key, lines)] = account.objects().items()
    assert key == "events/date=2026-11-21/hour=05/events.shoal.shardId-000000000000.11-12.jsonl"
    assert [(e["event"], e["delivery_id"], e["seq"]) for e in lines] == [
        ("delivered", "s-7f3a.1", 0),
        ("delivered", "s-7f3a.2", 1),
        ("acked", "s-7f3a.1", 0),
        ("acked", "s-7f3a.2", 1),
    ]
    assert lines[0]["batch"] == hint_digest("get/s-7f3a/4")
    assert lines[2]["batch"] == hint_digest("ack/s-7f3a/5/1")
