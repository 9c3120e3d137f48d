"""A push-queue batch (``PushWorker.handle``): its sessions' first gets side by side, every
session's delivery events appended in one call, and only then its frames; a session whose
push fails returns its chunk without holding the others back."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import boto3
import pytest
import shoal.edge.push as push_module
from botocore.exceptions import ClientError
from shoal.core.config import get_config
from shoal.delivery.events import EVENT_LOG, Recording

from tests.helpers import archive_events
from tests.integration.test_edge import Edge, edge, texts
from tests.integration.test_events_recording import events

__all__ = ["edge"]  # fixture

SESSIONS = 3


def record(edge: Edge, aws: boto3.Session) -> list[list[tuple[str, bytes]]]:
    """Turns the edge's delivery events on; the appends of get events (records keyed by a
    session), one list of records per call."""
    recording = Recording(get_config().streams[EVENT_LOG], edge.world.clock, aws.client("kinesis"))
    edge.world.delivery.events = recording
    log = recording.log()
    real = log.append
    appends: list[list[tuple[str, bytes]]] = []

    def counting(records: Sequence[tuple[str, bytes]]) -> None:
        if any(key.startswith("session/") for key, _ in records):
            appends.append(list(records))
        real(records)

    log.append = counting  # type: ignore[method-assign]
    return appends


def subscribed(edge: Edge) -> list[str]:
    connections = [f"c{n}" for n in range(SESSIONS)]
    for n, connection in enumerate(connections):
        edge.connect(connection, client_id=f"alice-{n}")
        edge.send(
            connection, {"action": "subscribe", "subscriptions": [{"filter": "a/#", "qos": 1}]}
        )
    return connections


@pytest.fixture
def at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A returned chunk is visible again at once (its jittered delay drawn as 0)."""
    monkeypatch.setattr(push_module, "backoff_s", lambda *_: 0.0)


def test_a_batch_appends_its_sessions_delivery_events_in_one_call(
    edge: Edge, aws: boto3.Session
) -> None:
    """One PutRecords for the batch, not one a session; each session's events are still a
    record of its own (its partition key), and each names its delivery."""
    appends = record(edge, aws)
    connections = subscribed(edge)
    edge.world.publish("a/b", "m0")
    edge.world.route()
    for connection in connections:
        assert texts(edge.messages(connection)) == ["m0"], connection
    assert len(appends) == 1, appends
    assert len(appends[0]) == SESSIONS
    archive_events(aws)
    delivered = [e for e in events(aws) if e["event"] == "delivered"]
    ids = sorted(f["id"] for c in connections for f in edge.messages(c))
    assert sorted(e["delivery_id"] for e in delivered) == ids


@pytest.mark.usefixtures("at_once")
def test_no_frame_goes_out_before_its_batchs_events_are_appended(
    edge: Edge, aws: boto3.Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The append fails: no session of the batch is posted what the log does not name. What
    the gets handed out is made due again and the chunks are returned: their retry sends it,
    once each and with ``dup``; the next message goes out at once."""
    appends = record(edge, aws)
    connections = subscribed(edge)
    log = edge.world.delivery.events.log()  # type: ignore[union-attr]
    working = log.append
    failures = {"n": 0}
    posted_before_retry: list[int] = []

    def failing_once(records: list[tuple[str, bytes]]) -> Any:
        if failures["n"] == 0 and any(key.startswith("session/") for key, _ in records):
            failures["n"] += 1
            raise ClientError({"Error": {"Code": "InternalFailure"}}, "PutRecords")
        posted_before_retry.append(sum(len(edge.api.sent[c]) for c in connections))
        return working(records)

    monkeypatch.setattr(log, "append", failing_once)
    edge.world.publish("a/b", "m0")
    edge.world.route()
    assert failures["n"] == 1
    # nothing had been posted when the retry appended its events
    assert posted_before_retry[0] == 2 * SESSIONS  # each connection's connected, subscribed
    for connection in connections:
        [again] = edge.messages(connection)
        assert texts([again]) == ["m0"] and again["dup"] is True, again
    edge.world.publish("a/b", "m1")
    edge.world.route()
    for connection in connections:
        assert texts(edge.messages(connection)) == ["m0", "m1"], connection
    # m1's batch: one append of every session's record
    assert len(appends[-1]) == SESSIONS


def test_a_batch_arms_its_sessions_due_times_before_any_frame(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The due index's write (one due list naming the batch's sessions with deliveries in
    flight) comes before the batch's frames: a worker that dies while posting leaves what it
    handed out timed, so the sweep sends it again after its ack timeout."""
    connections = subscribed(edge)
    steps: list[str] = []
    post, arm = edge.api.post, edge.connections.arm_sessions

    def posting(connection_id: str, frame: str) -> None:
        steps.append("post")
        post(connection_id, frame)

    def arming(*args: Any, **kwargs: Any) -> bool:
        steps.append("arm")
        return arm(*args, **kwargs)

    monkeypatch.setattr(edge.api, "post", posting)
    monkeypatch.setattr(edge.connections, "arm_sessions", arming)
    edge.world.publish("a/b", "m0")
    edge.world.route()
    assert steps == ["arm"] + ["post"] * SESSIONS, steps
    for connection in connections:
        assert texts(edge.messages(connection)) == ["m0"], connection


@pytest.mark.usefixtures("at_once")
def test_a_session_whose_get_is_throttled_returns_its_chunk_alone(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A throttled call in one session's get: the others are pushed; its chunk alone is
    returned to the queue, and its retry pushes it, once."""
    connections = subscribed(edge)
    throttled = edge.connections.connection(connections[1])
    assert throttled is not None
    get = edge.worker._get
    refusals = {"n": 0}

    def getting(push: Any, *args: Any, **kwargs: Any) -> Any:
        if push.session_id == throttled.session_id and refusals["n"] == 0:
            refusals["n"] += 1
            raise ClientError({"Error": {"Code": "ThrottlingException"}}, "PutItem")
        return get(push, *args, **kwargs)

    monkeypatch.setattr(edge.worker, "_get", getting)
    answers: list[dict[str, Any]] = []
    handle = edge.worker.handle

    def recording(event: Any) -> dict[str, Any]:
        answers.append(handle(event))
        return answers[-1]

    monkeypatch.setattr(edge.worker, "handle", recording)
    edge.world.publish("a/b", "m0")
    edge.world.route()
    assert refusals["n"] == 1
    # one chunk returned (the throttled session's lane), then taken again
    assert sum(len(a["batchItemFailures"]) for a in answers) == 1
    assert [texts(edge.messages(c)) for c in connections] == [["m0"]] * SESSIONS
