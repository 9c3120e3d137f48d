"""The WebSocket API's ledger of open connections (``shoal.local.wsledger``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from shoal.local import wsledger
from shoal.local.wsledger import ConnectionLedger, OpenConnection


def entry(connection_id: str) -> OpenConnection:
    return OpenConnection(connection_id, 1_000, "127.0.0.1", "ua", {"principalId": "alice"})


def test_a_new_life_owes_the_connections_the_last_left_open(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    first = ConnectionLedger(path)
    assert first.take_owed() == []
    first.opened(entry("a"))
    first.opened(entry("b"))
    first.closed("a")
    first.close()
    # (killed: nothing closes b)
    assert ConnectionLedger(path).take_owed() == [entry("b")]
    # (killed again before its $disconnect ran: still owed)
    third = ConnectionLedger(path)
    assert third.take_owed() == [entry("b")]
    third.closed("b")
    assert ConnectionLedger(path).take_owed() == []


def test_a_line_a_kill_cut_short_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    ledger = ConnectionLedger(path)
    ledger.take_owed()
    ledger.opened(entry("a"))
    ledger.close()
    with path.open("a") as out:
        out.write('{"open":"b","at":')
    assert ConnectionLedger(path).take_owed() == [entry("a")]


def test_closes_are_compacted_away(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wsledger, "COMPACT_AFTER", 3)
    path = tmp_path / "ledger.jsonl"
    ledger = ConnectionLedger(path)
    ledger.take_owed()
    ledger.opened(entry("kept"))
    for n in range(3):
        ledger.opened(entry(f"c{n}"))
        ledger.closed(f"c{n}")
    # rewritten with the open one only, and appended to from there
    assert path.read_text().splitlines() == [entry("kept").line()]
    ledger.opened(entry("d"))
    assert ConnectionLedger(path).take_owed() == [entry("kept"), entry("d")]


def test_a_close_of_a_connection_it_does_not_hold_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    ledger = ConnectionLedger(path)
    ledger.take_owed()
    ledger.closed("never-opened")
    assert path.read_text() == ""


def test_a_connection_that_went_before_the_kill_is_owed_with_the_time_it_went(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its socket closed, its $disconnect waited (a minute under load), then the kill: the
    restart's $disconnect says when it went, so a will's delay counts from the close (the
    30-minute soak at 200 clients withheld 13 wills that the restart's time had moved past
    the resume that held them)."""
    path = tmp_path / "ledger.jsonl"
    ledger = ConnectionLedger(path)
    ledger.take_owed()
    ledger.opened(entry("a"))
    ledger.opened(entry("b"))
    ledger.went("a", 5_000)
    ledger.went("gone", 6_000)  # not held: nothing written
    ledger.close()
    owed = ConnectionLedger(path).take_owed()
    assert [(e.connection_id, e.went_at_ms) for e in owed] == [("a", 5_000), ("b", None)]
    # kept through a compaction, and gone once its $disconnect ran
    monkeypatch.setattr(wsledger, "COMPACT_AFTER", 1)
    again = ConnectionLedger(path)
    again.take_owed()
    again.opened(entry("c"))
    again.closed("c")
    assert ConnectionLedger(path).take_owed()[0].went_at_ms == 5_000
    again.closed("a")
    assert [e.connection_id for e in ConnectionLedger(path).take_owed()] == ["b"]
