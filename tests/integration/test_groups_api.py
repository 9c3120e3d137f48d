"""Shared subscriptions through the handlers: join, fan-out once per group, leases on
heartbeat, hand-off, takeover, leave, session end."""

from __future__ import annotations

from typing import Any

import jsonschema
from shoal.delivery.inbox import InboxItem
from shoal.groups.streams import group_partition, parse_delivery_id
from shoal.sessions.model import WillMessage

import functions.reaper.app as reaper_app
import functions.sessions.app as sessions_app
import functions.subscriptions.app as subscriptions_app
from tests.helpers import FakeContext, load_event, response_json
from tests.integration.test_delivery_api import operation_schema, sample
from tests.integration.test_groups_support import LEASE_S, GroupWorld, gworld

__all__ = ["gworld"]  # fixture

GROUP = "$share/g/orders/#"


def member(world: GroupWorld, client_id: str, text: str = GROUP, **connect: Any) -> str:
    body = {"clean_start": False, "session_expiry_s": 600, **connect}
    channel = world.connect(client_id, **body)
    assert world.subscribe(client_id, channel, {"filter": text, "qos": 1}) == [1]
    return channel


def publish(world: GroupWorld, count: int, key: str = "k") -> list[str]:
    ids = [world.publish(f"orders/{n}", f"m{n}", ordering_key=key) for n in range(count)]
    world.route()
    return ids


class NoWills:
    """A will publisher for reapers whose sessions carry no will."""

    def publish_will(self, sub: str, client_id: str, will: WillMessage, will_id: str) -> None:
        raise AssertionError("no session of this test has a will")


def test_the_first_subscribe_creates_the_group_and_the_last_unsubscribe_removes_it(
    gworld: GroupWorld,
) -> None:
    # Given two members of one group
    a = member(gworld, "alice-a")
    b = member(gworld, "alice-b")
    loaded = gworld.group("g", "orders/#")
    assert loaded is not None and len(loaded.state.members) == 2
    # When one unsubscribes, the group stays; when the other does, it is gone
    assert gworld.unsubscribe("alice-a", a, GROUP)[0] == 200
    assert gworld.group("g", "orders/#") is not None
    assert gworld.unsubscribe("alice-b", b, GROUP)[0] == 200
    assert gworld.group("g", "orders/#") is None


def test_the_router_writes_a_message_once_per_group_and_one_member_gets_it(
    gworld: GroupWorld,
) -> None:
    # Given two members, both heartbeating
    a = member(gworld, "alice-a")
    b = member(gworld, "alice-b")
    gworld.heartbeat("alice-a", a)
    gworld.heartbeat("alice-b", b)
    # When three messages are published
    ids = publish(gworld, 3)
    # Then the group's partition holds each once, and between the members each arrives once
    loaded = gworld.group("g", "orders/#")
    assert loaded is not None
    partition = group_partition(loaded.state.incarnation)
    rows = gworld.group_store.dynamo.query(
        gworld.inbox.table,
        KeyConditionExpression="#p = :p",
        ExpressionAttributeNames={"#p": "inbox"},
        ExpressionAttributeValues={":p": {"S": partition}},
    )
    stored = [InboxItem.from_record(r) for r in rows]
    assert sorted(m.message_id for i in stored for m in i.messages) == sorted(ids)
    got = gworld.drain("alice-a", a) + gworld.drain("alice-b", b)
    assert sorted(m["message_id"] for m in got) == sorted(ids)
    assert all(m["subscription"] == GROUP and not m["dup"] for m in got)


def test_heartbeat_answers_lease_changes_only(gworld: GroupWorld) -> None:
    # Given a member and a stream with a message
    a = member(gworld, "alice-a")
    publish(gworld, 1)
    # When it heartbeats
    first = gworld.heartbeat("alice-a", a)
    # Then it learns of its granted stream, once
    assert [(x["group"], x["lease"], x["state"]) for x in first] == [(GROUP, 1, "granted")]
    assert gworld.heartbeat("alice-a", a) == []


def test_a_join_revokes_a_stream_and_hands_it_over_after_the_final_ack(
    gworld: GroupWorld,
) -> None:
    # Given one member holding both streams, with messages of both in flight
    a = member(gworld, "alice-a")
    for key in range(8):  # over the default topic's two shards
        publish(gworld, 1, key=f"k{key}")
    gworld.heartbeat("alice-a", a)
    held = gworld.get("alice-a", a, 100)
    sources = {getattr(parse_delivery_id(m["id"]), "source", None) for m in held}
    assert len(sources) == 2
    # When a second member joins
    b = member(gworld, "alice-b")
    assert gworld.heartbeat("alice-b", b) == []
    # Then the first learns one stream is revoking, and the second gets nothing of it yet
    (revoking,) = gworld.heartbeat("alice-a", a)
    assert revoking["state"] == "revoking"
    assert gworld.get("alice-b", b, 100) == []
    # When the first acks what it holds (its final progress)
    acked = gworld.ack("alice-a", a, [m["id"] for m in held])[1]
    assert acked == {"acked": 8}
    # Then the second is granted the stream
    (granted,) = gworld.heartbeat("alice-b", b)
    assert (granted["stream"], granted["state"]) == (revoking["stream"], "granted")
    assert granted["lease"] == revoking["lease"] + 1


def test_a_takeover_gets_its_unacked_group_messages_again(gworld: GroupWorld) -> None:
    # Given a member that got two messages and did not ack them
    a = member(gworld, "alice-a")
    ids = publish(gworld, 2)
    gworld.heartbeat("alice-a", a)
    assert [m["message_id"] for m in gworld.get("alice-a", a)] == ids
    # When the client reconnects (the same session, a new channel)
    gworld.clock.advance(0.001)
    again = gworld.connect("alice-a", clean_start=False, session_expiry_s=600)
    # Then it gets them again, dup, before the ack timeout
    redelivered = gworld.get("alice-a", again)
    assert [(m["message_id"], m["dup"]) for m in redelivered] == [(i, True) for i in ids]


def test_a_silent_member_loses_its_streams_after_the_lease_timeout(gworld: GroupWorld) -> None:
    # Given a holder that got a message, and a second member
    a = member(gworld, "alice-a")
    (message_id,) = publish(gworld, 1)
    gworld.heartbeat("alice-a", a)
    first = gworld.get("alice-a", a)
    b = member(gworld, "alice-b")
    # When only the second heartbeats past the lease timeout
    gworld.clock.advance(LEASE_S)
    gworld.heartbeat("alice-b", b)
    # Then it gets the message, dup; the first's late ack counts nothing
    second = gworld.get("alice-b", b)
    assert [(m["message_id"], m["dup"]) for m in second] == [(message_id, True)]
    assert gworld.ack("alice-a", a, [first[0]["id"]])[1] == {"acked": 0}
    assert gworld.ack("alice-b", b, [second[0]["id"]])[1] == {"acked": 1}
    # and the first learns its lease was revoked
    assert [x["state"] for x in gworld.heartbeat("alice-a", a)] == ["revoked"]


def test_a_group_and_a_plain_subscription_each_get_every_message(gworld: GroupWorld) -> None:
    a = member(gworld, "alice-a")
    plain = member(gworld, "alice-p", "orders/#")
    gworld.heartbeat("alice-a", a)
    ids = publish(gworld, 3)
    assert [m["message_id"] for m in gworld.drain("alice-a", a)] == ids
    assert [m["message_id"] for m in gworld.drain("alice-p", plain)] == ids


def test_the_session_document_lists_the_groups_and_leases(gworld: GroupWorld) -> None:
    a = member(gworld, "alice-a")
    publish(gworld, 1)
    gworld.heartbeat("alice-a", a)
    status, session = gworld.call(sessions_app.handler, "GET", "alice-a", channel=a)
    assert status == 200
    (group,) = session["groups"]
    assert (group["group"], group["members"]) == (GROUP, 1)
    assert [x["state"] for x in group["leases"]] == ["granted"]


def test_a_clean_start_leaves_the_group(gworld: GroupWorld) -> None:
    member(gworld, "alice-a")
    member(gworld, "alice-b")
    # When alice-a's session is discarded by a clean start
    gworld.clock.advance(0.001)
    gworld.connect("alice-a", clean_start=True)
    # Then it is no longer a member
    loaded = gworld.group("g", "orders/#")
    assert loaded is not None
    assert list(loaded.state.members) == [gworld.session_id("alice-b")]


def test_the_reaper_ends_the_last_members_session_and_the_group_goes(
    gworld: GroupWorld, monkeypatch: Any
) -> None:
    # Given the only member, disconnected, its session expiring in 60 s
    a = member(gworld, "alice-a", session_expiry_s=60)
    publish(gworld, 2)
    gworld.disconnect("alice-a", a)
    # When the reaper runs after the expiry
    gworld.clock.advance(61)
    reaper = reaper_app.Reaper(
        gworld.registry.repository,
        publisher=NoWills(),
        clock=gworld.clock,
        on_session_end=gworld.retirer,
    )
    monkeypatch.setattr(reaper_app, "reaper", lambda: reaper)
    report = reaper_app.handler({}, FakeContext())
    # Then the session ended and the group is gone with its backlog
    assert report["sessions_ended"] == 1
    assert gworld.group("g", "orders/#") is None


def test_sample_events_answer_as_the_openapi_document_says(gworld: GroupWorld) -> None:
    # Given sensor-1 connected as the sample events' principal
    claims = load_event("groups_subscribe.json")["requestContext"]["authorizer"]["jwt"]["claims"]
    channel = gworld.connect("sensor-1", claims=claims)
    # When it subscribes to a shared group, a message arrives, and it heartbeats
    joined = subscriptions_app.handler(sample("groups_subscribe.json", channel), FakeContext())
    assert response_json(joined) == {"granted": [1]}
    gworld.publish("orders/1", "x")
    gworld.route()
    beat = sessions_app.handler(sample("groups_heartbeat.json", channel), FakeContext())
    # Then the heartbeat names the granted stream, as the OpenAPI document describes it
    body = response_json(beat)
    jsonschema.validate(body, operation_schema("/heartbeat", "post"))
    assert [(x["group"], x["state"]) for x in body["leases"]] == [
        ("$share/workers/orders/#", "granted")
    ]


def test_the_reaper_hands_a_dead_channels_streams_to_live_members(
    gworld: GroupWorld, monkeypatch: Any
) -> None:
    # Given a holder with a 1 s keepalive, and a second member that heartbeats later on
    a = member(gworld, "alice-a", keepalive_s=1)
    publish(gworld, 1)
    gworld.heartbeat("alice-a", a)
    b = member(gworld, "alice-b")
    gworld.clock.advance(LEASE_S - 1)
    gworld.heartbeat("alice-b", b)
    # When the reaper runs past the holder's keepalive and lease, and nobody else calls
    gworld.clock.advance(2)
    reaper = reaper_app.Reaper(
        gworld.registry.repository,
        publisher=NoWills(),
        clock=gworld.clock,
        on_session_end=gworld.retirer,
        on_channel_expired=gworld.groups.channel_expired,
    )
    monkeypatch.setattr(reaper_app, "reaper", lambda: reaper)
    report = reaper_app.handler({}, FakeContext())
    # Then the channel expired and its stream is the live member's
    assert report["channels_expired"] == 1
    loaded = gworld.group("g", "orders/#")
    assert loaded is not None
    assert {x.holder for x in loaded.state.streams.values()} == {gworld.session_id("alice-b")}


def test_a_new_shared_subscription_gets_no_retained_message(gworld: GroupWorld) -> None:
    # Given a retained message on a topic the group's filter matches
    gworld.publish("orders/kept", "retained", retain=True)
    gworld.route()
    # When a session subscribes to it through a shared subscription, and another plainly
    shared = member(gworld, "alice-a")
    plain = gworld.connect("alice-p")
    assert gworld.subscribe("alice-p", plain, {"filter": "orders/#", "qos": 1}) == [1]
    # Then only the plain one gets it: MQTT 5 §4.8.2, retained messages are not sent when a
    # session establishes a shared subscription
    assert [m["topic"] for m in gworld.get("alice-p", plain)] == ["orders/kept"]
    assert gworld.get("alice-a", shared) == []


def test_no_local_on_a_shared_subscription_is_refused_for_that_filter(gworld: GroupWorld) -> None:
    channel = gworld.connect("alice-a")
    # When a subscribe asks No Local of a shared subscription, beside a valid filter
    granted = gworld.subscribe(
        "alice-a",
        channel,
        {"filter": GROUP, "qos": 1, "no_local": True},
        {"filter": "orders/#", "qos": 1, "no_local": True},
    )
    # Then that filter alone is refused ([MQTT-3.8.3-4]: a protocol error), nothing of it kept
    assert granted == ["no_local_on_shared", 1]
    assert gworld.group("g", "orders/#") is None
