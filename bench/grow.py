"""Growing a topic: from switch-produce to the first delivery from the new storage topic.

Over a real ``shoal dev`` run as a user runs it (this checkout, the reaper on its default
one-minute schedule, no ``SHOAL_SEAL_GRACE_S``): a topic of 2 partitions, a session subscribed
to it, one message per ordering key in the old storage topic. Then, per round, a storage
topic is added (not timed) and the clock starts as ``switch-produce`` is sent; when it answers,
one message is published (it lands in the new storage topic), and the session's long-polling
gets wait for it. Measured: how long the switch call took (it seals what it left behind once no
put routed before the switch can land: the 2 s until the switch is in effect plus the 11 s
grace), and the time from sending the switch to the first delivery of a message of the new
storage topic.
"""

from __future__ import annotations

import base64
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.delivery import _dev_server, _environment, _request, _shoal, _token

ROUNDS = 3
TOPIC = "grow"


def _admin(state: Path) -> str:
    args = [*_shoal(), "token", "--sub", "ops", "--admin", "--state-dir", str(state)]
    done = subprocess.run(args, capture_output=True, check=True, timeout=60, env=_environment())
    return done.stdout.decode().strip().splitlines()[-1]


def _call(url: str, method: str, path: str, token: str, body: Any = None, **kw: Any) -> Any:
    status, answer = _request(url, method, path, token, body, **kw)
    if status >= 300:
        raise RuntimeError(f"{method} {path}: {status} {answer}")
    return answer


def run() -> dict[str, Any]:
    rounds: list[dict[str, Any]] = []
    with _dev_server() as (url, state):
        admin, token = _admin(state), _token(state)
        _call(url, "POST", "/v1/topics", admin, {"name": TOPIC, "partitions": 2})
        channel = _call(url, "PUT", "/v1/sessions/bench-grow", token, {})["channel"]
        session = "/v1/sessions/bench-grow"
        subscription = {"subscriptions": [{"filter": f"{TOPIC}/#", "qos": 1}]}
        _call(url, "POST", f"{session}/subscriptions", token, subscription, channel=channel)
        for n in range(ROUNDS):
            for key in ("a", "b"):
                body = {"topic": f"{TOPIC}/{key}", "text": f"old-{n}-{key}", "ordering_key": key}
                _call(url, "POST", "/v1/messages", token, body)
            _call(url, "POST", f"/v1/topics/{TOPIC}/storage-topics", admin, {"partitions": 2})
            started = time.perf_counter()
            switched = _call(url, "POST", f"/v1/topics/{TOPIC}/switch-produce", admin)
            answered = time.perf_counter() - started
            new_text = f"new-{n}"
            body = {"topic": f"{TOPIC}/a", "text": new_text, "ordering_key": "a"}
            published = _call(url, "POST", "/v1/messages", token, body)
            assert published["storage_topic"] == switched["produce_pointer"], published
            delivered = None
            got: list[str] = []
            while delivered is None and time.perf_counter() - started < 180:
                answer = _call(
                    url, "GET", f"{session}/messages?max=100&wait_ms=1000", token, channel=channel
                )
                messages = answer["messages"]
                if messages:
                    ids = {"ids": [m["id"] for m in messages]}
                    _call(url, "POST", f"{session}/acks", token, ids, channel=channel)
                got += [base64.b64decode(m["payload"]).decode() for m in messages]
                if new_text in got:
                    delivered = time.perf_counter() - started
            if delivered is None:
                raise RuntimeError(f"round {n}: the new storage topic's message never came")
            # per-key order across the switch: key a's message of the old storage topic first
            assert got.index(f"old-{n}-a") < got.index(new_text), got
            rounds.append(
                {
                    "switch_call_s": round(answered, 2),
                    "switch_to_first_delivery_s": round(delivered, 2),
                }
            )
    firsts = [r["switch_to_first_delivery_s"] for r in rounds]
    return {
        "rounds": rounds,
        "switch_to_first_delivery_s_median": round(statistics.median(firsts), 2),
        "switch_to_first_delivery_s_max": max(firsts),
        "before": "128 s (issue 34: the 120 s grace plus up to a reaper period)",
    }


def report(figures: dict[str, Any]) -> str:
    rows = "\n".join(
        f"| {n + 1} | {r['switch_call_s']} | {r['switch_to_first_delivery_s']} |"
        for n, r in enumerate(figures["rounds"])
    )
    median = figures["switch_to_first_delivery_s_median"]
    worst = figures["switch_to_first_delivery_s_max"]
    return f"""## Growing a topic: switch-produce to the first delivery from the new storage topic

`shoal dev` as a user runs it (reaper on its one-minute schedule, no `SHOAL_SEAL_GRACE_S`), a
topic of 2 partitions grown by one storage topic of 2 partitions per round; a session
long-polls (`wait_ms=1000`). The clock starts when `switch-produce` is sent; one message is
published as soon as it answers. The switch call seals the storage topic it left behind once no
put routed before the switch can land (2 s until in effect + 11 s grace: the publish path's
10 s bound on a put after routing, plus 1 s of clock skew).

| round | switch-produce answered (s) | switch to first delivery from the new storage topic (s) |
|---|---|---|
{rows}

Median {median} s, worst {worst} s; before this change: {figures["before"]}.
"""
