"""Property 5 under real concurrency: racing connects for one client id, through the handlers.

Each thread invokes its own copy of the handler module (as separate Lambda execution
environments would) against the serialized emulator, so conditional writes are atomic as in
DynamoDB and the interleavings are the threads' own.
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import boto3
import pytest
from shoal import wiring
from shoal.core.clock import ManualClock
from shoal.core.config import get_config
from shoal.sessions.model import Version

import functions.sessions.app as sessions_app
from tests.integration.test_sessions_support import (
    Handler,
    Sessions,
    account,
    empty_sessions_table,
    handler_copy,
)

__all__ = ["account"]  # fixtures

#: threads per storm (the issue asks for at least 32)
RACERS = 32
#: storms per test. The issue's 50 storms of 32 took 18 minutes of one CI core (about 22 s a
#: storm: 70 handler calls through the emulator), more than the suite's whole budget; the
#: suite runs 8 (256 racing connects). ``SHOAL_RACE_REPEAT=50 pytest
#: tests/integration/test_sessions_race.py`` runs the full property.
REPEAT = int(os.environ.get("SHOAL_RACE_REPEAT", "8"))


@pytest.fixture(scope="module")
def clock() -> ManualClock:
    """One clock for the module: the racers' environments outlive a test."""
    return ManualClock()


@pytest.fixture(scope="module")
def sessions(account: boto3.Session, clock: ManualClock) -> Iterator[Sessions]:
    """The module's own: every round uses fresh client ids, so nothing needs emptying."""
    registry = wiring.session_registry(get_config(), clock)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sessions_app, "registry", lambda: registry)
        yield Sessions(account, clock, registry)


@pytest.fixture(autouse=True)
def _small_table(account: boto3.Session) -> None:
    empty_sessions_table(account)


@pytest.fixture(scope="module")
def environments(account: boto3.Session, clock: ManualClock) -> list[Handler]:
    """One handler copy per racer, each with its own registry (and client), on the clock."""
    copies: list[ModuleType] = []
    for _ in range(RACERS):
        copy = handler_copy()
        registry = wiring.session_registry(get_config(), clock)
        setattr(copy, "registry", lambda registry=registry: registry)  # noqa: B010
        copies.append(copy)
    return [copy.handler for copy in copies]


@dataclass
class Outcome:
    connected_at_ms: int
    status: int
    body: Any


def storm(
    sessions: Sessions, handlers: list[Handler], client_id: str, base_ms: int
) -> list[Outcome]:
    """Every racer connects ``client_id`` at once, each with its own connect time."""
    times = [base_ms + i for i in range(len(handlers))]
    random.shuffle(times)
    outcomes: list[Outcome | None] = [None] * len(handlers)
    start = threading.Barrier(len(handlers))

    def racer(index: int) -> None:
        start.wait()
        body = {"clean_start": False, "session_expiry_s": 600, "connected_at_ms": times[index]}
        status, answer = sessions.call("PUT", client_id, body=body, handler=handlers[index])
        outcomes[index] = Outcome(times[index], status, answer)

    threads = [threading.Thread(target=racer, args=(i,)) for i in range(len(handlers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(o is not None for o in outcomes)
    return [o for o in outcomes if o is not None]


@pytest.mark.parametrize("round_", range(REPEAT))
def test_racing_connects_leave_exactly_the_newest(
    sessions: Sessions, environments: list[Handler], round_: int
) -> None:
    client_id = f"race-{round_}"
    # Given a session with a subscription and undelivered messages
    now = sessions.clock.now_ms()
    first = sessions.connected(
        client_id, clean_start=False, session_expiry_s=600, connected_at_ms=now - 60_000
    )
    sessions.give_session(client_id, first, {"devices/#": {"qos": 1}})
    head = sessions.view(client_id).head
    assert head is not None
    session_id = head.session_id

    # When 32 racers connect it at once, each with a distinct, newer version
    outcomes = storm(sessions, environments, client_id, now - 30_000)

    # Then only 200, 409 and 503 come back, and the newest always wins
    assert {o.status for o in outcomes} <= {200, 409, 503}
    newest = max(outcomes, key=lambda o: o.connected_at_ms)
    assert newest.status == 200, newest.body
    codes = {o.body["error"]["code"] for o in outcomes if o.status != 200}
    assert codes <= {"channel_outdated", "server_busy"}
    winners = [o for o in outcomes if o.status == 200]
    # and every winner resumed the one session (none forked a new one)
    assert all(o.body["session_present"] for o in winners)

    # Then the newest channel is the only live one, even for those answered 200 before it
    live = newest.body["channel"]
    for outcome in winners:
        status, body = sessions.heartbeat(client_id, outcome.body["channel"])
        if outcome is newest:
            assert status == 200
        else:
            assert (status, body["error"]["code"]) == (409, "session_taken_over")
    assert sessions.heartbeat(client_id, first)[0] == 409

    # When the losers disconnect
    for outcome in winners:
        if outcome is not newest:
            assert sessions.disconnect(client_id, outcome.body["channel"])[0] == 409

    # Then one registration is left, the newest's, owning the one unforked session
    view = sessions.view(client_id)
    assert view.registrations == (Version.parse(live),)
    head = view.head
    assert head is not None and head.channel == live and head.connected
    assert head.session_id == session_id
    assert dict(head.subscriptions) == {"devices/#": {"qos": 1}}


@pytest.mark.parametrize("round_", range(REPEAT))
def test_disconnect_racing_a_newer_connect_never_removes_it(
    sessions: Sessions, environments: list[Handler], round_: int
) -> None:
    client_id = f"race-dereg-{round_}"
    now = sessions.clock.now_ms()
    old = sessions.connected(
        client_id, clean_start=False, session_expiry_s=600, connected_at_ms=now - 10
    )
    answers: dict[str, tuple[int, Any]] = {}
    start = threading.Barrier(2)

    def disconnect() -> None:
        start.wait()
        answers["disconnect"] = sessions.disconnect(client_id, old, handler=environments[0])

    body = {"clean_start": False, "session_expiry_s": 600, "connected_at_ms": now}

    def connect() -> None:
        start.wait()
        answers["connect"] = sessions.call("PUT", client_id, body=body, handler=environments[1])

    threads = [threading.Thread(target=disconnect), threading.Thread(target=connect)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert answers["disconnect"][0] in {204, 409}
    status, answer = answers["connect"]
    if status == 503:
        # The disconnect landed between the connect's two reads (RealMax older than
        # LocalMax): the connect aborted and wrote nothing; the client retries, as told
        assert answers["disconnect"][0] == 204
        assert sessions.view(client_id).registrations == ()
        status, answer = sessions.call("PUT", client_id, body=body, handler=environments[1])
    # Whichever came first, the newer registration stands and is live
    assert status == 200, answer
    assert sessions.view(client_id).registrations == (Version.parse(answer["channel"]),)
    assert sessions.heartbeat(client_id, answer["channel"])[0] == 200
