"""Crash points on the WebSocket push path: a Lambda dying between two AWS calls and retried
(the router's batch by the Kinesis mapping, bisected on a function error; the pusher's chunk
by the push queue). What a crash leaves must keep the delivery promises: QoS 0 at most once,
an unacked QoS 1 delivery sent again after its ack timeout."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from botocore.exceptions import ClientError
from shoal.core.errors import ServerBusy
from shoal.edge import push as push_module

from tests.integration.test_edge import (
    Edge,
    away_while_published,
    chunks_visible_again_at_once,
    edge,
    texts,
)
from tests.integration.test_edge_fanout import qos0_then_qos1_behind_a_waiting_push

__all__ = ["edge"]  # fixture


class Crash(Exception):
    """A function dying at an injection point (Lambda reports a function error)."""


class FailsFirst:
    """``real`` wrapped: its first ``times`` calls raise ``error`` instead; ``calls`` counts
    them all."""

    def __init__(self, real: Any, error: Exception, times: int = 1) -> None:
        self.real = real
        self.error = error
        self.times = times
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls <= self.times:
            raise self.error
        return self.real(*args, **kwargs)


def test_a_router_batch_retried_after_its_hand_off_posts_its_qos0_frames_once(
    edge: Edge,
) -> None:
    """The router handed a batch's pushes to the queue, carrying a connected session's QoS 0
    deliveries whole, then died before its answer reached Lambda (a timeout). The batch is
    retried, bisected: each half is another hand-off (its own deduplication ids), and must
    not carry those QoS 0 frames again: they may have gone out (MQTT 5 §4.3.1)."""
    edge.connect("c1")
    edge.send("c1", {"action": "subscribe", "subscriptions": [{"filter": "a/#", "qos": 0}]})
    handler = edge.world.router
    calls = {"n": 0}

    def dies_after_its_hand_off(event: dict[str, Any], context: Any) -> Any:
        calls["n"] += 1
        answer = handler(event, context)
        if calls["n"] == 1:
            raise Crash("the router died after its hand-off")
        return answer

    edge.world.router = dies_after_its_hand_off
    for n in range(2):
        edge.world.publish("a/b", f"q{n}", qos=0)
    edge.world.route()
    assert calls["n"] > 1  # the batch was retried
    assert texts(edge.messages("c1")) == ["q0", "q1"]


def test_a_pusher_that_dies_between_its_get_and_its_arm_leaves_what_it_handed_out_timed(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pusher died after its get wrote the session's state (the deliveries handed out) and
    before the due index's write that times them (a timeout while other sessions' gets ran,
    or the arm's own call). Its chunk comes back and its get finds nothing new to hand out;
    what the dead attempt handed out must still come again after its ack timeout, with
    ``dup``, while the session stays connected (no reconnect, no other message)."""
    edge.connect("c1")
    edge.send("c1", {"action": "subscribe", "subscriptions": [{"filter": "a/#", "qos": 1}]})
    dies_before_arming = FailsFirst(
        edge.connections.arm_sessions, Crash("the pusher died before the due index's write")
    )
    monkeypatch.setattr(edge.connections, "arm_sessions", dies_before_arming)
    chunks_visible_again_at_once(edge)
    for n in range(2):
        edge.world.publish("a/b", f"m{n}")
    edge.world.route()
    assert dies_before_arming.calls >= 1
    assert edge.messages("c1") == []
    edge.world.clock.advance(edge.world.settings.ack_timeout_s + 1)
    edge.sweep()
    frames = edge.messages("c1")
    assert texts(frames) == ["m0", "m1"]
    assert [f["dup"] for f in frames] == [True, True]


def test_a_qos0_frame_is_not_posted_after_a_later_delivery_when_the_batch_read_failed(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As ``test_a_qos0_frame_a_later_delivery_overtook_is_dropped_not_posted_out_of_order``,
    but the pusher's batch read of the sessions' states fails (throttled): each get then
    reads its own state, and the QoS 0 frame must still not be posted after the later
    message of its key that an earlier push handed out."""
    edge.connect("c0", client_id="alice-0")
    edge.send("c0", {"action": "subscribe", "subscriptions": [{"filter": "a/#", "qos": 1}]})
    found = edge.connections.connection("c0")
    assert found is not None
    # Given a push of the session waiting in its lane, then two batches handed over behind it
    qos0_then_qos1_behind_a_waiting_push(edge, found.session_id)

    def throttled(*_: Any) -> Any:
        raise ClientError({"Error": {"Code": "ThrottlingException"}}, "BatchGetItem")

    monkeypatch.setattr(edge.world.delivery, "read_sessions", throttled)
    # When the pusher takes the lane in order, a record a batch
    monkeypatch.setattr(edge, "mapping", dataclasses.replace(edge.mapping, batch_size=1))
    frames = edge.messages("c0")
    # Then m1 went out (by the first push, from the inbox) and m0 never after it
    assert texts(frames) == ["m1"]


def test_an_ack_sent_again_after_its_hand_off_failed_still_lets_out_what_waits(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ack that opened a full window wrote the session's state, then its hand-off of the
    push failed (the queue refused it past its tries, or the function died there): the
    client is told to send the frame again. The ack sent again finds its ids acked, so it
    opens nothing by itself; what waited behind the window must still go out while the
    session stays connected and idle (nothing else in flight for the sweep, no new message)."""
    edge.connect("c1", receive_maximum=1)
    edge.send("c1", {"action": "subscribe", "subscriptions": [{"filter": "a/#", "qos": 1}]})
    for n in range(2):
        edge.world.publish("a/b", f"m{n}")
    edge.world.route()
    [first] = edge.messages("c1")
    assert texts([first]) == ["m0"]
    real = edge.queue.hand_off
    refused = {"n": 0}

    def refusing_once(*args: Any, **kwargs: Any) -> int:
        if refused["n"] == 0:
            refused["n"] += 1
            raise ServerBusy("the push queue refused a hand-off; retry")
        return real(*args, **kwargs)

    monkeypatch.setattr(edge.queue, "hand_off", refusing_once)
    answer = edge.send("c1", {"action": "ack", "ids": [first["id"]]})
    assert answer is not None and answer["action"] == "error"  # "retry"
    # When the ack is sent again: it acks nothing new, but the push its first write owed
    # is handed over now (the state says so: ``push_owed``)
    assert edge.send("c1", {"action": "ack", "ids": [first["id"]]}) is None
    assert texts(edge.messages("c1")) == ["m0", "m1"]
    # and once that push went out, the same ack again pushes nothing more
    again = len(edge.api.sent["c1"])
    assert edge.send("c1", {"action": "ack", "ids": [first["id"]]}) is None
    assert len(edge.api.sent["c1"]) == again


def test_a_connection_whose_ready_mark_meets_a_busy_store_is_marked_when_it_clears(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The connect's answer went out, then its ``ready`` mark was refused as busy (throttled,
    or the store's answer past a call's wait). The client holds itself connected and never
    sends its connect again, and the pusher posts nothing to a connection not ready: left
    so, the session would get nothing until it connected again. The mark is tried again
    through the busy store, as ``$disconnect``'s steps are."""
    busy_twice = FailsFirst(edge.connections.ready, ServerBusy("the store is busy; retry"), 2)
    monkeypatch.setattr(edge.connections, "ready", busy_twice)
    edge.connect("c1")
    edge.send("c1", {"action": "subscribe", "subscriptions": [{"filter": "a/#", "qos": 1}]})
    found = edge.connections.connection("c1")
    assert found is not None
    target = edge.connections.target(found.session_id)
    assert target is not None and target.ready
    edge.world.publish("a/b", "m0")
    edge.world.route()
    assert texts(edge.messages("c1")) == ["m0"]
    assert edge.api.closed == []


def test_a_connection_that_cannot_be_marked_ready_is_closed_not_left_silent(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above, but the store stays busy past every try: the connection is closed, so that
    the client connects again (its session kept) instead of waiting, connected, for pushes
    that skip it. Its ``$disconnect`` ends the channel as any close does, and the next
    connect is marked ready and pushed to."""
    real_ready = edge.connections.ready

    def always_busy(*_: Any, **__: Any) -> bool:
        raise ServerBusy("the store is busy; retry")

    monkeypatch.setattr(edge.connections, "ready", always_busy)
    edge.connect("c1")
    assert edge.api.closed == ["c1"]
    edge.dropped("c1")
    monkeypatch.setattr(edge.connections, "ready", real_ready)
    edge.connect("c2")
    edge.send("c2", {"action": "subscribe", "subscriptions": [{"filter": "a/#", "qos": 1}]})
    edge.world.publish("a/b", "m0")
    edge.world.route()
    assert texts(edge.messages("c2")) == ["m0"]


def test_a_connect_that_died_after_its_answer_leaves_a_connection_a_push_closes(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The connect's answer went out and the function died before the connection's
    ``ready`` mark (a timeout, a crash): nothing will mark it, and every push skips it. A
    push that finds it so past ``READY_BOUND_MS`` closes it, so that the client connects
    again (its session kept) and gets what waits; one that finds it so sooner (a push
    racing the answer) leaves it be."""
    real_ready = edge.connections.ready

    def dies(*_: Any, **__: Any) -> bool:
        raise Crash("the edge died after posting the connect's answer")

    monkeypatch.setattr(edge.connections, "ready", dies)
    edge.world.clock.advance(0.001)
    # the route answers the function's error; the client had its answer already
    edge.send("c1", {"action": "connect", "client_id": "alice-1", "session_expiry_s": 3600})
    monkeypatch.setattr(edge.connections, "ready", real_ready)
    assert edge.api.sent["c1"][0]["action"] == "connected"
    edge.send("c1", {"action": "subscribe", "subscriptions": [{"filter": "a/#", "qos": 1}]})
    edge.world.publish("a/b", "m0")
    edge.world.route()
    # within the bound: skipped, not closed
    assert edge.messages("c1") == [] and edge.api.closed == []
    edge.world.clock.advance(push_module.READY_BOUND_MS / 1000 + 1)
    edge.world.publish("a/b", "m1")
    edge.world.route()
    assert edge.messages("c1") == [] and edge.api.closed == ["c1"]
    edge.dropped("c1")
    edge.connect("c2")
    assert texts(edge.messages("c2")) == ["m0", "m1"]


def test_a_push_the_queue_refused_after_a_connects_answer_is_handed_over_by_the_sweep(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session reconnects while a message waits for it; the connect's answer goes out and
    its connection is marked ready, then the queue refuses the hand-off of its push (past
    the sender's tries). The client has its answer and will not send its connect again, and
    no new message comes: the sweep's next run hands the push over, and the message goes
    out without another connect."""
    away_while_published(edge, "m0")
    refused_once = FailsFirst(
        edge.queue.hand_off, ServerBusy("the push queue refused a hand-off; retry")
    )
    monkeypatch.setattr(edge.queue, "hand_off", refused_once)
    edge.connect("c2")
    assert refused_once.calls == 1
    assert edge.messages("c2") == []
    edge.sweep()
    assert texts(edge.messages("c2")) == ["m0"]
