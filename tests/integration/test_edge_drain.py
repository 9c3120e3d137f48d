"""QoS 0 pushed without state and the ordered drain across storage topics (``shoal.drain``).

A QoS 0 delivery to a connected session is posted from the push work, written nowhere. After
a SwitchProduce, the later storage topic's items wait at the session's gate until the earlier
one is drained and handed out; a QoS 0 frame of the later topic must wait as well, or it
passes earlier messages of its ordering key. The 30-minute soak caught it: one QoS 0 message
reached six WebSocket subscribers before a QoS 1 message of its key published five seconds
earlier, held by the gate while the storage topic the switch left behind drained.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError

from tests.integration.test_delivery_support import World
from tests.integration.test_drain_support import GRACE_MS, Drain, Feed, switch
from tests.integration.test_edge import Edge, texts

T0, T1 = "shoal-orders-0", "shoal-orders-1"
DEFAULT = "shoal-default-0"
KEY = "k"


@pytest.fixture
def edge(aws: boto3.Session, monkeypatch: pytest.MonkeyPatch) -> Iterator[Edge]:
    world = World(aws, monkeypatch)
    world.topic("default")
    world.topic("orders", 1)
    yield Edge(world, monkeypatch)


def publish(edge: Edge, text: str, qos: int) -> None:
    edge.world.publish("orders/eu", text, qos=qos, ordering_key=KEY)


def routed(edge: Edge, feed: Feed, stream: str) -> None:
    """The router over the stream's new records, then the pushes it handed over."""
    feed.route(stream)
    edge.push()


def seal(edge: Edge, drain: Drain, feed: Feed) -> None:
    """T0 sealed once the grace is over, and its seals routed: T0 is fully drained."""
    edge.world.clock.advance(GRACE_MS / 1000 + 1)
    assert drain.sealer.run() == 1
    routed(edge, feed, T0)


def subscribed(edge: Edge, receive_maximum: int = 100) -> None:
    edge.connect("c1", receive_maximum=receive_maximum)
    edge.send("c1", {"action": "subscribe", "subscriptions": [{"filter": "orders/#", "qos": 1}]})


def t1_routed_first(edge: Edge, *t1: str) -> tuple[Drain, Feed]:
    """A subscribed session; m0 (QoS 1) in T0, a switch, then ``t1`` of the same key in T1
    (QoS 0 for names starting with q), and T1 routed before T0."""
    drain, feed = Drain(edge.world), Feed(edge.world)
    subscribed(edge)
    publish(edge, "m0", 1)
    switch("orders", 1)
    for text in t1:
        publish(edge, text, 0 if text.startswith("q") else 1)
    routed(edge, feed, T1)
    return drain, feed


def t0_handed_out(edge: Edge) -> tuple[Drain, Feed]:
    """A subscribed session; m0 (QoS 1) in T0, a switch, T0 routed, sealed and drained, and
    m0 pushed: the session has had all of T0."""
    drain, feed = Drain(edge.world), Feed(edge.world)
    subscribed(edge)
    publish(edge, "m0", 1)
    switch("orders", 1)
    routed(edge, feed, T0)
    seal(edge, drain, feed)
    assert texts(edge.messages("c1")) == ["m0"]
    return drain, feed


@contextmanager
def pushes_held(edge: Edge) -> Iterator[list[dict[str, Any]]]:
    """The pusher's invocations meanwhile taken aside, not run (a push queue behind under
    load): their events, for ``edge.worker.handle`` to run later."""
    held: list[dict[str, Any]] = []

    def hold(event: dict[str, Any]) -> dict[str, Any]:
        held.append(event)
        return {"batchItemFailures": []}

    setattr(edge.worker, "handle", hold)  # noqa: B010 (the instance's, over its method)
    try:
        yield held
    finally:
        delattr(edge.worker, "handle")


def q0_held_before_m1(edge: Edge) -> tuple[Drain, Feed, list[dict[str, Any]]]:
    """A subscribed session; q0 (QoS 0) in T0, a switch, m1 (QoS 1) of the same key in T1;
    T0 routed with its push held: the held pusher events."""
    drain, feed = Drain(edge.world), Feed(edge.world)
    subscribed(edge)
    publish(edge, "q0", 0)
    switch("orders", 1)
    publish(edge, "m1", 1)
    with pushes_held(edge) as held:
        feed.route(T0)
        edge.push()
    return drain, feed, held


def test_a_qos0_message_of_a_storage_topic_still_draining_waits_behind_its_key(
    edge: Edge,
) -> None:
    # Given m0 in T0, then a switch, then m1 (QoS 1) and q2 (QoS 0) of the same key in T1,
    # routed first (T0 is neither routed nor sealed)
    drain, feed = t1_routed_first(edge, "m1", "q2")
    # Then nothing of the key goes out: m1 waits at the gate, and q2 with it
    assert texts(edge.messages("c1")) == []
    # When T0 is routed, sealed and drained, and the next message of T1 brings a push
    routed(edge, feed, T0)
    seal(edge, drain, feed)
    publish(edge, "m3", 1)
    routed(edge, feed, T1)
    # Then the key's messages came in publish order, q2 among them
    assert texts(edge.messages("c1")) == ["m0", "m1", "q2", "m3"]


def test_a_qos0_frame_is_not_posted_past_what_a_session_has_not_had_of_a_drained_topic(
    edge: Edge,
) -> None:
    drain, feed = Drain(edge.world), Feed(edge.world)
    # Given a session whose window holds one message, and m0, m1 of one key in T0
    subscribed(edge, receive_maximum=1)
    publish(edge, "m0", 1)
    publish(edge, "m1", 1)
    switch("orders", 1)
    # When T0 is routed and drained: m0 goes out, m1 waits for the window
    routed(edge, feed, T0)
    seal(edge, drain, feed)
    assert texts(edge.messages("c1")) == ["m0"]
    # When q2 (QoS 0) of the key is published to T1 and routed: T0 is drained, so the
    # router sends it as a frame, but the session has not had m1 yet
    publish(edge, "q2", 0)
    routed(edge, feed, T1)
    # Then q2 does not pass m1: at most once, it is dropped
    assert texts(edge.messages("c1")) == ["m0"]
    [m0] = edge.messages("c1")
    edge.send("c1", {"action": "ack", "ids": [m0["id"]]})
    assert texts(edge.messages("c1")) == ["m0", "m1"]
    # When the session has had all of T0, the next QoS 0 frame of T1 goes out at once
    [_, m1] = edge.messages("c1")
    edge.send("c1", {"action": "ack", "ids": [m1["id"]]})
    publish(edge, "q3", 0)
    routed(edge, feed, T1)
    assert texts(edge.messages("c1")) == ["m0", "m1", "q3"]


def test_what_the_gate_held_is_pushed_once_the_drain_is_over_without_another_message(
    edge: Edge,
) -> None:
    # Given m0 in T0, a switch, and m1 in T1 routed first: the gate holds m1
    drain, feed = t1_routed_first(edge, "m1")
    assert texts(edge.messages("c1")) == []
    # A sweep while the gate is closed pushes nothing and looks again later
    edge.world.clock.advance(3)
    edge.sweep()
    assert texts(edge.messages("c1")) == []
    # When T0 is routed, sealed and drained, and nothing more is published
    routed(edge, feed, T0)
    seal(edge, drain, feed)
    assert texts(edge.messages("c1")) == ["m0"]
    # Then the sweep pushes what the gate held
    edge.world.clock.advance(3)
    edge.sweep()
    assert texts(edge.messages("c1")) == ["m0", "m1"]


def test_a_gate_that_cannot_be_read_keeps_the_qos0_frame_from_passing(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    drain, feed = t0_handed_out(edge)

    # Given the gate's reads refused (throttled) while a QoS 0 frame of T1 is pushed
    real = drain.session_gate.opens
    refusing = [True]

    def refused(*args: Any, **kwargs: Any) -> bool:
        if refusing[0]:
            raise ClientError(
                {"Error": {"Code": "ProvisionedThroughputExceededException", "Message": "-"}},
                "Query",
            )
        return real(*args, **kwargs)

    monkeypatch.setattr(drain.session_gate, "opens", refused)
    publish(edge, "q1", 0)
    routed(edge, feed, T1)
    # Then the frame is dropped (not known to be in order), and the push went on
    assert texts(edge.messages("c1")) == ["m0"]
    refusing[0] = False
    publish(edge, "m2", 1)
    routed(edge, feed, T1)
    assert texts(edge.messages("c1")) == ["m0", "m2"]


def test_a_session_pushed_only_qos0_asks_its_gate_once_after_a_switch(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session pushed only QoS 0 frames has no state written, so its state never remembers
    that it passed the drained storage topic: the gate remembers it (passing is forever)."""
    # Given a session that had all of T0, sealed and drained after a switch
    drain, feed = t0_handed_out(edge)
    asked: list[str] = []
    real = drain.session_gate._handed_out

    def counted(session_id: str, *args: Any) -> bool:
        asked.append(session_id)
        return real(session_id, *args)

    monkeypatch.setattr(drain.session_gate, "_handed_out", counted)
    # When three QoS 0 messages of T1 are pushed, one by one
    for text in ("q1", "q2", "q3"):
        publish(edge, text, 0)
        routed(edge, feed, T1)
    # Then each went out, and the gate read the session's inbox for the first only
    assert texts(edge.messages("c1")) == ["m0", "q1", "q2", "q3"]
    assert len(asked) == 1


def test_a_qos0_frame_of_a_storage_topic_the_session_passed_is_not_posted_after_its_successor(
    edge: Edge,
) -> None:
    """The 30-minute soak at 200 clients caught a QoS 0 frame of T0 posted 13 s after a QoS 1
    delivery of its key from T1: the frame waited in the push queue, not in the inbox, so the
    gate let T1 out without it."""
    # Given q0 (QoS 0) in T0, a switch, then m1 (QoS 1) of the same key in T1
    # When T0 is routed but its push is held (a push queue behind under load)
    drain, feed, held = q0_held_before_m1(edge)
    assert held and texts(edge.messages("c1")) == []
    # and T0 is sealed and drained, and m1 routed from T1 and pushed first
    seal(edge, drain, feed)
    routed(edge, feed, T1)
    assert texts(edge.messages("c1")) == ["m1"]
    # Then the held push, run late, does not post q0 after m1 (at most once: dropped)
    for event in held:
        assert edge.worker.handle(event) == {"batchItemFailures": []}
    assert texts(edge.messages("c1")) == ["m1"]
    # and a QoS 0 frame of T1 still goes out
    publish(edge, "q2", 0)
    routed(edge, feed, T1)
    assert texts(edge.messages("c1")) == ["m1", "q2"]


def test_a_qos0_frame_goes_before_a_later_message_of_its_source_whatever_other_sources_frames_lead(
    edge: Edge,
) -> None:
    """A push of several records holds QoS 0 frames of several sources, in record order. A
    message handed out went after the frames of its source that come before it only when they
    led the list: a frame of another source ahead of them kept them back, and they went out
    after it (the 30-minute soak at 200 clients, seed 11: a QoS 0 frame 1.5 s after a later
    QoS 1 message of its key, both in one push)."""
    edge.connect("c1")
    subscriptions = [{"filter": "orders/#", "qos": 1}, {"filter": "a/#", "qos": 1}]
    edge.send("c1", {"action": "subscribe", "subscriptions": subscriptions})
    # Given qB (QoS 0) in the orders topic, then qA (QoS 0) and mA (QoS 1) of one key in the
    # default topic, each routed with its push held
    feed = Feed(edge.world)
    with pushes_held(edge) as held:
        edge.world.publish("orders/x", "qB", qos=0)
        feed.route(T0)
        edge.push()
        edge.world.publish("a/x", "qA", qos=0, ordering_key=KEY)
        edge.world.publish("a/x", "mA", qos=1, ordering_key=KEY)
        feed.route(DEFAULT)
        edge.push()
    records = [r for event in held for r in event["Records"]]
    assert len(records) == 2
    # When one invocation takes both records, the orders topic's first
    assert edge.worker.handle({"Records": records}) == {"batchItemFailures": []}
    # Then qA goes before mA, its key's later message
    sent = texts(edge.messages("c1"))
    assert sorted(sent) == ["mA", "qA", "qB"]
    assert sent.index("qA") < sent.index("mA")


def test_a_qos0_frame_of_an_earlier_storage_topic_goes_before_a_later_ones_message_in_one_push(
    edge: Edge,
) -> None:
    """A push of two records, one carrying a QoS 0 frame of T0 and one naming T1's items: its
    get found T0 drained and handed out (the frame is in no inbox) and let T1's message out,
    and the frame, of another source, went after it. The soak at 200 clients (seed 11, 8
    minutes, no kills) saw a QoS 0 message posted 2 s after a QoS 1 message of its key
    published 47 s after it, the topic switched between them."""
    # Given q0 (QoS 0) in T0, a switch, then m1 (QoS 1) of the same key in T1; T0 routed
    # with its push held (a push queue behind under load), then sealed and drained
    drain, feed, held = q0_held_before_m1(edge)
    seal(edge, drain, feed)
    # and T1 routed with its push held too
    with pushes_held(edge) as later:
        feed.route(T1)
        edge.push()
    records = [r for event in held + later for r in event["Records"]]
    assert len(records) == 2
    assert texts(edge.messages("c1")) == []
    # When one invocation takes both records, T0's first
    assert edge.worker.handle({"Records": records}) == {"batchItemFailures": []}
    # Then q0 goes out before m1, its key's later message
    assert texts(edge.messages("c1")) == ["q0", "m1"]
