"""The front door: a real ``shoal dev`` process driven over HTTP by concurrent clients.

Two measurements, each against ``shoal dev`` processes this module starts on fresh state
directories under a temporary folder:

1. Concurrency. For each N of 8, 32, 64 and 128: N client threads, each with its own
   keep-alive connection (``http.client``), released together by a barrier. Each connects a
   session (``PUT /v1/sessions/c-N-i``, clean start), subscribes to a topic of its own (its
   own first level, ``fd-N-i/in``: subscriptions are stored in one bucket per first level, and
   concurrent subscribes into one bucket contend on its version, which is not what this
   measures), then does ``ROUNDS`` rounds of publish (``POST /v1/messages``), get
   (``GET .../messages?max=10``) and ack (``POST .../acks``, with the ids the get answered,
   possibly none). Per request: the latency, the status; connection resets, disconnects and
   timeouts are counted apart (the client then reconnects and goes on with its next request).
   Before measuring, clients ramp up (``WARM_UP``) so cold starts are not measured.
2. Crash to first answered retry. ``SHOAL_CRASH_AT=publish:<step>`` makes the process exit
   with 137 (as under kill -9) at that step of an exactly-once publish. The publish is sent,
   the connection drops; ``shoal dev`` is started again on the same state and ports (without
   the variable) while the client retries as a client would (503: sleep Retry-After seconds,
   else 0.5 s; connection refused or dropped: 0.2 s) until it is answered 2xx. Then the
   storage streams are read through the emulator: the message must be in exactly one record.

``shoal dev`` serializes every call into its AWS emulator with one lock, and the background
functions (router, deliveries) triggered by the publishes take the same lock: throughput is
the emulator's, and the server shares the machine's cores with the client threads.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.delivery import _shoal

ROOT = Path(__file__).resolve().parent.parent
CONCURRENCY = (8, 32, 64, 128)
#: publish + get + ack rounds per client, after its connect and subscribe
ROUNDS = 3
PARTITIONS = 1
#: before measuring, clients ramp up like this (one round each), so that every function has
#: several execution environments (``shoal dev`` makes up to 8 a function): cold starts are
#: not measured
WARM_UP = (8, 32)
#: http.client timeout of every request of the concurrency runs (API Gateway's own is 30 s)
REQUEST_TIMEOUT_S = 60.0
WARM_UP_TIMEOUT_S = 120.0
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0
#: give up retrying the crashed publish after this long
RETRY_DEADLINE_S = 120.0
#: the issue's target for a retry after a crash to be answered
CRASH_TARGET_S = 15.0
CRASH_STEPS = ("after_reserve", "after_put")
COMMAND = "python -m bench frontdoor"


def _environment(extra: dict[str, str]) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("AWS_ENDPOINT_URL") and k != "SHOAL_CRASH_AT"
    }
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("POWERTOOLS_LOG_LEVEL", "WARNING")
    return env | extra


class _Dev:
    """One ``shoal dev`` process on a state directory, restartable on the same ports."""

    def __init__(self, state_dir: Path, env: dict[str, str] | None = None) -> None:
        self.state_dir = state_dir
        self.env = dict(env or {})
        self.log_path = state_dir.parent / f"{state_dir.name}.log"
        self.port = 0
        self.aws_port = 0
        self.aws_url = ""
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> float:
        """Start it and wait until it is healthy; the seconds that took."""
        started = time.monotonic()
        args = [
            *_shoal(),
            "dev",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--aws-port",
            str(self.aws_port),
            "--state-dir",
            str(self.state_dir),
            "--default-partitions",
            str(PARTITIONS),
        ]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                args, cwd=ROOT, env=_environment(self.env), stdout=log, stderr=subprocess.STDOUT
            )
        runtime = self.state_dir / "runtime.json"
        while time.monotonic() - started < START_TIMEOUT_S:
            if self.process.poll() is not None:
                raise RuntimeError(f"shoal dev exited with {self.process.returncode}")
            info = _read_json(runtime)
            if info and info.get("pid") == self.process.pid:
                self.port = int(info["url"].rsplit(":", 1)[1])
                self.aws_url = info["aws_url"]
                self.aws_port = int(self.aws_url.rsplit(":", 1)[1])
                if self._healthy():
                    return time.monotonic() - started
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"shoal dev did not become healthy in {START_TIMEOUT_S} s")

    def _healthy(self) -> bool:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        try:
            connection.request("GET", "/v1/health")
            return connection.getresponse().status == 200
        except (OSError, http.client.HTTPException):
            return False
        finally:
            connection.close()

    def stop(self) -> None:
        """SIGTERM, then kill -9 if it does not stop in time."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(STOP_TIMEOUT_S)

    def token(self, sub: str) -> str:
        args = [*_shoal(), "token", "--state-dir", str(self.state_dir), "--sub", sub, "--admin"]
        args += ["--clients", "c-*", "--publish", "#", "--subscribe", "#"]
        done = subprocess.run(
            args, cwd=ROOT, env=_environment({}), capture_output=True, check=True, timeout=60
        )
        return done.stdout.decode().strip().splitlines()[-1]

    def log_summary(self) -> dict[str, Any]:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return _log_summary(text)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data


_PLAIN = re.compile(r"^\S+ \S+ (DEBUG|INFO|WARNING|ERROR|CRITICAL) (\S+): (.*)$")
_GATEWAY = re.compile(r"^(\S+) (\S+) (\d{3}) ([\d.]+)ms$")


def _log_summary(text: str) -> dict[str, Any]:
    """Lines by level, tracebacks, gateway answers by status, and a few warning/error lines."""
    levels: Counter[str] = Counter()
    gateway: Counter[str] = Counter()
    samples: Counter[str] = Counter()
    slowest_ms = 0.0
    for line in text.splitlines():
        level = message = ""
        if line.startswith("{"):
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if isinstance(record, dict):
                level = str(record.get("level", ""))
                message = str(record.get("message", ""))
                # shoal dev's gateway: one JSON line per request, with its status and ms
                if str(record.get("logger", "")).endswith("gateway") and "status" in record:
                    gateway[str(record["status"])] += 1
                    slowest_ms = max(slowest_ms, float(record.get("ms", 0.0)))
        elif match := _PLAIN.match(line):
            level, logger, message = match.groups()
            answer = _GATEWAY.match(message) if logger.endswith("gateway") else None
            if answer:
                gateway[answer.group(3)] += 1
                slowest_ms = max(slowest_ms, float(answer.group(4)))
        if level:
            levels[level] += 1
            if level in {"WARNING", "ERROR", "CRITICAL"}:
                samples[f"{level} {message[:160]}"] += 1
    return {
        "lines": len(text.splitlines()),
        "levels": dict(levels),
        "tracebacks": text.count("Traceback (most recent call last)"),
        "gateway_statuses": dict(gateway),
        "gateway_slowest_ms": round(slowest_ms, 1),
        "warnings_and_errors": dict(samples.most_common(8)),
    }


# -- 1. concurrency --------------------------------------------------------------------------


@dataclass
class _Tally:
    """One client thread's record; merged after the run."""

    latencies_ms: dict[str, list[float]] = field(default_factory=dict)
    statuses: Counter[int] = field(default_factory=Counter)
    #: answers with a 5xx status, by request kind
    failed: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    closed_by_server: int = 0
    received: int = 0
    acked: int = 0
    aborted: int = 0


class _Client:
    """One client: its own keep-alive connection, reopened after a reset."""

    def __init__(self, port: int, token: str, tally: _Tally, timeout: float) -> None:
        self.connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        self.token = token
        self.tally = tally

    def open(self) -> None:
        try:
            self.connection.connect()
        except OSError as exc:
            self.tally.errors[type(exc).__name__] += 1
            self.connection.close()

    def call(
        self,
        kind: str,
        method: str,
        path: str,
        body: Any = None,
        channel: str | None = None,
    ) -> tuple[int, Any] | None:
        """The status and parsed body, or None when the connection failed (counted)."""
        headers = {"Authorization": f"Bearer {self.token}"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if channel is not None:
            headers["Shoal-Channel"] = channel
        started = time.perf_counter()
        try:
            self.connection.request(method, path, body=data, headers=headers)
            response = self.connection.getresponse()
            raw = response.read()
        except (OSError, http.client.HTTPException) as exc:
            self.tally.errors[type(exc).__name__] += 1
            self.connection.close()  # the next request opens a new connection
            return None
        latency_ms = (time.perf_counter() - started) * 1000
        self.tally.latencies_ms.setdefault(kind, []).append(latency_ms)
        self.tally.statuses[response.status] += 1
        if response.status >= 500:
            self.tally.failed[kind] += 1
        if response.will_close:
            self.tally.closed_by_server += 1
        try:
            parsed = json.loads(raw) if raw else None
        except ValueError:
            parsed = None
        return response.status, parsed

    def close(self) -> None:
        self.connection.close()


def _session(client: _Client, client_id: str, topic: str, rounds: int) -> None:
    base = f"/v1/sessions/{client_id}"
    answer = client.call("connect", "PUT", base, {"clean_start": True})
    if answer is None or answer[0] != 200:
        client.tally.aborted += 1
        return
    channel = answer[1]["channel"]
    subscription = {"subscriptions": [{"filter": topic, "qos": 1}]}
    answer = client.call("subscribe", "POST", f"{base}/subscriptions", subscription, channel)
    if answer is None or answer[0] != 200:
        client.tally.aborted += 1
        return
    for n in range(rounds):
        client.call("publish", "POST", "/v1/messages", {"topic": topic, "text": f"m{n}"})
        answer = client.call("get", "GET", f"{base}/messages?max=10", channel=channel)
        ids: list[str] = []
        if answer is not None and answer[0] == 200:
            ids = [m["id"] for m in answer[1]["messages"]]
            client.tally.received += len(ids)
        answer = client.call("ack", "POST", f"{base}/acks", {"ids": ids}, channel)
        if answer is not None and answer[0] == 200:
            client.tally.acked += int(answer[1]["acked"])


def _percentile(ordered: list[float], q: float) -> float:
    if not ordered:
        return 0.0
    return round(ordered[min(len(ordered) - 1, int(len(ordered) * q))], 1)


def _level(
    server: _Dev,
    token: str,
    clients: int,
    rounds: int,
    *,
    name: str = "",
    timeout: float = REQUEST_TIMEOUT_S,
) -> dict[str, Any]:
    tallies = [_Tally() for _ in range(clients)]
    barrier = threading.Barrier(clients + 1)
    name = name or str(clients)

    def work(i: int) -> None:
        client = _Client(server.port, token, tallies[i], timeout)
        client.open()
        try:
            barrier.wait()
            _session(client, f"c-{name}-{i}", f"fd-{name}-{i}/in", rounds)
        finally:
            client.close()

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    load_before = os.getloadavg()[0]
    barrier.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    load_after = os.getloadavg()[0]

    statuses: Counter[int] = Counter()
    errors: Counter[str] = Counter()
    failed: Counter[str] = Counter()
    by_kind: dict[str, list[float]] = {}
    for tally in tallies:
        statuses.update(tally.statuses)
        errors.update(tally.errors)
        failed.update(tally.failed)
        for kind, values in tally.latencies_ms.items():
            by_kind.setdefault(kind, []).extend(values)
    latencies = sorted(v for values in by_kind.values() for v in values)
    answered = len(latencies)
    return {
        "clients": clients,
        "rounds": rounds,
        "requests": answered,
        "seconds": round(elapsed, 2),
        "requests_per_s": round(answered / elapsed, 1),
        "latency_ms": {
            "p50": round(statistics.median(latencies), 1) if latencies else 0.0,
            "p99": _percentile(latencies, 0.99),
            "max": round(latencies[-1], 1) if latencies else 0.0,
        },
        "latency_ms_by_request": {
            kind: {
                "requests": len(values),
                "p50": round(statistics.median(values), 1),
                "p99": _percentile(sorted(values), 0.99),
                "5xx": failed[kind],
            }
            for kind, values in by_kind.items()
        },
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "status_5xx": sum(v for k, v in statuses.items() if k >= 500),
        "resets_and_errors": sum(errors.values()),
        "errors": dict(errors),
        "closed_by_server": sum(t.closed_by_server for t in tallies),
        "clients_aborted": sum(t.aborted for t in tallies),
        "messages_received": sum(t.received for t in tallies),
        "messages_acked": sum(t.acked for t in tallies),
        "load_average_1m": {"before": round(load_before, 1), "after": round(load_after, 1)},
    }


def _round_trip(server: _Dev, requests: int = 30) -> dict[str, float]:
    """``GET /v1/health`` one after another on one keep-alive connection: the floor."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=REQUEST_TIMEOUT_S)
    latencies: list[float] = []
    try:
        for _ in range(requests):
            started = time.perf_counter()
            connection.request("GET", "/v1/health")
            connection.getresponse().read()
            latencies.append((time.perf_counter() - started) * 1000)
    finally:
        connection.close()
    latencies.sort()
    return {"p50": round(statistics.median(latencies), 1), "max": round(latencies[-1], 1)}


def _concurrency(workdir: Path, levels: tuple[int, ...], rounds: int) -> dict[str, Any]:
    server = _Dev(workdir / "concurrency")
    try:
        start_s = server.start()
        _round_trip(server, 3)  # the health function's cold start
        round_trip = _round_trip(server)
        token = server.token("bench")
        warm_up = []
        for clients in WARM_UP:
            level = _level(server, token, clients, 1, name=f"w{clients}", timeout=WARM_UP_TIMEOUT_S)
            warm_up.append({k: level[k] for k in _WARM_UP_FIGURES})
        results = []
        for clients in levels:
            time.sleep(2.0)  # let the previous level's deliveries settle
            results.append(_level(server, token, clients, rounds))
    finally:
        server.stop()
    return {
        "start_s": round(start_s, 2),
        "idle_health_round_trip_ms": round_trip,
        "warm_up": warm_up,
        "levels": results,
        "log": server.log_summary(),
    }


_WARM_UP_FIGURES = (
    "clients",
    "requests",
    "seconds",
    "latency_ms",
    "status_5xx",
    "resets_and_errors",
    "load_average_1m",
)


# -- 2. crash to first answered retry --------------------------------------------------------


def _publish_once(port: int, token: str, body: bytes, timeout: float) -> tuple[int, str, Any]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request(
            "POST",
            "/v1/messages",
            body=body,
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        )
        response = connection.getresponse()
        raw = response.read()
    finally:
        connection.close()
    try:
        parsed = json.loads(raw) if raw else None
    except ValueError:
        parsed = raw[:200].decode(errors="replace")
    return response.status, response.getheader("Retry-After") or "", parsed


def _records_containing(aws_url: str, needles: list[bytes]) -> dict[str, int]:
    """How many records of all the emulator's streams contain each needle."""
    from shoal.local.aws import EndpointSession

    kinesis = EndpointSession(aws_url).client("kinesis")
    counts = dict.fromkeys((n.decode() for n in needles), 0)
    records = 0
    for stream in kinesis.list_streams()["StreamNames"]:
        for shard in kinesis.list_shards(StreamName=stream)["Shards"]:
            iterator = kinesis.get_shard_iterator(
                StreamName=stream, ShardId=shard["ShardId"], ShardIteratorType="TRIM_HORIZON"
            )["ShardIterator"]
            while iterator:
                page = kinesis.get_records(ShardIterator=iterator, Limit=10_000)
                for record in page["Records"]:
                    records += 1
                    for needle in needles:
                        counts[needle.decode()] += needle in record["Data"]
                if not page["Records"] and not page.get("MillisBehindLatest"):
                    break
                iterator = page.get("NextShardIterator")
    return {"records_read": records, **counts}


def _crash(workdir: Path, step: str) -> dict[str, Any]:
    server = _Dev(workdir / f"crash-{step}", {"SHOAL_CRASH_AT": f"publish:{step}"})
    try:
        server.start()
        token = server.token("p")
        text = f"crash-{step}-{uuid.uuid4().hex}"
        message = {"topic": "a/b", "text": text, "publisher_id": "p", "publisher_seq": 1}
        body = json.dumps(message).encode()
        try:
            first: str = str(_publish_once(server.port, token, body, 30.0)[:2])
        except (OSError, http.client.HTTPException) as exc:
            first = type(exc).__name__
        crashed_at = time.monotonic()
        assert server.process is not None
        try:
            exit_status: int | None = server.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:  # it did not crash: measure the restart anyway
            server.kill()
            exit_status = None

        server.env = {}
        restart: dict[str, Any] = {}

        def start_again() -> None:
            try:
                restart["seconds"] = server.start()
            except Exception as exc:  # reported; the retry loop gives up at its deadline
                restart["error"] = repr(exc)

        restarter = threading.Thread(target=start_again, daemon=True)
        restarter.start()

        attempts: list[dict[str, Any]] = []
        answer: tuple[int, str, Any] | None = None
        first_answer_s: float | None = None
        while time.monotonic() - crashed_at < RETRY_DEADLINE_S:
            # the restarted server binds the same port: ask it, not an old one
            port = server.port
            sent = _since(crashed_at)
            try:
                status, retry_after, parsed = _publish_once(port, token, body, 30.0)
            except (OSError, http.client.HTTPException) as exc:
                at = _since(crashed_at)
                attempts.append({"sent_s": sent, "at_s": at, "error": type(exc).__name__})
                time.sleep(0.2)
                continue
            at = _since(crashed_at)
            if first_answer_s is None:
                first_answer_s = at
            attempt: dict[str, Any] = {"sent_s": sent, "at_s": at, "status": status}
            if retry_after:
                attempt["retry_after"] = retry_after
            attempts.append(attempt)
            if 200 <= status < 300:
                answer = (status, retry_after, parsed)
                break
            time.sleep(float(retry_after) if status == 503 and retry_after else 0.5)
        answered_s = _since(crashed_at) if answer is not None else None
        restarter.join(START_TIMEOUT_S)

        again: tuple[int, str, Any] | None = None
        exactly_once: dict[str, int] = {}
        if answer is not None:
            again = _publish_once(server.port, token, body, 30.0)
            message_id = str(answer[2]["message_id"])
            exactly_once = _records_containing(server.aws_url, [message_id.encode(), text.encode()])
            exactly_once = {
                "records_read": exactly_once["records_read"],
                "records_with_message_id": exactly_once[message_id],
                "records_with_payload": exactly_once[text],
            }
    finally:
        server.stop()
    errors = Counter(a["error"] for a in attempts if "error" in a)
    statuses = Counter(str(a["status"]) for a in attempts if "status" in a)
    return {
        "step": step,
        "first_publish": first,
        "exit_status": exit_status,
        "restart_s": round(restart["seconds"], 2) if "seconds" in restart else None,
        "restart_error": restart.get("error"),
        "crash_to_first_answer_s": first_answer_s,
        "crash_to_answered_retry_s": answered_s,
        "attempts": len(attempts),
        "attempt_statuses": dict(statuses),
        "attempt_errors": dict(errors),
        "answered_attempts": [a for a in attempts if "status" in a],
        "answer_status": answer[0] if answer else None,
        "answer_duplicate": answer[2].get("duplicate") if answer else None,
        "again_status": again[0] if again else None,
        "again_duplicate": again[2].get("duplicate") if again else None,
        **exactly_once,
        "within_target": answered_s is not None and answered_s <= CRASH_TARGET_S,
        "log": server.log_summary(),
    }


def _since(started: float) -> float:
    return round(time.monotonic() - started, 2)


# -- the benchmark ---------------------------------------------------------------------------


def run(
    levels: tuple[int, ...] = CONCURRENCY, rounds: int = ROUNDS, workdir: Path | None = None
) -> dict[str, Any]:
    """Both measurements; ``workdir`` (kept) instead of a temporary folder (removed)."""
    started = time.monotonic()
    folder = workdir or Path(tempfile.mkdtemp(prefix="shoal-bench-frontdoor-"))
    folder.mkdir(parents=True, exist_ok=True)
    try:
        concurrency = _concurrency(folder, levels, rounds)
        crashes = [_crash(folder, step) for step in CRASH_STEPS]
    finally:
        if workdir is None:
            shutil.rmtree(folder, ignore_errors=True)
    return {
        "name": "frontdoor",
        "command": COMMAND,
        "machine": f"shared, {os.cpu_count()} cores",
        "partitions": PARTITIONS,
        "concurrency": concurrency,
        "crash": crashes,
        "crash_target_s": CRASH_TARGET_S,
        "seconds": round(time.monotonic() - started, 1),
    }


def _log_line(name: str, log: dict[str, Any]) -> str:
    levels = log["levels"]
    noisy = "; ".join(f"{line} (x{n})" for line, n in log["warnings_and_errors"].items())
    return (
        f"- {name}: {log['lines']} lines, {levels.get('WARNING', 0)} warnings, "
        f"{levels.get('ERROR', 0) + levels.get('CRITICAL', 0)} errors, "
        f"{log['tracebacks']} tracebacks; slowest request {log['gateway_slowest_ms']} ms"
        + (f". {noisy}" if noisy else "")
    )


def report(figures: dict[str, Any]) -> str:
    f = figures
    c = f["concurrency"]
    rounds = c["levels"][0]["rounds"] if c["levels"] else ROUNDS
    lines = [
        "## Front door (`shoal dev` over HTTP)",
        "",
        f"Measured with `{f['command']}` on this shared machine ({f['machine']}; the client "
        "threads and the server share them), against one `shoal dev` process on a fresh state "
        f"directory ({f['partitions']} partition a topic; started and healthy in "
        f"{c['start_s']} s). N client threads, each with its own keep-alive connection, start "
        "together; each connects a session (clean start), subscribes to its own topic (a first "
        "level of its own, `fd-N-i/in`: one subscription bucket each), then "
        f"does {rounds} rounds of publish + get (`max=10`) + ack. `shoal dev` serializes every "
        "call into its AWS emulator with one lock (the router and deliveries the publishes "
        "trigger take it too), so the throughput here is the emulator's, not the gateway's "
        "or AWS's; the machine's load average (1 min, other work included) is noted per run. "
        "Resets/errors: connection resets, disconnects and timeouts (client timeout "
        f"{REQUEST_TIMEOUT_S:g} s), counted apart from statuses (must be 0). Whole benchmark: "
        f"{f['seconds']} s.",
        "",
    ]
    if "idle_health_round_trip_ms" in c:
        trip = c["idle_health_round_trip_ms"]
        lines.append(
            "Floor: `GET /v1/health` one after another on one keep-alive connection of the idle "
            f"server, p50 {trip['p50']} ms (max {trip['max']} ms)."
        )
    for w in c.get("warm_up", []):
        lines.append(
            f"Warm-up (not measured below): {w['clients']} clients, one round each, "
            f"{w['requests']} requests in {w['seconds']} s, p50 {w['latency_ms']['p50']} ms, "
            f"p99 {w['latency_ms']['p99']} ms, 5xx {w['status_5xx']}, resets/errors "
            f"{w['resets_and_errors']} (each concurrent call of a function beyond its warm "
            "execution environments is a cold start, up to 8 a function, 64 for get)."
        )
    lines += [
        "",
        "| clients | requests | requests/s | p50 ms | p99 ms | max ms | 5xx "
        "| resets/errors | messages got | acked | load avg |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for level in c["levels"]:
        latency = level["latency_ms"]
        lines.append(
            f"| {level['clients']} | {level['requests']} | {level['requests_per_s']} "
            f"| {latency['p50']} | {latency['p99']} | {latency['max']} | {level['status_5xx']} "
            f"| {level['resets_and_errors']} | {level['messages_received']} "
            f"| {level['messages_acked']} | {level['load_average_1m']['before']} |"
        )
    lines += [
        "",
        "Messages got / acked: what the gets of the run answered; a delivery reaches a session "
        "only after the router and the delivery functions ran (in the background, behind the "
        "same emulator lock), so under many clients the run can end before any arrives.",
        "",
        "p50 / p99 ms by request:",
        "",
    ]
    for level in c["levels"]:
        kinds = ", ".join(
            f"{kind} {v['p50']} / {v['p99']}" + (f" ({v['5xx']} 5xx)" if v.get("5xx") else "")
            for kind, v in level["latency_ms_by_request"].items()
        )
        statuses = ", ".join(f"{k}: {v}" for k, v in level["statuses"].items())
        errors = ", ".join(f"{k}: {v}" for k, v in level["errors"].items())
        lines.append(
            f"- {level['clients']} clients: {kinds} (statuses {statuses}"
            + (f"; errors {errors}" if errors else "")
            + ")"
        )
    lines += [
        "",
        "### Crash to first answered retry",
        "",
        "`SHOAL_CRASH_AT=publish:<step>` kills the process (exit 137) at that step of an "
        "exactly-once publish (`publisher_id` p, `publisher_seq` 1). It is started again on the "
        "same state and ports while the client retries (503: Retry-After, else 0.5 s; refused "
        "or dropped: 0.2 s). The publish reservation's hold is 10 s (`RESERVATION_HOLD_MS`); the "
        f"target is an answer within {f['crash_target_s']:g} s of the crash. Records: the "
        "storage streams read from TRIM_HORIZON through the emulator, records holding the "
        "answered message id (must be 1) and the message's unique payload (must be 1).",
        "",
        "| crash at | exit | restart s | crash → first answer s | crash → answered 2xx s "
        "| attempts | answer | duplicate | sent again | records with id | with payload |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for crash in f["crash"]:
        again = f"{crash['again_status']} (duplicate {str(crash['again_duplicate']).lower()})"
        lines.append(
            f"| {crash['step']} | {crash['exit_status']} | {crash['restart_s']} "
            f"| {crash['crash_to_first_answer_s']} | {crash['crash_to_answered_retry_s']} "
            f"| {crash['attempts']} | {crash['answer_status']} "
            f"| {str(crash['answer_duplicate']).lower()} | {again} "
            f"| {crash.get('records_with_message_id', '-')} "
            f"| {crash.get('records_with_payload', '-')} |"
        )
    lines += [""]
    for crash in f["crash"]:
        statuses = ", ".join(f"{k}: {v}" for k, v in crash["attempt_statuses"].items())
        errors = ", ".join(f"{k}: {v}" for k, v in crash["attempt_errors"].items())
        answered = ", ".join(
            f"{a['status']} (sent {a['sent_s']} s, answered {a['at_s']} s"
            + (f", Retry-After {a['retry_after']}" if "retry_after" in a else "")
            + ")"
            for a in crash.get("answered_attempts", [])
        )
        lines.append(
            f"- {crash['step']}: the first publish ended with {crash['first_publish']}; "
            f"retries answered {statuses or 'nothing'}, failed {errors or 'never'}. "
            f"Answers after the crash: {answered or 'none'}."
        )
    lines += ["", "`shoal dev` logs:", "", _log_line("concurrency", c["log"])]
    for crash in f["crash"]:
        lines.append(_log_line(f"crash at {crash['step']}", crash["log"]))
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
