"""A shared group's QoS 2 delivery sent again to a WebSocket member and acked between the push's
hand-out and its post is not posted (run H of the 30-minute soak at 200 clients, seed 11:
a held QoS 2 delivery posted 29 s after its ack was answered). Both ways a copy goes out
again: from its stream (the member still holds the lane) and from the items a group holds for
a member whose lane moved ([MQTT-4.8.2-4/5]). Made deterministic by acking between the push's
get and its post."""

from __future__ import annotations

import json
from typing import Any

import pytest
from shoal.aws.dynamo import Dynamo
from shoal.core.config import get_config
from shoal.edge.connections import DUE_SHARDS
from shoal.edge.push import PushWorker
from shoal.edge.routes import handle
from shoal.edge.sweep import PushSweep

from tests.integration.test_edge import Edge, group_edge
from tests.integration.test_edge_acks import stale_ack_reads

__all__ = ["group_edge"]  # fixture

SHARE = {"filter": "$share/g/a/#", "qos": 2}


def ack_between_get_and_post(
    edge: Edge, monkeypatch: pytest.MonkeyPatch, connection: str, delivery_id: str
) -> list[dict[str, Any]]:
    """The next push's get that hands ``delivery_id`` out is followed, before its post, by the
    connection's ack of it (the ack frame's own route, which posts its answer); the answers
    of that ack."""
    real_get = PushWorker._get
    answers: list[dict[str, Any]] = []

    def get_then_ack(self: PushWorker, *args: Any, **kwargs: Any) -> Any:
        handed = real_get(self, *args, **kwargs)
        if not answers and any(m["id"] == delivery_id for m in handed):
            event = edge.event("edge_frame.json", connection)
            event["body"] = json.dumps({"action": "ack", "ref": "late", "ids": [delivery_id]})
            event["requestContext"]["routeKey"] = "ack"
            handle(lambda: edge.service, event)
            answers.extend(f for f in edge.api.sent[connection] if f["action"] == "acked")
        return handed

    monkeypatch.setattr(PushWorker, "_get", get_then_ack)
    return answers


def test_a_group_copy_sent_again_from_its_stream_and_acked_before_its_post_is_not_posted(
    group_edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    edge = group_edge
    # Given the one member of a group, pushed a QoS 2 message it has not acked
    edge.connect("c1", client_id="alice-1")
    edge.send("c1", {"action": "subscribe", "subscriptions": [SHARE]})
    edge.world.publish("a/b", "job", qos=2)
    edge.world.route()
    [first] = edge.messages("c1")
    assert not first["dup"] and first["qos"] == 2
    answers = ack_between_get_and_post(edge, monkeypatch, "c1", first["id"])
    # When its ack timeout passes, the session's next push (another message's, a hand-off's)
    # hands it out again, and the ack of the first copy lands before that push posts the copy
    edge.world.clock.advance(edge.world.settings.ack_timeout_s + 1)
    edge.push_again("c1")
    # Then the ack counted, and the copy was never posted
    assert [a["acked"] for a in answers] == [1]
    assert [(f["id"], f["dup"]) for f in edge.messages("c1")] == [(first["id"], False)]


def held_for_alice_1(edge: Edge) -> dict[str, Any]:
    """A QoS 2 message handed to alice-1, the group's first member, whose connection is then
    lost: its lanes go to alice-2, whose next push holds the message for alice-1 (never
    alice-2's). The first copy."""
    edge.connect("c1", client_id="alice-1")
    edge.send("c1", {"action": "subscribe", "subscriptions": [SHARE]})
    edge.world.publish("a/b", "job", qos=2)
    edge.world.route()
    [first] = edge.messages("c1")
    edge.connect("c2", client_id="alice-2")
    edge.send("c2", {"action": "subscribe", "subscriptions": [SHARE]})
    edge.dropped("c1")
    edge.push_again("c2")
    assert edge.messages("c2") == []
    return first


def test_a_member_back_on_a_new_connection_is_pushed_its_held_message_at_once(
    group_edge: Edge,
) -> None:
    """The reconnect's push is the get that takes lanes back (a rebalance it commits): the
    held message goes in that get. Before, the group as that commit wrote it forgot the held
    deliveries, and the message waited for the member's next push (another message)."""
    edge = group_edge
    first = held_for_alice_1(edge)
    edge.connect("c3", client_id="alice-1")
    assert [(f["id"], f["dup"]) for f in edge.messages("c3")] == [(first["id"], True)]
    assert edge.messages("c2") == []


def test_a_held_group_copy_sent_again_and_acked_before_its_post_is_not_posted(
    group_edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    edge = group_edge
    # Given a QoS 2 message held for alice-1 after its connection was lost
    first = held_for_alice_1(edge)
    # When alice-1 comes back on a new connection, its push hands the held message out again,
    # and alice-1's ack of the first copy lands before that push posts it
    answers = ack_between_get_and_post(edge, monkeypatch, "c3", first["id"])
    edge.connect("c3", client_id="alice-1")
    # Then the ack counted, and the copy was never posted to either member
    assert [a["acked"] for a in answers] == [1]
    assert edge.messages("c3") == []
    assert edge.messages("c2") == []


@pytest.mark.parametrize("qos", [1, 2])
def test_a_group_delivery_left_unacked_comes_again_from_the_sweep(
    group_edge: Edge, qos: int
) -> None:
    """A connected member that does not ack a group delivery gets it again with ``dup`` once
    its ack timeout passed, from the reaper's sweep, as a session's own delivery does: the
    group is quiet, so no other push would carry it. Once acked, the sweep sends nothing."""
    edge = group_edge
    edge.connect("c1", client_id="alice-1")
    edge.send("c1", {"action": "subscribe", "subscriptions": [{**SHARE, "qos": qos}]})
    edge.world.publish("a/b", "job", qos=qos)
    edge.world.route()
    [first] = edge.messages("c1")
    # before its timeout: nothing again
    edge.world.clock.advance(edge.world.settings.ack_timeout_s / 2)
    edge.sweep()
    assert len(edge.messages("c1")) == 1
    edge.world.clock.advance(edge.world.settings.ack_timeout_s / 2 + 1)
    edge.sweep()
    assert [(f["id"], f["dup"]) for f in edge.messages("c1")] == [
        (first["id"], False),
        (first["id"], True),
    ]
    # acked: the sweep after the next timeout sends nothing
    edge.send("c1", {"action": "ack", "ids": [first["id"]]})
    edge.world.clock.advance(edge.world.settings.ack_timeout_s + 1)
    edge.sweep()
    assert len(edge.messages("c1")) == 2


def test_a_due_list_keeps_the_group_ids_it_was_armed_for(group_edge: Edge) -> None:
    """The list stores a stream's ordinals as runs (an item holds 400 KB at most, and a push
    may hand out a hundred a session); what the sweep takes back is every id armed."""
    connections = group_edge.connections
    ids = {
        "s1": [f"g-k.src-0.3.{o}" for o in (*range(0, 100), 105, 107, 108)],
        "s2": ["g-k.src-1.1.7", "g-other.src-0.2.0"],
    }
    assert connections.arm_sessions(["s1", "s2", "s3"], 5, grouped=ids)
    [(key, due_at_ms)] = [k for shard in range(DUE_SHARDS) for k in connections.due(shard, 10, 10)]
    taken = connections.take_due(key, due_at_ms)
    assert sorted(taken.sessions) == ["s1", "s2", "s3"]
    assert {s: sorted(i) for s, i in taken.grouped.items()} == {
        s: sorted(i) for s, i in ids.items()
    }
    # taken once
    assert connections.take_due(key, due_at_ms).sessions == []


def test_a_group_copy_posted_late_is_not_posted_once_its_ordinal_is_done(
    group_edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run J of the soak: a member's first copy was posted 38 s after its get handed it out (a
    batch posts only after all its gets, and the machine was loaded); meanwhile its lane moved
    and the next holder got the message again and acked it, 20 s before the post. A post that
    late checks the group first, and a copy whose ordinal is done on its stream goes nowhere.
    Here the member's own ack frame, run between the get and the post, makes it done: the
    check reads the stream, not who acked."""
    edge = group_edge
    edge.connect("c1", client_id="alice-1")
    edge.send("c1", {"action": "subscribe", "subscriptions": [{**SHARE, "qos": 1}]})
    real_get = PushWorker._get
    acked: list[dict[str, Any]] = []

    def get_then_done(self: PushWorker, *args: Any, **kwargs: Any) -> Any:
        handed = real_get(self, *args, **kwargs)
        if handed and not acked:
            # the post comes late: its ordinal is done on the stream before it
            edge.world.clock.advance(2)
            event = edge.event("edge_frame.json", "c1")
            event["body"] = json.dumps({"action": "ack", "ref": "x", "ids": [handed[0]["id"]]})
            event["requestContext"]["routeKey"] = "ack"
            handle(lambda: edge.service, event)
            acked.extend(f for f in edge.api.sent["c1"] if f["action"] == "acked")
        return handed

    monkeypatch.setattr(PushWorker, "_get", get_then_done)
    # When a message's first copy is handed out, its ordinal done, and its post comes late
    edge.world.publish("a/b", "job", qos=1)
    edge.world.route()
    # Then the copy was not posted
    assert [a["acked"] for a in acked] == [1]
    assert edge.messages("c1") == []


def test_the_sweep_asks_the_groups_once_for_all_its_sessions(
    group_edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two members of two groups, each pushed a delivery of one message: the sweep at their
    ack timeout reads what is still out for both in one batch read (it read once a session),
    and sends again only the one not acked."""
    edge = group_edge
    for connection, client, share in (("c1", "alice-1", "g"), ("c2", "alice-2", "h")):
        edge.connect(connection, client_id=client)
        subscription = {"filter": f"$share/{share}/a/#", "qos": 1}
        edge.send(connection, {"action": "subscribe", "subscriptions": [subscription]})
    edge.world.publish("a/b", "job", qos=1)
    edge.world.route()
    [first] = edge.messages("c1")
    [second] = edge.messages("c2")
    edge.send("c1", {"action": "ack", "ids": [first["id"]]})
    # When the sweep runs past their ack timeout, its reads of the groups' table counted
    reads: list[dict[str, Any]] = []
    real = Dynamo.call

    groups = get_config().table("groups")

    def counted(self: Dynamo, operation: str, **kwargs: Any) -> Any:
        if operation == "batch_get_item" and groups in kwargs.get("RequestItems", {}):
            reads.append(kwargs)
        return real(self, operation, **kwargs)

    edge.world.clock.advance(edge.world.settings.ack_timeout_s + 1)
    with monkeypatch.context() as patched:
        patched.setattr(Dynamo, "call", counted)
        PushSweep(edge.connections, edge.world.delivery, edge.queue, edge.world.clock).sweep()
    edge.push()
    # Then one read asked for both sessions' deliveries, and only alice-2's came again
    assert len(reads) == 1
    assert [(f["id"], f["dup"]) for f in edge.messages("c2")] == [
        (second["id"], False),
        (second["id"], True),
    ]
    assert len(edge.messages("c1")) == 1


def test_a_group_ack_whose_stale_read_predates_the_subscribe_lands(
    group_edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ack frame reads the session's head eventually consistent; a copy older than the
    subscribe that joined the group does not join it, and the group's ack would pass the id
    over (an id of a group left). The ack reads the head again, consistently, and the id is
    acked: it never comes again."""
    edge = group_edge
    # Given a member whose ack reads answer the head as it was before its subscribe
    edge.connect("c1", client_id="alice-1")
    stale_ack_reads(edge, monkeypatch, "c1")
    edge.send("c1", {"action": "subscribe", "subscriptions": [{**SHARE, "qos": 1}]})
    edge.world.publish("a/b", "job", qos=1)
    edge.world.route()
    [first] = edge.messages("c1")
    assert first["id"].startswith("g-")
    # When it acks the group's delivery
    edge.send("c1", {"action": "ack", "ref": "a", "ids": [first["id"]]})
    # Then the ack counted, and the sweep after its timeout sends nothing again
    assert [f["acked"] for f in edge.api.sent["c1"] if f["action"] == "acked"] == [1]
    edge.world.clock.advance(edge.world.settings.ack_timeout_s + 1)
    edge.sweep()
    assert [f["id"] for f in edge.messages("c1")] == [first["id"]]
