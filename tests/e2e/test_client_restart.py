"""Exactly-once through client restarts, over ``shoal dev``: publisher and consumer killed with -9.

The publisher and the consumer are separate processes: this module run as a script
(``python -m tests.e2e.test_client_restart publish|consume ...``), or the ``shoal publish`` and
``shoal subscribe`` commands, all on state files that survive them. The script can kill itself
with SIGKILL at a chosen request (``--kill after:POST:/v1/messages:12``: once the answer to the
12th publish arrived, before the client could record it), so the interesting instants are hit
every run; the test also kills one publisher from outside at whatever point it has reached.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import requests
from requests.adapters import HTTPAdapter
from shoal.client.http import ShoalClient

from tests.e2e.conftest import ROOT, DevServer, shoal_command

pytestmark = pytest.mark.e2e

MESSAGES = 30
TOPIC = "relay/orders/eu"
CLIENT_ID = "relay-consumer"
RUN_TIMEOUT_S = 120


# -- the client processes ----------------------------------------------------------------------


class KillingAdapter(HTTPAdapter):
    """Sends requests as usual, and SIGKILLs this process at the n-th request to a route."""

    def __init__(self, spec: str) -> None:
        super().__init__()
        self.when, self.method, self.path_end, nth = spec.split(":")
        self.nth = int(nth)
        self.seen = 0

    def send(self, request: requests.PreparedRequest, *args: Any, **kwargs: Any) -> Any:
        path = urlsplit(request.url or "").path
        hit = False
        if request.method == self.method and path.endswith(self.path_end):
            self.seen += 1
            hit = self.seen == self.nth
        if hit and self.when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        response = super().send(request, *args, **kwargs)
        if hit and self.when == "after":
            os.kill(os.getpid(), signal.SIGKILL)
        return response


def _client(args: argparse.Namespace, **options: Any) -> ShoalClient:
    http = requests.Session()
    if args.kill:
        http.mount("http://", KillingAdapter(args.kill))
    return ShoalClient(args.url, args.token, state=args.state, http=http, **options)


def _publish(args: argparse.Namespace) -> int:
    """Publish msg-<seq> until seq ``args.count``, going on from wherever the state says."""
    with _client(args) as client:
        while client.next_seq <= args.count:
            result = client.publish(TOPIC, text=f"msg-{client.next_seq}")
            print(json.dumps(result.as_dict()), flush=True)
            time.sleep(args.pause_s)
    return 0


def _consume(args: argparse.Namespace) -> int:
    """Print every message (the processing) until killed or ``args.count`` were printed."""
    with _client(args, client_id=CLIENT_ID) as client:
        client.connect(session_expiry_s=600)
        for message in client.messages(max_messages=5, wait_ms=2000, count=args.count):
            print(message.as_json_line(), flush=True)
    return 0


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=("publish", "consume"))
    parser.add_argument("--url", required=True)
    parser.add_argument("--token", default=os.environ.get("SHOAL_TOKEN"))
    parser.add_argument("--state", type=Path, required=True)
    parser.add_argument("--count", type=int)
    parser.add_argument("--kill", help="when:METHOD:path-end:n, e.g. before:POST:/acks:2")
    parser.add_argument("--pause-s", type=float, default=0.0)
    args = parser.parse_args(argv)
    return _publish(args) if args.role == "publish" else _consume(args)


# -- the test ----------------------------------------------------------------------------------


def _env(token: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_ENDPOINT_URL")}
    # the token goes by environment, never on a command line
    return env | {"PYTHONUNBUFFERED": "1", "SHOAL_TOKEN": token}


def _script(dev: DevServer, role: str, state: Path, *args: str) -> list[str]:
    module = "tests.e2e.test_client_restart"
    return [sys.executable, "-m", module, role, "--url", dev.url, "--state", str(state), *args]


def _run(command: list[str], token: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command,
        cwd=ROOT,
        env=_env(token),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )


def _lines(output: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in output.splitlines() if line.startswith("{")]


def _missing_route(dev: DevServer, token: str) -> str | None:
    """The first session route the server does not have yet (404 route_not_found), if any."""
    status, connected = dev.request(
        "PUT", "/v1/sessions/relay-probe", token=token, json={"clean_start": True}
    )
    assert status == 200, connected
    headers = {"Shoal-Channel": connected["channel"]}
    probes: list[tuple[str, str, Any]] = [
        ("POST", "/v1/sessions/relay-probe/subscriptions", {"subscriptions": []}),
        ("GET", "/v1/sessions/relay-probe/messages?max=1", None),
        ("POST", "/v1/sessions/relay-probe/acks", {"ids": []}),
    ]
    for method, path, body in probes:
        status, answer = dev.request(method, path, token=token, json=body, headers=headers)
        code = answer.get("error", {}).get("code") if isinstance(answer, dict) else None
        if status == 404 and code == "route_not_found":
            return f"{method} {path.split('?')[0]}"
    return None


def test_exactly_once_through_client_restarts(dev: DevServer, tmp_path: Path) -> None:
    token = dev.token("relay", clients=["relay-*"], publish=["relay/#"], subscribe=["relay/#"])
    missing = _missing_route(dev, token)
    if missing is not None:
        pytest.skip(f"{missing} is not routed by shoal dev yet (404 route_not_found)")
    published_state, consumed_state = tmp_path / "publisher.json", tmp_path / "consumer.json"
    subscribe = [*shoal_command(), "subscribe", "--url", dev.url, "--client-id", CLIENT_ID]
    subscribe += ["--filter", "relay/orders/#", "--qos", "1", "--state", str(consumed_state)]
    subscribe += ["--json"]

    # Given a durable subscription made by `shoal subscribe` before anything is published
    done = _run([*subscribe, "--count", "0"], token)
    assert done.returncode == 0, done.stderr

    # When the publisher dies (kill -9) right after the server accepted message 12
    killed = _run(
        _script(dev, "publish", published_state, "--count", str(MESSAGES), "--kill",
                "after:POST:/v1/messages:12"),
        token,
    )  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert [r["publisher_seq"] for r in _lines(killed.stdout)] == list(range(1, 12))
    # and `shoal publish` sends message 12 again from the same state
    again = _run(
        [*shoal_command(), "publish", "--url", dev.url, "--topic", TOPIC, "--text", "msg-12",
         "--state", str(published_state)],
        token,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    (result,) = _lines(again.stdout)
    # Then it carries the same seq, and the server recognises it
    assert (result["publisher_seq"], result["duplicate"]) == (12, True)

    # When a publisher is killed from outside at whatever point it reached
    publisher = subprocess.Popen(
        _script(dev, "publish", published_state, "--count", str(MESSAGES), "--pause-s", "0.05"),
        cwd=ROOT, env=_env(token), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert publisher.stdout is not None
    before_kill = [json.loads(publisher.stdout.readline()) for _ in range(4)]
    publisher.send_signal(signal.SIGKILL)
    rest, _ = publisher.communicate(timeout=RUN_TIMEOUT_S)
    assert publisher.returncode == -signal.SIGKILL
    # and a last one finishes the job
    last = _run(_script(dev, "publish", published_state, "--count", str(MESSAGES)), token)
    assert last.returncode == 0, last.stderr
    seqs = [r["publisher_seq"] for r in [*before_kill, *_lines(rest), *_lines(last.stdout)]]
    assert seqs[0] == 13 and seqs[-1] == MESSAGES
    assert set(seqs) == set(range(13, MESSAGES + 1))

    # When the consumer dies after processing a second batch, before it could ack it
    first = _run(_script(dev, "consume", consumed_state, "--kill", "before:POST:/acks:2"), token)
    assert first.returncode == -signal.SIGKILL, first.stderr
    # and a restarted one dies as soon as the answer to its third fetch arrived
    second = _run(_script(dev, "consume", consumed_state, "--kill", "after:GET:/messages:3"), token)
    assert second.returncode == -signal.SIGKILL, second.stderr
    printed = _lines(first.stdout) + _lines(second.stdout)
    assert printed, "the killed consumers processed nothing"
    # and `shoal subscribe` consumes what is left
    left = MESSAGES - len(printed)
    final = _run([*subscribe, "--count", str(left), "--wait-ms", "2000"], token)
    assert final.returncode == 0, final.stderr
    printed += _lines(final.stdout)

    # Then every message was processed exactly once, in publish order
    assert [m["text"] for m in printed] == [f"msg-{n}" for n in range(1, MESSAGES + 1)]
    assert len({m["id"] for m in printed}) == MESSAGES
    # and the messages fetched but never processed by the killed consumer came again as dup
    assert any(m["dup"] for m in _lines(final.stdout))
    # and the consumer's state file remembers every processed id
    (scope,) = json.loads(consumed_state.read_text())["scopes"].values()
    assert len(scope["sessions"][CLIENT_ID]["delivered"]) == MESSAGES


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))


FIRST_TOKEN_TTL_S = 45


#: runs a command with Ctrl-C as from a terminal, whatever this runner's own disposition: a
#: suite run as a background job of a shell ignores SIGINT and its children inherit that
#: (POSIX), so `shoal subscribe` never saw the signal and this test waited out its limit
WITH_CTRL_C = [
    sys.executable,
    "-c",
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execvp(sys.argv[1], sys.argv[1:])",
]


def test_a_subscriber_outlives_a_server_restart_and_its_token(
    dev: DevServer, tmp_path: Path
) -> None:
    # Given `shoal subscribe` reading its token from a file, the token valid for 45 s (15 s ran
    # out on CI's machine before `shoal subscribe` had started: the other tokens are minted
    # first, as each `shoal token` takes seconds there)
    publisher = dev.token("pub", publish=["lives/#"])
    admin = dev.token("ops", admin=True)
    token_file = tmp_path / "token"
    token_file.write_text(
        dev.token("lives", clients=["lives-*"], subscribe=["lives/#"], ttl_s=FIRST_TOKEN_TTL_S)
    )
    minted = time.monotonic()  # after the token was made: it expires before minted + its ttl
    command = [*shoal_command(), "subscribe", "--url", dev.url, "--token-file", str(token_file)]
    command += ["-i", "lives-1", "-t", "lives/#", "--wait-ms", "1000", "--retries", "1"]
    command += ["--state", str(tmp_path / "sub.json")]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_ENDPOINT", "SHOAL_"))}
    subscriber = subprocess.Popen(
        [*WITH_CTRL_C, *command], cwd=ROOT, env=env | {"PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(
        target=lambda: lines.extend(iter(subscriber.stdout.readline, "")),  # type: ignore[union-attr]
        daemon=True,
    )
    reader.start()

    def publish(text: str) -> None:
        status, body = dev.request(
            "POST", "/v1/messages", token=publisher, json={"topic": "lives/a", "text": text}
        )
        assert status == 201, body

    def wait_for(count: int) -> None:
        deadline = time.monotonic() + 90
        while len(lines) < count and time.monotonic() < deadline and subscriber.poll() is None:
            time.sleep(0.2)

    try:
        # (subscribed once the session holds the subscription)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            status, body = dev.request("GET", "/v1/sessions/lives-1", token=admin)
            if status == 200 and body.get("subscriptions"):
                break
            time.sleep(0.2)
        publish("m1")
        wait_for(1)
        # When whatever rotates the file writes a fresh token, shoal dev dies (kill -9) and
        # starts again on its state, and the first token has expired by then
        token_file.write_text(
            dev.token("lives", clients=["lives-*"], subscribe=["lives/#"], ttl_s=3600)
        )
        dev.restart(kill=True)
        time.sleep(max(0.0, minted + FIRST_TOKEN_TTL_S + 1 - time.monotonic()))
        publish("m2")
        publish("m3")
        wait_for(3)
        # Then the subscriber is still running, printed every message once, and said in one
        # line that it lost the server and in one that it had it back
        assert subscriber.poll() is None, subscriber.stderr.read()  # type: ignore[union-attr]
        assert [line.strip() for line in lines] == ["m1", "m2", "m3"]
    finally:
        subscriber.send_signal(signal.SIGINT)
        # its clean disconnect is a call to shoal dev
        status = subscriber.wait(30)
        err = subscriber.stderr.read()  # type: ignore[union-attr]
    assert "shoal: lost " in err and " answers again; " in err, err
    # And Ctrl-C ended it with 130 (after a clean disconnect)
    assert status == 130, err
