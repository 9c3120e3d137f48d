"""The enhanced fan-out option over a real ``shoal dev`` (issue 48): the router reads the default
topic through its consumer, and delivery keeps its guarantees, across a kill -9 too."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest
from shoal.local.provision import LocalNames

from tests.e2e.conftest import DevFactory
from tests.e2e.test_delivery import Client, publish, text

pytestmark = pytest.mark.e2e

KEYS = ("k0", "k1", "k2", "k3")


def publish_round(dev: Any, token: str, name: str, count: int) -> list[str]:
    """``count`` QoS 1 messages over ``KEYS`` (``<name>-<key>-<n>``), each key in order."""
    sent = []
    for n in range(count):
        key = KEYS[n % len(KEYS)]
        body = f"{name}-{key}-{n:03d}"
        publish(dev, token, f"fo/{key}", body, qos=1, ordering_key=key)
        sent.append(body)
    return sent


def check_order(got: list[dict[str, Any]]) -> None:
    """Per ordering key, the messages came in publish order."""
    by_key: dict[str, list[str]] = defaultdict(list)
    for message in got:
        by_key[text(message).split("-")[1]].append(text(message))
    for key, bodies in by_key.items():
        assert bodies == sorted(bodies), key


def test_delivery_through_the_routers_consumer_survives_a_kill_9(dev_factory: DevFactory) -> None:
    # Given shoal dev with the option on (the default topic made at start, 2 partitions)
    dev = dev_factory(default_partitions=2, env={"SHOAL_ENHANCED_FAN_OUT": "router"})
    session = dev.aws()
    stream = "shoal-default-0"
    arn = session.client("kinesis").describe_stream_summary(StreamName=stream)[
        "StreamDescriptionSummary"
    ]["StreamARN"]
    [consumer] = session.client("kinesis").list_stream_consumers(StreamARN=arn)["Consumers"]
    router = LocalNames.for_deployment().functions["router"]
    [mapping] = session.client("lambda").list_event_source_mappings(FunctionName=router)[
        "EventSourceMappings"
    ]
    # Then the router's mapping reads the stream through its consumer
    assert mapping["EventSourceArn"] == consumer["ConsumerARN"]
    token = dev.token("alice", clients=["alice-*"], publish=["#"], subscribe=["#"])
    client = Client(dev, token, "alice-1")
    client.connect()
    assert client.subscribe({"filter": "fo/#", "qos": 1}) == [1]
    # When messages of four ordering keys are published, got and acked
    sent = publish_round(dev, token, "a", 20)
    got = client.collect(len(sent))
    # Then each came exactly once, each key in publish order
    assert sorted(text(m) for m in got) == sorted(sent)
    assert len({m["id"] for m in got}) == len(got) and not any(m["dup"] for m in got)
    check_order(got)
    # When more are published and the server is killed at once (some not routed yet), then
    # started again on the same state
    more = publish_round(dev, token, "b", 12)
    dev.restart(kill=True)
    client.connect()
    # Then the mapping resumes from its checkpoint on the consumer: every message comes, none
    # of the first round again, none twice
    after = client.collect(len(more), timeout_s=60)
    assert sorted(text(m) for m in after) == sorted(more)
    assert len({m["message_id"] for m in after}) == len(after)
    check_order(after)
    assert client.quiet() == []
