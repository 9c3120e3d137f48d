"""A connect retried after its answer was lost (issue 47): the ``connect_token`` the client keeps
across the retries of one connect gets the retry the channel its earlier try registered.

Without it a retry registers a newer channel, which takes the earlier one over and publishes
that channel's will (MQTT 5 §3.1.4): the soak saw connects answered after 20 s, sent three
times, and a will for each takeover, while the client saw one connect. The sessions function
runs over moto as in ``test_sessions``.
"""

from __future__ import annotations

from typing import Any

import pytest
from shoal.core.auth import Principal
from shoal.sessions.model import REG_PREFIX, WILL_PREFIX, ConnectRequest

from tests.integration.test_sessions import interleaved
from tests.integration.test_sessions_support import (
    ALICE,
    MALLORY,
    Sessions,
    account,
    clock,
    sessions,
)

__all__ = ["account", "clock", "sessions"]  # fixtures

CLIENT = "sensor-1"
TOKEN = "5f0c2a9e4b7d4e1f"
BODY: dict[str, Any] = {
    "clean_start": False,
    "session_expiry_s": 300,
    "keepalive_s": 10,
    "will": {"topic": "devices/sensor-1/status", "text": "offline"},
}


def _kinds(sessions: Sessions) -> list[str]:
    return sorted(str(i["item"]).split("#")[0] for i in sessions.items(CLIENT))


def test_a_retried_connect_gets_the_channel_its_first_try_registered(sessions: Sessions) -> None:
    # Given a connect that registered a channel (its answer lost on the way)
    status, first = sessions.connect(CLIENT, **BODY, connect_token=TOKEN)
    assert status == 200
    before = sessions.items(CLIENT)
    # When the client sends the same connect again, half a second later
    sessions.clock.advance(0.5)
    status, again = sessions.connect(CLIENT, **BODY, connect_token=TOKEN)
    # Then it is answered as the first try was: the same channel, nothing taken over
    assert (status, again) == (200, first)
    assert sessions.items(CLIENT) == before
    assert not [i for i in before if str(i["item"]).startswith(WILL_PREFIX)]
    assert sessions.registry.stats.repeated == 1


def test_the_repeated_answer_keeps_session_present(sessions: Sessions) -> None:
    # Given a session, and a connect resuming it whose answer is lost
    sessions.connected(CLIENT, **BODY)
    sessions.clock.advance(1)
    status, first = sessions.connect(CLIENT, **BODY, connect_token=TOKEN)
    assert (status, first["session_present"]) == (200, True)
    # When it is sent again
    sessions.clock.advance(1)
    status, again = sessions.connect(CLIENT, **BODY, connect_token=TOKEN)
    # Then the answer is the first one's, session_present included
    assert (status, again) == (200, first)


def test_without_a_token_a_retry_takes_the_first_channel_over(sessions: Sessions) -> None:
    # the behaviour the token exists to avoid: a newer channel, and the older one's will due
    first = sessions.connected(CLIENT, **BODY)
    sessions.clock.advance(0.5)
    second = sessions.connected(CLIENT, **BODY)
    assert second != first
    assert WILL_PREFIX.rstrip("#") in _kinds(sessions)


def test_a_token_whose_channel_was_taken_over_connects_anew(sessions: Sessions) -> None:
    # Given a channel made with a token, then taken over by another connect
    first = sessions.connected(CLIENT, **BODY, connect_token=TOKEN)
    sessions.clock.advance(1)
    second = sessions.connected(CLIENT, **BODY, connect_token="another-connect-1")
    # When a late retry of the first connect arrives
    sessions.clock.advance(1)
    third = sessions.connected(CLIENT, **BODY, connect_token=TOKEN)
    # Then it is a connect of its own: the taken-over channel is never handed out again
    assert third not in (first, second)
    assert sessions.view(CLIENT).head.channel == third  # type: ignore[union-attr]


def test_a_token_whose_channel_disconnected_connects_anew(sessions: Sessions) -> None:
    first = sessions.connected(CLIENT, **BODY, connect_token=TOKEN)
    assert sessions.disconnect(CLIENT, first)[0] == 204
    sessions.clock.advance(1)
    status, again = sessions.connect(CLIENT, **BODY, connect_token=TOKEN)
    assert status == 200 and again["channel"] != first
    assert again["session_present"] is True


def test_another_principal_with_the_same_token_does_not_get_the_channel(
    sessions: Sessions,
) -> None:
    # Given alice's channel made with a token
    sessions.connected(CLIENT, **BODY, connect_token=TOKEN)
    before = sessions.items(CLIENT)
    sessions.clock.advance(1)
    # When mallory (allowed the same client ids) connects with that token
    body = {k: v for k, v in BODY.items() if k != "will"}
    status, answer = sessions.connect(CLIENT, **body, claims=MALLORY, connect_token=TOKEN)
    # Then she is refused as any connect to another principal's session is: the token
    # hands out nothing, and nothing changed
    assert (status, answer["error"]["code"]) == (403, "forbidden")
    assert sessions.items(CLIENT) == before


def test_a_retry_that_read_a_stale_view_finds_its_first_try_at_the_conflict(
    sessions: Sessions, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a first try that registered, and a retry whose cheap read sees nothing yet
    status, first = sessions.connect(CLIENT, **BODY, connect_token=TOKEN)
    before = sessions.items(CLIENT)
    repository = interleaved(sessions, monkeypatch)
    repository.stale_reads = True
    sessions.clock.advance(0.5)
    # When the retry tries to commit, its condition fails, and the consistent read shows the
    # channel its first try registered
    status, again = sessions.connect(CLIENT, **BODY, connect_token=TOKEN)
    # Then that channel is the answer, and nothing changed
    assert (status, again) == (200, first)
    assert sessions.items(CLIENT) == before


@pytest.mark.parametrize("token", ["short", "has space in it", "x" * 65, 7])
def test_a_malformed_token_is_refused_and_changes_nothing(sessions: Sessions, token: Any) -> None:
    sessions.connected(CLIENT, **BODY)
    before = sessions.items(CLIENT)
    status, body = sessions.connect(CLIENT, **BODY, connect_token=token)
    assert (status, body["error"]["code"]) == (400, "invalid_request")
    assert sessions.items(CLIENT) == before


def test_a_websocket_connect_never_repeats_a_channel(sessions: Sessions) -> None:
    # a connection is its channel: two connects on connections, with one token, are two
    who = Principal.from_claims(ALICE)
    request = ConnectRequest.model_validate({**BODY, "connect_token": TOKEN})
    registry = sessions.registry
    first = registry.connect(who, CLIENT, request, on_connection=True)
    sessions.clock.advance(1)
    second = registry.connect(who, CLIENT, request, on_connection=True)
    assert second.channel != first.channel
    # nor is a connection's channel handed to an HTTP connect with the token
    sessions.clock.advance(1)
    status, answer = sessions.connect(CLIENT, **BODY, connect_token=TOKEN)
    assert status == 200 and answer["channel"] != second.channel
    assert [i for i in sessions.items(CLIENT) if str(i["item"]).startswith(REG_PREFIX)]
