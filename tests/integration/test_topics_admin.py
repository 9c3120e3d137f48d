"""The topic routes over moto: create, get, list, add a storage topic, switch produce."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from shoal.aws.kinesis import HASH_SPACE, ROUTER_MAPPING, StreamInfo, even_starting_keys

from tests.helpers import load_event
from tests.integration.test_publish_harness import ALICE, Crash, Harness, admin_call, call


@pytest.fixture
def harness(aws: boto3.Session, monkeypatch: pytest.MonkeyPatch) -> Iterator[Harness]:
    h = Harness(aws)
    h.install(monkeypatch)
    yield h


def mappings(aws: boto3.Session, stream: str) -> list[Any]:
    arn = aws.client("kinesis").describe_stream_summary(StreamName=stream)[
        "StreamDescriptionSummary"
    ]["StreamARN"]
    return aws.client("lambda").list_event_source_mappings(EventSourceArn=arn)[
        "EventSourceMappings"
    ]


def test_create_makes_the_stream_and_the_router_mapping(
    harness: Harness, aws: boto3.Session
) -> None:
    # When an admin creates a topic of 4 partitions
    status, body = admin_call("POST", "/v1/topics", {"name": "orders", "partitions": 4})
    # Then the answer is the topic document
    assert status == 201
    assert body == {
        "name": "orders",
        "produce_pointer": 0,
        "storage_topics": [{"index": 0, "stream": "shoal-orders-0", "partitions": 4, "k": 1}],
    }
    # And the stream has 4 shards of equal hash ranges
    starts = [int(s["HashKeyRange"]["StartingHashKey"]) for s in harness.shards("shoal-orders-0")]
    assert starts == even_starting_keys(4)
    assert int(harness.shards("shoal-orders-0")[-1]["HashKeyRange"]["EndingHashKey"]) == (
        HASH_SPACE - 1
    )
    # And exactly one mapping feeds it to the router, configured never to drop a batch
    (mapping,) = mappings(aws, "shoal-orders-0")
    assert mapping["FunctionArn"].endswith(":function:shoal-router")
    for key, value in ROUTER_MAPPING.items():
        assert mapping[key] == value
    assert mapping["MaximumRetryAttempts"] == -1
    assert mapping["FunctionResponseTypes"] == ["ReportBatchItemFailures"]


def test_get_and_list_show_created_topics(harness: Harness) -> None:
    admin_call("POST", "/v1/topics", {"name": "b", "partitions": 2})
    admin_call("POST", "/v1/topics", {"name": "a", "partitions": 1})
    status, body = admin_call("GET", "/v1/topics")
    assert status == 200
    assert [t["name"] for t in body["topics"]] == ["a", "b"]
    assert admin_call("GET", "/v1/topics/b")[1]["storage_topics"][0]["partitions"] == 2


def test_adding_a_storage_topic_computes_k(harness: Harness) -> None:
    # Given a topic of 4 partitions
    admin_call("POST", "/v1/topics", {"name": "orders", "partitions": 4})
    # When storage topics of 8, then 16, then 6 partitions are added
    for partitions in (8, 16, 6):
        status, body = admin_call(
            "POST", "/v1/topics/orders/storage-topics", {"partitions": partitions}
        )
        assert status == 201
    # Then K follows the base partition count, and the produce pointer has not moved
    assert [(s["partitions"], s["k"]) for s in body["storage_topics"]] == [
        (4, 1),
        (8, 2),
        (16, 4),
        (6, 1),
    ]
    assert body["produce_pointer"] == 0
    assert [s["stream"] for s in body["storage_topics"]] == [f"shoal-orders-{i}" for i in range(4)]
    assert all(len(harness.shards(f"shoal-orders-{i}")) for i in range(4))


def test_switch_produce_moves_one_step_and_never_past_the_last(harness: Harness) -> None:
    admin_call("POST", "/v1/topics", {"name": "orders", "partitions": 4})
    admin_call("POST", "/v1/topics/orders/storage-topics", {"partitions": 8})
    status, body = admin_call("POST", "/v1/topics/orders/switch-produce")
    assert (status, body["produce_pointer"]) == (200, 1)
    status, body = admin_call("POST", "/v1/topics/orders/switch-produce")
    assert status == 409
    assert body["error"]["code"] == "no_next_storage_topic"
    assert harness.topic("orders").produce_pointer == 1


def test_a_switch_returns_only_once_it_is_in_effect(harness: Harness) -> None:
    # Given a grown topic
    admin_call("POST", "/v1/topics", {"name": "orders", "partitions": 4})
    admin_call("POST", "/v1/topics/orders/storage-topics", {"partitions": 8})
    # When produce is switched
    admin_call("POST", "/v1/topics/orders/switch-produce")
    # Then by the time the call returned, every publisher routes to the new storage topic
    topic = harness.topic("orders")
    producing = topic.producing(harness.clock.now_ms())
    assert producing is not None and producing.index == 1


def test_creating_an_existing_topic_is_a_conflict(harness: Harness) -> None:
    admin_call("POST", "/v1/topics", {"name": "orders", "partitions": 4})
    before = harness.snapshot()
    status, body = admin_call("POST", "/v1/topics", {"name": "orders", "partitions": 4})
    assert (status, body["error"]["code"]) == (409, "topic_exists")
    assert harness.snapshot() == before


BAD_REQUESTS = [
    ("POST", "/v1/topics", {"name": "a/b", "partitions": 4}, None, 400, "invalid_topic_name"),
    ("POST", "/v1/topics", {"name": "", "partitions": 4}, None, 400, "invalid_topic_name"),
    ("POST", "/v1/topics", {"name": "x" * 65, "partitions": 4}, None, 400, "invalid_topic_name"),
    ("POST", "/v1/topics", {"name": 7, "partitions": 4}, None, 400, "invalid_topic_name"),
    ("POST", "/v1/topics", {"partitions": 4}, None, 400, "invalid_topic_name"),
    ("POST", "/v1/topics", {"name": "new", "partitions": 5}, None, 400, "invalid_partitions"),
    ("POST", "/v1/topics", {"name": "new", "partitions": 0}, None, 400, "invalid_partitions"),
    ("POST", "/v1/topics", {"name": "new", "partitions": "4"}, None, 400, "invalid_partitions"),
    ("POST", "/v1/topics", {"name": "new", "partitions": 504}, None, 400, "invalid_partitions"),
    ("POST", "/v1/topics", {"name": "new"}, None, 400, "invalid_partitions"),
    ("POST", "/v1/topics", {"name": "new", "partitions": 4, "x": 1}, None, 400, "invalid_request"),
    ("POST", "/v1/topics", {"name": "new", "partitions": 4}, ALICE, 403, "forbidden"),
    ("POST", "/v1/topics", {"name": "new", "partitions": 4}, {}, 401, "unauthorized"),
    ("GET", "/v1/topics", None, ALICE, 403, "forbidden"),
    ("GET", "/v1/topics/nope", None, None, 404, "topic_not_found"),
    ("GET", "/v1/topics/no.pe", None, None, 404, "topic_not_found"),
    ("POST", "/v1/topics/nope/storage-topics", {"partitions": 4}, None, 404, "topic_not_found"),
    (
        "POST",
        "/v1/topics/orders/storage-topics",
        {"partitions": 7},
        None,
        400,
        "invalid_partitions",
    ),
    ("POST", "/v1/topics/orders/storage-topics", {}, None, 400, "invalid_partitions"),
    ("POST", "/v1/topics/orders/storage-topics", {"partitions": 8}, ALICE, 403, "forbidden"),
    ("POST", "/v1/topics/orders/switch-produce", None, None, 409, "no_next_storage_topic"),
    ("POST", "/v1/topics/orders/switch-produce", {"x": 1}, None, 400, "invalid_request"),
    ("POST", "/v1/topics/nope/switch-produce", None, None, 404, "topic_not_found"),
]


@pytest.mark.parametrize("case", BAD_REQUESTS)
def test_bad_topic_requests_are_coded_and_change_nothing(
    harness: Harness, case: tuple[str, str, Any, dict[str, Any] | None, int, str]
) -> None:
    method, path, body, claims, status, code = case
    # Given an existing topic and a snapshot of the whole account
    admin_call("POST", "/v1/topics", {"name": "orders", "partitions": 4})
    before = harness.snapshot()
    # When a bad request arrives
    kwargs: dict[str, Any] = {} if claims is None else {"claims": claims or None}
    got_status, got = admin_call(method, path, body, **kwargs)
    # Then it is answered with its code and nothing changed
    assert (got_status, got["error"]["code"]) == (status, code)
    assert harness.snapshot() == before


def test_malformed_json_is_coded(harness: Harness) -> None:
    before = harness.snapshot()
    status, body = admin_call("POST", "/v1/topics", raw_body="{nope")
    assert (status, body["error"]["code"]) == (400, "malformed_json")
    assert harness.snapshot() == before


@pytest.mark.parametrize("step", ["ensure_stream", "ensure_router_mapping"])
def test_a_crash_while_creating_converges_on_retry(
    harness: Harness, aws: boto3.Session, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    # Given the process dies right after the stream (or the mapping) was created
    real = getattr(harness.streams, step)

    def crash_after(*args: Any, **kwargs: Any) -> Any:
        real(*args, **kwargs)
        raise Crash

    monkeypatch.setattr(harness.streams, step, crash_after)
    with pytest.raises(Crash):
        admin_call("POST", "/v1/topics", {"name": "orders", "partitions": 4})
    # Then the topic is not visible yet
    assert admin_call("GET", "/v1/topics/orders")[0] == 404
    # When the client repeats the request
    monkeypatch.setattr(harness.streams, step, real)
    status, body = admin_call("POST", "/v1/topics", {"name": "orders", "partitions": 4})
    # Then it completes with one stream and one mapping
    assert status == 201
    assert len(body["storage_topics"]) == 1
    assert len(mappings(aws, "shoal-orders-0")) == 1
    assert len(harness.shards("shoal-orders-0")) == 4
    # And a third create is a conflict
    assert admin_call("POST", "/v1/topics", {"name": "orders", "partitions": 4})[0] == 409


def test_a_crashed_create_is_not_taken_over_with_other_partitions(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    def crash(*_: Any, **__: Any) -> StreamInfo:
        raise Crash

    monkeypatch.setattr(harness.streams, "ensure_stream", crash)
    with pytest.raises(Crash):
        admin_call("POST", "/v1/topics", {"name": "orders", "partitions": 4})
    monkeypatch.undo()
    harness.install(monkeypatch)
    status, body = admin_call("POST", "/v1/topics", {"name": "orders", "partitions": 8})
    assert (status, body["error"]["code"]) == (409, "topic_exists")


def test_a_crash_while_adding_a_storage_topic_converges(
    harness: Harness, aws: boto3.Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    admin_call("POST", "/v1/topics", {"name": "orders", "partitions": 4})
    real = harness.streams.ensure_router_mapping

    def crash_after(*args: Any) -> str:
        real(*args)
        raise Crash

    monkeypatch.setattr(harness.streams, "ensure_router_mapping", crash_after)
    with pytest.raises(Crash):
        admin_call("POST", "/v1/topics/orders/storage-topics", {"partitions": 8})
    monkeypatch.setattr(harness.streams, "ensure_router_mapping", real)
    # Another size is refused while the first one is pending
    status, body = admin_call("POST", "/v1/topics/orders/storage-topics", {"partitions": 12})
    assert (status, body["error"]["code"]) == (409, "storage_topic_pending")
    assert admin_call("GET", "/v1/topics/orders")[1]["storage_topics"][-1]["index"] == 0
    # Repeating the request finishes it
    status, body = admin_call("POST", "/v1/topics/orders/storage-topics", {"partitions": 8})
    assert status == 201
    assert [(s["partitions"], s["k"]) for s in body["storage_topics"]] == [(4, 1), (8, 2)]
    assert len(mappings(aws, "shoal-orders-1")) == 1


def test_a_stream_in_the_way_is_a_conflict(harness: Harness, aws: boto3.Session) -> None:
    # Given someone else's stream with the name the topic needs, of another size
    aws.client("kinesis").create_stream(StreamName="shoal-orders-0", ShardCount=2)
    status, body = admin_call("POST", "/v1/topics", {"name": "orders", "partitions": 4})
    assert (status, body["error"]["code"]) == (409, "stream_conflict")
    assert len(harness.shards("shoal-orders-0")) == 2


def test_an_uneven_stream_split_is_recorded(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given Kinesis split a stream's hash space other than evenly
    real = harness.streams.ensure_stream

    def uneven(name: str, partitions: int, wait_s: float) -> StreamInfo:
        info = real(name, partitions, wait_s=wait_s)
        return StreamInfo(info.arn, (0, *(k + 1 for k in info.starting_keys[1:])))

    monkeypatch.setattr(harness.streams, "ensure_stream", uneven)
    admin_call("POST", "/v1/topics", {"name": "orders", "partitions": 4})
    # Then the topic routes to the stream's own starting keys
    storage = harness.topic("orders").storage_topics[0]
    assert storage.starting_key(1) == even_starting_keys(4)[1] + 1


def test_concurrent_admins_never_corrupt_a_topic(harness: Harness) -> None:
    # Given a topic
    admin_call("POST", "/v1/topics", {"name": "orders", "partitions": 2})
    results: list[tuple[int, Any]] = []

    def grow() -> None:
        results.append(admin_call("POST", "/v1/topics/orders/storage-topics", {"partitions": 4}))

    # When several admins add storage topics at once
    threads = [threading.Thread(target=grow) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Then every answer is a success or a coded conflict, and the topic is consistent
    assert all(status in (201, 409) for status, _ in results)
    topic = harness.topic("orders")
    assert topic is not None and topic.pending is None
    assert [s.index for s in topic.storage_topics] == list(range(len(topic.storage_topics)))
    assert all(len(harness.shards(s.stream)) == s.partitions for s in topic.storage_topics)
    assert topic.version == 2 * len(topic.storage_topics)


def test_concurrent_switches_move_one_step_each(harness: Harness) -> None:
    admin_call("POST", "/v1/topics", {"name": "orders", "partitions": 2})
    for _ in range(3):
        admin_call("POST", "/v1/topics/orders/storage-topics", {"partitions": 4})
    results: list[int] = []

    def switch() -> None:
        results.append(admin_call("POST", "/v1/topics/orders/switch-produce")[0])

    threads = [threading.Thread(target=switch) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # three steps were possible: three switches succeed, the fourth finds no next
    assert sorted(results) == [200, 200, 200, 409]
    assert harness.topic("orders").produce_pointer == 3


def test_the_sample_events_create_and_grow_a_topic(harness: Harness) -> None:
    from functions.admin.app import handler

    status, created = call(handler, load_event("admin_create_topic.json"))
    assert (status, created["name"]) == (201, "orders")
    status, grown = call(handler, load_event("admin_add_storage_topic.json"))
    assert (status, grown["storage_topics"][1]["k"]) == (201, 2)


def test_answers_fit_the_openapi_document(harness: Harness) -> None:
    import jsonschema

    from tests.unit.test_openapi import schema

    _, created = admin_call("POST", "/v1/topics", {"name": "orders", "partitions": 4})
    jsonschema.validate(created, schema("Topic"))
    _, listed = admin_call("GET", "/v1/topics")
    jsonschema.validate(listed["topics"][0], schema("Topic"))
    _, error = admin_call("GET", "/v1/topics/nope")
    jsonschema.validate(error, schema("Error"))
