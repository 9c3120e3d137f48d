"""Composite topics and exactly-once publishing, end to end over a real `shoal dev`."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import boto3
import pytest
from shoal.composite.model import route, stable_hash
from shoal.records import Message, decode_record

from tests.e2e.conftest import DevServer

pytestmark = pytest.mark.e2e


def stream_messages(aws: boto3.Session, stream: str) -> list[tuple[int, Message]]:
    """(partition, message) for every message in the stream; partitions in hash-key order."""
    kinesis = aws.client("kinesis")
    shards = sorted(
        kinesis.list_shards(StreamName=stream)["Shards"],
        key=lambda s: int(s["HashKeyRange"]["StartingHashKey"]),
    )
    out: list[tuple[int, Message]] = []
    for partition, shard in enumerate(shards):
        iterator = kinesis.get_shard_iterator(
            StreamName=stream, ShardId=shard["ShardId"], ShardIteratorType="TRIM_HORIZON"
        )["ShardIterator"]
        while True:
            response = kinesis.get_records(ShardIterator=iterator, Limit=10_000)
            for record in response["Records"]:
                out += [(partition, m) for m in decode_record(record["Data"])]
            if not response["Records"]:
                break
            iterator = response["NextShardIterator"]
    return out


def archived_ids(aws: boto3.Session) -> set[str]:
    s3 = aws.client("s3")
    ids: set[str] = set()
    for bucket in (b["Name"] for b in s3.list_buckets()["Buckets"] if "archive" in b["Name"]):
        for item in s3.list_objects_v2(Bucket=bucket, Prefix="messages/").get("Contents", []):
            body = s3.get_object(Bucket=bucket, Key=item["Key"])["Body"].read()
            ids |= {json.loads(line)["message_id"] for line in body.splitlines()}
    return ids


def test_topics_and_exactly_once_publishing(dev: DevServer) -> None:
    admin = dev.token("ops", admin=True)
    alice = dev.token("alice", publish=["orders/#"])
    aws = dev.aws()

    def publish(body: dict[str, Any], token: str = alice) -> tuple[int, Any]:
        return dev.request("POST", "/v1/messages", token=token, json=body)

    # Given a topic of 4 partitions, made by an admin
    status, topic = dev.request(
        "POST", "/v1/topics", token=admin, json={"name": "orders", "partitions": 4}
    )
    assert status == 201
    assert topic["storage_topics"] == [
        {"index": 0, "stream": "shoal-orders-0", "partitions": 4, "k": 1}
    ]
    assert (
        dev.request("POST", "/v1/topics", token=alice, json={"name": "x", "partitions": 1})[0]
        == 403
    )

    # A single publish lands in the partition the router formula names
    status, single = publish({"topic": "orders/eu/1", "text": "first"})
    assert status == 201
    assert single["partition"] == route(stable_hash("orders/eu/1"), 4, 1)

    # A batch: one answer per message, in order
    status, batch = dev.request(
        "POST",
        "/v1/messages:batch",
        token=alice,
        json={
            "messages": [
                {"topic": "orders/eu/2", "text": "b1", "ordering_key": "cust-1"},
                {"topic": "orders/+", "text": "refused"},
                {"topic": "orders/us/9", "text": "b2", "ordering_key": "cust-2"},
            ]
        },
    )
    assert status == 200
    results = batch["results"]
    assert results[1]["error"]["code"] == "invalid_topic"
    assert results[0]["partition"] == route(stable_hash("cust-1"), 4, 1)
    assert results[2]["partition"] == route(stable_hash("cust-2"), 4, 1)

    # Exactly once: a repeat is a duplicate with the original id; a gap is refused
    seq1 = {"topic": "orders/eu/1", "text": "s1", "publisher_id": "checkout", "publisher_seq": 1}
    status, created = publish(seq1)
    assert (status, created["duplicate"]) == (201, False)
    status, again = publish(seq1)
    assert (status, again["duplicate"], again["message_id"]) == (200, True, created["message_id"])
    status, gap = publish({**seq1, "publisher_seq": 3})
    assert (status, gap["error"]["code"], gap["error"]["expected"]) == (409, "publisher_seq_gap", 2)

    # Racing retries of one publish: one record, one id
    seq2 = {**seq1, "text": "s2", "publisher_seq": 2}
    answers: list[tuple[int, Any]] = []

    def racer() -> None:
        answers.append(publish(seq2))

    threads = [threading.Thread(target=racer) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ok = [body for status, body in answers if status in (200, 201)]
    assert [status for status, _ in answers].count(201) == 1
    assert all(status in (200, 201, 503) for status, _ in answers)
    assert len({body["message_id"] for body in ok}) == 1

    # Every message so far is in the first storage topic, where the router formula put it
    first = stream_messages(aws, "shoal-orders-0")
    by_id = {m.message_id: (p, m) for p, m in first}
    assert len(first) == len(by_id) == 5  # first, b1, b2, s1, s2: nothing twice
    assert by_id[single["message_id"]][0] == single["partition"]
    assert by_id[results[0]["message_id"]][0] == results[0]["partition"]
    assert by_id[ok[0]["message_id"]][1].payload == b"s2"

    # Grow the topic (8 partitions: K = 2) and switch produce
    status, grown = dev.request(
        "POST", "/v1/topics/orders/storage-topics", token=admin, json={"partitions": 8}
    )
    assert status == 201
    assert grown["storage_topics"][1] == {
        "index": 1,
        "stream": "shoal-orders-1",
        "partitions": 8,
        "k": 2,
    }
    status, switched = dev.request("POST", "/v1/topics/orders/switch-produce", token=admin)
    assert (status, switched["produce_pointer"]) == (200, 1)
    status, body = dev.request("POST", "/v1/topics/orders/switch-produce", token=admin)
    assert (status, body["error"]["code"]) == (409, "no_next_storage_topic")

    # After the switch, publishes go to the new storage topic, in the block of the old shard
    status, after = publish({"topic": "orders/eu/1", "text": "after", "ordering_key": "cust-1"})
    h = stable_hash("cust-1")
    assert (status, after["storage_topic"]) == (201, 1)
    assert after["partition"] == route(h, 8, 2)
    assert after["partition"] // 2 == results[0]["partition"]
    ((partition, message),) = stream_messages(aws, "shoal-orders-1")
    assert (partition, message.payload) == (after["partition"], b"after")

    # And the router, mapped onto both streams at run time, archives what it consumed
    wanted = {single["message_id"], after["message_id"]}
    deadline = time.monotonic() + 60
    while not wanted <= archived_ids(aws) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert wanted <= archived_ids(aws)
