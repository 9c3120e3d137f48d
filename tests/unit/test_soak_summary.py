"""The soak's summary (``bench.soak.summary.summarize``) on small histories written as the
driver writes them: the server's CPU per life and over the traffic, from its samples."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.soak.checker import Report
from bench.soak.driver import Settings
from bench.soak.history import History, history_file
from bench.soak.summary import summarize

T0 = 1_700_000_000.0
SAMPLE = {"rss_kb": 100_000, "fds": 40, "threads": 12}


def _history(folder: Path, *, cpu: bool) -> None:
    """A run of 150 s: a first life sampled every 10 s using half a core, a kill at 65 s, a
    second life up at 80 s using a whole core (the sampler reads CPU only if ``cpu``)."""
    now = T0
    history = History(history_file(folder, "driver", 0), writer="driver", clock=lambda: now)

    def sample(at: float, pid: int, cpu_s: float) -> None:
        read: dict[str, Any] = {"pid": pid, "cpu_s": cpu_s} if cpu else {}
        history.record("sample", t=T0 + at, server=True, **SAMPLE, **read)

    history.record("phase", name="start")
    for n in range(7):  # 0 .. 60 s: 5 CPU seconds every 10 s
        sample(10.0 * n, 1000, 2.0 + 5.0 * n)
    history.record("fault", t=T0 + 65, kind="server_kill", pid=1000)
    history.record("sample", t=T0 + 70, server=False, clients_rss_kb=0)
    history.record("fault", t=T0 + 80, kind="server_up", took_s=15.0)
    for n in range(7):  # 90 .. 150 s: 10 CPU seconds every 10 s
        sample(90.0 + 10.0 * n, 2000, 20.0 + 10.0 * n)
    history.record("phase", t=T0 + 150, name="traffic_end")
    history.close()


def _summarize(out: Path) -> dict[str, Any]:
    return summarize(out, Settings(minutes=2.5, clients=2, seed=1), Report(), starts=[])


def test_each_life_has_its_mean_cpu_and_the_traffic_its_share_of_one_core(
    tmp_path: Path,
) -> None:
    _history(tmp_path / "history", cpu=True)

    figures = _summarize(tmp_path)

    assert [life["cpu_cores_mean"] for life in figures["server_lives"]] == [0.5, 1.0]
    # 60 s at half a core and 60 s at one: the restart's gap, where no process of one life
    # was sampled on both sides, is not a step of either
    assert figures["server_cpu_cores_mean"] == 0.75
    assert figures["server_cpu_saturated_pct"] == 50.0
    text = (tmp_path / "summary.md").read_text()
    assert "| CPU (cores, mean) |" in text
    assert "| 12 | 0.5 |" in text and "| 12 | 1.0 |" in text
    assert "0.75 cores on average" in text


def test_samples_of_an_older_history_without_cpu_still_summarize(tmp_path: Path) -> None:
    _history(tmp_path / "history", cpu=False)

    figures = _summarize(tmp_path)

    lives = figures["server_lives"]
    assert [life["rss_mb_end"] for life in lives] == [97.7, 97.7]
    assert [life["cpu_cores_mean"] for life in lives] == [None, None]
    assert figures["server_cpu_cores_mean"] is None
    assert "cores on average" not in (tmp_path / "summary.md").read_text()
