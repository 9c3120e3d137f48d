"""POST /v1/messages and /v1/messages:batch over moto: routing, limits, retained, PutRecords."""

from __future__ import annotations

import base64
from collections.abc import Iterator, Sequence
from typing import Any

import boto3
import pytest
from shoal.aws.kinesis import OutRecord, PutOutcome
from shoal.composite.model import ROUTED_PUT_BOUND_MS, route, stable_hash
from shoal.publish.writer import PUT_DEADLINE_MS
from shoal.records import decode_record, record_partition_key

from tests.helpers import load_event
from tests.integration.test_publish_harness import ALICE, Harness, admin_call, call, publish_call


@pytest.fixture
def harness(aws: boto3.Session, monkeypatch: pytest.MonkeyPatch) -> Iterator[Harness]:
    # Given the default topic (1 partition) and `orders` (4 partitions)
    h = Harness(aws)
    h.install(monkeypatch)
    h.default(partitions=1)
    admin_call("POST", "/v1/topics", {"name": "orders", "partitions": 4})
    yield h


def test_a_publish_lands_in_the_partition_the_router_formula_names(harness: Harness) -> None:
    # When alice publishes text to orders/eu/1
    status, body = publish_call({"topic": "orders/eu/1", "text": "hello", "qos": 2})
    # Then it is routed by the hash of the topic (the default ordering key)
    expected = route(stable_hash("orders/eu/1"), 4, 1)
    assert status == 201
    assert body == {
        "message_id": body["message_id"],
        "topic": "orders/eu/1",
        "storage_topic": 0,
        "partition": expected,
        "duplicate": False,
    }
    # And the stream holds it in that shard (ExplicitHashKey = the shard's starting key)
    ((partition, message),) = harness.messages("shoal-orders-0")
    assert partition == expected
    assert (message.message_id, message.payload, message.qos) == (body["message_id"], b"hello", 2)
    assert (message.sub, message.retain, message.ordering_key) == ("alice", False, "orders/eu/1")


def test_ordering_key_and_properties_travel_with_the_message(harness: Harness) -> None:
    payload = bytes(range(256))
    status, body = publish_call(
        {
            "topic": "orders/eu/1",
            "payload": base64.b64encode(payload).decode(),
            "ordering_key": "customer-7",
            "properties": {
                "content_type": "application/octet-stream",
                "user_properties": {"trace": "abc"},
                "message_expiry_s": 60,
            },
        }
    )
    assert status == 201
    assert body["partition"] == route(stable_hash("customer-7"), 4, 1)
    ((_, message),) = harness.messages("shoal-orders-0")
    assert message.payload == payload
    assert message.ordering_key == "customer-7"
    assert message.properties == {
        "content_type": "application/octet-stream",
        "user_properties": {"trace": "abc"},
        "message_expiry_s": 60,
    }


def test_a_topic_without_its_own_composite_goes_to_default(harness: Harness) -> None:
    status, body = publish_call({"topic": "other/x", "text": "hi"})
    assert (status, body["storage_topic"], body["partition"]) == (201, 0, 0)
    assert [m.topic for _, m in harness.messages("shoal-default-0")] == ["other/x"]
    assert harness.messages("shoal-orders-0") == []


def test_without_default_an_unknown_first_level_is_not_found(
    aws: boto3.Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given no default topic at all
    h = Harness(aws)
    h.install(monkeypatch)
    before = h.snapshot()
    status, body = publish_call({"topic": "other/x", "text": "hi"})
    assert (status, body["error"]["code"]) == (404, "topic_not_found")
    assert h.snapshot() == before


def test_a_new_topic_takes_its_names_over_from_default(harness: Harness) -> None:
    # Given a warm publisher sending sensors/1/temp to default
    assert publish_call({"topic": "sensors/1/temp", "text": "a"})[0] == 201
    # When an admin creates `sensors`
    admin_call("POST", "/v1/topics", {"name": "sensors", "partitions": 2})
    # Then once the create has returned, the same publisher routes there
    publish_call({"topic": "sensors/1/temp", "text": "b"})
    assert [m.payload for _, m in harness.messages("shoal-sensors-0")] == [b"b"]
    assert [m.payload for _, m in harness.messages("shoal-default-0")] == [b"a"]


def test_switch_produce_reaches_a_warm_publisher(harness: Harness) -> None:
    # Given a publisher that has cached `orders`
    publish_call({"topic": "orders/1", "text": "old"})
    admin_call("POST", "/v1/topics/orders/storage-topics", {"partitions": 8})
    # When produce switches (the call returns once the switch is in effect)
    admin_call("POST", "/v1/topics/orders/switch-produce")
    status, body = publish_call({"topic": "orders/1", "text": "new"})
    # Then the next publish goes to the new storage topic, in the partition of K = 2
    assert (status, body["storage_topic"]) == (201, 1)
    assert body["partition"] == route(stable_hash("orders/1"), 8, 2)
    assert [m.payload for _, m in harness.messages("shoal-orders-1")] == [b"new"]


def test_a_switch_is_not_seen_before_its_instant(harness: Harness) -> None:
    # Given a cached topic and a switch written but not yet in effect
    publish_call({"topic": "orders/1", "text": "a"})
    admin_call("POST", "/v1/topics/orders/storage-topics", {"partitions": 8})
    harness.topics.effective_delay_ms = 10_000
    harness.topics.clock = type(harness.clock)(harness.clock.now_ms())  # the admin's own clock
    harness.topics.switch_produce("orders")
    # When a publisher with a fresh cache publishes before the instant
    harness.clock.advance(2)
    status, body = publish_call({"topic": "orders/1", "text": "b"})
    # Then it still writes to the old storage topic, like every stale cache does
    assert (status, body["storage_topic"]) == (201, 0)
    harness.clock.advance(10)
    assert publish_call({"topic": "orders/1", "text": "c"})[1]["storage_topic"] == 1


def test_retained_messages_are_set_replaced_and_cleared(harness: Harness) -> None:
    retained = harness.retained()
    publish_call({"topic": "orders/state", "text": "v1", "retain": True})
    assert getattr(retained.get("orders/state"), "payload", None) == b"v1"
    harness.clock.advance(1)
    _, body = publish_call({"topic": "orders/state", "text": "v2", "retain": True, "qos": 0})
    stored = retained.get("orders/state")
    assert stored is not None
    assert (stored.payload, stored.message_id, stored.qos) == (b"v2", body["message_id"], 0)
    # an empty retained publish clears it, and is still published
    harness.clock.advance(1)
    assert publish_call({"topic": "orders/state", "retain": True})[0] == 201
    assert retained.get("orders/state") is None
    assert len(harness.messages("shoal-orders-0")) == 3


def test_an_older_retained_publish_never_overwrites_a_newer_one(harness: Harness) -> None:
    publish_call({"topic": "orders/state", "text": "new", "retain": True})
    harness.clock.advance(-5)
    publish_call({"topic": "orders/state", "text": "late", "retain": True})
    assert getattr(harness.retained().get("orders/state"), "payload", None) == b"new"


def test_the_payload_limit_is_kinesis_record_minus_the_envelope(harness: Harness) -> None:
    # Given a payload far too large: the answer names the largest payload that fits
    status, body = publish_call({"topic": "orders/1", "text": "x" * 1_100_000})
    assert (status, body["error"]["code"]) == (413, "payload_too_large")
    limit = body["error"]["limit"]
    assert 1_000_000 < limit < 1024 * 1024
    # When the payload is exactly that limit, it is published; one byte more is refused
    assert publish_call({"topic": "orders/1", "text": "x" * limit})[0] == 201
    assert publish_call({"topic": "orders/1", "text": "x" * (limit + 1)})[0] == 413
    ((_, record),) = harness.records("shoal-orders-0")
    assert len(record["Data"]) + len(record["PartitionKey"]) == 1024 * 1024


LONG_TOPIC = "a/" + "b" * 65_533
BAD_MESSAGES: list[tuple[dict[str, Any], dict[str, Any], int, str]] = [
    ({"topic": "orders/+"}, ALICE, 400, "invalid_topic"),
    ({"topic": "orders/#"}, ALICE, 400, "invalid_topic"),
    ({"topic": ""}, ALICE, 400, "invalid_topic"),
    ({"topic": "orders/\x00"}, ALICE, 400, "invalid_topic"),
    ({"topic": "$SYS/x"}, ALICE, 400, "invalid_topic"),
    ({"topic": LONG_TOPIC + "b"}, ALICE, 400, "invalid_topic"),
    ({"topic": "secret/x"}, {"sub": "bob", "shoal:publish": "[orders/#]"}, 403, "forbidden"),
    ({"topic": "orders/x"}, {"sub": "bob"}, 403, "forbidden"),
    ({"topic": "orders/x", "payload": "not base64!"}, ALICE, 400, "invalid_payload"),
    ({"topic": "orders/x", "payload": "aGk=", "text": "hi"}, ALICE, 400, "invalid_payload"),
    ({"topic": "orders/x", "qos": 3}, ALICE, 400, "invalid_request"),
    ({"topic": "orders/x", "retain": 1}, ALICE, 400, "invalid_request"),
    ({"topic": "orders/x", "publisher_id": "p"}, ALICE, 400, "invalid_request"),
    ({"topic": "orders/x", "publisher_id": "p", "publisher_seq": 0}, ALICE, 400, "invalid_request"),
    (
        {"topic": "orders/x", "publisher_id": "p", "publisher_seq": 2},
        ALICE,
        409,
        "publisher_seq_gap",
    ),
    ({"topic": "orders/x", "properties": {"x": 1}}, ALICE, 400, "invalid_request"),
    ({"topic": "orders/x", "unknown": 1}, ALICE, 400, "invalid_request"),
    ({"topic": "orders/x", "text": "x" * 400_000, "retain": True}, ALICE, 413, "payload_too_large"),
    ({"topic": "orders/x", "text": "x" * 2_000_000}, ALICE, 413, "payload_too_large"),
    ({"text": "no topic"}, ALICE, 400, "invalid_request"),
]


@pytest.mark.parametrize(("message", "claims", "status", "code"), BAD_MESSAGES)
def test_bad_publishes_are_coded_and_change_nothing(
    harness: Harness, message: dict[str, Any], claims: dict[str, Any], status: int, code: str
) -> None:
    before = harness.snapshot()
    got_status, body = publish_call(message, claims=claims)
    assert (got_status, body["error"]["code"]) == (status, code)
    assert harness.snapshot() == before


def test_a_gap_names_the_expected_seq(harness: Harness) -> None:
    publish_call({"topic": "orders/x", "publisher_id": "p", "publisher_seq": 1})
    status, body = publish_call({"topic": "orders/x", "publisher_id": "p", "publisher_seq": 3})
    assert (status, body["error"]["code"], body["error"]["expected"]) == (
        409,
        "publisher_seq_gap",
        2,
    )


@pytest.mark.parametrize(
    ("raw", "status", "code"),
    [("{nope", 400, "malformed_json"), ("[]", 400, "invalid_request")],
)
def test_malformed_bodies_are_coded(harness: Harness, raw: str, status: int, code: str) -> None:
    before = harness.snapshot()
    got_status, body = publish_call(None, raw_body=raw)
    assert (got_status, body["error"]["code"]) == (status, code)
    assert harness.snapshot() == before


def test_unauthenticated_publish_is_refused(harness: Harness) -> None:
    status, body = publish_call({"topic": "orders/x"}, claims=None)
    assert (status, body["error"]["code"]) == (401, "unauthorized")


def test_a_batch_answers_each_message_in_order_with_one_put(harness: Harness) -> None:
    calls = harness.count_calls()
    # When a batch mixes good messages, bad ones and two topics
    status, body = publish_call(
        {
            "messages": [
                {"topic": "orders/1", "text": "a"},
                {"topic": "orders/+", "text": "bad"},
                {"topic": "other/1", "text": "b"},
                "not an object",
                {"topic": "orders/1", "text": "c"},
                {"topic": "orders/2", "qos": 9},
            ]
        },
        batch=True,
    )
    # Then every message has its own answer, in order
    assert status == 200
    results = body["results"]
    assert [r.get("error", {}).get("code") for r in results] == [
        None,
        "invalid_topic",
        None,
        "invalid_request",
        None,
        "invalid_request",
    ]
    assert results[1]["error"]["status"] == 400
    assert [r["storage_topic"] for r in (results[0], results[2], results[4])] == [0, 0, 0]
    # And the messages of one partition went out in order, one PutRecords per stream
    assert [m.payload for _, m in harness.messages("shoal-orders-0")] == [b"a", b"c"]
    assert [m.payload for _, m in harness.messages("shoal-default-0")] == [b"b"]
    assert calls.get("kinesis.PutRecords") == 2
    assert "kinesis.PutRecord" not in calls


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"messages": []}, "invalid_request"),
        ({"messages": [{}] * 501}, "invalid_request"),
        ({"msgs": []}, "invalid_request"),
        ({"messages": {}}, "invalid_request"),
    ],
)
def test_bad_batches_are_refused_whole(harness: Harness, body: Any, code: str) -> None:
    before = harness.snapshot()
    status, answer = publish_call(body, batch=True)
    assert (status, answer["error"]["code"]) == (400, code)
    assert harness.snapshot() == before


def test_a_batch_of_500_splits_by_the_byte_limit_and_keeps_order(harness: Harness) -> None:
    # Given a topic of 12 partitions and 500 messages of 11 KB (5.5 MB, over one call's 5 MiB)
    admin_call("POST", "/v1/topics", {"name": "bulk", "partitions": 12})
    calls = harness.count_calls()
    messages = [
        {"topic": "bulk/1", "text": f"{n:05d}" + "x" * 11_000, "ordering_key": f"k{n % 12}"}
        for n in range(500)
    ]
    status, body = publish_call({"messages": messages}, batch=True)
    assert status == 200
    assert all("error" not in r for r in body["results"])
    # Then each ordering key's messages are in the stream in publish order, exactly once
    stored = harness.messages("shoal-bulk-0")
    assert len(stored) == 500
    for key in range(12):
        seen = [int(m.payload[:5]) for _, m in stored if m.ordering_key == f"k{key}"]
        assert seen == [n for n in range(500) if n % 12 == key]
    # And the puts respected Kinesis' limits (5 MiB a call, 1 MiB a record)
    assert calls["kinesis.PutRecords"] >= 2
    assert all(len(r["Data"]) <= 1024 * 1024 for _, r in harness.records("shoal-bulk-0"))


class FlakyPuts:
    """Wraps Streams.put_records: fails chosen records (not writing them) on chosen calls."""

    def __init__(self, harness: Harness, fail: dict[int, set[int]]) -> None:
        self.real = harness.streams.__class__.put_records.__get__(harness.streams)
        self.fail = fail
        self.calls: list[list[OutRecord]] = []

    def __call__(self, stream: str, records: Sequence[OutRecord]) -> list[PutOutcome]:
        self.calls.append(list(records))
        failing = self.fail.get(len(self.calls), set())
        kept = [r for n, r in enumerate(records) if n not in failing]
        written = iter(self.real(stream, kept))
        return [
            PutOutcome(error_code="ProvisionedThroughputExceededException")
            if n in failing
            else next(written)
            for n in range(len(records))
        ]


def test_only_failed_records_are_retried(harness: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given the first PutRecords call fails its second and fourth records
    flaky = FlakyPuts(harness, {1: {1, 3}})
    monkeypatch.setattr(harness.streams, "put_records", flaky)
    messages = [{"topic": "orders/1", "text": str(n), "ordering_key": f"k{n}"} for n in range(8)]
    # When a batch is published to several partitions
    status, body = publish_call({"messages": messages}, batch=True)
    # Then the retry carried exactly the two failed records, and every message is stored once
    assert status == 200 and all("error" not in r for r in body["results"])
    assert len(flaky.calls) == 2
    assert flaky.calls[1] == [flaky.calls[0][1], flaky.calls[0][3]]
    payloads = sorted(m.payload for _, m in harness.messages("shoal-orders-0"))
    assert payloads == sorted(str(n).encode() for n in range(8))


def test_a_partition_that_keeps_failing_fails_only_its_messages(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a stream that refuses one partition's record on every attempt
    target = route(stable_hash("k0"), 4, 1)

    def refuse(stream: str, records: Sequence[OutRecord]) -> list[PutOutcome]:
        start = harness.topics.get("orders").storage_topics[0].starting_key(target)
        doomed = {n for n, r in enumerate(records) if r.explicit_hash_key == start}
        return FlakyPuts(harness, {1: doomed})(stream, records)

    monkeypatch.setattr(harness.streams, "put_records", refuse)
    keys = ["k0", "k1", "k0", "k2"]
    messages = [
        {"topic": "orders/1", "text": str(n), "ordering_key": k} for n, k in enumerate(keys)
    ]
    _, body = publish_call({"messages": messages}, batch=True)
    # Then the two k0 messages answer 503 and nothing of k0 reached the stream
    codes = [r.get("error", {}).get("code") for r in body["results"]]
    assert codes == ["server_busy", None, "server_busy", None]
    stored = [m.ordering_key for _, m in harness.messages("shoal-orders-0")]
    assert sorted(stored) == ["k1", "k2"]


def test_aws_calls_of_a_warm_single_publish(harness: Harness) -> None:
    # Given a warm publisher (topic metadata cached)
    publish_call({"topic": "orders/1", "text": "warm"})
    calls = harness.count_calls()
    publish_call({"topic": "orders/1", "text": "a"})
    # Then a plain publish is one PutRecord and nothing else
    assert calls == {"kinesis.PutRecord": 1}
    calls.clear()
    publish_call({"topic": "orders/1", "text": "b", "publisher_id": "p", "publisher_seq": 1})
    # and an exactly-once publish adds the reservation and its confirmation
    assert calls == {"kinesis.PutRecord": 1, "dynamodb.PutItem": 1, "dynamodb.UpdateItem": 1}


def test_the_sample_events_publish(harness: Harness) -> None:
    from functions.publish.app import handler

    status, single = call(handler, load_event("publish_message.json"))
    assert (status, single["topic"]) == (201, "orders/eu/1")
    status, batch = call(handler, load_event("publish_batch.json"))
    codes = [r.get("error", {}).get("code") for r in batch["results"]]
    assert (status, codes) == (200, [None, None, "invalid_topic"])
    assert getattr(harness.retained().get("sensors/7/temp"), "payload", None) == b"\x00\x15"


def test_publish_answers_fit_the_openapi_document(harness: Harness) -> None:
    import jsonschema

    from tests.unit.test_openapi import schema

    _, single = publish_call(
        {"topic": "orders/1", "text": "a", "publisher_id": "p", "publisher_seq": 1}
    )
    jsonschema.validate(single, schema("PublishResult"))
    _, duplicate = publish_call({"topic": "orders/1", "publisher_id": "p", "publisher_seq": 1})
    jsonschema.validate(duplicate, schema("PublishResult"))
    _, batch = publish_call({"messages": [{"topic": "orders/1"}, {"topic": "#"}]}, batch=True)
    for result in batch["results"]:
        jsonschema.validate(result, schema("Error" if "error" in result else "PublishResult"))


def _same_partition_keys(count: int) -> list[str]:
    """Ordering keys the router sends to one partition of `orders` (4 partitions)."""
    target = route(stable_hash("k0"), 4, 1)
    keys = [f"k{n}" for n in range(200) if route(stable_hash(f"k{n}"), 4, 1) == target]
    return keys[:count]


def test_a_record_holds_one_ordering_key_and_is_keyed_by_it(harness: Harness) -> None:
    # Given two ordering keys routed to the same partition
    a, b = _same_partition_keys(2)
    messages = [
        {"topic": "orders/1", "text": str(n), "ordering_key": k}
        for n, k in enumerate([a, b, a, b, a])
    ]
    # When one batch publishes their messages interleaved
    status, body = publish_call({"messages": messages}, batch=True)
    assert status == 200 and all("error" not in r for r in body["results"])
    # Then each key's messages share one record whose partition key is the ordering key,
    # routed to the partition's shard by its starting hash key
    records = harness.records("shoal-orders-0")
    assert sorted(r["PartitionKey"] for _, r in records) == sorted([a, b])
    target = route(stable_hash(a), 4, 1)
    assert {p for p, _ in records} == {target}
    held = {r["PartitionKey"]: [m.payload for m in decode_record(r["Data"])] for _, r in records}
    assert held == {a: [b"0", b"2", b"4"], b: [b"1", b"3"]}


def test_an_ordering_key_too_long_for_kinesis_is_keyed_by_its_digest(harness: Harness) -> None:
    # When a message's ordering key is longer than Kinesis' 256-character partition key
    key = "k" * 300
    status, _ = publish_call({"topic": "orders/1", "text": "x", "ordering_key": key})
    # Then its record's partition key is the key's digest, the same for every record of it
    assert status == 201
    ((_, record),) = harness.records("shoal-orders-0")
    assert record["PartitionKey"] == record_partition_key(key)
    assert len(record["PartitionKey"]) == 32 and record["PartitionKey"] != key


def test_a_failing_key_does_not_fail_another_key_of_its_partition(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given two keys of one partition, and a stream that refuses every record of the first
    a, b = _same_partition_keys(2)

    def refuse(stream: str, records: Sequence[OutRecord]) -> list[PutOutcome]:
        doomed = {n for n, r in enumerate(records) if r.partition_key == a}
        return FlakyPuts(harness, {1: doomed})(stream, records)

    monkeypatch.setattr(harness.streams, "put_records", refuse)
    messages = [
        {"topic": "orders/1", "text": str(n), "ordering_key": k} for n, k in enumerate([a, b, a])
    ]
    # When a batch publishes both
    _, body = publish_call({"messages": messages}, batch=True)
    # Then only the first key's messages answer 503; the other key's message is stored
    codes = [r.get("error", {}).get("code") for r in body["results"]]
    assert codes == ["server_busy", None, "server_busy"]
    assert [m.ordering_key for _, m in harness.messages("shoal-orders-0")] == [b]


def test_no_put_starts_once_the_routing_bound_is_too_near(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a publisher that chose the storage topic and then stalled (a slow reservation, a
    # frozen container) until too little of ROUTED_PUT_BOUND_MS is left for one put call
    choose = harness.publish.directory.destinations

    def slow(topics: Sequence[str]) -> Any:
        chosen = choose(topics)
        harness.clock.advance((ROUTED_PUT_BOUND_MS - PUT_DEADLINE_MS) / 1000)
        return chosen

    monkeypatch.setattr(harness.publish.directory, "destinations", slow)
    # When a plain and a sequenced message are published
    plain, _ = publish_call({"topic": "orders/1", "text": "late"})
    sequenced, body = publish_call(
        {"topic": "orders/1", "text": "late", "publisher_id": "p", "publisher_seq": 1}
    )
    # Then both answer 503 (retry) and nothing reached the stream: a put into a storage topic
    # ends within the bound after its choice, which is what the sealer waits for after a switch
    assert (plain, sequenced, body["error"]["code"]) == (503, 503, "server_busy")
    assert harness.messages("shoal-orders-0") == []
    # And without the stall the same publish goes through
    monkeypatch.setattr(harness.publish.directory, "destinations", choose)
    assert publish_call({"topic": "orders/1", "text": "on time"})[0] == 201
