"""Wills on time (issue 47): a lost WebSocket connection's head, and the will it leaves, reaped
by their due timers (the wills queue's delayed messages, ``shoal.sessions.timers``) when they
are due, not at the reaper's next scheduled run.

The edge's routes run over moto as in ``test_edge``; the wills queue's mapping invokes the
reaper function's handler with Lambda's SQS event (``QueueMappings``), one batch a round, and
the emulated SQS keeps the world's manual clock, so a timer delayed 5 s is handed out once the
clock has moved 5 s, and not before. No scheduled reaper run happens unless a test says so.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import moto.sqs.models
import pytest
from botocore.exceptions import ClientError
from shoal.core.auth import Principal
from shoal.core.config import get_config
from shoal.core.errors import ServerBusy
from shoal.declarations import WILLS_MAPPING
from shoal.edge.pushwork import HandOffs
from shoal.local.esm.queues import QueueMapping, QueueMappings
from shoal.local.provision import LocalNames
from shoal.sessions.model import HEAD, HELD_WILL_BOUND_MS, WILL_PREFIX, ConnectRequest
from shoal.sessions.reaper import Reaper
from shoal.sessions.timers import SqsDueTimer

import functions.reaper.app as reaper_app
from tests.helpers import FakeContext
from tests.integration.test_edge import Edge, edge
from tests.integration.test_sessions_support import RecordingPublisher

__all__ = ["edge"]  # fixtures

WILL = {"topic": "alice/status", "text": "offline", "delay_s": 5}


class Timers:
    """The wills queue, its timers armed by the edge's registry and the reaper, and the
    reaper function taking them through its mapping, on the world's clock."""

    def __init__(self, edge: Edge, monkeypatch: pytest.MonkeyPatch) -> None:
        world = edge.world
        self.edge = edge
        clock = world.clock
        # the emulated SQS delays and hides messages by the world's clock
        monkeypatch.setattr(moto.sqs.models, "unix_time_millis", lambda: float(clock.now_ms()))
        monkeypatch.setattr(moto.sqs.models, "unix_time", lambda: clock.now_ms() / 1000)
        self.sqs = world.session.client("sqs")
        self.timer = SqsDueTimer(self.sqs, get_config().queues["wills"], clock)
        world.registry.timer = self.timer
        self.publisher = RecordingPublisher()
        self.reaper = Reaper(world.registry.repository, self.publisher, clock, timer=self.timer)
        monkeypatch.setattr(reaper_app, "reaper", lambda: self.reaper)
        monkeypatch.setattr(reaper_app, "hand_offs", lambda: HandOffs(edge.queue))
        self.answers: list[dict[str, Any]] = []
        self.mappings = QueueMappings(world.session, self._invoke)
        names = LocalNames.for_deployment()
        # Lambda's mapping of the reaper on the wills queue, as the stack declares it
        self.mapping = QueueMapping(
            uuid="wills",
            function_arn=names.functions["reaper"],
            queue_arn=names.queue_arn("wills"),
            batch_size=WILLS_MAPPING["BatchSize"],
            concurrency=1,
            report_item_failures=True,
            enabled=True,
        )

    def _invoke(self, _function: str, event: dict[str, Any]) -> Any:
        answer = reaper_app.handler(event, FakeContext())
        self.answers.append(answer)
        return answer

    def fire(self) -> int:
        """One round of the mapping: the timers the queue hands out now, in one batch (at
        most ten), through the reaper's handler; the timers finished."""
        messages = self.mappings.receive(self.mapping)
        return len(self.mappings.deliver(self.mapping, messages)) if messages else 0

    def waiting(self) -> int:
        """Timers in the queue, delayed or visible (not those in flight)."""
        attributes = self.sqs.get_queue_attributes(
            QueueUrl=self.timer.url,
            AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesDelayed"],
        )["Attributes"]
        return sum(int(v) for v in attributes.values())

    def wills(self) -> list[tuple[str, str | None]]:
        return [(client_id, will.text) for _, client_id, will, _ in self.publisher.published]


@pytest.fixture
def timers(edge: Edge, monkeypatch: pytest.MonkeyPatch) -> Iterator[Timers]:
    yield Timers(edge, monkeypatch)


def _connected(timers: Timers, client_id: str = "alice-1") -> bool:
    head = timers.reaper.repository.head(client_id)
    assert head is not None
    return head.connected


# --- a lost connection


def test_a_lost_connections_will_without_delay_is_published_by_its_timer(timers: Timers) -> None:
    # Given a WebSocket session with a will without delay
    timers.edge.connect("c1", will=WILL | {"delay_s": 0})
    # When its connection is lost ($disconnect without a disconnect frame)
    timers.edge.dropped("c1")
    # Then its timer, handed out at once, expires the channel and publishes the will: no
    # scheduled run of the reaper
    assert timers.fire() == 1
    assert not _connected(timers)
    assert timers.wills() == [("alice-1", "offline")]
    assert timers.waiting() == 0


def test_a_lost_connections_will_is_published_once_its_delay_passed(timers: Timers) -> None:
    # Given a lost connection whose will waits 5 s
    timers.edge.connect("c1", will=WILL)
    timers.edge.dropped("c1")
    # When its head's timer came: the channel expired, the will waits with a timer of its own
    assert timers.fire() == 1
    assert not _connected(timers)
    assert timers.wills() == []
    # Then the will's timer is not handed out while the delay runs ...
    timers.edge.world.clock.advance(4.999)
    assert timers.fire() == 0
    # ... and publishes it once the delay passed
    timers.edge.world.clock.advance(0.001)
    assert timers.fire() == 1
    assert timers.wills() == [("alice-1", "offline")]
    assert timers.waiting() == 0


def test_a_late_disconnect_counts_the_will_delay_from_the_close(timers: Timers) -> None:
    """API Gateway's $disconnect may run a while after the close (under ``shoal dev``'s load,
    seconds): its event's time is the close's, and MQTT 5 starts the delay there
    (§3.1.3.2.2). The 2-hour soak's wills came late or not at all when it was counted from
    the function's run."""
    # Given a connection lost at t, whose $disconnect runs 3 s later
    timers.edge.connect("c1", will=WILL)
    closed_at = timers.edge.world.clock.now_ms()
    timers.edge.world.clock.advance(3)
    timers.edge.dropped("c1", requestTimeEpoch=closed_at)
    assert timers.fire() == 1
    assert timers.wills() == []
    # Then its 5 s delay runs out 2 s later, at t + 5
    timers.edge.world.clock.advance(1.999)
    assert timers.fire() == 0
    timers.edge.world.clock.advance(0.001)
    assert timers.fire() == 1
    assert timers.wills() == [("alice-1", "offline")]


def test_a_disconnect_later_than_the_delay_publishes_the_will_at_once(timers: Timers) -> None:
    # Given a connection lost 6 s before its $disconnect ran, with a 5 s will delay
    timers.edge.connect("c1", will=WILL)
    closed_at = timers.edge.world.clock.now_ms()
    timers.edge.world.clock.advance(6)
    timers.edge.dropped("c1", requestTimeEpoch=closed_at)
    # Then the head's timer expires the channel and publishes the will in the same run
    assert timers.fire() == 1
    assert timers.wills() == [("alice-1", "offline")]
    assert timers.waiting() == 0


@pytest.mark.parametrize("step", ["connection", "lose"])
def test_a_disconnect_the_store_refuses_for_a_while_still_leaves_the_will(
    timers: Timers, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    """API Gateway invokes $disconnect once, whatever it answers. The 200-client soak's
    emulator refused three of them busy (DynamoDB can answer 503 or throttle as well): their
    sessions stayed connected to gone connections, their wills never published."""
    # Given a connection with a will, whose $disconnect finds the store busy twice at `step`
    timers.edge.connect("c1", will=WILL)
    owner: Any = (
        timers.edge.service.connections
        if step == "connection"
        else timers.edge.world.registry.repository
    )
    real = getattr(owner, step)
    refusals = iter([ServerBusy("the store is busy; retry")] * 2)

    def busy(*args: Any, **kwargs: Any) -> Any:
        refused = next(refusals, None)
        if refused is not None:
            raise refused
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, step, busy)
    closed_at = timers.edge.world.clock.now_ms()
    # When the connection is lost
    timers.edge.dropped("c1", requestTimeEpoch=closed_at)
    # Then the $disconnect got through: the channel expires, and the will comes after its
    # delay from the close
    assert next(refusals, None) is None
    assert timers.fire() == 1
    assert not _connected(timers)
    timers.edge.world.clock.advance(5)  # the will's delay
    assert timers.fire() == 1
    assert timers.wills() == [("alice-1", "offline")]


def test_a_disconnect_event_time_ahead_of_the_clock_counts_from_now(timers: Timers) -> None:
    # Given a $disconnect whose event says a time after this function's clock (clocks skew)
    timers.edge.connect("c1", will=WILL)
    timers.edge.dropped("c1", requestTimeEpoch=timers.edge.world.clock.now_ms() + 60_000)
    assert timers.fire() == 1
    # Then the delay counts from now, not from the future
    timers.edge.world.clock.advance(5)
    assert timers.fire() == 1
    assert timers.wills() == [("alice-1", "offline")]


def test_a_reconnect_within_the_delay_cancels_the_will_its_timer_comes_for(
    timers: Timers,
) -> None:
    # Given a lost connection whose head's timer expired the channel and armed the will's
    timers.edge.connect("c1", will=WILL)
    timers.edge.dropped("c1")
    assert timers.fire() == 1
    # When the client connects again within the will's delay (the session resumes)
    timers.edge.world.clock.advance(3)
    assert timers.edge.connect("c2")["session_present"] is True
    # Then the will's timer comes after the delay and finds nothing to publish
    timers.edge.world.clock.advance(3)
    assert timers.fire() == 1
    assert timers.wills() == []


def test_a_duplicate_timer_publishes_the_will_once(timers: Timers) -> None:
    # Given a lost connection's will waiting with its timer, and the same timer sent twice
    timers.edge.connect("c1", will=WILL)
    timers.edge.dropped("c1")
    assert timers.fire() == 1
    head = timers.reaper.repository.head("alice-1")
    assert head is not None
    will = WILL_PREFIX + head.newest.key
    timers.timer.arm("alice-1", will, timers.edge.world.clock.now_ms() + 5000)
    # When both come after the delay, in one batch
    timers.edge.world.clock.advance(5)
    assert timers.fire() == 2
    # Then the will is published once (the second finds it claimed, then gone)
    assert timers.wills() == [("alice-1", "offline")]


def test_a_duplicate_head_timer_expires_the_channel_once(
    timers: Timers, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a lost connection whose head's timer was sent twice
    timers.edge.connect("c1", will=WILL | {"delay_s": 0})
    timers.edge.dropped("c1")
    timers.timer.arm("alice-1", HEAD, timers.edge.world.clock.now_ms())
    expired: list[bool] = []
    expire = timers.reaper.repository.expire_channel

    def counted(*args: Any) -> bool:
        expired.append(expire(*args))
        return expired[-1]

    monkeypatch.setattr(timers.reaper.repository, "expire_channel", counted)
    # When both come, in one batch
    assert timers.fire() == 2
    # Then the channel expired once (the second found it expired) and its will went out once
    assert expired == [True]
    assert timers.wills() == [("alice-1", "offline")]


def test_a_timer_that_comes_early_is_armed_again_for_the_rest(
    timers: Timers, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given timers sent with at most 2 s of delay (as SQS's 15 minutes cut a longer one)
    monkeypatch.setattr(timers.timer, "longest_s", 2)
    timers.edge.connect("c1", will=WILL)
    timers.edge.dropped("c1")
    assert timers.fire() == 1
    # When the will's timer comes after 2 s of its 5
    timers.edge.world.clock.advance(2)
    assert timers.fire() == 1
    # Then nothing is published and a timer waits for the rest, not lost
    assert timers.wills() == []
    assert timers.waiting() == 1
    timers.edge.world.clock.advance(2)
    assert timers.fire() == 1  # early again: armed for the last second
    assert timers.wills() == []
    timers.edge.world.clock.advance(1)
    assert timers.fire() == 1
    assert timers.wills() == [("alice-1", "offline")]
    assert timers.waiting() == 0


def test_a_timer_not_armed_leaves_the_will_to_the_schedule(
    timers: Timers, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a wills queue that refuses sends
    def refused(**_: Any) -> None:
        answer: Any = {"Error": {"Code": "ServiceUnavailable", "Message": "down"}}
        raise ClientError(answer, "SendMessage")

    monkeypatch.setattr(timers.sqs, "send_message", refused)
    timers.edge.connect("c1", will=WILL | {"delay_s": 0})
    # When the connection is lost: the $disconnect does its work all the same
    timers.edge.dropped("c1")
    assert timers.fire() == 0
    # Then the scheduled run, the backstop, publishes the will
    assert timers.reaper.run().wills_published == 1
    assert timers.wills() == [("alice-1", "offline")]


def test_a_timer_whose_step_failed_returns_to_the_queue(timers: Timers) -> None:
    # Given a lost connection's will due now, and a publish path failing once
    timers.edge.connect("c1", will=WILL | {"delay_s": 0})
    timers.edge.dropped("c1")
    timers.publisher.failures = 1
    # When its timer comes: the will's publish fails
    assert timers.fire() == 0
    # Then the handler names the timer as failed: it stays in the queue (in flight until its
    # visibility timeout), and the will waits claimed, for its retry
    [answer] = timers.answers
    assert len(answer["batchItemFailures"]) == 1
    assert timers.wills() == []


def test_an_unreadable_timer_is_dropped(timers: Timers) -> None:
    # Given a message no timer wrote
    timers.sqs.send_message(QueueUrl=timers.timer.url, MessageBody='{"v": 99}')
    # When it comes: it is finished (deleted), not returned to come again
    assert timers.fire() == 1
    assert timers.answers == [{"batchItemFailures": []}]
    assert timers.waiting() == 0


# --- a takeover


def test_a_takeovers_will_without_delay_is_published_by_its_timer(timers: Timers) -> None:
    # Given a live WebSocket session with a will without delay
    timers.edge.connect("c1", will=WILL | {"delay_s": 0})
    # When another connection takes the session over (MQTT 5: the will without delay goes)
    timers.edge.connect("c2")
    # Then the will's timer, due at once, publishes it: no scheduled run
    assert timers.fire() == 1
    assert timers.wills() == [("alice-1", "offline")]


def test_a_clean_start_publishes_the_waiting_will_by_its_timer(timers: Timers) -> None:
    # Given a lost connection whose will waits 5 s
    timers.edge.connect("c1", will=WILL)
    timers.edge.dropped("c1")
    assert timers.fire() == 1
    # When the client connects with a clean start within the delay (the session ends)
    timers.edge.connect("c2", clean_start=True)
    # Then the will is published at once, by the timer the connect armed
    assert timers.fire() == 1
    assert timers.wills() == [("alice-1", "offline")]
    # and its first timer, when it comes, finds it gone
    timers.edge.world.clock.advance(5)
    assert timers.fire() == 1
    assert timers.wills() == [("alice-1", "offline")]


# --- an HTTP channel's keepalive (issue 47: the soak's one late will)

HTTP_KEEPALIVE_S = 10
#: the channel expires 1.5 times its keepalive after its last request ([MQTT-3.1.2-22])
HTTP_GRACE_S = HTTP_KEEPALIVE_S * 1.5
ALICE = Principal(sub="alice", clients=("alice-1",), publish=("alice/#",))


def _http_connect(timers: Timers, **fields: Any) -> str:
    """An HTTP connect (no WebSocket connection keeps it live: its keepalive does); its
    channel."""
    timers.edge.world.clock.advance(0.001)
    request = ConnectRequest.model_validate(
        {"clean_start": False, "session_expiry_s": 3600, "keepalive_s": HTTP_KEEPALIVE_S} | fields
    )
    return timers.edge.world.registry.connect(ALICE, "alice-1", request).channel


def test_an_http_channel_silent_past_its_keepalive_leaves_its_will_on_time(
    timers: Timers,
) -> None:
    # Given an HTTP channel with a will without delay, and no request after its connect
    _http_connect(timers, will=WILL | {"delay_s": 0})
    # When 1.5 times its keepalive has not quite passed
    timers.edge.world.clock.advance(HTTP_GRACE_S - 0.5)
    assert timers.fire() == 0
    assert _connected(timers)
    # Then as it passes, its timer expires the channel and the will goes out: no scheduled
    # run of the reaper (it would come up to a minute later)
    timers.edge.world.clock.advance(0.5)
    assert timers.fire() == 1
    assert not _connected(timers)
    assert timers.wills() == [("alice-1", "offline")]
    assert timers.waiting() == 0


def test_a_busy_http_channels_keepalive_timer_goes_on_and_expires_it_once_silent(
    timers: Timers,
) -> None:
    # Given an HTTP channel with a will, whose client makes a request within its keepalive
    channel = _http_connect(timers, will=WILL | {"delay_s": 0})
    clock = timers.edge.world.clock
    clock.advance(HTTP_KEEPALIVE_S)
    timers.edge.world.registry.heartbeat(ALICE, "alice-1", channel)
    # When its first deadline comes: the channel was seen since
    clock.advance(HTTP_GRACE_S - HTTP_KEEPALIVE_S)
    assert timers.fire() == 1
    # Then it stays connected, and one timer waits for its new deadline (1.5 keepalives
    # after the request), not two
    assert _connected(timers)
    assert timers.wills() == []
    assert timers.waiting() == 1
    clock.advance(HTTP_KEEPALIVE_S - 0.5)
    assert timers.fire() == 0
    clock.advance(0.5)
    assert timers.fire() == 1
    assert not _connected(timers)
    assert timers.wills() == [("alice-1", "offline")]


def test_a_reconnected_http_channel_keeps_one_keepalive_timer(timers: Timers) -> None:
    # Given an HTTP channel with a will, connected again half a keepalive later
    _http_connect(timers, will=WILL)
    clock = timers.edge.world.clock
    clock.advance(HTTP_KEEPALIVE_S / 2)
    _http_connect(timers, will=WILL)
    assert timers.waiting() == 2
    # When the first connect's deadline comes
    clock.advance(HTTP_GRACE_S - HTTP_KEEPALIVE_S / 2)
    assert timers.fire() == 1
    # Then its timer does nothing (the head is due at the newer connect's deadline): it is not
    # armed again, and the newer connect's timer expires the channel at its own deadline
    assert timers.waiting() == 1
    assert _connected(timers)
    clock.advance(HTTP_KEEPALIVE_S / 2)
    assert timers.fire() == 1
    assert not _connected(timers)
    assert timers.waiting() == 1  # the will's, for its 5 s delay
    clock.advance(5)  # the will's delay
    assert timers.fire() == 1
    assert timers.wills() == [("alice-1", "offline")]
    assert timers.waiting() == 0


def test_an_http_channel_without_a_will_arms_no_keepalive_timer(timers: Timers) -> None:
    # Given an HTTP channel without a will: nothing is published when it expires, so its
    # expiry is left to the schedule (a timer chain costs requests every keepalive)
    _http_connect(timers)
    # Then no timer waits
    assert timers.waiting() == 0


def test_the_schedule_takes_up_an_http_channels_lost_keepalive_timer(
    timers: Timers, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given an HTTP channel with a will whose connect could not arm its timer (the queue
    # refused the send), and a request within its keepalive
    sends = timers.sqs.send_message

    def refused(**_: Any) -> None:
        answer: Any = {"Error": {"Code": "ServiceUnavailable", "Message": "down"}}
        raise ClientError(answer, "SendMessage")

    monkeypatch.setattr(timers.sqs, "send_message", refused)
    channel = _http_connect(timers, will=WILL | {"delay_s": 0})
    monkeypatch.setattr(timers.sqs, "send_message", sends)
    assert timers.waiting() == 0
    clock = timers.edge.world.clock
    clock.advance(HTTP_KEEPALIVE_S)
    timers.edge.world.registry.heartbeat(ALICE, "alice-1", channel)
    # When the scheduled run finds the head past its first deadline
    clock.advance(HTTP_GRACE_S - HTTP_KEEPALIVE_S + 1)
    assert timers.reaper.run().rescheduled == 1
    # Then it arms the timer for the new deadline, which expires the channel on time
    assert timers.waiting() == 1
    clock.advance(HTTP_KEEPALIVE_S - 1 - 0.5)
    assert timers.fire() == 0
    clock.advance(0.5)
    assert timers.fire() == 1
    assert timers.wills() == [("alice-1", "offline")]


# --- a takeover that comes before the gone connection's $disconnect (issue 47: the 200-client
# soak's wills never published: a reconnect's connect ran while the dropped connection's
# $disconnect still waited, took over a channel that looked live, and withheld the will)


def _held(timers: Timers) -> list[Any]:
    view = timers.reaper.repository.read("alice-1", consistent=True)
    return [w for w in view.wills if w.held_since_ms is not None]


def test_a_takeover_after_the_delay_from_the_close_publishes_the_will_at_the_disconnect(
    timers: Timers,
) -> None:
    # Given a connection with a 5 s will delay that closes at t, its $disconnect not run yet
    timers.edge.connect("c1", will=WILL)
    closed_at = timers.edge.world.clock.now_ms()
    # When the client connects again 6 s later: the session resumes, over a channel that
    # still looks live, and the will is held, not published and not dropped
    timers.edge.world.clock.advance(6)
    assert timers.edge.connect("c2")["session_present"] is True
    assert timers.fire() == 0
    assert timers.wills() == [] and len(_held(timers)) == 1
    # Then the late $disconnect says the connection closed at t: the delay ran out with no new
    # connection (MQTT 5 §3.1.3.2.2, [MQTT-3.1.2-8]), so the will goes now, once
    timers.edge.world.clock.advance(2)
    timers.edge.dropped("c1", requestTimeEpoch=closed_at)
    assert timers.fire() == 1
    assert timers.wills() == [("alice-1", "offline")]
    assert _held(timers) == [] and timers.waiting() == 0
    # And the new channel is the live one, untouched
    assert _connected(timers)


def test_a_takeover_within_the_delay_from_the_close_drops_the_will_at_the_disconnect(
    timers: Timers,
) -> None:
    # Given a connection with a 5 s will delay that closes at t, and the client back at t + 2,
    # before that connection's $disconnect
    timers.edge.connect("c1", will=WILL)
    closed_at = timers.edge.world.clock.now_ms()
    timers.edge.world.clock.advance(2)
    timers.edge.connect("c2")
    # When the $disconnect comes, Then the will is dropped: a new connection came within its
    # delay ([MQTT-3.1.3-9]); nothing is published, now or later
    timers.edge.dropped("c1", requestTimeEpoch=closed_at)
    assert _held(timers) == []
    timers.edge.world.clock.advance(3600)
    timers.reaper.run()
    assert timers.fire() == 0
    assert timers.wills() == []


def test_a_live_channel_taken_over_never_has_its_delayed_will_published(timers: Timers) -> None:
    # Given a live connection with a will delay, taken over by a new connection of its client
    timers.edge.connect("c1", will=WILL)
    timers.edge.world.clock.advance(1)
    timers.edge.connect("c2")
    # When the old connection closes after the takeover (its $disconnect at its own time)
    timers.edge.world.clock.advance(10)
    timers.edge.dropped("c1")
    # Then its will is withheld, as MQTT says for a session resumed within the delay
    timers.edge.world.clock.advance(3600)
    timers.reaper.run()
    assert timers.fire() == 0
    assert timers.wills() == [] and _held(timers) == []


def test_a_held_will_whose_close_never_comes_is_dropped_at_its_bound(timers: Timers) -> None:
    # Given a will held by a takeover, and no $disconnect of the old connection ever
    timers.edge.connect("c1", will=WILL)
    timers.edge.world.clock.advance(1)
    timers.edge.connect("c2")
    assert len(_held(timers)) == 1
    # When the schedule runs before the bound, Then it waits
    timers.edge.world.clock.advance(HELD_WILL_BOUND_MS / 1000 - 1)
    assert timers.reaper.run().wills_withheld == 0
    assert len(_held(timers)) == 1
    # And past the bound it is dropped, never published
    timers.edge.world.clock.advance(2)
    assert timers.reaper.run().wills_withheld == 1
    assert _held(timers) == [] and timers.wills() == []


def test_an_http_channel_past_its_keepalive_taken_over_after_the_delay_leaves_its_will(
    timers: Timers,
) -> None:
    # Given an HTTP channel with a 5 s will delay, silent past 1.5 keepalives and 5 s more,
    # its expiry not reaped yet (the reaper behind)
    _http_connect(timers, will=WILL)
    timers.edge.world.clock.advance(HTTP_GRACE_S + 5)
    # When its client connects again, Then the channel counts as closed when its keepalive
    # ran out, the delay ran out after it, and the will goes at once
    _http_connect(timers)
    timers.fire()
    assert timers.wills() == [("alice-1", "offline")]
    assert _held(timers) == []


def test_an_http_channel_past_its_keepalive_taken_over_within_the_delay_withholds_its_will(
    timers: Timers,
) -> None:
    # Given an HTTP channel with a 5 s will delay whose keepalive ran out 2 s ago, unreaped
    _http_connect(timers, will=WILL)
    timers.edge.world.clock.advance(HTTP_GRACE_S + 2)
    # When its client connects again, Then the session resumes within the delay: no will
    _http_connect(timers)
    timers.edge.world.clock.advance(3600)
    timers.reaper.run()
    timers.fire()
    assert timers.wills() == [] and _held(timers) == []
