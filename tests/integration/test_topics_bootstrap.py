"""The deploy-time bootstrap custom resource and the start-up hook: the `default` topic."""

from __future__ import annotations

import boto3
from shoal.composite.model import CompositeTopic
from shoal.composite.service import ensure_default_topic
from shoal.composite.store import TopicStore
from shoal.core.config import get_config
from shoal.wiring import topic_service

from functions.bootstrap.app import handler
from tests.helpers import FakeContext, load_event


def load_topic(name: str) -> CompositeTopic | None:
    return TopicStore.from_config(get_config()).load(name)


def test_create_makes_the_default_topic_with_the_configured_partitions(aws: boto3.Session) -> None:
    # When CloudFormation creates the custom resource (DefaultPartitions "2")
    response = handler(load_event("bootstrap_create.json"), FakeContext())
    # Then the default topic exists, with a stream of 2 shards and the router's mapping
    assert response["PhysicalResourceId"] == "shoal-topic-default"
    assert response["Data"] == {"Topic": "default", "Streams": "shoal-default-0"}
    topic = load_topic("default")
    assert topic is not None and topic.storage_topics[0].partitions == 2
    assert len(aws.client("kinesis").list_shards(StreamName="shoal-default-0")["Shards"]) == 2
    assert len(aws.client("lambda").list_event_source_mappings()["EventSourceMappings"]) == 1


def test_create_and_update_are_idempotent(aws: boto3.Session) -> None:
    handler(load_event("bootstrap_create.json"), FakeContext())
    update = load_event("bootstrap_create.json")
    update |= {"RequestType": "Update", "PhysicalResourceId": "shoal-topic-default"}
    update["ResourceProperties"]["DefaultPartitions"] = "4"
    response = handler(update, FakeContext())
    # an existing topic is kept as it is (grow it with a storage topic instead)
    assert response["PhysicalResourceId"] == "shoal-topic-default"
    topic = load_topic("default")
    assert topic is not None and topic.storage_topics[0].partitions == 2
    assert len(aws.client("lambda").list_event_source_mappings()["EventSourceMappings"]) == 1


def test_delete_keeps_the_topic_and_its_messages(aws: boto3.Session) -> None:
    handler(load_event("bootstrap_create.json"), FakeContext())
    delete = load_event("bootstrap_create.json")
    delete |= {"RequestType": "Delete", "PhysicalResourceId": "shoal-topic-default"}
    assert handler(delete, FakeContext()) == {"PhysicalResourceId": "shoal-topic-default"}
    assert load_topic("default") is not None
    # (besides the event log, which the stack owns)
    streams = aws.client("kinesis").list_streams()["StreamNames"]
    assert sorted(streams) == sorted(["shoal-default-0", *get_config().streams.values()])


def test_the_start_hook_uses_the_configured_partition_count(aws: boto3.Session) -> None:
    config = get_config().model_copy(update={"default_partitions": 3})
    topic = ensure_default_topic(topic_service(config))
    assert topic.storage_topics[0].partitions == 3
    assert ensure_default_topic(topic_service(config)) == load_topic("default")
