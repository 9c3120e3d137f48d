"""The soak's driver: one ``shoal dev``, every kind of client at once, faults on a seeded
schedule, and afterwards the checker's verdict, the plots and the summary.

The run's folder (``--out``, default ``.shoal/soak/<time>``) holds ``state/`` (the server's),
``shoal-dev.log``, ``clients/`` (each client's state file), ``history/`` (one file per writer
and life: the driver, the push endpoint, each worker), ``report.txt`` (the checker's),
``soak.png`` and ``summary.md``.

What runs (``plan``), scaled by ``--clients``: exactly-once publishers (single and batched,
with and without ordering keys) into a composite topic ``soak`` of 2 partitions, which is grown
by a storage topic and switched once mid-run; WebSocket and long-polling subscribers of it; two
shared groups (``$share/ga/jobs/#`` at QoS 1 and ``$share/gb/work/#`` at QoS 2), each with an
anchor member per transport that stays and members that join, leave and crash; a push
subscription (``hooks/#``, ordered) to a local endpoint that fails a share of requests
(``bench.soak.endpoint``); retained messages and a subscriber that subscribes to them again and
again; will clients over both transports; an observer of the wills; subscribers whose token is
short-lived and rotated.

Faults (``schedule``), seeded: kill -9 of ``shoal dev`` and its restart on the same state;
WebSocket connections dropped without a close; client processes killed with -9 and started
again from their state files; a token left to expire under two subscribers before a new one
comes; and, when ``SHOAL_DEV_THROTTLE`` is set (or ``--throttle``), the runtime's throttling of
``@connections`` posts and DynamoDB calls, passed through to ``shoal dev`` as it is.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.soak import checker as soak_checker
from bench.soak.clients import AREAS, WILL_KEEPALIVE_S, payload_keys
from bench.soak.endpoint import PushEndpoint
from bench.soak.history import History, history_file, read_history
from bench.soak.server import (
    REAPER_S,
    ROOT,
    THROTTLE_ENV,
    DevProcess,
    die_with_parent,
    request,
    resources,
    state_rss_kb,
)

PRINCIPAL = "soak"
PUSH_NAME = "hooks"
SAMPLE_EVERY_S = 5.0
#: a short-lived token's life, and how often it is rotated while no expiry is due
SHORT_TOKEN_TTL_S = 60
ROTATE_EVERY_S = 40.0
#: clients per worker process
PER_WORKER = 8
#: messages a second over all publishers, whatever the client count: at 5 a second and 100
#: clients (about 60 deliveries a second) shoal dev on 2 shared cores fell behind on the
#: WebSocket acks and sessions stalled at a full window (docs/operations.md, "Soak")
DEFAULT_RATE = 2.0


@dataclass
class Settings:
    minutes: float = 5.0
    clients: int = 40
    seed: int = 1
    #: messages a second over all publishers (``DEFAULT_RATE`` unless told)
    rate: float | None = None
    kills: int | None = None
    drops: int | None = None
    client_kills: int | None = None
    token_expiries: int | None = None
    grow: bool | None = None
    #: the longest the drain after the traffic may take, and the least; past ``drain_s`` it
    #: goes on while the missing count falls between two looks, up to ``drain_cap_s``: an
    #: overloaded run's slow subscriber still working through its backlog is in flight, and
    #: the verdict should not call it lost because the wait ended
    drain_s: float = 240.0
    min_drain_s: float = 40.0
    drain_cap_s: float = 720.0
    out: Path | None = None
    throttle: str | None = None

    @property
    def duration_s(self) -> float:
        return self.minutes * 60


def drain_goes_on(
    settings: Settings, spent_s: float, missing: int | None, before: int | None
) -> bool:
    """Whether the drain looks again: within ``drain_s`` always; past it, up to
    ``drain_cap_s``, only while the last look found fewer missing than the one before it."""
    if spent_s < settings.drain_s:
        return True
    if spent_s >= settings.drain_cap_s or missing is None or before is None:
        return False
    return missing < before


@dataclass
class Fault:
    at_s: float
    kind: str


@dataclass
class Outcome:
    report: soak_checker.Report
    out: Path
    figures: dict[str, Any] = field(default_factory=dict)


# -- the plan -----------------------------------------------------------------------------------


def plan(settings: Settings) -> list[dict[str, Any]]:
    """Every client of the run, as its worker gets it (client id, role and options)."""
    rate = settings.rate if settings.rate is not None else DEFAULT_RATE
    specs: list[dict[str, Any]] = []

    def add(kind: str, **spec: Any) -> None:
        spec["client"] = f"{PRINCIPAL}-{kind}-{len(specs)}"
        specs.append(spec)

    def publisher(family: str, share: float, **spec: Any) -> None:
        add(f"pub-{family}", role="publisher", family=family, rate=rate * share, **spec)

    publisher("soak", 0.2, keyed=True)
    publisher("soak", 0.2, keyed=True, batch=5)
    publisher("soak", 0.1, keyed=False)
    # at most once: never redelivered, never twice (the checker's qos0_twice)
    publisher("soak", 0.05, keyed=True, qos=0)
    publisher("jobs", 0.15, keyed=True, batch=5)
    publisher("work", 0.1, keyed=True, qos=2)
    publisher("hooks", 0.15, keyed=True)
    publisher("retained", 0.05, keyed=False, retain=True)
    # wills are seen by a long-polling observer: its acks are answered whatever the load on
    # the WebSocket API (a second one over WebSocket comes with more clients)
    add("observer", role="subscriber", transport="http", filters=[_filter("wills/#")])
    for group, family, qos in (("ga", "jobs", 1), ("gb", "work", 2)):
        for transport in ("ws", "http"):
            add(
                f"{group}",
                role="group_member",
                transport=transport,
                anchor=True,
                filters=[_filter(f"$share/{group}/{family}/#", qos)],
            )
    add("will", role="will_ws", transport="ws")
    add("will", role="will_http", transport="http")
    add("prober", role="prober", transport="ws", filters=[_filter("retained/#")])
    add("short", role="subscriber", transport="http", token="short", filters=[_filter("soak/#")])
    add("sub", role="subscriber", transport="ws", filters=[_filter("soak/#")])
    add("sub", role="subscriber", transport="http", filters=[_filter("soak/a1/#")])
    rng = random.Random(f"{settings.seed}/plan")
    extra = max(0, settings.clients - len(specs))
    if extra:
        add("short", role="subscriber", transport="ws", token="short", filters=[_filter("soak/#")])
        extra -= 1
    if extra:
        add("observer", role="subscriber", transport="ws", filters=[_filter("wills/#")])
        extra -= 1
    for n in range(extra):
        roll = rng.random()
        transport = "ws" if n % 5 < 3 else "http"
        if roll < 0.10:
            group, family, qos = (("ga", "jobs", 1), ("gb", "work", 2))[n % 2]
            add(
                group,
                role="group_member",
                transport=transport,
                filters=[_filter(f"$share/{group}/{family}/#", qos)],
            )
        elif roll < 0.20:
            add("will", role=f"will_{transport}", transport=transport)
        elif roll < 0.23:
            add("prober", role="prober", transport=transport, filters=[_filter("retained/#")])
        else:
            area = f"soak/a{n % AREAS}/#" if n % 20 else "soak/#"
            add("sub", role="subscriber", transport=transport, filters=[_filter(area)])
    return specs


def _filter(name: str, qos: int = 1) -> dict[str, Any]:
    return {"filter": name, "qos": qos}


def schedule(settings: Settings) -> list[Fault]:
    """The faults of the traffic's duration, in time order (seeded)."""
    minutes = settings.minutes
    duration = settings.duration_s
    rng = random.Random(f"{settings.seed}/faults")
    kills = settings.kills if settings.kills is not None else max(1, round(minutes / 5))
    drops = settings.drops if settings.drops is not None else max(2, round(2 * minutes))
    client_kills = (
        settings.client_kills if settings.client_kills is not None else max(1, round(minutes / 2))
    )
    expiries = (
        settings.token_expiries
        if settings.token_expiries is not None
        else (max(1, round(minutes / 10)) if minutes >= 3 else 0)
    )
    grow = settings.grow if settings.grow is not None else minutes >= 2
    faults: list[Fault] = []
    # kills spread over the run, each in its own slot (a restart takes its time)
    for n in range(kills):
        slot = 0.8 * duration / kills
        faults.append(
            Fault(0.1 * duration + slot * n + rng.uniform(0.2, 0.8) * slot, "server_kill")
        )

    def spread(count: int, kind: str, low: float = 0.05, high: float = 0.9) -> None:
        faults.extend(Fault(rng.uniform(low, high) * duration, kind) for _ in range(count))

    spread(drops, "ws_drop")
    spread(client_kills, "client_kill", 0.1, 0.85)
    spread(expiries, "token_expiry", 0.1, 0.7)
    if grow:
        faults.append(Fault(0.4 * duration, "grow"))
    return sorted(faults, key=lambda f: f.at_s)


# -- the parts ----------------------------------------------------------------------------------


class Workers:
    """The client processes: started, killed with -9, started again with the next life."""

    def __init__(self, spec_path: Path, names: list[str], log_path: Path) -> None:
        self.spec_path = spec_path
        self.names = names
        self.log_path = log_path
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.lives: dict[str, int] = dict.fromkeys(names, 0)

    def start(self, name: str) -> None:
        with open(self.log_path, "ab") as log:
            self.processes[name] = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "bench.soak.worker",
                    str(self.spec_path),
                    name,
                    str(self.lives[name]),
                ],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent,  # noqa: PLW1509 - no threads touch it meanwhile
            )

    def start_all(self) -> None:
        for name in self.names:
            self.start(name)

    def kill(self, name: str) -> None:
        process = self.processes[name]
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
            process.wait(30)
        self.lives[name] += 1

    def signal(self, name: str, signum: int) -> None:
        process = self.processes.get(name)
        if process is not None and process.poll() is None:
            process.send_signal(signum)

    def stop_all(self, timeout_s: float = 120.0) -> None:
        for name in self.names:
            self.signal(name, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for process in self.processes.values():
            try:
                process.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(30)

    def pids(self) -> list[int]:
        return [p.pid for p in self.processes.values() if p.poll() is None]


class TokenFiles:
    """The clients' token files: one long-lived, one short-lived and rotated, except while an
    expiry is due (then the token in use runs out under its subscribers before a new one)."""

    def __init__(self, folder: Path, server: DevProcess, history: History) -> None:
        self.folder = folder
        self.server = server
        self.history = history
        self.main = folder / "main.jwt"
        self.short = folder / "short.jwt"
        self.hold_until = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._rotate, name="tokens", daemon=True)

    def start(self) -> None:
        _write(self.main, self.server.mint(PRINCIPAL, ttl_s=86_400 * 2))
        _write(self.short, self.server.mint(PRINCIPAL, ttl_s=SHORT_TOKEN_TTL_S))
        self._written = time.time()
        self._thread.start()

    def admin(self) -> str:
        return self.server.mint("ops", ttl_s=86_400 * 2, admin=True)

    def expire(self) -> None:
        """Stop rotating: the short token expires under its subscribers; a new one 5 s later."""
        expires = self._written + SHORT_TOKEN_TTL_S
        self.hold_until = expires + 5
        self.history.record(
            "fault", kind="token_expiry", expires_at=round(expires, 3), clients="short"
        )

    def _rotate(self) -> None:
        while not self._stop.wait(1.0):
            now = time.time()
            if now < self.hold_until:
                continue
            held = self.hold_until and now >= self.hold_until
            if held or now - self._written >= ROTATE_EVERY_S:
                _write(self.short, self.server.mint(PRINCIPAL, ttl_s=SHORT_TOKEN_TTL_S))
                self._written = now
                if held:
                    self.hold_until = 0.0
                    self.history.record("fault", kind="token_renewed", clients="short")

    def stop(self) -> None:
        self._stop.set()


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text + "\n")
    tmp.replace(path)


class Sampler:
    """The server's resident memory, open files, threads and CPU seconds (and the clients'
    memory), every ``SAMPLE_EVERY_S``."""

    def __init__(
        self, history: History, server: DevProcess, workers: Callable[[], list[int]]
    ) -> None:
        self.history = history
        self.server = server
        self.workers = workers
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_EVERY_S):
            pid = self.server.pid
            seen = resources(pid) if pid is not None else None
            clients_kb = sum((resources(p) or {}).get("rss_kb", 0) for p in self.workers())
            # its pid says which life a sample is of: CPU seconds count from each start
            server = {"pid": pid, **seen} if seen is not None else {}
            self.history.record(
                "sample",
                server=seen is not None,
                clients_rss_kb=clients_kb,
                load=round(os.getloadavg()[0], 2),
                **server,
            )


# -- the run ------------------------------------------------------------------------------------


class Soak:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.out = settings.out or ROOT / ".shoal" / "soak" / stamp
        self.out.mkdir(parents=True, exist_ok=True)
        self.history_dir = self.out / "history"
        self.history = History(history_file(self.history_dir, "driver", 0), writer="driver")
        self.rng = random.Random(f"{settings.seed}/driver")
        throttle = settings.throttle or os.environ.get(THROTTLE_ENV)
        self.throttle = throttle or None
        env = {THROTTLE_ENV: throttle} if throttle else {}
        self.server = DevProcess(self.out / "state", env=env, log_path=self.out / "shoal-dev.log")
        self.admin = ""
        self.ws_workers: list[str] = []
        self._switching: threading.Thread | None = None

    def say(self, text: str) -> None:
        print(f"soak: {text}", file=sys.stderr, flush=True)

    def run(self) -> Outcome:
        main = threading.current_thread() is threading.main_thread()
        # a SIGTERM (a timeout's) unwinds through the cleanup, as Ctrl-C does
        before = signal.signal(signal.SIGTERM, _interrupt) if main else None
        try:
            return self._run()
        finally:
            if main:
                signal.signal(signal.SIGTERM, before if before is not None else signal.SIG_DFL)

    def _run(self) -> Outcome:
        settings = self.settings
        specs = plan(settings)
        faults = schedule(settings)
        self.say(f"{len(specs)} clients, {len(faults)} faults, out {self.out}")
        took = self.server.start()
        self.say(f"shoal dev up in {took:.1f} s")
        tokens = TokenFiles(self.out, self.server, self.history)
        tokens.start()
        self.admin = tokens.admin()
        endpoint = PushEndpoint(
            History(history_file(self.history_dir, "endpoint", 0), writer="endpoint"),
            settings.seed,
            PUSH_NAME,
        )
        endpoint.start()
        self.history.record(
            "phase",
            name="start",
            reaper_s=REAPER_S,
            will_keepalive_s=WILL_KEEPALIVE_S,
            seed=settings.seed,
            clients=len(specs),
            minutes=settings.minutes,
            throttle=self.throttle,
            faults=[f.kind for f in faults],
        )
        self._setup(endpoint.url)
        names = [f"worker-{n}" for n in range(math.ceil(len(specs) / PER_WORKER))]
        by_worker: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
        for n, spec in enumerate(specs):
            by_worker[names[n % len(names)]].append(spec)
        self.ws_workers = [
            name
            for name, held in by_worker.items()
            if any(s.get("transport") == "ws" for s in held)
        ]
        spec_path = self.out / "workers.json"
        worker_spec = {
            "url": self.server.url,
            "ws_url": self.server.ws_url,
            "state_dir": str(self.out / "clients"),
            "history_dir": str(self.history_dir),
            "token_files": {"main": str(tokens.main), "short": str(tokens.short)},
            "seed": settings.seed,
            "workers": by_worker,
        }
        (self.out / "clients").mkdir(exist_ok=True)
        spec_path.write_text(json.dumps(worker_spec, indent=1))
        workers = Workers(spec_path, names, self.out / "workers.log")
        workers.start_all()
        sampler = Sampler(self.history, self.server, workers.pids)
        sampler.start()
        try:
            began = time.monotonic()
            for fault in faults:
                self._wait_until(began + fault.at_s)
                self._fault(fault, workers, tokens, by_worker)
            self._wait_until(began + settings.duration_s)
            self.history.record("phase", name="traffic_end")
            worker_spec["traffic_ended"] = True
            spec_path.write_text(json.dumps(worker_spec, indent=1))
            for name in names:
                workers.signal(name, signal.SIGUSR2)
            self.say("traffic ended; draining")
            self._drain()
            workers.stop_all()
            self._push_final()
            self._server_drops()
            self._state_memory()
            self.history.record("phase", name="end")
        finally:
            sampler.stop()
            tokens.stop()
            with contextlib.suppress(Exception):
                workers.stop_all(30)
            self.server.stop()
            endpoint.stop()
            endpoint.history.close()
            self.history.close()
        report = soak_checker.check_path(self.history_dir)
        (self.out / "report.txt").write_text(report.render())
        self.say(f"verdict: {'PASS' if report.ok else 'FAIL'} ({self.out / 'report.txt'})")
        from bench.soak.summary import summarize

        figures = summarize(self.out, settings, report, self.server.starts)
        return Outcome(report, self.out, figures)

    def _wait_until(self, deadline: float) -> None:
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(left, 1.0))

    def _call(self, method: str, path: str, body: Any = None, timeout: float = 60) -> Any:
        for _ in range(30):
            try:
                status, answer = request(
                    self.server.url, method, path, token=self.admin, body=body, timeout=timeout
                )
            except OSError:
                status, answer = 0, None
            if status < 300 and status != 0:
                return answer
            if status in (0, 429, 500, 502, 503, 504):
                time.sleep(2)
                continue
            raise RuntimeError(f"{method} {path}: {status} {answer}")
        raise RuntimeError(f"{method} {path}: no answer")

    def _setup(self, endpoint_url: str) -> None:
        self.history.record("topic", action="create", name="soak", phase="invoke")
        self._call("POST", "/v1/topics", {"name": "soak", "partitions": 2})
        self.history.record("topic", action="create", name="soak", phase="ok")
        push = {
            "name": PUSH_NAME,
            "filter": "hooks/#",
            "endpoint": endpoint_url,
            "ordered": True,
            "retry": {
                "max_attempts": 5,
                "initial_backoff_s": 0.2,
                "max_backoff_s": 2.0,
                "multiplier": 2.0,
            },
        }
        self.history.record(
            "push_sub", phase="invoke", name=PUSH_NAME, filter="hooks/#", ordered=True
        )
        self._call("POST", "/v1/subscriptions", push)
        self.history.record("push_sub", phase="ok", name=PUSH_NAME, filter="hooks/#", ordered=True)

    def _fault(
        self,
        fault: Fault,
        workers: Workers,
        tokens: TokenFiles,
        by_worker: dict[str, list[dict[str, Any]]],
    ) -> None:
        if fault.kind == "server_kill":
            self.history.record("fault", kind="server_kill", pid=self.server.pid)
            self.server.kill()
            self.say("shoal dev killed")
            took = self.server.start()
            self.history.record("fault", kind="server_up", took_s=round(took, 2))
            self.say(f"shoal dev up again in {took:.1f} s")
        elif fault.kind == "ws_drop" and self.ws_workers:
            name = self.rng.choice(self.ws_workers)
            self.history.record("fault", kind="ws_drop", worker=name)
            workers.signal(name, signal.SIGUSR1)
        elif fault.kind == "client_kill":
            name = self.rng.choice(workers.names)
            clients = [s["client"] for s in by_worker[name]]
            self.history.record("fault", kind="client_kill", worker=name, clients=clients)
            workers.kill(name)
            time.sleep(self.rng.uniform(1, 4))
            workers.start(name)
            self.history.record("fault", kind="client_restart", worker=name, clients=clients)
            self.say(f"{name} killed and started again")
        elif fault.kind == "token_expiry":
            tokens.expire()
        elif fault.kind == "grow":
            self._switching = threading.Thread(target=self._grow, name="grow", daemon=True)
            self._switching.start()

    def _grow(self) -> None:
        """A storage topic added to ``soak``, then the produce pointer moved to it. A call cut
        by a kill of the server is sent again; when its retry is refused because the first
        attempt was applied (no next storage topic), the topic document says so."""
        try:
            self.history.record("topic", action="grow", name="soak", phase="invoke")
            grown = self._call("POST", "/v1/topics/soak/storage-topics", {"partitions": 2})
            self.history.record("topic", action="grow", name="soak", phase="ok")
            last = max(int(s["index"]) for s in grown["storage_topics"])
            self.history.record("topic", action="switch", name="soak", phase="invoke")
            try:
                self._call("POST", "/v1/topics/soak/switch-produce", timeout=90)
            except RuntimeError as exc:
                topic = self._call("GET", "/v1/topics/soak")
                if "no_next_storage_topic" not in str(exc) or topic["produce_pointer"] != last:
                    raise
            self.history.record("topic", action="switch", name="soak", phase="ok")
            self.say("topic soak grown and switched")
        except (RuntimeError, KeyError, TypeError, ValueError) as exc:
            self.history.record("topic", action="switch", name="soak", phase="fail", error=str(exc))

    def _drain(self) -> None:
        """Until nothing owed is missing (messages, pushes, wills due) and the push subscription
        has nothing in retry, or ``drain_s`` (the checker read as an oracle of quiescence only;
        the verdict comes after the run)."""
        began = time.monotonic()
        missing: int | None = None
        try:
            missing = self._drain_until(began)
        finally:
            self.history.record(
                "phase",
                name="drained",
                after_s=round(time.monotonic() - began),
                missing=missing,
            )

    def _drain_until(self, began: float) -> int | None:
        """The missing count at the last look (0: quiescent; None: never looked)."""
        if self._switching is not None:
            self._switching.join(120)
        missing: int | None = None
        before: int | None = None
        while True:
            if not drain_goes_on(self.settings, time.monotonic() - began, missing, before):
                return missing
            time.sleep(10)
            if time.monotonic() - began < self.settings.min_drain_s:
                continue
            state = self._call("GET", f"/v1/subscriptions/{PUSH_NAME}") or {}
            if state.get("retry_depth"):
                continue
            records, torn = read_history(self.history_dir)
            report = soak_checker.check(records, torn=torn)
            missing_now = [
                v
                for v in report.violations
                if v.property in ("lost", "push")
                or (v.property == "will" and "never published" in v.summary)
            ]
            before, missing = missing, len(missing_now)
            self.say(f"draining: {missing} missing after {time.monotonic() - began:.0f} s")
            if not missing:
                return 0

    def _server_drops(self) -> None:
        """The shared groups' ``dropped`` delivery events as the service archived them (the
        emulator's S3, what the audit reads): a QoS 2 message whose member's session ended or
        left while it was in flight goes to no one ([MQTT-4.8.2-5]), and its member's client
        may never have recorded the delivery (an answer lost to a kill). The checker counts
        such a message dropped by the service's word, not lost."""
        import boto3
        from shoal.delivery.events import EVENTS_PREFIX

        s3 = boto3.client(
            "s3",
            endpoint_url=f"http://127.0.0.1:{self.server.aws_port}",
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )
        drops: list[dict[str, Any]] = []
        objects = 0
        error: str | None = None
        try:
            for bucket in s3.list_buckets().get("Buckets", []):
                pages = s3.get_paginator("list_objects_v2").paginate(
                    Bucket=bucket["Name"], Prefix=EVENTS_PREFIX + "/"
                )
                for listed in pages:
                    for obj in listed.get("Contents", []):
                        objects += 1
                        body = s3.get_object(Bucket=bucket["Name"], Key=obj["Key"])["Body"]
                        for line in body.read().splitlines():
                            event = json.loads(line)
                            if event.get("event") == "dropped" and (
                                event.get("consumer_kind") == "group"
                            ):
                                drops.append(
                                    {
                                        k: event.get(k)
                                        for k in ("consumer", "message_id", "reason", "label")
                                    }
                                )
        except Exception as exc:  # the verdict then counts such messages lost
            error = str(exc)
            self.say(f"the archived delivery events could not be read: {exc}")
        self.history.record("server_drops", events=drops, objects=objects, error=error)

    def _state_memory(self) -> None:
        """The server's memory beside a fresh process's holding the same state, at the end:
        what of the server's memory is not its data."""
        pid = self.server.pid
        server = (resources(pid) or {}).get("rss_kb") if pid is not None else None
        state = state_rss_kb(self.server.state_dir, self.server.env)
        self.history.record("state_memory", server_rss_kb=server, state_rss_kb=state)

    def _push_final(self) -> None:
        state = self._call("GET", f"/v1/subscriptions/{PUSH_NAME}") or {}
        entries: list[dict[str, Any]] = []
        after: str | None = None
        while True:
            query = f"?limit=100&after={after}" if after else "?limit=100"
            page = self._call("GET", f"/v1/subscriptions/{PUSH_NAME}/dlq{query}") or {}
            for message in page.get("messages") or []:
                entries.append(
                    {
                        "message_id": message.get("id"),
                        "mk": payload_keys(message).get("mk"),
                        "reason": message.get("reason"),
                        "attempts": message.get("attempts"),
                        "key": message.get("ordering_key"),
                    }
                )
            after = page.get("next")
            if not after:
                break
        self.history.record(
            "push_final",
            name=PUSH_NAME,
            dlq=entries,
            retry_depth=state.get("retry_depth"),
            dlq_depth=state.get("dlq_depth"),
            blocked_keys=state.get("blocked_keys"),
        )


def _interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run_soak(settings: Settings) -> Outcome:
    return Soak(settings).run()
