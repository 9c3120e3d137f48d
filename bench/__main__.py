"""Run the benchmarks, then write bench/results.json and bench/RESULTS.md.

``python -m bench`` runs every benchmark; ``python -m bench groups push`` runs only those named
and keeps the figures of the others from the previous results file (a full run takes long,
mostly the audit's generated archives). Options after the names (``python -m bench soak
--minutes 30``) go to the one benchmark named, whose ``run`` takes them.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

from bench import (
    audit,
    client,
    connections,
    cost,
    delivery,
    fanout,
    filter_index,
    fleet,
    frontdoor,
    groups,
    grow,
    publish,
    push,
    sessions,
    soak,
    wspush,
)

HERE = Path(__file__).resolve().parent
BENCHMARKS = {
    "publish": publish,
    "sessions": sessions,
    "filter_index": filter_index,
    "delivery": delivery,
    "groups": groups,
    "push": push,
    "wspush": wspush,
    "audit": audit,
    "frontdoor": frontdoor,
    "cost": cost,
    "fleet": fleet,
    "client": client,
    "connections": connections,
    "fanout": fanout,
    "grow": grow,
    # not part of a plain `python -m bench`: minutes of its own (python -m bench soak)
    "soak": soak,
}
#: run only when named
ON_REQUEST = frozenset({"soak"})


def main(argv: list[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    cut = next((i for i, a in enumerate(given) if a.startswith("-")), len(given))
    wanted, options = given[:cut], given[cut:]
    wanted = wanted or [name for name in BENCHMARKS if name not in ON_REQUEST]
    unknown = sorted(set(wanted) - set(BENCHMARKS))
    if unknown:
        print(f"unknown benchmark(s): {', '.join(unknown)}; known: {', '.join(BENCHMARKS)}")
        return 2
    if options and len(wanted) != 1:
        print("options go to one benchmark: name exactly one before them")
        return 2
    previous: dict[str, Any] = {}
    if (HERE / "results.json").exists():
        previous = json.loads((HERE / "results.json").read_text()).get("benchmarks", {})
    results: dict[str, Any] = {
        "generated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(["python -m bench", *(argv if argv is not None else sys.argv[1:])]),
        "ran": [name for name in BENCHMARKS if name in wanted],
        "python": platform.python_version(),
        "machine": platform.machine(),
        "benchmarks": {},
    }
    for name, module in BENCHMARKS.items():
        if name in wanted:
            print(f"running {name} ...", file=sys.stderr)
            results["benchmarks"][name] = module.run(options) if options else module.run()
        elif name in previous:
            results["benchmarks"][name] = previous[name]
    # the other benchmarks' figures as they are now, not as they were at the start: a run of
    # another benchmark that ended meanwhile keeps its figures
    if (HERE / "results.json").exists():
        now = json.loads((HERE / "results.json").read_text()).get("benchmarks", {})
        for name in BENCHMARKS:
            if name not in wanted and name in now:
                results["benchmarks"][name] = now[name]
    results["benchmarks"] = {
        name: results["benchmarks"][name] for name in BENCHMARKS if name in results["benchmarks"]
    }
    (HERE / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    render(results)
    return 0


def render(results: dict[str, Any]) -> None:
    """RESULTS.md from a results file's figures (a report's wording can change without a rerun)."""
    sections = [
        module.report(results["benchmarks"][name])
        for name, module in BENCHMARKS.items()
        if name in results["benchmarks"]
    ]
    ran = results.get("ran") or list(results["benchmarks"])
    header = (
        "# Benchmark results\n\n"
        f"The last run was `{results.get('command', 'python -m bench')}` at "
        f"{results['generated_at']} (Python {results['python']}, {results['machine']}); it "
        f"measured {', '.join(ran)} together. The other sections keep the figures of the run "
        "that last measured them. Raw figures: `bench/results.json`.\n\n"
    )
    (HERE / "RESULTS.md").write_text(header + "\n".join(sections))
    print((HERE / "RESULTS.md").read_text())


if __name__ == "__main__":
    raise SystemExit(main())
