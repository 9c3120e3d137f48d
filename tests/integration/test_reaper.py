"""The reaper with a manual clock: keepalive expiry, wills after their delay, session expiry."""

from __future__ import annotations

import threading
from typing import Any

import boto3
import pytest
from shoal.core.clock import SystemClock
from shoal.core.config import get_config
from shoal.core.errors import TopicNotFound
from shoal.core.faults import InjectedFault
from shoal.sessions.model import WILL_RETRY_MS, Version, WillMessage
from shoal.sessions.reaper import Reaper
from shoal.sessions.registry import SessionRegistry
from shoal.sessions.repository import SessionRepository
from shoal.sessions.timers import SqsDueTimer
from shoal.wiring import ServiceWillPublisher

import functions.reaper.app as reaper_app
import functions.sessions.app as sessions_app
from tests.helpers import FakeContext, load_event
from tests.integration.test_publish_harness import Harness
from tests.integration.test_sessions_support import (
    DynamoCalls,
    Interleaved,
    RecordingPublisher,
    Sessions,
    account,
    clock,
    sessions,
)

__all__ = ["account", "clock", "sessions"]  # fixtures

CLIENT = "sensor-1"
WILL = {"topic": "devices/sensor-1/status", "text": "gone", "delay_s": 30}


@pytest.fixture
def publisher() -> RecordingPublisher:
    return RecordingPublisher()


@pytest.fixture
def reaper(sessions: Sessions, publisher: RecordingPublisher) -> Reaper:
    return Reaper(sessions.repository, publisher, sessions.clock)


def wills(publisher: RecordingPublisher) -> list[tuple[str, str, str]]:
    return [(sub, client_id, will.topic) for sub, client_id, will, _ in publisher.published]


def test_any_request_of_the_channel_counts_for_its_keepalive(
    sessions: Sessions, reaper: Reaper, publisher: RecordingPublisher
) -> None:
    """MQTT 5 §3.1.2.10: the keepalive runs from the client's last control packet, whatever
    it was, not only a heartbeat. A channel that only reads (here its session document; gets
    and acks alike) is not expired at 1.5 keepalives; a request writes only once half the
    keepalive passed since the channel was last seen."""
    channel = sessions.connected(CLIENT, keepalive_s=10, session_expiry_s=300, will=WILL)
    calls = DynamoCalls(sessions.repository.dynamo.client)
    sessions.clock.advance(4)
    assert sessions.get(CLIENT, channel)[0] == 200
    assert "UpdateItem" not in calls.take()  # within half the keepalive: a read only
    sessions.clock.advance(4)
    assert sessions.get(CLIENT, channel)[0] == 200
    assert calls.take().count("UpdateItem") == 1
    # 16 s after the connect, past its 15 s grace, seen 8 s ago: not expired
    sessions.clock.advance(8)
    assert reaper.run().channels_expired == 0
    assert sessions.get(CLIENT, channel)[0] == 200
    # silent from then on: expired at 1.5 keepalives after that last request
    sessions.clock.advance(16)
    assert reaper.run().channels_expired == 1
    assert publisher.published == []  # the will waits its 30 s delay


def expired_channel(sessions: Sessions, reaper: Reaper, **connect: Any) -> str:
    """A channel whose keepalive (10 s) ran out and that the reaper has disconnected."""
    body = {"keepalive_s": 10, "session_expiry_s": 300, "will": WILL, **connect}
    channel = sessions.connected(CLIENT, **body)
    sessions.clock.advance(15)
    assert reaper.run().channels_expired == 1
    return channel


# --- keepalive


def test_channel_lives_until_one_and_a_half_keepalives(sessions: Sessions, reaper: Reaper) -> None:
    channel = sessions.connected(CLIENT, keepalive_s=10, session_expiry_s=300)
    sessions.clock.advance(14.999)
    assert reaper.run().channels_expired == 0
    assert sessions.heartbeat(CLIENT, channel)[0] == 200


def test_keepalive_expiry_disconnects_the_channel(sessions: Sessions, reaper: Reaper) -> None:
    channel = expired_channel(sessions, reaper)
    status, body = sessions.heartbeat(CLIENT, channel)
    assert (status, body["error"]["code"]) == (409, "session_taken_over")
    view = sessions.view(CLIENT)
    assert view.head is not None and not view.head.connected
    assert view.registrations == ()


def test_heartbeat_keeps_the_channel_and_the_reaper_catches_up(
    sessions: Sessions, reaper: Reaper
) -> None:
    channel = sessions.connected(CLIENT, keepalive_s=10, session_expiry_s=300)
    sessions.clock.advance(10)
    assert sessions.heartbeat(CLIENT, channel)[0] == 200
    # Given the index still says the connect's deadline, the reaper moves it, expiring nothing
    sessions.clock.advance(5)
    report = reaper.run()
    assert (report.channels_expired, report.rescheduled) == (0, 1)
    sessions.clock.advance(10)
    assert reaper.run().channels_expired == 1


def test_heartbeat_racing_the_reaper_keeps_the_channel(
    sessions: Sessions, publisher: RecordingPublisher
) -> None:
    channel = sessions.connected(CLIENT, keepalive_s=10, session_expiry_s=300, will=WILL)
    sessions.clock.advance(15)
    repository = Interleaved(sessions.repository)
    # Given a heartbeat that lands between the reaper's read and its write
    repository.on_read = lambda consistent: (
        sessions.heartbeat(CLIENT, channel) if consistent else None
    )
    report = Reaper(repository, publisher, sessions.clock).run()
    assert (report.channels_expired, report.contended) == (0, 1)
    assert sessions.heartbeat(CLIENT, channel)[0] == 200


def test_zero_keepalive_is_never_expired(sessions: Sessions, reaper: Reaper) -> None:
    channel = sessions.connected(CLIENT, keepalive_s=0)
    sessions.clock.advance(10**6)
    assert reaper.run().channels_expired == 0
    assert sessions.heartbeat(CLIENT, channel)[0] == 200


# --- wills


def test_will_is_published_after_its_delay(
    sessions: Sessions, reaper: Reaper, publisher: RecordingPublisher
) -> None:
    channel = expired_channel(sessions, reaper)
    sessions.clock.advance(29.999)
    reaper.run()
    assert publisher.published == []
    sessions.clock.advance(0.001)
    assert reaper.run().wills_published == 1
    assert wills(publisher) == [("alice", CLIENT, WILL["topic"])]
    assert publisher.published[0][3] == channel
    # and only once
    sessions.clock.advance(60)
    reaper.run()
    assert len(publisher.published) == 1


def test_a_late_run_counts_the_will_delay_from_the_keepalives_end(
    sessions: Sessions, reaper: Reaper, publisher: RecordingPublisher
) -> None:
    """MQTT 5 §3.1.3.2.2: the delay starts when the connection is closed, here when 1.5
    keepalives passed without a packet, not when the reaper got to it."""
    # Given a channel whose keepalive (10 s) ran out at 15 s, and a reaper that runs only
    # 20 s later (its timer or its schedule came late)
    sessions.connected(CLIENT, keepalive_s=10, session_expiry_s=300, will=WILL)
    sessions.clock.advance(35)
    assert reaper.run().channels_expired == 1
    assert publisher.published == []
    # Then the will's 30 s ran from 15 s: due at 45 s, not at 65 s
    sessions.clock.advance(9.999)
    assert reaper.run().wills_published == 0
    sessions.clock.advance(0.001)
    assert reaper.run().wills_published == 1
    assert wills(publisher) == [("alice", CLIENT, WILL["topic"])]


def test_clean_disconnect_publishes_no_will(
    sessions: Sessions, reaper: Reaper, publisher: RecordingPublisher
) -> None:
    channel = sessions.connected(CLIENT, keepalive_s=10, session_expiry_s=60, will=WILL)
    assert sessions.disconnect(CLIENT, channel)[0] == 204
    sessions.clock.advance(3600)
    reaper.run()
    assert publisher.published == []


def test_resume_within_the_delay_suppresses_the_will(
    sessions: Sessions, reaper: Reaper, publisher: RecordingPublisher
) -> None:
    expired_channel(sessions, reaper)
    sessions.clock.advance(10)
    status, body = sessions.connect(CLIENT, clean_start=False, session_expiry_s=300)
    assert (status, body["session_present"]) == (200, True)
    sessions.clock.advance(3600)
    reaper.run()
    assert publisher.published == []


def test_resume_after_the_delay_does_not_stop_the_will(
    sessions: Sessions, reaper: Reaper, publisher: RecordingPublisher
) -> None:
    # Given the delay ran out before the reaper's next run, and then the client comes back
    expired_channel(sessions, reaper)
    sessions.clock.advance(31)
    sessions.connected(CLIENT, clean_start=False, session_expiry_s=300)
    assert reaper.run().wills_published == 1


def test_clean_start_within_the_delay_ends_the_session_and_publishes_at_once(
    sessions: Sessions, reaper: Reaper, publisher: RecordingPublisher
) -> None:
    expired_channel(sessions, reaper)
    sessions.clock.advance(10)
    sessions.connected(CLIENT, clean_start=True)
    assert reaper.run().wills_published == 1


def test_will_without_delay_is_published_with_the_expiry(
    sessions: Sessions, reaper: Reaper, publisher: RecordingPublisher
) -> None:
    sessions.connected(CLIENT, keepalive_s=10, session_expiry_s=300, will={**WILL, "delay_s": 0})
    sessions.clock.advance(15)
    report = reaper.run()
    assert (report.channels_expired, report.wills_published) == (1, 1)


def test_session_ending_before_the_delay_publishes_the_will_then(
    sessions: Sessions, reaper: Reaper, publisher: RecordingPublisher
) -> None:
    # Given a session that ends at disconnect (expiry 0) and a 30 s will delay
    sessions.connected(CLIENT, keepalive_s=10, session_expiry_s=0, will=WILL)
    sessions.clock.advance(15)
    report = reaper.run()
    # Then the will goes with the session, at once (MQTT 5: whichever comes first)
    assert (report.channels_expired, report.wills_published, report.sessions_ended) == (1, 1, 1)
    assert sessions.items(CLIENT) == []


def test_failed_publish_is_retried_later(
    sessions: Sessions, reaper: Reaper, publisher: RecordingPublisher
) -> None:
    expired_channel(sessions, reaper)
    sessions.clock.advance(30)
    publisher.failures = 1
    assert reaper.run().failed == 1
    # the claimed will is not due again until its retry time
    assert reaper.run().wills_published == 0
    sessions.clock.advance(WILL_RETRY_MS / 1000)
    assert reaper.run().wills_published == 1
    assert len(publisher.published) == 1


def test_overlapping_reapers_publish_a_will_once(
    sessions: Sessions, publisher: RecordingPublisher
) -> None:
    reapers = [Reaper(sessions.repository, publisher, sessions.clock) for _ in range(4)]
    expired_channel(sessions, reapers[0])
    sessions.clock.advance(30)
    threads = [threading.Thread(target=r.run) for r in reapers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(publisher.published) == 1


# --- wills of live channels taken over (MQTT 5 §3.1.2.5, §3.1.3.2.2, [MQTT-3.1.4-3])


def take_over(
    sessions: Sessions, *, delay_s: int, clean_start: bool, session_expiry_s: int = 300
) -> tuple[str, bool]:
    """A live channel with a will of ``delay_s``, taken over 5 s later by a connect without a
    will (and without a keepalive, so only the first channel's will can come out): the first
    channel, and whether the takeover found the session present."""
    first = sessions.connected(
        CLIENT,
        clean_start=False,
        keepalive_s=10,
        session_expiry_s=session_expiry_s,
        will={**WILL, "delay_s": delay_s},
    )
    sessions.clock.advance(5)
    status, body = sessions.connect(
        CLIENT, clean_start=clean_start, keepalive_s=0, session_expiry_s=300
    )
    assert status == 200, body
    present: bool = body["session_present"]
    return first, present


def published_once(
    sessions: Sessions, reaper: Reaper, publisher: RecordingPublisher, channel: str, delay_s: int
) -> None:
    """The reaper's next run (no time passed) publishes ``channel``'s will, and no run after."""
    report = reaper.run()
    assert (report.channels_expired, report.wills_published) == (0, 1)
    will = WillMessage.model_validate({**WILL, "delay_s": delay_s})
    assert publisher.published == [("alice", CLIENT, will, channel)]
    sessions.clock.advance(3600)
    reaper.run()
    assert len(publisher.published) == 1
    assert sessions.view(CLIENT).wills == ()


def test_takeover_resuming_the_session_publishes_a_will_without_delay(
    sessions: Sessions, reaper: Reaper, publisher: RecordingPublisher
) -> None:
    first, present = take_over(sessions, delay_s=0, clean_start=False)
    assert present
    published_once(sessions, reaper, publisher, first, delay_s=0)


def test_takeover_resuming_the_session_within_the_will_delay_withholds_the_will(
    sessions: Sessions, reaper: Reaper, publisher: RecordingPublisher
) -> None:
    _, present = take_over(sessions, delay_s=30, clean_start=False)
    assert present
    # held for the old channel's close (a WebSocket connection's $disconnect would decide);
    # an HTTP channel has none, so it waits out its bound and is dropped
    (held,) = sessions.view(CLIENT).wills
    assert held.held_since_ms is not None
    report = reaper.run()
    sessions.clock.advance(3600)
    later = reaper.run()
    assert (report.channels_expired, publisher.published) == (0, [])
    assert (later.wills_withheld, sessions.view(CLIENT).wills) == (1, ())


def test_an_http_takeover_arms_the_timer_that_publishes_its_will(
    sessions: Sessions, publisher: RecordingPublisher
) -> None:
    """The sessions function's connect, as wired (``wiring.session_registry``): the will its
    takeover makes due at once goes out when its timer comes, not at the reaper's next run."""
    # Given the wills queue empty (the module's account is shared by its tests)
    sqs, url = sessions.session.client("sqs"), get_config().queues["wills"]
    sqs.purge_queue(QueueUrl=url)
    # When an HTTP connect takes over a live channel whose will has no delay
    first, present = take_over(sessions, delay_s=0, clean_start=False)
    assert present
    # Then one timer waits in the wills queue, handed out at once, naming that will ...
    timers = sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10)["Messages"]
    assert len(timers) == 1
    # ... and the reaper, given it as its mapping gives it, publishes the will
    reaper = Reaper(sessions.repository, publisher, sessions.clock)
    event = {"Records": [{"messageId": m["MessageId"], "body": m["Body"]} for m in timers]}
    assert reaper.on_timers(event) == {"batchItemFailures": []}
    assert wills(publisher) == [("alice", CLIENT, WILL["topic"])]
    assert publisher.published[0][3] == first


@pytest.mark.parametrize("delay_s", [0, 30])
def test_clean_start_takeover_publishes_the_will_at_once(
    sessions: Sessions, reaper: Reaper, publisher: RecordingPublisher, delay_s: int
) -> None:
    # the old session ends with the takeover, before any delay runs out
    first, present = take_over(sessions, delay_s=delay_s, clean_start=True)
    assert not present
    published_once(sessions, reaper, publisher, first, delay_s)


@pytest.mark.parametrize("delay_s", [0, 30])
def test_takeover_of_a_session_ending_with_its_channel_publishes_the_will_at_once(
    sessions: Sessions, reaper: Reaper, publisher: RecordingPublisher, delay_s: int
) -> None:
    # a session expiry of 0: the session ended with the channel, so nothing was resumed
    first, present = take_over(sessions, delay_s=delay_s, clean_start=False, session_expiry_s=0)
    assert not present
    published_once(sessions, reaper, publisher, first, delay_s)


@pytest.mark.parametrize("clean_start", [False, True])
def test_connect_after_a_clean_disconnect_publishes_no_will(
    sessions: Sessions, reaper: Reaper, publisher: RecordingPublisher, clean_start: bool
) -> None:
    channel = sessions.connected(
        CLIENT, keepalive_s=10, session_expiry_s=300, will={**WILL, "delay_s": 0}
    )
    assert sessions.disconnect(CLIENT, channel)[0] == 204
    sessions.connected(CLIENT, clean_start=clean_start, keepalive_s=0, session_expiry_s=300)
    reaper.run()
    assert publisher.published == []


def interleaved(sessions: Sessions, monkeypatch: pytest.MonkeyPatch) -> Interleaved:
    """The handler's registry over a repository the test can act inside of."""
    repository = Interleaved(sessions.repository)
    registry = SessionRegistry(repository, sessions.clock)
    monkeypatch.setattr(sessions_app, "registry", lambda: registry)
    sessions.registry = registry
    return repository


def test_takeover_will_is_written_once_when_a_racer_took_over_first(
    sessions: Sessions,
    reaper: Reaper,
    publisher: RecordingPublisher,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = sessions.clock.now_ms()
    first = sessions.connected(
        CLIENT, keepalive_s=10, session_expiry_s=300, will=WILL, connected_at_ms=now - 10
    )
    repository = interleaved(sessions, monkeypatch)

    def racer() -> None:
        sessions.connected(CLIENT, clean_start=True, keepalive_s=0, connected_at_ms=now - 5)

    # Given an older racer that takes the first channel over between our read and our commit
    repository.on_register = racer
    # When our connect's transaction fails on the racer's head and is retried against it
    sessions.connected(CLIENT, clean_start=True, keepalive_s=0, connected_at_ms=now)
    assert sessions.registry.stats.retries == 1
    # Then the first channel's will was written by the racer's takeover alone, and goes once
    assert [w.version.channel for w in sessions.view(CLIENT).wills] == [first]
    published_once(sessions, reaper, publisher, first, delay_s=30)


def test_takeover_will_survives_a_lost_commit_answer(
    sessions: Sessions,
    reaper: Reaper,
    publisher: RecordingPublisher,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    first = sessions.connected(CLIENT, keepalive_s=10, session_expiry_s=300, will=WILL)
    sessions.clock.advance(1)
    # Given a takeover whose transaction landed but whose answer said it failed (COMMITTED)
    interleaved(sessions, monkeypatch).lose_own_commit = True
    sessions.connected(CLIENT, clean_start=True, keepalive_s=0)
    published_once(sessions, reaper, publisher, first, delay_s=30)


@pytest.mark.parametrize("crash", ["before", "after"])
def test_connect_crashing_around_its_transaction_publishes_the_will_once(
    sessions: Sessions,
    reaper: Reaper,
    publisher: RecordingPublisher,
    monkeypatch: pytest.MonkeyPatch,
    crash: str,
) -> None:
    first = sessions.connected(CLIENT, keepalive_s=10, session_expiry_s=300, will=WILL)
    sessions.clock.advance(1)
    dynamo = sessions.repository.dynamo
    transact = dynamo.transact

    def crashing(parts: list[dict[str, Any]]) -> list[str] | None:
        monkeypatch.setattr(dynamo, "transact", transact)  # once
        if crash == "after":
            assert transact(parts) is None
        raise InjectedFault(f"the connect's invocation died {crash} its transaction")

    monkeypatch.setattr(dynamo, "transact", crashing)
    # Given a takeover whose invocation dies before, or after, its transaction
    assert sessions.connect(CLIENT, clean_start=True, keepalive_s=0)[0] == 500
    view = sessions.view(CLIENT)
    assert view.head is not None
    if crash == "before":
        # Then neither the takeover nor the will was written: the channel lives, armed
        assert (view.head.channel, view.wills) == (first, ())
        assert view.head.will is not None
    else:
        # Then both were: the new channel owns the head and the old will is due
        assert view.head.channel != first and view.head.will is None
        assert [w.version.channel for w in view.wills] == [first]
    # When the client retries the connect (a new connect: a later version)
    sessions.clock.advance(1)
    sessions.connected(CLIENT, clean_start=True, keepalive_s=0)
    # Then the first channel's will goes once, either way
    published_once(sessions, reaper, publisher, first, delay_s=30)


# --- session expiry


def test_expired_session_is_cleaned_up(sessions: Sessions, reaper: Reaper) -> None:
    channel = sessions.connected(CLIENT, keepalive_s=10, session_expiry_s=60)
    sessions.disconnect(CLIENT, channel)
    head = next(i for i in sessions.items(CLIENT) if i["item"] == "head")
    # Given DynamoDB's TTL as the backstop: the head expires with the session
    expires_ms = sessions.clock.now_ms() + 60_000
    assert head["expires_at"] == -(-expires_ms // 1000)
    sessions.clock.advance(59.999)
    assert reaper.run().sessions_ended == 0
    sessions.clock.advance(0.001)
    assert reaper.run().sessions_ended == 1
    assert sessions.items(CLIENT) == []


def test_ended_session_cleanup_removes_leftover_registrations(
    sessions: Sessions, reaper: Reaper
) -> None:
    # Given a registration no connect cleaned up (its channel never called again)
    now = sessions.clock.now_ms()
    stale = Version.new(now - 5)
    sessions.repository.dynamo.client.put_item(
        TableName=sessions.repository.table,
        Item={
            "client_id": {"S": CLIENT},
            "item": {"S": "reg#" + stale.key},
            "channel": {"S": stale.channel},
        },
    )
    channel = sessions.connected(CLIENT, keepalive_s=10, session_expiry_s=0)
    sessions.disconnect(CLIENT, channel)
    assert reaper.run().sessions_ended == 1
    assert sessions.items(CLIENT) == []


def test_reaper_reads_the_due_index_not_the_table(sessions: Sessions, reaper: Reaper) -> None:
    for n in range(5):
        sessions.connected(f"sensor-{n}", keepalive_s=10)
    sessions.clock.advance(15)
    calls = DynamoCalls(sessions.repository.dynamo.client)
    assert reaper.run().channels_expired == 5
    assert "Scan" not in calls.names
    assert calls.names.count("Query") >= 8  # one per due shard, plus one read per client


# --- the real publish path and the handler


def test_will_reaches_the_stream_once(
    account: boto3.Session, sessions: Sessions, monkeypatch: pytest.MonkeyPatch
) -> None:
    harness = Harness(account)
    default = harness.default()
    publisher = ServiceWillPublisher(harness.publish)
    reaper = Reaper(sessions.repository, publisher, sessions.clock)
    channel = expired_channel(sessions, reaper)
    sessions.clock.advance(30)
    assert reaper.run().wills_published == 1
    assert sessions.view(CLIENT).wills == ()
    # When the same will is published again (as by a reaper that died before deleting it)
    publisher.publish_will("alice", CLIENT, WillMessage.model_validate(WILL), will_id=channel)
    # Then the stream holds it once, as the subscriber-visible record of the will
    messages = [
        m for _, m in harness.messages(default.storage_topics[0].stream) if m.topic == WILL["topic"]
    ]
    assert [(m.payload, m.sub, m.publisher_id) for m in messages] == [
        (b"gone", "alice", f"will:{channel}")
    ]


def test_will_refused_for_good_is_dropped(
    sessions: Sessions, reaper: Reaper, publisher: RecordingPublisher
) -> None:
    # Given a publish path that refuses the will for good (a 4xx: retrying cannot help)
    publisher.refusal = TopicNotFound("no composite topic and no default")
    expired_channel(sessions, reaper)
    sessions.clock.advance(30)
    report = reaper.run()
    assert (report.wills_published, report.wills_dropped, report.failed) == (0, 1, 0)
    assert sessions.view(CLIENT).wills == ()


def test_handler_runs_the_reaper_on_its_schedule(
    sessions: Sessions, reaper: Reaper, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reaper_app, "reaper", lambda: reaper)
    sessions.connected(CLIENT, keepalive_s=10)
    sessions.clock.advance(15)
    report = reaper_app.handler(load_event("reaper_schedule.json"), FakeContext())
    assert report["channels_expired"] == 1


def test_handler_builds_its_reaper_from_the_configuration(sessions: Sessions) -> None:
    reaper_app.reaper.cache_clear()
    built = reaper_app.reaper()
    reaper_app.reaper.cache_clear()
    assert isinstance(built.repository, SessionRepository)
    assert built.repository.table == get_config().table("sessions")
    assert isinstance(built.clock, SystemClock)
    assert isinstance(built.publisher, ServiceWillPublisher)
    # the will an expired channel leaves waiting gets its timer, on the wills queue
    assert isinstance(built.timer, SqsDueTimer)
    assert built.timer.url == get_config().queues["wills"]
