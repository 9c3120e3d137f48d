"""Ordered drain for a shared group over moto: a group stream of T1 yields nothing until the
group's T0 streams are sealed, routed and fully acked (another member may hold them)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import boto3
import pytest

from tests.integration.test_delivery_support import texts
from tests.integration.test_drain_sessions import KEY, T0, T1
from tests.integration.test_drain_support import GRACE_MS, Drain, Feed, switch
from tests.integration.test_groups_support import GroupWorld

SHARED = {"filter": "$share/g/orders/#", "qos": 1}


@pytest.fixture(params=[1, 4], ids=["one-lane", "four-lanes"])
def gworld(
    aws: boto3.Session, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> Iterator[GroupWorld]:
    # with lanes, every lane of T0's shards must be past the seal (the key's lane, and the
    # lanes that only pass over its messages)
    w = GroupWorld(aws, monkeypatch, lanes=request.param)
    w.topic("default", 1)
    w.topic("orders", 4)
    yield w


def publish(world: GroupWorld, names: list[str]) -> None:
    for name in names:
        world.publish("orders/eu", name, qos=1, ordering_key=KEY)


def members(world: GroupWorld) -> dict[str, str]:
    channels = {c: world.connect(c) for c in ("alice-a", "alice-b")}
    for client, channel in channels.items():
        world.subscribe(client, channel, SHARED)
    return channels


def get_all(world: GroupWorld, channels: dict[str, str]) -> list[tuple[str, Any]]:
    """One get by each member (after a heartbeat each): (member, delivery) in answer order."""
    out: list[tuple[str, Any]] = []
    for client, channel in channels.items():
        world.heartbeat(client, channel)
    for client, channel in channels.items():
        out += [(client, m) for m in world.get(client, channel, 100)]
    return out


def test_a_t1_stream_waits_for_the_t0_streams_to_be_sealed_and_acked(gworld: GroupWorld) -> None:
    # Given two members, m0-m2 of one key in T0, a switch, m3-m5 of the key in T1
    drain, feed = Drain(gworld), Feed(gworld)
    channels = members(gworld)
    publish(gworld, ["m0", "m1", "m2"])
    switch("orders", 4)
    publish(gworld, ["m3", "m4", "m5"])
    # When T1's batch is routed before T0's (both streams known to the leader and granted)
    feed.route(T1)
    feed.route(T0)
    # Then the members get T0's messages only
    first = get_all(gworld, channels)
    assert texts([m for _, m in first]) == ["m0", "m1", "m2"]
    # When T0 is sealed and the seals routed, while its messages are not acked yet
    gworld.clock.advance(GRACE_MS / 1000 + 1)
    assert drain.sealer.run() == 1
    feed.route(T0)
    # Then no member gets T1's messages: the T0 stream's holder may still redeliver m0-m2
    assert get_all(gworld, channels) == []
    # When T0's holder acks them
    holder = first[0][0]
    status, _ = gworld.ack(holder, channels[holder], [m["id"] for _, m in first])
    assert status == 200
    gworld.clock.advance(1.1)
    # Then T1's messages go out, after T0's: the key's publish order holds across members
    rest = get_all(gworld, channels)
    assert texts([m for _, m in rest]) == ["m3", "m4", "m5"]
