"""The WebSocket API's open connections, kept on disk so a restarted ``shoal dev`` owes nothing.

API Gateway never restarts: every connection it accepted ends with a ``$disconnect``, however
it ends. ``shoal dev`` is a process that a kill -9 can end, and its connections go with it
without one. Their sessions would then stay live for the registry's bound on a connection (a
little over API Gateway's 2 hours), and their wills wait as long. So the server writes each
connection it opens and each whose ``$disconnect`` ran to a ledger in the state directory, and
a restart on the same state runs the ``$disconnect`` of every connection the ledger still holds
open, as API Gateway would have, with close code 1006 and the time the connection went: a
socket that closed before the kill has a line saying when (written as it closes, before its
``$disconnect`` runs, which under load can be a minute later); one the kill ended went with
the process, so the restart's time (the will's delay must not run from a moment before the
close). A connection's line holds what its ``$disconnect`` event carries: no header, so no
token.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any

log = logging.getLogger("shoal-dev.websocket")

#: the ledger's file in the state directory
LEDGER_FILE = "websocket-connections.jsonl"
#: rewritten with only the open connections once this many closes were appended (and at
#: least as many as are open): a day of short connections does not grow it without bound
COMPACT_AFTER = 10_000


@dataclass(frozen=True)
class OpenConnection:
    """What a connection's ``$disconnect`` event needs, as the ledger keeps it."""

    connection_id: str
    connected_at_ms: int
    source_ip: str
    user_agent: str
    authorizer: dict[str, Any] | None
    #: when its socket closed, if it did before its ``$disconnect`` ran (``went``)
    went_at_ms: int | None = None

    def line(self) -> str:
        record: dict[str, Any] = {
            "open": self.connection_id,
            "at": self.connected_at_ms,
            "ip": self.source_ip,
            "ua": self.user_agent,
            "authorizer": self.authorizer,
        }
        if self.went_at_ms is not None:
            record["went"] = self.went_at_ms
        return json.dumps(record, separators=(",", ":"))

    @classmethod
    def parse(cls, record: dict[str, Any]) -> OpenConnection:
        authorizer = record.get("authorizer")
        return cls(
            connection_id=str(record["open"]),
            connected_at_ms=int(record["at"]),
            source_ip=str(record.get("ip") or ""),
            user_agent=str(record.get("ua") or ""),
            authorizer=dict(authorizer) if isinstance(authorizer, dict) else None,
            went_at_ms=int(record["went"]) if record.get("went") is not None else None,
        )


class ConnectionLedger:
    """Append-only lines, one per open and one per close; touched by one thread (the event
    loop's) once the server runs."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._open: dict[str, OpenConnection] = {}
        self._closes = 0
        self._file: IO[str] | None = None

    def take_owed(self) -> list[OpenConnection]:
        """The connections a previous life left open (their ``$disconnect`` never ran). They
        stay in the ledger until ``closed`` is called for each, so a kill during the replay
        leaves them owed again. Opens the ledger for appending."""
        for number, line in enumerate(self._lines(), 1):
            try:
                record = json.loads(line)
                if "open" in record:
                    entry = OpenConnection.parse(record)
                    self._open[entry.connection_id] = entry
                elif "closed" in record:
                    self._open.pop(str(record["closed"]), None)
                elif "went" in record:
                    self._went(str(record["went"]), int(record["at"]))
            except (ValueError, KeyError, TypeError):
                # a line a kill cut short: its connection's open or close is lost with it
                log.warning("connection ledger line %d unreadable: skipped", number)
        self._rewrite()
        return list(self._open.values())

    def opened(self, entry: OpenConnection) -> None:
        self._open[entry.connection_id] = entry
        self._append(entry.line())

    def went(self, connection_id: str, at_ms: int) -> None:
        """The connection's socket closed at ``at_ms``; its ``$disconnect`` has yet to run."""
        if self._went(connection_id, at_ms):
            self._append(json.dumps({"went": connection_id, "at": at_ms}))

    def _went(self, connection_id: str, at_ms: int) -> bool:
        entry = self._open.get(connection_id)
        if entry is None:
            return False
        self._open[connection_id] = replace(entry, went_at_ms=at_ms)
        return True

    def closed(self, connection_id: str) -> None:
        if self._open.pop(connection_id, None) is None:
            return
        self._append(json.dumps({"closed": connection_id}))
        self._closes += 1
        if self._closes >= max(COMPACT_AFTER, len(self._open)):
            self._rewrite()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    # -- the file --

    def _lines(self) -> list[str]:
        try:
            text = self.path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return []
        return [line for line in text.splitlines() if line.strip()]

    def _append(self, line: str) -> None:
        if self._file is None:
            self._file = self.path.open("a", encoding="utf-8")
        # written through to the OS at once: a kill -9 of the process loses none of it
        self._file.write(line + "\n")
        self._file.flush()

    def _rewrite(self) -> None:
        """The ledger as only the open connections, replaced whole (a kill meanwhile leaves
        the old file or the new one, never a part)."""
        self.close()
        partial = self.path.with_suffix(".partial")
        with partial.open("w", encoding="utf-8") as out:
            for entry in self._open.values():
                out.write(entry.line() + "\n")
        os.replace(partial, self.path)
        self._closes = 0
        with contextlib.suppress(OSError):
            self._file = self.path.open("a", encoding="utf-8")
