"""Lanes through the handlers: a group's members share one shard's unkeyed messages, keyed
messages keep their order, a lost member's lane moves, a get reads a source once for all the
lanes it holds."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from shoal import wiring
from shoal.core.config import get_config
from shoal.groups.records import group_key
from shoal.groups.streams import CachedReader, parse_delivery_id

from tests.integration.test_groups_support import LEASE_S, GroupWorld, gworld

__all__ = ["gworld"]  # fixture

GROUP = "$share/w/jobs/#"


@pytest.fixture
def lanes_world(aws: boto3.Session, monkeypatch: pytest.MonkeyPatch) -> Iterator[GroupWorld]:
    w = GroupWorld(aws, monkeypatch, lanes=4)
    w.topic("default", 1)
    yield w


def member(world: GroupWorld, client_id: str, **option: Any) -> str:
    channel = world.connect(client_id, clean_start=False, session_expiry_s=600)
    assert world.subscribe(client_id, channel, {"filter": GROUP, "qos": 1, **option}) == [1]
    return channel


def test_members_share_one_shards_unkeyed_messages(lanes_world: GroupWorld) -> None:
    w = lanes_world
    # Given four members of a group on a one-partition topic
    channels = {c: member(w, c) for c in ("alice-w0", "alice-w1", "alice-w2", "alice-w3")}
    for c, channel in channels.items():
        w.heartbeat(c, channel)
    # When 200 messages without an ordering key are published
    ids = [w.publish("jobs/a", f"m{n}") for n in range(200)]
    w.route()
    got: dict[str, list[str]] = {c: [] for c in channels}
    for _ in range(30):
        for c, channel in channels.items():
            batch = w.get(c, channel, 20)
            got[c] += [m["message_id"] for m in batch]
            if batch:
                assert w.ack(c, channel, [m["id"] for m in batch])[1]["acked"] == len(batch)
        if sum(len(v) for v in got.values()) >= len(ids):
            break
    # Then every member got a share (at least 10% each) and every message went out once
    assert sorted(m for v in got.values() for m in v) == sorted(ids)
    assert min(len(v) for v in got.values()) >= 20, {c: len(v) for c, v in got.items()}


def test_keyed_messages_keep_their_order_within_the_group(lanes_world: GroupWorld) -> None:
    w = lanes_world
    channels = {c: member(w, c) for c in ("alice-w0", "alice-w1", "alice-w2")}
    published: dict[str, list[str]] = {f"k{k}": [] for k in range(5)}
    for n in range(60):
        key = f"k{n % 5}"
        published[key].append(w.publish("jobs/a", f"m{n}", ordering_key=key))
    w.route()
    received: dict[str, tuple[str, list[str]]] = {}
    for _ in range(20):
        for c, channel in channels.items():
            batch = w.get(c, channel, 7)
            for m in batch:
                key = next(k for k, ids in published.items() if m["message_id"] in ids)
                holder, seen = received.setdefault(key, (c, []))
                # a key's messages all go to the member holding its lane
                assert holder == c
                seen.append(m["message_id"])
            if batch:
                w.ack(c, channel, [m["id"] for m in batch])
    assert {k: v[1] for k, v in received.items()} == published


def test_a_lost_members_lanes_and_unacked_messages_move_to_the_others(
    lanes_world: GroupWorld,
) -> None:
    w = lanes_world
    channels = {c: member(w, c) for c in ("alice-w0", "alice-w1")}
    ids = [w.publish("jobs/a", f"m{n}") for n in range(40)]
    w.route()
    # Given w0 holding messages it never acks, then going silent
    held = w.get("alice-w0", channels["alice-w0"], 100)
    assert held
    # When the lease timeout passes while w1 keeps calling
    w.clock.advance(LEASE_S / 2)
    w.heartbeat("alice-w1", channels["alice-w1"])
    w.clock.advance(LEASE_S / 2 + 0.1)
    got: list[str] = []
    for _ in range(10):
        batch = w.get("alice-w1", channels["alice-w1"], 100)
        got += [m["message_id"] for m in batch]
        if batch:
            w.ack("alice-w1", channels["alice-w1"], [m["id"] for m in batch])
    # Then w1 got every message, w0's unacked ones among them (dup)
    assert sorted(set(got)) == sorted(ids)
    assert {m["message_id"] for m in held} <= set(got)
    # and w0's late acks are fenced off
    assert w.ack("alice-w0", channels["alice-w0"], [m["id"] for m in held])[1]["acked"] == 0


def test_one_member_holding_every_lane_reads_the_source_once_per_get(
    lanes_world: GroupWorld, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = lanes_world
    channel = member(w, "alice-solo")
    ids = [w.publish("jobs/a", f"m{n}") for n in range(40)]
    w.route()
    readers: list[CachedReader] = []
    original = type(w.groups.reader).cached

    def recording(self: Any) -> CachedReader:
        reader = original(self)
        readers.append(reader)
        return reader

    monkeypatch.setattr(type(w.groups.reader), "cached", recording)
    got = w.get("alice-solo", channel, 100)
    # one member of four lanes gets everything, in publish order per lane
    assert sorted(m["message_id"] for m in got) == sorted(ids)
    lanes = Counter(str(getattr(parse_delivery_id(m["id"]), "source", "")) for m in got)
    assert len(lanes) == 4
    # and three of the four lanes were answered from what the first one read
    assert readers and readers[-1].hits >= 3


def test_a_subscribe_sets_its_groups_lanes_and_a_plain_filter_refuses_them(
    gworld: GroupWorld,
) -> None:
    w = gworld
    channel = w.connect("alice-c1", clean_start=False, session_expiry_s=600)
    granted = w.subscribe(
        "alice-c1",
        channel,
        {"filter": "$share/big/orders/#", "qos": 1, "lanes": 16},
        {"filter": "orders/#", "qos": 1, "lanes": 2},
    )
    assert granted == [1, "lanes_not_shared"]
    loaded = w.group("big", "orders/#")
    assert loaded is not None and loaded.state.lanes == 16
    # a later member's own count does not change the group's
    other = w.connect("alice-c2", clean_start=False, session_expiry_s=600)
    assert w.subscribe(
        "alice-c2", other, {"filter": "$share/big/orders/#", "qos": 1, "lanes": 2}
    ) == [1]
    loaded = w.group("big", "orders/#")
    assert loaded is not None and loaded.state.lanes == 16


def test_a_member_that_only_gets_keeps_its_lanes(lanes_world: GroupWorld) -> None:
    w = lanes_world
    # Given two members, one of which never heartbeats but keeps getting
    getter = member(w, "alice-getter")
    other = member(w, "alice-other")
    w.heartbeat("alice-other", other)
    for n in range(8):
        w.publish("jobs/a", f"m{n}")
    w.route()
    w.get("alice-getter", getter, 1)
    before = w.group("w", "jobs/#")
    assert before is not None
    held = {s for s, x in before.state.streams.items() if x.holder == w.session_id("alice-getter")}
    assert held
    # When twice the lease timeout passes in small steps, the getter calling get each step
    for _ in range(8):
        w.clock.advance(LEASE_S / 4)
        w.get("alice-getter", getter, 1)
        w.heartbeat("alice-other", other)
    # Then it still holds its lanes (a get renews), under the same leases
    after = w.group("w", "jobs/#")
    assert after is not None
    assert {s: after.state.streams[s].lease for s in held} == {
        s: before.state.streams[s].lease for s in held
    }
    assert all(after.state.streams[s].holder == w.session_id("alice-getter") for s in held)


@pytest.mark.parametrize(("partitions", "lanes"), [(1, 8), (4, 2), (8, 1)])
def test_a_new_group_gets_lanes_for_its_topics_partitions(
    aws: boto3.Session, monkeypatch: pytest.MonkeyPatch, partitions: int, lanes: int
) -> None:
    # Given the groups service as a deployed function wires it (default parallelism 8)
    w = GroupWorld(aws, monkeypatch)
    w.topic("default", 1)
    w.topic("wide", partitions)
    service = wiring.group_service(get_config(), w.clock)
    # When the first member's subscribe creates a group reading that topic
    text = "$share/pool/wide/#"
    plan = service.membership("alice-a", "session-a", joins=[text])
    assert service.store.dynamo.transact(plan.parts) is None
    # Then its shards have ceil(8 / partitions) lanes
    loaded = service.store.load(group_key("pool", "wide/#"))
    assert loaded is not None and loaded.state.lanes == lanes
