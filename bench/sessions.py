"""Reconnect storm: C clients x R reconnects each, concurrently, through the sessions handler.

Every reconnect of a client races the others of the same client id (all resume the one
session, ``clean_start`` false, each with its own ``connected_at_ms``). Worker threads each
invoke their own copy of the handler module, as separate Lambda execution environments would,
against the in-process emulator with DynamoDB serialized (``shoal.local.serialize``).

Reported: connects/s, p50/p99 latency, outcomes, retries per connect, DynamoDB calls per
connect (counted) and the capacity they would consume (estimated from DynamoDB's pricing
rules for items under 1 KB), and invariant violations after the storm (must be 0): the newest
connect of each client id won; its channel is the only live one; after the other winners
disconnect, exactly one registration is left; the session was not forked.

The figures are the emulator's: moto copies a whole table for each part of every transaction,
so they say more about relative cost (calls, retries) than about DynamoDB's latency.
"""

from __future__ import annotations

import importlib.util
import json
import random
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal import wiring
from shoal.local.context import LambdaContext

from bench.account import emulated_account, item_size

CLAIMS = {"sub": "bench", "shoal:clients": "[storm-*]"}

Handler = Callable[[dict[str, Any], Any], dict[str, Any]]


class _Calls:
    """DynamoDB calls, and the capacity they would consume, across every worker's client."""

    def __init__(self) -> None:
        self.operations: Counter[str] = Counter()
        self.rcu = 0.0
        self.wcu = 0.0
        self._lock = threading.Lock()

    def watch(self, client: Any) -> None:
        # the API parameters, before they are serialized
        client.meta.events.register("before-parameter-build.dynamodb", self._record)

    def _record(self, params: dict[str, Any], model: Any, **_: Any) -> None:
        name = model.name
        rcu = wcu = 0.0
        if name in {"Query", "GetItem"}:
            # per 4 KB read: a client's partition (head and a registration or two) fits
            rcu = 1.0 if params.get("ConsistentRead") else 0.5
        elif name == "TransactWriteItems":
            parts = params.get("TransactItems", [])
            # two units per item (under 1 KB) in a transaction, and two for the head's entry
            # in the due index moving (a delete and a put of the index entry)
            wcu = 2.0 * len(parts) + 2.0
        elif name in {"UpdateItem", "DeleteItem", "PutItem"}:
            wcu = 1.0
        with self._lock:
            self.operations[name] += 1
            self.rcu += rcu
            self.wcu += wcu


def _handler_copy() -> Any:
    spec = importlib.util.find_spec("functions.sessions.app")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass
class _Connect:
    client_id: str
    connected_at_ms: int
    status: int = 0
    body: Any = None
    latency_s: float = 0.0


SAMPLE = Path(__file__).resolve().parent.parent / "events" / "sessions_connect.json"


def _context() -> LambdaContext:
    return LambdaContext("shoal-sessions", memory_mb=512, timeout_s=15, request_id="bench")


def _event(
    method: str,
    client_id: str,
    suffix: str = "",
    *,
    body: Any = None,
    channel: str | None = None,
) -> dict[str, Any]:
    """The sample connect event (events/sessions_connect.json), turned into this call."""
    event: dict[str, Any] = json.loads(SAMPLE.read_text())
    route = f"{method} /v1/sessions/{{client_id}}{suffix}"
    event["routeKey"] = event["requestContext"]["routeKey"] = route
    event["rawPath"] = event["requestContext"]["http"]["path"] = f"/v1/sessions/{client_id}{suffix}"
    event["requestContext"]["http"]["method"] = method
    event["requestContext"]["authorizer"]["jwt"]["claims"] = CLAIMS
    event["requestContext"]["timeEpoch"] = int(time.time() * 1000)
    event["pathParameters"] = {"client_id": client_id}
    event["body"] = json.dumps(body) if body is not None else None
    event["headers"].pop("content-length", None)
    if channel is not None:
        event["headers"]["shoal-channel"] = channel
    return event


def _invoke(handler: Handler, event: dict[str, Any]) -> tuple[int, Any]:
    response = handler(event, _context())
    body = response.get("body")
    return response["statusCode"], json.loads(body) if body else None


def run(clients: int = 40, reconnects: int = 8, workers: int = 16) -> dict[str, Any]:
    from shoal.core.clock import SystemClock
    from shoal.core.config import get_config
    from shoal.sessions.model import Version
    from shoal.sessions.registry import RegistryStats

    with emulated_account():
        calls = _Calls()
        stats = RegistryStats()
        clock = SystemClock()
        environments: list[Any] = []
        for _ in range(workers):
            module = _handler_copy()
            registry = wiring.session_registry(get_config(), clock)
            registry.stats = stats
            calls.watch(registry.repository.dynamo.client)
            module.registry = lambda registry=registry: registry
            environments.append(module)
        idle: list[Any] = list(environments)
        idle_lock = threading.Lock()

        def with_environment(work: Callable[[Handler], Any]) -> Any:
            with idle_lock:
                module = idle.pop()
            try:
                return work(module.handler)
            finally:
                with idle_lock:
                    idle.append(module)

        handler: Handler = environments[0].handler
        base = clock.now_ms() - 30_000
        ids = [f"storm-{n}" for n in range(clients)]
        sessions: dict[str, str] = {}
        for client_id in ids:
            body = {"clean_start": False, "session_expiry_s": 600, "connected_at_ms": base}
            status, answer = _invoke(handler, _event("PUT", client_id, body=body))
            assert status == 200, answer
            sessions[client_id] = answer["channel"]
        first_heads = {c: _head_session(registry_of(environments[0]), c) for c in ids}
        calls.operations.clear()
        calls.rcu = calls.wcu = 0.0
        stats_before = stats.as_dict()

        storm = [_Connect(c, base + 1 + r) for c in ids for r in range(reconnects)]
        random.shuffle(storm)

        def connect(item: _Connect) -> None:
            body = {"clean_start": False, "session_expiry_s": 600}
            body["connected_at_ms"] = item.connected_at_ms
            started = time.perf_counter()
            item.status, item.body = with_environment(
                lambda h: _invoke(h, _event("PUT", item.client_id, body=body))
            )
            item.latency_s = time.perf_counter() - started

        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=workers) as pool:
            list(pool.map(connect, storm))
        elapsed = time.perf_counter() - started
        operations = dict(calls.operations)
        rcu, wcu = calls.rcu, calls.wcu
        after = stats.as_dict()

        violations = _check(handler, registry_of(environments[0]), storm, first_heads, Version)
        repository = registry_of(environments[0]).repository
        raw_head = repository.dynamo.client.get_item(
            TableName=repository.table, Key={"client_id": {"S": ids[0]}, "item": {"S": "head"}}
        )["Item"]

    latencies = sorted(c.latency_s * 1000 for c in storm)
    n = len(storm)
    retries = after["retries"] - stats_before["retries"]
    return {
        "name": "sessions_reconnect_storm",
        "clients": clients,
        "reconnects_per_client": reconnects,
        "workers": workers,
        "connects": n,
        "seconds": round(elapsed, 3),
        "connects_per_s": round(n / elapsed, 1),
        "latency_ms": {
            "p50": round(statistics.median(latencies), 2),
            "p99": round(latencies[min(n - 1, int(n * 0.99))], 2),
        },
        "outcomes": dict(Counter(str(c.status) for c in storm)),
        "retries_per_connect": round(retries / n, 3),
        "dynamodb_calls_per_connect": round(sum(operations.values()) / n, 3),
        "dynamodb_calls_by_operation": operations,
        "estimated_capacity_per_connect": {"rcu": round(rcu / n, 3), "wcu": round(wcu / n, 3)},
        "head_item_bytes": item_size(raw_head),
        "invariant_violations": violations,
        "emulator": "moto in-process, DynamoDB serialized",
    }


def registry_of(module: Any) -> Any:
    return module.registry()


def _head_session(registry: Any, client_id: str) -> str | None:
    head = registry.repository.head(client_id)
    return None if head is None else head.session_id


def _check(
    handler: Handler,
    registry: Any,
    storm: list[_Connect],
    first_heads: dict[str, str | None],
    version: Any,
) -> int:
    """Count broken invariants of property 5 after the storm (each client id once per rule)."""
    violations = 0
    by_client: dict[str, list[_Connect]] = {}
    for item in storm:
        by_client.setdefault(item.client_id, []).append(item)
    for client_id, items in by_client.items():
        newest = max(items, key=lambda c: c.connected_at_ms)
        winners = [c for c in items if c.status == 200]
        violations += any(c.status not in (200, 409, 503) for c in items)
        if newest.status != 200:
            violations += 1
            continue
        live = newest.body["channel"]
        violations += any(not c.body["session_present"] for c in winners)
        for item in winners:
            status, _ = _invoke(
                handler,
                _event("POST", client_id, "/heartbeat", channel=item.body["channel"]),
            )
            violations += status != (200 if item is newest else 409)
        for item in winners:
            if item is not newest:
                _invoke(
                    handler,
                    _event("DELETE", client_id, channel=item.body["channel"]),
                )
        view = registry.repository.read(client_id, consistent=True)
        violations += view.registrations != (version.parse(live),)
        head = view.head
        violations += head is None or head.channel != live or not head.connected
        violations += head is None or head.session_id != first_heads[client_id]
    return violations


def report(figures: dict[str, Any]) -> str:
    f = figures
    outcomes = ", ".join(f"{status}: {n}" for status, n in sorted(f["outcomes"].items()))
    ops = ", ".join(f"{k} {v}" for k, v in f["dynamodb_calls_by_operation"].items())
    capacity = f["estimated_capacity_per_connect"]
    return "\n".join(
        [
            "## Reconnect storm (sessions)",
            "",
            f"{f['clients']} client ids x {f['reconnects_per_client']} reconnects each, all at "
            f"once from {f['workers']} workers, each resuming the one session of its client id "
            "through the handler (in-process moto, DynamoDB serialized).",
            "",
            "| connects | connects/s | p50 ms | p99 ms | retries/connect | DynamoDB calls/connect "
            "| RCU/connect (est.) | WCU/connect (est.) | invariant violations |",
            "|---|---|---|---|---|---|---|---|---|",
            f"| {f['connects']} | {f['connects_per_s']} | {f['latency_ms']['p50']} "
            f"| {f['latency_ms']['p99']} | {f['retries_per_connect']} "
            f"| {f['dynamodb_calls_per_connect']} | {capacity['rcu']} | {capacity['wcu']} "
            f"| {f['invariant_violations']} |",
            "",
            f"Outcomes: {outcomes} (409: channel_outdated, a newer connect existed). "
            f"Calls: {ops}. Head item: {f['head_item_bytes']} bytes.",
            "",
            "A connect that wins is one eventually consistent Query and one TransactWriteItems "
            "(the head, its registration, and the older registrations it cleans up); an outdated "
            "one is refused after the Query alone, or after a failed transaction and one strong "
            "Query. Latency is the emulator's (one lock around moto), not DynamoDB's.",
            "",
        ]
    )


if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
