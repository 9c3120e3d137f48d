"""The embedded AWS's journal: every successful mutating request, durable before its response
leaves (``shoal.local.aws`` stages, waits for and replays it).

Group commit: a request's record is staged in memory under the backend lock, in apply order,
and written and fsynced after the lock is let go, by whichever waiting request finds no write
in progress, for every record staged by then (``Journal.wait_durable``). A crash loses only
staged records whose requests were never answered."""

from __future__ import annotations

import json
import logging
import os
import struct
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

log = logging.getLogger("shoal-dev.aws")

JOURNAL_FILE = "aws-journal.bin"
_MAGIC = b"SHOALJ1\n"
_RECORD_HEADER = struct.Struct(">II")  # payload length, crc32 of payload
#: a record larger than this is treated as a torn length field, never allocated
_MAX_RECORD = 1 << 30


@dataclass(frozen=True)
class JournalRecord:
    """One successful mutating request, as the WSGI app saw it."""

    seq: int
    at_ms: int
    environ: dict[str, str]
    preserved_names: dict[str, str]
    body: bytes

    def encode(self) -> bytes:
        meta = {
            "seq": self.seq,
            "at_ms": self.at_ms,
            "environ": self.environ,
            "preserved": self.preserved_names,
        }
        payload = json.dumps(meta, separators=(",", ":")).encode() + b"\n" + self.body
        return _RECORD_HEADER.pack(len(payload), zlib.crc32(payload)) + payload

    @classmethod
    def decode(cls, payload: bytes) -> JournalRecord:
        head, _, body = payload.partition(b"\n")
        meta = json.loads(head)
        return cls(meta["seq"], meta["at_ms"], meta["environ"], meta["preserved"], body)

    @property
    def method(self) -> str:
        return self.environ.get("REQUEST_METHOD", "")


class Journal:
    """An append-only file of length-prefixed, checksummed records.

    Opening it reads every complete record and cuts off a torn tail (a record whose length or
    checksum does not hold: the process died mid-append, so no client was told it succeeded).
    ``after``: the last record a snapshot holds (``shoal.local.snapshot``); records up to it
    are read past, not kept, and the next record's number is past it whatever the file holds.
    """

    def __init__(self, path: Path, *, after: int = -1) -> None:
        self.path = path
        #: how many records ``pending`` yields (those after ``after``)
        self.pending_count = 0
        #: the file's span of those records (read again by ``pending``, not kept: decoded all at
        #: once, a long journal's records took more memory than the state they make, and the
        #: process kept it after the replay)
        self._pending_span = (0, 0)
        self._after = after
        self.dropped_tail_bytes = 0
        #: the last record number read, kept or not
        self._last_seq = after
        created = not path.exists()
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        if created or os.fstat(self._fd).st_size == 0:
            os.write(self._fd, _MAGIC)
            os.fsync(self._fd)
            fsync_dir(path.parent)
        self._load()
        os.lseek(self._fd, 0, os.SEEK_END)
        #: the last record staged (applied, in order), and the last one on disk
        self.staged_seq = self._last_seq
        self.durable_seq = self.staged_seq
        self._staged: list[bytes] = []
        self._writing = False
        self._failure: OSError | None = None
        self._turn = threading.Condition()

    def _load(self) -> None:
        size = os.fstat(self._fd).st_size
        with open(self.path, "rb") as f:
            if f.read(len(_MAGIC)) != _MAGIC:
                raise ValueError(f"{self.path} is not a shoal AWS journal")
            good = first = f.tell()
            for payload in _payloads(f, size):
                seq = _seq_of(payload)
                if seq > self._last_seq:
                    if not self.pending_count:
                        first = good
                    self.pending_count += 1
                    self._last_seq = seq
                good = f.tell()
        self._pending_span = (first, good) if self.pending_count else (good, good)
        if good < size:
            self.dropped_tail_bytes = size - good
            log.warning("journal: dropped a torn tail of %d bytes", self.dropped_tail_bytes)
            os.ftruncate(self._fd, good)
            os.fsync(self._fd)

    def pending(self) -> Iterator[JournalRecord]:
        """The records read at opening after ``after``, in order, each decoded as it is asked
        for (a replay holds one at a time)."""
        start, end = self._pending_span
        last = self._after
        with open(self.path, "rb") as f:
            f.seek(start)
            for payload in _payloads(f, end):
                record = JournalRecord.decode(payload)
                if record.seq > last:
                    last = record.seq
                    yield record

    @property
    def next_seq(self) -> int:
        """The sequence number of the next record."""
        return self.staged_seq + 1

    def stage(self, record: JournalRecord) -> None:
        """Queue one applied record for the disk (under the backend lock, in apply order)."""
        data = record.encode()
        with self._turn:
            self._staged.append(data)
            self.staged_seq = record.seq

    def wait_durable(self, seq: int) -> None:
        """Returns once every record up to ``seq`` is on disk, writing them if no other
        waiter is; raises OSError once a write failed (every later answer would show what
        the disk lacks)."""
        with self._turn:
            while True:
                if self._failure is not None:
                    raise OSError(self._failure.errno, f"journal write failed: {self._failure}")
                if self.durable_seq >= seq:
                    return
                if not self._writing:
                    break
                self._turn.wait()
            chunks, upto = self._staged, self.staged_seq
            self._staged = []
            self._writing = True
        failure: OSError | None = None
        try:
            self.write_out(chunks)
        except OSError as exc:
            failure = exc
        with self._turn:
            self._writing = False
            if failure is None:
                self.durable_seq = upto
            else:
                self._failure = failure
            self._turn.notify_all()
        if failure is not None:
            raise failure

    def write_out(self, chunks: list[bytes]) -> None:
        """Write records in order and fsync them."""
        for data in chunks:
            view = memoryview(data)
            while view:
                written = os.write(self._fd, view)
                view = view[written:]
        os.fsync(self._fd)

    def append(self, record: JournalRecord) -> None:
        """Stage one record and wait until it is durable."""
        self.stage(record)
        self.wait_durable(record.seq)

    def close(self) -> None:
        if self._fd >= 0:
            try:
                self.wait_durable(self.staged_seq)
            except OSError:
                log.warning("journal: the last staged records could not be written")
            os.close(self._fd)
            self._fd = -1


def _payloads(f: BinaryIO, end: int) -> Iterator[bytes]:
    """The payloads of the intact records from ``f``'s position up to offset ``end``; the
    first torn one (a short read, a length past ``_MAX_RECORD``, a wrong checksum) ends them."""
    while f.tell() < end:
        header = f.read(_RECORD_HEADER.size)
        if len(header) < _RECORD_HEADER.size:
            return
        length, crc = _RECORD_HEADER.unpack(header)
        if length > _MAX_RECORD:
            return
        payload = f.read(length)
        if len(payload) < length or zlib.crc32(payload) != crc:
            return
        yield payload


def _seq_of(payload: bytes) -> int:
    """A record's number without decoding the rest: ``encode`` writes it first."""
    if payload.startswith(b'{"seq":'):
        end = payload.find(b",", 7)
        if end > 0:
            return int(payload[7:end])
    return JournalRecord.decode(payload).seq


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
