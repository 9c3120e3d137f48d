"""The soak (issue 47): ``python -m bench soak [--minutes N] [--clients N] [--seed N]``.

One ``shoal dev`` on a persistent state directory, every kind of client at once, faults on a
seeded schedule (``bench.soak.driver``); every operation recorded as a history
(``bench.soak.history``) and judged afterwards (``bench.soak.checker``); memory, open files,
threads and latency over time beside the fault marks (``bench.soak.summary``).

A run's figures go to the results file under its label (``<minutes>m-<clients>c``), beside the
other labels' last figures: the 30-minute and the 2-hour runs are kept side by side. Its plot is
copied to ``bench/soak/plots/<label>.png``.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def parse(argv: list[str]) -> Any:
    from bench.soak.driver import Settings

    parser = argparse.ArgumentParser(prog="python -m bench soak")
    parser.add_argument("--minutes", type=float, default=5.0, help="traffic's duration")
    parser.add_argument("--clients", type=int, default=40)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--rate", type=float, help="messages a second over all publishers")
    parser.add_argument("--kills", type=int, help="kills of shoal dev (default: 1 per 5 min)")
    parser.add_argument("--drops", type=int, help="WebSocket drops (default: 2 a minute)")
    parser.add_argument("--client-kills", type=int, help="client processes killed")
    parser.add_argument("--throttle", help="SHOAL_DEV_THROTTLE for shoal dev (default: as set)")
    parser.add_argument("--out", type=Path, help="the run's folder (default .shoal/soak/<time>)")
    args = parser.parse_args(argv)
    return Settings(
        minutes=args.minutes,
        clients=args.clients,
        seed=args.seed,
        rate=args.rate,
        kills=args.kills,
        drops=args.drops,
        client_kills=args.client_kills,
        throttle=args.throttle,
        out=args.out,
    )


def run(argv: list[str] | None = None) -> dict[str, Any]:
    from bench.soak.driver import run_soak

    settings = parse(list(argv or []))
    outcome = run_soak(settings)
    figures = dict(outcome.figures)
    figures["command"] = " ".join(["python -m bench soak", *(argv or [])])
    # the run's folder as the checkout names it (the results file travels with the code)
    figures["out"] = _relative(outcome.out)
    label = f"{settings.minutes:g}m-{settings.clients}c"
    if figures.get("png"):
        plots = HERE / "plots"
        plots.mkdir(exist_ok=True)
        shutil.copyfile(figures["png"], plots / f"{label}.png")
        figures["png"] = _relative(Path(figures["png"]))
        figures["plot"] = f"soak/plots/{label}.png"
    runs = dict(_previous_runs())
    runs[label] = figures
    return {"runs": runs}


def _judged_again(run: dict[str, Any]) -> str:
    """A run whose history a later checker judged again (a checker fixed after the run
    started): by which, and what the run's own checker said."""
    again = run.get("judged_again")
    if not again:
        return ""
    said = ", ".join(f"{k} {v}" for k, v in again.get("the_run_said", {}).items()) or "none"
    return f"; judged again by the checker of {again.get('by')} (the run's own found: {said})"


def _beyond(run: dict[str, Any]) -> str:
    found = run.get("rss_beyond_state")
    if not found:
        return "not measured"
    return f"{found['pct']} % ({found['server_mb']} MB against {found['state_mb']} MB)"


def _cpu(run: dict[str, Any]) -> str:
    mean = run.get("server_cpu_cores_mean")
    if mean is None:
        return "not measured"
    return f"{mean} ({run.get('server_cpu_saturated_pct')} % saturated)"


def _relative(path: Path) -> str:
    root = HERE.parents[1]
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


def _previous_runs() -> dict[str, Any]:
    path = HERE.parent / "results.json"
    try:
        benchmarks = json.loads(path.read_text()).get("benchmarks", {})
    except (OSError, ValueError):
        return {}
    runs = benchmarks.get("soak", {}).get("runs", {})
    return runs if isinstance(runs, dict) else {}


def report(figures: dict[str, Any]) -> str:
    from bench.soak.summary import SATURATED_CORES

    rows = []
    for label, run in sorted(figures.get("runs", {}).items()):
        latency = run.get("latency_s", {})
        warm = run.get("rss_after_warmup") or {}
        lives = run.get("server_lives") or []
        worst_life = max((life["rss_growth_pct"] for life in lives), default=None)
        bad = {k: v for k, v in run.get("violations", {}).items() if v}
        found = ", ".join(f"{k} {v}" for k, v in bad.items()) or "none"
        rows.append(
            f"| {label} | {run.get('verdict')} | {found} | "
            f"{run.get('faults', {}).get('server_kill', 0)} | "
            f"{run.get('connections_dropped', 0)} | {run.get('faults', {}).get('client_kill', 0)} "
            f"| {run.get('counts', {}).get('publishes_acked')} | "
            f"{run.get('counts', {}).get('deliveries')} | {latency.get('p50')} / "
            f"{latency.get('p99')} | {run.get('recovery_s_worst')} | "
            f"{warm.get('growth_pct')} % | {worst_life} % | {_beyond(run)} | {_cpu(run)} |"
        )
    plots = [
        f"![{label}]({run['plot']})"
        for label, run in sorted(figures.get("runs", {}).items())
        if run.get("plot")
    ]
    commands = [
        f"- {label}: `{run.get('command')}` (throttle: {run.get('throttle') or 'none'})"
        + _judged_again(run)
        for label, run in sorted(figures.get("runs", {}).items())
    ]
    return (
        "## Soak: mixed traffic and faults, judged afterwards (issue 47)\n\n"
        "One `shoal dev` on a persistent state directory; WebSocket and long-polling "
        "subscribers, two shared groups whose members join, leave and crash, a push "
        "subscription to an endpoint that fails a share of requests, exactly-once publishers "
        "(single and batched, keyed and not), retained messages, wills, a topic grown and "
        "switched once; kill -9 of the server, WebSocket connections dropped without a close, "
        "client processes killed and started again from their state files, a token expiring "
        "under two subscribers. Every operation is recorded client-side and the history is "
        "judged afterwards by `bench.soak.checker` (`python -m bench.soak.checker HISTORY`). "
        "Latency: publish invoked to received; recovery: from a fault's end to the first 5 s "
        "window whose p99 is under 2 s. RSS growth: from 5 minutes in (a fifth of a shorter "
        "run) to the end of traffic, and the worst growth within one life of the server. "
        "`shoal dev` keeps all a run writes in memory (Kinesis records, inbox items until "
        "their TTL, archive objects), so its memory grows with the run's data; beyond its "
        "data: the server's memory at the end against a fresh process's that holds the same "
        "state (its snapshot and journal loaded), which a leak would grow. Server CPU: the "
        "mean share of one core its processes used over the traffic while up (the journal "
        f"replays after kills in), and the share of that time at {SATURATED_CORES:g} core or "
        "more: one core is about all the emulator's Python work can take under the GIL.\n\n"
        "| run | verdict | violations | kills | dropped | client kills | publishes acked | "
        "deliveries | latency p50 / p99 (s) | worst recovery (s) | RSS growth | worst in a "
        "life | RSS beyond its data | server CPU (cores, mean) |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
        + "\n".join(rows)
        + "\n\n"
        + "\n".join(commands)
        + "\n\n"
        + "\n\n".join(plots)
        + "\n"
    )
