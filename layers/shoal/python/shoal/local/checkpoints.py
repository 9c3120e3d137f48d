"""Where an emulated event source mapping has got to in each shard: its checkpoints.

A checkpoint is a position a shard iterator can be made from, so resuming is one
GetShardIterator call, the same against moto and against Kinesis. Checkpoints are keyed by
mapping UUID and shard id, as Lambda keys its own. ``FileCheckpoints`` keeps them in a state
directory and survives a kill -9 (atomic replace of one small JSON file per mapping);
``MemoryCheckpoints`` keeps them for the life of the process.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

PositionKind = Literal[
    "TRIM_HORIZON", "LATEST", "AT_TIMESTAMP", "AT_SEQUENCE_NUMBER", "AFTER_SEQUENCE_NUMBER"
]
_KINDS = {"TRIM_HORIZON", "LATEST", "AT_TIMESTAMP", "AT_SEQUENCE_NUMBER", "AFTER_SEQUENCE_NUMBER"}


@dataclass(frozen=True)
class Position:
    """A place in a shard: a starting position, a time, or a sequence number.

    ``AFTER_SEQUENCE_NUMBER n`` is the ordinary checkpoint: record n and every record before it
    are done. ``AT_SEQUENCE_NUMBER n`` says n itself is not done yet.
    """

    kind: PositionKind
    sequence_number: str | None = None
    #: seconds since the epoch, for AT_TIMESTAMP
    timestamp: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"unknown position {self.kind!r}")
        if self.kind.endswith("SEQUENCE_NUMBER") and self.sequence_number is None:
            raise ValueError(f"{self.kind} needs a sequence number")
        if self.kind == "AT_TIMESTAMP" and self.timestamp is None:
            raise ValueError("AT_TIMESTAMP needs a timestamp")

    @classmethod
    def after(cls, sequence_number: int | str) -> Position:
        return cls("AFTER_SEQUENCE_NUMBER", sequence_number=str(sequence_number))

    @classmethod
    def at(cls, sequence_number: int | str) -> Position:
        return cls("AT_SEQUENCE_NUMBER", sequence_number=str(sequence_number))

    def iterator_args(self) -> dict[str, Any]:
        """The GetShardIterator arguments that resume from here."""
        args: dict[str, Any] = {"ShardIteratorType": self.kind}
        if self.sequence_number is not None:
            args["StartingSequenceNumber"] = self.sequence_number
        if self.timestamp is not None:
            args["Timestamp"] = self.timestamp
        return args

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind}
        if self.sequence_number is not None:
            out["sequence_number"] = self.sequence_number
        if self.timestamp is not None:
            out["timestamp"] = self.timestamp
        return out

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Position:
        return cls(raw["kind"], raw.get("sequence_number"), raw.get("timestamp"))


class CheckpointStore(Protocol):
    def load(self, mapping_uuid: str, shard_id: str) -> Position | None: ...

    def save(self, mapping_uuid: str, shard_id: str, position: Position) -> None: ...

    def delete_mapping(self, mapping_uuid: str) -> None: ...


class MemoryCheckpoints:
    """Checkpoints for the life of the process (``shoal dev`` without ``--state-dir``, tests)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._positions: dict[tuple[str, str], Position] = {}

    def load(self, mapping_uuid: str, shard_id: str) -> Position | None:
        with self._lock:
            return self._positions.get((mapping_uuid, shard_id))

    def save(self, mapping_uuid: str, shard_id: str, position: Position) -> None:
        with self._lock:
            self._positions[(mapping_uuid, shard_id)] = position

    def delete_mapping(self, mapping_uuid: str) -> None:
        with self._lock:
            for key in [k for k in self._positions if k[0] == mapping_uuid]:
                del self._positions[key]


_SAFE_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


class FileCheckpoints:
    """One ``<mapping uuid>.json`` per mapping under ``directory``: ``{shard id: position}``.

    Every save rewrites the mapping's file through a temporary file that is fsynced and then
    renamed over the old one, so a kill -9 leaves either the old or the new checkpoints, never
    a torn file.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._cache: dict[str, dict[str, Position]] = {}

    def _path(self, mapping_uuid: str) -> Path:
        # UUIDs come from the Lambda API; refuse anything that could leave the directory.
        if not _SAFE_NAME.match(mapping_uuid):
            raise ValueError(f"not a mapping uuid: {mapping_uuid!r}")
        return self.directory / f"{mapping_uuid}.json"

    def _read(self, mapping_uuid: str) -> dict[str, Position]:
        if mapping_uuid not in self._cache:
            path = self._path(mapping_uuid)
            try:
                raw = json.loads(path.read_text())
            except FileNotFoundError:
                raw = {}
            self._cache[mapping_uuid] = {k: Position.from_json(v) for k, v in raw.items()}
        return self._cache[mapping_uuid]

    def load(self, mapping_uuid: str, shard_id: str) -> Position | None:
        with self._lock:
            return self._read(mapping_uuid).get(shard_id)

    def save(self, mapping_uuid: str, shard_id: str, position: Position) -> None:
        with self._lock:
            positions = dict(self._read(mapping_uuid))
            positions[shard_id] = position
            body = json.dumps({k: v.to_json() for k, v in sorted(positions.items())})
            _atomic_write(self._path(mapping_uuid), body)
            self._cache[mapping_uuid] = positions

    def delete_mapping(self, mapping_uuid: str) -> None:
        with self._lock:
            self._cache.pop(mapping_uuid, None)
            with contextlib.suppress(FileNotFoundError):
                self._path(mapping_uuid).unlink()


def _atomic_write(path: Path, body: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(body)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    # The rename itself is durable only once the directory entry is on disk.
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
