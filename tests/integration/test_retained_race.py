"""A subscription made while the router is behind on a retained message: the session gets that
message once, as retained (MQTT 5 §3.8.3.1, §4.1), and every message published after the
subscribe routed. The harness routes only when told to, so "behind" is deterministic."""

from __future__ import annotations

from typing import Any

import pytest
from shoal.delivery.model import RETAINED_GUARD_S

from tests.integration.test_delivery_support import World, texts, world

__all__ = ["world"]  # fixture

CLIENT = "alice-1"


def connected(world: World) -> str:
    return world.connect(CLIENT, clean_start=False, session_expiry_s=3600)


def kinds(messages: list[Any]) -> list[tuple[str, bool]]:
    return list(zip(texts(messages), [m["retain"] for m in messages], strict=True))


def in_flight_during_the_subscribe(world: World, text: str) -> None:
    """A retained message whose arrival at the stream comes after the subscription's cut: a
    publish still in flight while the subscribe ran (issue 33: between the two, either). Only
    such a message reaches the new subscription twice, as retained and routed, which the mark
    settles; one published before the subscribe is never routed to it."""
    world.stream_skew_ms = world.settings.stream_skew_ms + 2
    world.publish("r/a", text, retain=True)
    world.stream_skew_ms = 0


def marks(world: World, messages: list[Any]) -> dict[str, int]:
    session_id = messages[0]["id"].rpartition(".")[0]
    return world.inbox.state(session_id).marks


def test_a_subscription_made_while_the_router_is_behind_gets_the_message_once(
    world: World,
) -> None:
    # Given a retained message the router has not routed yet, in flight during the subscribe
    in_flight_during_the_subscribe(world, "kept")
    channel = connected(world)
    # When a subscription is made, a message published after it, and then the router runs
    world.subscribe(CLIENT, channel, {"filter": "r/#", "qos": 1})
    world.publish("r/a", "later", retain=True)
    assert world.route() > 0
    # Then the earlier one came once, as retained, the later one routed
    got = world.drain(CLIENT, channel)
    assert sorted(kinds(got)) == [("kept", True), ("later", False)]
    # and the mark went with the routed copy it consumed
    assert marks(world, got) == {}


def test_overlapping_new_subscriptions_get_it_once_whichever_the_router_names(
    world: World,
) -> None:
    world.publish("r/a", "kept", retain=True, qos=1)
    channel = connected(world)
    # the retained copy names r/+ (the first of equal QoS); the router names r/# (the smaller
    # filter of equal QoS): the mark must stand under both
    world.subscribe(CLIENT, channel, {"filter": "r/+", "qos": 1}, {"filter": "r/#", "qos": 1})
    world.route()
    got = world.drain(CLIENT, channel)
    assert [(m["subscription"], m["retain"]) for m in got] == [("r/+", True)]


def test_a_second_subscribe_sends_retained_again_but_never_routed(world: World) -> None:
    world.publish("r/a", "kept", retain=True)
    channel = connected(world)
    wanted = {"filter": "r/a", "qos": 1, "retain_handling": 0}
    world.subscribe(CLIENT, channel, wanted)
    first = world.drain(CLIENT, channel)
    world.subscribe(CLIENT, channel, wanted)  # retain handling 0: sent at every subscribe
    world.route()
    again = world.drain(CLIENT, channel)
    assert kinds(first) + kinds(again) == [("kept", True), ("kept", True)]


def test_retain_handling_2_gets_neither_the_retained_nor_a_routed_copy(world: World) -> None:
    world.publish("r/a", "kept", retain=True)
    channel = connected(world)
    world.subscribe(CLIENT, channel, {"filter": "r/#", "qos": 1, "retain_handling": 2})
    world.publish("r/a", "later")
    world.route()
    assert kinds(world.drain(CLIENT, channel)) == [("later", False)]


def test_an_unsubscribe_forgets_the_subscriptions_marks(world: World) -> None:
    world.publish("r/a", "kept", retain=True)
    channel = connected(world)
    world.subscribe(CLIENT, channel, "r/#", "other")
    got = world.drain(CLIENT, channel)
    assert kinds(got) == [("kept", True)] and len(marks(world, got)) == 1
    status, _ = world.unsubscribe(CLIENT, channel, "r/#")
    assert status == 200
    # the next get drops them (and the router's copy would go as unsubscribed anyway)
    assert world.get(CLIENT, channel) == []
    assert marks(world, got) == {}


def test_a_retained_message_older_than_the_guard_is_not_marked(world: World) -> None:
    world.publish("r/a", "kept", retain=True)
    world.clock.advance(RETAINED_GUARD_S + 1)
    channel = connected(world)
    world.subscribe(CLIENT, channel, "r/#")
    got = world.get(CLIENT, channel)
    assert kinds(got) == [("kept", True)] and marks(world, got) == {}


class Crash(Exception):
    """A function dying between two of its writes."""


def test_a_retained_message_published_before_the_subscribe_is_never_routed_to_it(
    world: World,
) -> None:
    # Given a retained message published (and arrived) before the subscribe
    world.publish("r/a", "kept", retain=True)
    channel = connected(world)
    world.subscribe(CLIENT, channel, {"filter": "r/#", "qos": 1})
    assert world.route() > 0
    # Then it comes once, as retained: the router gives the subscription nothing before its
    # cut, so the mark waits for a routed copy that never comes and expires with the guard
    got = world.drain(CLIENT, channel)
    assert kinds(got) == [("kept", True)]
    expiries = list(marks(world, got).values())
    assert len(expiries) == 1
    assert expiries[0] <= world.clock.now_ms() // 1000 + RETAINED_GUARD_S + 1


def test_crashes_of_the_router_and_of_get_still_deliver_it_once(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    in_flight_during_the_subscribe(world, "kept")
    channel = connected(world)
    world.subscribe(CLIENT, channel, "r/#")
    # the router dies after its inbox writes: the mapping retries the batch
    put = world.fanout.inbox.put
    crashes = {"put": 1, "state": 1}

    def put_then_crash(items: Any) -> None:
        put(items)
        if crashes["put"]:
            crashes["put"] -= 1
            raise Crash

    monkeypatch.setattr(world.fanout.inbox, "put", put_then_crash)
    world.route()
    assert crashes["put"] == 0
    # a get dies before its state write (the one consuming the routed copy): the next get
    # plans the same again
    write_state = world.inbox.write_state

    def crash_once(*args: Any, **kwargs: Any) -> bool:
        if crashes["state"]:
            crashes["state"] -= 1
            raise Crash
        return write_state(*args, **kwargs)

    monkeypatch.setattr(world.inbox, "write_state", crash_once)
    status, _ = world.get_call(CLIENT, channel)
    assert (status, crashes["state"]) == (500, 0)
    got = world.drain(CLIENT, channel)
    assert kinds(got) == [("kept", True)]
