"""The router's push in waves (``Pusher.push_sessions``): each wave of sessions takes its
leases and hands its deliveries out, appends every session's delivery events in one call, and
only then posts its frames."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import boto3
import pytest
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


def test_a_wave_appends_its_sessions_delivery_events_in_one_call(
    edge: Edge, aws: boto3.Session
) -> None:
    """One PutRecords for the wave, not one a session; each session's events are still a
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


def test_no_frame_goes_out_before_its_waves_events_are_appended(
    edge: Edge, aws: boto3.Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The append fails: no session of the wave is posted what the log does not name. Each
    gives its lease back armed, so the sweep alone sends the deliveries again after their ack
    timeout, once each and with ``dup``; the next message is pushed at once."""
    appends = record(edge, aws)
    connections = subscribed(edge)
    log = edge.world.delivery.events.log()  # type: ignore[union-attr]
    working = log.append
    failures = {"n": 0}

    def failing_once(records: list[tuple[str, bytes]]) -> Any:
        if failures["n"] == 0 and any(key.startswith("session/") for key, _ in records):
            failures["n"] += 1
            raise ClientError({"Error": {"Code": "InternalFailure"}}, "PutRecords")
        return working(records)

    monkeypatch.setattr(log, "append", failing_once)
    edge.world.publish("a/b", "m0")
    edge.world.route()
    assert failures["n"] == 1
    for connection in connections:
        assert edge.messages(connection) == [], connection
    # no other trigger: the sweep alone sends them again
    edge.world.clock.advance(edge.world.settings.ack_timeout_s + 1)
    assert edge.pusher.sweep().pushed == SESSIONS
    for connection in connections:
        [again] = edge.messages(connection)
        assert texts([again]) == ["m0"] and again["dup"] is True, again
    # the leases were given back: the next message goes out at once
    edge.world.publish("a/b", "m1")
    edge.world.route()
    for connection in connections:
        assert texts(edge.messages(connection)) == ["m0", "m1"], connection
    # m1's wave: one append of every session's record
    assert len(appends[-1]) == SESSIONS


def test_a_wave_posts_every_frame_before_it_gives_a_lease_back(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The releases (a conditional write each) come after all the wave's frames, so that no
    frame waits behind another session's release."""
    connections = subscribed(edge)
    steps: list[str] = []
    post, release = edge.api.post, edge.connections.release

    def posting(connection_id: str, frame: str) -> None:
        steps.append("post")
        post(connection_id, frame)

    def releasing(*args: Any, **kwargs: Any) -> bool:
        steps.append("release")
        return release(*args, **kwargs)

    monkeypatch.setattr(edge.api, "post", posting)
    monkeypatch.setattr(edge.connections, "release", releasing)
    edge.world.publish("a/b", "m0")
    edge.world.route()
    assert steps == ["post"] * SESSIONS + ["release"] * SESSIONS, steps
    for connection in connections:
        assert texts(edge.messages(connection)) == ["m0"], connection


def test_a_session_whose_lease_cannot_be_taken_fails_the_batch_after_the_others(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A throttled lease write for one session of a wave: the others are pushed and give
    their leases back; the error is raised after them, so the router's batch is retried (as
    it was when each session pushed alone)."""
    connections = subscribed(edge)
    throttled = edge.connections.connection(connections[1])
    assert throttled is not None
    take = edge.connections.take_lease

    def taking(connection: Any) -> str | None:
        if connection.session_id == throttled.session_id:
            raise ClientError({"Error": {"Code": "ThrottlingException"}}, "UpdateItem")
        return take(connection)

    monkeypatch.setattr(edge.connections, "take_lease", taking)
    edge.world.publish("a/b", "m0")
    # the router's push: the first and third sessions get the message
    edge.world.route()
    assert [texts(edge.messages(c)) for c in connections] == [["m0"], [], ["m0"]]
    # and the push raises once they are done (the router's invocation fails, as it did)
    sessions = [edge.connections.connection(c) for c in connections]
    with pytest.raises(ClientError):
        edge.pusher.push_sessions([s.session_id for s in sessions if s is not None])
    # the retried batch's push, once the lease can be taken, reaches the third session only
    monkeypatch.setattr(edge.connections, "take_lease", take)
    assert edge.pusher.push_sessions([s.session_id for s in sessions if s is not None]) == 1
    assert [texts(edge.messages(c)) for c in connections] == [["m0"]] * SESSIONS
