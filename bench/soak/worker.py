"""One process of the soak's clients: ``python -m bench.soak.worker SPEC WORKER LIFE``.

The driver starts one per group of clients, each client a thread playing its role
(``bench.soak.clients``), and kills it with -9 to kill its clients; started again with the next
``LIFE``, each client resumes from its state file. Signals from the driver: SIGUSR1 drops one
WebSocket connection without a close, SIGUSR2 ends the traffic (publishers settle what is in
flight, will clients end normally, the rest keep consuming), SIGTERM stops (acks settled, clients
closed without a DISCONNECT: their sessions stay).
"""

from __future__ import annotations

import json
import random
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from bench.soak.clients import ROLES, Context
from bench.soak.history import History, history_file


def main(argv: list[str]) -> int:
    spec_path, worker, life = Path(argv[0]), argv[1], int(argv[2])
    spec: dict[str, Any] = json.loads(spec_path.read_text())
    history = History(
        history_file(Path(spec["history_dir"]), worker, life), writer=worker, life=life
    )
    ctx = Context(
        url=spec["url"],
        ws_url=spec["ws_url"],
        state_dir=Path(spec["state_dir"]),
        token_files={k: Path(v) for k, v in spec["token_files"].items()},
        history=history,
        life=life,
        seed=int(spec["seed"]),
    )
    rng = random.Random(f"{spec['seed']}/{worker}/{life}/drops")
    stopped = threading.Event()

    def drop(_signum: int, _frame: FrameType | None) -> None:
        with ctx.lock:
            live = sorted(ctx.live_ws)
        if live:
            client = ctx.live_ws.get(rng.choice(live))
            if client is not None:
                threading.Thread(target=client.drop, daemon=True).start()

    def end_traffic(_signum: int, _frame: FrameType | None) -> None:
        ctx.traffic_end.set()

    def stop(_signum: int, _frame: FrameType | None) -> None:
        ctx.traffic_end.set()
        ctx.stop.set()
        stopped.set()

    signal.signal(signal.SIGUSR1, drop)
    signal.signal(signal.SIGUSR2, end_traffic)
    signal.signal(signal.SIGTERM, stop)
    threads = []
    for client in spec["workers"][worker]:
        role = ROLES[client["role"]]
        thread = threading.Thread(target=_run, args=(role, ctx, client), name=client["client"])
        thread.start()
        threads.append(thread)
    if spec.get("traffic_ended"):
        ctx.traffic_end.set()
    while not stopped.wait(1.0):
        pass
    for thread in threads:
        thread.join(60)
    history.close()
    return 0


def _run(role: Any, ctx: Context, client: dict[str, Any]) -> None:
    try:
        role(ctx, client)
    except Exception as exc:  # recorded: a role that dies is a finding, not a crash of the worker
        ctx.history.record("client_error", client=client["client"], error=repr(exc)[:300])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
