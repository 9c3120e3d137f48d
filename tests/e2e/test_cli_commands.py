"""Every client command of ``shoal`` against one ``shoal dev``, run in-process through
``main(argv)``: publish (one message, ``-l`` in batches, a missing file, state per server),
subscribe (output forms, retain handling 0/1/2), topics, push and sessions.

Requests are counted by the server: the gateway writes one JSON log line per request.
"""

from __future__ import annotations

import io
import json
import socket
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
from shoal.cli.main import main
from shoal.client.http import ShoalClient
from shoal.client.support import CallRetry

from tests.e2e.conftest import DevServer

pytestmark = pytest.mark.e2e


@dataclass
class Run:
    status: int
    out: str
    err: str

    def json_lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.out.splitlines()]


class Shoal:
    """``shoal ...`` in this process, in a fresh working folder, against ``shared_dev``."""

    def __init__(
        self, dev: DevServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        self.dev = dev
        self.capsys = capsys
        self.monkeypatch = monkeypatch

    def token(self, sub: str, *flags: str) -> str:
        result = self(["token", "--state-dir", str(self.dev.state_dir), "--sub", sub, *flags])
        assert result.status == 0, result.err
        return result.out.strip().splitlines()[-1]

    def __call__(self, argv: list[str], stdin: bytes | None = None) -> Run:
        self.capsys.readouterr()
        if stdin is not None:
            self.monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(stdin)))
        status = main(argv)
        captured = self.capsys.readouterr()
        return Run(status, captured.out, captured.err)

    def requests_to(self, path: str, after: int = 0) -> int:
        """Requests the server logged for ``path`` (lines from ``after`` on)."""
        return sum(1 for line in self.log_lines()[after:] if line.get("path") == path)

    def log_lines(self) -> list[dict[str, Any]]:
        lines = []
        for raw in self.dev.log().splitlines():
            if raw.startswith("{"):
                lines.append(json.loads(raw))
        return lines


@pytest.fixture
def shoal(
    shared_dev: DevServer,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> Iterator[Shoal]:
    monkeypatch.chdir(tmp_path)  # the default state files go under ./.shoal/client
    for name in ("SHOAL_URL", "SHOAL_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    yield Shoal(shared_dev, capsys, monkeypatch)


def settle_log(shoal: Shoal, path: str, at_least: int, after: int) -> int:
    """The server's count of requests to ``path``, once its log shows ``at_least`` (the line
    is written just after the answer)."""
    for _ in range(50):
        count = shoal.requests_to(path, after)
        if count >= at_least:
            return count
        time.sleep(0.05)
    return shoal.requests_to(path, after)


def test_publish_lines_from_stdin_go_in_batches_and_arrive_in_order(shoal: Shoal) -> None:
    url = shoal.dev.url
    token = shoal.token("cli-lines", "--publish", "lines/#", "--subscribe", "lines/#")
    common = ["--url", url, "--token", token]
    assert shoal(["subscribe", *common, "-t", "lines/#", "-C", "0"]).status == 0
    before = len(shoal.log_lines())
    # When 60 lines (and two blank ones, which are not sent) are published with -l
    lines = b"".join(f"line {n}\n".encode() for n in range(60)) + b"\n\n"
    # (batches cut by count only: with the default 10 ms delay, a reader held up that long on a
    # loaded machine sends a partial batch, and the count below was 4 once in a whole run)
    run = shoal(
        [
            "publish",
            *common,
            "-t",
            "lines/a",
            "-l",
            "--batch-size",
            "25",
            "--batch-delay-ms",
            "60000",
        ],
        stdin=lines,
    )
    assert run.status == 0, run.err
    # Then each line is one message with the next seq of one publisher
    results = run.json_lines()
    assert [r["publisher_seq"] for r in results] == list(range(1, 61))
    assert not any(r["duplicate"] for r in results)
    # and the server got them in three batch requests: 0.05 requests a message
    assert settle_log(shoal, "/v1/messages:batch", 3, before) == 3
    assert shoal.requests_to("/v1/messages", before) == 0
    # and a subscriber gets them once each, in order
    got = shoal(["subscribe", *common, "-t", "lines/#", "-C", "60", "--wait-ms", "1000"])
    assert got.out.splitlines() == [f"line {n}" for n in range(60)]


def test_a_message_left_for_one_server_is_never_sent_to_another(shoal: Shoal) -> None:
    url = shoal.dev.url
    token = shoal.token("cli-resend", "--publish", "resend/#", "--subscribe", "resend/#")
    sub = ["subscribe", "--url", url, "--token", token, "-t", "resend/#", "--json"]
    assert shoal([*sub, "-C", "0"]).status == 0
    # Given a publish to a wrong URL that never got an answer
    wrong = ["publish", "--url", "http://127.0.0.1:1", "--token", token, "--retries", "0"]
    failed = shoal([*wrong, "-t", "resend/x", "-m", "wrong-url"])
    assert failed.status == 1
    assert failed.err.count("\n") == 1 and "stay in flight" in failed.err
    # When the next publish goes to the real server under the same principal
    right = shoal(["publish", "--url", url, "--token", token, "-t", "resend/x", "-m", "right"])
    # Then it goes alone, first of its sequence there, and nothing is said about a resend
    assert right.status == 0 and right.err == ""
    assert right.json_lines()[0]["publisher_seq"] == 1
    got = shoal([*sub, "-C", "1", "-W", "1"])
    assert [m["text"] for m in got.json_lines()] == ["right"]


def _leave_in_flight(url: str, token: str, text: str) -> None:
    """What a `shoal publish` killed mid-request leaves: a publish in flight in the default
    state file of (url, principal), which this server never received."""
    from shoal.cli.pubsub import state_file
    from shoal.client.support import principal_of

    class Refused(requests.adapters.BaseAdapter):
        def send(self, *args: Any, **kwargs: Any) -> requests.Response:
            raise requests.ConnectionError("refused")

        def close(self) -> None:
            pass

    http = requests.Session()
    http.mount("http://", Refused())
    state = state_file("publish", url, principal_of(token))
    policy = CallRetry(attempts=1)
    client = ShoalClient(url, token, state=state, policy=policy, http=http)
    with client, pytest.raises(Exception, match="no answer"):
        client.publish("pending/x", text=text)


def test_a_pending_message_is_resent_to_its_server_and_said_so(shoal: Shoal) -> None:
    url = shoal.dev.url
    token = shoal.token("cli-pending", "--publish", "pending/#", "--subscribe", "pending/#")
    sub = ["subscribe", "--url", url, "--token", token, "-t", "pending/#"]
    assert shoal([*sub, "-C", "0"]).status == 0
    _leave_in_flight(url, token, "earlier")
    # When the next publish runs against the same server
    run = shoal(["publish", "--url", url, "--token", token, "-t", "pending/x", "-m", "later"])
    # Then the earlier message goes first, and stderr says so in one line
    assert run.status == 0
    assert run.err.count("\n") == 1 and "sending again 1 message(s)" in run.err
    assert run.json_lines()[0]["publisher_seq"] == 2
    assert shoal([*sub, "-C", "2"]).out.splitlines() == ["earlier", "later"]


def test_discard_pending_forgets_what_an_earlier_run_left(shoal: Shoal) -> None:
    url = shoal.dev.url
    token = shoal.token("cli-discard", "--publish", "pending/#", "--subscribe", "pending/#")
    sub = ["subscribe", "--url", url, "--token", token, "-t", "pending/#"]
    assert shoal([*sub, "-C", "0"]).status == 0
    _leave_in_flight(url, token, "forgotten")
    publish = ["publish", "--url", url, "--token", token, "-t", "pending/x"]
    run = shoal([*publish, "--discard-pending", "-m", "kept"])
    assert run.status == 0 and "forgot 1 message(s)" in run.err
    # the next publish starts clean: nothing said, nothing resent
    assert shoal([*publish, "-m", "next"]).err == ""
    assert shoal([*sub, "-C", "2"]).out.splitlines() == ["kept", "next"]


def test_a_missing_file_is_one_line_and_publishes_nothing(shoal: Shoal) -> None:
    token = shoal.token("cli-file", "--publish", "file/#")
    before = len(shoal.log_lines())
    run = shoal(
        ["publish", "--url", shoal.dev.url, "--token", token, "-t", "file/x", "-f", "no.bin"]
    )
    assert run.status == 2
    assert run.err == "shoal: error: cannot read --file no.bin: No such file or directory\n"
    assert shoal.requests_to("/v1/messages", before) == 0


@pytest.mark.parametrize(
    ("handling", "printed"),
    [(0, [["kept"], ["kept"]]), (1, [["kept"], []]), (2, [[], []])],
)
def test_retain_handling_decides_when_the_retained_message_prints(
    shoal: Shoal, handling: int, printed: list[list[str]]
) -> None:
    # MQTT 5 §3.8.3.1: 0 at every subscribe, 1 only when the subscription is new, 2 never
    token = shoal.token(
        f"cli-rh{handling}",
        *("--clients", f"rh{handling}-*"),
        *("--publish", f"rh{handling}/#", "--subscribe", f"rh{handling}/#"),
    )
    common = ["--url", shoal.dev.url, "--token", token]
    retained = shoal(["publish", *common, "-t", f"rh{handling}/x", "-m", "kept", "-r"])
    assert retained.status == 0
    # at once: a subscription the router sees before it routes the message gets it only as
    # the retained message, or not at all (handling 2), never routed too (docs/design.md)
    sub = ["subscribe", *common, "-i", f"rh{handling}-1", "-t", f"rh{handling}/x"]
    sub += ["--retain-handling", str(handling)]
    runs = []
    for expected in printed:
        # a run that expects the message stops at it; one that expects nothing waits a little
        run = shoal([*sub, "-C", "1", "-W", "5" if expected else "0.5"])
        assert run.status == (0 if expected else 27)
        runs.append(run.out.splitlines())
    assert runs == printed


def test_subscribe_prints_payloads_or_topic_and_payload(shoal: Shoal) -> None:
    token = shoal.token(
        "cli-out", "--clients", "out-*", "--publish", "out/#", "--subscribe", "out/#"
    )
    common = ["--url", shoal.dev.url, "--token", token]
    sub = ["subscribe", *common, "-i", "out-1", "-t", "out/#", "--no-local"]
    assert shoal([*sub, "-C", "0"]).status == 0
    # a message published under the subscriber's own client id is skipped (--no-local)
    assert shoal(["publish", *common, "-i", "out-1", "-t", "out/own", "-m", "mine"]).status == 0
    assert shoal(["publish", *common, "-t", "out/a", "-m", "first"]).status == 0
    assert shoal(["publish", *common, "-t", "out/b", "-m", "second"]).status == 0
    assert shoal([*sub, "-C", "1"]).out == "first\n"
    assert shoal([*sub, "-C", "1", "-v"]).out == "out/b second\n"


def test_topics_push_and_sessions_round_trips(shoal: Shoal) -> None:
    admin = ["--url", shoal.dev.url, "--token", shoal.token("cli-ops", "--admin")]

    def ok(*argv: str) -> Any:
        run = shoal([*argv, *admin])
        assert run.status == 0, run.err
        return json.loads(run.out) if run.out else None

    created = ok("topics", "create", "cliorders", "--partitions", "2")
    assert (created["name"], created["storage_topics"][0]["partitions"]) == ("cliorders", 2)
    assert "cliorders" in [t["name"] for t in ok("topics", "list")["topics"]]
    # a switch with no newer storage topic is refused in one line (the route's own 409)
    early = shoal(["topics", "switch-produce", "cliorders", *admin])
    assert (early.status, early.err.count("\n")) == (1, 1)
    assert "no_next_storage_topic" in early.err
    grown = ok("topics", "grow", "cliorders", "--partitions", "4")
    assert [s["partitions"] for s in grown["storage_topics"]] == [2, 4]
    assert ok("topics", "describe", "cliorders")["produce_pointer"] == 0
    refused = shoal(["topics", "describe", "nope", *admin])
    assert (refused.status, refused.err.count("\n")) == (1, 1)
    assert "topic_not_found" in refused.err

    hook = "http://127.0.0.1:9/hook"
    made = ok(
        "push",
        "create",
        "clibill",
        "--filter",
        "cliorders/#",
        "--endpoint",
        hook,
        "--max-attempts",
        "3",
    )
    assert (made["filter"], made["retry"]["max_attempts"]) == ("cliorders/#", 3)
    # push list: a page, then every page; entries as describe has them, without the depths
    assert len(ok("push", "list", "--limit", "1")["subscriptions"]) <= 1
    listed = ok("push", "list", "--all")
    assert listed["next_page_token"] is None
    mine = [s for s in listed["subscriptions"] if s["name"] == "clibill"]
    assert [(s["filter"], s["state"], "dlq_depth" in s) for s in mine] == [
        ("cliorders/#", "active", False)
    ]
    assert ok("push", "update", "clibill", "--parallelism", "2")["parallelism"] == 2
    assert ok("push", "describe", "clibill")["parallelism"] == 2
    assert ok("push", "seek", "clibill", "--to", "latest")["name"] == "clibill"
    assert ok("push", "dlq", "list", "clibill") == {"messages": [], "next": None}
    report = ok("push", "dlq", "redrive", "clibill", "--ordering-key", "k1")
    assert report["redriven"] == 0
    assert ok("push", "delete", "clibill") is None
    assert shoal(["push", "describe", "clibill", *admin]).status == 1
    assert "clibill" not in [s["name"] for s in ok("push", "list", "--all")["subscriptions"]]


def test_sessions_show_reads_a_held_session_without_taking_it_over(shoal: Shoal) -> None:
    url = shoal.dev.url
    token = shoal.token("cli-show", "--publish", "show/#", "--subscribe", "show/#")
    common = ["--url", url, "--token", token]
    with ShoalClient(url, token, client_id="cli-show") as client:
        # Given a subscriber holding the session, with a QoS 1 delivery not acked yet
        channel = client.connect(clean_start=True, session_expiry_s=600).channel
        assert client.subscribe("show/#", qos=2) == [2]
        assert shoal(["publish", *common, "-t", "show/a", "-m", "held"]).status == 0
        got = client.fetch(wait_ms=5000)
        assert [m.payload for m in got] == [b"held"]
        before = len(shoal.log_lines())
        # When its principal, then an admin, run `shoal sessions show`
        admin = shoal.token("cli-show-ops", "--admin")
        shown = [
            shoal(["sessions", "show", "--url", url, "--token", t, "cli-show"])
            for t in (token, admin)
        ]
        # Then both see the session, its subscription and the delivery in flight
        for run in shown:
            assert run.status == 0, run.err
            session = json.loads(run.out)
            assert [(s["filter"], s["qos"]) for s in session["subscriptions"]] == [("show/#", 2)]
            assert (session["connected"], session["in_flight"]) == (True, 1)
        # and the server got two GETs of the session and no connect (PUT on the same path)
        assert settle_log(shoal, "/v1/sessions/cli-show", 2, before) == 2
        methods = [
            line["method"]
            for line in shoal.log_lines()[before:]
            if line.get("path") == "/v1/sessions/cli-show"
        ]
        assert methods == ["GET", "GET"]
        # and the subscriber keeps its channel and acks its delivery
        assert client.connection is not None and client.connection.channel == channel
        assert client.ack(*got) == 1
        assert client.heartbeat() is not None
    # a session nobody holds: one line, the API's 404
    missing = shoal(["sessions", "show", "--url", url, "--token", admin, "cli-show-none"])
    assert (missing.status, missing.err.count("\n")) == (1, 1)
    assert "session_not_found" in missing.err


def test_the_dev_log_is_json_lines_without_tracebacks_for_dropped_polls(shoal: Shoal) -> None:
    token = shoal.token("cli-drop", "--subscribe", "drop/#")
    url = shoal.dev.url
    with ShoalClient(url, token, client_id="cli-drop") as client:
        client.connect()
        channel = client.connection.channel if client.connection else ""
    host, port = url.removeprefix("http://").split(":")
    poll = (
        f"GET /v1/sessions/cli-drop/messages?wait_ms=300 HTTP/1.1\r\nHost: {host}\r\n"
        f"Authorization: Bearer {token}\r\nShoal-Channel: {channel}\r\n\r\n"
    ).encode()
    reset = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() resets the connection
    # Given a long poll whose client resets the connection before the answer
    with socket.create_connection((host, int(port))) as raw:
        raw.sendall(poll)
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, reset)
    # and a keep-alive connection reset while the server waits for its next request
    with socket.create_connection((host, int(port))) as raw:
        raw.sendall(f"GET /v1/health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        assert raw.recv(65536).startswith(b"HTTP/1.1 200")
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, reset)
    time.sleep(0.6)  # the server answers the dropped poll after its 300 ms
    log = shoal.dev.log()
    assert "Traceback" not in log
    # and every log line of the runtime (not the banner on stdout) is one JSON object
    gateway = [line for line in shoal.log_lines() if line.get("logger") == "shoal-dev.gateway"]
    assert gateway and all({"method", "path", "status", "ms"} <= set(line) for line in gateway)


def test_the_emulator_port_is_kept_in_the_state_dir(shared_dev: DevServer) -> None:
    # the next start on this state dir without --aws-port serves the emulator there again
    assert (shared_dev.state_dir / "aws-port").read_text() == f"{shared_dev.aws_port}\n"
