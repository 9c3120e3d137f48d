"""End-to-end fixtures: a real ``shoal dev`` process, driven over HTTP.

``dev`` starts ``shoal dev`` on a free loopback port with a fresh ``--state-dir`` and waits
until ``GET /v1/health`` answers. Use it like this::

    @pytest.mark.e2e
    def test_admin_creates_a_topic(dev: DevServer) -> None:
        admin = dev.token("ops", admin=True)
        status, body = dev.request("POST", "/v1/topics", token=admin, json={"name": "orders"})
        assert status == 201
        kinesis = dev.aws().client("kinesis")        # the emulated account, directly
        dev.restart(kill=True)                        # kill -9, start again on the same state

``dev_factory(**options)`` starts one with other options (``default_partitions=4``,
``extra_args=[...]``, ``env={"SHOAL_ACK_TIMEOUT_S": "2"}``); every server it started is
stopped after the test. ``shared_dev`` is
one server per test process, for tests that neither stop it nor need a fresh account;
``own_dev`` one per module.
"""

from __future__ import annotations

import json as jsonlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import boto3
import pytest
from shoal.local.aws import EndpointSession

from bench.soak.server import steady_ports

ROOT = Path(__file__).resolve().parents[2]
#: a start took 60-110 s on CI's machine with the suite beside it, once over 90 s
START_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 30.0


def shoal_command() -> list[str]:
    """The installed ``shoal`` entry point of this interpreter's environment."""
    script = Path(sys.executable).with_name("shoal")
    return [str(script)] if script.exists() else [sys.executable, "-m", "shoal.cli"]


def _child_environment() -> dict[str, str]:
    env = dict(os.environ)
    # the test process's fake-AWS settings are fine; an endpoint of its own is not
    for key in [k for k in env if k.startswith("AWS_ENDPOINT_URL")]:
        del env[key]
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("POWERTOOLS_LOG_LEVEL", "WARNING")
    return env


class DevServer:
    """One ``shoal dev`` process on a state directory; restartable on the same ports."""

    def __init__(
        self,
        state_dir: Path,
        *,
        default_partitions: int = 1,
        extra_args: Iterable[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.state_dir = state_dir
        self.default_partitions = default_partitions
        self.extra_args = list(extra_args)
        #: more environment for the server process (e.g. SHOAL_ACK_TIMEOUT_S)
        self.env = dict(env or {})
        self.log_path = state_dir.parent / f"{state_dir.name}.log"
        self.port = 0
        self.aws_port = 0
        self.ws_port = 0
        self.url = ""
        #: the WebSocket API (``ws://127.0.0.1:PORT``)
        self.ws_url = ""
        self.aws_url = ""
        self.issuer = ""
        self.process: subprocess.Popen[bytes] | None = None

    # -- lifecycle --

    def start(self) -> None:
        """Start ``shoal dev`` (on the ports of the previous run, if any) and wait for health."""
        if not self.port:
            # below the ephemeral range: a restart finds them free (``steady_ports``)
            self.port, self.aws_port, self.ws_port = steady_ports(3)
        args = [
            *shoal_command(),
            "dev",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--aws-port",
            str(self.aws_port),
            "--ws-port",
            str(self.ws_port),
            "--state-dir",
            str(self.state_dir),
            "--default-partitions",
            str(self.default_partitions),
            *self.extra_args,
        ]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                args,
                cwd=ROOT,
                env=_child_environment() | self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self._wait_until_ready()

    def _wait_until_ready(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        runtime_file = self.state_dir / "runtime.json"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"shoal dev exited with {self.process.returncode}:\n{self.log()}"
                )
            info = _read_json(runtime_file)
            if info and info.get("pid") == self.process.pid:
                self.url, self.aws_url, self.issuer = info["url"], info["aws_url"], info["issuer"]
                self.port = int(self.url.rsplit(":", 1)[1])
                self.aws_port = int(self.aws_url.rsplit(":", 1)[1])
                self.ws_url = info["ws_url"]
                self.ws_port = int(self.ws_url.rsplit(":", 1)[1])
                if self._healthy():
                    return
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(
            f"shoal dev did not become healthy in {START_TIMEOUT_S} s:\n{self.log()}"
        )

    def _healthy(self) -> bool:
        try:
            status, _ = self.request("GET", "/v1/health", timeout=5)
        except OSError:
            return False
        return status == 200

    def kill(self) -> None:
        """kill -9: no shutdown code runs."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(STOP_TIMEOUT_S)

    def terminate(self) -> int:
        """SIGTERM, and the exit status once the process has stopped."""
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(STOP_TIMEOUT_S)

    def restart(self, kill: bool = True) -> None:
        """Stop (kill -9 by default, else SIGTERM) and start again on the same state and ports."""
        if kill:
            self.kill()
        else:
            self.terminate()
        self.start()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    # -- talking to it --

    def token(
        self,
        sub: str = "tester",
        *,
        admin: bool = False,
        clients: Iterable[str] | None = None,
        publish: Iterable[str] = (),
        subscribe: Iterable[str] = (),
        ttl_s: int = 3600,
    ) -> str:
        """A token from ``shoal token`` for this server's issuer (clients default to ``sub``)."""
        args = [*shoal_command(), "token", "--sub", sub, "--state-dir", str(self.state_dir)]
        args += ["--ttl-s", str(ttl_s)]
        if admin:
            args.append("--admin")
        for flag, values in (
            ("--clients", clients),
            ("--publish", publish),
            ("--subscribe", subscribe),
        ):
            items = list(values or ())
            if items:
                args += [flag, *items]
        done = subprocess.run(
            args, cwd=ROOT, env=_child_environment(), capture_output=True, check=True, timeout=60
        )
        return done.stdout.decode().strip().splitlines()[-1]

    def request(
        self,
        method: str,
        path: str,
        *,
        token: str | None = None,
        json: Any = None,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout: float = 30,
    ) -> tuple[int, Any]:
        """One HTTP request; the body comes back parsed as JSON when it is JSON, else bytes."""
        all_headers = dict(headers or {})
        data = body
        if json is not None:
            data = jsonlib.dumps(json).encode()
            all_headers.setdefault("Content-Type", "application/json")
        if token is not None:
            all_headers["Authorization"] = f"Bearer {token}"
        request = urllib.request.Request(
            self.url + path, data=data, method=method, headers=all_headers
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                status, raw = response.status, response.read()
        except urllib.error.HTTPError as error:
            status, raw = error.code, error.read()
        try:
            return status, jsonlib.loads(raw) if raw else None
        except ValueError:
            return status, raw

    def aws(self) -> boto3.Session:
        """A boto3 session whose clients talk to this server's emulated account."""
        return EndpointSession(self.aws_url)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = jsonlib.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data


def connection_ids(dev: DevServer, client_id: str) -> list[str]:
    """The WebSocket connections that hold ``client_id``'s session (the connections table)."""
    dynamo = dev.aws().client("dynamodb")
    (table,) = [t for t in dynamo.list_tables()["TableNames"] if t.endswith("-connections")]
    items = dynamo.scan(TableName=table)["Items"]
    return [
        i["key"]["S"].removeprefix("conn#")
        for i in items
        if i["key"]["S"].startswith("conn#") and i.get("client_id", {}).get("S") == client_id
    ]


DevFactory = Callable[..., DevServer]


@contextmanager
def dev_servers(directory: Path) -> Iterator[DevFactory]:
    """Starts ``shoal dev`` processes under ``directory``; all are stopped when it ends (for a
    fixture of a module's own, with options ``own_dev`` does not take)."""
    with _servers(directory) as start:
        yield start


@contextmanager
def _servers(directory: Path) -> Iterator[DevFactory]:
    servers: list[DevServer] = []

    def start(
        *,
        default_partitions: int = 1,
        extra_args: Iterable[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> DevServer:
        server = DevServer(
            directory / f"state-{len(servers)}",
            default_partitions=default_partitions,
            extra_args=extra_args,
            env=env,
        )
        servers.append(server)
        server.start()
        return server

    try:
        yield start
    finally:
        for server in servers:
            if server.process is not None and server.process.poll() is None:
                try:
                    server.terminate()
                except subprocess.TimeoutExpired:
                    server.kill()


@pytest.fixture
def dev_factory(tmp_path: Path) -> Iterator[DevFactory]:
    """Starts ``shoal dev`` processes with options; all are stopped after the test."""
    with _servers(tmp_path) as start:
        yield start


@pytest.fixture
def dev(dev_factory: DevFactory) -> DevServer:
    """A fresh ``shoal dev`` on its own state directory, healthy; free to kill or restart."""
    return dev_factory()


@pytest.fixture(scope="session")
def shared_dev(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevServer]:
    """One ``shoal dev`` for every module of a test process (a start took 60 to 110 s on CI's
    machine, and seven modules used to start one each).

    Tests that use it see each other's state, across modules: use names of the module's own
    (``fd-``, ``cli``, ``wsa``), never assert on what the whole account holds, never stop it.
    """
    with _servers(tmp_path_factory.mktemp("shared-dev")) as start:
        yield start()


@pytest.fixture(scope="module")
def own_dev(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevServer]:
    """One ``shoal dev`` for this module alone: for a module whose tests change what others
    would see (the fuzzer creates topics of many shards and sessions subscribed to ``#``)."""
    with _servers(tmp_path_factory.mktemp("own-dev")) as start:
        yield start()
