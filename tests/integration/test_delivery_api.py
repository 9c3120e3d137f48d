"""Subscribe, unsubscribe, get and ack through their handlers, with the router in between."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest
from shoal.core.config import get_config
from shoal.delivery.inbox import InboxStore
from shoal.delivery.model import MAX_INLINE_PAYLOAD, MAX_POLL_INTERVAL_S, STATE, source_id
from shoal.delivery.subscriptions import SubscriptionRetirer
from shoal.sessions.reaper import Reaper

import functions.messages.app as messages_app
import functions.sessions.app as sessions_app
import functions.subscriptions.app as subscriptions_app
from bench.cost import ReadUnits
from tests.helpers import FakeContext, load_event, response_json
from tests.integration.test_delivery_support import BOB, World, texts, world
from tests.integration.test_sessions_support import RecordingPublisher
from tests.unit.test_openapi import spec

__all__ = ["world"]  # fixture

CLIENT = "alice-1"


def connected(world: World, client_id: str = CLIENT, **body: Any) -> str:
    body.setdefault("clean_start", False)
    body.setdefault("session_expiry_s", 3600)
    return world.connect(client_id, **body)


# --- subscribe


def test_subscribe_grants_one_qos_or_code_per_filter(world: World) -> None:
    channel = connected(world, "bob-1", claims=BOB)
    granted = world.subscribe(
        "bob-1",
        channel,
        {"filter": "sensors/+/temp", "qos": 1},
        {"filter": "orders/eu/#", "qos": 2},
        {"filter": "sensors/#", "qos": 1},  # wider than sensors/+/temp
        {"filter": "a/#/b", "qos": 0},
        {"filter": "$share/g/orders/#", "qos": 1},
        claims=BOB,
    )
    assert granted == [1, 2, "not_authorized", "invalid_filter", 1]
    status, session = world.call(sessions_app.handler, "GET", "bob-1", channel=channel, claims=BOB)
    assert status == 200
    assert [s["filter"] for s in session["subscriptions"]] == [
        "$share/g/orders/#",
        "orders/eu/#",
        "sensors/+/temp",
    ]


def test_a_request_of_only_invalid_filters_is_refused_and_changes_nothing(world: World) -> None:
    channel = connected(world)
    status, body = world.subscribe_call(CLIENT, channel, "a/#/b", "$share//x")
    assert (status, body["error"]["code"]) == (400, "invalid_filter")
    # and the message names the rule the first filter breaks (MQTT 5 §4.7.1)
    assert body["error"]["message"] == (
        "'a/#/b': '#' must be the last level of a filter, on its own (as in 'a/#') [MQTT-4.7.1-1]"
    )
    assert world.store.versions(["L:a", "W"]) == {"L:a": 0, "W": 0}


def test_subscribe_needs_the_live_channel(world: World) -> None:
    old = connected(world)
    world.clock.advance(1)
    connected(world)
    status, body = world.subscribe_call(CLIENT, old, "a/#")
    assert (status, body["error"]["code"]) == (409, "session_taken_over")


def test_a_subscription_made_before_a_publish_returns_gets_that_message(world: World) -> None:
    # Given a router that has already routed (its view of subscriptions is cached)
    channel = connected(world)
    world.subscribe(CLIENT, channel, "warmup")
    world.publish("warmup", "w")
    world.route()
    # When, many times over, a new subscription is made and a message published at once
    for n in range(25):
        world.subscribe(CLIENT, channel, f"fresh/{n}/#")
        world.publish(f"fresh/{n}/x", f"m{n}")
        world.route()
    # Then every one of them arrived
    got = world.drain(CLIENT, channel)
    assert texts(got) == ["w", *[f"m{n}" for n in range(25)]]


# --- fan-out semantics


def test_overlapping_subscriptions_deliver_once_with_the_highest_qos(world: World) -> None:
    channel = connected(world)
    world.subscribe(
        CLIENT,
        channel,
        {"filter": "sensors/#", "qos": 0},
        {"filter": "sensors/+/temp", "qos": 2},
        {"filter": "sensors/kitchen/temp", "qos": 1},
    )
    world.publish("sensors/kitchen/temp", "21", qos=2)
    world.publish("sensors/kitchen/door", "open", qos=2)
    world.route()
    got = world.get(CLIENT, channel)
    assert [(m["topic"], m["qos"], m["subscription"]) for m in got] == [
        ("sensors/kitchen/temp", 2, "sensors/+/temp"),
        ("sensors/kitchen/door", 0, "sensors/#"),
    ]


def test_granted_qos_is_the_lower_of_subscription_and_message(world: World) -> None:
    channel = connected(world)
    world.subscribe(CLIENT, channel, {"filter": "q/#", "qos": 1})
    for qos in (0, 1, 2):
        world.publish("q/x", str(qos), qos=qos)
    world.route()
    assert [m["qos"] for m in world.get(CLIENT, channel)] == [0, 1, 1]


def test_two_sessions_each_get_every_matching_message(world: World) -> None:
    a = connected(world, "alice-a")
    b = connected(world, "bob-1", claims=BOB)
    world.subscribe("alice-a", a, "sensors/#")
    world.subscribe("bob-1", b, "sensors/+/temp", claims=BOB)
    world.publish("sensors/1/temp", "t")
    world.publish("sensors/1/hum", "h")
    world.route()
    assert texts(world.drain("alice-a", a)) == ["t", "h"]
    assert texts(world.drain("bob-1", b, claims=BOB)) == ["t"]


def test_messages_of_one_ordering_key_arrive_in_publish_order(world: World) -> None:
    # Given a topic of 4 partitions and keys spread over them, published interleaved
    world.topic("orders", 4)
    channel = connected(world)
    world.subscribe(CLIENT, channel, "orders/#")
    for n in range(40):
        world.publish(f"orders/{n % 3}", f"{n % 5}:{n}", ordering_key=f"k{n % 5}")
        if n % 7 == 0:
            world.route()
    world.route()
    # Then per key the session sees publish order, and every message once
    got = texts(world.drain(CLIENT, channel))
    assert len(got) == 40
    for key in range(5):
        seen = [int(t.split(":")[1]) for t in got if t.startswith(f"{key}:")]
        assert seen == sorted(seen) and len(seen) == 8


def test_expired_messages_are_not_delivered(world: World) -> None:
    channel = connected(world)
    world.subscribe(CLIENT, channel, "e/#")
    world.publish("e/1", "short", properties={"message_expiry_s": 5})
    world.publish("e/2", "long", properties={"message_expiry_s": 600})
    world.route()
    world.clock.advance(10)
    got = world.get(CLIENT, channel)
    # Then the expired one is dropped, and the other says how long it has left
    assert texts(got) == ["long"]
    assert got[0]["properties"]["message_expiry_s"] == 590


def test_no_local_skips_the_sessions_own_publishes(world: World) -> None:
    channel = connected(world)
    world.subscribe(CLIENT, channel, {"filter": "chat/#", "qos": 1, "no_local": True})
    world.publish("chat/room", "mine", publisher_id=CLIENT, publisher_seq=1)
    world.publish("chat/room", "theirs", publisher_id="alice-2", publisher_seq=1)
    world.route()
    assert texts(world.get(CLIENT, channel)) == ["theirs"]


def test_large_payloads_are_delivered_from_the_archive(world: World) -> None:
    channel = connected(world)
    world.subscribe(CLIENT, channel, "big")
    payload = bytes(range(256)) * (MAX_INLINE_PAYLOAD // 128)
    world.publish("big", payload=base64.b64encode(payload).decode(), text=None)
    world.route()
    (got,) = world.get(CLIENT, channel)
    assert base64.b64decode(got["payload"]) == payload


# --- get and ack


def test_unacked_qos1_comes_again_with_dup_after_the_ack_timeout(world: World) -> None:
    channel = connected(world)
    world.subscribe(CLIENT, channel, "r/#")
    world.publish("r/1", "one", qos=1)
    world.publish("r/0", "zero", qos=0)
    world.route()
    first = world.get(CLIENT, channel)
    assert [(m["qos"], m["dup"]) for m in first] == [(1, False), (0, False)]
    # Before the timeout nothing comes again
    world.clock.advance(29)
    assert world.get(CLIENT, channel) == []
    # After it the QoS 1 message comes again, same id, dup; the QoS 0 one never does
    world.clock.advance(2)
    again = world.get(CLIENT, channel)
    assert [(m["id"], m["dup"]) for m in again] == [(first[0]["id"], True)]
    # Once acked it never comes again
    assert world.ack(CLIENT, channel, [first[0]["id"]]) == (200, {"acked": 1})
    world.clock.advance(60)
    assert world.get(CLIENT, channel) == []
    assert world.ack(CLIENT, channel, [first[0]["id"]]) == (200, {"acked": 0})


def test_acks_out_of_order_free_the_window(world: World) -> None:
    # Given a window of 3 unacked deliveries
    world.settings = world.delivery.settings = world.settings.model_copy(update={"window": 3})
    channel = connected(world)
    world.subscribe(CLIENT, channel, "w/#")
    for n in range(6):
        world.publish("w/x", str(n))
    world.route()
    first = world.get(CLIENT, channel, 10)
    assert texts(first) == ["0", "1", "2"]
    assert world.get(CLIENT, channel, 10) == []
    # When the last of them is acked, Then one more comes
    world.ack(CLIENT, channel, [first[2]["id"]])
    assert texts(world.get(CLIENT, channel, 10)) == ["3"]
    # And after the timeout only the unacked ones come again, in order
    world.clock.advance(31)
    assert texts(world.get(CLIENT, channel, 10)) == ["0", "1", "3"]


def test_the_session_document_counts_the_deliveries_in_flight(world: World) -> None:
    # Given three QoS 1 deliveries and one QoS 0 handed out
    channel = connected(world)
    world.subscribe(CLIENT, channel, "f/#")
    for n in range(3):
        world.publish("f/x", str(n))
    world.publish("f/x", "q0", qos=0)
    world.route()
    handed = world.get(CLIENT, channel, 10)
    assert len(handed) == 4

    def in_flight() -> int:
        status, body = world.call(sessions_app.handler, "GET", CLIENT, channel=channel)
        assert status == 200
        return int(body["in_flight"])

    # Then the three QoS 1 wait for their ack (QoS 0 is done as it goes out)
    assert in_flight() == 3
    # When one is acked, Then two are left
    world.ack(CLIENT, channel, [handed[1]["id"]])
    assert in_flight() == 2


def test_get_answers_at_most_max_and_resumes_where_it_stopped(world: World) -> None:
    channel = connected(world)
    world.subscribe(CLIENT, channel, "p/#")
    world.publish_batch([{"topic": "p/x", "text": str(n), "ordering_key": "k"} for n in range(7)])
    world.route()
    assert texts(world.get(CLIENT, channel, 3)) == ["0", "1", "2"]
    assert texts(world.get(CLIENT, channel, 3)) == ["3", "4", "5"]
    assert texts(world.get(CLIENT, channel, 3)) == ["6"]


def test_a_long_poll_returns_what_arrives_while_it_waits(world: World) -> None:
    channel = connected(world)
    world.subscribe(CLIENT, channel, "lp")
    world.publish("lp", "late")
    advance = world.clock.sleep
    routed: list[int] = []

    def sleep(seconds: float) -> None:
        advance(seconds)
        if not routed:
            routed.append(world.route())

    world.clock.sleep = sleep  # type: ignore[method-assign]
    started = world.clock.now_ms()
    got = world.get(CLIENT, channel, wait_ms=5000)
    assert texts(got) == ["late"]
    assert world.clock.now_ms() - started < 5000
    # And with nothing to come it gives up at the deadline
    assert world.get(CLIENT, channel, wait_ms=3000) == []


def test_an_idle_long_poll_looks_for_the_partitions_first_item_once(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long poll's first read finds the session's first inbox item (consumed: items stay
    until TTL) and jumps to its source's cursor; its polls again start at that cursor, not
    with the query that would find the same item again (up to 16 read units each), and still
    find what arrives while it waits."""
    channel = connected(world)
    world.subscribe(CLIENT, channel, "q/#")
    world.publish_batch(
        [{"topic": "q/x", "text": str(n), "ordering_key": f"k{n}"} for n in range(6)]
    )
    world.route()
    got = world.get(CLIENT, channel, 10)
    assert world.ack(CLIENT, channel, [m["id"] for m in got])[0] == 200
    lower_bounds: list[str] = []
    real = InboxStore.after

    def after(self: InboxStore, session_id: str, key: str, **kw: Any) -> Any:
        lower_bounds.append(key)
        return real(self, session_id, key, **kw)

    monkeypatch.setattr(InboxStore, "after", after)
    assert world.get(CLIENT, channel, wait_ms=5000) == []
    polls = lower_bounds.count(STATE) + sum(1 for k in lower_bounds if k != STATE)
    assert lower_bounds.count(STATE) == 1 and polls > 5
    # what arrives meanwhile is found by a poll that started at the cursor
    lower_bounds.clear()

    def late() -> None:
        world.publish("q/x", "late", ordering_key="k0")
        world.route()

    _on_third_sleep(world, late)
    assert texts(world.get(CLIENT, channel, wait_ms=5000)) == ["late"]
    assert lower_bounds.count(STATE) == 1


def _on_third_sleep(world: World, act: Callable[[], None]) -> None:
    """The world's clock runs ``act`` once, at its third sleep (a long poll's wait)."""
    advance = world.clock.sleep
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        advance(seconds)
        slept.append(seconds)
        if len(slept) == 3:
            act()

    world.clock.sleep = sleep  # type: ignore[method-assign]


def _source(world: World, topic: str) -> str:
    """The inbox source of a one-partition composite topic (its storage stream's one shard)."""
    stream = world.harness.topic(topic).storage_topics[0].stream
    return source_id(stream, world.harness.shards(stream)[0]["ShardId"])


@pytest.mark.parametrize("late_sorts", ["before", "after"])
def test_a_long_poll_finds_a_delivery_of_another_source_within_its_schedule(
    world: World, late_sorts: str
) -> None:
    """Issue 48: a poll's re-reads must see every source, also one that sorts before the
    source of the session's first inbox item and had no item when the poll began."""
    # Given a session subscribed to two composite topics (two inbox sources), which sort one
    # way or the other
    world.topic("alpha")
    world.topic("beta")
    low, high = sorted(["alpha", "beta"], key=lambda t: _source(world, t))
    early, late = (high, low) if late_sorts == "before" else (low, high)
    channel = connected(world)
    world.subscribe(CLIENT, channel, "alpha/#", "beta/#")
    # And it got and acked a message of one of them
    world.publish(f"{early}/x", "early")
    world.route()
    got = world.get(CLIENT, channel, 10)
    assert texts(got) == ["early"]
    assert world.ack(CLIENT, channel, [m["id"] for m in got])[0] == 200
    # When it long-polls, and a message of the other topic is routed during the wait
    advance = world.clock.sleep
    routed_at: list[int] = []

    def sleep(seconds: float) -> None:
        advance(seconds)
        if not routed_at and world.clock.now_ms() >= 1500 + started:
            world.publish(f"{late}/x", "late")
            world.route()
            routed_at.append(world.clock.now_ms())

    world.clock.sleep = sleep  # type: ignore[method-assign]
    started = world.clock.now_ms()
    got = world.get(CLIENT, channel, wait_ms=20000)
    # Then the poll answers it, at most one re-read interval after it was written
    assert texts(got) == ["late"]
    assert world.clock.now_ms() - routed_at[0] <= MAX_POLL_INTERVAL_S * 1000


def _consumed(world: World, topics: list[str], rounds: int) -> str:
    """A session subscribed to ``topics`` (one source each) whose inbox holds ``rounds``
    consumed items of each; its channel."""
    channel = connected(world)
    world.subscribe(CLIENT, channel, *[f"{t}/#" for t in topics])
    for round_ in range(rounds):
        for topic in topics:
            world.publish(f"{topic}/x", f"{round_}")
        world.route()
        world.drain(CLIENT, channel)
    return channel


def _idle_poll_read_units(world: World, topics: list[str]) -> float:
    """The read units, as DynamoDB bills them, of a 20 s long poll that finds nothing, by a
    session whose inbox holds consumed items of ``topics`` (one source each)."""
    channel = _consumed(world, topics, 3)
    meter = ReadUnits()
    meter.attach(world.inbox.dynamo.client)
    assert world.get(CLIENT, channel, wait_ms=20000) == []
    return meter.units


def test_an_idle_20_s_long_poll_costs_what_it_cost_before_it_saw_every_source(
    world: World,
) -> None:
    """Issue 48: within 10 % of the 28 read units it cost before (bench/RESULTS.md, fleet),
    whose re-reads saw only the sources from the first one's on."""
    # Given a session whose inbox holds consumed items of one source
    # When it long-polls 20 s and nothing comes
    units = _idle_poll_read_units(world, ["default"])
    # Then its reads cost at most 28 units and 10 %
    assert units <= 28 * 1.1


def test_an_idle_long_polls_looks_are_half_price_reads(world: World) -> None:
    """With two sources an idle poll reads three key ranges: before the first source, after
    each cursor. Looks eventually consistent (half a unit each), it costs less than the two
    strongly consistent queries a poll it made before, which saw fewer sources."""
    world.topic("alpha")
    # Given a session whose inbox holds consumed items of two sources
    # When it long-polls 20 s and nothing comes
    units = _idle_poll_read_units(world, ["default", "alpha"])
    # Then: two reads of its head and state, the first scan's three queries, and 24 polls of
    # three half-unit looks
    assert units == 2 + 3 + 24 * 1.5


def test_an_idle_long_polls_looks_ask_for_one_item_a_query(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A look asks only whether anything is new. In an idle inbox each of its queries finds the
    next source's first consumed item and jumps to that source's cursor, so it asks for one
    item: a page (up to 16) was read, copied and parsed to drop all but the first, once per
    source a look. What comes during the wait is still found, and read as a page to hand out."""
    world.topic("alpha")
    world.topic("beta")
    # Given a session whose inbox holds several consumed items of three sources
    channel = _consumed(world, ["default", "alpha", "beta"], 5)
    looks: list[tuple[int, int]] = []
    pages: list[int] = []
    real = InboxStore.after

    def after(self: InboxStore, session_id: str, key: str, **kw: Any) -> Any:
        found = real(self, session_id, key, **kw)
        if kw.get("consistent", True):
            pages.append(kw["limit"])
        else:
            looks.append((kw["limit"], len(found)))
        return found

    monkeypatch.setattr(InboxStore, "after", after)
    # When it long-polls and nothing comes
    assert world.get(CLIENT, channel, wait_ms=5000) == []
    # Then every look's query asked for one item and read at most one
    assert len(looks) > 10
    assert {limit for limit, _ in looks} == {1}
    assert max(n for _, n in looks) == 1
    # And what comes during a wait is found, then handed out by the consistent walk's pages
    looks.clear()
    advance = world.clock.sleep

    def sleep(seconds: float) -> None:
        advance(seconds)
        if len(looks) == 6:
            for n in range(3):
                world.publish("beta/x", f"late{n}", ordering_key="k")
            world.route()

    world.clock.sleep = sleep  # type: ignore[method-assign]
    assert texts(world.get(CLIENT, channel, wait_ms=5000)) == ["late0", "late1", "late2"]
    assert {limit for limit, _ in looks} == {1}
    assert max(pages) > 1


def test_get_and_ack_need_the_live_channel(world: World) -> None:
    old = connected(world)
    world.subscribe(CLIENT, old, "x")
    world.clock.advance(1)
    connected(world)
    assert world.get_call(CLIENT, old)[1]["error"]["code"] == "session_taken_over"
    assert world.ack(CLIENT, old, [])[1]["error"]["code"] == "session_taken_over"


def test_gets_and_acks_keep_the_channel_alive_without_heartbeats(world: World) -> None:
    """MQTT 5 §3.1.2.10: any packet of the client counts for its keepalive. A client that
    only long-polls and acks (the messages function) is not expired at 1.5 keepalives."""
    channel = connected(world, keepalive_s=10)
    world.subscribe(CLIENT, channel, "k/#")
    reaper = Reaper(world.registry.repository, RecordingPublisher(), world.clock)
    for _ in range(4):
        world.clock.advance(6)
        world.get(CLIENT, channel)
        assert world.ack(CLIENT, channel, [])[0] == 200
        assert reaper.run().channels_expired == 0
    # 24 s after the connect (its grace was 15 s): live; silent 16 s more, expired
    world.clock.advance(16)
    assert reaper.run().channels_expired == 1


def test_bad_query_parameters_are_refused(world: World) -> None:
    channel = connected(world)
    status, body = world.call(
        messages_app.handler,
        "GET",
        CLIENT,
        "/messages",
        channel=channel,
        query={"max": "many"},
    )
    assert (status, body["error"]["code"]) == (400, "invalid_request")


# --- unsubscribe


def test_unsubscribing_drops_the_subscriptions_undelivered_messages(world: World) -> None:
    channel = connected(world)
    world.subscribe(CLIENT, channel, "u/#", "keep/#")
    world.publish("u/1", "dropped")
    world.publish("keep/1", "kept")
    world.route()
    assert world.unsubscribe(CLIENT, channel, "u/#", "never") == (
        200,
        {"unsubscribed": ["success", "no_subscription_existed"]},
    )
    # When it subscribes again, Then the old undelivered message does not come back
    world.subscribe(CLIENT, channel, "u/#")
    world.publish("u/2", "new")
    world.route()
    assert texts(world.drain(CLIENT, channel)) == ["kept", "new"]
    # And the router no longer delivers for the dropped one
    world.unsubscribe(CLIENT, channel, "u/#")
    world.publish("u/3", "after")
    world.route()
    assert world.drain(CLIENT, channel) == []


# --- retained messages


def test_retained_messages_follow_retain_handling(world: World) -> None:
    world.publish("home/lamp", "on", retain=True)
    world.publish("home/door", "shut", retain=True, qos=0)
    world.publish("other/x", "no", retain=True)
    channel = connected(world)
    # retain_handling 0: sent; with the retain flag; granted QoS min(sub, message)
    world.subscribe(CLIENT, channel, {"filter": "home/+", "qos": 1, "retain_handling": 0})
    got = world.get(CLIENT, channel)
    assert sorted((m["topic"], m["retain"], m["qos"]) for m in got) == [
        ("home/door", True, 0),
        ("home/lamp", True, 1),
    ]
    world.ack(CLIENT, channel, [m["id"] for m in got])
    # retain_handling 1: only for a new subscription
    world.subscribe(CLIENT, channel, {"filter": "home/+", "qos": 1, "retain_handling": 1})
    assert world.get(CLIENT, channel) == []
    world.subscribe(CLIENT, channel, {"filter": "home/lamp", "qos": 1, "retain_handling": 1})
    assert texts(world.get(CLIENT, channel)) == ["on"]
    # retain_handling 2: never; nor for shared subscriptions
    world.subscribe(CLIENT, channel, {"filter": "#", "qos": 1, "retain_handling": 2})
    world.subscribe(CLIENT, channel, {"filter": "$share/g/home/#", "qos": 1})
    world.clock.advance(31)
    assert texts(world.get(CLIENT, channel)) == ["on"]  # only the unacked redelivery


def test_live_messages_carry_no_retain_flag_and_clearing_stops_retained(world: World) -> None:
    channel = connected(world)
    world.subscribe(CLIENT, channel, "t")
    world.publish("t", "v1", retain=True)
    world.route()
    assert [m["retain"] for m in world.drain(CLIENT, channel)] == [False]
    world.publish("t", "", retain=True)  # clears it
    other = connected(world, "alice-2")
    world.subscribe("alice-2", other, "t")
    assert world.get("alice-2", other) == []


# --- sessions: offline, takeover, clean start, expiry


def test_an_offline_session_accumulates_and_gets_everything_on_reconnect(world: World) -> None:
    channel = connected(world)
    world.subscribe(CLIENT, channel, "o/#")
    world.disconnect(CLIENT, channel)
    for n in range(5):
        world.publish("o/x", str(n))
    world.route()
    world.clock.advance(60)
    again = connected(world)
    assert texts(world.drain(CLIENT, again)) == ["0", "1", "2", "3", "4"]


def test_takeover_hands_undelivered_and_unacked_messages_to_the_new_channel(world: World) -> None:
    first = connected(world)
    world.subscribe(CLIENT, first, "k/#")
    for n in range(4):
        world.publish("k/x", str(n))
    world.route()
    delivered = world.get(CLIENT, first, 2)
    assert texts(delivered) == ["0", "1"]
    # When another channel takes the session over (no ack timeout has passed)
    world.clock.advance(1)
    second = connected(world)
    # Then it gets the unacked ones again at once (dup, same ids), then the rest
    got = world.get(CLIENT, second, 10)
    assert [(m["id"], m["dup"]) for m in got[:2]] == [(m["id"], True) for m in delivered]
    assert texts(got) == ["0", "1", "2", "3"]
    assert [m["dup"] for m in got[2:]] == [False, False]


def test_clean_start_discards_the_inbox(world: World) -> None:
    first = connected(world)
    world.subscribe(CLIENT, first, "c/#")
    world.publish("c/x", "old")
    world.route()
    world.clock.advance(1)
    second = connected(world, clean_start=True)
    assert world.get(CLIENT, second) == []
    # and the old session's subscription no longer delivers to the new session
    world.publish("c/x", "new")
    world.route()
    assert world.get(CLIENT, second) == []


def test_an_expired_session_keeps_nothing(world: World) -> None:
    first = connected(world, session_expiry_s=60)
    world.subscribe(CLIENT, first, "x/#")
    world.publish("x/1", "m")
    world.route()
    world.disconnect(CLIENT, first)
    world.clock.advance(61)
    second = connected(world)
    assert world.get(CLIENT, second) == []


@pytest.mark.parametrize("qos", [1, 2])
def test_acked_ids_never_come_again_across_a_takeover(world: World, qos: int) -> None:
    first = connected(world)
    world.subscribe(CLIENT, first, {"filter": "z", "qos": qos})
    world.publish("z", "a", qos=qos)
    world.publish("z", "b", qos=qos)
    world.route()
    got = world.get(CLIENT, first)
    world.ack(CLIENT, first, [got[0]["id"]])
    world.clock.advance(1)
    second = connected(world)
    assert texts(world.get(CLIENT, second)) == ["b"]


# --- the sample events and the contract


def sample(name: str, channel: str, **changes: Any) -> dict[str, Any]:
    event = load_event(name)
    event["headers"]["shoal-channel"] = channel
    event.update(changes)
    return event


def test_sample_events_answer_as_the_openapi_document_says(world: World) -> None:
    # Given sensor-1 connected as the sample events' principal
    claims = load_event("subscriptions_subscribe.json")["requestContext"]["authorizer"]["jwt"][
        "claims"
    ]
    channel = world.connect("sensor-1", claims=claims)
    answer = subscriptions_app.handler(
        sample("subscriptions_subscribe.json", channel), FakeContext()
    )
    assert answer["statusCode"] == 200
    jsonschema.validate(response_json(answer), operation_schema("/subscriptions", "post"))
    assert response_json(answer) == {"granted": [1, 2]}
    world.publish("sensors/1/temp", "20", properties={"content_type": "text/plain"})
    world.route()
    got = messages_app.handler(sample("messages_get.json", channel), FakeContext())
    body = response_json(got)
    jsonschema.validate(body, operation_schema("/messages", "get"))
    assert [m["topic"] for m in body["messages"]] == ["sensors/1/temp"]
    ack = sample(
        "messages_ack.json", channel, body=json.dumps({"ids": [body["messages"][0]["id"]]})
    )
    acked = messages_app.handler(ack, FakeContext())
    assert response_json(acked) == {"acked": 1}
    jsonschema.validate(response_json(acked), operation_schema("/acks", "post"))
    gone = subscriptions_app.handler(
        sample("subscriptions_unsubscribe.json", channel), FakeContext()
    )
    assert response_json(gone) == {"unsubscribed": ["success"]}
    jsonschema.validate(response_json(gone), operation_schema("/unsubscribe", "post"))


def operation_schema(suffix: str, method: str) -> dict[str, Any]:
    document = spec()
    operation = document["paths"][f"/v1/sessions/{{client_id}}{suffix}"][method]
    answer = operation["responses"]["200"]["content"]["application/json"]["schema"]
    return {**answer, "components": document["components"]}


# --- ended sessions leave the router's store


def stored_subscriptions(world: World) -> list[tuple[str, str]]:
    table = world.session.resource("dynamodb").Table(get_config().table("subscriptions"))
    items = table.scan(ConsistentRead=True)["Items"]
    return sorted(
        (str(i["client_id"]), str(i["filter"])) for i in items if str(i["item"]).startswith("s#")
    )


def test_a_clean_start_removes_the_old_sessions_subscriptions(world: World) -> None:
    first = connected(world)
    world.subscribe(CLIENT, first, "old/#", "both/#")
    world.clock.advance(1)
    second = connected(world, clean_start=True)
    assert stored_subscriptions(world) == []
    # and what the new session subscribes stays, even under a filter the old one had
    world.subscribe(CLIENT, second, "both/#")
    world.clock.advance(1)
    connected(world, clean_start=False)
    assert stored_subscriptions(world) == [(CLIENT, "both/#")]


def test_the_reaper_removes_an_expired_sessions_subscriptions(world: World) -> None:
    channel = connected(world, session_expiry_s=60)
    world.subscribe(CLIENT, channel, "r/#")
    world.disconnect(CLIENT, channel)
    world.clock.advance(61)
    reaper = Reaper(
        world.registry.repository,
        RecordingPublisher(),
        world.clock,
        on_session_end=SubscriptionRetirer(world.store, world.clock),
    )
    assert reaper.run().sessions_ended == 1
    assert stored_subscriptions(world) == []


def test_redelivery_respects_max_and_keeps_ids_and_order(world: World) -> None:
    channel = connected(world)
    world.subscribe(CLIENT, channel, "s/#")
    world.publish_batch([{"topic": "s/x", "text": str(n), "ordering_key": "k"} for n in range(5)])
    world.route()
    first = world.get(CLIENT, channel, 10)
    world.ack(CLIENT, channel, [first[1]["id"]])
    # When the ack timeout passes, Then the unacked ones come again, max at a time, in order
    world.clock.advance(31)
    part = world.get(CLIENT, channel, 2)
    rest = world.get(CLIENT, channel, 10)
    assert [m["id"] for m in part + rest] == [first[n]["id"] for n in (0, 2, 3, 4)]
    assert all(m["dup"] for m in part + rest)
    # and a part handed out again later waits for its own timeout
    world.clock.advance(31)
    assert len(world.get(CLIENT, channel, 10)) == 4


def test_overlapping_new_subscriptions_get_a_retained_message_once(world: World) -> None:
    world.publish("r/a", "kept", retain=True, qos=2)
    channel = connected(world)
    world.subscribe(CLIENT, channel, {"filter": "r/#", "qos": 0}, {"filter": "r/+", "qos": 2})
    got = world.get(CLIENT, channel)
    assert [(m["topic"], m["qos"], m["subscription"]) for m in got] == [("r/a", 2, "r/+")]


def test_a_session_holds_a_bounded_number_of_subscriptions(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("shoal.delivery.subscriptions.MAX_SUBSCRIPTIONS_PER_SESSION", 2)
    channel = connected(world)
    assert world.subscribe(CLIENT, channel, "a", "b", "c", "a") == [2, 2, "quota_exceeded", 2]


def test_a_get_past_many_consumed_items_reads_one_of_them_to_find_its_cursor(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a session whose inbox holds 12 consumed items (one per routed batch; they stay
    # until TTL)
    channel = connected(world)
    world.subscribe(CLIENT, channel, "old/#")
    for n in range(12):
        world.publish("old/x", f"m{n}")
        world.route()
    assert len(world.drain(CLIENT, channel)) == 12
    # and one new message
    world.publish("old/x", "new")
    world.route()
    read: list[int] = []
    after = world.inbox.after

    def counted(*args: Any, **kwargs: Any) -> Any:
        items = after(*args, **kwargs)
        read.append(len(items))
        return items

    monkeypatch.setattr(world.inbox, "after", counted)
    # When the session gets
    got = world.get(CLIENT, channel)
    # Then it gets the new message, having read one consumed item to learn where to jump, then
    # the new one (a query is billed for every item it reads, up to 64 KB each)
    assert texts(got) == ["new"]
    assert read[:2] == [1, 1] and sum(read) == 2


def test_a_long_polls_walk_after_a_look_starts_at_the_source_the_look_found_new(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A look walks every source, eventually consistent, and finds the new message in one of
    them; the consistent walk that hands it out starts at that source's cursor, not at the
    partition's first item: the sources before it were just looked at and had nothing."""
    topics = ["alpha", "beta", "gamma"]
    for topic in topics:
        world.topic(topic)
    # Given a session whose inbox holds consumed items of three sources
    channel = _consumed(world, topics, 3)
    ordered = sorted(topics, key=lambda t: _source(world, t))
    last = ordered[-1]
    walked: list[str] = []
    looked: list[str] = []
    real = InboxStore.after

    def after(self: InboxStore, session_id: str, key: str, **kw: Any) -> Any:
        (walked if kw.get("consistent", True) else looked).append(key)
        return real(self, session_id, key, **kw)

    monkeypatch.setattr(InboxStore, "after", after)

    def late() -> None:
        for n in range(2):
            world.publish(f"{last}/x", f"late{n}", ordering_key="k")
        world.route()
        walked.clear()

    _on_third_sleep(world, late)
    # When it long-polls and two messages of the source that sorts last come during the wait
    got = world.get(CLIENT, channel, wait_ms=5000)
    # Then they are handed out, in order
    assert texts(got) == ["late0", "late1"]
    # And the walk that handed them out read only that source's items and what follows them
    hit = _source(world, last)
    assert walked and all(key >= f"{hit}#" for key in walked)
    # while the look before it walked every source
    assert len({key.split("#")[0] for key in looked if key != STATE}) == len(topics)
