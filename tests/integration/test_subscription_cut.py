"""A subscription starts where it was made (API.md; DESIGN.md property 1).

A message whose publish returned before the subscribe was called never reaches the new
subscription, live or routed (only as the retained message its retain handling asks for, on a
non-shared subscription); one whose publish was called after the subscribe returned always
does. The world routes only when told to, so "the router is behind" is deterministic, and the
emulated stream stamps arrivals by the world's clock plus a skew the tests set
(``World.stream_skew_ms``): the functions' clock and the stream's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import boto3
import pytest

from tests.integration.test_delivery_support import World, texts, world
from tests.integration.test_drain_support import switch
from tests.integration.test_groups_support import GroupWorld

__all__ = ["world"]  # fixture

CLIENT = "alice-1"
#: the skew bound the world's subscriptions assume (DeliverySettings' default)
BOUND_MS = 100


@pytest.fixture
def gworld(aws: boto3.Session, monkeypatch: pytest.MonkeyPatch) -> Iterator[GroupWorld]:
    w = GroupWorld(aws, monkeypatch)
    w.topic("default", 1)
    yield w


def kinds(messages: list[Any]) -> list[tuple[str, bool]]:
    return list(zip(texts(messages), [m["retain"] for m in messages], strict=True))


def connected(w: World, client_id: str = CLIENT) -> str:
    return w.connect(client_id, clean_start=False, session_expiry_s=3600)


@pytest.mark.parametrize("routed_before", [False, True], ids=["router-behind", "router-ran"])
def test_a_session_gets_nothing_published_before_its_subscribe(
    world: World, routed_before: bool
) -> None:
    assert world.settings.stream_skew_ms == BOUND_MS
    # Given messages published (and returned) before the subscribe
    world.publish("jobs/a", "early-1", qos=1)
    world.publish("jobs/b", "early-2", qos=2, ordering_key="k")
    channel = connected(world)
    if routed_before:
        world.route()
    # When the session subscribes, and a message is published after it returned
    world.subscribe(CLIENT, channel, {"filter": "jobs/#", "qos": 2})
    world.publish("jobs/a", "late", qos=1)
    world.route()
    # Then only the later one reaches it
    assert texts(world.drain(CLIENT, channel)) == ["late"]


@pytest.mark.parametrize(
    ("retain_handling", "expected"),
    [(0, [("kept", True)]), (1, [("kept", True)]), (2, [])],
)
@pytest.mark.parametrize("routed_before", [False, True], ids=["router-behind", "router-ran"])
def test_a_retained_message_comes_only_as_retain_handling_asks(
    world: World, retain_handling: int, expected: list[tuple[str, bool]], routed_before: bool
) -> None:
    # Given a retained message and a plain one, both published before the subscribe
    world.publish("r/a", "kept", retain=True)
    world.publish("r/b", "plain")
    channel = connected(world)
    if routed_before:
        world.route()
    # When a new subscription is made and the router catches up
    wanted = {"filter": "r/#", "qos": 1, "retain_handling": retain_handling}
    world.subscribe(CLIENT, channel, wanted)
    world.route()
    # Then the retained one came as retained (or not at all), never routed; the plain one never
    assert kinds(world.drain(CLIENT, channel)) == expected
    # and a message published after the subscribe is routed
    world.publish("r/a", "later", retain=True)
    world.route()
    assert kinds(world.drain(CLIENT, channel)) == [("later", False)]


def test_subscribing_again_never_takes_back_what_the_subscription_was_due(world: World) -> None:
    # Given a subscription and a message published after it, not routed yet
    channel = connected(world)
    world.subscribe(CLIENT, channel, {"filter": "jobs/#", "qos": 1})
    world.publish("jobs/a", "due")
    # When the same filter is subscribed again (new options) before the router runs
    world.subscribe(CLIENT, channel, {"filter": "jobs/#", "qos": 2})
    world.route()
    # Then the message still reaches it: the subscription's start did not move
    assert texts(world.drain(CLIENT, channel)) == ["due"]


def test_a_resumed_session_keeps_its_subscriptions_start(world: World) -> None:
    # Given a subscription, then a message published while the session is away
    channel = connected(world)
    world.subscribe(CLIENT, channel, {"filter": "jobs/#", "qos": 1})
    world.disconnect(CLIENT, channel)
    world.publish("jobs/a", "while-away")
    # When the session resumes and the router runs
    channel = connected(world)
    world.route()
    # Then the message is there
    assert texts(world.drain(CLIENT, channel)) == ["while-away"]


def test_the_cut_holds_across_add_storage_topic_and_switch_produce(world: World) -> None:
    world.topic("orders", 1)
    # Given a message in T0, a switch, a message in T1, all before the subscribe
    world.publish("orders/eu", "early-t0")
    switch("orders", 1)
    world.publish("orders/eu", "early-t1")
    channel = connected(world)
    # When the session subscribes, a message follows in T1, and the router runs
    world.subscribe(CLIENT, channel, {"filter": "orders/#", "qos": 1})
    world.publish("orders/eu", "late")
    world.route()
    # Then only the later one reaches it
    assert texts(world.drain(CLIENT, channel)) == ["late"]


@pytest.mark.parametrize("skew_ms", [-BOUND_MS, 0, BOUND_MS], ids=["behind", "equal", "ahead"])
def test_within_the_skew_bound_the_cut_is_exact_on_both_sides(world: World, skew_ms: int) -> None:
    # Given the stream's clock off the functions' by up to the bound
    world.stream_skew_ms = skew_ms
    world.publish("jobs/a", "before")
    channel = connected(world)
    # When the session subscribes and a publish is called right after the subscribe returned
    world.subscribe(CLIENT, channel, {"filter": "jobs/#", "qos": 1})
    world.publish("jobs/a", "after")
    world.route()
    # Then the earlier message never reaches it and the later one always does
    assert texts(world.drain(CLIENT, channel)) == ["after"]


def test_the_subscribe_waits_out_twice_the_bound_before_it_returns(world: World) -> None:
    channel = connected(world)
    began = world.clock.now_ms()
    world.subscribe(CLIENT, channel, {"filter": "jobs/#", "qos": 1})
    # the cut is the start + the bound; a publish after the return must arrive past it even
    # when the stream's clock is the bound behind
    assert world.clock.now_ms() - began >= 2 * BOUND_MS + 1
    # subscribing again keeps the cut, so it does not wait again
    again = world.clock.now_ms()
    world.subscribe(CLIENT, channel, {"filter": "jobs/#", "qos": 2})
    assert world.clock.now_ms() == again


def test_beyond_the_bound_the_promise_is_not_kept(world: World) -> None:
    """Why the bound matters: a stream clock further behind than it puts a publish made after
    the subscribe returned before the cut (the deployment must set a true bound)."""
    world.stream_skew_ms = -(BOUND_MS + 2)
    channel = connected(world)
    world.subscribe(CLIENT, channel, {"filter": "jobs/#", "qos": 1})
    world.publish("jobs/a", "after")
    world.route()
    assert world.drain(CLIENT, channel) == []


# --- shared groups ------------------------------------------------------------------------------


@pytest.mark.parametrize("routed_before", [False, True], ids=["router-behind", "router-ran"])
def test_a_new_group_gets_nothing_published_before_it_was_made(
    gworld: GroupWorld, routed_before: bool
) -> None:
    # Given a retained job and a plain one, published before the group existed
    gworld.publish("jobs/r", "retained-1", retain=True, qos=1)
    gworld.publish("jobs/r", "plain-1", qos=1)
    channel = connected(gworld)
    if routed_before:
        gworld.route()
    # When a worker joins (creating the group), and a job is published after
    gworld.subscribe(CLIENT, channel, {"filter": "$share/rr/jobs/r", "qos": 1})
    gworld.publish("jobs/r", "job-2", qos=1)
    gworld.route()
    # Then the worker gets only the later job, and no retained copy
    assert kinds(gworld.drain(CLIENT, channel)) == [("job-2", False)]


def test_a_later_member_gets_what_the_group_was_due_before_it_joined(gworld: GroupWorld) -> None:
    # Given a group whose only member is away, and a job published while the group exists
    first = connected(gworld, "alice-a")
    gworld.subscribe("alice-a", first, {"filter": "$share/rr/jobs/r", "qos": 1})
    gworld.disconnect("alice-a", first)
    gworld.publish("jobs/r", "job-1", qos=1)
    # When a second member joins after the publish, and the router runs
    second = connected(gworld, "alice-b")
    gworld.subscribe("alice-b", second, {"filter": "$share/rr/jobs/r", "qos": 1})
    gworld.route()
    gworld.clock.advance(11)  # the away member's lease times out
    gworld.heartbeat("alice-b", second)
    # Then the job still reaches the group: the group's start, not the member's, counts
    got = gworld.drain("alice-b", second)
    assert texts(got) == ["job-1"]
