"""The client's state file: publisher sequences and processed message ids, crash safe.

The file is rewritten atomically (temporary file, fsync, rename, fsync of the folder) and locked
for the life of the client. Everything in it belongs to a *scope*, the (server URL, principal)
pair a client talks as: a publish left in flight for one server is never sent to another, and
one principal's sequence is never continued under another's token (the server keys publisher
sequences by principal and publisher id). Per scope it holds:

- the publisher id made for the scope (when the application names none);
- per publisher id, the last sequence number the server accepted and the publishes *in flight*
  (seq, digest and body each, in seq order), written before they are sent;
- per client id, the ids of recently processed messages (a bounded, most-recent window).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

from shoal.client.errors import ClientError, StateInUse

#: processed message ids kept per client id; acks reach the server within a batch or two
RECENT_IDS = 1000
#: version 2 keys everything by (URL, principal); version 1 files had one unscoped sequence
STATE_VERSION = 2
#: the scope of a state used without naming one (tests, a single-server tool)
NO_SCOPE = ("", "")


def scope_key(scope: tuple[str, str]) -> str:
    url, principal = scope
    return json.dumps([url, principal], separators=(",", ":"))


class ClientState:
    """Publisher sequences and processed ids of one scope, in memory and (with a path) in a
    locked file that may hold other scopes too."""

    def __init__(
        self,
        path: str | Path | None = None,
        *,
        recent_ids: int = RECENT_IDS,
        scope: tuple[str, str] = NO_SCOPE,
    ) -> None:
        self.path = Path(path) if path is not None else None
        self.recent_ids = recent_ids
        self._lock: IO[bytes] | None = None
        self._file: dict[str, Any] = {"version": STATE_VERSION, "scopes": {}}
        self._data: dict[str, Any] = {}
        self._delivered: dict[str, dict[str, None]] = {}
        if self.path is not None:
            self._open(self.path)
        self.scope = scope
        self.use_scope(scope)

    def use_scope(self, scope: tuple[str, str]) -> None:
        """Work on ``scope`` from now on (a client learns its URL and principal after the
        state is opened)."""
        self.save_delivered()
        scopes: dict[str, Any] = self._file["scopes"]
        if self._data and not (
            self._data.get("publisher_id") or self._data["publishers"] or self._data["sessions"]
        ):
            # a scope only looked at leaves no trace in the file
            scopes.pop(scope_key(self.scope), None)
        self.scope = scope
        self._data = scopes.setdefault(
            scope_key(scope),
            {"url": scope[0], "principal": scope[1], "publishers": {}, "sessions": {}},
        )
        self._data.setdefault("publishers", {})
        self._data.setdefault("sessions", {})
        self._delivered = {
            client_id: dict.fromkeys(session.get("delivered", []))
            for client_id, session in self._data["sessions"].items()
        }

    def _open(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_name(path.name + ".lock"), "ab")  # noqa: SIM115 - held until close
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            lock.close()
            raise StateInUse(f"{path} is used by another running client") from exc
        self._lock = lock
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return
        except ValueError as exc:
            self.close()
            raise ClientError(f"{path} is not a client state file") from exc
        if not isinstance(data, dict) or data.get("version") != STATE_VERSION:
            self.close()
            raise ClientError(f"{path} is not a client state file of version {STATE_VERSION}")
        data.setdefault("scopes", {})
        self._file = data

    def close(self) -> None:
        if self._lock is not None:
            self._lock.close()  # closing the descriptor releases the lock
            self._lock = None

    def save_delivered(self) -> None:
        for client_id, ids in self._delivered.items():
            self._data["sessions"].setdefault(client_id, {})["delivered"] = list(ids)

    def save(self) -> None:
        """Write the whole state atomically: a reader sees the old file or the new one."""
        self.save_delivered()
        if self.path is None:
            return
        text = json.dumps(self._file, separators=(",", ":"))
        folder = self.path.parent
        fd, temporary = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=folder)
        try:
            with os.fdopen(fd, "w") as handle:
                handle.write(text)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
        # the rename itself is durable only once the folder is
        folder_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(folder_fd)
        finally:
            os.close(folder_fd)

    # -- publishers --

    def default_publisher_id(self) -> str:
        """A publisher id made once per scope, so a restarted client keeps it."""
        publisher_id = self._data.get("publisher_id")
        if not isinstance(publisher_id, str):
            publisher_id = self._data["publisher_id"] = f"pub-{uuid.uuid4().hex[:16]}"
            self.save()
        return publisher_id

    def new_default_publisher_id(self) -> str:
        """Start a fresh default publisher id (after discarding publishes in flight, whose seqs
        the server may or may not hold: a new sequence never collides with them)."""
        self._data.pop("publisher_id", None)
        return self.default_publisher_id()

    def publisher(self, publisher_id: str) -> dict[str, Any]:
        """``{"last_seq": n, "in_flight": [{"seq", "digest", "body"}, ...]}`` (mutable)."""
        publishers: dict[str, Any] = self._data["publishers"]
        publisher: dict[str, Any] = publishers.setdefault(
            publisher_id, {"last_seq": 0, "in_flight": []}
        )
        if not isinstance(publisher.get("in_flight"), list):
            publisher["in_flight"] = []
        return publisher

    def in_flight_elsewhere(self) -> list[tuple[str, str, int]]:
        """(URL, principal, count) of the other scopes with publishes in flight."""
        out = []
        for key, data in self._file["scopes"].items():
            if data is self._data:
                continue
            count = sum(len(p.get("in_flight") or []) for p in data.get("publishers", {}).values())
            if count:
                url, principal = json.loads(key)
                out.append((str(url), str(principal), count))
        return out

    # -- sessions --

    def _ids(self, client_id: str) -> dict[str, None]:
        return self._delivered.setdefault(client_id, {})

    def was_processed(self, client_id: str, message_id: str) -> bool:
        return message_id in self._ids(client_id)

    def record_processed(self, client_id: str, message_ids: Iterable[str]) -> None:
        ids = self._ids(client_id)
        changed = False
        for message_id in message_ids:
            if message_id not in ids:
                ids[message_id] = None
                changed = True
        if not changed:
            return
        # oldest first: dicts keep insertion order
        for stale in list(ids)[: max(0, len(ids) - self.recent_ids)]:
            del ids[stale]
        self.save()
