"""The client's batching: messages/s and requests per message over a real ``shoal dev``.

Side by side in one run, on one ``shoal dev`` (this checkout, 2 partitions):

- **shoal publish -l**: 10,000 lines on stdin to ``shoal publish -l`` (a subprocess, interpreter
  start included), batched by the defaults (100 messages or 10 ms), against the same command
  with ``--batch-size 1`` (one ``POST /v1/messages`` a line) over 1,000 lines;
- **client batching**: ``ShoalClient.batch_publisher()`` in this process, 10,000 messages,
  against ``ShoalClient.publish`` (one request a message, the client's way before batching) over
  1,000 messages.

Every message is published exactly once with a sequence number, and each run's state file is
fsynced once per request; the requests are counted by the client (``-d`` for the command). The
one-per-message side runs a tenth of the messages: its rate is what is compared.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.delivery import _dev_server, _environment, _shoal, _token

LINES = 10_000
SINGLE = 1_000


def _cli(url: str, token: str, state: Path, lines: int, batch_size: int | None) -> dict[str, Any]:
    args = [*_shoal(), "publish", "--url", url, "--token", token, "--state", str(state)]
    args += ["-t", "bench/cli", "-l", "-d"]
    if batch_size is not None:
        args += ["--batch-size", str(batch_size)]
    data = "".join(f"reading {n}\n" for n in range(lines)).encode()
    started = time.perf_counter()
    done = subprocess.run(
        args, input=data, capture_output=True, check=True, timeout=1800, env=_environment()
    )
    seconds = time.perf_counter() - started
    published = done.stdout.count(b"\n")
    found = re.search(rb"(\d+) message\(s\) in (\d+) request\(s\)", done.stderr)
    requests = int(found.group(2)) if found else 0
    return {
        "messages": published,
        "seconds": round(seconds, 3),
        "messages_per_s": round(published / seconds, 1),
        "requests_per_message": round(requests / published, 4),
    }


def _library(url: str, token: str, state: Path, messages: int, batched: bool) -> dict[str, Any]:
    from shoal.client.http import ShoalClient

    with ShoalClient(url, token, state=state) as client:
        started = time.perf_counter()
        if batched:
            with client.batch_publisher() as publisher:
                futures = [
                    publisher.publish("bench/lib", text=f"reading {n}") for n in range(messages)
                ]
            for future in futures:
                future.result()
        else:
            for n in range(messages):
                client.publish("bench/lib", text=f"reading {n}")
        seconds = time.perf_counter() - started
        requests = client.requests_sent
    return {
        "messages": messages,
        "seconds": round(seconds, 3),
        "messages_per_s": round(messages / seconds, 1),
        "requests_per_message": round(requests / messages, 4),
    }


def run() -> dict[str, Any]:
    with _dev_server() as (url, state_dir), tempfile.TemporaryDirectory() as tmp:
        token = _token(state_dir)
        folder = Path(tmp)
        cli_batched = _cli(url, token, folder / "cli-batched.json", LINES, None)
        cli_single = _cli(url, token, folder / "cli-single.json", SINGLE, 1)
        lib_batched = _library(url, token, folder / "lib-batched.json", LINES, True)
        lib_single = _library(url, token, folder / "lib-single.json", SINGLE, False)
    return {
        "cli": {
            "batched": cli_batched,
            "one_per_message": cli_single,
            "speedup": round(cli_batched["messages_per_s"] / cli_single["messages_per_s"], 2),
        },
        "client": {
            "batched": lib_batched,
            "one_per_message": lib_single,
            "speedup": round(lib_batched["messages_per_s"] / lib_single["messages_per_s"], 2),
        },
    }


def report(figures: dict[str, Any]) -> str:
    rows = []
    for name, label in (
        ("cli", "`shoal publish -l` over stdin"),
        ("client", "`ShoalClient` in process"),
    ):
        ways = (("batched", "batched (100 / 10 ms)"), ("one_per_message", "one a request"))
        for way, text in ways:
            f = figures[name][way]
            rows.append(
                f"| {label} | {text} | {f['messages']:,} | {f['messages_per_s']:,.0f} | "
                f"{f['requests_per_message']} |"
            )
    return (
        "## Client batching\n\n"
        "Exactly-once publishes over one `shoal dev` (2 partitions), batched as Google Pub/Sub's "
        "publisher does (by count, bytes and delay, over `POST /v1/messages:batch`) against one "
        "request a message, in one run. The command's time includes its interpreter start.\n\n"
        "| how | requests | messages | messages/s | requests/message |\n"
        "|---|---|---:|---:|---:|\n" + "\n".join(rows) + "\n\n"
        f"Batching is {figures['cli']['speedup']}x the messages/s of one request a message for "
        f"`shoal publish -l`, {figures['client']['speedup']}x for the client.\n"
    )
