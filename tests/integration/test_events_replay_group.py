"""Replay into a shared group (``pipeline.replay.GroupStreamTarget``) over the emulated account:
the group's member gets the replayed messages once, in order, through get like any other."""

from __future__ import annotations

import boto3
from shoal.core.config import get_config

from pipeline.replay import GroupStreamTarget, ReplayMessage
from tests.integration.test_groups_support import GroupWorld, gworld

__all__ = ["gworld"]  # fixture


def replayed(n: int, topic: str = "orders/a") -> ReplayMessage:
    return ReplayMessage(
        replay_message_id=f"replayed-{n}",
        message_id=f"m{n}",
        topic=topic,
        ordering_key="k",
        qos=1,
        published_at=1_700_000_000_000 + n,
        payload=f"old {n}".encode(),
        replay_position=f"p.{n:05d}",
    )


def test_a_groups_member_gets_a_replay_once_in_order(
    gworld: GroupWorld, aws: boto3.Session
) -> None:
    w = gworld
    # Given the only member of $share/g/orders/#, with nothing routed yet
    channel = w.connect("alice-1")
    w.subscribe("alice-1", channel, "$share/g/orders/#")
    # When five archived messages are replayed into the group, twice (the same replay id)
    for _ in range(2):
        target = GroupStreamTarget.from_config(get_config(), "g/orders/#", "replay-1", w.clock)
        assert target.inject([replayed(n) for n in range(5)]) == 5
    # Then the member gets each once, in plan order, under the replayed ids, and acks them
    got = w.drain("alice-1", channel)
    assert [m["message_id"] for m in got] == [f"replayed-{n}" for n in range(5)]
    assert [m["subscription"] for m in got] == ["$share/g/orders/#"] * 5
    assert w.drain("alice-1", channel) == []
