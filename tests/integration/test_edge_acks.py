"""``ack`` frames as a client that holds its acks sends them (issue 46, item 3): many ids in
one frame, out of order, an id twice, ids the session never handed out, more ids than the
window, and an ack racing a redelivery; each frame writes the session's delivery state once,
whatever its number of ids; and an ack whose eventually consistent reads are older than what
it acks. Driven through the edge's routes over moto (``test_edge.Edge``)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from shoal.aws.dynamo import Dynamo
from shoal.core.config import get_config
from shoal.delivery.model import STATE
from shoal.edge.push import PushWorker
from shoal.edge.routes import handle

from tests.integration.test_edge import Edge, edge, texts

__all__ = ["edge"]  # fixture

#: DynamoDB's write operations, as ``Dynamo.call`` names them
WRITES = {
    "put_item",
    "update_item",
    "delete_item",
    "batch_write_item",
    "transact_write_items",
}


def pushed(edge: Edge, connection: str, count: int, *, window: int = 100) -> list[dict[str, Any]]:
    """A connected session subscribed to ``a/#`` at QoS 1, pushed ``count`` messages
    (``m0``...): the message frames it was sent."""
    edge.connect(connection, receive_maximum=window)
    edge.send(connection, {"action": "subscribe", "subscriptions": [{"filter": "a/#", "qos": 1}]})
    for n in range(count):
        edge.world.publish("a/b", f"m{n}")
    edge.world.route()
    return edge.messages(connection)


def ack(edge: Edge, connection: str, ids: list[str]) -> int:
    """One ack frame (with a ref, so that the service says how many ids it acked)."""
    edge.send(connection, {"action": "ack", "ref": "a", "ids": ids})
    answer = edge.api.sent[connection][-1]
    while answer["action"] != "acked":
        # deliveries the ack let out are pushed after its answer
        answer = next(f for f in reversed(edge.api.sent[connection]) if f["action"] == "acked")
    acked: int = answer["acked"]
    return acked


def redelivered(edge: Edge, connection: str) -> list[str]:
    """After the ack timeout, what the sweep sends again (with dup): the texts."""
    before = len(edge.messages(connection))
    edge.world.clock.advance(edge.world.settings.ack_timeout_s + 1)
    edge.sweep()
    again = edge.messages(connection)[before:]
    assert all(f["dup"] for f in again)
    return texts(again)


def state_writes(edge: Edge, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, Any]]:
    """Every DynamoDB write from now on: (operation, table, the item's position or None)."""
    writes: list[tuple[str, str, Any]] = []
    real = Dynamo.call

    def recording(self: Dynamo, operation: str, **request: Any) -> Any:
        if operation in WRITES:
            item = request.get("Item") or request.get("Key") or {}
            position = (item.get("position") or {}).get("S")
            writes.append((operation, str(request.get("TableName")), position))
        return real(self, operation, **request)

    monkeypatch.setattr(Dynamo, "call", recording)
    return writes


def test_many_ids_in_one_frame_are_acked_together(edge: Edge) -> None:
    # Given five deliveries pushed and processed
    frames = pushed(edge, "c1", 5)
    # When one ack frame carries all their ids
    # Then all five are acked, and none comes again after the ack timeout
    assert ack(edge, "c1", [f["id"] for f in frames]) == 5
    assert redelivered(edge, "c1") == []


def test_an_ack_frame_writes_the_sessions_state_once_whatever_its_number_of_ids(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given 99 deliveries in flight, in the service's window of 100 (not full: the acks let
    # nothing out, so the frame's writes are the ack's alone)
    assert edge.world.settings.window == 100
    frames = pushed(edge, "c1", 99)
    ids = [f["id"] for f in frames]
    inboxes = get_config().table("inboxes")
    writes = state_writes(edge, monkeypatch)
    # When they are acked in frames of 1, 10 and 88 ids
    # Then each frame made one write: the session's delivery state
    for batch in (ids[:1], ids[1:11], ids[11:]):
        writes.clear()
        assert ack(edge, "c1", batch) == len(batch)
        assert writes == [("put_item", inboxes, STATE)], len(batch)
    assert redelivered(edge, "c1") == []


def test_ids_out_of_order_are_acked_and_the_window_counts_what_is_unacked(edge: Edge) -> None:
    # Given a window of 3, full, and two more messages waiting behind it
    frames = pushed(edge, "c1", 5, window=3)
    assert texts(frames) == ["m0", "m1", "m2"]
    # When the last one handed out is acked before the first ones
    assert ack(edge, "c1", [frames[2]["id"]]) == 1
    # Then the window opened by one (m0, m1 stay in it, unacked)
    assert texts(edge.messages("c1")) == ["m0", "m1", "m2", "m3"]
    # and a frame of the rest, in reverse order, acks them all and lets m4 out
    rest = [f["id"] for f in edge.messages("c1") if f["id"] != frames[2]["id"]]
    assert ack(edge, "c1", rest[::-1]) == 3
    assert texts(edge.messages("c1"))[-1] == "m4"
    assert ack(edge, "c1", [edge.messages("c1")[-1]["id"]]) == 1
    assert redelivered(edge, "c1") == []


def test_an_id_acked_twice_is_acked_once_and_changes_nothing_the_second_time(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given two deliveries in flight
    first, second = pushed(edge, "c1", 2)
    # When one frame names the first twice, and a later frame names it again
    assert ack(edge, "c1", [first["id"], first["id"]]) == 1
    writes = state_writes(edge, monkeypatch)
    assert ack(edge, "c1", [first["id"]]) == 0
    # Then the second ack wrote nothing, and the one not acked still comes again
    assert writes == []
    assert redelivered(edge, "c1") == ["m1"]
    assert second["id"] == edge.messages("c1")[-1]["id"]


def test_unknown_ids_are_acked_as_nothing_and_change_nothing(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a delivery in flight to c1, and another session's delivery to c2
    (mine,) = pushed(edge, "c1", 1)
    edge.connect("c2", client_id="alice-2")
    edge.send("c2", {"action": "subscribe", "subscriptions": [{"filter": "b/#", "qos": 1}]})
    edge.world.publish("b/c", "theirs")
    edge.world.route()
    theirs = edge.messages("c2")[0]["id"]
    session = mine["id"].rpartition(".")[0]
    unknown = ["nonsense", "", f"{session}.x", f"{session}.999", theirs, "g-not-a-group"]
    writes = state_writes(edge, monkeypatch)
    # When c1 acks ids it was never given (garbage, not handed out yet, another session's)
    # Then nothing is acked, nothing is written, and no error is sent (MQTT 5 §3.4: a PUBACK
    # of an unknown packet identifier is not an error)
    assert ack(edge, "c1", unknown) == 0
    assert writes == []
    assert [f["action"] for f in edge.api.sent["c1"]].count("error") == 0
    # and both deliveries are still in flight: they come again after the ack timeout
    assert redelivered(edge, "c1") == ["m0"]
    assert texts(edge.messages("c2")) == ["theirs", "theirs"]


def test_a_frame_with_more_ids_than_the_window_acks_only_what_was_handed_out(
    edge: Edge,
) -> None:
    # Given a window of 2, full, and three messages waiting behind it
    frames = pushed(edge, "c1", 5, window=2)
    assert texts(frames) == ["m0", "m1"]
    session = frames[0]["id"].rpartition(".")[0]
    handed = [f["id"] for f in frames]
    # When one frame acks the window and names 998 ids more, among them the ids the waiting
    # deliveries will have (a session's ids are numbered)
    guessed = [f"{session}.{n}" for n in range(2, 1000)]
    assert set(handed).isdisjoint(guessed)
    assert ack(edge, "c1", handed + guessed) == 2
    # Then the waiting ones are pushed, not acked ahead: unacked, they come again
    assert texts(edge.messages("c1")) == ["m0", "m1", "m2", "m3"]
    assert redelivered(edge, "c1") == ["m2", "m3"]
    # and a frame over the API's 1,000 ids is refused with a code and changes nothing
    answer = edge.send(
        "c1", {"action": "ack", "ref": "big", "ids": [f"{session}.{n}" for n in range(1001)]}
    )
    assert (answer["status"], answer["error"]["code"]) == (400, "invalid_request")
    assert redelivered(edge, "c1") == ["m2", "m3"]


def test_an_ack_racing_the_redelivery_of_its_id_lands_and_the_id_never_comes_again(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client's held ack arrives as the ack timeout's sweep sends the delivery again: the
    ack read the session's state before the sweep's push wrote it, so its conditional write
    fails and it reads again. Made deterministic by running the sweep between the ack's read
    and its write."""
    # Given a delivery in flight whose ack timeout has passed
    (first,) = pushed(edge, "c1", 1)
    edge.world.clock.advance(edge.world.settings.ack_timeout_s + 1)
    service = edge.service.delivery
    real_read = service.read_sessions

    def read_then_sweep(*args: Any, **kwargs: Any) -> Any:
        read = real_read(*args, **kwargs)
        monkeypatch.setattr(service, "read_sessions", real_read)
        edge.sweep()  # sends the delivery again, with dup: a new state version
        return read

    monkeypatch.setattr(service, "read_sessions", read_then_sweep)
    # When its ack comes between the sweep's read of the session and its write
    assert ack(edge, "c1", [first["id"]]) == 1
    # Then the copy went out once, with dup, and the ack still landed
    frames = edge.messages("c1")
    assert [(f["id"], f["dup"]) for f in frames] == [(first["id"], False), (first["id"], True)]
    # and the copy's ack (the client acks a copy of what it processed again) acks nothing
    assert ack(edge, "c1", [first["id"]]) == 0
    assert redelivered(edge, "c1") == []
    assert redelivered(edge, "c1") == []


def test_a_copy_handed_out_again_and_acked_before_its_post_is_not_posted(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sweep's push hands a delivery out again (dup, its state written), and the client's
    ack of the first copy lands before the push posts the copy: posted, it would reach the
    client after its ack was answered (the soak beside a lagging server: copies up to 20 s
    after the answer). Made deterministic by acking between the push's get and its post."""
    # Given a delivery in flight whose ack timeout has passed
    (first,) = pushed(edge, "c1", 1)
    edge.world.clock.advance(edge.world.settings.ack_timeout_s + 1)
    real_get = PushWorker._get
    acked: list[int] = []

    def get_then_ack(self: PushWorker, *args: Any, **kwargs: Any) -> Any:
        handed = real_get(self, *args, **kwargs)
        if handed and not acked:
            # the ack frame's own route, without draining the push queue (this is a push)
            event = edge.event("edge_frame.json", "c1")
            event["body"] = json.dumps({"action": "ack", "ref": "late", "ids": [first["id"]]})
            event["requestContext"]["routeKey"] = "ack"
            handle(lambda: edge.service, event)
            acked.append(1)
        return handed

    monkeypatch.setattr(PushWorker, "_get", get_then_ack)
    # When the sweep sends it again and the ack comes between that hand-out and its post
    edge.sweep()
    # Then the ack was answered as counting, and the copy was never posted
    answers = [f for f in edge.api.sent["c1"] if f["action"] == "acked"]
    assert [a["acked"] for a in answers] == [1]
    assert [(f["id"], f["dup"]) for f in edge.messages("c1")] == [(first["id"], False)]
    # and nothing comes again later
    monkeypatch.setattr(PushWorker, "_get", real_get)
    assert redelivered(edge, "c1") == []


# --- an ack reads its session eventually consistent


def stale_ack_reads(edge: Edge, monkeypatch: pytest.MonkeyPatch, connection: str) -> None:
    """From now on, the eventually consistent reads of the connection's session (an ack
    frame's) answer what they answer now: a copy as stale as DynamoDB may hand out."""
    service = edge.service.delivery
    found = edge.connections.connection(connection)
    assert found is not None
    pair = (found.client_id, found.session_id)
    stale = service.read_sessions([pair], consistent=False)
    real_read = service.read_sessions

    def read(sessions: Any, *, consistent: bool = True) -> Any:
        wanted = sorted(set(sessions))
        if not consistent and wanted == [pair]:
            return stale
        return real_read(wanted, consistent=consistent)

    monkeypatch.setattr(service, "read_sessions", read)


def test_an_ack_of_an_id_handed_out_after_its_stale_read_lands(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ack frame's eventually consistent read may predate the push that handed its id out
    (the client acks within milliseconds of the frame): the state read then has not handed the
    id out, and the ack reads it again, consistently, instead of acking nothing."""
    # Given a connected session whose ack reads answer the state before any push
    edge.connect("c1")
    edge.send("c1", {"action": "subscribe", "subscriptions": [{"filter": "a/#", "qos": 1}]})
    stale_ack_reads(edge, monkeypatch, "c1")
    # When a delivery is pushed and acked
    edge.world.publish("a/b", "m0")
    edge.world.route()
    (first,) = edge.messages("c1")
    assert ack(edge, "c1", [first["id"]]) == 1
    # Then the id never comes again
    assert redelivered(edge, "c1") == []
    assert redelivered(edge, "c1") == []


def test_an_ack_on_a_new_connection_whose_stale_read_predates_it_lands(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ack frame's eventually consistent read may predate the connect that made its
    channel the session's live one (a reconnect, the session kept): the head read then names
    the old channel, and the ack reads the head again, consistently, instead of refusing."""
    # Given a delivery in flight to a session whose client reconnects (the session kept),
    # its new connection's ack reads answering what they did before the reconnect
    (first,) = pushed(edge, "c1", 1)
    found = edge.connections.connection("c1")
    assert found is not None
    service = edge.service.delivery
    before = service.read_sessions([(found.client_id, found.session_id)], consistent=False)
    edge.api.gone.add("c1")
    edge.connect("c2")
    real_read = service.read_sessions

    def read(sessions: Any, *, consistent: bool = True) -> Any:
        return before if not consistent else real_read(sessions, consistent=consistent)

    monkeypatch.setattr(service, "read_sessions", read)
    # When the new connection gets the delivery again and acks it
    again = edge.messages("c2")
    assert [(f["id"], f["dup"]) for f in again] == [(first["id"], True)]
    assert ack(edge, "c2", [first["id"]]) == 1
    # Then it is acked: it never comes again
    assert redelivered(edge, "c2") == []


def test_an_ack_whose_stale_read_finds_no_connection_yet_lands(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ack frame's eventually consistent read of its connection may not find the item its
    ``connect`` wrote yet: the ack reads it again, consistently, instead of answering that
    the connection holds no session."""
    # Given a delivery in flight, and reads of the connection that find nothing unless
    # consistent
    (first,) = pushed(edge, "c1", 1)
    real = edge.connections.connection

    def connection(connection_id: str, *, consistent: bool = True) -> Any:
        return real(connection_id) if consistent else None

    monkeypatch.setattr(edge.connections, "connection", connection)
    # When the client acks it
    assert ack(edge, "c1", [first["id"]]) == 1
    # Then it never comes again
    assert redelivered(edge, "c1") == []
