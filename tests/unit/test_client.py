"""shoal.client against a fake Shoal: retries, exactly-once publish and processing, crashes."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from shoal.cli.main import main
from shoal.client.errors import ApiError, SessionTakenOver, StateInUse, Unavailable
from shoal.client.http import GROUP_HEARTBEAT_MS, ShoalClient
from shoal.client.state import ClientState
from shoal.client.support import CallRetry
from shoal.core.clock import ManualClock

from tests.unit.test_client_support import Crash, FakeAdapter, FakeShoal, serve, transport

URL = "http://shoal.test"
TOKEN = "header.claims.signature"
POLICY = CallRetry(timeout_s=2.0, attempts=4, backoff_s=0.5, max_backoff_s=4.0)


class SleepLog(ManualClock):
    """A manual clock that remembers every sleep."""

    def __init__(self) -> None:
        super().__init__()
        self.sleeps: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        super().sleep(seconds)


@pytest.fixture
def fake() -> FakeShoal:
    return FakeShoal()


@pytest.fixture
def state_path(tmp_path: Path) -> Path:
    return tmp_path / "client.json"


class Clients:
    """Makes clients on one state file; a 'restart' is a new client after the old one died."""

    def __init__(self, fake: FakeShoal, state_path: Path) -> None:
        self.fake = fake
        self.state_path = state_path
        self.clock = SleepLog()
        self.adapter: FakeAdapter | None = None
        self.made: list[ShoalClient] = []

    def new(self, client_id: str | None = "c1", **options: Any) -> ShoalClient:
        # a dead client's lock dies with its process; here the old client releases it
        for old in self.made:
            old.state.close()
        http, self.adapter = transport(self.fake)
        client = ShoalClient(
            URL,
            TOKEN,
            client_id=client_id,
            state=self.state_path,
            policy=POLICY,
            http=http,
            clock=self.clock,
            rng=random.Random(7),
            **options,
        )
        self.made.append(client)
        return client


@pytest.fixture
def clients(fake: FakeShoal, state_path: Path) -> Iterator[Clients]:
    made = Clients(fake, state_path)
    yield made
    for client in made.made:
        client.state.close()


# -- publishing --------------------------------------------------------------------------------


def test_publish_numbers_messages_and_a_restart_continues(clients: Clients) -> None:
    # Given a client that published two messages
    first = clients.new()
    assert [first.publish("a/b", text=t).publisher_seq for t in ("one", "two")] == [1, 2]
    # When a new client starts on the same state file
    second = clients.new()
    result = second.publish("a/b", text="three")
    # Then it keeps the publisher id and continues the sequence
    assert (result.publisher_id, result.publisher_seq) == (first.publisher_id, 3)
    assert [b["publisher_seq"] for b in clients.fake.bodies_of("POST /v1/messages")] == [1, 2, 3]
    assert clients.fake.texts() == ["one", "two", "three"]


def test_a_lost_answer_is_retried_with_the_same_seq(clients: Clients) -> None:
    # Given a publish whose answer is lost after the server accepted it
    clients.fake.fail("POST /v1/messages", "lose")
    client = clients.new()
    result = client.publish("a/b", text="once")
    # Then the retry carries the same seq and the server answers it as a duplicate
    assert [b["publisher_seq"] for b in clients.fake.bodies_of("POST /v1/messages")] == [1, 1]
    assert (result.duplicate, result.message_id) == (True, "m1")
    assert clients.fake.texts() == ["once"]
    assert client.next_seq == 2


def test_a_crash_after_the_server_accepted_resends_the_same_seq(clients: Clients) -> None:
    # Given a client that died after the server accepted its publish, before it heard so
    clients.fake.fail("POST /v1/messages", "crash")
    with pytest.raises(Crash):
        clients.new().publish("a/b", text="first")
    # When the restarted client publishes the same message
    restarted = clients.new()
    assert restarted.pending_publish is not None
    assert restarted.next_seq == 1
    again = restarted.publish("a/b", text="first")
    following = restarted.publish("a/b", text="second")
    # Then the server deduplicates it, and the sequence goes on after it
    assert (again.publisher_seq, again.duplicate) == (1, True)
    assert (following.publisher_seq, following.duplicate) == (2, False)
    assert clients.fake.texts() == ["first", "second"]


def test_after_a_crash_another_message_first_finishes_the_one_in_flight(
    clients: Clients,
) -> None:
    # Given a client that died before its publish reached the server
    clients.fake.fail("POST /v1/messages", "crash_before")
    with pytest.raises(Crash):
        clients.new().publish("a/b", text="first")
    # When the restarted client publishes something else
    result = clients.new().publish("a/b", text="second")
    # Then the message in flight goes first, with its own seq
    assert clients.fake.texts() == ["first", "second"]
    assert result.publisher_seq == 2


def test_busy_answers_back_off_exponentially_with_jitter(clients: Clients) -> None:
    # Given three busy answers before success
    clients.fake.fail("POST /v1/messages", 503, times=3)
    client = clients.new()
    client.publish("a/b", text="x")
    # Then each wait is between half and all of 0.5 s, 1 s, 2 s
    sleeps = clients.clock.sleeps
    assert len(sleeps) == 3
    for n, slept in enumerate(sleeps):
        ceiling = POLICY.backoff_s * 2**n
        assert ceiling / 2 <= slept <= ceiling
    assert len(set(sleeps)) == 3


def test_retry_after_is_honoured_up_to_the_largest_backoff(clients: Clients) -> None:
    clients.fake.fail("POST /v1/messages", 429, code="throttled", headers={"Retry-After": "3"})
    clients.fake.fail("POST /v1/messages", 429, code="throttled", headers={"Retry-After": "60"})
    clients.new().publish("a/b", text="x")
    assert clients.clock.sleeps[0] == 3.0
    assert clients.clock.sleeps[1] == POLICY.max_backoff_s


def test_api_gateways_own_401_is_read_with_its_reason(clients: Clients) -> None:
    # Given API Gateway's JWT authorizer refusing the token, in its own shape
    header = 'Bearer scope="" error="invalid_token" error_description="the token has expired"'
    clients.fake.fail(
        "POST /v1/messages",
        401,
        body={"message": "Unauthorized"},
        headers={"www-authenticate": header},
    )
    # Then the client raises a coded error that says why, without retrying
    with pytest.raises(ApiError) as raised:
        clients.new().publish("a/b", text="x")
    assert (raised.value.status, raised.value.code) == (401, "unauthorized")
    assert "the token has expired" in raised.value.message
    assert clients.fake.requests.count("POST /v1/messages") == 1


def test_api_gateways_own_503_is_retried_like_a_busy_function(clients: Clients) -> None:
    clients.fake.fail("POST /v1/messages", 503, body={"message": "Service Unavailable"})
    assert clients.new().publish("a/b", text="x").publisher_seq == 1
    assert clients.fake.requests.count("POST /v1/messages") == 2


def test_connection_errors_are_retried(clients: Clients) -> None:
    clients.fake.fail("POST /v1/messages", "refuse", times=2)
    result = clients.new().publish("a/b", text="x")
    assert (result.publisher_seq, result.duplicate) == (1, False)
    assert clients.fake.requests.count("POST /v1/messages") == 3


def test_an_answer_cut_short_is_retried_as_a_lost_one(clients: Clients) -> None:
    """A server killed while it sends an answer's body (kill -9 of ``shoal dev`` in the soak,
    a dropped connection deployed) cuts the body short: requests raises ChunkedEncodingError,
    not a ConnectionError. Two long-polling subscribers died of it in the 2-hour soak and their
    sessions' messages piled up unread (641). The call is tried again as a lost answer is."""
    # Given a publish and a subscribe whose answers are cut short once each
    clients.fake.fail("POST /v1/messages", "cut")
    clients.fake.fail("POST /v1/sessions/c1/subscriptions", "cut")
    client = clients.new()
    # When they are called
    result = client.publish("a/b", text="once")
    client.subscribe("a/#")
    # Then each was sent again: the publish with its seq, answered as the duplicate it is
    assert [b["publisher_seq"] for b in clients.fake.bodies_of("POST /v1/messages")] == [1, 1]
    assert result.duplicate and clients.fake.texts() == ["once"]
    assert clients.fake.requests.count("POST /v1/sessions/c1/subscriptions") == 2


def test_retries_are_bounded_and_the_publish_stays_in_flight(clients: Clients) -> None:
    # Given a server that is always busy
    clients.fake.fail("POST /v1/messages", 503, times=POLICY.attempts)
    client = clients.new()
    # When the client publishes, it gives up after the bounded attempts
    with pytest.raises(Unavailable) as raised:
        client.publish("a/b", text="x")
    assert clients.fake.requests.count("POST /v1/messages") == POLICY.attempts
    assert TOKEN not in str(raised.value)
    # Then the publish stays in flight and the same message later goes with the same seq
    assert client.pending_publish == {"topic": "a/b", "qos": 1, "retain": False, "text": "x"}
    assert client.publish("a/b", text="x").publisher_seq == 1
    assert client.pending_publish is None


def test_a_refused_publish_frees_its_seq(clients: Clients) -> None:
    # Given a publish the server refuses outright
    client = clients.new()
    with pytest.raises(ApiError) as raised:
        client.publish("$SYS/x", text="no")
    assert (raised.value.status, raised.value.code) == (400, "invalid_topic")
    assert len(clients.fake.requests) == 1
    # Then nothing stays in flight and the next publish takes seq 1
    assert client.pending_publish is None
    assert client.publish("a/b", text="yes").publisher_seq == 1


def test_a_refusal_after_a_lost_answer_keeps_the_publish_in_flight(clients: Clients) -> None:
    # Given an attempt whose answer was lost, then a refusal (a token that just expired)
    clients.fake.fail("POST /v1/messages", "lose")
    clients.fake.fail("POST /v1/messages", 401, code="unauthorized")
    client = clients.new()
    with pytest.raises(ApiError):
        client.publish("a/b", text="x")
    # Then the first attempt may have been accepted: the publish stays in flight with its seq
    assert client.next_seq == 1 and client.pending_publish is not None
    other = client.publish("a/b", text="y")
    assert clients.fake.texts() == ["x", "y"]
    assert other.publisher_seq == 2


# -- sessions ----------------------------------------------------------------------------------


def test_session_calls_connect_on_demand_and_carry_the_channel(clients: Clients) -> None:
    client = clients.new()
    # When the first session call is made without a connect
    assert client.subscribe(["a/#", "b"], qos=1) == [1, 1]
    # Then the client connects first, and the call names the channel
    assert clients.fake.requests == ["PUT /v1/sessions/c1", "POST /v1/sessions/c1/subscriptions"]
    channel = clients.fake.sessions["c1"].channel
    assert clients.fake.headers[1]["Shoal-Channel"] == channel
    assert "Shoal-Channel" not in clients.fake.headers[0]
    assert clients.fake.bodies[0]["clean_start"] is False


def test_client_ids_are_escaped_in_paths(clients: Clients) -> None:
    clients.new(client_id="room/7 a").connect()
    assert clients.fake.requests == ["PUT /v1/sessions/room%2F7%20a"]


def test_session_taken_over_is_not_retried_and_reconnects_on_demand(clients: Clients) -> None:
    # Given a client whose channel another connect took over
    client = clients.new()
    client.connect(session_expiry_s=600)
    clients.fake.sessions["c1"].channel = "newer"
    # When it sends a heartbeat, the answer is raised at once
    with pytest.raises(SessionTakenOver):
        client.heartbeat()
    assert clients.fake.requests.count("POST /v1/sessions/c1/heartbeat") == 1
    assert client.connection is None
    # Then the next call connects again, resuming the session
    client.heartbeat()
    assert clients.fake.requests[-2:] == [
        "PUT /v1/sessions/c1",
        "POST /v1/sessions/c1/heartbeat",
    ]
    assert clients.fake.bodies[-2]["connect_token"] != clients.fake.bodies[0]["connect_token"]
    assert {k: v for k, v in clients.fake.bodies[-2].items() if k != "connect_token"} == {
        "clean_start": False,
        "session_expiry_s": 600,
        "keepalive_s": 60,
    }


def test_a_connect_keeps_its_token_across_retries_and_the_next_connect_draws_another(
    clients: Clients,
) -> None:
    # Given a connect whose first answer is lost after the server registered the channel
    clients.fake.fail("PUT /v1/sessions/c1", "lose")
    client = clients.new()
    client.connect(will={"topic": "a/status", "text": "gone"})
    first, retry = clients.fake.bodies_of("PUT /v1/sessions/c1")
    # Then the retry carries the same token: the server answers it with the channel it
    # registered, not a newer one that takes it over and publishes its will
    assert len(first["connect_token"]) >= 8
    assert retry == first
    # And another connect (not a retry) draws a token of its own
    client.connect()
    assert (
        clients.fake.bodies_of("PUT /v1/sessions/c1")[-1]["connect_token"]
        != (first["connect_token"])
    )


def test_a_long_poll_gets_a_longer_read_timeout(clients: Clients) -> None:
    client = clients.new()
    client.fetch(max_messages=5, wait_ms=5000)
    assert clients.adapter is not None
    assert clients.adapter.timeouts[-1] == (POLICY.timeout_s, POLICY.timeout_s + 5.0)
    assert clients.adapter.timeouts[0] == (POLICY.timeout_s, POLICY.timeout_s)


def test_heartbeats_go_out_twice_per_keepalive_while_polling(clients: Clients) -> None:
    client = clients.new()
    client.connect(keepalive_s=60)
    client.fetch()
    clients.clock.advance(31)
    client.fetch()
    assert [r.rsplit("/", 1)[-1] for r in clients.fake.requests] == [
        "c1",
        "messages",
        "heartbeat",
        "messages",
    ]


def test_a_shared_group_member_heartbeats_within_the_group_lease_and_polls_shorter(
    clients: Clients,
) -> None:
    # Given a member of a shared group whose keepalive is a minute
    client = clients.new()
    client.connect(keepalive_s=60)
    client.subscribe("$share/g/a/#")
    client.fetch(wait_ms=20_000)
    # When 6 s pass between two polls
    clients.clock.advance(6)
    client.fetch(wait_ms=20_000)
    # Then it heartbeats before the second poll (a 30 s gap would lose its group streams)
    assert [r.rsplit("/", 1)[-1] for r in clients.fake.requests][-3:] == [
        "messages",
        "heartbeat",
        "messages",
    ]
    # and long-polls no longer than its heartbeat interval
    assert clients.adapter is not None
    assert clients.adapter.timeouts[-1] == (
        POLICY.timeout_s,
        POLICY.timeout_s + GROUP_HEARTBEAT_MS / 1000,
    )


# -- receiving ---------------------------------------------------------------------------------


def publish_texts(clients: Clients, *texts: str) -> None:
    publisher = clients.new(client_id=None)
    for text in texts:
        publisher.publish("a/b", text=text)
    publisher.state.close()


def test_messages_are_handed_once_and_acked_before_the_next_fetch(clients: Clients) -> None:
    # Given a subscribed session with three messages waiting
    consumer = clients.new()
    consumer.subscribe("a/#")
    publish_texts(clients, "1", "2", "3")
    consumer = clients.new()
    # When it iterates over three messages, two per fetch
    texts = [m.text for m in consumer.messages(max_messages=2, wait_ms=0, count=3)]
    # Then each comes once, in order, and every one is acked
    assert texts == ["1", "2", "3"]
    assert clients.fake.bodies_of("POST /v1/sessions/c1/acks") == [
        {"ids": ["m1", "m2"]},
        {"ids": ["m3"]},
    ]
    assert clients.fake.sessions["c1"].in_flight == {}


def test_a_restart_acks_processed_messages_again_without_handing_them_over(
    clients: Clients,
) -> None:
    consumer = clients.new()
    consumer.subscribe("a/#")
    publish_texts(clients, "1", "2", "3")
    # Given a consumer that processed two messages and died as it sent their ack
    clients.fake.fail("POST /v1/sessions/c1/acks", "crash_before")
    consumer = clients.new()
    handed = []
    with pytest.raises(Crash):
        for message in consumer.messages(max_messages=2, wait_ms=0):
            handed.append(message.text)
    assert handed == ["1", "2"]
    # When a restarted consumer reconnects and the server delivers them again
    restarted = clients.new()
    restarted.connect()
    again = list(restarted.messages(max_messages=10, wait_ms=0, count=1))
    # Then only the unprocessed one is handed over; the others are acked again
    assert [m.text for m in again] == ["3"]
    # (the first ack request is the one that never left the dead client)
    acks = clients.fake.bodies_of("POST /v1/sessions/c1/acks")[1:]
    assert [i for body in acks for i in body["ids"]] == ["m1", "m2", "m3"]
    assert clients.fake.sessions["c1"].in_flight == {}


def test_a_message_being_processed_at_a_crash_comes_again(clients: Clients) -> None:
    consumer = clients.new()
    consumer.subscribe("a/#")
    publish_texts(clients, "1")
    # Given a consumer that died while it processed a message (it never asked for the next)
    consumer = clients.new()
    with pytest.raises(RuntimeError):
        for _message in consumer.messages(wait_ms=0):
            raise RuntimeError("died while processing")
    # When it restarts
    restarted = clients.new()
    restarted.connect()
    again = list(restarted.messages(wait_ms=0, count=1))
    # Then the message comes again, marked dup
    assert [(m.text, m.dup) for m in again] == [("1", True)]


def test_ack_records_and_acks_at_once(clients: Clients) -> None:
    consumer = clients.new()
    consumer.subscribe("a/#")
    publish_texts(clients, "1")
    consumer = clients.new()
    (message,) = consumer.fetch()
    assert consumer.ack(message) == 1
    assert consumer.state.was_processed("c1", message.id)
    assert clients.fake.sessions["c1"].acked == {message.id}


# -- the state file ----------------------------------------------------------------------------


def test_processed_ids_are_a_bounded_window_of_the_most_recent(state_path: Path) -> None:
    state = ClientState(state_path, recent_ids=3)
    state.record_processed("c1", ["a", "b"])
    state.record_processed("c1", ["c", "d", "e"])
    state.close()
    reopened = ClientState(state_path)
    assert [reopened.was_processed("c1", i) for i in "abcde"] == [False, False, True, True, True]
    (scope,) = json.loads(state_path.read_text())["scopes"].values()
    assert scope["sessions"]["c1"]["delivered"] == ["c", "d", "e"]
    reopened.close()


def test_the_state_file_is_replaced_whole_and_held_by_one_client(state_path: Path) -> None:
    # Given a client state that was saved several times
    state = ClientState(state_path)
    for n in range(5):
        state.record_processed("c1", [f"id{n}"])
    # Then only the file (and its lock) remain: no temporary files
    names = sorted(p.name for p in state_path.parent.iterdir())
    assert names == ["client.json", "client.json.lock"]
    # and a second client cannot use it while the first holds it
    with pytest.raises(StateInUse):
        ClientState(state_path)
    state.close()
    ClientState(state_path).close()


def test_a_state_file_of_something_else_is_refused(state_path: Path) -> None:
    state_path.write_text('{"hello": 1}')
    with pytest.raises(Exception, match="not a client state file"):
        ClientState(state_path)


# -- the command line --------------------------------------------------------------------------


def test_shoal_publish_and_subscribe_over_http(
    fake: FakeShoal, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with serve(fake) as url:
        common = ["--url", url, "--token", TOKEN]
        sub = [*common, "--client-id", "cli-1", "--filter", "news/#", "--transport", "poll"]
        sub += ["--state", str(tmp_path / "sub.json")]
        pub = [*common, "--state", str(tmp_path / "pub.json"), "--topic", "news/today"]
        # Given a subscription made by `shoal subscribe --count 0`
        assert main(["subscribe", *sub, "--count", "0"]) == 0
        capsys.readouterr()
        # When two messages are published by two commands
        payload = tmp_path / "payload.bin"
        payload.write_bytes(b"\xffbinary")
        assert main(["publish", *pub, "--text", "hello"]) == 0
        assert main(["publish", *pub, "--file", str(payload), "--qos", "2"]) == 0
        published = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        # Then they carry consecutive seqs of one publisher
        assert [p["publisher_seq"] for p in published] == [1, 2]
        assert published[0]["publisher_id"] == published[1]["publisher_id"]
        # and `shoal subscribe` prints one JSON line each, then ends
        assert main(["subscribe", *sub, "--json", "--count", "2", "--wait-ms", "0"]) == 0
        lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(m["topic"], m.get("text")) for m in lines] == [
        ("news/today", "hello"),
        ("news/today", None),
    ]
    assert lines[1]["payload"] == "/2JpbmFyeQ=="
    assert fake.sessions["cli-1"].in_flight == {}
    assert fake.requests[-1] == "DELETE /v1/sessions/cli-1"


def test_shoal_publish_reports_a_refusal(
    fake: FakeShoal, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with serve(fake) as url:
        args = ["publish", "--url", url, "--token", TOKEN, "--topic", "a/+", "--text", "x"]
        assert main([*args, "--state", str(tmp_path / "s.json")]) == 1
    error = capsys.readouterr().err
    assert "invalid_topic" in error and TOKEN not in error
