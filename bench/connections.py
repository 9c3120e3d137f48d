"""WebSocket connections held by a real ``shoal dev``, with real tokens.

For each N of ``SIZES``: a fresh ``shoal dev`` process of this checkout (``bench.delivery``'s
start), one token from ``shoal token`` for every client, and in this process N ``websockets``
clients connecting with ``Authorization: Bearer <token>``, at most ``IN_FLIGHT`` handshakes at
once. Each handshake runs the real ``wsauth`` authorizer (the JWT's signature checked against
the server's JWKS) and ``edge``'s ``$connect``, as API Gateway would. Measured:

- the connect rate (handshakes a second, over all N);
- the ``shoal dev`` process's resident memory (``VmRSS``, with its children if any) before the
  first handshake and with all N held, and per connection;
- one ``ping`` frame on every connection, answered by the mock route (no function): all still
  open, and how long one round over all of them takes.

At ``FANOUT`` connections (1,000) the clients then go on to hold sessions: a ``connect`` and a
``subscribe`` frame each (the real ``edge`` function: registry, subscription store), at most
``IN_FLIGHT_SESSIONS`` at once, each made again on a new connection after a busy answer (429 or
5xx, or a connection closed, as ``shoal.client`` does: ``SESSION_ATTEMPTS``; every held
connection sends a one-way ``keepalive`` every ``KEEPALIVE_S``, as the client does, for the
sessions of 10,000 take longer than API Gateway's 10 minutes idle); then one message is
published over the HTTP API to the filter they all hold, and the time from just before that
publish to its ``message`` frame is taken at every subscriber: the first, the median and the
last (each client acks what it got as ``shoal.client`` does: after its default ack delay, in a
frame without a ``ref``, which nothing answers).

Client and server share the machine's two cores (and the machine is shared with other work:
the load average is given beside each figure).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

from shoal.client.acks import DEFAULT_ACK_DELAY_S
from shoal.core.retry import backoff_s

from bench.delivery import _dev_server, _ms, _percentile, _request, _token

SIZES = (1_000, 10_000)
#: handshakes in flight at once (a client fleet reconnecting after a restart is a burst too)
IN_FLIGHT = 200
#: at these numbers of connections the clients also hold sessions and one message fans out to
#: all of them (issue 46: the last of 1,000 within 5 s; all of 10,000 exactly once)
FANOUT = (1_000, 10_000)
#: after the last first copy arrived: how long the clients go on reading, for copies too many
SETTLE_S = 3.0
#: connect and subscribe frames in flight at once (each runs the edge function)
IN_FLIGHT_SESSIONS = 8
FANOUT_WAIT_S = 600.0
#: a session's connect and subscribe, tried on a new connection after a busy answer
SESSION_ATTEMPTS = 5
#: the publish, tried again on a busy answer (exactly once: ``publisher_id``/``publisher_seq``)
PUBLISH_ATTEMPTS = 8
#: how often every held connection sends a one-way ``keepalive`` (API Gateway closes one idle
#: for 10 minutes)
KEEPALIVE_S = 240.0


def _rss_kb(pid: int) -> int:
    """Resident memory of ``pid`` and its descendants, KB."""
    total = 0
    pending = [pid]
    while pending:
        p = pending.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        pending.extend(int(c) for c in children)
    return total


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


async def _open(ws_url: str, token: str) -> Any:
    """One connection, as a client opens it (its handshake runs the authorizer and
    ``$connect``)."""
    from websockets.asyncio.client import connect

    return await connect(
        ws_url,
        additional_headers={"Authorization": f"Bearer {token}"},
        ping_interval=None,
        compression=None,
        open_timeout=300,
        close_timeout=30,
    )


async def _hold(ws_url: str, token: str, count: int) -> tuple[list[Any], dict[str, Any]]:
    from websockets.asyncio.client import ClientConnection

    gate = asyncio.Semaphore(IN_FLIGHT)
    failures: dict[str, int] = {}

    async def open_one() -> ClientConnection | None:
        async with gate:
            try:
                ws: ClientConnection = await _open(ws_url, token)
            except Exception as exc:  # counted by type, the run goes on
                name = type(exc).__name__
                failures[name] = failures.get(name, 0) + 1
                return None
            return ws

    started = time.perf_counter()
    opened = await asyncio.gather(*(open_one() for _ in range(count)))
    connect_s = time.perf_counter() - started
    sockets = [ws for ws in opened if ws is not None]

    async def ping(ws: ClientConnection) -> bool:
        try:
            await ws.send('{"action":"ping"}')
            return bool(json.loads(await ws.recv()) == {"action": "pong"})
        except Exception:  # a closed connection answers no pong
            return False

    started = time.perf_counter()
    answered = sum(await asyncio.gather(*(ping(ws) for ws in sockets)))
    ping_round_s = time.perf_counter() - started
    return sockets, {
        "connected": len(sockets),
        "failed": sum(failures.values()),
        "failures": failures,
        "connect_s": round(connect_s, 2),
        "connects_per_s": round(len(sockets) / connect_s, 1),
        "pings_answered": answered,
        "ping_round_s": round(ping_round_s, 2),
    }


async def _fanout(
    url: str, ws_url: str, token: str, sockets: list[Any], server_pid: int
) -> dict[str, Any]:
    """Sessions on the held connections, then one message to all of them."""
    from websockets.exceptions import ConnectionClosed

    gate = asyncio.Semaphore(IN_FLIGHT_SESSIONS)
    #: frames other than the awaited answer (error frames, a late duplicate), by action and
    #: error code; and sessions that never got their answer
    other: dict[str, int] = {}
    refused = 0
    #: sessions made again on a new connection after a busy answer, as ``shoal.client`` does
    retried = 0

    async def expect(ws: Any, action: str) -> str:
        """``action`` when its answer came, ``busy`` for an error a client tries again
        (429 or 5xx, or a function's failure: ``shoal.client.ws``) or a connection closed
        (API Gateway's 10 minutes idle: a connection held while thousands of sessions before it
        are made), else ``none``."""
        try:
            async with asyncio.timeout(120):
                while True:
                    answer = json.loads(await ws.recv())
                    if answer.get("action") == action:
                        return action
                    error = answer.get("error") or {}
                    reason = f"{answer.get('action')}:{error.get('code') or answer.get('message')}"
                    other[reason] = other.get(reason, 0) + 1
                    status = int(answer.get("status") or 0)
                    if answer.get("action") == "error" and (status == 429 or status >= 500):
                        return "busy"
                    if answer.get("message") == "Internal server error":
                        # API Gateway's answer when the function failed: busy for the client
                        return "busy"
        except TimeoutError:
            return "none"
        except ConnectionClosed as exc:
            reason = f"closed:{exc.rcvd.code if exc.rcvd else None}"
            other[reason] = other.get(reason, 0) + 1
            return "busy"

    async def ask(ws: Any, frame: dict[str, Any]) -> str:
        """``frame`` sent, and what came of it (``expect``)."""
        try:
            await ws.send(json.dumps(frame))
        except ConnectionClosed:
            other["closed:before"] = other.get("closed:before", 0) + 1
            return "busy"
        return await expect(ws, "connected" if frame["action"] == "connect" else "subscribed")

    async def session(n: int, ws: Any) -> Any:
        """The connection holding the subscribed session, or None."""
        nonlocal refused, retried
        async with gate:
            client = f"bench-fan-{n}"
            subscription = {"filter": "fan/#", "qos": 1}
            subscribe = {"action": "subscribe", "ref": "s", "subscriptions": [subscription]}
            for attempt in range(SESSION_ATTEMPTS):
                if attempt:
                    # the client's answer to a busy server: a new connection after a backoff
                    retried += 1
                    await ws.close()
                    await asyncio.sleep(backoff_s(attempt, 0.4, 5.0))
                    try:
                        ws = current[n] = await _open(ws_url, token)
                    except Exception as exc:  # counted as a frame of its own, the run goes on
                        reason = f"handshake:{type(exc).__name__}"
                        other[reason] = other.get(reason, 0) + 1
                        break
                got = await ask(ws, {"action": "connect", "client_id": client, "ref": "c"})
                if got == "connected":
                    got = await ask(ws, subscribe)
                    if got == "subscribed":
                        return ws
                if got != "busy":
                    break
            refused += 1
            return None

    #: each session's connection as it is now (a busy answer's retry opens a new one)
    current = list(sockets)

    async def keep_alive() -> None:
        # as the client does (``shoal.client.wslink``): a one-way ``keepalive`` well inside API
        # Gateway's 10 minutes idle, for 10,000 sessions take longer than that to make
        while True:
            await asyncio.sleep(KEEPALIVE_S)
            for ws in list(current):
                with contextlib.suppress(Exception):  # a closed one is the session's to redo
                    await ws.send('{"action":"keepalive"}')

    keeper = asyncio.create_task(keep_alive())
    started = time.perf_counter()
    ready = await asyncio.gather(*(session(n, ws) for n, ws in enumerate(sockets)))
    sessions_s = time.perf_counter() - started
    subscribed = [ws for ws in ready if ws is not None]
    rss_sessions_kb = _rss_kb(server_pid)
    load_before = _load()
    arrivals: list[float] = []
    sent = 0.0
    #: the message frames each connection got (a copy too many would show here)
    copies: list[int] = [0] * len(subscribed)
    first: list[asyncio.Future[None]] = [
        asyncio.get_running_loop().create_future() for _ in subscribed
    ]

    async def receive(n: int, ws: Any) -> None:
        while True:
            frame = json.loads(await ws.recv())
            if frame.get("action") == "message":
                copies[n] += 1
                if not first[n].done():
                    arrivals.append(time.time() - sent)
                    first[n].set_result(None)
                acks.append(asyncio.create_task(ack(ws, frame["id"])))

    async def ack(ws: Any, delivery_id: str) -> None:
        # as ``shoal.client`` acks: held for its default delay (to share a frame with the ids
        # that come meanwhile), and without a ``ref``, so that nothing answers it (an MQTT
        # PUBACK gets no answer)
        await asyncio.sleep(DEFAULT_ACK_DELAY_S)
        with contextlib.suppress(ConnectionClosed):
            await ws.send(json.dumps({"action": "ack", "ids": [delivery_id]}))

    acks: list[asyncio.Task[None]] = []
    receivers = [asyncio.create_task(receive(n, ws)) for n, ws in enumerate(subscribed)]
    sent = time.time()
    # exactly once, and tried again on a busy answer as a publisher does (the latency counts
    # from the first try)
    message = {"topic": "fan/one", "text": "x", "qos": 1}
    message |= {"publisher_id": "bench-fan", "publisher_seq": 1}
    attempts = 0
    while True:
        attempts += 1
        status, _ = await asyncio.to_thread(_request, url, "POST", "/v1/messages", token, message)
        if (status != 429 and status < 500) or attempts == PUBLISH_ATTEMPTS:
            break
        await asyncio.sleep(backoff_s(attempts, 0.2, 5.0))
    publish_ms = _ms(time.time() - sent)
    await asyncio.wait(first, timeout=FANOUT_WAIT_S)
    # copies too many come later, if at all: read on a while before counting
    await asyncio.sleep(SETTLE_S)
    for task in [*receivers, *acks, keeper]:
        task.cancel()
    arrivals.sort()
    return {
        "subscribers": len(subscribed),
        "sessions_refused": refused,
        "sessions_retried": retried,
        "other_frames": other,
        "sessions_s": round(sessions_s, 2),
        "sessions_per_s": round(len(subscribed) / sessions_s, 1),
        "server_rss_sessions_mb": round(rss_sessions_kb / 1024, 1),
        "publish_status": status,
        "publish_attempts": attempts,
        "publish_ms": publish_ms,
        "received": len(arrivals),
        "received_twice": sum(1 for c in copies if c > 1),
        "first_ms": _ms(arrivals[0]) if arrivals else None,
        "median_ms": _ms(_percentile(arrivals, 0.5)) if arrivals else None,
        "last_ms": _ms(arrivals[-1]) if arrivals else None,
        "load_before": load_before,
        "load_after": _load(),
    }


def measure(count: int, fanout: bool) -> dict[str, Any]:
    with _dev_server() as (url, state):
        info = json.loads((Path(state) / "runtime.json").read_text())
        ws_url, pid = info["ws_url"], int(info["pid"])
        token = _token(state)
        idle_kb = _rss_kb(pid)
        load_before = _load()

        async def scenario() -> dict[str, Any]:
            sockets, figures = await _hold(ws_url, token, count)
            figures["server_rss_mb"] = round(_rss_kb(pid) / 1024, 1)
            figures["load_before"] = load_before
            figures["load_after"] = _load()
            if fanout:
                figures["fanout"] = await _fanout(url, ws_url, token, sockets, pid)
            started = time.perf_counter()
            await asyncio.gather(*(ws.close() for ws in sockets), return_exceptions=True)
            figures["close_s"] = round(time.perf_counter() - started, 2)
            return figures

        figures = asyncio.run(scenario())
    figures["server_rss_before_mb"] = round(idle_kb / 1024, 1)
    grown_kb = figures["server_rss_mb"] * 1024 - idle_kb
    figures["server_kb_per_connection"] = round(grown_kb / max(figures["connected"], 1), 1)
    return {"connections": count, **figures}


def run(sizes: tuple[int, ...] = SIZES) -> dict[str, Any]:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    figures: dict[str, Any] = {
        "in_flight_handshakes": IN_FLIGHT,
        "in_flight_sessions": IN_FLIGHT_SESSIONS,
        "open_files_limit": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
        "cpus": os.cpu_count(),
        "runs": [],
    }
    # each size's figures also to this file as they come (a run stopped by its timeout keeps
    # the sizes it finished)
    partial = os.environ.get("BENCH_PARTIAL")
    for n in sizes:
        figures["runs"].append(measure(n, fanout=n in FANOUT))
        if partial:
            Path(partial).write_text(json.dumps(figures, indent=2))
    return figures


def report(figures: dict[str, Any]) -> str:
    rows = [
        f"| {r['connections']:,} | {r['connected']:,} | {r['failed']} | {r['connects_per_s']} "
        f"| {r['server_rss_before_mb']} | {r['server_rss_mb']} | {r['server_kb_per_connection']} "
        f"| {r['pings_answered']:,} | {r['ping_round_s']} | {r['load_before']} |"
        for r in figures["runs"]
    ]
    lines = [
        "## WebSocket connections held by `shoal dev` (connections)",
        "",
        "`python -m bench connections`: per N a fresh `shoal dev` and N `websockets` clients in "
        "the bench process with one real token (`shoal token`), at most "
        f"{figures['in_flight_handshakes']} handshakes in flight, each running the real `wsauth` "
        "authorizer (JWT checked against the server's JWKS) and `edge`'s `$connect`; "
        f"{figures['cpus']} cores shared by both (and by other work: load average beside each "
        f"row), open files limit {figures['open_files_limit']:,} a process. Then one `ping` "
        "frame on every connection, answered by the mock route (no function). Server RSS is "
        "the `shoal dev` process's.",
        "",
        "| N | connected | failed | connects/s | server RSS before MB | server RSS held MB "
        "| server KB/connection | pings answered | ping round s | load before |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
    ]
    for r in figures["runs"]:
        if r.get("failures"):
            lines.append(f"- N {r['connections']:,}: failed handshakes by error: {r['failures']}")
        f = r.get("fanout")
        if f:
            lines += [
                f"- One publish to {f['subscribers']:,} connected subscribers (each a `connect` "
                f"and a `subscribe` frame first, {figures['in_flight_sessions']} at once: "
                f"{f['sessions_per_s']} sessions/s, {f['sessions_refused']} without their "
                "answer, made again on a new connection after a busy answer (as "
                f"`shoal.client` does): {f.get('sessions_retried', 'not counted')}, other "
                f"frames {f['other_frames'] or 'none'}; server RSS "
                f"then {f['server_rss_sessions_mb']} MB): publish answered "
                f"{f['publish_status']} in {f['publish_ms']} ms "
                f"({f.get('publish_attempts', 'not counted')} tries); "
                f"{f['received']:,} received it "
                f"({f.get('received_twice', 'not counted')} of them twice), the first after "
                f"{f['first_ms']} ms, the median after {f['median_ms']} ms, **the last after "
                f"{f['last_ms']} ms** (load average before {f['load_before']}, after "
                f"{f['load_after']}).",
            ]
    lines += [
        "",
        "An idle connection is a socket and a small object on the server's event loop: no "
        "thread and no function. The handshake's two invocations (authorizer, `$connect`) "
        "bound the connect rate. A fan-out: the router writes the deliveries and hands the "
        "pushes to the push queue, a message per lane; the pusher's invocations (as many at "
        "once as its sandboxes, 8) take them side by side, four sessions at a time each "
        "under `shoal dev` (16 deployed: `SHOAL_PUSH_PARALLELISM`), each push a share of one "
        "batch read of its sessions, the state's write and one `PostToConnection`; each client "
        "acks after `shoal.client`'s default ack delay (300 ms). Under `shoal dev` all of it "
        "is CPU of one process, and every call waits for the emulator's one lock, on two "
        "cores shared with the clients.",
        "",
    ]
    return "\n".join(lines)
