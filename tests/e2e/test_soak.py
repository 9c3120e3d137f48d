"""The soak's short run (issue 47): a minute of every kind of client at once over a real
``shoal dev``, with one kill -9 of it, judged afterwards by the same checker as the long runs
(``python -m bench soak``; ``bench.soak.checker``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.soak.driver import Settings, run_soak
from bench.soak.history import read_history


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_a_minute_of_mixed_traffic_and_faults_keeps_every_promise(tmp_path: Path) -> None:
    # Given one shoal dev on a persistent state directory, the soak's clients (publishers,
    # WebSocket and long-polling subscribers, two shared groups, a push subscription, wills,
    # retained messages) and its seeded faults: one kill -9 of the server, WebSocket
    # connections dropped without a close, a client process killed and started again
    settings = Settings(
        minutes=1,
        clients=19,
        seed=47,
        kills=1,
        drops=3,
        client_kills=1,
        min_drain_s=15,
        drain_s=180,
        out=tmp_path / "soak",
    )

    # When it runs for a minute and its history is checked afterwards
    outcome = run_soak(settings)

    # Then no property of the contract is violated
    report = outcome.report
    assert report.ok, report.render()
    # and each property had something to judge: the kill happened, messages were owed to
    # sessions, groups and the push subscription, and wills were due or forbidden
    counts = report.counts
    assert counts["fault_server_kill"] == 1
    assert counts["owed_session"] > 0 and counts["owed_group"] > 0
    assert counts["push_hooks_owed"] > 0
    assert counts["wills_required"] + counts["wills_forbidden"] > 0
    # and the service's archived delivery events were read for the drops it made by rule
    [drops] = [r for r in read_history(outcome.out / "history")[0] if r["op"] == "server_drops"]
    assert drops["error"] is None and drops["objects"] > 0
    # and the server's memory at the end was set beside what a fresh process holding its
    # state takes (a leak is what the server holds beyond it)
    beyond = outcome.figures["rss_beyond_state"]
    assert beyond is not None and beyond["state_mb"] > 0 and beyond["server_mb"] > 0
