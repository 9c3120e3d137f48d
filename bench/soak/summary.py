"""The soak's figures from its history: latency over time, the server's memory, open files,
threads and CPU beside the fault marks (``soak.png``), and ``summary.md``.

Latency is a delivery's receive time less its publish's first invoke (one clock), binned by
receive time into ``BIN_S`` windows: per window the p50 and p99 over all clients, and each
client's p99. A fault's recovery is the time from its end (the server answering again, the
client process started again, the connection dropped, the new token written) to the start of
the first window whose p99 is under ``RECOVERED_P99_S`` again.

The server's CPU is in cores: the CPU seconds (user and system) its process tree used between
two samples of one life (their ``cpu_s``) over the seconds between them; 1.0 is one core busy,
about all the emulator's Python work can take under the GIL. ``summary.md`` has a row per life
of the server: its resident memory and open files once settled (``SETTLED_S`` after it answers)
and at its end, its threads at the end, and its mean CPU from its first sample to its last;
and the CPU over the whole traffic. Samples of older histories read no CPU: their CPU
figures are None.
"""

from __future__ import annotations

from collections import defaultdict
from importlib import import_module
from pathlib import Path
from typing import Any

from bench.soak.checker import PROPERTIES, Report
from bench.soak.history import Record, read_history

BIN_S = 5.0
RECOVERED_P99_S = 2.0
#: the issue's baseline for memory growth: after the first 5 minutes
WARM_S = 300.0
#: a restarted server's level is read this long after it answers again
SETTLED_S = 30.0
#: the server counts as saturated from this share of one core on (the GIL's cap is one)
SATURATED_CORES = 0.9
#: (from, to, cores): the server's CPU between two consecutive samples of one life
Step = tuple[float, float, float]
FAULT_COLOURS = {
    "server_kill": "#d64545",
    "server_up": "#2f9e44",
    "client_kill": "#f08c00",
    "ws_drop": "#adb5bd",
    "token_expiry": "#7048e8",
    "grow": "#1c7ed6",
}
#: what ends each fault: recovery is counted from there
FAULT_END = {
    "server_kill": "server_up",
    "client_kill": "client_restart",
    "token_expiry": "token_renewed",
}


def _percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def latencies(records: list[Record]) -> list[tuple[float, str, float]]:
    """(received, client, seconds since the publish was first invoked) of each first delivery
    of a message to a client (retained copies aside)."""
    invoked: dict[str, float] = {}
    for record in records:
        if record["op"] == "publish" and record.get("phase") == "invoke" and record.get("mk"):
            invoked.setdefault(str(record["mk"]), float(record["t"]))
    seen: set[tuple[str, str]] = set()
    out = []
    for record in records:
        if record["op"] != "deliver" or record.get("retain"):
            continue
        mk = record.get("mk")
        if mk is None or mk not in invoked:
            continue
        key = (str(record.get("client")), str(mk))
        if key in seen:
            continue
        seen.add(key)
        out.append((float(record["t"]), key[0], float(record["t"]) - invoked[mk]))
    return out


def _bins(points: list[tuple[float, str, float]], start: float) -> dict[int, list[float]]:
    bins: dict[int, list[float]] = defaultdict(list)
    for t, _, seconds in points:
        bins[int((t - start) // BIN_S)].append(seconds)
    return bins


def _recoveries(
    faults: list[Record], bins: dict[int, list[float]], start: float
) -> list[dict[str, Any]]:
    ends: dict[str, list[Record]] = defaultdict(list)
    for fault in faults:
        ends[str(fault.get("kind"))].append(fault)
    out = []
    for fault in faults:
        kind = str(fault.get("kind"))
        if kind not in ("server_kill", "client_kill", "ws_drop", "token_expiry"):
            continue
        at = float(fault["t"])
        ended = at
        follow = FAULT_END.get(kind)
        if follow:
            later = [float(f["t"]) for f in ends[follow] if float(f["t"]) >= at]
            ended = min(later) if later else at
        first = int((ended - start) // BIN_S)
        recovered = None
        for index in sorted(b for b in bins if b >= first):
            if _percentile(bins[index], 0.99) < RECOVERED_P99_S:
                recovered = max(0.0, start + index * BIN_S - ended)
                break
        out.append(
            {
                "kind": kind,
                "at_s": round(at - start, 1),
                "lasted_s": round(ended - at, 1),
                "recovered_s": None if recovered is None else round(recovered, 1),
            }
        )
    return out


def _lives(samples: list[Record], faults: list[Record], start: float) -> list[dict[str, Any]]:
    """Each life of the server: its memory and open files once settled and at its end, and
    its mean CPU (cores) from its first sample to its last."""
    bounds = [start] + [float(f["t"]) for f in faults if f.get("kind") == "server_up"]
    kills = [float(f["t"]) for f in faults if f.get("kind") == "server_kill"]
    lives = []
    for n, began in enumerate(bounds):
        ended = next((k for k in kills if k > began), float("inf"))
        inside = [s for s in samples if began <= float(s["t"]) < ended and s.get("server")]
        settled = [s for s in inside if float(s["t"]) >= began + SETTLED_S] or inside
        if not settled:
            continue
        first, last = settled[0], inside[-1]
        read = [s for s in inside if "cpu_s" in s]
        lives.append(
            {
                "life": n,
                "from_s": round(began - start, 1),
                "to_s": round(float(last["t"]) - start, 1),
                "rss_mb_settled": round(first["rss_kb"] / 1024, 1),
                "rss_mb_end": round(last["rss_kb"] / 1024, 1),
                "rss_growth_pct": round(100 * (last["rss_kb"] / first["rss_kb"] - 1), 1),
                "fds_settled": first["fds"],
                "fds_end": last["fds"],
                "threads_end": last["threads"],
                "cpu_cores_mean": _cores(read[0], read[-1]) if len(read) > 1 else None,
            }
        )
    return lives


def _cores(first: Record, last: Record) -> float | None:
    """The server's CPU between two samples of one life, as a share of one core."""
    seconds = float(last["t"]) - float(first["t"])
    if seconds <= 0:
        return None
    return round((last["cpu_s"] - first["cpu_s"]) / seconds, 2)


def _cpu_steps(samples: list[Record]) -> list[list[Step]]:
    """Per life of the server (its pid), (from, to, cores) between each two consecutive
    samples that read its CPU."""
    lives: list[list[Step]] = []
    before: Record | None = None
    for sample in samples:
        if not sample.get("server") or "cpu_s" not in sample:
            continue
        if before is None or before.get("pid") != sample.get("pid"):
            lives.append([])
        else:
            t0, t1 = float(before["t"]), float(sample["t"])
            if t1 > t0:
                lives[-1].append((t0, t1, (sample["cpu_s"] - before["cpu_s"]) / (t1 - t0)))
        before = sample
    return lives


def _cpu_busy(steps: list[list[Step]], start: float, traffic_end: float) -> dict[str, Any]:
    """The server's CPU over the traffic while it was up (a restart's journal replay in): its
    mean share of one core, and the share of that time it was saturated."""
    during = [
        step for life in steps for step in life if start <= step[0] and step[1] <= traffic_end
    ]
    seconds = sum(t1 - t0 for t0, t1, _ in during)
    if not seconds:
        return {"server_cpu_cores_mean": None, "server_cpu_saturated_pct": None}
    busy = sum((t1 - t0) * cores for t0, t1, cores in during)
    saturated = sum(t1 - t0 for t0, t1, cores in during if cores >= SATURATED_CORES)
    return {
        "server_cpu_cores_mean": round(busy / seconds, 2),
        "server_cpu_saturated_pct": round(100 * saturated / seconds, 1),
    }


def _warm_growth(samples: list[Record], start: float, traffic_end: float) -> dict[str, Any]:
    """The issue's figure: RSS from the first 5 minutes (or a fifth of a shorter run) to the
    end of the traffic, and whether a kill lay between (a restarted server starts over)."""
    span = traffic_end - start
    warm_at = start + min(WARM_S, span / 5)
    live = [s for s in samples if s.get("server") and warm_at <= float(s["t"]) <= traffic_end]
    if len(live) < 2:
        return {}
    first, last = live[0], live[-1]
    return {
        "from_s": round(float(first["t"]) - start, 1),
        "rss_mb_from": round(first["rss_kb"] / 1024, 1),
        "rss_mb_end": round(last["rss_kb"] / 1024, 1),
        "growth_pct": round(100 * (last["rss_kb"] / first["rss_kb"] - 1), 1),
    }


def _beyond_state(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The server's memory at the end beside a fresh process's that holds the same state
    (``bench.soak.server.state_rss_kb``): ``shoal dev`` keeps all it was sent in memory, so
    its memory grows with a run's data; what it holds beyond what its data takes is what a
    leak would grow."""
    found = next((r for r in records if r["op"] == "state_memory"), None)
    if found is None or not found.get("server_rss_kb") or not found.get("state_rss_kb"):
        return None
    server, state = int(found["server_rss_kb"]), int(found["state_rss_kb"])
    return {
        "server_mb": round(server / 1024, 1),
        "state_mb": round(state / 1024, 1),
        "pct": round(100 * (server / state - 1), 1),
    }


def summarize(
    out: Path, settings: Any, report: Report, starts: list[dict[str, float]]
) -> dict[str, Any]:
    records, _ = read_history(out / "history")
    start_record = next((r for r in records if r["op"] == "phase" and r["name"] == "start"), None)
    start = float(start_record["t"]) if start_record else float(records[0]["t"])
    traffic_end = next(
        (float(r["t"]) for r in records if r["op"] == "phase" and r["name"] == "traffic_end"),
        float(records[-1]["t"]),
    )
    drained_record = next((r for r in records if r["op"] == "phase" and r["name"] == "drained"), {})
    drained = drained_record.get("after_s")
    samples = [r for r in records if r["op"] == "sample"]
    cpu = _cpu_steps(samples)
    faults = [r for r in records if r["op"] == "fault"]
    faults += [
        {**r, "kind": "grow"}
        for r in records
        if r["op"] == "topic" and r.get("action") == "switch" and r.get("phase") == "invoke"
    ]
    points = latencies(records)
    bins = _bins(points, start)
    all_seconds = [p[2] for p in points]
    recoveries = _recoveries(faults, bins, start)
    slowest = [r["recovered_s"] for r in recoveries if r["recovered_s"] is not None]
    fault_counts: dict[str, int] = defaultdict(int)
    for fault in faults:
        fault_counts[str(fault["kind"])] += 1
    drops = sum(1 for r in records if r["op"] == "lost" and r.get("how") == "dropped")
    figures: dict[str, Any] = {
        "minutes": settings.minutes,
        "clients": settings.clients,
        "traffic_end_s": round(traffic_end - start, 1),
        "drain_s": drained,
        #: owed messages, pushes and wills still missing when the drain ended (0: quiescent)
        "drain_missing": drained_record.get("missing"),
        "seed": settings.seed,
        "throttle": start_record.get("throttle") if start_record else None,
        "verdict": "PASS" if report.ok else "FAIL",
        "violations": {name: len(v) for name, v in report.by_property().items()},
        "counts": {
            k: report.counts[k]
            for k in (
                "published",
                "publishes_acked",
                "deliveries",
                "acks",
                "owed_session",
                "owed_group",
                "wills_required",
                "wills_forbidden",
                "wills_either",
                "wills_disturbed",
                "ack_races",
                "qos2_dropped_on_leave",
                "qos2_dropped_unseen",
                "acked_after_drain",
            )
            if k in report.counts
        },
        "push": {k: v for k, v in report.counts.items() if k.startswith("push_")},
        "faults": dict(sorted(fault_counts.items())),
        "connections_dropped": drops,
        "latency_s": {
            "p50": round(_percentile(all_seconds, 0.5), 3) if all_seconds else None,
            "p99": round(_percentile(all_seconds, 0.99), 3) if all_seconds else None,
            "max": round(max(all_seconds), 3) if all_seconds else None,
        },
        "recovery_s_worst": max(slowest) if slowest else None,
        "unrecovered": sum(1 for r in recoveries if r["recovered_s"] is None),
        "recoveries": recoveries,
        "server_lives": _lives(samples, faults, start),
        "rss_after_warmup": _warm_growth(samples, start, traffic_end),
        "rss_beyond_state": _beyond_state(records),
        **_cpu_busy(cpu, start, traffic_end),
        "server_starts": starts,
        "notes": report.notes[:10],
    }
    png = out / "soak.png"
    try:
        _plot(
            png,
            samples=samples,
            cpu=cpu,
            faults=faults,
            bins=bins,
            points=points,
            start=start,
            figures=figures,
        )
        figures["png"] = str(png)
    except ImportError:
        figures["png"] = None
    (out / "summary.md").write_text(markdown(figures, report))
    return figures


def _plot(
    png: Path,
    *,
    samples: list[Record],
    cpu: list[list[Step]],
    faults: list[Record],
    bins: dict[int, list[float]],
    points: list[tuple[float, str, float]],
    start: float,
    figures: dict[str, Any],
) -> None:
    # through import_module, as pipeline/charts.py does: mypy (cold) skips matplotlib's stubs
    matplotlib: Any = import_module("matplotlib")
    matplotlib.use("Agg")
    plt: Any = import_module("matplotlib.pyplot")
    fig, axes = plt.subplots(5, 1, figsize=(13, 15), sharex=True, dpi=100)
    minutes = [(float(s["t"]) - start) / 60 for s in samples if s.get("server")]
    live = [s for s in samples if s.get("server")]
    axes[0].plot(minutes, [s["rss_kb"] / 1024 for s in live], color="#1c7ed6", label="shoal dev")
    axes[0].plot(
        [(float(s["t"]) - start) / 60 for s in samples],
        [s.get("clients_rss_kb", 0) / 1024 for s in samples],
        color="#868e96",
        linestyle="--",
        label="client processes",
    )
    axes[0].set_ylabel("resident memory (MB)")
    axes[0].legend(loc="upper left", fontsize=8)
    axes[1].plot(minutes, [s["fds"] for s in live], color="#2f9e44")
    axes[1].set_ylabel("open files")
    axes[2].plot(minutes, [s["threads"] for s in live], color="#f08c00")
    axes[2].set_ylabel("threads")
    per_client: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for t, client, seconds in points:
        per_client[client][int((t - start) // BIN_S)].append(seconds)
    for client_bins in per_client.values():
        xs = sorted(client_bins)
        axes[3].plot(
            [(x * BIN_S) / 60 for x in xs],
            [_percentile(client_bins[x], 0.99) for x in xs],
            color="#adb5bd",
            linewidth=0.5,
            alpha=0.5,
        )
    xs = sorted(bins)
    axes[3].plot(
        [(x * BIN_S) / 60 for x in xs],
        [_percentile(bins[x], 0.99) for x in xs],
        color="#d64545",
        label="p99, all clients",
    )
    axes[3].plot(
        [(x * BIN_S) / 60 for x in xs],
        [_percentile(bins[x], 0.5) for x in xs],
        color="#1c7ed6",
        label="p50",
    )
    axes[3].axhline(RECOVERED_P99_S, color="#495057", linestyle=":", linewidth=1)
    axes[3].set_yscale("log")
    axes[3].set_ylabel(f"latency (s) per {BIN_S:g} s")
    axes[3].legend(loc="upper left", fontsize=8)
    axes[3].set_title("grey: each client's p99", loc="right", fontsize=8, color="#868e96")
    for life in cpu:
        axes[4].plot(
            [((t0 + t1) / 2 - start) / 60 for t0, t1, _ in life],
            [cores for _, _, cores in life],
            color="#0b7285",
        )
    axes[4].set_ylim(bottom=0)
    # one core: about all the emulator's Python work can take under the GIL
    axes[4].axhline(1.0, color="#495057", linestyle=":", linewidth=1)
    axes[4].set_ylabel("server CPU (cores)")
    axes[4].set_xlabel("minutes since the start")
    for ax in axes:
        if figures.get("traffic_end_s") is not None:
            ax.axvline(figures["traffic_end_s"] / 60, color="#212529", linestyle="--", linewidth=1)
        for fault in faults:
            kind = str(fault.get("kind"))
            if kind in FAULT_COLOURS:
                ax.axvline(
                    (float(fault["t"]) - start) / 60,
                    color=FAULT_COLOURS[kind],
                    linewidth=0.8 if kind == "ws_drop" else 1.2,
                    alpha=0.8,
                )
    handles = [
        matplotlib.lines.Line2D([], [], color=colour, label=kind.replace("_", " "))
        for kind, colour in FAULT_COLOURS.items()
    ]
    handles.append(
        matplotlib.lines.Line2D([], [], color="#212529", linestyle="--", label="traffic end")
    )
    fig.legend(handles=handles, loc="upper right", ncol=7, fontsize=8)
    fig.suptitle(
        f"Shoal soak: {figures['minutes']:g} min, {figures['clients']} clients, seed "
        f"{figures['seed']}: {figures['verdict']}",
        x=0.01,
        ha="left",
        fontsize=13,
        color="#2f9e44" if figures["verdict"] == "PASS" else "#d64545",
    )
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(png, format="png", facecolor="white")
    plt.close(fig)


def _start(start: dict[str, float]) -> str:
    if "replayed" not in start:
        return f"{start.get('start_s')}"
    return f"{start.get('start_s')} ({start['replayed']:.0f}, {start['replay_s']})"


def _drain_end(missing: int | None) -> str:
    if missing == 0:
        return "until nothing owed was missing"
    if missing is None:
        return "ended by its limit before a look"
    return (
        f"ended by its limit with {missing} owed still missing at its last look (before the "
        "service's own drop events were read): the verdict judges them"
    )


def markdown(figures: dict[str, Any], report: Report) -> str:
    violations = ", ".join(f"{k} {v}" for k, v in figures["violations"].items())
    latency = figures["latency_s"]
    lines = [
        f"# Soak: {figures['minutes']:g} minutes, {figures['clients']} clients, seed "
        f"{figures['seed']}: {figures['verdict']}",
        "",
        f"Throttle: {figures['throttle'] or 'none'}. Traffic {figures['traffic_end_s']} s, then "
        f"a drain of {figures['drain_s']} s ({_drain_end(figures.get('drain_missing'))}). "
        f"Violations: {violations}.",
        "",
        "Counts: " + ", ".join(f"{k} {v}" for k, v in figures["counts"].items()) + ".",
        "",
        "Push subscription: " + ", ".join(f"{k} {v}" for k, v in figures["push"].items()) + ".",
        "",
        "Faults: "
        + ", ".join(f"{k} {v}" for k, v in figures["faults"].items())
        + f"; connections dropped without a close: {figures['connections_dropped']}.",
        "",
        f"Delivery latency (publish invoked to received): p50 {latency['p50']} s, p99 "
        f"{latency['p99']} s, max {latency['max']} s. Worst recovery after a fault (p99 back "
        f"under {RECOVERED_P99_S:g} s): {figures['recovery_s_worst']} s; never recovered: "
        f"{figures['unrecovered']}.",
        "",
        "| fault | at (s) | lasted (s) | recovered after (s) |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {r['kind']} | {r['at_s']} | {r['lasted_s']} | {r['recovered_s']} |"
        for r in figures["recoveries"]
        if r["kind"] != "ws_drop"
    ]
    lines += [
        "",
        "| server life | from (s) | to (s) | RSS settled (MB) | RSS end (MB) | growth | "
        "open files settled | at end | threads at end | CPU (cores, mean) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {life['life']} | {life['from_s']} | {life['to_s']} | {life['rss_mb_settled']} | "
        f"{life['rss_mb_end']} | {life['rss_growth_pct']} % | {life['fds_settled']} | "
        f"{life['fds_end']} | {life['threads_end']} | {life['cpu_cores_mean']} |"
        for life in figures["server_lives"]
    ]
    if figures["server_cpu_cores_mean"] is not None:
        lines += [
            "",
            "Server CPU over the traffic while up (restarts' journal replays in): "
            f"{figures['server_cpu_cores_mean']} cores on average, at {SATURATED_CORES:g} or "
            f"more {figures['server_cpu_saturated_pct']} % of that time (one core is about all "
            "the emulator's Python work can take under the GIL).",
        ]
    warm = figures["rss_after_warmup"]
    if warm:
        lines += [
            "",
            f"RSS from {warm['from_s']} s ({warm['rss_mb_from']} MB) to the end of traffic "
            f"({warm['rss_mb_end']} MB): {warm['growth_pct']} % (a kill in between starts the "
            "server over).",
        ]
    starts = figures["server_starts"]
    lines += [
        "",
        "Server starts (s until healthy; journal records replayed, s): "
        + "; ".join(
            f"{s.get('start_s')}"
            + (f" ({s['replayed']:.0f}, {s['replay_s']})" if "replayed" in s else "")
            for s in starts
        )
        + ".",
    ]
    if figures["notes"]:
        lines += ["", "Notes: " + "; ".join(figures["notes"]) + "."]
    found = [name for name in PROPERTIES if figures["violations"].get(name)]
    if found:
        lines += ["", "## Violations", "", "```", report.render()[:20_000], "```"]
    return "\n".join(lines) + "\n"
