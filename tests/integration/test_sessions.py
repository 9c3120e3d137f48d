"""Sessions through the handler over moto: every branch of connect, and the session calls."""

from __future__ import annotations

import base64
from typing import Any

import jsonschema
import pytest
from shoal import wiring
from shoal.core.config import get_config
from shoal.sessions.model import MAX_WILL_PAYLOAD_BYTES, Version
from shoal.sessions.registry import SessionRegistry
from shoal.sessions.repository import SessionRepository

import functions.sessions.app as sessions_app
from tests.helpers import FakeContext, load_event
from tests.integration.test_sessions_support import (
    MALLORY,
    DynamoCalls,
    Interleaved,
    Sessions,
    account,
    clock,
    sessions,
)
from tests.unit.test_openapi import schema

__all__ = ["account", "clock", "sessions"]  # fixtures

CLIENT = "sensor-1"


def interleaved(sessions: Sessions, monkeypatch: pytest.MonkeyPatch, **kw: Any) -> Interleaved:
    """Swap the handler's repository for one the test can act inside of."""
    repository = Interleaved(sessions.repository)
    registry = SessionRegistry(repository, sessions.clock, **kw)
    monkeypatch.setattr(sessions_app, "registry", lambda: registry)
    sessions.registry = registry
    return repository


# --- connect: new, resume, discard


def test_first_connect_starts_a_new_session(sessions: Sessions) -> None:
    status, body = sessions.connect(CLIENT, clean_start=False, keepalive_s=30)
    assert status == 200
    assert body["session_present"] is False
    assert body["keepalive_s"] == 30
    view = sessions.view(CLIENT)
    assert view.head is not None and view.head.channel == body["channel"]
    assert view.registrations == (Version.parse(body["channel"]),)


def test_connect_version_defaults_to_the_gateway_request_time(sessions: Sessions) -> None:
    channel = sessions.connected(CLIENT)
    assert Version.parse(channel).connected_at_ms == sessions.clock.now_ms()


def test_reconnect_with_clean_start_false_resumes_the_session(sessions: Sessions) -> None:
    first = sessions.connected(CLIENT, clean_start=False, session_expiry_s=300)
    sessions.clock.advance(1)
    status, body = sessions.connect(CLIENT, clean_start=False, session_expiry_s=300)
    assert (status, body["session_present"]) == (200, True)
    assert body["channel"] != first


def test_taking_over_a_session_that_ends_with_its_channel_finds_none(sessions: Sessions) -> None:
    # Given a live channel with subscriptions whose session expiry is 0
    first = sessions.connected(CLIENT, clean_start=False, session_expiry_s=0)
    sessions.give_session(CLIENT, first, {"devices/+/temp": {"qos": 1}})
    sessions.clock.advance(1)
    # When a persistent connect takes it over
    status, body = sessions.connect(CLIENT, clean_start=False, session_expiry_s=300)
    # Then no session is present, and the new one starts empty (MQTT 5 §3.1.2.11.2)
    assert (status, body["session_present"]) == (200, False)
    view = sessions.view(CLIENT)
    assert view.head is not None and view.head.subscriptions == {}


def test_takeover_keeps_the_session_and_its_subscriptions(sessions: Sessions) -> None:
    # Given a session with subscriptions
    first = sessions.connected(CLIENT, clean_start=False, session_expiry_s=300)
    sessions.give_session(CLIENT, first, {"devices/+/temp": {"qos": 1}})
    head = sessions.view(CLIENT).head
    assert head is not None
    session_id = head.session_id
    # When a new channel takes it over
    sessions.clock.advance(1)
    second = sessions.connected(CLIENT, clean_start=False, session_expiry_s=300)
    # Then the session and its subscriptions moved with it
    status, body = sessions.get(CLIENT, second)
    assert status == 200
    assert body["subscriptions"] == [{"filter": "devices/+/temp", "qos": 1}]
    assert body["session_id"] == session_id


def test_resume_after_disconnect_within_expiry_keeps_the_session(sessions: Sessions) -> None:
    first = sessions.connected(CLIENT, clean_start=False, session_expiry_s=60)
    sessions.give_session(CLIENT, first, {"a/#": {"qos": 0}})
    assert sessions.disconnect(CLIENT, first)[0] == 204
    sessions.clock.advance(59)
    status, body = sessions.connect(CLIENT, clean_start=False, session_expiry_s=60)
    assert (status, body["session_present"]) == (200, True)
    assert sessions.get(CLIENT, body["channel"])[1]["subscriptions"] == [
        {"filter": "a/#", "qos": 0}
    ]


def test_session_is_gone_after_its_expiry(sessions: Sessions) -> None:
    first = sessions.connected(CLIENT, clean_start=False, session_expiry_s=60)
    sessions.give_session(CLIENT, first, {"a/#": {"qos": 0}})
    sessions.disconnect(CLIENT, first)
    sessions.clock.advance(60)
    status, body = sessions.connect(CLIENT, clean_start=False, session_expiry_s=60)
    assert (status, body["session_present"]) == (200, False)
    answer = sessions.get(CLIENT, body["channel"])[1]
    assert answer["subscriptions"] == []


def test_session_expiry_zero_ends_the_session_at_disconnect(sessions: Sessions) -> None:
    first = sessions.connected(CLIENT, clean_start=False, session_expiry_s=0)
    sessions.disconnect(CLIENT, first)
    status, body = sessions.connect(CLIENT, clean_start=False)
    assert (status, body["session_present"]) == (200, False)


def test_clean_start_discards_the_session(sessions: Sessions) -> None:
    first = sessions.connected(CLIENT, clean_start=False, session_expiry_s=300)
    sessions.give_session(CLIENT, first, {"a/#": {"qos": 0}})
    sessions.clock.advance(1)
    status, body = sessions.connect(CLIENT, clean_start=True, session_expiry_s=300)
    assert (status, body["session_present"]) == (200, False)
    answer = sessions.get(CLIENT, body["channel"])[1]
    assert answer["subscriptions"] == []


# --- connect: the registry's branches


def test_older_connect_is_outdated_after_one_cheap_read(sessions: Sessions) -> None:
    # Given a channel registered at t
    sessions.connected(CLIENT, connected_at_ms=sessions.clock.now_ms())
    before = sessions.items(CLIENT)
    calls = DynamoCalls(sessions.repository.dynamo.client)
    # When a connect from before t arrives
    status, body = sessions.connect(CLIENT, connected_at_ms=sessions.clock.now_ms() - 1)
    # Then it is refused from the eventually consistent read alone, and nothing changed
    assert (status, body["error"]["code"]) == (409, "channel_outdated")
    assert calls.take() == ["Query"]
    assert sessions.items(CLIENT) == before


def test_outdated_after_the_strong_read(
    sessions: Sessions, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a newer channel that the eventually consistent read does not show yet
    sessions.connected(CLIENT, connected_at_ms=sessions.clock.now_ms())
    before = sessions.items(CLIENT)
    repository = interleaved(sessions, monkeypatch)
    repository.stale_reads = True
    calls = DynamoCalls(repository.dynamo.client)
    # When an older connect passes the cheap check and tries to commit
    status, body = sessions.connect(CLIENT, connected_at_ms=sessions.clock.now_ms() - 1)
    # Then its condition fails, RealMax is newer, and it is refused without a change
    assert (status, body["error"]["code"]) == (409, "channel_outdated")
    assert calls.take() == ["TransactWriteItems", "Query"]
    assert sessions.items(CLIENT) == before


def test_newest_connect_retries_against_a_racer_that_won(
    sessions: Sessions, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = sessions.clock.now_ms()
    sessions.connected(CLIENT, clean_start=False, session_expiry_s=300, connected_at_ms=now - 10)
    repository = interleaved(sessions, monkeypatch)
    stats = sessions.registry.stats
    racer: list[str] = []
    # Given an older racer that commits between our read and our transaction
    repository.on_register = lambda: racer.append(
        sessions.connected(CLIENT, clean_start=False, session_expiry_s=300, connected_at_ms=now - 5)
    )
    # When we (the newest) connect
    status, body = sessions.connect(CLIENT, clean_start=False, connected_at_ms=now)
    # Then we retried against the racer and won; the racer is taken over
    assert (status, body["session_present"]) == (200, True)
    # (the racer: one attempt; ours: two)
    assert (stats.connects, stats.attempts) == (2, 3)
    assert sessions.heartbeat(CLIENT, racer[0])[1]["error"]["code"] == "session_taken_over"
    assert sessions.view(CLIENT).registrations == (Version.parse(body["channel"]),)


def test_registry_moving_backwards_aborts_without_a_change(
    sessions: Sessions, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a live channel that the eventually consistent read shows (LocalMax) ...
    first = sessions.connected(CLIENT, clean_start=False, session_expiry_s=300)
    repository = interleaved(sessions, monkeypatch)

    def deregisters(consistent: bool) -> None:
        # ... and that disconnects before our transaction: its registration is gone
        if not consistent:
            assert repository.disconnect(CLIENT, Version.parse(first), "alice", 0)

    repository.on_read = deregisters
    before: list[dict[str, Any]] = []
    repository.on_register = lambda: before.extend(sessions.items(CLIENT))
    sessions.clock.advance(1)
    # When we connect: ours > LocalMax > RealMax (none)
    status, body = sessions.connect(CLIENT, clean_start=False)
    # Then the connect aborts with a retryable answer and writes nothing
    assert (status, body["error"]["code"]) == (503, "server_busy")
    assert sessions.registry.stats.aborted == 1
    assert sessions.items(CLIENT) == before
    assert sessions.view(CLIENT).registrations == ()


def test_disconnected_channel_holds_off_no_reconnect(sessions: Sessions) -> None:
    # Given a channel that disconnected cleanly
    now = sessions.clock.now_ms()
    first = sessions.connected(CLIENT, clean_start=False, session_expiry_s=300, connected_at_ms=now)
    sessions.disconnect(CLIENT, first)
    # When a reconnect carries an earlier time (another gateway host's clock, say)
    status, body = sessions.connect(
        CLIENT, clean_start=False, session_expiry_s=300, connected_at_ms=now - 1
    )
    # Then it resumes the session all the same
    assert (status, body["session_present"]) == (200, True)


def test_own_commit_seen_on_the_strong_read_is_success(
    sessions: Sessions, monkeypatch: pytest.MonkeyPatch
) -> None:
    repository = interleaved(sessions, monkeypatch)
    repository.lose_own_commit = True
    status, body = sessions.connect(CLIENT)
    assert status == 200
    assert sessions.view(CLIENT).registrations == (Version.parse(body["channel"]),)
    assert sessions.heartbeat(CLIENT, body["channel"])[0] == 200


def test_retries_that_run_out_of_time_answer_server_busy(
    sessions: Sessions, monkeypatch: pytest.MonkeyPatch
) -> None:
    sessions.connected(CLIENT)
    before = sessions.items(CLIENT)
    repository = interleaved(sessions, monkeypatch, budget_s=0.5)
    # Given a transaction that keeps failing while RealMax stays below ours
    monkeypatch.setattr(SessionRepository, "register", lambda *a, **k: False)
    sessions.clock.advance(1)
    status, body = sessions.connect(CLIENT)
    assert (status, body["error"]["code"]) == (503, "server_busy")
    assert sessions.registry.stats.attempts > 1
    assert sessions.items(CLIENT) == before
    assert repository.table


def test_connect_costs_one_query_and_one_transaction(sessions: Sessions) -> None:
    calls = DynamoCalls(sessions.repository.dynamo.client)
    sessions.connected(CLIENT, clean_start=False, session_expiry_s=60)
    assert calls.take() == ["Query", "TransactWriteItems"]
    sessions.clock.advance(1)
    sessions.connected(CLIENT, clean_start=False, session_expiry_s=60)
    assert calls.take() == ["Query", "TransactWriteItems"]


# --- session-scoped calls


def test_heartbeat_refreshes_the_keepalive(sessions: Sessions) -> None:
    channel = sessions.connected(CLIENT, keepalive_s=10)
    sessions.clock.advance(7)
    calls = DynamoCalls(sessions.repository.dynamo.client)
    assert sessions.heartbeat(CLIENT, channel) == (200, {"leases": []})
    assert calls.take() == ["UpdateItem"]
    head = sessions.view(CLIENT).head
    assert head is not None and head.last_seen_ms == sessions.clock.now_ms()


def test_stale_channel_is_taken_over_and_changes_nothing(sessions: Sessions) -> None:
    # Given a channel taken over by a newer one
    old = sessions.connected(CLIENT, clean_start=False, session_expiry_s=300)
    sessions.clock.advance(1)
    sessions.connected(CLIENT, clean_start=False, session_expiry_s=300)
    before = sessions.items(CLIENT)
    # When the old channel calls
    sessions.clock.advance(1)
    answers = [sessions.heartbeat(CLIENT, old), sessions.get(CLIENT, old)]
    # Then every call is session_taken_over and the session did not change
    assert {(s, b["error"]["code"]) for s, b in answers} == {(409, "session_taken_over")}
    assert sessions.items(CLIENT) == before


def test_clean_disconnect_ends_the_channel(sessions: Sessions) -> None:
    channel = sessions.connected(CLIENT, session_expiry_s=60)
    assert sessions.disconnect(CLIENT, channel) == (204, None)
    view = sessions.view(CLIENT)
    assert view.head is not None and view.head.connected is False
    assert view.registrations == ()
    assert sessions.heartbeat(CLIENT, channel)[1]["error"]["code"] == "session_taken_over"


def test_late_deregistration_never_removes_the_newer_registration(sessions: Sessions) -> None:
    # Given an old channel and a newer one
    old = sessions.connected(CLIENT, clean_start=False, session_expiry_s=60)
    sessions.clock.advance(1)
    new = sessions.connected(CLIENT, clean_start=False, session_expiry_s=60)
    # When the old channel disconnects late
    status, body = sessions.disconnect(CLIENT, old)
    # Then it is told it was taken over; the newer registration and session stand
    assert (status, body["error"]["code"]) == (409, "session_taken_over")
    assert sessions.view(CLIENT).registrations == (Version.parse(new),)
    assert sessions.heartbeat(CLIENT, new)[0] == 200


def test_stale_disconnect_removes_only_its_own_registration(
    sessions: Sessions, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a stale registration the newer connect did not see (so did not clean up)
    now = sessions.clock.now_ms()
    old = sessions.connected(CLIENT, connected_at_ms=now - 5)
    repository = interleaved(sessions, monkeypatch)
    with monkeypatch.context() as patch:
        patch.setattr(type(repository), "read", _without_registrations)
        new = sessions.connected(CLIENT, connected_at_ms=now)
    assert {v.channel for v in sessions.view(CLIENT).registrations} == {old, new}
    # When the stale channel disconnects
    assert sessions.disconnect(CLIENT, old)[0] == 409
    # Then exactly its own entry is gone
    assert sessions.view(CLIENT).registrations == (Version.parse(new),)


def _without_registrations(self: Interleaved, client_id: str, *, consistent: bool) -> Any:
    view = SessionRepository.read(self, client_id, consistent=consistent)
    return type(view)(view.head, (), view.wills)


def test_get_unknown_session_is_not_found(sessions: Sessions) -> None:
    status, body = sessions.get(CLIENT, Version.new(1).channel)
    assert (status, body["error"]["code"]) == (404, "session_not_found")


# --- permissions


def test_client_id_outside_the_claim_is_forbidden(sessions: Sessions) -> None:
    status, body = sessions.connect("someone-else")
    assert (status, body["error"]["code"]) == (403, "forbidden")
    assert sessions.items("someone-else") == []


def test_another_principal_cannot_take_a_live_session(sessions: Sessions) -> None:
    sessions.connected(CLIENT, clean_start=False, session_expiry_s=60)
    before = sessions.items(CLIENT)
    sessions.clock.advance(1)
    status, body = sessions.connect(CLIENT, clean_start=False, claims=MALLORY)
    assert (status, body["error"]["code"]) == (403, "forbidden")
    assert sessions.items(CLIENT) == before


def test_another_principal_cannot_act_on_a_session(sessions: Sessions) -> None:
    channel = sessions.connected(CLIENT, session_expiry_s=60)
    before = sessions.items(CLIENT)
    answers = [
        sessions.heartbeat(CLIENT, channel, claims=MALLORY),
        sessions.get(CLIENT, channel, claims=MALLORY),
        sessions.disconnect(CLIENT, channel, claims=MALLORY),
    ]
    assert {(s, b["error"]["code"]) for s, b in answers} == {(403, "forbidden")}
    assert sessions.items(CLIENT) == before


# --- bad input: coded 4xx, no state change


@pytest.mark.parametrize(
    ("raw", "status", "code"),
    [
        ('{"unknown": true}', 400, "invalid_request"),
        ('{"keepalive_s": -1}', 400, "invalid_request"),
        ('{"keepalive_s": "60"}', 400, "invalid_request"),
        ('{"clean_start": "yes"}', 400, "invalid_request"),
        ('{"session_expiry_s": 1.5}', 400, "invalid_request"),
        ('{"will": {"topic": "devices/x", "qos": 7}}', 400, "invalid_request"),
        ("{not json", 400, "malformed_json"),
        ("[]", 400, "invalid_request"),
        ('{"connected_at_ms": 99999999999999}', 400, "invalid_request"),
        ('{"will": {"topic": "devices/+"}}', 400, "invalid_topic"),
        ('{"will": {"topic": "$SYS/x"}}', 400, "invalid_topic"),
        ('{"will": {"topic": "elsewhere/x"}}', 403, "forbidden"),
    ],
)
def test_bad_connect_is_coded_and_changes_nothing(
    sessions: Sessions, raw: str, status: int, code: str
) -> None:
    answer = sessions.call("PUT", CLIENT, raw_body=raw)
    assert (answer[0], answer[1]["error"]["code"]) == (status, code)
    assert sessions.items(CLIENT) == []


def test_oversized_will_is_refused(sessions: Sessions) -> None:
    payload = base64.b64encode(b"x" * (MAX_WILL_PAYLOAD_BYTES + 1)).decode()
    status, body = sessions.connect(CLIENT, will={"topic": "devices/x", "payload": payload})
    assert (status, body["error"]["code"]) == (413, "payload_too_large")
    assert sessions.items(CLIENT) == []


@pytest.mark.parametrize(
    ("method", "channel"),
    # a GET without the header at all is the read-only view (below)
    [
        (m, c)
        for m in ("POST", "GET", "DELETE")
        for c in (None, "", "not-a-channel!")
        if (m, c) != ("GET", None)
    ],
)
def test_session_call_without_a_valid_channel_is_refused(
    sessions: Sessions, method: str, channel: str | None
) -> None:
    sessions.connected(CLIENT, session_expiry_s=60)
    before = sessions.items(CLIENT)
    suffix = "/heartbeat" if method == "POST" else ""
    status, body = sessions.call(method, CLIENT, suffix=suffix, channel=channel)
    assert (status, body["error"]["code"]) == (400, "invalid_request")
    assert sessions.items(CLIENT) == before


# --- the read-only view: GET without Shoal-Channel

ADMIN = {"sub": "ops", "shoal:admin": "true"}
BOB = {"sub": "bob"}  # may act as client id "bob" only


def test_the_read_only_view_changes_nothing(sessions: Sessions) -> None:
    # Given a live channel holding the session
    channel = sessions.connected(CLIENT, session_expiry_s=60, keepalive_s=30)
    before = sessions.items(CLIENT)
    sessions.clock.advance(5)
    # When its principal and an admin (not allowed the client id as a client) read it
    for claims in (None, ADMIN):
        status, view = sessions.call("GET", CLIENT, claims=claims)
        # Then they see it, without its channel
        assert status == 200, view
        jsonschema.validate(view, schema("Session"))
        assert (view["client_id"], view["connected"], view["channel"]) == (CLIENT, True, None)
        assert view["session_expiry_s"] == 60
    # and nothing was written: no keepalive renewed, no registration, the channel still live
    assert sessions.items(CLIENT) == before
    assert sessions.heartbeat(CLIENT, channel)[0] == 200
    assert sessions.get(CLIENT, channel)[1]["channel"] == channel


def test_the_read_only_view_of_no_session_is_not_found(sessions: Sessions) -> None:
    for claims in (None, ADMIN):
        status, body = sessions.call("GET", CLIENT, claims=claims)
        assert (status, body["error"]["code"]) == (404, "session_not_found")
    # a session that ended with its channel (expiry 0) is gone too
    channel = sessions.connected(CLIENT, session_expiry_s=0)
    assert sessions.disconnect(CLIENT, channel)[0] == 204
    status, body = sessions.call("GET", CLIENT)
    assert (status, body["error"]["code"]) == (404, "session_not_found")


def test_the_read_only_view_is_forbidden_to_other_principals(sessions: Sessions) -> None:
    sessions.connected(CLIENT, session_expiry_s=60)
    before = sessions.items(CLIENT)
    # one allowed the client id whose session another principal holds, one not allowed it
    # (refused before any read, session or not)
    for claims, client_id in ((MALLORY, CLIENT), (BOB, CLIENT), (BOB, "sensor-none")):
        status, body = sessions.call("GET", client_id, claims=claims)
        assert (status, body["error"]["code"]) == (403, "forbidden"), claims
    assert sessions.items(CLIENT) == before


def test_registry_reads_its_table_from_the_configuration(sessions: Sessions) -> None:
    assert wiring.session_registry(get_config()).repository.table == "shoal-sessions"


def test_sample_event_connects(sessions: Sessions) -> None:
    # Given the sample connect event as API Gateway sends it (a will, a 1 h session expiry)
    event = load_event("sessions_connect.json")
    event["requestContext"]["timeEpoch"] = sessions.clock.now_ms()
    response = sessions_app.handler(event, FakeContext())
    assert response["statusCode"] == 200
    head = sessions.view("sensor-1").head
    assert head is not None and head.will is not None and head.session_expiry_s == 3600
