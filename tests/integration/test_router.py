"""The router over moto: each consumed batch archived as partitioned JSON lines in S3."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from shoal.core.config import get_config
from shoal.local.esm.invocation import event_of

from functions.router.app import handler
from tests.helpers import FakeContext, load_event
from tests.integration.test_publish_harness import Harness, admin_call, publish_call


@pytest.fixture
def harness(aws: boto3.Session, monkeypatch: pytest.MonkeyPatch) -> Iterator[Harness]:
    h = Harness(aws)
    h.install(monkeypatch)
    admin_call("POST", "/v1/topics", {"name": "orders", "partitions": 2})
    yield h


def archive(aws: boto3.Session) -> dict[str, list[dict[str, Any]]]:
    s3 = aws.client("s3")
    bucket = get_config().buckets["archive"]
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])]
    return {
        key: [
            json.loads(line) for line in s3.get_object(Bucket=bucket, Key=key)["Body"].iter_lines()
        ]
        for key in keys
    }


def kinesis_event(harness: Harness, stream: str) -> dict[str, Any]:
    """The event Lambda would send for every record of the stream's first non-empty shard."""
    records = harness.records(stream)
    partition = records[0][0]
    shard = harness.shards(stream)[partition]["ShardId"]
    return event_of([r for p, r in records if p == partition], stream=stream, shard_id=shard)


def test_a_consumed_batch_is_archived_by_topic_date_and_hour(
    harness: Harness, aws: boto3.Session
) -> None:
    # Given three messages published to one ordering key of `orders`
    ids = [
        publish_call({"topic": "orders/eu/1", "text": f"m{n}", "ordering_key": "k"})[1][
            "message_id"
        ]
        for n in range(3)
    ]
    # When the router consumes the shard's batch
    response = handler(kinesis_event(harness, "shoal-orders-0"), FakeContext())
    # Then nothing failed, and one object holds the three lines, in order
    assert response == {"batchItemFailures": []}
    ((key, lines),) = archive(aws).items()
    assert key.startswith("messages/topic=orders/date=")
    assert "/hour=" in key and key.endswith(".jsonl")
    assert [line["message_id"] for line in lines] == ids
    assert [base64.b64decode(line["payload"]) for line in lines] == [b"m0", b"m1", b"m2"]
    assert {(line["composite_topic"], line["storage_topic"]) for line in lines} == {("orders", 0)}
    assert lines[0]["topic"] == "orders/eu/1" and lines[0]["publisher"] == "alice"
    assert [(line["ordering_key"], line["keyed"]) for line in lines] == [("k", True)] * 3


def test_an_unkeyed_message_is_archived_as_unkeyed(harness: Harness, aws: boto3.Session) -> None:
    # Given a message published without an ordering key
    publish_call({"topic": "orders/eu/1", "text": "m"})
    # When the router archives it
    handler(kinesis_event(harness, "shoal-orders-0"), FakeContext())
    # Then its line says so (the audit judges a shared group's order per explicit key only),
    # and its key is its topic, the order a session keeps
    ((_, (line,)),) = archive(aws).items()
    assert (line["ordering_key"], line["keyed"]) == ("orders/eu/1", False)


def test_a_retried_batch_overwrites_its_own_objects(harness: Harness, aws: boto3.Session) -> None:
    publish_call({"topic": "orders/eu/1", "text": "m"})
    event = kinesis_event(harness, "shoal-orders-0")
    handler(event, FakeContext())
    first = archive(aws)
    # When Lambda hands the same batch again, Then the archive is the same
    handler(event, FakeContext())
    assert archive(aws) == first


def test_foreign_records_are_quarantined_not_failed(harness: Harness, aws: boto3.Session) -> None:
    # Given the sample batch: a Shoal record of two messages and a record that is not Shoal's
    response = handler(load_event("router_kinesis_batch.json"), FakeContext())
    # Then nothing failed (a poison record must not block its shard)
    assert response == {"batchItemFailures": []}
    objects = archive(aws)
    messages = [
        line for key, lines in objects.items() if key.startswith("messages/") for line in lines
    ]
    quarantined = [
        line for key, lines in objects.items() if key.startswith("quarantine/") for line in lines
    ]
    assert [m["topic"] for m in messages] == ["orders/eu/1", "orders/us/2"]
    assert base64.b64decode(messages[1]["payload"]) == b"\x00\x01binary"
    assert [(q["sequence_number"], base64.b64decode(q["data"])) for q in quarantined] == [
        ("8", b"not a shoal record")
    ]


def test_only_records_before_a_failure_are_archived(harness: Harness, aws: boto3.Session) -> None:
    # Given a batch of three records whose second cannot even be parsed
    for n in range(3):
        publish_call({"topic": "orders/eu/1", "text": f"m{n}", "ordering_key": "k"})
    event = kinesis_event(harness, "shoal-orders-0")
    event["Records"][1]["kinesis"]["data"] = "%%% not base64"
    # When the router runs
    response = handler(event, FakeContext())
    # Then it reports the second record, and archived only the first (Lambda resends 2 and 3)
    failed = event["Records"][1]["kinesis"]["sequenceNumber"]
    assert response == {"batchItemFailures": [{"itemIdentifier": failed}]}
    lines = [line for lines in archive(aws).values() for line in lines]
    assert [base64.b64decode(line["payload"]) for line in lines] == [b"m0"]


def test_an_archive_failure_fails_the_invocation(harness: Harness, aws: boto3.Session) -> None:
    publish_call({"topic": "orders/eu/1", "text": "m"})
    event = kinesis_event(harness, "shoal-orders-0")
    aws.client("s3").delete_bucket(Bucket=get_config().buckets["archive"])
    # Then the error propagates, so that Lambda retries the whole batch
    with pytest.raises(Exception, match="NoSuchBucket"):
        handler(event, FakeContext())
