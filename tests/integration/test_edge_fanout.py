"""The fan-out through the push queue (``shoal.edge.pushwork``, ``shoal.edge.push``): throttled
posts delivered later, a session's racing pushes kept in order by its lane, and a router
invocation whose work does not grow with its connected subscribers."""

from __future__ import annotations

import dataclasses
import inspect
import random
from collections import Counter
from typing import Any

import pytest
import shoal.edge.push as push_module
from shoal.aws.dynamo import Dynamo
from shoal.core import metrics
from shoal.edge.connections import Connection

import functions.router.app as router_app
from tests.integration.test_edge import Edge, edge, texts

__all__ = ["edge"]  # fixture


def subscribed(edge: Edge, n: int, **connect: Any) -> list[str]:
    connections = [f"c{k}" for k in range(n)]
    for k, connection in enumerate(connections):
        edge.connect(connection, client_id=f"alice-{k}", **connect)
        edge.send(
            connection, {"action": "subscribe", "subscriptions": [{"filter": "a/#", "qos": 1}]}
        )
    return connections


def test_throttled_posts_are_delivered_later_none_lost_none_twice(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``@connections`` refuses a share of posts as throttled (429 LimitExceededException).
    A refused post is tried again with backoff and jitter; one refused past its tries makes
    what its push handed out and did not post due again and returns its chunk, whose retry
    sends it: every session gets every message once, in publish order."""
    # Given 12 connected sessions, and @connections refusing 60 % of the deliveries' posts
    # (seeded: some are refused six times running, past their tries)
    connections = subscribed(edge, 12)
    rng = random.Random(7)
    edge.api.throttle = lambda _connection, frame: (
        frame["action"] == "message" and rng.random() < 0.6
    )
    # a returned chunk is visible again at once (its jittered delay drawn as 0)
    monkeypatch.setattr(push_module, "backoff_s", lambda *_: 0.0)
    gave_up: list[str] = []
    post = edge.api.post

    def counting(connection_id: str, frame: str) -> None:
        try:
            post(connection_id, frame)
        except push_module.PostThrottled:
            gave_up.append(connection_id)
            raise

    monkeypatch.setattr(edge.api, "post", counting)
    # When 5 messages of one ordering key are published and routed
    for n in range(5):
        edge.world.publish("a/b", f"m{n}")
    edge.world.route()
    # Then some posts were refused past their tries (else this proves nothing) ...
    assert gave_up
    assert sum(edge.api.refused.values()) >= 6 * len(gave_up)
    # ... and every session got every message once, in order
    for connection in connections:
        frames = edge.messages(connection)
        assert texts(frames) == [f"m{n}" for n in range(5)], connection
        assert len({f["id"] for f in frames}) == 5


def test_a_router_push_and_an_ack_push_of_one_session_keep_the_keys_order(edge: Edge) -> None:
    """The two pushes race for the session (an ack opened its window while a router batch
    was routed): both go to the session's lane, which the pusher takes in order, one batch
    at a time, so frames leave in the order their deliveries were handed out. Deterministic:
    both are handed over before the pusher runs."""
    # Given a session with a window of 2, and messages of one key waiting behind it
    subscribed(edge, 1, receive_maximum=2)
    for n in range(3):
        edge.world.publish("a/b", f"m{n}", ordering_key="k")
    edge.world.route()
    assert texts(edge.messages("c0")) == ["m0", "m1"]
    # When an ack opens the window and, before any push runs, a router batch hands over m3
    pushes = edge.push
    edge.push = lambda: 0  # type: ignore[method-assign]
    first = edge.api.sent["c0"][-2]
    edge.send("c0", {"action": "ack", "ids": [first["id"]]})
    edge.world.publish("a/b", "m3", ordering_key="k")
    edge.world.route()
    # both pushes wait in the session's lane
    sqs = edge.world.session.client("sqs")
    waiting = sqs.get_queue_attributes(
        QueueUrl=edge.queue.url, AttributeNames=["ApproximateNumberOfMessages"]
    )["Attributes"]["ApproximateNumberOfMessages"]
    assert int(waiting) == 2
    edge.push = pushes  # type: ignore[method-assign]
    # Then the frames keep the key's order, each once; acks let the rest out in order
    for _ in range(3):
        edge.send("c0", {"action": "ack", "ids": [f["id"] for f in edge.messages("c0")]})
    frames = edge.messages("c0")
    assert texts(frames) == ["m0", "m1", "m2", "m3"]
    assert not any(f["dup"] for f in frames)


def test_a_gone_connection_in_a_chunk_holds_back_no_other_session(edge: Edge) -> None:
    connections = subscribed(edge, 3)
    edge.api.gone.add("c1")
    edge.world.publish("a/b", "m0")
    edge.world.route()
    assert [texts(edge.messages(c)) for c in connections] == [["m0"], [], ["m0"]]
    # the gone connection's session is no longer a push target (its $disconnect is owed)
    found = edge.connections.connection("c1")
    assert found is not None
    assert edge.connections.targets([found.session_id]) == []


def _router_calls(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """The AWS calls router invocations make from now on, by service and operation."""
    calls = Counter[str]()
    real = Dynamo.call

    def counting(self: Dynamo, operation: str, **request: Any) -> Any:
        if _in_router():
            calls[f"dynamodb.{operation}"] += 1
        return real(self, operation, **request)

    monkeypatch.setattr(Dynamo, "call", counting)
    queue = router_app.router().queue
    assert queue is not None
    send = queue.sqs.send_message_batch

    def sending(**request: Any) -> Any:
        calls["sqs.send_message_batch"] += 1
        return send(**request)

    monkeypatch.setattr(queue.sqs, "send_message_batch", sending)
    return calls


def _in_router() -> bool:
    return any(f.filename.endswith("router/batch.py") for f in inspect.stack())


@pytest.mark.parametrize("connected", [16, 1000])
def test_a_router_invocations_work_does_not_grow_with_its_connected_subscribers(
    edge: Edge, monkeypatch: pytest.MonkeyPatch, connected: int
) -> None:
    """Counted, not timed: one publish to 16 connected subscribers and to 1,000. The router's
    calls for 1,000 are those for 16 but for writing the deliveries (25 items a batch write)
    and the carrier's hand-off (a queue message per lane, ten a call): it reads nobody's
    connection past a hundred sessions (the pusher does), and posts nothing."""
    world = edge.world
    # Given the subscribers, each connected (as a connect's bind and answer leave it)
    for k in range(connected):
        client_id = f"alice-{k}"
        channel = world.connect(client_id, clean_start=False, session_expiry_s=3600)
        world.subscribe(client_id, channel, {"filter": "a/#", "qos": 1})
        head = world.registry.repository.head(client_id)
        assert head is not None and head.session_id is not None
        connection = Connection(f"c{k}", client_id, "alice", channel, head.session_id, 100, 0)
        edge.connections.bind(connection)
        edge.connections.ready(connection)
    calls = _router_calls(monkeypatch)
    posted = metrics_count(monkeypatch)
    pushes = edge.push
    edge.push = lambda: 0  # type: ignore[method-assign]
    world.publish("a/b", "x")
    world.route()
    # Then: the writes of the deliveries, a hand-off of a message per lane at most ...
    assert calls.pop("dynamodb.batch_write_item") == -(-connected // 25)
    lanes = min(connected, edge.queue.lanes)
    assert calls.pop("sqs.send_message_batch") <= -(-lanes // 10)
    # ... the subscription store's versions, and one read of who is connected for 16, not
    # for 1,000 (one batch read each) ...
    assert calls.pop("dynamodb.batch_get_item", 0) == (2 if connected <= 100 else 1)
    # ... the same few reads and writes of its own otherwise (the ledger's read and move, a
    # query), and no post
    assert sum(calls.values()) <= 3, calls
    assert posted == []
    # and the pusher then reaches every one of them
    edge.push = pushes  # type: ignore[method-assign]
    edge.push()
    assert sum(len(edge.api.sent[f"c{k}"]) for k in range(connected)) == connected


def metrics_count(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The router invocations' pushed frames (``FramesPushed``) from now on."""
    pushed: list[int] = []
    real = push_module.count

    def counting(name: str, value: int = 1) -> None:
        if name == metrics.PUSHED and _in_router():
            pushed.append(value)
        real(name, value)

    monkeypatch.setattr(push_module, "count", counting)
    return pushed


def test_a_chunk_carries_the_archive_lines_of_its_own_sessions(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch of many clients' own messages (a backend publishing to each its command): their
    archive lines together are over what a queue message carries, but each chunk carries
    only its sessions' lines, so no push reads the archive back."""
    payloads = edge.world.delivery.payloads
    assert payloads is not None
    reads: list[str] = []
    real = payloads.s3.get_object

    def counting(**request: Any) -> Any:
        reads.append(request["Key"])
        return real(**request)

    monkeypatch.setattr(payloads.s3, "get_object", counting)
    clients = 40
    for k in range(clients):
        edge.connect(f"c{k}", client_id=f"alice-{k}")
        edge.send(f"c{k}", {"action": "subscribe", "subscriptions": [{"filter": f"own/{k}"}]})
    # 40 messages of 2 KB in one batch: 80 KB of lines, over a message's 64 KB of them
    edge.world.publish_batch(
        [{"topic": f"own/{k}", "text": f"{k}:" + "x" * 2048} for k in range(clients)]
    )
    edge.world.route()
    for k in range(clients):
        [frame] = edge.messages(f"c{k}")
        assert texts([frame])[0].startswith(f"{k}:")
    assert reads == []


def test_a_large_fan_out_hands_each_part_over_as_it_is_written(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fan-out to many sessions is written in parts, and each part's pushes are handed
    over once its items are written, not after the last part: the pushers post the first
    parts while the router writes the next. Every session still gets the message once."""
    import shoal.router.fanout as fanout_module

    # Given parts of 10 sessions (2,000 deployed) and 40 connected subscribers
    monkeypatch.setattr(fanout_module, "PIPELINE_SESSIONS", 10)
    connections = subscribed(edge, 40)
    steps: list[str] = []
    inbox = router_app.router().fanout.inbox
    put, hand_off = inbox.put, edge.queue.hand_off

    def putting(items: Any) -> None:
        steps.append("write")
        put(items)

    def handing(sessions: Any, **kwargs: Any) -> int:
        steps.append("hand off")
        return hand_off(sessions, **kwargs)

    monkeypatch.setattr(inbox, "put", putting)
    monkeypatch.setattr(edge.queue, "hand_off", handing)
    # When one message is published and routed
    edge.world.publish("a/b", "m0")
    edge.world.route()
    # Then four parts went, each written then handed over, and every session got it once
    assert steps == ["write", "hand off"] * 4, steps
    assert [texts(edge.messages(c)) for c in connections] == [["m0"]] * 40


def test_qos0_frames_carried_whole_keep_their_place_among_written_deliveries(edge: Edge) -> None:
    """The router writes a connected session's QoS 1 deliveries and carries its QoS 0 ones
    whole in the push (written nowhere): the push posts each QoS 0 frame where its message
    stands in the source among what its get hands out, so the ordering key's order holds
    across QoS levels (design property 3)."""
    subscribed(edge, 1)
    for n, qos in enumerate((1, 0, 1, 0)):
        edge.world.publish("a/b", f"m{n}", ordering_key="k", qos=qos)
    edge.world.route()
    frames = edge.messages("c0")
    assert texts(frames) == ["m0", "m1", "m2", "m3"]
    assert [f["qos"] for f in frames] == [1, 0, 1, 0]


def test_a_qos0_frame_a_later_delivery_overtook_is_dropped_not_posted_out_of_order(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A push handed over before a router batch (an ack's, a sweep's) runs after the next
    batch was written and hands that batch's QoS 1 delivery out first; the QoS 0 frame the
    first batch carries is then behind it. Posted, it would break the key's order: it is
    dropped (QoS 0 is at most once, MQTT 5 §4.3.1) and its event says why."""
    subscribed(edge, 1)
    found = edge.connections.connection("c0")
    assert found is not None
    # Given a push of the session waiting in its lane, then two batches handed over behind it
    qos0_then_qos1_behind_a_waiting_push(edge, found.session_id)
    # When the pusher takes the lane in order, a record a batch (the three in one batch would
    # be one push, which orders them itself)
    monkeypatch.setattr(edge, "mapping", dataclasses.replace(edge.mapping, batch_size=1))
    frames = edge.messages("c0")
    # Then m1 went out (by the first push, from the inbox) and m0 never after it
    assert texts(frames) == ["m1"]
    assert edge.worker.last.frames == 0  # the batch's own push posted nothing


def test_a_returned_chunk_posts_its_qos0_frames_once(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk whose QoS 1 post was throttled past its tries comes back from the queue; the
    QoS 0 frame it carries went out the first time and is not posted again (at most once),
    while the QoS 1 delivery is sent again, after it."""
    subscribed(edge, 1)
    refused = {"n": 0}

    def throttle(_connection: str, frame: dict[str, Any]) -> bool:
        if frame["action"] == "message" and frame["qos"] == 1 and refused["n"] < 6:
            refused["n"] += 1
            return True
        return False

    edge.api.throttle = throttle
    monkeypatch.setattr(push_module, "backoff_s", lambda *_: 0.0)
    edge.world.publish("a/b", "m0", ordering_key="k", qos=0)
    edge.world.publish("a/b", "m1", ordering_key="k", qos=1)
    edge.world.route()
    frames = edge.messages("c0")
    assert refused["n"] == 6
    assert texts(frames) == ["m0", "m1"]


def test_a_qos0_frame_does_not_pass_a_message_its_full_window_holds_back(edge: Edge) -> None:
    """QoS 0 is not subject to the window (MQTT 5 §4.9), but a QoS 0 frame carried past a
    QoS 1 message of its key that a full window holds back would overtake it: it is dropped
    (at most once). One the window holds nothing back for goes out at once."""
    subscribed(edge, 1, receive_maximum=1)
    # m0 fills the window, m1 waits behind it, m2 (QoS 0) comes after m1
    for n, qos in enumerate((1, 1, 0)):
        edge.world.publish("a/b", f"m{n}", ordering_key="k", qos=qos)
    edge.world.route()
    assert texts(edge.messages("c0")) == ["m0"]
    edge.send("c0", {"action": "ack", "ids": [edge.messages("c0")[-1]["id"]]})
    assert texts(edge.messages("c0")) == ["m0", "m1"]
    edge.send("c0", {"action": "ack", "ids": [edge.messages("c0")[-1]["id"]]})
    # with the window full and nothing waiting behind it, a QoS 0 frame goes out at once
    edge.world.publish("a/b", "m3", ordering_key="k", qos=1)
    edge.world.publish("a/b", "m4", ordering_key="k", qos=0)
    edge.world.route()
    assert texts(edge.messages("c0")) == ["m0", "m1", "m3", "m4"]


def qos0_then_qos1_behind_a_waiting_push(edge: Edge, session_id: str) -> None:
    """A push of the session waits in its lane; then a QoS 0 ``m0`` and a QoS 1 ``m1`` of
    key ``k`` are routed, each batch's push handed over behind it (none run yet)."""
    pushes = edge.push
    edge.push = lambda: 0  # type: ignore[method-assign]
    edge.queue.hand_off([session_id])
    edge.world.publish("a/b", "m0", ordering_key="k", qos=0)
    edge.world.route()
    edge.world.publish("a/b", "m1", ordering_key="k", qos=1)
    edge.world.route()
    edge.push = pushes  # type: ignore[method-assign]
