"""``GET /v1/groups/{share}?filter=``: an admin's view of one shared group over moto, its
members, its lanes and who holds them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import boto3
import jsonschema
import pytest
from shoal.groups.admin import GroupView

import functions.admin.app as admin_app
from tests.helpers import FakeContext, http_event, response_json
from tests.integration.test_delivery_support import ALICE
from tests.integration.test_groups_support import GroupWorld
from tests.integration.test_publish_harness import ADMIN
from tests.unit.test_openapi import schema

GROUP = "$share/ops/orders/#"


@pytest.fixture
def world(aws: boto3.Session, monkeypatch: pytest.MonkeyPatch) -> Iterator[GroupWorld]:
    # one shard in three lanes: three members hold one lane each
    w = GroupWorld(aws, monkeypatch, lanes=3)
    w.topic("default", 1)
    view = GroupView(w.group_store, w.registry.repository, w.clock)
    monkeypatch.setattr(admin_app, "groups", lambda: view)
    yield w


def view_call(
    share: str, topic_filter: str | None, claims: dict[str, Any] = ADMIN
) -> tuple[int, Any]:
    raw = quote(share, safe="")
    event = http_event(
        "GET",
        f"/v1/groups/{raw}",
        claims=claims,
        query=None if topic_filter is None else {"filter": topic_filter},
        route_key="GET /v1/groups/{share}",
        path_parameters={"share": raw},
    )
    response = admin_app.handler(event, FakeContext())
    return response["statusCode"], response_json(response)


def member(world: GroupWorld, client_id: str) -> str:
    channel = world.connect(client_id, clean_start=False, session_expiry_s=600)
    assert world.subscribe(client_id, channel, {"filter": GROUP, "qos": 1}) == [1]
    return channel


def test_a_group_of_three_shows_its_members_and_each_lanes_holder(world: GroupWorld) -> None:
    # Given three members of one group whose source is known (a message was routed to it)
    channels = {c: member(world, c) for c in ("alice-a", "alice-b", "alice-c")}
    world.publish("orders/1", "m1")
    world.route()
    # and each member has heartbeated (an advance grants the lanes)
    for client_id, channel in channels.items():
        world.heartbeat(client_id, channel)
    # and one member disconnected since
    world.disconnect("alice-c", channels["alice-c"])
    # When an admin asks for the group
    status, body = view_call("ops", "orders/#")
    # Then the answer is the documented document
    assert status == 200, body
    jsonschema.validate(body, schema("SharedGroup"))
    assert (body["group"], body["share"], body["filter"]) == (GROUP, "ops", "orders/#")
    assert body["lanes_per_source"] == 3
    # with its three members, whose session ids are their sessions', connected or not
    members = {m["client_id"]: m for m in body["members"]}
    assert sorted(members) == ["alice-a", "alice-b", "alice-c"]
    for client_id, m in members.items():
        assert m["session_id"] == world.session_id(client_id)
        assert (m["live"], m["lanes_held"]) == (True, 1)
    assert [members[c]["connected"] for c in ("alice-a", "alice-b", "alice-c")] == [
        True,
        True,
        False,
    ]
    # and three lanes of the one source, each granted to a different member
    lanes = body["lanes"]
    assert sorted(lane["lane"] for lane in lanes) == [0, 1, 2]
    assert len({lane["source"] for lane in lanes}) == 1
    assert all(lane["state"] == "granted" for lane in lanes)
    holders = {lane["holder"]: lane["holder_client_id"] for lane in lanes}
    assert holders == {m["session_id"]: c for c, m in members.items()}


def test_messages_handed_out_show_in_flight_on_their_lane(world: GroupWorld) -> None:
    # Given one member holding all three lanes, which got the messages and has not acked
    channel = member(world, "alice-a")
    for n in range(6):
        world.publish(f"orders/{n}", f"m{n}", ordering_key=f"k{n}")
    world.route()
    world.heartbeat("alice-a", channel)
    got = world.get("alice-a", channel, 100)
    assert len(got) == 6
    # When an admin asks for the group
    status, body = view_call("ops", "orders/#")
    # Then the lanes' in-flight counts add up to what it holds
    assert status == 200, body
    assert sum(lane["in_flight"] for lane in body["lanes"]) == 6
    assert {lane["holder_client_id"] for lane in body["lanes"]} == {"alice-a"}


def test_a_lane_being_handed_over_shows_revoking_under_its_old_holder(world: GroupWorld) -> None:
    # Given one member holding all three lanes, each with messages in flight
    a = member(world, "alice-a")
    for n in range(12):
        world.publish(f"orders/{n}", f"m{n}", ordering_key=f"k{n}")
    world.route()
    world.heartbeat("alice-a", a)
    held = world.get("alice-a", a, 100)
    assert len(held) == 12
    _, before = view_call("ops", "orders/#")
    assert all(lane["in_flight"] > 0 for lane in before["lanes"]), before["lanes"]
    # When a second member joins and the group is advanced
    b = member(world, "alice-b")
    world.heartbeat("alice-b", b)
    world.heartbeat("alice-a", a)
    # Then one lane is being handed over: still the first member's, revoking
    _, body = view_call("ops", "orders/#")
    states = sorted((lane["state"], lane["holder_client_id"]) for lane in body["lanes"])
    assert states == [("granted", "alice-a"), ("granted", "alice-a"), ("revoking", "alice-a")]
    assert {m["client_id"]: m["lanes_held"] for m in body["members"]} == {
        "alice-a": 3,
        "alice-b": 0,
    }
    # When the first member acks what it holds (its final progress)
    assert world.ack("alice-a", a, [m["id"] for m in held])[0] == 200
    world.heartbeat("alice-b", b)
    # Then the lane is the second member's, nothing in flight anywhere
    _, body = view_call("ops", "orders/#")
    states = sorted((lane["state"], lane["holder_client_id"]) for lane in body["lanes"])
    assert states == [("granted", "alice-a"), ("granted", "alice-a"), ("granted", "alice-b")]
    assert sum(lane["in_flight"] for lane in body["lanes"]) == 0


def test_a_group_known_to_no_router_yet_has_members_and_no_lanes(world: GroupWorld) -> None:
    member(world, "alice-a")
    status, body = view_call("ops", "orders/#")
    assert status == 200, body
    assert [m["client_id"] for m in body["members"]] == ["alice-a"]
    assert body["lanes"] == []


def test_an_unknown_group_is_404_with_its_code(world: GroupWorld) -> None:
    member(world, "alice-a")
    # another share name of the same filter, and the same share name of another filter
    for share, topic_filter in (("other", "orders/#"), ("ops", "orders/+")):
        status, body = view_call(share, topic_filter)
        assert (status, body["error"]["code"]) == (404, "group_not_found")


def test_a_non_admin_is_refused_before_anything_is_read(world: GroupWorld) -> None:
    member(world, "alice-a")
    for topic_filter in ("orders/#", None, "a/#/b"):
        status, body = view_call("ops", topic_filter, claims=ALICE)
        assert (status, body["error"]["code"]) == (403, "forbidden")


@pytest.mark.parametrize(
    ("share", "topic_filter", "code"),
    [
        ("ops", None, "invalid_request"),
        ("ops", "", "invalid_filter"),
        ("ops", "orders/#/x", "invalid_filter"),
        ("o+s", "orders/#", "invalid_filter"),
        ("o#", "orders/#", "invalid_filter"),
        # "ops/orders" with filter "#" would otherwise name share "ops" and filter "orders/#"
        ("ops/orders", "#", "invalid_filter"),
        ("ops", "orders/\x00", "invalid_filter"),
    ],
)
def test_bad_input_is_a_coded_400(
    world: GroupWorld, share: str, topic_filter: str | None, code: str
) -> None:
    member(world, "alice-a")
    status, body = view_call(share, topic_filter)
    assert (status, body["error"]["code"]) == (400, code)
