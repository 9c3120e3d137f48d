"""The router's fan-out over moto: what it writes to inboxes, and what it reads to know whom."""

from __future__ import annotations

from collections import Counter
from typing import Any

import boto3
import pytest
from shoal.aws.dynamo import plain
from shoal.core.config import get_config
from shoal.delivery.inbox import InboxItem
from shoal.local.esm.invocation import event_of
from shoal.records import Message
from shoal.router.fanout import Fanout

from tests.helpers import FakeContext
from tests.integration.test_delivery_support import World, texts, world

__all__ = ["world"]  # fixture

CLIENT = "alice-1"


def connected(world: World, client_id: str = CLIENT) -> str:
    return world.connect(client_id, clean_start=False, session_expiry_s=3600)


def event_for(world: World, stream: str, first: int = 0, last: int | None = None) -> dict[str, Any]:
    """Lambda's event for records ``first..last`` (by index) of the stream's only shard."""
    records = [r for _, r in world.harness.records(stream)]
    shard = world.harness.shards(stream)[0]["ShardId"]
    chosen = records[first : None if last is None else last + 1]
    return event_of(chosen, stream=stream, shard_id=shard)


def inbox_items(session: boto3.Session) -> list[InboxItem]:
    """The delivery items of every inbox, decoded (state and ledger items left out)."""
    table = session.resource("dynamodb").Table(get_config().table("inboxes"))
    items: list[dict[str, Any]] = table.scan(ConsistentRead=True)["Items"]
    return [InboxItem.from_record(plain(i)) for i in items if "b" in i]


def positions(session: boto3.Session) -> Counter[tuple[str, str, str]]:
    return Counter(
        (i.session_id, i.source, m.position) for i in inbox_items(session) for m in i.messages
    )


def route(world: World, event: dict[str, Any]) -> Any:
    return world.router(event, FakeContext())


def test_a_batch_redelivered_as_is_writes_nothing_twice(world: World) -> None:
    channel = connected(world)
    world.subscribe(CLIENT, channel, "a/#")
    for n in range(3):
        world.publish("a/b", str(n))
    event = event_for(world, "shoal-default-0")
    assert route(world, event) == {"batchItemFailures": []}
    before = inbox_items(world.session)
    route(world, event)
    assert inbox_items(world.session) == before
    assert texts(world.drain(CLIENT, channel)) == ["0", "1", "2"]


def test_a_batch_replayed_from_an_older_checkpoint_writes_nothing_twice(world: World) -> None:
    # Given records 3..5 routed, then (a mapping that lost its checkpoint) 0..5 again
    channel = connected(world)
    world.subscribe(CLIENT, channel, "a/#")
    for n in range(6):
        world.publish("a/b", str(n))
    route(world, event_for(world, "shoal-default-0", 0, 2))
    route(world, event_for(world, "shoal-default-0", 3, 5))
    route(world, event_for(world, "shoal-default-0", 0, 5))
    # Then each delivery is written once (the ledger sent the replay through the inbox check)
    assert set(positions(world.session).values()) == {1}
    assert texts(world.drain(CLIENT, channel)) == [str(n) for n in range(6)]


def test_a_bisected_retry_after_a_partial_write_writes_nothing_twice(world: World) -> None:
    # Given a batch of six whose deliveries were written by an attempt that then failed
    channel = connected(world)
    world.subscribe(CLIENT, channel, "a/#")
    for n in range(6):
        world.publish("a/b", str(n))
    route(world, event_for(world, "shoal-default-0", 0, 5))
    # When Lambda retries it in halves
    route(world, event_for(world, "shoal-default-0", 0, 2))
    route(world, event_for(world, "shoal-default-0", 3, 5))
    assert set(positions(world.session).values()) == {1}
    assert len(inbox_items(world.session)) == 1


def test_small_messages_of_one_batch_share_one_item_per_session(world: World) -> None:
    a, b = connected(world, "alice-a"), connected(world, "alice-b")
    world.subscribe("alice-a", a, "s/#")
    world.subscribe("alice-b", b, "s/+")
    world.publish_batch([{"topic": "s/x", "text": str(n)} for n in range(20)])
    for n in range(5):
        world.publish("s/y", f"single{n}")
    world.route()
    # Then one item per session holds all 25 deliveries (one write each)
    items = inbox_items(world.session)
    assert sorted(len(i.messages) for i in items) == [25, 25]
    assert len(texts(world.drain("alice-a", a))) == 25


def test_dollar_topics_match_only_filters_that_name_their_first_level(world: World) -> None:
    # Given two sessions: one on '#', one on '$SYS/#' (publishing refuses $-topics, so the
    # message is handed to the fan-out directly)
    hash_, sys = connected(world, "alice-h"), connected(world, "alice-s")
    world.subscribe("alice-h", hash_, "#", "+/broker")
    world.subscribe("alice-s", sys, "$SYS/#")
    message = Message(
        "m1", "$SYS/broker", b"up", 1, False, "$SYS/broker", world.clock.now_ms(), "x"
    )
    report = world.fanout.route("shoal-default-0", "shardId-000000000000", [("1", [message])])
    assert report.deliveries == 1
    assert world.get("alice-h", hash_) == []
    assert [m["topic"] for m in world.get("alice-s", sys)] == ["$SYS/broker"]


def test_a_shared_subscription_without_its_group_reaches_no_inbox(world: World) -> None:
    channel = connected(world)
    world.subscribe(CLIENT, channel, "$share/g/jobs/#")
    world.publish("jobs/1", "j")
    world.route()
    assert world.get(CLIENT, channel) == []
    # When a batch meets a shared subscription that names no group incarnation
    bare = Fanout(world.fanout.cache, world.fanout.inbox, world.settings)
    message = Message("m2", "jobs/2", b"j", 1, False, "jobs/2", world.clock.now_ms(), "x")
    report = bare.route("shoal-default-0", "shardId-000000000000", [("9", [message])])
    # Then it is counted as skipped and written nowhere
    assert (report.shared_skipped, report.deliveries) == (1, 0)


def test_the_router_view_follows_changes_incrementally(world: World) -> None:
    channel = connected(world)
    world.subscribe(CLIENT, channel, "v/#")
    world.publish("v/1", "one")
    world.route()
    assert texts(world.drain(CLIENT, channel)) == ["one"]
    stats = world.fanout.cache.stats
    loads = stats.full_loads
    # When subscriptions change between batches
    world.unsubscribe(CLIENT, channel, "v/#")
    world.subscribe(CLIENT, channel, "v/+")
    world.publish("v/2", "two")
    world.publish("v/2/deep", "not matched now")
    world.route()
    # Then the router applied the changes, without reloading the bucket
    assert stats.full_loads == loads and stats.incremental >= 1
    assert texts(world.drain(CLIENT, channel)) == ["two"]


def test_a_gap_in_the_change_records_reloads_the_bucket(world: World) -> None:
    channel = connected(world)
    world.subscribe(CLIENT, channel, "g/1")
    world.publish("g/1", "one")
    world.route()
    # Given a change record that TTL removed
    world.subscribe(CLIENT, channel, "g/2")
    table = world.session.resource("dynamodb").Table(get_config().table("subscriptions"))
    table.delete_item(Key={"bucket": "L:g", "item": "c#000000000002"})
    loads = world.fanout.cache.stats.full_loads
    world.publish("g/2", "two")
    world.route()
    assert world.fanout.cache.stats.full_loads == loads + 1
    assert texts(world.drain(CLIENT, channel)) == ["one", "two"]


def test_the_batch_is_still_archived(world: World) -> None:
    channel = connected(world)
    world.subscribe(CLIENT, channel, "a")
    world.publish("a", "x")
    world.route()
    s3 = world.session.client("s3")
    keys = [
        o["Key"]
        for o in s3.list_objects_v2(Bucket=get_config().buckets["archive"])["Contents"]
        if o["Key"].startswith("messages/")
    ]
    assert len(keys) == 1 and keys[0].startswith("messages/topic=default/")


def test_only_records_before_a_failed_one_are_routed(world: World) -> None:
    channel = connected(world)
    world.subscribe(CLIENT, channel, "f")
    for n in range(3):
        world.publish("f", str(n))
    event = event_for(world, "shoal-default-0")
    event["Records"][1]["kinesis"]["data"] = "%%% not base64"
    answer = route(world, event)
    assert answer["batchItemFailures"] == [
        {"itemIdentifier": event["Records"][1]["kinesis"]["sequenceNumber"]}
    ]
    assert texts(world.get(CLIENT, channel)) == ["0"]


@pytest.mark.parametrize("expiry_s", [1, 3600])
def test_message_expiry_is_checked_when_routing(world: World, expiry_s: int) -> None:
    channel = connected(world)
    world.subscribe(CLIENT, channel, "e")
    world.publish("e", "x", properties={"message_expiry_s": expiry_s})
    world.clock.advance(2)
    world.route()
    assert len(inbox_items(world.session)) == (0 if expiry_s == 1 else 1)
