"""Ordered drain for sessions over moto: a key's T1 messages wait for its T0 messages."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from shoal.composite.model import StorageTopic
from shoal.delivery.inbox import InboxStore
from shoal.delivery.model import source_id, split_key
from shoal.drain import Sealer, seal_grace_ms
from shoal.records import is_seal
from shoal.wiring import SealingHooks

from tests.integration.test_delivery_support import World, texts
from tests.integration.test_drain_support import GRACE_MS, Drain, Feed, switch

T0, T1 = "shoal-orders-0", "shoal-orders-1"


class Crash(BaseException):
    """A process dying mid-call (not even ``except Exception`` runs)."""


@pytest.fixture
def world(aws: boto3.Session, monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    w = World(aws, monkeypatch)
    w.topic("default", 1)
    w.topic("orders", 4)
    yield w


def t1_sorts_first() -> str:
    """An ordering key whose T1 inbox source sorts before its T0 one, so that a get reading
    sources in key order alone would hand T1 out first (both storage topics have 4 partitions
    and K=1, so the key is in the same partition of each; moto names shards by number)."""

    def source(stream: str, key: str) -> str:
        partition = StorageTopic(0, stream, 4, 1).partition_for(key)
        return source_id(stream, f"shardId-{partition:012d}")

    return next(k for k in (f"k{n}" for n in range(100)) if source(T1, k) < source(T0, k))


KEY = t1_sorts_first()


def publish(world: World, names: list[str]) -> None:
    for name in names:
        world.publish("orders/eu", name, qos=1, ordering_key=KEY)


def switched(world: World) -> tuple[Drain, Feed, str]:
    """A subscribed session, m0-m2 of one key in T0, a switch, m3-m5 of that key in T1."""
    drain, feed = Drain(world), Feed(world)
    channel = world.connect("alice-1")
    world.subscribe("alice-1", channel, {"filter": "orders/#", "qos": 1})
    publish(world, ["m0", "m1", "m2"])
    switch("orders", 4)
    publish(world, ["m3", "m4", "m5"])
    assert [m.payload for _, m in world.harness.messages(T1)] == [b"m3", b"m4", b"m5"]
    return drain, feed, channel


def seal(world: World, drain: Drain) -> None:
    world.clock.advance(GRACE_MS / 1000 + 1)
    assert drain.sealer.run() == 1


def test_t1_waits_until_t0_is_sealed_and_routed_then_all_in_publish_order(world: World) -> None:
    # Given T1's batch routed before T0's
    drain, feed, channel = switched(world)
    feed.route(T1)
    # Then get hands out nothing of T1 while T0 is not drained
    assert world.get("alice-1", channel, 100) == []
    # When T0 is routed (not sealed yet): its messages come, T1's still wait
    feed.route(T0)
    first = world.get("alice-1", channel, 100)
    assert texts(first) == ["m0", "m1", "m2"]
    world.clock.advance(2)
    assert world.get("alice-1", channel, 100) == []
    # When the sealer runs before the grace is over: nothing is sealed
    assert drain.sealer.run() == 0
    # When T0 is sealed and the seals routed
    seal(world, drain)
    assert feed.route(T0) == 4  # one seal per shard
    # Then T1's messages follow, and the session saw the key in publish order
    rest = world.get("alice-1", channel, 100)
    assert texts(first + rest) == ["m0", "m1", "m2", "m3", "m4", "m5"]


def test_one_get_hands_out_t0_before_t1_whatever_the_source_order(world: World) -> None:
    # Given everything routed and sealed before the session reads, T1 routed first
    drain, feed, channel = switched(world)
    feed.route(T1)
    feed.route(T0)
    seal(world, drain)
    feed.route(T0)
    # When the session gets two messages at a time
    seen: list[str] = []
    for _ in range(4):
        batch = world.get("alice-1", channel, 2)
        seen += texts(batch)
        world.ack("alice-1", channel, [m["id"] for m in batch])
    # Then the key's messages come in publish order
    assert seen == ["m0", "m1", "m2", "m3", "m4", "m5"]


def test_the_steady_state_reads_no_drain_record(world: World) -> None:
    # Given a session that passed T0 once
    drain, feed, channel = switched(world)
    feed.route(T0)
    seal(world, drain)
    feed.route(T0)
    feed.route(T1)
    assert len(world.drain("alice-1", channel)) == 6
    reads = drain.session_gate.view.reads
    # and remembers it in its delivery state
    head = world.registry.repository.head("alice-1")
    assert head is not None and head.session_id is not None
    assert world.inbox.state(head.session_id).drained == {"orders": 1}
    # When more T1 messages come
    publish(world, ["m6", "m7"])
    feed.route(T1)
    # Then they go out without the gate reading the drain record again
    assert texts(world.get("alice-1", channel, 100)) == ["m6", "m7"]
    assert drain.session_gate.view.reads == reads


def test_a_replayed_batch_holding_a_seal_changes_nothing_twice(world: World) -> None:
    # Given T0 routed with its seals, T1 routed, the session served
    drain, feed, channel = switched(world)
    feed.route(T0)
    seal(world, drain)
    feed.route(T0)
    feed.route(T1)
    assert texts(world.drain("alice-1", channel)) == ["m0", "m1", "m2", "m3", "m4", "m5"]
    record = drain.store.record(T0)
    # When Lambda replays every batch of both storage topics
    feed.replay(T0)
    feed.replay(T1)
    # Then the drain record is the same and the session gets nothing twice
    assert drain.store.record(T0) == record
    assert world.get("alice-1", channel, 100) == []


def test_a_sealer_crash_between_the_seals_and_the_mark_is_completed_by_the_next_run(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given T0 routed, and a sealer that dies after putting the seals, before the mark
    drain, feed, channel = switched(world)
    feed.route(T0)
    feed.route(T1)
    world.clock.advance(GRACE_MS / 1000 + 1)

    def die(*_: object, **__: object) -> None:
        raise Crash

    with monkeypatch.context() as patch:
        patch.setattr(drain.store, "mark_sealed", die)
        with pytest.raises(Crash):
            drain.sealer.run()
    # When the router routes those seals
    feed.route(T0)
    # Then T0 is not fully drained (not marked sealed), so T1 still waits
    assert drain.store.record(T0).sealed is None
    assert texts(world.get("alice-1", channel, 100)) == ["m0", "m1", "m2"]
    world.clock.advance(2)
    assert world.get("alice-1", channel, 100) == []
    # When the next run seals again (a second seal per shard) and the router routes them
    assert drain.sealer.run() == 1
    feed.route(T0)
    seals = [r for _, r in world.harness.records(T0) if is_seal(r["Data"])]
    assert len(seals) == 8
    # Then T1 goes out
    world.clock.advance(2)
    assert texts(world.get("alice-1", channel, 100)) == ["m3", "m4", "m5"]


def test_a_switch_seals_what_it_left_behind_once_no_routed_put_can_land(world: World) -> None:
    # Given the topic service as the wiring root makes it: a switch seals what it leaves behind,
    # with the default grace (the publish path's routing bound plus the skew margin)
    drain, feed = Drain(world), Feed(world)
    harness = world.harness
    sealer = Sealer(harness.streams, drain.store, harness.store.scan, world.clock)
    harness.topics.hooks = SealingHooks(harness.config, harness.streams, world.clock, sealer)
    channel = world.connect("alice-1")
    world.subscribe("alice-1", channel, {"filter": "orders/#", "qos": 1})
    publish(world, ["m0", "m1", "m2"])
    # When the admin switches produce (no reaper runs in this test)
    switch("orders", 4)
    # Then the call answered once T0 was sealed, at the switch's effect plus the grace, and
    # not before: every T0 shard holds a seal
    effective = harness.topic("orders").effective_at_ms
    record = drain.store.record(T0)
    assert record.sealed is not None and len(record.sealed) == 4
    assert record.sealed_at == effective + seal_grace_ms() == world.clock.now_ms()
    assert sum(1 for _, r in harness.records(T0) if is_seal(r["Data"])) == 4
    # And a message published after the switch is delivered as soon as the router has the
    # seals, after the key's T0 messages
    publish(world, ["m3"])
    feed.route(T1)
    feed.route(T0)
    got: list[Any] = []
    for _ in range(3):
        batch = world.get("alice-1", channel, 100)
        if batch:
            world.ack("alice-1", channel, [m["id"] for m in batch])
        got += batch
    assert texts(got) == ["m0", "m1", "m2", "m3"]


def _items_by_stream(world: World, session_id: str) -> dict[str, int]:
    """The session's inbox items, counted by the storage topic of their source."""
    streams = {
        source_id(stream, shard["ShardId"]): stream
        for stream in (T0, T1)
        for shard in world.harness.shards(stream)
    }
    counted: dict[str, int] = {T0: 0, T1: 0}
    for row in world.inbox.dynamo.query(
        world.inbox.table,
        KeyConditionExpression="#p = :p",
        ExpressionAttributeNames={"#p": "inbox"},
        ExpressionAttributeValues={":p": {"S": session_id}},
    ):
        stream = streams.get(split_key(str(row["position"]))[0])
        if stream is not None:
            counted[stream] += 1
    return counted


def _passed_t0(world: World) -> tuple[Drain, Feed, str, str]:
    """A session that got m0-m5 across the switch; its channel and session id."""
    drain, feed, channel = switched(world)
    feed.route(T0)
    seal(world, drain)
    feed.route(T0)
    feed.route(T1)
    head = world.registry.repository.head("alice-1")
    assert head is not None and head.session_id is not None
    return drain, feed, channel, head.session_id


def test_an_idle_long_poll_deletes_the_items_of_a_storage_topic_the_session_passed(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Consumed items stay until their TTL, and every look of a long poll queries past each
    source's: after a topic grows, the drained storage topic's sources too, for 14 days. Once
    the session has passed that storage topic and acked all of it, nothing comes to those
    sources again and nothing reads them back: an idle look deletes their items, once."""
    # Given a session that got and acked everything of T0 and T1
    _, feed, channel, session_id = _passed_t0(world)
    assert texts(world.drain("alice-1", channel)) == ["m0", "m1", "m2", "m3", "m4", "m5"]
    before = _items_by_stream(world, session_id)
    assert before[T0] > 0 and before[T1] > 0
    # When it long-polls and nothing comes
    assert world.get("alice-1", channel, 10, wait_ms=2000) == []
    # Then T0's items are gone, and T1's stay (the live storage topic's)
    assert _items_by_stream(world, session_id) == {T0: 0, T1: before[T1]}
    # And a later poll's looks query no T0 source
    t0_sources = {source_id(T0, s["ShardId"]) for s in world.harness.shards(T0)}
    looked: list[str] = []
    real = InboxStore.after

    def after(self: InboxStore, session: str, key: str, **kw: Any) -> Any:
        if not kw.get("consistent", True):
            looked.append(split_key(key)[0])
        return real(self, session, key, **kw)

    monkeypatch.setattr(InboxStore, "after", after)
    assert world.get("alice-1", channel, 10, wait_ms=2000) == []
    assert looked and not t0_sources & set(looked)
    # And what comes later is delivered, and nothing of T0 again
    publish(world, ["m6"])
    feed.route(T1)
    assert texts(world.drain("alice-1", channel)) == ["m6"]


def test_a_passed_storage_topics_items_in_flight_are_kept_and_sent_again(world: World) -> None:
    """A delivery handed out and not acked is read back from its items when it is sent again
    (after the ack timeout): a look leaves its source's items alone until it is acked."""
    # Given a session that got everything of T0 and T1 and acked all but m1
    _, _, channel, session_id = _passed_t0(world)
    got = world.get("alice-1", channel, 100)
    got += world.get("alice-1", channel, 100)
    assert texts(got) == ["m0", "m1", "m2", "m3", "m4", "m5"]
    assert world.ack("alice-1", channel, [m["id"] for m in got if texts([m]) != ["m1"]])[0] == 200
    before = _items_by_stream(world, session_id)
    # When it long-polls and nothing new comes
    assert world.get("alice-1", channel, 10, wait_ms=2000) == []
    # Then T0's items stay
    assert _items_by_stream(world, session_id) == before
    # And after the ack timeout m1 comes again, with dup
    world.clock.advance(world.settings.ack_timeout_s + 1)
    again = world.get("alice-1", channel, 10)
    assert texts(again) == ["m1"] and again[0]["dup"] is True
    assert world.ack("alice-1", channel, [again[0]["id"]])[0] == 200
    # And once it is acked, the next idle poll deletes them
    assert world.get("alice-1", channel, 10, wait_ms=2000) == []
    assert _items_by_stream(world, session_id)[T0] == 0
