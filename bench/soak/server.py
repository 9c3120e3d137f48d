"""The soak's ``shoal dev``: one process on a persistent state directory, killed with -9 and
started again on the same state and ports; its tokens; and what ``/proc`` says of it.

The same start and wait as ``tests/e2e/conftest.py``'s ``DevServer`` (the bench cannot import
the tests' fixtures), with the soak's options: the reaper every ``REAPER_S`` seconds (wills
and keep-alives are judged against it) and ``SHOAL_DEV_THROTTLE`` passed through when set.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shoal.cli.dev import port_free

from bench.delivery import _shoal

ROOT = Path(__file__).resolve().parents[2]
#: a restart replays the whole journal (about 2.6 ms a request here, 40-70 requests a second
#: under the soak): minutes after a long run, and the soak records it rather than give up
START_TIMEOUT_S = 3600.0
STOP_TIMEOUT_S = 30.0
#: the reaper's period under the soak (deployed: a minute; keep-alives and wills wait on it)
REAPER_S = 2
#: the runtime's throttle (issue 47: the lead's fault injection of ``@connections`` posts and
#: DynamoDB calls); passed through as it is, never interpreted here
THROTTLE_ENV = "SHOAL_DEV_THROTTLE"
#: prctl(2)'s option: the signal a child gets when its parent dies
PR_SET_PDEATHSIG = 1


def _libc() -> Any:
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None


#: loaded here, in the parent: a child between fork and exec only calls into it
LIBC = _libc()


def die_with_parent() -> None:
    """In a child before it runs: killed when the soak's process dies (Linux's
    PR_SET_PDEATHSIG), so a driver killed mid-run leaves no server or client behind."""
    if LIBC is not None:
        with contextlib.suppress(OSError, AttributeError):
            LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def child_environment(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    for key in [k for k in env if k.startswith("AWS_ENDPOINT_URL")]:
        del env[key]
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("POWERTOOLS_LOG_LEVEL", "WARNING")
    env |= dict(extra or {})
    return env


#: a start that finds one of its ports taken tries again this often, this far apart
PORT_TAKEN_ATTEMPTS = 60
PORT_TAKEN_WAIT_S = 2.0

#: where ``steady_ports`` looks, up to the kernel's ephemeral range
STEADY_PORTS_FROM = 10_000


def ephemeral_low(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> int:
    """The lowest port the kernel hands out to outgoing connections (Linux's default 32,768)."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def steady_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` free ports below the kernel's ephemeral range, for a server restarted on the
    same ports. A port chosen by binding port 0 comes from that range, and while the server is
    down the kernel may give it to an outgoing connection of a client as its own end: the
    restart then cannot bind it (a 30-minute soak ended at its fifth kill with "--aws-port 41991
    is in use"). Below the range, only a server that binds it can hold it."""
    rng = random.Random()  # a spread of ports, not a secret
    low = ephemeral_low()
    ports: list[int] = []
    while len(ports) < count:
        port = rng.randrange(STEADY_PORTS_FROM, low)
        if port not in ports and port_free(host, port):
            ports.append(port)
    return ports


class DevProcess:
    """``shoal dev`` on ``state_dir``: started, killed, started again on the same ports."""

    def __init__(
        self,
        state_dir: Path,
        *,
        default_partitions: int = 2,
        env: Mapping[str, str] | None = None,
        log_path: Path | None = None,
    ) -> None:
        self.state_dir = state_dir
        self.default_partitions = default_partitions
        self.env = dict(env or {})
        self.log_path = log_path or state_dir.parent / "shoal-dev.log"
        self.port = 0
        self.aws_port = 0
        self.ws_port = 0
        self.url = ""
        self.ws_url = ""
        self.issuer = ""
        self.process: subprocess.Popen[bytes] | None = None
        #: seconds each start took until healthy, and the journal's replay time it printed
        self.starts: list[dict[str, float]] = []

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def start(self) -> float:
        """Start and wait until healthy; the seconds it took."""
        if not self.port:
            self.port, self.aws_port, self.ws_port = steady_ports(3)
        args = [
            *_shoal(),
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
            "--schedule",
            f"reaper={REAPER_S}",
            "--log-level",
            "WARNING",
        ]
        began = time.monotonic()
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        for attempt in range(PORT_TAKEN_ATTEMPTS):
            tried_at = self.log_path.stat().st_size if self.log_path.exists() else 0
            with open(self.log_path, "ab") as log:
                self.process = subprocess.Popen(
                    args,
                    cwd=ROOT,
                    env=child_environment(self.env),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    preexec_fn=die_with_parent,  # noqa: PLW1509 - no threads touch it meanwhile
                )
            try:
                self._wait_until_ready()
                break
            except RuntimeError:
                # another program bound one of its ports while it was down (below the
                # ephemeral range only a server does: a test's shoal dev beside the run, which
                # the 2-hour soak met at its 5th kill). Its clients know these ports, so it
                # waits for them rather than moving
                if attempt == PORT_TAKEN_ATTEMPTS - 1 or not self._port_taken(tried_at):
                    raise
                time.sleep(PORT_TAKEN_WAIT_S)
        took = time.monotonic() - began
        self.starts.append({"start_s": round(took, 2), **self._replay(offset)})
        return took

    def _port_taken(self, offset: int) -> bool:
        """Whether the start that logged from ``offset`` on stopped on a port in use."""
        try:
            with self.log_path.open("rb") as handle:
                handle.seek(offset)
                return b"is in use" in handle.read()
        except OSError:
            return False

    def _replay(self, offset: int) -> dict[str, float]:
        try:
            with self.log_path.open("rb") as handle:
                handle.seek(offset)
                text = handle.read().decode(errors="replace")
        except OSError:
            return {}
        found = re.search(r"journal:\s+(\d+) requests replayed in ([\d.]+) s", text)
        if found is None:
            return {}
        return {"replayed": float(found.group(1)), "replay_s": float(found.group(2))}

    def _wait_until_ready(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        runtime_file = self.state_dir / "runtime.json"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"shoal dev exited with {self.process.returncode}")
            info = _read_json(runtime_file)
            if info and info.get("pid") == self.process.pid:
                self.url, self.issuer = info["url"], info["issuer"]
                self.port = int(self.url.rsplit(":", 1)[1])
                self.aws_port = int(str(info["aws_url"]).rsplit(":", 1)[1])
                self.ws_url = info["ws_url"]
                self.ws_port = int(self.ws_url.rsplit(":", 1)[1])
                if self.healthy():
                    return
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"shoal dev did not become healthy in {START_TIMEOUT_S} s")

    def healthy(self) -> bool:
        try:
            status, _ = request(self.url, "GET", "/v1/health", timeout=5)
        except OSError:
            return False
        return status == 200

    def kill(self) -> None:
        """kill -9: no shutdown code runs."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(STOP_TIMEOUT_S)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()

    def mint(self, sub: str, *, ttl_s: int, admin: bool = False) -> str:
        """A token signed with the state directory's key (as ``shoal token``), in-process: the
        soak mints many (every rotation of a short-lived token) and a CLI start costs seconds."""
        from shoal.local.authorizer import IssuerSettings, SigningKey, mint_token

        settings = IssuerSettings.load(self.state_dir)
        assert settings is not None, "shoal dev has not started on this state directory"
        return mint_token(
            SigningKey.load_or_create(self.state_dir),
            issuer=settings.issuer,
            audience=settings.audience,
            sub=sub,
            admin=admin,
            clients=None if admin else [f"{sub}-*"],
            publish=() if admin else ["#"],
            subscribe=() if admin else ["#"],
            ttl_s=ttl_s,
        )


def request(
    url: str,
    method: str,
    path: str,
    *,
    token: str | None = None,
    body: Any = None,
    timeout: float = 30,
) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = json.dumps(body).encode() if body is not None else None
    # loopback http only: the URL is shoal dev's own
    call = urllib.request.Request(url + path, data=data, method=method, headers=headers)  # noqa: S310
    try:
        with urllib.request.urlopen(call, timeout=timeout) as response:  # noqa: S310
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as error:
        status, raw = error.code, error.read()
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, raw


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data


# -- what /proc says ----------------------------------------------------------------------------


def process_tree(pid: int) -> list[int]:
    found, pending = [], [pid]
    while pending:
        p = pending.pop()
        found.append(p)
        try:
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        pending.extend(int(c) for c in children)
    return found


#: /proc's CPU times are in clock ticks, this many a second
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def resources(pid: int) -> dict[str, float] | None:
    """Resident memory (KB), open files, threads and CPU seconds used so far (``cpu_s``) of
    ``pid`` and its descendants; None once it is gone."""
    rss = fds = threads = ticks = 0
    seen = False
    for p in process_tree(pid):
        try:
            status = Path(f"/proc/{p}/status").read_text().splitlines()
            stat = Path(f"/proc/{p}/stat").read_text()
            fds += len(os.listdir(f"/proc/{p}/fd"))
        except OSError:
            continue
        seen = True
        for line in status:
            if line.startswith("VmRSS:"):
                rss += int(line.split()[1])
            elif line.startswith("Threads:"):
                threads += int(line.split()[1])
        # the command name (field 2, in parentheses) may hold spaces and parentheses: the
        # fields are counted from after its last ')', where field 3 is
        fields = stat[stat.rindex(")") + 1 :].split()
        # utime and stime (fields 14, 15), and cutime and cstime (16, 17): the ticks of its
        # children once waited for (a snapshot's forked child), which otherwise leave the
        # tree's total as the child ends
        ticks += sum(int(field) for field in fields[11:15])
    if not seen:
        return None
    return {"rss_kb": rss, "fds": fds, "threads": threads, "cpu_s": round(ticks / CLOCK_TICKS, 2)}


#: a fresh process that starts the emulator on a state directory (its snapshot, then the
#: journal after it) and answers its resident memory once it is up (``state_rss_kb``)
_STATE_RSS = """
import gc, json, pathlib, sys
from shoal.local.aws import EmbeddedAws
aws = EmbeddedAws(host="127.0.0.1", port=0, state_dir=pathlib.Path(sys.argv[1]))
aws.start()
gc.collect()
rss = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS:"))
aws.stop()
print(json.dumps({"rss_kb": rss}))
"""


def state_rss_kb(state_dir: Path, env: Mapping[str, str] | None = None) -> int | None:
    """The resident memory (KB) of a fresh process holding what ``state_dir`` holds (a copy
    of it: a start may write a snapshot), or None when it could not say. ``shoal dev`` keeps
    every record, item and object in memory, so its memory grows with what a run writes; set
    beside the server's own at the same point, this says how much of that memory is the
    data and how much is not (a leak)."""
    from shoal.local.aws import JOURNAL_FILE
    from shoal.local.snapshot import SNAPSHOT_FILE

    with tempfile.TemporaryDirectory(dir=state_dir.parent) as tmp:
        copy = Path(tmp) / "state"
        copy.mkdir(mode=0o700)
        for name in (JOURNAL_FILE, SNAPSHOT_FILE):
            if (state_dir / name).exists():
                shutil.copy2(state_dir / name, copy / name)
        try:
            done = subprocess.run(
                [sys.executable, "-c", _STATE_RSS, str(copy)],
                cwd=ROOT,
                env=child_environment(env),
                capture_output=True,
                timeout=900,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return None
    if done.returncode != 0 or not done.stdout.strip():
        return None
    return int(json.loads(done.stdout.splitlines()[-1])["rss_kb"])
