"""The enhanced fan-out option over moto (issue 48): the router's consumer of each storage stream
the run-time code makes, from its registration to its deregistration."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError
from shoal.aws.dynamo import Dynamo
from shoal.aws.kinesis import ROUTER_CONSUMER, Streams
from shoal.composite.model import StorageTopic, stream_name
from shoal.core.clock import ManualClock
from shoal.core.config import FAN_OUT_ENV, get_config
from shoal.teardown import Teardown, on_event

from functions.bootstrap.app import handler as bootstrap
from tests.helpers import FakeContext, load_event
from tests.integration.test_publish_harness import Harness, admin_call


def harness(aws: boto3.Session, monkeypatch: pytest.MonkeyPatch, *, on: bool) -> Harness:
    """The admin API's services, with the option as ``-c enhancedFanOut=router`` sets it."""
    if on:
        monkeypatch.setenv(FAN_OUT_ENV, "router")
    get_config.cache_clear()
    h = Harness(aws)
    h.install(monkeypatch)
    return h


@pytest.fixture
def world(aws: boto3.Session, monkeypatch: pytest.MonkeyPatch) -> Iterator[Harness]:
    yield harness(aws, monkeypatch, on=True)
    get_config.cache_clear()


def stream_arn(aws: boto3.Session, stream: str) -> str:
    summary = aws.client("kinesis").describe_stream_summary(StreamName=stream)
    return str(summary["StreamDescriptionSummary"]["StreamARN"])


def consumers(aws: boto3.Session, stream: str) -> list[dict[str, Any]]:
    found = aws.client("kinesis").list_stream_consumers(StreamARN=stream_arn(aws, stream))
    return [dict(c) for c in found["Consumers"]]


def router_sources(aws: boto3.Session) -> list[str]:
    """What the router's mappings read (a stream's or a consumer's ARN)."""
    found = aws.client("lambda").list_event_source_mappings()["EventSourceMappings"]
    return sorted(
        str(m["EventSourceArn"]) for m in found if m["FunctionArn"].endswith(":shoal-router")
    )


def test_a_topic_made_with_the_option_is_routed_through_its_consumer(
    world: Harness, aws: boto3.Session
) -> None:
    # When a topic is created through the admin API with the option on
    assert admin_call("POST", "/v1/topics", {"name": "orders", "partitions": 2})[0] == 201
    # Then its stream has the router's consumer, active, and the router's one mapping reads it
    [consumer] = consumers(aws, "shoal-orders-0")
    assert (consumer["ConsumerName"], consumer["ConsumerStatus"]) == (ROUTER_CONSUMER, "ACTIVE")
    assert router_sources(aws) == [consumer["ConsumerARN"]]
    # And the mapping keeps the router's settings (only its source differs)
    [mapping] = aws.client("lambda").list_event_source_mappings()["EventSourceMappings"]
    assert (mapping["BatchSize"], mapping["ParallelizationFactor"]) == (500, 1)


def test_without_the_option_no_consumer_is_registered(
    aws: boto3.Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    harness(aws, monkeypatch, on=False)
    # When a topic is created with the option off (the default)
    assert admin_call("POST", "/v1/topics", {"name": "orders", "partitions": 1})[0] == 201
    # Then the router's mapping polls the stream itself, and nothing else is registered
    assert consumers(aws, "shoal-orders-0") == []
    assert router_sources(aws) == [stream_arn(aws, "shoal-orders-0")]


def test_the_mapping_waits_until_the_consumer_is_active(
    world: Harness, aws: boto3.Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given Kinesis reporting the new consumer CREATING for two looks (moto makes it ACTIVE at
    # once), and a record of what the make does in what order
    events: list[str] = []
    listed = Streams._consumer
    mapped = Streams.ensure_router_mapping

    def consumer(self: Streams, arn: str, name: str) -> tuple[str, str] | None:
        found = listed(self, arn, name)
        if found is not None and events.count("CREATING") < 2:
            found = (found[0], "CREATING")
        events.append(found[1] if found else "none")
        return found

    def mapping(self: Streams, source: str, function: str) -> str:
        events.append("mapping")
        return mapped(self, source, function)

    monkeypatch.setattr(Streams, "_consumer", consumer)
    monkeypatch.setattr(Streams, "ensure_router_mapping", mapping)
    started = world.clock.now_ms()
    # When a topic is created
    world.topics.create("orders", 1)
    # Then the mapping is made only once the consumer is ACTIVE, a second after each look
    assert events == ["none", "CREATING", "CREATING", "ACTIVE", "mapping"]
    assert world.clock.now_ms() - started >= 2000


def test_a_consumer_still_creating_after_the_wait_answers_retry_and_is_kept(
    world: Harness, aws: boto3.Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a consumer that stays CREATING longer than the request may wait
    listed = Streams._consumer

    def creating(self: Streams, arn: str, name: str) -> tuple[str, str] | None:
        found = listed(self, arn, name)
        return (found[0], "CREATING") if found else None

    monkeypatch.setattr(Streams, "_consumer", creating)
    # When a topic is created, Then the request answers 503 (retry) and no mapping is made
    status, body = admin_call("POST", "/v1/topics", {"name": "orders", "partitions": 1})
    assert (status, body["error"]["code"]) == (503, "server_busy")
    assert router_sources(aws) == []
    # And the consumer stays: the repeated request finds it further on, and completes
    monkeypatch.setattr(Streams, "_consumer", listed)
    [kept] = consumers(aws, "shoal-orders-0")
    assert admin_call("POST", "/v1/topics", {"name": "orders", "partitions": 1})[0] == 201
    assert router_sources(aws) == [kept["ConsumerARN"]]


def test_a_failed_make_deregisters_its_consumer_and_a_repeat_completes(
    world: Harness, aws: boto3.Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given Lambda refusing the router's mapping once
    refusals = [1]
    create = world.streams.awslambda.create_event_source_mapping

    def refuse(**kwargs: Any) -> Any:
        if refusals:
            refusals.pop()
            raise ClientError(
                {"Error": {"Code": "InvalidParameterValueException", "Message": "no"}},
                "CreateEventSourceMapping",
            )
        return create(**kwargs)

    monkeypatch.setattr(world.streams.awslambda, "create_event_source_mapping", refuse)
    # When a topic is created, Then the request fails and leaves no consumer (nor mapping)
    status, _ = admin_call("POST", "/v1/topics", {"name": "orders", "partitions": 1})
    assert status == 500
    assert consumers(aws, "shoal-orders-0") == []
    assert router_sources(aws) == []
    # And repeating it registers the consumer again and completes the topic
    assert admin_call("POST", "/v1/topics", {"name": "orders", "partitions": 1})[0] == 201
    [consumer] = consumers(aws, "shoal-orders-0")
    assert router_sources(aws) == [consumer["ConsumerARN"]]


def test_a_mapping_of_an_attempt_made_with_the_option_off_is_replaced(
    world: Harness, aws: boto3.Session
) -> None:
    # Given a make that crashed after the router's mapping on the stream itself (the option off)
    storage = StorageTopic(0, stream_name(world.config.stream_prefix, "orders", 0), 1, 1)
    assert world.store.reserve("orders", storage)
    info = world.streams.ensure_stream(storage.stream, 1)
    world.streams.ensure_router_mapping(info.arn, world.topics.router_function)
    # When the request is repeated with the option on
    world.topics.ensure("orders", 1)
    # Then the router reads the stream through its consumer only: never twice
    [consumer] = consumers(aws, storage.stream)
    assert router_sources(aws) == [consumer["ConsumerARN"]]


def test_a_grow_and_a_switch_keep_the_consumers(world: Harness, aws: boto3.Session) -> None:
    # Given a topic made with the option on
    assert admin_call("POST", "/v1/topics", {"name": "orders", "partitions": 1})[0] == 201
    [first] = consumers(aws, "shoal-orders-0")
    # When it grows by a storage topic and produce switches to it
    status, _ = admin_call("POST", "/v1/topics/orders/storage-topics", {"partitions": 2})
    assert status == 201
    assert admin_call("POST", "/v1/topics/orders/switch-produce")[0] == 200
    # Then the first stream keeps its consumer and mapping (its records drain through it), and
    # the new stream has its own
    assert consumers(aws, "shoal-orders-0") == [first]
    [second] = consumers(aws, "shoal-orders-1")
    assert router_sources(aws) == sorted([first["ConsumerARN"], second["ConsumerARN"]])


def test_the_bootstrap_makes_the_default_topic_through_a_consumer(
    world: Harness, aws: boto3.Session
) -> None:
    # When CloudFormation creates the bootstrap's custom resource with the option on
    bootstrap(load_event("bootstrap_create.json"), FakeContext())
    # Then the default topic's stream is read through the router's consumer
    [consumer] = consumers(aws, "shoal-default-0")
    assert router_sources(aws) == [consumer["ConsumerARN"]]


def teardown(aws: boto3.Session) -> Teardown:
    return Teardown(
        get_config(),
        aws.client("kinesis"),
        aws.client("lambda"),
        Dynamo(aws.client("dynamodb")),
        ManualClock(),
    )


def test_the_teardown_deregisters_the_consumers_with_or_without_a_mapping(
    world: Harness, aws: boto3.Session
) -> None:
    # Given two topics made with the option on, and a make that crashed after its consumer
    # (registered, no mapping yet)
    assert admin_call("POST", "/v1/topics", {"name": "orders", "partitions": 2})[0] == 201
    assert admin_call("POST", "/v1/topics", {"name": "metrics", "partitions": 1})[0] == 201
    storage = StorageTopic(0, stream_name(world.config.stream_prefix, "halfway", 0), 1, 1)
    assert world.store.reserve("halfway", storage)
    info = world.streams.ensure_stream(storage.stream, 1)
    world.streams.ensure_consumer(info.arn, ROUTER_CONSUMER)
    # When the stack is deleted
    answer = on_event(
        {"RequestType": "Delete", "StackId": "arn", "ResourceProperties": {}},
        lambda: teardown(aws),
        lambda _: "DELETE_IN_PROGRESS",
    )
    # Then the three consumers were deregistered before their streams went
    assert answer["Data"]["ConsumersDeregistered"] == 3
    assert answer["Data"]["MappingsDeleted"] == 2
    listing = aws.client("kinesis").list_streams()["StreamNames"]
    assert not {"shoal-orders-0", "shoal-metrics-0", storage.stream} & set(listing)
