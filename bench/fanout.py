"""One message to many connected subscribers, deployed: a model from the calls counted here.

The real ``router`` and ``pusher`` handlers run over in-process moto (``bench.cost``'s run):
``COUNTED`` sessions subscribed to one filter and connected (their connections bound and
ready, as a connect leaves them), one publish, the router's batch, then the push queue taken
by the pusher as Lambda's mapping would take it. Counted: each function's AWS calls and its
CPU time (the process's, less in-process moto's: ``bench.cost.AWS_SIDE``), per subscriber.

The model then times a fan-out to ``SIZES`` subscribers on a deployed stack:

- the router: its inbox writes (25 items a ``BatchWriteItem``, ``write_concurrency`` at once)
  at ``CALL_S`` each; its hand-off to the push queue, by the bytes a session took in the
  counted run's ``SendMessageBatch`` calls, packed as ``shoal.edge.pushwork`` packs them (a
  body per lane and part, 200 KB at most; ten bodies and 250 KB a call; a part's calls
  ``SEND_CONCURRENCY`` at once unless a lane's sessions split into several bodies, then one
  after the other); its other calls (the version read, the ledger, the archive object, the
  events) once an invocation, not per subscriber; its CPU per subscriber scaled to its
  memory's share of a vCPU (Lambda gives a full vCPU at 1,769 MB);
- the pushes: ``pushConcurrency`` workers (the stack's default), each running
  ``PushSettings.parallelism`` (16) sessions side by side: a worker's rate is the lower of its
  threads' round trips (the pusher's calls per subscriber at ``CALL_S``) and its CPU, and all of
  them together at most the account's API Gateway rate (``POST_RATE`` a second, shared by every
  API of the region; a post is one request);
- a mapping's wait before the router (half its one-second poll) and the queue's hop;
- a large fan-out is written in parts (``shoal.router.fanout.PIPELINE_SESSIONS`` sessions a
  part at least, ``MAX_PARTS`` at most), each part's pushes handed over as it is written: the
  pushes run beside the router's later parts, so the last subscriber is reached when the
  later of the two ends (the router's last part and its pushes, or every push).

Besides the stack as declared, when it declares less, the model is given for a router with a
full vCPU (1,769 MB) and 16 inbox writes at once (what the stack declares since issue 46).

Goal (issue 46): 100,000 subscribers reached within 15 s, a post rate of two thirds of the
account's default rate or better.
"""

from __future__ import annotations

import math
import time
from typing import Any

from shoal.core.config import DEFAULT_PUSH_PARALLELISM as PUSH_PARALLELISM
from shoal.core.config import DEFAULT_WRITE_CONCURRENCY, get_config
from shoal.declarations import DEPLOYMENT
from shoal.edge.pushwork import (
    MAX_BATCH_BYTES,
    MAX_BATCH_ENTRIES,
    MAX_BODY_BYTES,
    SEND_CONCURRENCY,
    PushQueue,
)
from shoal.router.fanout import MAX_PARTS, PIPELINE_SESSIONS

from bench.account import emulated_account
from bench.cost import FULL_VCPU_MB, Run, Scenario, _http, _start_metering, _stop_metering

COUNTED = 1_000
SIZES = (1_000, 10_000, 100_000)
#: a deployed AWS call's round trip, as the issue sets it
CALL_S = 0.010
#: the account's default API Gateway request rate, shared by every API of the region
POST_RATE = 10_000
#: infra.stack's default (context ``pushConcurrency``)
PUSH_CONCURRENCY = 50
#: the router mapping's poll (about a second: half of it waited on average), the queue's hop
POLL_WAIT_S = 0.5
QUEUE_HOP_S = 0.05
GOAL_S = 15.0
GOAL_RATE_SHARE = 2 / 3


def _vcpu(function: str) -> float:
    return min(1.0, DEPLOYMENT.function(function).memory_mb / FULL_VCPU_MB)


def count(subscribers: int = COUNTED) -> dict[str, Any]:
    """The router's and the pusher's calls and CPU per subscriber of one publish."""
    import os

    from shoal.composite.service import ensure_default_topic
    from shoal.edge.connections import Connection, ConnectionStore
    from shoal.sessions.repository import SessionRepository
    from shoal.wiring import topic_service

    scenario = Scenario("fan-out", batch=1, subscribers=subscribers)
    with emulated_account(default_partitions=1) as session:
        os.environ["SHOAL_CONNECTIONS_ENDPOINT"] = (
            "https://bench.execute-api.us-east-1.amazonaws.com/v1"
        )
        get_config.cache_clear()
        config = get_config()
        ensure_default_topic(topic_service(config, stream_wait_s=30.0), 1)
        run = Run(session, scenario)
        run.cpu_time = True
        connections = ConnectionStore.from_config(config)
        sessions = SessionRepository.from_config(config)
        for n in range(subscribers):
            client = f"bench-{n}"
            channel = run.session_call(
                "sessions",
                "PUT",
                client,
                body={"clean_start": False, "session_expiry_s": 3600, "keepalive_s": 600},
            )["channel"]
            run.session_call(
                "subscriptions",
                "POST",
                client,
                "/subscriptions",
                body={"subscriptions": [{"filter": "fan/#", "qos": 1}]},
                headers={"Shoal-Channel": channel},
            )
            head = sessions.head(client)
            assert head is not None and head.session_id is not None
            connection = Connection(
                f"bench{n:06d}=", client, "bench", channel, head.session_id, 100, 0
            )
            connections.bind(connection)
            connections.ready(connection)
        # warm: the caches of both functions filled by one fan-out, not counted
        run.invoke("publish", _http("POST", "/v1/messages", body={"topic": "fan/x", "text": "w"}))
        run.route()
        run.pushes()
        run.invoke("publish", _http("POST", "/v1/messages", body={"topic": "fan/x", "text": "m"}))
        figures: dict[str, Any] = {}
        # the bytes of the router's hand-off a session takes (what the model packs for larger
        # fan-outs)
        sent: list[int] = []
        send = PushQueue._send

        def measured(queue: PushQueue, entries: Any) -> None:
            sent.extend(len(e.body) for e in entries)
            send(queue, entries)

        setattr(PushQueue, "_send", measured)  # noqa: B010 (a method swapped for the count)
        for function, step in (("router", run.route), ("pusher", run.pushes)):
            _start_metering(run)
            started = time.perf_counter()
            step()
            wall = time.perf_counter() - started
            _stop_metering(run)
            calls = dict(run.meters.calls.calls)
            figures[function] = {
                "invocations": run.counts.invocations.get(function, 0),
                "calls": {k: v / subscribers for k, v in sorted(calls.items())},
                "calls_per_subscriber": sum(calls.values()) / subscribers,
                "cpu_ms_per_subscriber": run.counts.lambda_s * 1000 / subscribers,
                "wall_s_in_process": wall,
            }
            if function == "router":
                figures[function]["handoff_bytes_per_subscriber"] = sum(sent) / subscribers
        setattr(PushQueue, "_send", send)  # noqa: B010
        return {"subscribers": subscribers, **figures}


def handoff_s(n: int, bytes_per_session: float, lanes: int) -> float:
    """The router's hand-off of ``n`` sessions' pushes, packed as ``PushQueue.hand_off``
    packs it: per part of the fan-out, a body per lane (split past ``MAX_BODY_BYTES``), ten
    bodies and ``MAX_BATCH_BYTES`` a call; a part's calls ``SEND_CONCURRENCY`` at once, or one
    after the other when a lane split (its bodies must reach the queue in order)."""
    parts = max(1, min(MAX_PARTS, n // PIPELINE_SESSIONS))
    per_lane = n / parts / min(lanes, n) * bytes_per_session
    bodies_per_lane = max(1, math.ceil(per_lane / MAX_BODY_BYTES))
    body = per_lane / bodies_per_lane
    per_call = max(1, min(MAX_BATCH_ENTRIES, int(MAX_BATCH_BYTES // (body + 200))))
    calls = math.ceil(min(lanes, n) * bodies_per_lane / per_call)
    rounds = calls if bodies_per_lane > 1 else math.ceil(calls / SEND_CONCURRENCY)
    return parts * rounds * CALL_S


def model(
    counted: dict[str, Any],
    sizes: tuple[int, ...] = SIZES,
    *,
    router_mb: int | None = None,
    write_concurrency: int = DEFAULT_WRITE_CONCURRENCY,
) -> list[dict[str, Any]]:
    router, pusher = counted["router"], counted["pusher"]
    writes = router["calls"].get("dynamodb.BatchWriteItem", 0.0)
    sends = router["calls"].get("sqs.SendMessageBatch", 0.0)
    # the rest is once a batch: counted per subscriber of the counted run, so times its size
    fixed_calls = (router["calls_per_subscriber"] - writes - sends) * counted["subscribers"]
    lanes = get_config().push.lanes
    vcpu = min(1.0, router_mb / FULL_VCPU_MB) if router_mb is not None else _vcpu("router")
    rows = []
    for n in sizes:
        router_s = (
            n * writes * CALL_S / write_concurrency
            + handoff_s(n, router["handoff_bytes_per_subscriber"], lanes)
            # the batch's own reads and writes, one after the other
            + fixed_calls * CALL_S
            + n * router["cpu_ms_per_subscriber"] / 1000 / vcpu
        )
        per_session_io = pusher["calls_per_subscriber"] * CALL_S / PUSH_PARALLELISM
        per_session_cpu = pusher["cpu_ms_per_subscriber"] / 1000 / _vcpu("pusher")
        worker_rate = 1 / max(per_session_io, per_session_cpu)
        rate = min(PUSH_CONCURRENCY * worker_rate, POST_RATE)
        push_s = n / rate
        parts = max(1, min(MAX_PARTS, n // PIPELINE_SESSIONS))
        # pushes start once the first part is written and run beside the later parts
        total = (
            POLL_WAIT_S + QUEUE_HOP_S + max(router_s + push_s / parts, router_s / parts + push_s)
        )
        rows.append(
            {
                "subscribers": n,
                "router_s": round(router_s, 2),
                "worker_sessions_per_s": round(worker_rate, 1),
                "push_rate_per_s": round(rate),
                "bound_by": "API Gateway's rate"
                if rate >= POST_RATE
                else ("the workers' CPU" if per_session_cpu > per_session_io else "round trips"),
                "push_s": round(push_s, 2),
                "last_reached_s": round(total, 2),
            }
        )
    return rows


def run() -> dict[str, Any]:
    counted = count()
    return {
        "counted": counted,
        "call_s": CALL_S,
        "post_rate": POST_RATE,
        "push_concurrency": PUSH_CONCURRENCY,
        "push_parallelism": PUSH_PARALLELISM,
        "write_concurrency": DEFAULT_WRITE_CONCURRENCY,
        "router_mb": DEPLOYMENT.function("router").memory_mb,
        "pusher_mb": DEPLOYMENT.function("pusher").memory_mb,
        "model": model(counted),
        "router_cpu_ms_at_goal": router_cpu_at_goal(counted),
        # what a full-vCPU router writing 16 at once would do, when the stack declares less
        "model_full_vcpu_router": model(counted, router_mb=FULL_VCPU_MB, write_concurrency=16)
        if DEPLOYMENT.function("router").memory_mb < FULL_VCPU_MB or DEFAULT_WRITE_CONCURRENCY < 16
        else [],
    }


def report(figures: dict[str, Any]) -> str:
    counted = figures["counted"]
    lines = [
        "## One message to many connected subscribers, deployed (fanout)",
        "",
        "`python -m bench fanout`: the real `router` and `pusher` over in-process moto, "
        f"{counted['subscribers']:,} subscribers of one filter, each connected; one publish "
        "(after a warm one). Counted per subscriber, then modeled for a deployed stack: "
        f"{figures['call_s'] * 1000:.0f} ms an AWS call, the router's inbox writes "
        f"{figures['write_concurrency']} at once, {figures['push_concurrency']} pusher workers "
        f"(the stack's default `pushConcurrency`) of {figures['push_parallelism']} threads, "
        f"CPU scaled to the functions' memory ({figures['router_mb']} MB router, "
        f"{figures['pusher_mb']} MB pusher; a vCPU at {FULL_VCPU_MB:,} MB), the account's "
        f"default API Gateway rate of {figures['post_rate']:,} posts a second, the mapping's "
        "half-second wait before the router.",
        "",
    ]
    for function in ("router", "pusher"):
        f = counted[function]
        calls = ", ".join(f"{k} {v:.3f}" for k, v in f["calls"].items())
        lines.append(
            f"- {function}: {f['invocations']} invocation(s); "
            f"{f['calls_per_subscriber']:.3f} AWS calls a subscriber ({calls}); "
            f"{f['cpu_ms_per_subscriber']:.2f} ms of CPU a subscriber; "
            f"{f['wall_s_in_process']:.1f} s in process."
        )
    for title, rows in (
        ("The stack as declared", figures["model"]),
        (
            f"A router of {FULL_VCPU_MB:,} MB (a full vCPU) writing 16 at once",
            figures.get("model_full_vcpu_router") or [],
        ),
    ):
        if not rows:
            continue
        lines += [
            "",
            f"{title}:",
            "",
            "| subscribers | router s | a worker's sessions/s | push rate /s | bound by "
            "| pushes s | last reached s |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            lines.append(
                f"| {r['subscribers']:,} | {r['router_s']} | {r['worker_sessions_per_s']:,} "
                f"| {r['push_rate_per_s']:,} | {r['bound_by']} | {r['push_s']} "
                f"| **{r['last_reached_s']}** |"
            )
        big = next((r for r in rows if r["subscribers"] == 100_000), None)
        if big is not None:
            met = big["last_reached_s"] <= GOAL_S
            share = big["push_rate_per_s"] / figures["post_rate"]
            lines += [
                "",
                f"Goal (issue 46), 100,000 subscribers within {GOAL_S:g} s at two thirds of "
                f"the account's rate or better: {big['last_reached_s']} s at {share:.0%} of "
                "the rate, " + ("met." if met and share >= GOAL_RATE_SHARE else "missed."),
            ]
    margin = figures.get("router_cpu_ms_at_goal")
    if margin is not None:
        lines += [
            "",
            "The router's CPU decides it (the writes, 16 at once, are 2.5 s of 100,000 "
            "subscribers; the hand-off packed by bytes, "
            f"{counted['router']['handoff_bytes_per_subscriber']:.0f} bytes a subscriber, "
            "well under a second): 100,000 are reached within the goal while it stays under "
            f"{margin:.2f} ms a subscriber at the declared memory; this run measured "
            f"{counted['router']['cpu_ms_per_subscriber']:.2f} ms (a loaded shared machine "
            "has measured up to 0.31).",
        ]
    lines.append("")
    return "\n".join(lines)


def router_cpu_at_goal(counted: dict[str, Any], n: int = 100_000) -> float:
    """The router's CPU a subscriber (ms) at which ``n`` subscribers take ``GOAL_S``."""
    low, high = 0.0, 10.0
    for _ in range(40):
        middle = (low + high) / 2
        trial = {**counted, "router": {**counted["router"], "cpu_ms_per_subscriber": middle}}
        if model(trial, (n,))[0]["last_reached_s"] <= GOAL_S:
            low = middle
        else:
            high = middle
    return low
