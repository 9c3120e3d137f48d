"""shoal.client.ws against a fake WebSocket API (no server, no sockets): the session's frames,
exactly-once processing across lost acks and reconnects, flow control, keep-alive, takeover,
token renewal, and how ``shoal subscribe`` finds the ws:// URL."""

from __future__ import annotations

import base64
import json
import logging
import random
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from shoal.cli.common import UsageError
from shoal.cli.pubsub import ws_url_of
from shoal.client.errors import ApiError, SessionTakenOver, Unavailable
from shoal.client.support import CallRetry, FlowControl, Outages
from shoal.client.ws import ShoalWsClient
from shoal.client.wslink import HandshakeRefused, LinkLost, WsSettings
from shoal.core.clock import ManualClock

URL = "ws://shoal.test"


def jwt(sub: str, n: int = 0) -> str:
    claims = base64.urlsafe_b64encode(json.dumps({"sub": sub, "n": n}).encode()).decode()
    return f"h.{claims.rstrip('=')}.s"


TOKEN = jwt("alice")
POLICY = CallRetry(timeout_s=2.0, attempts=3, backoff_s=0.5, max_backoff_s=4.0)
SETTINGS = WsSettings(keepalive_thread=False)


class SleepLog(ManualClock):
    """A manual clock that remembers every sleep (and calls ``on_sleep`` after each)."""

    def __init__(self) -> None:
        super().__init__()
        self.sleeps: list[float] = []
        self.on_sleep: Any = None

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        super().sleep(seconds)
        if self.on_sleep is not None:
            self.on_sleep()


@dataclass
class Session:
    client_id: str
    subscriptions: dict[str, int] = field(default_factory=dict)
    #: delivery id -> message (every message the session was given, in order)
    inbox: dict[str, dict[str, Any]] = field(default_factory=dict)
    acked: set[str] = field(default_factory=set)
    #: handed to a connection, not acked (in order)
    in_flight: list[str] = field(default_factory=list)
    #: every ack frame's ids, in order
    ack_frames: list[list[str]] = field(default_factory=list)


class FakeSocket:
    def __init__(self, server: FakeServer, headers: Mapping[str, str]) -> None:
        self.server = server
        self.headers = dict(headers)
        self.inbound: deque[str] = deque()
        self.sent: list[dict[str, Any]] = []
        self.closed_code: int | None = None
        self.client_closed = False
        self.client_id: str | None = None
        self.window = 0
        self.channel = ""

    # the client's side
    def send(self, message: str) -> None:
        if self.closed_code is not None or self.client_closed:
            raise LinkLost("closed", self.closed_code)
        frame = json.loads(message)
        self.sent.append(frame)
        self.server.frame(self, frame)

    def recv(self, timeout: float | None = None) -> str:
        if self.inbound:
            return self.inbound.popleft()
        if self.closed_code is not None:
            raise LinkLost("closed", self.closed_code)
        # nothing comes: the wait passes, unless a message scheduled meanwhile comes first
        if not self.server.publish_due(within_s=timeout or 0) and self.closed_code is None:
            self.server.clock.advance(timeout or 0)
        if self.inbound:
            return self.inbound.popleft()
        raise TimeoutError

    def close(self, code: int = 1000, reason: str = "") -> None:
        self.client_closed = True
        self.server.closed(self)

    # the server's side
    def push(self, frame: Mapping[str, Any]) -> None:
        self.inbound.append(json.dumps(frame))

    def drop(self, code: int = 1006) -> None:
        self.closed_code = code
        self.server.closed(self)

    @property
    def open(self) -> bool:
        return self.closed_code is None and not self.client_closed


class FakeServer:
    """The WebSocket API as the brief describes it: connect, subscribe, pushed messages within
    the window, acks, ping, takeover, redelivery with dup on reconnect."""

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self.tokens: set[str] = {TOKEN}
        self.down = False
        self.refuse_status: int | None = None
        self.sessions: dict[str, Session] = {}
        self.sockets: list[FakeSocket] = []
        self.connects: list[dict[str, Any]] = []
        self.live: dict[str, FakeSocket] = {}
        self.seq = 0
        self.answer_pings = True
        #: drop acks instead of applying them (the ack's answer or the ack itself lost)
        self.lose_acks = False
        #: ``renew`` frames, and whether to refuse them (as for a connection lost meanwhile)
        self.renews: list[dict[str, Any]] = []
        self.refuse_renewals = False
        #: (clock ms, topic, text), in time order: published when the clock gets there
        self.scheduled: deque[tuple[int, str, str]] = deque()
        #: the clock's time of each ack frame, beside ``Session.ack_frames``
        self.ack_times: list[int] = []

    # -- the connector
    def connector(self, url: str, headers: Mapping[str, str], timeout: float) -> FakeSocket:
        if self.down:
            raise LinkLost("connection refused")
        if self.refuse_status is not None:
            raise HandshakeRefused(self.refuse_status)
        token = headers.get("Authorization", "").removeprefix("Bearer ")
        if token not in self.tokens:
            raise HandshakeRefused(401, b'{"message":"Unauthorized"}')
        socket = FakeSocket(self, headers)
        self.sockets.append(socket)
        return socket

    # -- frames
    def frame(self, socket: FakeSocket, frame: dict[str, Any]) -> None:
        action, ref = frame["action"], frame.get("ref")
        if action == "ping":
            if self.answer_pings:
                socket.push({"action": "pong"})
            return
        if action == "keepalive":
            return  # one way, as API Gateway's mock route
        if action == "connect":
            self.connects.append(frame)
            client_id = frame["client_id"]
            present = client_id in self.sessions and not frame["clean_start"]
            if not present:
                self.sessions[client_id] = Session(client_id)
            old = self.live.get(client_id)
            socket.client_id = client_id
            socket.window = int(frame.get("receive_maximum") or 10)
            self.live[client_id] = socket
            if old is not None and old is not socket and old.open:
                old.push({"action": "disconnect", "reason": "session_taken_over"})
                old.drop(1000)
            socket.channel = f"ch{len(self.connects)}"
            socket.push(
                {
                    "ref": ref,
                    "action": "connected",
                    "session_present": present,
                    "channel": socket.channel,
                    "keepalive_s": 0,
                    "receive_maximum": socket.window,
                }
            )
            # what was in flight on the older connection comes again, with dup
            self.push(client_id, redeliver=True)
            return
        if action == "renew":
            # the live channel moves to this connection: nothing said to the older one, nothing
            # in flight sent again
            self.renews.append(frame)
            old = self.live.get(frame["client_id"])
            if self.refuse_renewals or old is None or old.channel != frame["channel"]:
                error = {"code": "renew_refused", "message": "send connect"}
                socket.push({"ref": ref, "action": "error", "status": 409, "error": error})
                return
            socket.client_id, socket.window, socket.channel = old.client_id, old.window, old.channel
            self.live[frame["client_id"]] = socket
            socket.push(
                {
                    "ref": ref,
                    "action": "connected",
                    "session_present": True,
                    "channel": socket.channel,
                    "keepalive_s": 0,
                    "receive_maximum": socket.window,
                }
            )
            return
        session = self.sessions[str(socket.client_id)]
        if action == "subscribe":
            granted = []
            for sub in frame["subscriptions"]:
                session.subscriptions[sub["filter"]] = sub["qos"]
                granted.append(sub["qos"])
            socket.push({"ref": ref, "action": "subscribed", "granted": granted})
        elif action == "ack":
            session.ack_frames.append(list(frame["ids"]))
            self.ack_times.append(self.clock.now_ms())
            if self.lose_acks:
                return
            fresh = [i for i in frame["ids"] if i not in session.acked]
            session.acked |= set(fresh)
            session.in_flight = [i for i in session.in_flight if i not in session.acked]
            socket.push({"ref": ref, "action": "acked", "acked": len(fresh)})
            self.push(session.client_id)
        elif action == "disconnect":
            socket.push({"ref": ref, "action": "disconnect", "reason": "normal"})
            socket.drop(1000)
            self.live.pop(session.client_id, None)

    def closed(self, socket: FakeSocket) -> None:
        if socket.client_id is not None and self.live.get(socket.client_id) is socket:
            del self.live[socket.client_id]

    # -- messages
    def publish(self, topic: str, text: str, qos: int = 1) -> list[str]:
        ids = []
        for session in self.sessions.values():
            if any(_matches(f, topic) for f in session.subscriptions):
                self.seq += 1
                delivery = f"d{self.seq}"
                session.inbox[delivery] = {
                    "id": delivery,
                    "message_id": f"m{self.seq}",
                    "topic": topic,
                    "payload": base64.b64encode(text.encode()).decode(),
                    "qos": qos,
                    "retain": False,
                    "dup": False,
                    "subscription": next(f for f in session.subscriptions if _matches(f, topic)),
                    "properties": {},
                    "published_at": self.clock.now_ms(),
                }
                ids.append(delivery)
                self.push(session.client_id)
        return ids

    def push(self, client_id: str, redeliver: bool = False) -> None:
        socket = self.live.get(client_id)
        session = self.sessions.get(client_id)
        if socket is None or session is None or not socket.open:
            return
        if redeliver:
            for delivery in session.in_flight:
                socket.push({"action": "message", **session.inbox[delivery], "dup": True})
        handed = set(session.in_flight) | session.acked
        for delivery, message in session.inbox.items():
            if len(session.in_flight) >= socket.window:
                return
            if delivery not in handed:
                session.in_flight.append(delivery)
                socket.push({"action": "message", **message})

    def publish_due(self, within_s: float) -> bool:
        """A client waits ``within_s``: if a scheduled message is due by then, the clock moves
        to it and it is published (True)."""
        if not self.scheduled or self.scheduled[0][0] > self.clock.now_ms() + within_s * 1000:
            return False
        at_ms, topic, text = self.scheduled.popleft()
        self.clock.advance(max(at_ms - self.clock.now_ms(), 0) / 1000)
        self.publish(topic, text)
        return True

    def redeliver(self, client_id: str, delivery: str) -> None:
        """The ack timeout passed: ``delivery`` comes again, with dup, on the live connection."""
        self.live[client_id].push(
            {"action": "message", **self.sessions[client_id].inbox[delivery], "dup": True}
        )

    def frames(self, action: str) -> list[dict[str, Any]]:
        return [f for s in self.sockets for f in s.sent if f["action"] == action]


def _matches(pattern: str, topic: str) -> bool:
    if pattern.endswith("/#"):
        return topic.startswith(pattern[:-1]) or topic == pattern[:-2]
    return pattern == topic


@pytest.fixture
def clock() -> SleepLog:
    return SleepLog()


@pytest.fixture
def server(clock: SleepLog) -> FakeServer:
    return FakeServer(clock)


class Clients:
    def __init__(self, server: FakeServer, clock: SleepLog, state: Path) -> None:
        self.server = server
        self.clock = clock
        self.state = state
        self.made: list[ShoalWsClient] = []

    def new(self, token: Any = TOKEN, **options: Any) -> ShoalWsClient:
        for old in self.made:
            old.state.close()
        options.setdefault("settings", SETTINGS)
        client = ShoalWsClient(
            URL,
            token,
            client_id="c1",
            state=self.state,
            policy=POLICY,
            connector=self.server.connector,
            clock=self.clock,
            rng=random.Random(7),
            **options,
        )
        self.made.append(client)
        return client


@pytest.fixture
def clients(server: FakeServer, clock: SleepLog, tmp_path: Path) -> Iterator[Clients]:
    made = Clients(server, clock, tmp_path / "state.json")
    yield made
    for client in made.made:
        client.state.close()


def texts(messages: Any) -> list[str]:
    return [m.text for m in messages]


def soon(clock: ManualClock, seconds: float = 5) -> int:
    return clock.now_ms() + int(seconds * 1000)


# -- the session -----------------------------------------------------------------------------------


def test_connect_subscribe_and_each_pushed_message_once(clients: Clients) -> None:
    client = clients.new()
    assert client.subscribe("a/#") == [1]
    clients.server.publish("a/1", "one")
    clients.server.publish("a/2", "two")
    got = list(client.messages(count=2))
    assert texts(got) == ["one", "two"]
    # the raw message is the API's (the CLI prints it with --json): no `action`
    assert "action" not in got[0].raw and got[0].raw["id"] == "d1"
    client.close()
    session = clients.server.sessions["c1"]
    assert session.acked == {"d1", "d2"}
    # the first connect sends the options given; the default resumes a kept session
    (connect,) = clients.server.connects
    assert connect["clean_start"] is False and connect["client_id"] == "c1"
    assert connect["receive_maximum"] == 100


def test_a_message_is_acked_only_after_the_application_asks_for_the_next(
    clients: Clients,
) -> None:
    client = clients.new()
    client.subscribe("a/#")
    clients.server.publish("a/1", "one")
    clients.server.publish("a/2", "two")
    session = clients.server.sessions["c1"]
    stream = client.messages()
    first = next(stream)
    # while the application holds it, it is not acked
    assert first.id not in session.acked
    assert clients.server.frames("ack") == []
    second = next(stream)
    stream.close()
    client.close()
    # closing sends the acks of what was processed; the one held stays unacked
    assert session.acked == {first.id}
    assert second.id not in session.acked


def test_a_handler_that_raises_gets_its_message_again_and_it_is_acked_once(
    clients: Clients,
) -> None:
    client = clients.new()
    client.subscribe("a/#")
    clients.server.publish("a/1", "one")
    clients.server.publish("a/2", "two")
    calls: list[str] = []

    def fragile(message: Any) -> None:
        calls.append(message.text)
        if message.text == "two" and calls.count("two") == 1:
            raise RuntimeError("handler failed")

    with pytest.raises(RuntimeError):
        client.consume(fragile)
    session = clients.server.sessions["c1"]
    # the first was processed (its ack held), the second not
    assert client.state.was_processed("c1", "d1")
    assert not client.state.was_processed("c1", "d2")
    # the failed one is handed out again first, then acked once its handler returned
    assert client.consume(fragile, count=1) == 1
    assert calls == ["one", "two", "two"]
    client.close()
    assert session.acked == {"d1", "d2"}


def test_a_redelivered_id_already_processed_is_acked_again_and_not_handed_out(
    clients: Clients,
) -> None:
    client = clients.new()
    client.subscribe("a/#")
    server = clients.server
    server.lose_acks = True  # the ack is lost on its way
    server.publish("a/1", "one")
    assert texts(client.messages(count=1)) == ["one"]
    client.ack()  # its held ack goes now
    assert server.frames("ack")[-1]["ids"] == ["d1"]
    server.lose_acks = False
    # the ack timeout passes: d1 comes again with dup, then a new one
    server.redeliver("c1", "d1")
    server.publish("a/2", "two")
    assert texts(client.messages(count=1)) == ["two"]
    client.close()
    assert server.sessions["c1"].acked == {"d1", "d2"}
    # d1 was acked twice: once lost, once again after its redelivery
    assert sum(ids.count("d1") for ids in server.sessions["c1"].ack_frames) == 2


def test_processed_ids_survive_a_restart_of_the_client(clients: Clients) -> None:
    server = clients.server
    server.lose_acks = True
    first = clients.new()
    first.subscribe("a/#")
    server.publish("a/1", "one")
    assert texts(first.messages(count=1)) == ["one"]
    first.close()
    server.lose_acks = False
    # a new process on the same state file: the unacked d1 comes again on reconnect
    second = clients.new()
    server.publish("a/2", "two")
    assert texts(second.messages(count=1)) == ["two"]
    second.close()
    assert server.sessions["c1"].acked == {"d1", "d2"}


# -- acks held for a delay -------------------------------------------------------------------------


def test_acks_are_held_for_the_delay_and_go_in_one_frame(clients: Clients) -> None:
    # Given ten messages waiting for a client with the default delay (300 ms)
    client = clients.new()
    client.subscribe("a/#")
    server = clients.server
    for n in range(10):
        server.publish("a/x", str(n))
    start = clients.clock.now_ms()
    # When it processes them all and waits for more
    assert texts(client.messages(until_ms=soon(clients.clock))) == [str(n) for n in range(10)]
    # Then one ack frame carried the ten ids, 300 ms after the first was processed
    assert server.sessions["c1"].ack_frames == [[f"d{n}" for n in range(1, 11)]]
    assert server.ack_times == [start + 300]
    client.close()


def test_at_a_low_rate_the_acks_of_one_delay_share_a_frame(clients: Clients) -> None:
    # Given a message every 100 ms, each processed as it comes, with the default delay
    client = clients.new()
    client.subscribe("a/#")
    server = clients.server
    start = clients.clock.now_ms()
    published = {f"d{n}": start + 100 * n for n in range(1, 13)}
    server.scheduled.extend((at, "a/x", name) for name, at in published.items())
    # When the twelve are processed
    got = list(client.messages(until_ms=soon(clients.clock, 3)))
    assert len(got) == 12
    frames = server.sessions["c1"].ack_frames
    # Then a frame carries the acks of about 300 ms: four frames, not twelve
    assert len(frames) == 4
    assert sorted(i for ids in frames for i in ids) == sorted(published)
    # and none was held past the delay: a frame goes at most 300 ms after its oldest id was
    # processed (as it came)
    for ids, sent in zip(frames, server.ack_times, strict=True):
        assert sent - published[ids[0]] <= 300
    client.close()


def test_an_ack_delay_of_zero_acks_each_message_before_the_next_is_handed_out(
    clients: Clients,
) -> None:
    # Given a message every 100 ms and a client with no ack delay
    client = clients.new(ack_delay_s=0)
    client.subscribe("a/#")
    server = clients.server
    start = clients.clock.now_ms()
    server.scheduled.extend((start + 100 * n, "a/x", str(n)) for n in range(1, 6))
    # When it processes them
    assert len(list(client.messages(until_ms=soon(clients.clock, 1)))) == 5
    # Then each got an ack frame of its own, sent as it was processed
    assert server.sessions["c1"].ack_frames == [[f"d{n}"] for n in range(1, 6)]
    assert server.ack_times == [start + 100 * n for n in range(1, 6)]
    client.close()


def test_half_the_window_waiting_for_acks_sends_them_at_once(clients: Clients) -> None:
    # Given a window of 10, full, and two more messages behind it
    client = clients.new(flow=FlowControl(max_messages=10))
    client.subscribe("a/#")
    server = clients.server
    for n in range(12):
        server.publish("a/x", str(n))
    start = clients.clock.now_ms()
    # When five are processed (the application asks for the sixth)
    stream = client.messages()
    for _ in range(6):
        next(stream)
    # Then their acks went at once, in one frame, before the delay, and the window opened
    assert server.sessions["c1"].ack_frames == [[f"d{n}" for n in range(1, 6)]]
    assert server.ack_times == [start]
    assert server.sessions["c1"].in_flight[-2:] == ["d11", "d12"]
    stream.close()
    client.close()


def test_held_acks_go_before_waiting_would_keep_the_window_shut(clients: Clients) -> None:
    # Given a window of 4 filled by messages the application holds (auto_ack off), and more
    # behind it
    client = clients.new(flow=FlowControl(max_messages=4))
    client.subscribe("a/#")
    server = clients.server
    for n in range(6):
        server.publish("a/x", str(n))
    held = list(client.messages(count=4, auto_ack=False, until_ms=soon(clients.clock)))
    start = clients.clock.now_ms()
    # When one is processed (one ack held: under half the window) and the loop looks for more
    client.mark_processed(held[0])
    more = list(client.messages(count=1, auto_ack=False, until_ms=soon(clients.clock)))
    # Then the held ack went at once (nothing could come until it did), and the next came
    assert server.sessions["c1"].ack_frames == [["d1"]]
    assert server.ack_times == [start]
    assert texts(more) == ["4"]
    client.close()


@pytest.mark.parametrize("disconnect", [False, True])
def test_held_acks_go_when_the_client_closes(clients: Clients, disconnect: bool) -> None:
    # Given two messages processed, their acks held
    client = clients.new(ack_delay_s=10)
    client.subscribe("a/#")
    server = clients.server
    server.publish("a/x", "one")
    server.publish("a/x", "two")
    held = list(client.messages(count=2, auto_ack=False, until_ms=soon(clients.clock)))
    client.mark_processed(*held)
    assert server.sessions["c1"].ack_frames == []
    # When the client closes (with a disconnect or not)
    client.close(disconnect=disconnect)
    # Then one frame acked both
    assert server.sessions["c1"].ack_frames == [["d1", "d2"]]
    sent = [f for f in server.sockets[-1].sent if f["action"] in ("ack", "disconnect")]
    if disconnect:
        # asking for an answer, waited for before the disconnect (API Gateway runs a
        # connection's frames in no set order: the disconnect must not overtake the ack)
        assert [f["action"] for f in sent] == ["ack", "disconnect"]
        assert "ref" in sent[0]
    else:
        assert [f["action"] for f in sent] == ["ack"] and "ref" not in sent[0]


def test_an_ack_frame_carries_at_most_1000_ids(clients: Clients) -> None:
    # Given 1,500 messages processed together, their acks held
    client = clients.new(flow=FlowControl(max_messages=1500), ack_delay_s=10)
    client.subscribe("a/#")
    server = clients.server
    for n in range(1500):
        server.publish("a/x", str(n))
    held = list(client.messages(count=1500, auto_ack=False, until_ms=soon(clients.clock)))
    client.mark_processed(*held)
    # When they are sent
    client.close()
    # Then in frames of 1,000 ids at most (the API's limit), each id once
    frames = server.sessions["c1"].ack_frames
    assert [len(ids) for ids in frames] == [1000, 500]
    assert len(server.sessions["c1"].acked) == 1500


def test_a_client_killed_inside_its_ack_delay_acks_its_messages_again_without_handing_them_out(
    clients: Clients,
) -> None:
    # Given a client that processed three messages, their acks held for 10 s
    server = clients.server
    first = clients.new(ack_delay_s=10)
    first.subscribe("a/#")
    for n in range(1, 4):
        server.publish("a/x", f"m{n}")
    held = list(first.messages(count=3, auto_ack=False, until_ms=soon(clients.clock)))
    first.mark_processed(*held)
    assert server.sessions["c1"].ack_frames == []
    # When it is killed inside the delay (its connection lost, its state file released, no
    # ack sent), and a new process on the same state file resumes the session
    server.sockets[-1].drop(1006)
    second = clients.new()
    server.publish("a/x", "m4")
    got = list(second.messages(count=1, until_ms=soon(clients.clock)))
    # Then the three came again (dup) and were acked without being handed out: the
    # application gets only the new one
    assert texts(got) == ["m4"]
    second.close()
    assert server.sessions["c1"].acked == {"d1", "d2", "d3", "d4"}
    acks_again = [f for f in server.sockets[-1].sent if f["action"] == "ack"]
    assert sorted(i for frame in acks_again for i in frame["ids"]) == ["d1", "d2", "d3", "d4"]


def test_the_keepalive_thread_sends_held_acks_while_the_handler_runs(
    server: FakeServer, tmp_path: Path
) -> None:
    import time

    from shoal.core.clock import SystemClock

    server.clock = ManualClock()  # only recv's waits move it; the client reads real time
    client = ShoalWsClient(
        URL,
        TOKEN,
        client_id="c1",
        state=tmp_path / "s.json",
        connector=server.connector,
        clock=SystemClock(),
        ack_delay_s=0.05,
    )
    client.subscribe("a/#")
    server.publish("a/1", "quick")
    server.publish("a/2", "slow")
    for message in client.messages(count=2):
        if message.text == "slow":
            # a long handler: no loop receives, yet the first's ack goes at its delay (waited
            # for, not timed)
            deadline = time.monotonic() + 30
            while not server.sessions["c1"].ack_frames and time.monotonic() < deadline:
                time.sleep(0.02)
            assert server.sessions["c1"].ack_frames == [["d1"]]
    client.close()
    assert server.sessions["c1"].acked == {"d1", "d2"}


@pytest.mark.parametrize("delay_s", [-0.1, 10.5])
def test_an_ack_delay_out_of_its_range_is_refused(delay_s: float) -> None:
    with pytest.raises(ValueError, match="ack_delay_s must be 0 to 10 s"):
        ShoalWsClient(URL, TOKEN, client_id="c1", ack_delay_s=delay_s)


# -- flow control ----------------------------------------------------------------------------------


def test_receive_maximum_is_what_the_application_can_hold(clients: Clients) -> None:
    client = clients.new(flow=FlowControl(max_messages=3))
    client.subscribe("a/#")
    server = clients.server
    for n in range(8):
        server.publish("a/x", str(n))
    assert server.connects[0]["receive_maximum"] == 3
    held = list(client.messages(count=5, auto_ack=False, until_ms=soon(clients.clock)))
    # three outstanding, none processed: the server pushed no more than the window
    assert texts(held) == ["0", "1", "2"]
    assert len(server.sessions["c1"].in_flight) == 3
    # one processed from another thread opens the window by one
    client.mark_processed(held[0])
    more = list(client.messages(count=5, auto_ack=False, until_ms=soon(clients.clock)))
    assert texts(more) == ["3"]
    client.mark_processed(*held[1:], *more)
    rest = list(client.messages(count=4, until_ms=soon(clients.clock)))
    assert texts(rest) == ["4", "5", "6", "7"]
    client.close()
    assert len(server.sessions["c1"].acked) == 8


def test_max_bytes_holds_back_messages_while_the_outstanding_ones_fill_it(
    clients: Clients,
) -> None:
    client = clients.new(flow=FlowControl(max_messages=10, max_bytes=6))
    client.subscribe("a/#")
    for text in ("aaaa", "bbbb", "cc"):
        clients.server.publish("a/x", text)
    held = list(client.messages(count=3, auto_ack=False, until_ms=soon(clients.clock)))
    assert texts(held) == ["aaaa"]  # a second would make 8 bytes outstanding
    client.mark_processed(held[0])
    held = list(client.messages(count=3, auto_ack=False, until_ms=soon(clients.clock)))
    assert texts(held) == ["bbbb", "cc"]
    client.close()


# -- losses and reconnects -------------------------------------------------------------------------


def test_a_lost_connection_is_ridden_out_and_the_session_resumed(
    clients: Clients, clock: SleepLog
) -> None:
    client = clients.new()
    client.subscribe("a/#")
    server = clients.server
    server.publish("a/1", "one")
    said: list[str] = []
    stream = client.messages(on_outage=said.append)
    assert next(stream).text == "one"
    # the server restarts: the connection breaks (1006), nothing answers for five tries, and a
    # message is published meanwhile
    server.sockets[-1].drop(1006)
    server.down = True
    server.publish("a/2", "two")
    before = len(clock.sleeps)
    clock.on_sleep = lambda: setattr(server, "down", len(clock.sleeps) - before < 5)
    assert next(stream).text == "two"
    stream.close()
    assert len(said) == 2
    assert said[0].startswith("lost ws://shoal.test") and "answers again" in said[1]
    assert "the session was resumed" in said[1]
    # every reconnect resumed the session (never clean); the backoff doubled, jittered
    assert [c["clean_start"] for c in server.connects] == [False, False]
    backoff = clock.sleeps[before:]
    assert len(backoff) == 5
    assert 0.25 <= backoff[0] <= 0.5 and 4.0 <= backoff[4] <= 8.0
    client.close()
    # "one" was processed before the loss and redelivered with dup after it: acked, not
    # handed out again; "two" was handed out and the loop left: not processed, not acked
    assert server.sessions["c1"].acked == {"d1"}


def test_the_backoff_is_capped(clients: Clients, clock: SleepLog) -> None:
    client = clients.new()
    client.subscribe("a/#")
    server = clients.server
    server.sockets[-1].drop(1001)
    server.down = True
    outages = Outages(first_s=1.0, max_s=5.0)
    got = list(client.messages(outages=outages, until_ms=soon(clock, 60), on_outage=print))
    assert got == []
    assert max(clock.sleeps) <= 5.0 and len(clock.sleeps) > 10
    client.close()


def test_without_riding_out_a_loss_raises_unavailable(clients: Clients) -> None:
    client = clients.new()
    client.subscribe("a/#")
    clients.server.sockets[-1].drop(1006)
    clients.server.down = True
    with pytest.raises(Unavailable):
        list(client.messages(outages=Outages(forever=False)))
    client.close()


def test_a_session_gone_meanwhile_is_subscribed_again(clients: Clients) -> None:
    client = clients.new()
    client.subscribe(["a/#", "b/#"], qos=1)
    server = clients.server
    server.sockets[-1].drop(1006)
    del server.sessions["c1"]  # expired while the client was away
    said: list[str] = []
    assert list(client.messages(until_ms=soon(clients.clock), on_outage=said.append)) == []
    # the reconnect found no session: a new one, with the same subscriptions
    assert server.sessions["c1"].subscriptions == {"a/#": 1, "b/#": 1}
    assert "a new one, subscribed again" in said[-1]
    server.publish("b/1", "after")
    assert texts(client.messages(count=1)) == ["after"]
    client.close()


def test_the_connection_is_renewed_before_the_two_hour_limit(
    clients: Clients, clock: SleepLog
) -> None:
    settings = WsSettings(
        keepalive_thread=False, max_connection_s=100, renew_before_s=10, ping_every_s=1000
    )
    client = clients.new(settings=settings)
    client.subscribe("a/#")
    server = clients.server
    first = server.sockets[-1]
    got = list(client.messages(until_ms=soon(clock, 95)))
    assert got == []
    # between 80 and 90 s, a new connection renewed the live channel, then the old one closed
    assert len(server.sockets) == 2
    assert server.live["c1"] is server.sockets[-1]
    [renew] = server.renews
    assert {k: v for k, v in renew.items() if k != "ref"} == {
        "action": "renew",
        "client_id": "c1",
        "channel": "ch1",
    }
    assert len(server.connects) == 1
    # make-before-break: the old connection was still open when the new one renewed (the
    # server said nothing to it), and the client closed it after
    assert first.closed_code is None and first.client_closed
    assert client.connection is not None and client.connection.channel == "ch1"
    server.publish("a/1", "on the new one")
    assert texts(client.messages(count=1)) == ["on the new one"]
    client.close()


def test_a_refused_renewal_connects_instead_and_resumes_the_session(
    clients: Clients, clock: SleepLog
) -> None:
    """The old connection was lost just before its renewal (the server refuses ``renew``): the
    new connection sends ``connect`` (resuming, not clean), which decides the will as MQTT
    says."""
    settings = WsSettings(
        keepalive_thread=False, max_connection_s=100, renew_before_s=10, ping_every_s=1000
    )
    client = clients.new(settings=settings)
    client.subscribe("a/#")
    server = clients.server
    server.refuse_renewals = True
    assert list(client.messages(until_ms=soon(clock, 95))) == []
    assert len(server.renews) == 1
    assert len(server.connects) == 2 and server.connects[-1]["clean_start"] is False
    assert server.live["c1"] is server.sockets[-1]
    assert client.connection is not None and client.connection.channel == "ch2"
    server.publish("a/1", "still here")
    assert texts(client.messages(count=1)) == ["still here"]
    client.close()


# -- keep-alive ------------------------------------------------------------------------------------


def test_a_silent_client_keeps_its_connection_before_the_idle_limit(
    clients: Clients, clock: SleepLog
) -> None:
    client = clients.new(settings=WsSettings(keepalive_thread=False, ping_every_s=240))
    client.subscribe("a/#")
    assert list(client.messages(until_ms=soon(clock, 2000))) == []
    keepalives = clients.server.frames("keepalive")
    pings = clients.server.frames("ping")
    # one keep-alive per 240 s of the client's silence: 8 in 2000 s, all on the one
    # connection; every fourth a ping (answered), the others one way (half the messages)
    assert (len(keepalives), len(pings)) == (6, 2)
    [socket] = clients.server.sockets
    kinds = [f["action"] for f in socket.sent if f["action"] in ("keepalive", "ping")]
    assert kinds == ["keepalive"] * 3 + ["ping"] + ["keepalive"] * 3 + ["ping"]
    client.close()


def test_check_every_one_pings_at_every_keepalive(clients: Clients, clock: SleepLog) -> None:
    settings = WsSettings(keepalive_thread=False, ping_every_s=240, check_every=1)
    client = clients.new(settings=settings)
    client.subscribe("a/#")
    assert list(client.messages(until_ms=soon(clock, 1000))) == []
    assert (len(clients.server.frames("keepalive")), len(clients.server.frames("ping"))) == (0, 4)
    client.close()


def test_a_ping_left_unanswered_means_a_dead_connection(clients: Clients, clock: SleepLog) -> None:
    settings = WsSettings(keepalive_thread=False, ping_every_s=60, pong_timeout_s=10, check_every=1)
    client = clients.new(settings=settings)
    client.subscribe("a/#")
    clients.server.answer_pings = False  # a half-open TCP connection: nothing comes back
    said: list[str] = []
    assert list(client.messages(until_ms=soon(clock, 75), on_outage=said.append)) == []
    assert "no answer to a ping" in said[0]
    assert len(clients.server.sockets) == 2
    client.close()


def test_the_keepalive_thread_pings_while_the_handler_runs(
    server: FakeServer, tmp_path: Path
) -> None:
    import time

    from shoal.core.clock import SystemClock

    server.clock = ManualClock()  # only recv's waits move it; the client reads real time
    client = ShoalWsClient(
        URL,
        TOKEN,
        client_id="c1",
        state=tmp_path / "s.json",
        connector=server.connector,
        clock=SystemClock(),
        settings=WsSettings(ping_every_s=0.2, check_every=1),
    )
    client.subscribe("a/#")
    server.publish("a/1", "slow")
    for _message in client.messages(count=1):
        # a long handler: the loop is not receiving, yet pings go out (waited for, not timed)
        deadline = time.monotonic() + 30
        while len(server.frames("ping")) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(server.frames("ping")) >= 3
    client.close()


# -- takeover, tokens ------------------------------------------------------------------------------


def test_a_takeover_raises_and_the_next_call_resumes(clients: Clients) -> None:
    client = clients.new()
    client.subscribe("a/#")
    server = clients.server
    # another process connects with the same client id
    other = server.connector(URL, {"Authorization": f"Bearer {TOKEN}"}, 1)
    other.send(json.dumps({"action": "connect", "client_id": "c1", "clean_start": False}))
    with pytest.raises(SessionTakenOver):
        list(client.messages(until_ms=soon(clients.clock)))
    assert client.connection is None
    # asked again, it connects again, resuming the session (not clean)
    assert client.subscribe("b/#") == [1]
    assert server.connects[-1]["clean_start"] is False
    assert server.live["c1"] is server.sockets[-1]
    client.close()


def test_the_token_is_renewed_on_reconnect(
    clients: Clients, clock: SleepLog, tmp_path: Path
) -> None:
    from shoal.client.tokens import FileToken

    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    client = clients.new(token=FileToken(token_file))
    client.subscribe("a/#")
    server = clients.server
    # the token is revoked and the file rotated; the connection drops
    renewed = jwt("alice", 1)
    token_file.write_text(renewed)
    server.tokens = {renewed}
    server.sockets[-1].drop(1001)
    server.publish("a/1", "after")
    assert texts(client.messages(count=1, on_outage=lambda _: None)) == ["after"]
    assert server.sockets[-1].headers["Authorization"] == f"Bearer {renewed}"
    client.close()


def test_a_refused_token_without_a_renewal_is_final(clients: Clients) -> None:
    client = clients.new()
    client.subscribe("a/#")
    clients.server.tokens = set()
    clients.server.sockets[-1].drop(1001)
    with pytest.raises(ApiError) as refused:
        list(client.messages(on_outage=lambda _: None))
    assert refused.value.status == 401 and not isinstance(refused.value, Unavailable)
    client.close()


def test_a_token_of_another_principal_is_refused(clients: Clients, tmp_path: Path) -> None:
    from shoal.client.errors import ClientError
    from shoal.client.tokens import FileToken

    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    client = clients.new(token=FileToken(token_file))
    client.subscribe("a/#")
    token_file.write_text(jwt("mallory"))
    clients.server.tokens = {jwt("mallory")}
    clients.server.sockets[-1].drop(1001)
    with pytest.raises(ClientError, match="another principal"):
        list(client.messages(on_outage=lambda _: None))
    client.close()


def test_a_busy_handshake_is_tried_again(clients: Clients) -> None:
    client = clients.new()
    clients.server.refuse_status = 503
    with pytest.raises(Unavailable):
        client.subscribe("a/#")
    assert len(clients.clock.sleeps) == POLICY.attempts - 1
    clients.server.refuse_status = None
    assert client.subscribe("a/#") == [1]
    client.close()


def test_neither_tokens_nor_payloads_are_logged(
    clients: Clients, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    client = clients.new()
    client.subscribe("a/#")
    server = clients.server
    server.publish("a/1", "secret-payload")
    stream = client.messages()
    next(stream)
    server.sockets[-1].drop(1006)
    server.publish("a/2", "other-secret")
    next(stream)
    stream.close()
    client.close()
    logged = caplog.text + "".join(str(r.args) for r in caplog.records)
    assert "lost ws://shoal.test" in logged  # the outage was logged
    assert "secret" not in logged and TOKEN not in logged
    assert base64.b64encode(b"secret-payload").decode() not in logged


def test_disconnect_sends_a_normal_disconnect(clients: Clients) -> None:
    client = clients.new()
    client.subscribe("a/#")
    client.close(disconnect=True)
    assert clients.server.frames("disconnect") == [
        {"action": "disconnect", "ref": clients.server.frames("disconnect")[0]["ref"]}
    ]
    assert "c1" not in clients.server.live


# -- shoal subscribe: the ws:// URL ----------------------------------------------------------------


def test_the_ws_url_is_the_flag_else_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SHOAL_WS_URL", "wss://env.example/v1")
    assert ws_url_of("https://api.example", "wss://flag.example/v1") == (
        "wss://flag.example/v1",
        True,
    )
    assert ws_url_of("https://api.example", None) == ("wss://env.example/v1", True)
    with pytest.raises(UsageError, match="ws:// or wss://"):
        ws_url_of("https://api.example", "https://wrong.example")


def test_the_ws_url_of_shoal_dev_comes_from_its_runtime_file_else_port_plus_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SHOAL_WS_URL", raising=False)
    # no runtime file: shoal dev's convention, its HTTP port + 1 (a guess)
    assert ws_url_of("http://127.0.0.1:8080", None) == ("ws://127.0.0.1:8081", False)
    assert ws_url_of("http://localhost:9000/", None) == ("ws://localhost:9001", False)
    # the runtime file of the shoal dev serving --url (make run's .shoal): exact
    (tmp_path / ".shoal").mkdir()
    info = {"url": "http://127.0.0.1:8080", "ws_url": "ws://127.0.0.1:9999"}
    (tmp_path / ".shoal" / "runtime.json").write_text(json.dumps(info))
    assert ws_url_of("http://127.0.0.1:8080", None) == ("ws://127.0.0.1:9999", True)
    # ... only for the server it describes
    assert ws_url_of("http://127.0.0.1:7000", None) == ("ws://127.0.0.1:7001", False)


def test_a_deployed_api_without_a_ws_url_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SHOAL_WS_URL", raising=False)
    with pytest.raises(UsageError, match=r"--ws-url.*--transport poll"):
        ws_url_of("https://abc.execute-api.eu-west-1.amazonaws.com", None)


def test_subscribe_to_a_ws_url_that_does_not_answer_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from shoal.cli.main import main

    monkeypatch.chdir(tmp_path)
    for name in ("SHOAL_TOKEN_COMMAND", "SHOAL_WS_URL"):
        monkeypatch.delenv(name, raising=False)
    argv = ["subscribe", "--url", "http://127.0.0.1:1", "--ws-url", "ws://127.0.0.1:1"]
    argv += ["--token", TOKEN, "--retries", "0", "-t", "a/#"]
    status = main(argv)
    err = capsys.readouterr().err
    # a URL the user named is never swapped for the long poll: an error, in one line
    assert status == 1 and err.count("\n") == 1
    assert err.startswith("shoal: error: ws://127.0.0.1:1 did not answer (")
    assert "nothing was subscribed (is the server up, and is --ws-url right?)" in err


def test_a_guessed_ws_url_that_does_not_answer_falls_back_to_the_long_poll(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from shoal.cli.main import main

    monkeypatch.chdir(tmp_path)
    for name in ("SHOAL_TOKEN_COMMAND", "SHOAL_WS_URL"):
        monkeypatch.delenv(name, raising=False)
    argv = ["subscribe", "--url", "http://127.0.0.1:1", "--token", TOKEN, "--retries", "0"]
    status = main([*argv, "-t", "a/#"])
    err = capsys.readouterr().err.splitlines()
    # port + 1 (2) does not answer: said, then the long poll, which fails as it always did
    assert status == 1 and len(err) == 2
    assert err[0].startswith("shoal: no Shoal WebSocket API at ws://127.0.0.1:2 ")
    assert err[1].startswith("shoal: error: http://127.0.0.1:1 did not answer (")


def _closed_error() -> Exception:
    from websockets.exceptions import ConnectionClosedError

    return ConnectionClosedError(None, None, None)


@pytest.mark.parametrize(
    "lost",
    [
        pytest.param(_closed_error, id="closed-mid-handshake"),
        pytest.param(ConnectionResetError, id="reset"),
        pytest.param(TimeoutError, id="timeout"),
    ],
)
def test_a_connection_lost_while_it_opens_is_a_lost_link_the_client_rides_out(
    monkeypatch: pytest.MonkeyPatch, lost: Any
) -> None:
    """A server killed during the handshake closes the connection under it, and websockets
    raises ``ConnectionClosedError``: the connector says ``LinkLost``, which the client's loop
    rides out, not an error that ends it (the soak's kill -9 ended a subscriber's loop so)."""
    import websockets.sync.client
    from shoal.client.wslink import websockets_connector

    def refusing(*_: Any, **__: Any) -> Any:
        raise lost()

    monkeypatch.setattr(websockets.sync.client, "connect", refusing)
    with pytest.raises(LinkLost):
        websockets_connector("ws://127.0.0.1:9/", {}, 1.0)
