"""The delivery-event recorder: one object per invocation under a deterministic key."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from moto import mock_aws
from shoal.core.clock import ManualClock
from shoal.delivery.events import DeliveryEvents, hint_digest, record_answers

BUCKET = "archive"
T0 = 1_700_000_000_000  # 2023-11-14T22:13:20Z


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    with mock_aws():
        client = boto3.client("s3", region_name="us-east-1")
        client.create_bucket(Bucket=BUCKET)
        yield client


def keys(s3: Any) -> list[str]:
    return [o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET).get("Contents", [])]


def record_get(recorder: DeliveryEvents) -> None:
    for n in range(3):
        recorder.add(
            "delivered",
            "session",
            "sess-1",
            message_id=f"m{n}",
            delivery_id=f"sess-1.{n}",
            published_at=T0 + n,
            qos=1,
            label="client-1",
        )


def test_one_object_per_flush_with_every_event_in_order(s3: Any) -> None:
    # Given three deliveries recorded in one invocation
    recorder = DeliveryEvents(BUCKET, ManualClock(T0 + 500), s3)
    record_get(recorder)
    # When flushed
    key = recorder.flush("get/sess-1/7")
    # Then one object holds the three lines, numbered, under the earliest publish hour
    assert keys(s3) == [key]
    assert key == f"events/date=2023-11-14/hour=22/{hint_digest('get/sess-1/7')}.jsonl"
    body = s3.get_object(Bucket=BUCKET, Key=key)["Body"].read().decode()
    lines = [json.loads(line) for line in body.splitlines()]
    assert [(e["event"], e["message_id"], e["seq"]) for e in lines] == [
        ("delivered", "m0", 0),
        ("delivered", "m1", 1),
        ("delivered", "m2", 2),
    ]
    assert lines[0]["at"] == T0 + 500
    assert lines[0]["batch"] == hint_digest("get/sess-1/7")
    assert "reason" not in lines[0]  # absent fields are left out


def test_a_retried_invocation_overwrites_its_object(s3: Any) -> None:
    # Given a batch recorded and flushed, then the same batch again (a retry, later)
    first = DeliveryEvents(BUCKET, ManualClock(T0 + 500), s3)
    record_get(first)
    key = first.flush("router/shoal-default-0/shard-0/1-9")
    retry = DeliveryEvents(BUCKET, ManualClock(T0 + 60_000), s3)
    record_get(retry)
    # When flushed with the same hint
    again = retry.flush("router/shoal-default-0/shard-0/1-9")
    # Then it wrote the same key: still one object
    assert again == key
    assert keys(s3) == [key]


def test_flush_clears_the_buffer_and_an_empty_flush_writes_nothing(s3: Any) -> None:
    recorder = DeliveryEvents(BUCKET, ManualClock(T0), s3)
    record_get(recorder)
    recorder.flush("a")
    # When flushed again with nothing new
    assert recorder.flush("b") is None
    # Then only the first object exists
    assert len(keys(s3)) == 1


def test_without_a_bucket_the_recorder_does_nothing() -> None:
    # Given no archive bucket configured (and no S3 client at all)
    recorder = DeliveryEvents(None, ManualClock(T0))
    # When events are recorded and flushed
    record_get(recorder)
    # Then nothing is buffered or written
    assert len(recorder) == 0
    assert recorder.flush("x") is None


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


def test_a_retained_answer_is_recorded_as_retained(s3: Any) -> None:
    # Given a get that answers a published message (retain 0) and a retained one sent because
    # of a new subscription (retain 1, MQTT 5 §3.3.1.3)
    recorder = DeliveryEvents(BUCKET, ManualClock(T0 + 500), s3)
    answers = [
        {"id": "s.1", "message_id": "m1", "retain": False, "dup": False},
        {"id": "s.2", "message_id": "m0", "retain": True, "dup": False},
    ]
    record_answers(recorder, "session", "s", answers)
    key = recorder.flush("get/s/1")
    assert key is not None
    body = s3.get_object(Bucket=BUCKET, Key=key)["Body"].read().decode()
    lines = {e["message_id"]: e for e in map(json.loads, body.splitlines())}
    # Then only the retained delivery carries the flag the audit reads
    assert lines["m0"]["retain"] is True
    assert "retain" not in lines["m1"]
