"""``shoal.client.ws`` and ``shoal subscribe`` over one ``shoal dev``'s WebSocket API.

Each message is processed once through a connection the server closes (``DELETE`` on
``@connections``, as API Gateway's management API does it), a handler that raises gets its
message again, the in-flight window is what the client asked for, a takeover raises, and
``shoal subscribe`` prints over the WebSocket API by default and over the long poll with
``--transport poll``, and a ``shoal subscribe`` killed inside its ack delay prints nothing
twice. Messages are published over HTTP (``ShoalClient``).
"""

from __future__ import annotations

import io
import json
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from shoal.cli.main import main
from shoal.client.errors import SessionTakenOver
from shoal.client.http import ShoalClient
from shoal.client.support import FlowControl, ReceivedMessage
from shoal.client.ws import ShoalWsClient
from shoal.client.wslink import WsSettings
from shoal.local.authorizer import IssuerSettings, SigningKey, mint_token

from tests.e2e.conftest import DevServer, connection_ids, shoal_command

pytestmark = pytest.mark.e2e

#: how long a test waits for what should come (a bound on a hang, never a speed assertion)
PATIENCE_S = 120.0
#: how long a test watches for what should not come
QUIET_S = 2.0


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def token(dev: DevServer, sub: str, topic: str) -> str:
    """A token of ``shoal dev``'s local issuer, minted in this process (``shoal token`` in a
    subprocess costs seconds on a loaded machine)."""
    settings = IssuerSettings.load(dev.state_dir)
    assert settings is not None
    return mint_token(
        SigningKey.load_or_create(dev.state_dir),
        issuer=settings.issuer,
        audience=settings.audience,
        sub=sub,
        clients=[f"{sub}*"],
        publish=[f"{topic}/#"],
        subscribe=[f"{topic}/#"],
    )


def publish(dev: DevServer, jwt: str, topic: str, texts: list[str]) -> None:
    with ShoalClient(dev.url, jwt) as client:
        bodies = [ShoalClient.message_body(topic, text=t, qos=1) for t in texts]
        results = client.publish_many(bodies)
    assert all(not isinstance(r, Exception) for r in results), results


def ws_client(dev: DevServer, jwt: str, client_id: str, state: Path, **options: Any) -> Any:
    return ShoalWsClient(dev.ws_url, jwt, client_id=client_id, state=state, **options)


class HttpMember:
    """A session over the HTTP API, its channel held (a shared group's long-polling member)."""

    def __init__(self, dev: DevServer, jwt: str, client_id: str, topic_filter: str) -> None:
        self.dev, self.jwt, self.client_id = dev, jwt, client_id
        self.channel = ""
        body = {"clean_start": True, "session_expiry_s": 600}
        self.channel = self.call("PUT", json=body)["channel"]
        subscriptions = [{"filter": topic_filter, "qos": 1}]
        self.call("POST", "/subscriptions", json={"subscriptions": subscriptions})

    def call(self, method: str, suffix: str = "", **kw: Any) -> Any:
        headers = {"Shoal-Channel": self.channel} if self.channel else None
        status, body = self.dev.request(
            method, f"/v1/sessions/{self.client_id}{suffix}", token=self.jwt, headers=headers, **kw
        )
        assert status in (200, 204), body
        return body


def publish_keyed(dev: DevServer, jwt: str, topic: str, texts_by_key: dict[str, str]) -> None:
    with ShoalClient(dev.url, jwt) as client:
        bodies = [
            ShoalClient.message_body(topic, text=text, ordering_key=key)
            for key, text in texts_by_key.items()
        ]
        assert not any(isinstance(r, Exception) for r in client.publish_many(bodies))


def texts(messages: list[ReceivedMessage]) -> list[str | None]:
    return [m.text for m in messages]


@pytest.fixture
def state(tmp_path: Path) -> Path:
    return tmp_path / "ws-client.json"


def test_each_pushed_message_once_through_a_connection_the_server_closes(
    shared_dev: DevServer, state: Path
) -> None:
    jwt = token(shared_dev, "wsa", "wsa")
    said: list[str] = []
    got: list[ReceivedMessage] = []
    with ws_client(shared_dev, jwt, "wsa-1", state) as client:
        client.connect(clean_start=True)
        assert client.subscribe("wsa/#") == [1]
        publish(shared_dev, jwt, "wsa/x", [f"m{n}" for n in range(6)])
        deadline = now_ms() + int(PATIENCE_S * 1000)
        for message in client.messages(count=6, until_ms=deadline, on_outage=said.append):
            got.append(message)
            if len(got) == 3:
                # the server side closes the connection (a deploy, API Gateway's limits):
                # the 3rd is being processed, the rest may be in flight on the dead connection
                (connection_id,) = connection_ids(shared_dev, "wsa-1")
                status, _ = shared_dev.request("DELETE", f"/@connections/{connection_id}")
                assert status == 204
        # whatever came again with dup after the reconnect was not handed out again. (The
        # loss is noticed by whichever loop next uses the connection: the messages received
        # before the close are handed out first, and no ack is sent before its delay)
        more = list(client.messages(until_ms=now_ms() + int(QUIET_S * 1000), on_outage=said.append))
        assert client.connections_opened == 2
    assert texts(got) == [f"m{n}" for n in range(6)]
    assert more == []
    assert len(said) == 2 and "the session was resumed" in said[1]


def test_a_message_whose_handler_raised_comes_again_and_is_processed_once(
    shared_dev: DevServer, state: Path
) -> None:
    jwt = token(shared_dev, "wsb", "wsb")
    handled: list[str | None] = []

    def handler(message: ReceivedMessage) -> None:
        if message.text == "second" and "second" not in handled:
            handled.append("failed")
            raise RuntimeError("the handler failed")
        handled.append(message.text)

    deadline = now_ms() + int(PATIENCE_S * 1000)
    with ws_client(shared_dev, jwt, "wsb-1", state) as client:
        client.connect(clean_start=True)
        client.subscribe("wsb/#")
        publish(shared_dev, jwt, "wsb/x", ["first", "second", "third"])
        with pytest.raises(RuntimeError):
            client.consume(handler, until_ms=deadline)
    # not acked: a new client (a restarted process, same state file) gets it from the server
    # again, with dup, and the one processed before is not handed out again
    redelivered: list[ReceivedMessage] = []
    with ws_client(shared_dev, jwt, "wsb-1", state) as client:
        client.consume(redelivered.append, count=2, until_ms=deadline)
        more = list(client.messages(until_ms=now_ms() + int(QUIET_S * 1000)))
    assert handled == ["first", "failed"]
    assert texts(redelivered) == ["second", "third"]
    assert redelivered[0].dup is True
    assert more == []


def test_the_server_pushes_no_more_than_the_window_the_client_asked_for(
    shared_dev: DevServer, state: Path
) -> None:
    jwt = token(shared_dev, "wsc", "wsc")
    deadline = now_ms() + int(PATIENCE_S * 1000)
    with ws_client(shared_dev, jwt, "wsc-1", state, flow=FlowControl(max_messages=3)) as client:
        client.connect(clean_start=True)
        assert client.receive_maximum == 3
        client.subscribe("wsc/#")
        publish(shared_dev, jwt, "wsc/x", [f"n{n}" for n in range(6)])
        held = list(client.messages(count=3, auto_ack=False, until_ms=deadline))
        # the application holds three, unacked: nothing more is pushed
        assert list(client.messages(auto_ack=False, until_ms=now_ms() + int(QUIET_S * 1000))) == []
        # one processed opens the window by one
        client.ack(held[0])
        (fourth,) = list(client.messages(count=1, auto_ack=False, until_ms=deadline))
        client.ack(*held[1:], fourth)
        rest = list(client.messages(count=2, until_ms=deadline))
    assert texts([*held, fourth, *rest]) == [f"n{n}" for n in range(6)]


def test_a_newer_connect_for_the_client_id_takes_the_session_over(
    shared_dev: DevServer, tmp_path: Path
) -> None:
    jwt = token(shared_dev, "wsd", "wsd")
    first = ws_client(shared_dev, jwt, "wsd-1", tmp_path / "a.json")
    second = ws_client(shared_dev, jwt, "wsd-1", tmp_path / "b.json")
    try:
        first.connect(clean_start=True)
        first.subscribe("wsd/#")
        assert second.connect().session_present is True
        with pytest.raises(SessionTakenOver):
            list(first.messages(until_ms=now_ms() + int(PATIENCE_S * 1000)))
        assert first.connection is None
        # the newer connection holds the session and its subscription
        publish(shared_dev, jwt, "wsd/x", ["to the newer one"])
        got = list(second.messages(count=1, until_ms=now_ms() + int(PATIENCE_S * 1000)))
        assert texts(got) == ["to the newer one"]
    finally:
        first.close()
        second.close()


def test_a_renewal_before_the_connections_end_keeps_the_channel(
    shared_dev: DevServer, state: Path
) -> None:
    """The client renews its connection before its end (API Gateway's 2 hours, here 8 s on
    the client's side): the new connection's ``renew`` keeps the live channel, the old
    connection is closed, and what is published after comes on the new one."""
    jwt = token(shared_dev, "wse", "wse")
    settings = WsSettings(max_connection_s=8.0, renew_before_s=1.0, ping_every_s=60.0)
    with ws_client(shared_dev, jwt, "wse-1", state, settings=settings) as client:
        connected = client.connect(clean_start=True)
        client.subscribe("wse/#")
        (before,) = connection_ids(shared_dev, "wse-1")
        publish(shared_dev, jwt, "wse/x", ["before"])
        got = list(client.messages(count=1, until_ms=now_ms() + int(PATIENCE_S * 1000)))
        # past the renewal (6 to 7 s after the connect): the loop renews while it waits
        deadline = now_ms() + int(PATIENCE_S * 1000)
        while client.connections_opened < 2 and now_ms() < deadline:
            got += list(client.messages(until_ms=now_ms() + 500))
        assert client.connections_opened == 2
        assert client.connection is not None
        assert client.connection.channel == connected.channel
        assert client.connection.session_present is True
        publish(shared_dev, jwt, "wse/x", ["after"])
        got += list(client.messages(count=1, until_ms=now_ms() + int(PATIENCE_S * 1000)))
        # the old connection's items are gone: one connection holds the session
        (after,) = connection_ids(shared_dev, "wse-1")
    assert after != before
    assert texts(got) == ["before", "after"]


def test_a_lane_an_http_member_hands_over_reaches_a_websocket_member(
    shared_dev: DevServer, state: Path
) -> None:
    """A shared group of a long-polling HTTP member and a WebSocket member: the lanes the
    newcomer takes wait for the HTTP member's acks of what it holds, and the ack's request
    (the messages function) pushes the newcomer what its lanes hold then (``HandOvers``)."""
    jwt = token(shared_dev, "wsg", "wsg")
    share = "$share/gm/wsg/#"
    keys = [f"k{n}" for n in range(8)]

    http = HttpMember(shared_dev, jwt, "wsg-1", share)
    publish_keyed(shared_dev, jwt, "wsg/x", {k: f"first-{k}" for k in keys})
    held: list[dict[str, Any]] = []
    deadline = now_ms() + int(PATIENCE_S * 1000)
    while len(held) < len(keys) and now_ms() < deadline:
        got = http.call("GET", "/messages?max=100&wait_ms=2000")
        held += got["messages"]
    assert len(held) == len(keys)  # the only member holds every lane, each with one in flight
    # the next message of each key waits behind the one in flight: routed while the HTTP
    # member holds every lane (the router's push has nobody to push them to)
    publish_keyed(shared_dev, jwt, "wsg/x", {k: f"second-{k}" for k in keys})
    time.sleep(2.0)  # the mapping polls every 0.5 s: routed by then, as a rule
    with ws_client(shared_dev, jwt, "wsg-2", state) as member:
        member.connect(clean_start=True)
        member.subscribe(share)  # takes lanes: revoking from the HTTP member until its acks
        http.call("POST", "/acks", json={"ids": [m["id"] for m in held]})
        # the WebSocket member does nothing but wait: what reaches it was pushed to it by the
        # ack's request (or, if the router was late, by the router: then this proves less)
        pushed = list(member.messages(count=1, until_ms=now_ms() + int(PATIENCE_S * 1000)))
    assert texts(pushed) and str(texts(pushed)[0]).startswith("second-")


def test_lanes_an_http_member_leaves_reach_a_websocket_member(
    shared_dev: DevServer, state: Path
) -> None:
    """The HTTP member of a two-member group unsubscribes with its lanes' messages unread:
    its lanes go to the WebSocket member, idle with everything acked, and the unsubscribe's
    request (the subscriptions function) pushes it what they hold (``HandOvers``)."""
    jwt = token(shared_dev, "wsh", "wsh")
    share = "$share/gu/wsh/#"
    keys = [f"k{n}" for n in range(8)]
    stop = threading.Event()

    http = HttpMember(shared_dev, jwt, "wsh-1", share)

    def keep_leases() -> None:
        # the HTTP member keeps its lanes (6 s lease timeout) while the other consumes
        while not stop.wait(1.0):
            http.call("POST", "/heartbeat")

    beating = threading.Thread(target=keep_leases, daemon=True)
    beating.start()
    try:
        with ws_client(shared_dev, jwt, "wsh-2", state) as member:
            member.connect(clean_start=True)
            member.subscribe(share)
            publish_keyed(shared_dev, jwt, "wsh/x", {k: f"m-{k}" for k in keys})
            # its own lanes' messages, processed and acked; then quiet for 6 s, past the lease
            # timeout: the idle WebSocket member is live still (its connection keeps it), so
            # the leave grants it the lanes and pushes it
            got = list(member.messages(until_ms=now_ms() + 6000))
            assert 0 < len(got) < len(keys), texts(got)  # the HTTP member holds the rest
            stop.set()
            beating.join()
            http.call("POST", "/unsubscribe", json={"filters": [share]})
            # nothing else happens: what comes was pushed by the unsubscribe's request
            rest = len(keys) - len(got)
            got += list(member.messages(count=rest, until_ms=now_ms() + int(PATIENCE_S * 1000)))
    finally:
        stop.set()
    assert sorted(str(t) for t in texts(got)) == sorted(f"m-{k}" for k in keys)


# -- shoal subscribe ----------------------------------------------------------------------------


@pytest.fixture
def cli(
    shared_dev: DevServer,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> Iterator[Any]:
    monkeypatch.chdir(tmp_path)  # the default state files go under ./.shoal/client
    for name in ("SHOAL_URL", "SHOAL_TOKEN", "SHOAL_WS_URL", "SHOAL_TOKEN_COMMAND"):
        monkeypatch.delenv(name, raising=False)

    def run(argv: list[str]) -> tuple[int, str, str]:
        capsys.readouterr()
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"")))
        status = main(argv)
        captured = capsys.readouterr()
        return status, captured.out, captured.err

    yield run


def test_shoal_subscribe_prints_over_the_websocket_api_and_the_long_poll(
    shared_dev: DevServer, cli: Any
) -> None:
    jwt = token(shared_dev, "wse", "wse")
    common = ["--url", shared_dev.url, "--token", jwt, "-i", "wse-1", "-t", "wse/#"]
    ws = ["--ws-url", shared_dev.ws_url]
    # the session and its subscription, then two messages
    status, _, err = cli(["subscribe", *common, *ws, "-C", "0"])
    assert status == 0, err
    publish(shared_dev, jwt, "wse/a", ["one", "two"])
    status, out, err = cli(["subscribe", *common, *ws, "-C", "2", "-W", str(PATIENCE_S), "--json"])
    assert status == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    # the API's message objects, as the long poll prints them (no frame `action`)
    assert [line["text"] for line in lines] == ["one", "two"]
    assert all("action" not in line and line["topic"] == "wse/a" for line in lines)
    assert err == ""
    # the long poll goes on with the same session and state file: nothing printed twice
    publish(shared_dev, jwt, "wse/b", ["three"])
    poll = ["--transport", "poll", "--wait-ms", "1000"]
    status, out, err = cli(["subscribe", *common, *poll, "-C", "1", "-W", str(PATIENCE_S), "-v"])
    assert status == 0, err
    assert out == "wse/b three\n"


def _processed(state: Path, client_id: str) -> list[str]:
    """The ids a client's state file holds as processed (written atomically: whole or old)."""
    try:
        data = json.loads(state.read_text())
    except (FileNotFoundError, ValueError):
        return []
    return [
        i
        for scope in data["scopes"].values()
        for i in scope.get("sessions", {}).get(client_id, {}).get("delivered", [])
    ]


def test_shoal_subscribe_killed_inside_its_ack_delay_prints_nothing_twice(
    shared_dev: DevServer, cli: Any, tmp_path: Path
) -> None:
    """Acks are held for a delay; the processed ids are in the state file before that, so a
    subscriber killed inside the delay gets its messages again (the service never had their
    acks) and acks them without printing them again."""
    jwt = token(shared_dev, "wsk", "wsk")
    state = tmp_path / "wsk.json"
    common = ["--url", shared_dev.url, "--ws-url", shared_dev.ws_url, "--token", jwt]
    common += ["-i", "wsk-1", "-t", "wsk/#", "--state", str(state)]

    def in_flight() -> int:
        status, session = shared_dev.request("GET", "/v1/sessions/wsk-1", token=jwt)
        assert status == 200, session
        count: int = session["in_flight"]
        return count

    # Given a subscriber holding its acks 10 s (the longest delay), three messages printed
    # and processed (in its state file)
    status, _, err = cli(["subscribe", *common, "-C", "0"])
    assert status == 0, err
    argv = [*shoal_command(), "subscribe", *common, "--ack-delay-ms", "10000"]
    process = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        publish(shared_dev, jwt, "wsk/a", ["one", "two", "three"])
        deadline = time.monotonic() + PATIENCE_S
        while len(_processed(state, "wsk-1")) < 3 and time.monotonic() < deadline:
            assert process.poll() is None, process.communicate()
            time.sleep(0.05)
        # When it is killed inside its ack delay
        process.kill()
        out, _ = process.communicate(timeout=PATIENCE_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert out == b"one\ntwo\nthree\n"
    assert len(_processed(state, "wsk-1")) == 3
    # (no ack had gone: all three are still in flight; this fails only if more than the
    # 10 s delay passed between the third's processing and the kill)
    assert in_flight() == 3
    # Then the next run gets them again, acks them, and prints only what is new
    publish(shared_dev, jwt, "wsk/a", ["four"])
    status, out, err = cli(["subscribe", *common, "-C", "1", "-W", str(PATIENCE_S)])
    assert (status, out) == (0, "four\n"), err
    assert in_flight() == 0
