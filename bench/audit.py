"""Audit over generated archives: PySpark local[2] against one plain Python process.

For each size (delivery events; default 1M and 5M, ``BENCH_AUDIT_SIZES=200000`` for a quick
run) an archive is generated on disk exactly as ``shoal pipeline sync`` leaves one: messages
(one per ~3 events) spread over 20 sessions and 64 ordering keys, each routed, delivered and
acked, with 5% redelivered and planted faults (0.1% never acked, 0.05% acked under a second
delivery id, 0.05% acked out of order). Both implementations audit the same folder in the
same run and must agree on lost, duplicated and reordered (the planted counts).

The archive is generated once per size and kept under /tmp (``BENCH_AUDIT_CACHE``), compacted
to Parquet by the pipeline's ``compact``. Each measurement runs in a child process of its own:
Spark in a fresh JVM with a fixed heap (``-Xmx2g`` through ``spark.driver.memory``), its
start-up timed apart, local[2] at every size and, at the largest, local[1] pinned to one CPU
in runs alternating with more local[2] ones (scaling: the fastest run of each); the Python
baseline reads the JSON lines, GC tuned. Reported: seconds, the ratio (Python / Spark),
CPU seconds per million events (the input of docs/pipeline.md's cost estimate), peak resident
memory of the JVM and of the Python process.
"""

from __future__ import annotations

import gc
import json
import os
import random
import resource
import shutil
import subprocess
import sys
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
    # the baseline at its best: what is loaded stays out of the collector's way, and the
    # young generation is collected every 100,000 allocations instead of 700 (the millions of
    # small tuples and dicts it keeps would otherwise be traced again and again)
    gc.freeze()
    gc.set_threshold(100_000, 50, 100)
    started = time.perf_counter()
    result = python_audit(Path(root))
    seconds = time.perf_counter() - started
    totals = {k: sum(r[k] for r in result.values()) for k in ("lost", "duplicated", "reordered")}
    cpu = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"seconds": seconds, "cpu_s": cpu.ru_utime + cpu.ru_stime, **totals}))


def _child(code: str, env: dict[str, str] | None = None) -> tuple[dict[str, Any], float]:
    """Run ``code`` in a Python child of its own; its JSON answer and its peak RSS (MB)."""
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        cwd=Path(__file__).resolve().parent.parent,
        env={**os.environ, **(env or {})},
    )
    assert child.stdout is not None
    output = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"the benchmark child failed: {code}")
    figures: dict[str, Any] = json.loads(output.decode().strip().splitlines()[-1])
    return figures, round(usage.ru_maxrss / 1024, 1)


def _run_python(root: Path) -> dict[str, Any]:
    """The Python audit in a child process of its own, for a clean peak-memory figure."""
    figures, peak = _child(f"from bench.audit import _python_child; _python_child({str(root)!r})")
    figures["peak_rss_mb"] = peak
    return figures


def _jvm_pid(spark: Any) -> int | None:
    try:
        return int(spark.sparkContext._gateway.proc.pid)
    except AttributeError:
        return None


def _jvm_peak_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024, 1)
    return None


def _jvm_cpu_s(pid: int | None) -> float:
    """User + system CPU seconds of the JVM so far (every local executor thread is in it)."""
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _spark_child(root: str, master: str, horizon_ms: int = HORIZON_MS) -> None:
    """Two audits in a fresh JVM: the first pays the JVM's warm-up (class loading, Spark's code
    generation, the JIT compiling both: a cost per job, whatever its size); the second, over
    new DataFrames (nothing cached or shuffled is reused), is the cost per event once warm."""
    started = time.perf_counter()
    from pipeline.audit import AuditWindow, audit, report
    from pipeline.columnar import read_events_and_names, read_messages
    from pipeline.common import spark_session

    spark = spark_session("shoal-bench-audit", master=master)
    jvm_start_s = time.perf_counter() - started
    pid = _jvm_pid(spark)
    runs = []
    for _ in range(2):
        cpu_before = _jvm_cpu_s(pid) + time.process_time()
        started = time.perf_counter()
        events, names = read_events_and_names(spark, root)
        result = audit(
            read_messages(spark, root), events, AuditWindow(horizon_ms=horizon_ms), names=names
        )
        doc = report(result)
        runs.append(
            (time.perf_counter() - started, _jvm_cpu_s(pid) + time.process_time() - cpu_before)
        )
        # the cached pairs stay in the session's cache manager whatever frame derived from them is
        # dropped, and a later audit of the same inputs would read them (its plan is the same):
        # the warm audit must compute, not reuse
        spark.catalog.clearCache()
    totals = doc["totals"]
    print(
        json.dumps(
            {
                "jvm_start_s": jvm_start_s,
                "audit_s": runs[0][0],
                "cpu_s": runs[0][1],
                "warm_audit_s": runs[1][0],
                "warm_cpu_s": runs[1][1],
                "jvm_peak_rss_mb": _jvm_peak_mb(pid),
                "jvm_heap": spark.conf.get("spark.driver.memory"),
                "found": {k: totals[k] for k in ("lost", "duplicated", "reordered")},
            }
        )
    )
    spark.stop()


def _compact_child(root: str) -> None:
    started = time.perf_counter()
    from pipeline.columnar import compact
    from pipeline.common import spark_session

    spark = spark_session("shoal-bench-compact")
    jvm_start_s = time.perf_counter() - started
    started = time.perf_counter()
    done = compact(spark, root)
    print(
        json.dumps(
            {
                "jvm_start_s": jvm_start_s,
                "compact_s": time.perf_counter() - started,
                "hours": sum(c.hours for c in done),
            }
        )
    )
    spark.stop()


def _size_mb(folder: Path) -> float:
    return round(sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 2**20, 1)


def archive(size: int) -> tuple[Path, dict[str, int], dict[str, Any]]:
    """The generated archive of ``size`` events, compacted: made once, then kept under
    /tmp (the machine is shared: a 5M archive takes minutes to write). ``BENCH_AUDIT_CACHE``
    names another folder."""
    cache = Path(os.environ.get("BENCH_AUDIT_CACHE", "/tmp/shoal-bench-audit"))
    root = cache / f"{size}-v3"
    done = root / "planted.json"
    if not done.exists():
        shutil.rmtree(root, ignore_errors=True)
        started = time.perf_counter()
        made: dict[str, Any] = dict(generate(root, size))
        made["generate_s"] = round(time.perf_counter() - started, 2)
        compacted, _ = _child(
            f"from bench.audit import _compact_child; _compact_child({str(root)!r})"
        )
        made["compact_s"] = round(compacted["compact_s"], 2)
        done.write_text(json.dumps(made))
    planted = json.loads(done.read_text())
    sizes_mb = {
        "json_mb": _size_mb(root / "messages") + _size_mb(root / "events"),
        "parquet_mb": _size_mb(root / "parquet"),
    }
    return root, planted, sizes_mb


def recorder_cost(invocations: int = 200, events_per_invocation: int = 10) -> dict[str, Any]:
    """What ``shoal.delivery.events`` adds to one invocation: ``add`` per event and the one
    ``flush`` (a PutRecords to the event log) against in-process moto Kinesis. On AWS the
    PutRecords is a network round trip instead (typically tens of milliseconds), paid once per
    invocation."""
    import boto3
    from moto import mock_aws
    from shoal.core.clock import SystemClock
    from shoal.delivery.events import Recording

    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    with mock_aws():
        kinesis = boto3.client(
            "kinesis",
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )
        kinesis.create_stream(StreamName="events.bench", ShardCount=1)
        recording = Recording("events.bench", SystemClock(), kinesis)
        add_s = flush_s = 0.0
        for n in range(invocations):
            recorder = recording.new()
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


def _spark(root: Path, master: str, cpus: set[int] | None = None) -> dict[str, Any]:
    """``cpus``: the only CPUs the child may run on (the JVM it starts inherits them)."""
    pin = f"import os; os.sched_setaffinity(0, {sorted(cpus)!r}); " if cpus else ""
    figures, peak = _child(
        f"{pin}from bench.audit import _spark_child; _spark_child({str(root)!r}, {master!r})",
        # a fixed heap: the audit must fit in it at every size
        {"SHOAL_SPARK_DRIVER_MEMORY": "2g"},
    )
    figures["python_driver_peak_rss_mb"] = peak
    return figures


#: one core against two, measured this many times each, alternating (the machine's speed
#: drifts by 10-20% between runs: one pair alone can miss or make the figure by that much)
SCALING_PAIRS = 2


def scaling(root: Path, two: dict[str, Any]) -> dict[str, Any]:
    """local[1] with the whole process (JIT compiler, GC and driver threads too) on one CPU,
    as on a one-vCPU worker, against local[2] on two, in alternating runs (``two`` is the
    first local[2] one): the scaling is the fastest local[1] run over the fastest local[2]
    run, first and warm audits apart."""
    one_cpu = {min(os.sched_getaffinity(0))}
    ones, twos = [], [two]
    for n in range(SCALING_PAIRS):
        ones.append(_spark(root, "local[1]", one_cpu))
        if n + 1 < SCALING_PAIRS:
            twos.append(_spark(root, "local[2]"))

    def fastest(runs: list[dict[str, Any]], key: str) -> float:
        return min(float(r[key]) for r in runs)

    return {
        "cpus": len(os.sched_getaffinity(0)),
        "spark_local1_runs_s": [round(r["audit_s"], 2) for r in ones],
        "spark_local1_warm_runs_s": [round(r["warm_audit_s"], 2) for r in ones],
        "spark_local2_runs_s": [round(r["audit_s"], 2) for r in twos],
        "spark_local2_warm_runs_s": [round(r["warm_audit_s"], 2) for r in twos],
        "scaling_1_to_2": round(fastest(ones, "audit_s") / fastest(twos, "audit_s"), 2),
        "warm_scaling_1_to_2": round(
            fastest(ones, "warm_audit_s") / fastest(twos, "warm_audit_s"), 2
        ),
    }


def run() -> dict[str, Any]:
    figures: dict[str, Any] = {"horizon_ms": HORIZON_MS, "recorder": recorder_cost(), "runs": {}}
    largest = max(sizes())
    for size in sorted(sizes()):
        root, planted, on_disk = archive(size)
        rows = planted["messages"] + planted["events"]
        two = _spark(root, "local[2]")
        python = _run_python(root)
        found_python = {k: python[k] for k in ("lost", "duplicated", "reordered")}
        run = {
            **planted,
            **on_disk,
            "rows": rows,
            "jvm_start_s": round(two["jvm_start_s"], 2),
            "spark_s": round(two["audit_s"], 2),
            "spark_rows_per_s": round(rows / two["audit_s"]),
            "spark_cpu_s": round(two["cpu_s"], 1),
            "spark_cpu_s_per_million_events": round(two["cpu_s"] / (planted["events"] / 1e6), 2),
            "spark_warm_s": round(two["warm_audit_s"], 2),
            "spark_warm_cpu_s": round(two["warm_cpu_s"], 1),
            "spark_warm_cpu_s_per_million_events": round(
                two["warm_cpu_s"] / (planted["events"] / 1e6), 2
            ),
            "warm_ratio": round(python["seconds"] / two["warm_audit_s"], 2),
            "jvm_heap": two["jvm_heap"],
            "spark_peak_rss_mb": two["jvm_peak_rss_mb"],
            "python_s": round(python["seconds"], 2),
            "python_cpu_s": round(python["cpu_s"], 1),
            "python_rows_per_s": round(rows / python["seconds"]),
            "python_peak_rss_mb": python["peak_rss_mb"],
            "ratio": round(python["seconds"] / two["audit_s"], 2),
            "spark_found": two["found"],
            "python_found": found_python,
            # planted faults next to other faults of the same key can hide each other,
            # so the figure that must hold is that both implementations agree
            "agree": two["found"] == found_python,
        }
        if size == largest:
            run.update(scaling(root, two))
        figures["runs"][str(size)] = run
    return figures


def _runs(seconds: list[float]) -> str:
    return ", ".join(str(x) for x in seconds)


def report(figures: dict[str, Any]) -> str:
    lines = [
        "## Audit: PySpark local[2] over the compacted archive vs one Python process",
        "",
        "Generated archives (messages + delivery events, 20 sessions, 64 keys, planted losses, "
        "duplicates and reorderings), compacted to Parquet once; both implementations audit "
        "the same archive in the same run, each in a process of its own. Spark: a fresh JVM "
        "with a fixed 2 GB heap (`-Xmx2g`), its start-up reported apart; the audit time "
        "includes reading, judging every pair and the report's collects; first: the first audit "
        "in the JVM (its warm-up included), warm: a second audit in it over new DataFrames. "
        "Python: the JSON "
        "lines in one process, GC tuned (`gc.freeze`, threshold 100,000). ratio = Python time "
        "/ Spark time. CPU: the JVM's and the driver's user + system seconds during the audit.",
        "",
        "| events | JSON MB | Parquet MB | JVM start s | Spark first s | Spark warm s "
        "| CPU s/M events first / warm | JVM peak MB | Python s | Python CPU s | Python peak MB "
        "| ratio first / warm | findings agree |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for size, r in figures["runs"].items():
        lines.append(
            f"| {int(size):,} | {round(r['json_mb'], 1)} | {r['parquet_mb']} | {r['jvm_start_s']} "
            f"| {r['spark_s']} | {r.get('spark_warm_s')} "
            f"| {r['spark_cpu_s_per_million_events']} / "
            f"{r.get('spark_warm_cpu_s_per_million_events')} "
            f"| {r['spark_peak_rss_mb']} | {r['python_s']} | {r.get('python_cpu_s')} "
            f"| {r['python_peak_rss_mb']} | {r['ratio']}x / {r.get('warm_ratio')}x | {r['agree']} |"
        )
    for size, r in figures["runs"].items():
        if "scaling_1_to_2" in r:
            lines += [
                "",
                f"Scaling at {int(size):,} events, one core to two, the fastest of "
                f"{len(r['spark_local1_runs_s'])} alternating runs each: local[1] with its JVM "
                f"pinned to one CPU {_runs(r['spark_local1_runs_s'])} s, local[2] on "
                f"{r['cpus']} CPUs {_runs(r['spark_local2_runs_s'])} s: "
                f"**{r['scaling_1_to_2']}x** first; warm {_runs(r['spark_local1_warm_runs_s'])} s "
                f"and {_runs(r['spark_local2_warm_runs_s'])} s: "
                f"**{r['warm_scaling_1_to_2']}x**.",
            ]
    rec = figures.get("recorder")
    if rec:
        lines += [
            "",
            f"Delivery-event recorder, per invocation of {rec['events_per_invocation']} events: "
            f"{rec['add_us_per_event']} us per `add`, one `flush` (PutRecords) "
            f"{rec['flush_ms_moto']} ms against in-process moto.",
        ]
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    result = run()
    print(json.dumps(result, indent=2))
    print(report(result))
