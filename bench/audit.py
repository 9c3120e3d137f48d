"""Audit over generated archives: PySpark local[2] against one plain Python process.

For each size (delivery events; default 1M and 5M, ``BENCH_AUDIT_SIZES=200000`` for a quick
run) an archive is generated on disk exactly as ``shoal pipeline sync`` leaves one: messages
(one per ~3 events) spread over 20 sessions and 64 ordering keys, each routed, delivered and
acked, with 5% redelivered and planted faults (0.1% never acked, 0.05% acked under a second
delivery id, 0.05% acked out of order). Both implementations audit the same folder in the
same run and must agree on lost, duplicated and reordered (the planted counts).

Reported: rows (messages + events) per second for each, the ratio (Spark / Python), and peak
resident memory: the Spark JVM's high-water mark (its driver runs the local executors) and the
Python process's, measured in a child process of its own.
"""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import IO, Any

T0 = 1_700_000_000_000
CONSUMERS = 20
KEYS = 64
LINES_PER_FILE = 250_000
HORIZON_MS = 300_000
DEFAULT_SIZES = (1_000_000, 5_000_000)


def sizes() -> list[int]:
    raw = os.environ.get("BENCH_AUDIT_SIZES")
    return [int(s) for s in raw.split(",")] if raw else list(DEFAULT_SIZES)


class _Files:
    """JSON lines in files of LINES_PER_FILE, so local[2] reads in parallel."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.count = 0
        self.lines = 0
        self._out: IO[str] | None = None
        self.total = 0

    def write(self, line: str) -> None:
        if self._out is None or self.lines >= LINES_PER_FILE:
            if self._out is not None:
                self._out.close()
            self._out = open(self.folder / f"part-{self.count:05d}.jsonl", "w")  # noqa: SIM115
            self.count += 1
            self.lines = 0
        self._out.write(line)
        self.lines += 1
        self.total += 1

    def close(self) -> None:
        if self._out is not None:
            self._out.close()


def generate(root: Path, events: int, seed: int = 7) -> dict[str, int]:
    """An archive of about ``events`` delivery events; the planted fault counts."""
    rng = random.Random(seed)
    messages = events * 100 // 315
    out_m = _Files(root / "messages" / "topic=default" / "date=2023-11-14" / "hour=22")
    out_e = _Files(root / "events" / "date=2023-11-14" / "hour=22")
    planted = {"lost": 0, "duplicated": 0, "reordered": 0}
    ordinals = [0] * CONSUMERS
    held_back: dict[int, tuple[str, int]] = {}
    for n in range(messages):
        key = n % KEYS
        published = T0 + n * 20
        mid = f"m{n:09d}"
        out_m.write(
            f'{{"message_id":"{mid}","topic":"t/{key}","composite_topic":"default",'
            f'"storage_topic":0,"stream":"shoal-default-0","shard_id":"shardId-0",'
            f'"sequence_number":"{1000 + n}","position":0,"published_at":{published},'
            f'"qos":1,"retain":false,"ordering_key":"k{key}","publisher":"p",'
            f'"payload":"aGVsbG8="}}\n'
        )
        consumer = key % CONSUMERS  # a key's messages all go to one session
        name = f"s{consumer:02d}"
        ordinal = ordinals[consumer]
        ordinals[consumer] += 1
        did = f"{name}.{ordinal}"
        at = published + 5
        out_e.write(
            f'{{"event":"routed","consumer_kind":"session","consumer":"{name}",'
            f'"message_id":"{mid}","at":{at},"seq":0,"batch":"r"}}\n'
        )
        out_e.write(
            f'{{"event":"delivered","consumer_kind":"session","consumer":"{name}",'
            f'"message_id":"{mid}","delivery_id":"{did}","qos":1,"at":{at + 10},'
            f'"seq":0,"batch":"g"}}\n'
        )
        roll = rng.random()
        if roll < 0.05:
            out_e.write(
                f'{{"event":"redelivered","consumer_kind":"session","consumer":"{name}",'
                f'"message_id":"{mid}","delivery_id":"{did}","qos":1,"at":{at + 20},'
                f'"seq":0,"batch":"g"}}\n'
            )
        if 0.05 <= roll < 0.051 and n < messages * 0.3:
            planted["lost"] += 1
            continue
        ack_at = at + 30 + rng.randrange(0, 50)
        if 0.051 <= roll < 0.0515 and n < messages * 0.6 and key not in held_back:
            # acked after the next message of its key (published KEYS * 20 ms later)
            late = ack_at + KEYS * 20 * 2
            held_back[key] = (did, late)
            planted["reordered"] += 1
            out_e.write(
                f'{{"event":"acked","consumer_kind":"session","consumer":"{name}",'
                f'"delivery_id":"{did}","at":{late},"seq":0,"batch":"a"}}\n'
            )
            continue
        held_back.pop(key, None)
        out_e.write(
            f'{{"event":"acked","consumer_kind":"session","consumer":"{name}",'
            f'"delivery_id":"{did}","at":{ack_at},"seq":0,"batch":"a"}}\n'
        )
        if 0.0515 <= roll < 0.052:
            planted["duplicated"] += 1
            again = f"{name}.{ordinals[consumer]}"
            ordinals[consumer] += 1
            out_e.write(
                f'{{"event":"delivered","consumer_kind":"session","consumer":"{name}",'
                f'"message_id":"{mid}","delivery_id":"{again}","qos":1,"at":{ack_at + 1},'
                f'"seq":0,"batch":"g"}}\n'
            )
            out_e.write(
                f'{{"event":"acked","consumer_kind":"session","consumer":"{name}",'
                f'"delivery_id":"{again}","at":{ack_at + 2},"seq":0,"batch":"a"}}\n'
            )
    out_m.close()
    out_e.close()
    return {"messages": out_m.total, "events": out_e.total, **planted}


# -- the straightforward implementation ------------------------------------------------------------


def _percentile(values: list[int], q: float) -> float | None:
    """Linear interpolation between closest ranks, as Spark's ``percentile``."""
    if not values:
        return None
    position = q * (len(values) - 1)
    low = int(position)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (position - low)


def python_audit(root: Path, horizon_ms: int = HORIZON_MS) -> dict[str, Any]:
    """The audit's definitions (pipeline/audit.py) in one process, dicts and sorting."""
    messages: dict[str, tuple[int, int, str, str, tuple[int, int, int]]] = {}
    for path in sorted((root / "messages").rglob("*.jsonl")):
        with open(path) as lines:
            for line in lines:
                m = json.loads(line)
                order = (m["storage_topic"], int(m["sequence_number"]), m["position"])
                held = messages.get(m["message_id"])
                if held is None or order < held[4]:
                    messages[m["message_id"]] = (
                        m["published_at"],
                        m["qos"],
                        m["composite_topic"],
                        m["ordering_key"],
                        order,
                    )
    seen: set[tuple[Any, ...]] = set()
    events: list[tuple[Any, ...]] = []
    delivered_ids: dict[tuple[str, str, str], str] = {}
    for path in sorted((root / "events").rglob("*.jsonl")):
        with open(path) as lines:
            for line in lines:
                e = json.loads(line)
                ident = (
                    e["event"],
                    e["consumer_kind"],
                    e["consumer"],
                    e.get("message_id", ""),
                    e.get("delivery_id"),
                    e.get("attempt"),
                    e["at"],
                )
                if ident in seen:
                    continue
                seen.add(ident)
                events.append((*ident, e.get("seq", 0), e.get("qos")))
                if (
                    e["event"] in ("delivered", "redelivered", "routed")
                    and e.get("delivery_id")
                    and e.get("message_id")
                ):
                    delivered_ids.setdefault(
                        (e["consumer_kind"], e["consumer"], e["delivery_id"]), e["message_id"]
                    )
    seen.clear()
    pairs: dict[tuple[str, str, str], dict[str, Any]] = defaultdict(
        lambda: {"acked_at": None, "ack_seq": 0, "acks": set(), "last_delivered": None,
                 "dead": 0, "dropped": 0, "qos": None}
    )  # fmt: skip
    as_of = 0
    for kind, ckind, consumer, named, did, _attempt, at, seq, qos in events:
        as_of = max(as_of, at)
        mid = named or (delivered_ids.get((ckind, consumer, did), "") if did else "")
        if not mid or mid not in messages:
            continue
        p = pairs[(ckind, consumer, mid)]
        if qos is not None:
            p["qos"] = qos if p["qos"] is None else min(p["qos"], qos)
        if kind == "acked":
            if p["acked_at"] is None or (at, seq) < (p["acked_at"], p["ack_seq"]):
                p["acked_at"], p["ack_seq"] = at, seq
            p["acks"].add(did or mid)
        elif kind in ("delivered", "redelivered"):
            p["last_delivered"] = max(p["last_delivered"] or at, at)
        elif kind == "dead_lettered":
            p["dead"] = 1
        elif kind == "dropped":
            p["dropped"] = 1
    events.clear()
    as_of = max(as_of, max((m[0] for m in messages.values()), default=0))
    ranks: dict[str, int] = {}
    by_key: dict[tuple[str, str], list[tuple[tuple[int, int, int], int, str]]] = defaultdict(list)
    for mid, (published, _q, composite, key, order) in messages.items():
        by_key[(composite, key)].append((order, published, mid))
    for members in by_key.values():
        for rank, (_, _, mid) in enumerate(sorted(members), start=1):
            ranks[mid] = rank
    summary: dict[tuple[str, str], dict[str, Any]] = defaultdict(
        lambda: {"lost": 0, "duplicated": 0, "reordered": 0, "acked": 0, "latency": []}
    )
    acks_by_key: dict[tuple[str, str, str, str], list[tuple[int, int, int]]] = defaultdict(list)
    for (ckind, consumer, mid), p in pairs.items():
        published, message_qos, composite, key, _ = messages[mid]
        row = summary[(ckind, consumer)]
        qos = p["qos"] if p["qos"] is not None else message_qos
        if len(p["acks"]) > 1:
            row["duplicated"] += 1
        if p["acked_at"] is not None:
            row["latency"].append(p["acked_at"] - published)
            acks_by_key[(ckind, consumer, composite, key)].append(
                (p["acked_at"], p["ack_seq"], ranks[mid])
            )
        if qos == 0 or p["acked_at"] is not None or p["dead"] or p["dropped"]:
            row["acked"] += p["acked_at"] is not None
            continue
        if published + horizon_ms <= as_of:
            row["lost"] += 1
    for (ckind, consumer, _c, _k), acks in acks_by_key.items():
        highest = 0
        for _at, _seq, rank in sorted(acks):
            if rank < highest:
                summary[(ckind, consumer)]["reordered"] += 1
            highest = max(highest, rank)
    out = {}
    for (ckind, consumer), row in summary.items():
        latency = sorted(row.pop("latency"))
        row["latency_ms"] = {f"p{int(q * 100)}": _percentile(latency, q) for q in (0.5, 0.9, 0.99)}
        out[f"{ckind}:{consumer}"] = row
    return out


def _python_child(root: str) -> None:
    started = time.perf_counter()
    result = python_audit(Path(root))
    seconds = time.perf_counter() - started
    totals = {k: sum(r[k] for r in result.values()) for k in ("lost", "duplicated", "reordered")}
    print(json.dumps({"seconds": seconds, **totals}))


def _run_python(root: Path) -> dict[str, Any]:
    """The Python audit in a child process of its own, for a clean peak-memory figure."""
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from bench.audit import _python_child; _python_child({str(root)!r})",
        ],
        stdout=subprocess.PIPE,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert child.stdout is not None
    output = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise RuntimeError("the Python audit failed")
    figures: dict[str, Any] = json.loads(output)
    figures["peak_rss_mb"] = round(usage.ru_maxrss / 1024, 1)
    return figures


def _jvm_peak_mb(spark: Any) -> float | None:
    try:
        pid = spark.sparkContext._gateway.proc.pid
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except (AttributeError, OSError):
        return None
    return None


def recorder_cost(invocations: int = 200, events_per_invocation: int = 10) -> dict[str, Any]:
    """What ``shoal.delivery.events`` adds to one invocation: ``add`` per event and the one
    ``flush`` (a PutObject) against in-process moto S3. On AWS the PutObject is a network
    round trip instead (typically tens of milliseconds), paid once per invocation."""
    import boto3
    from moto import mock_aws
    from shoal.core.clock import SystemClock
    from shoal.delivery.events import DeliveryEvents

    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    with mock_aws():
        s3 = boto3.client(
            "s3",
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )
        s3.create_bucket(Bucket="archive")
        add_s = flush_s = 0.0
        for n in range(invocations):
            recorder = DeliveryEvents("archive", SystemClock(), s3)
            started = time.perf_counter()
            for k in range(events_per_invocation):
                recorder.add(
                    "delivered", "session", "sess", message_id=f"m{n}.{k}",
                    delivery_id=f"sess.{k}", published_at=T0 + k, qos=1,
                )  # fmt: skip
            added = time.perf_counter()
            recorder.flush(f"get/sess/{n}")
            flush_s += time.perf_counter() - added
            add_s += added - started
    return {
        "events_per_invocation": events_per_invocation,
        "add_us_per_event": round(add_s / (invocations * events_per_invocation) * 1e6, 1),
        "flush_ms_moto": round(flush_s / invocations * 1000, 2),
    }


def run() -> dict[str, Any]:
    os.environ.setdefault("SHOAL_SPARK_DRIVER_MEMORY", "6g")
    from pipeline.audit import AuditWindow, audit, report
    from pipeline.common import read_events, read_messages, spark_session

    spark = spark_session("shoal-bench-audit")
    figures: dict[str, Any] = {"horizon_ms": HORIZON_MS, "recorder": recorder_cost(), "runs": {}}
    for size in sorted(sizes()):
        root = Path(tempfile.mkdtemp(prefix=f"shoal-bench-audit-{size}-"))
        try:
            started = time.perf_counter()
            planted = generate(root, size)
            generated_s = time.perf_counter() - started
            rows = planted["messages"] + planted["events"]

            started = time.perf_counter()
            doc = report(
                audit(
                    read_messages(spark, str(root)),
                    read_events(spark, str(root)),
                    AuditWindow(horizon_ms=HORIZON_MS),
                )
            )
            spark_s = time.perf_counter() - started
            python = _run_python(root)
            totals = doc["totals"]
            found = {k: totals[k] for k in ("lost", "duplicated", "reordered")}
            found_python = {k: python[k] for k in ("lost", "duplicated", "reordered")}
            figures["runs"][str(size)] = {
                **planted,
                "rows": rows,
                "generate_s": round(generated_s, 2),
                "spark_s": round(spark_s, 2),
                "spark_rows_per_s": round(rows / spark_s),
                "spark_peak_rss_mb": _jvm_peak_mb(spark),
                "python_s": round(python["seconds"], 2),
                "python_rows_per_s": round(rows / python["seconds"]),
                "python_peak_rss_mb": python["peak_rss_mb"],
                "ratio": round(python["seconds"] / spark_s, 2),
                "spark_found": found,
                "python_found": found_python,
                # planted faults next to other faults of the same key can hide each other,
                # so the figure that must hold is that both implementations agree
                "agree": found == found_python,
            }
        finally:
            shutil.rmtree(root, ignore_errors=True)
    figures["driver_peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    spark.stop()
    return figures


def report(figures: dict[str, Any]) -> str:
    lines = [
        "## Audit: PySpark local[2] vs one Python process",
        "",
        "Generated archives (messages + delivery events as JSON lines, 20 sessions, 64 keys, "
        "planted losses, duplicates and reorderings); both implementations audit the same "
        "folder in the same run. Spark time includes reading, judging every pair and the "
        "report's collects; ratio = Python time / Spark time. Peak RSS: the Spark JVM's "
        "high-water mark so far, and the Python audit's own process.",
        "",
        "| events | rows | Spark s | Spark rows/s | Python s | Python rows/s | ratio "
        "| JVM peak MB | Python peak MB | findings agree |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for size, r in figures["runs"].items():
        lines.append(
            f"| {int(size):,} | {r['rows']:,} | {r['spark_s']} | {r['spark_rows_per_s']:,} "
            f"| {r['python_s']} | {r['python_rows_per_s']:,} | {r['ratio']}x "
            f"| {r['spark_peak_rss_mb']} | {r['python_peak_rss_mb']} | {r['agree']} |"
        )
    rec = figures.get("recorder")
    if rec:
        lines += [
            "",
            f"Delivery-event recorder, per invocation of {rec['events_per_invocation']} events: "
            f"{rec['add_us_per_event']} us per `add`, one `flush` (PutObject) "
            f"{rec['flush_ms_moto']} ms against in-process moto.",
        ]
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    result = run()
    print(json.dumps(result, indent=2))
    print(report(result))
