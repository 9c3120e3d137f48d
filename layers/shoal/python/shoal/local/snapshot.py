"""The embedded AWS's snapshot: moto's state as of one journal record, so that a restart replays
only the records after it (``shoal.local.aws`` writes and loads it; ``shoal.local.journal``).

Without it a restart replayed the whole journal, and its time grew with the history: the
30-minute soak's restarts took 21.6 s, then 34.6, 56.6, 80.6 and 89.9 s as the journal grew to
160 MB (issue 47), 26 s for 60 MB even after the replay was made direct. A snapshot is written
at start, after the replay, once the replay had many records to apply (``SNAPSHOT_AFTER``): a
pickle of every moto backend this process has loaded, with the sequence number of the last
record it holds. The next start loads it and replays the records after that number, so a
restart costs the unpickling plus one server life's records.

The journal stays whole and is still the source of truth: a snapshot that is missing, torn,
or made by another moto, Python or snapshot format is set aside and the journal replayed from
its first record, as before (a journal outlives a Shoal upgrade; a pickle of moto's objects
need not). Written to a temporary file, fsynced and renamed over the last one, a snapshot is
either whole or absent.

What a pickle of moto cannot hold as it is: locks and conditions (made anew, unheld: nothing
runs while one is written or loaded), ``WeakValueDictionary`` (its entries, which the pickle
holds strongly elsewhere), ``defaultdict`` whose default is a lambda of ``{}`` (a
``defaultdict(dict)``), and references to the process-wide backend dicts themselves (the live
ones on load).
"""

from __future__ import annotations

import contextlib
import copyreg
import functools
import gc
import io
import json
import logging
import os
import pickle
import struct
import sys
import threading
import time
import weakref
import zlib
from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal.local.journal import fsync_dir

log = logging.getLogger("shoal-dev.aws")

SNAPSHOT_FILE = "aws-snapshot.bin"
_MAGIC = b"SHOALS1\n"
_HEADER = struct.Struct(">II")  # meta length, crc32 of meta + payload
#: a start that replayed at least this many records writes a snapshot after it
SNAPSHOT_AFTER = 2_000
#: what must match for a snapshot to be loaded (else the journal is replayed whole)
FORMAT = 2

_LOCK_TYPES = (type(threading.Lock()), type(threading.RLock()))


@dataclass(frozen=True)
class Loaded:
    """A snapshot loaded into moto: the last journal record it holds, and what it cost."""

    seq: int
    seconds: float
    size: int


def _identity() -> dict[str, Any]:
    import moto

    return {
        "format": FORMAT,
        "moto": moto.__version__,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
    }


def _backend_dicts() -> dict[str, Any]:
    """Every moto backend dict in use (moto's own list of those to reset), by service name;
    ValueError when one cannot be found again by its name (it could not be loaded back)."""
    from moto.core.base_backend import BackendDict

    found: dict[str, Any] = {}
    for backends in list(BackendDict._instances):
        if _live_backend(backends.service_name) is not backends:
            raise ValueError(f"moto's {backends.service_name} backends have another name")
        found[backends.service_name] = backends
    return found


def _live_backend(name: str) -> Any:
    from moto.backends import get_backend

    return get_backend(name)


def _registries(backends: Any) -> dict[str, Any]:
    """What a backend dict holds besides its accounts: the attributes a plain ``BackendDict``
    does not have. S3's is the bucket namespace (``bucket_accounts``: bucket name -> partition
    and account), by which ``CreateBucket`` finds a bucket that exists; without it a start
    from a snapshot made every existing bucket anew, empty, as ``shoal dev`` provisions."""
    plain = _plain_attributes()
    return {k: v for k, v in vars(backends).items() if k not in plain}


@functools.cache
def _plain_attributes() -> frozenset[str]:
    from moto.core.base_backend import BackendDict

    return frozenset(vars(BackendDict(object, "shoal-snapshot-probe", False, [])))


def _install(name: str, accounts: dict[str, Any], registries: dict[str, Any]) -> None:
    """The live backend dict of ``name`` made to hold ``accounts`` and ``registries``, and
    listed in use (so the next reset empties it, as one moto filled itself)."""
    from moto.core.base_backend import BackendDict

    live = _live_backend(name)
    live.clear()
    live.update(accounts)
    for attribute, value in registries.items():
        setattr(live, attribute, value)
    if live not in BackendDict._instances:
        BackendDict._instances.append(live)


def _weak_values(entries: dict[Any, Any]) -> weakref.WeakValueDictionary[Any, Any]:
    return weakref.WeakValueDictionary(entries)


def _default_dicts(entries: dict[Any, Any]) -> defaultdict[Any, Any]:
    return defaultdict(dict, entries)


def _sized_attributes(entries: dict[str, Any]) -> Any:
    """An item's attributes (moto's ``LimitedSizeDict``) made whole at once: its constructor
    fills it as a dict does, without the size check that its ``__setitem__`` makes of every
    attribute so far for each one set (they were checked when the item was written)."""
    from moto.dynamodb.models.dynamo_type import LimitedSizeDict

    return LimitedSizeDict(entries)


class _Pickler(pickle.Pickler):
    """moto's backends, with what a pickle cannot hold made anew (the module's note).

    The types met are looked up by their exact type in the pickler's own dispatch table, in C:
    a ``reducer_override`` was called for every object that is not a str, a number or the
    like (2.1 million in the 2-hour soak's snapshot), a third of the write. moto subclasses
    none of them."""

    def __init__(self, file: io.BytesIO, backend_names: Mapping[int, str]) -> None:
        from moto.core.base_backend import BackendDict
        from moto.dynamodb.models.dynamo_type import LimitedSizeDict

        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        #: id of each process-wide backend dict -> its service name
        self._backend_names = backend_names
        self.dispatch_table = {
            **copyreg.dispatch_table,
            _LOCK_TYPES[0]: lambda _: (threading.Lock, ()),
            _LOCK_TYPES[1]: lambda _: (threading.RLock, ()),
            weakref.WeakValueDictionary: lambda o: (_weak_values, (dict(o.items()),)),
            defaultdict: self._default_dict,
            BackendDict: self._backend_dict,
            # pickled as a dict subclass, each attribute came back through __setitem__, which
            # sums the size of every attribute set before it: most of a large snapshot's
            # load (the 2-hour soak's 317 MB: 536,000 calls, 9.8 of 21 s under the profiler)
            LimitedSizeDict: lambda o: (_sized_attributes, (dict(o),)),
        }

    def _backend_dict(self, obj: Any) -> Any:
        name = self._backend_names.get(id(obj))
        if name is not None:
            return _live_backend, (name,)
        return obj.__reduce_ex__(pickle.HIGHEST_PROTOCOL)

    def _default_dict(self, obj: defaultdict[Any, Any]) -> Any:
        factory = obj.default_factory
        if (
            factory is not None
            and "<lambda>" in getattr(factory, "__qualname__", "")
            and factory() == {}
        ):
            return _default_dicts, (dict(obj),)
        return obj.__reduce_ex__(pickle.HIGHEST_PROTOCOL)


def write(state_dir: Path, seq: int) -> int:
    """Pickle every loaded moto backend as of journal record ``seq`` into the snapshot file
    (nothing may change moto meanwhile); its size in bytes."""
    backends = _backend_dicts()
    buffer = io.BytesIO()
    _Pickler(buffer, {id(d): name for name, d in backends.items()}).dump(
        {name: (dict(d), _registries(d)) for name, d in backends.items()}
    )
    # the pickle's own buffer, written as it is: joining the parts copied it twice (a
    # second of a 300 MB snapshot's write)
    payload = buffer.getbuffer()
    meta = json.dumps({**_identity(), "seq": seq}).encode()
    head = _MAGIC + _HEADER.pack(len(meta), zlib.crc32(payload, zlib.crc32(meta))) + meta
    path = state_dir / SNAPSHOT_FILE
    temporary = path.with_name(path.name + ".tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for part in (memoryview(head), payload):
            left = part
            while left:
                left = left[os.write(fd, left) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temporary, path)
    fsync_dir(state_dir)
    return len(head) + len(payload)


def load(state_dir: Path) -> Loaded | None:
    """Install the snapshot's backends into moto (emptied, as at start), if there is one this
    process can load; None otherwise (the caller empties moto again: a failed install may
    have put part of it there, and the journal is replayed whole)."""
    path = state_dir / SNAPSHOT_FILE
    if not path.exists():
        return None
    started = time.perf_counter()
    status = path.stat()
    if status.st_uid != os.getuid() or status.st_mode & 0o022:
        # a pickle runs code as it loads: only this user's own file, which only it could
        # have written (as ssh treats its keys)
        log.warning("snapshot: %s is not this user's alone; replaying the whole journal", path)
        return None
    parsed = _parse(path.read_bytes())
    if isinstance(parsed, str):
        log.warning("snapshot: %s; replaying the whole journal", parsed)
        return None
    meta, payload = parsed
    try:
        with collector_held():
            state = pickle.loads(payload)  # noqa: S301 - this user's own file
            for name, (accounts, registries) in state.items():
                _install(name, accounts, registries)
            _queues_start_empty()
    except Exception as exc:  # any failure: the journal rebuilds what the snapshot holds
        log.warning(
            "snapshot: could not be loaded (%s); replaying the whole journal", type(exc).__name__
        )
        return None
    return Loaded(int(meta["seq"]), time.perf_counter() - started, status.st_size)


@contextlib.contextmanager
def collector_held() -> Iterator[None]:
    """The garbage collector off while a snapshot is loaded, on again after if it was: its
    passes would walk millions of objects that all stay, for cycles that cannot be there yet.
    Unpickling the 2-hour soak's 317 MB took 7.7 s with it and 4.3 s without, to the same RSS
    (1,312 MB). Not for the journal's replay: each record's answer leaves cyclic garbage, and
    held off through thousands of records the collector left the process fragmented for its
    life (``SerializedApp.replay``)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def _queues_start_empty() -> None:
    """Every SQS queue without messages, as a start without a snapshot leaves it: the journal
    keeps no queue's messages (``shoal.local.aws.TRANSIENT_QUEUE_ACTIONS``), so the records
    after a snapshot neither send nor delete what it holds. A snapshot's messages were, in
    part, in flight to handlers of the process that died (pushes of a FIFO lane received and
    never deleted): kept, each would hold its lane's later pushes until its visibility ran
    out, and come back at every start from the same snapshot. The soak found sessions that
    got nothing for the rest of the run after such a restart (issue 47)."""
    from moto.sqs.models import sqs_backends

    for _account, regions in sqs_backends.items():
        for _region, backend in regions.items():
            for queue in backend.queues.values():
                queue._messages = []
                queue._pending_messages = set()
                queue.deleted_messages = set()


def _parse(data: bytes) -> tuple[dict[str, Any], memoryview] | str:
    """The snapshot's meta and pickled payload, if this process can load them; else why not."""
    if not data.startswith(_MAGIC) or len(data) < len(_MAGIC) + _HEADER.size:
        return "not a snapshot"
    meta_length, crc = _HEADER.unpack_from(data, len(_MAGIC))
    start = len(_MAGIC) + _HEADER.size
    meta, payload = data[start : start + meta_length], memoryview(data)[start + meta_length :]
    if len(meta) < meta_length or zlib.crc32(payload, zlib.crc32(meta)) != crc:
        return "torn or damaged"
    identity = json.loads(meta)
    mismatched = {k: v for k, v in _identity().items() if identity.get(k) != v}
    if mismatched:
        return f"made by another {', '.join(sorted(mismatched))}"
    return identity, payload


#: while serving, a snapshot after this many records since the last one: a start after a kill
#: replays at most about this many (about 1,500 a second here: 3 s), and the child pickling
#: the state (about a second for the soak's 20 MB) runs about once a minute under its load
SNAPSHOT_WHILE_SERVING = 5_000
#: a snapshotting child that has not finished by then is killed (the last snapshot stands)
CHILD_TIMEOUT_S = 120.0


class Snapshotter:
    """Snapshots taken while the emulator serves, without holding it still while they are
    written: under the backend lock a child process is forked (the copy-on-write image of
    moto as of the last staged record), the lock is let go, and the child pickles and writes
    that image while the parent goes on serving, as Redis's ``BGSAVE`` does. Pickling in the
    parent would hold every AWS call for as long as it takes (0.5 to 0.9 s for the soak's
    19 MB snapshot, longer as state grows, past the calls' 2 s wait for the lock).

    The child runs only the pickling and its file's writes (no logging, no journal, no
    sockets) and leaves with ``os._exit``; a lock another thread held at the fork is never
    taken by it (the pickler makes locks anew without acquiring them). One child at a time;
    one that has not finished in ``CHILD_TIMEOUT_S`` is killed, and the last snapshot
    stands. Where ``os.fork`` is missing, snapshots are taken at start and stop only."""

    def __init__(self, state_dir: Path, last_seq: int) -> None:
        self.state_dir = state_dir
        #: the last journal record the newest snapshot holds
        self.last_seq = last_seq
        self._child: int | None = None
        self._reaper: threading.Thread | None = None

    def due(self, seq: int) -> bool:
        """Whether a snapshot should be taken now (cheap: called under the lock per write)."""
        return (
            self._child is None
            and hasattr(os, "fork")
            and seq - self.last_seq >= SNAPSHOT_WHILE_SERVING
        )

    def fork(self, seq: int) -> None:
        """Start a child writing the snapshot as of record ``seq`` (the caller holds the
        backend lock, so moto is exactly that)."""
        import warnings

        with warnings.catch_warnings():
            # CPython warns of fork in a threaded process: a child that takes a lock another
            # thread held may wait for ever. This one takes none (see the class), and is
            # killed past its timeout.
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # the child
            status = 0
            try:
                write(self.state_dir, seq)
            except BaseException:
                status = 1
            os._exit(status)
        self._child = pid
        self._reaper = threading.Thread(
            target=self._reap, args=(pid, seq, time.monotonic()), name="shoal-snapshot", daemon=True
        )
        self._reaper.start()

    def _reap(self, pid: int, seq: int, started: float) -> None:
        status = None
        while status is None:
            done, code = os.waitpid(pid, os.WNOHANG)
            if done:
                status = os.waitstatus_to_exitcode(code)
                break
            if time.monotonic() - started > CHILD_TIMEOUT_S:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                status = -9
                break
            time.sleep(0.1)
        if status == 0:
            self.last_seq = seq
            log.info(
                "snapshot: written by a child in %.2f s (through record %d)",
                time.monotonic() - started,
                seq,
            )
        else:
            log.warning("snapshot: the child writing it ended with %s", status)
        self._child = None

    def wait(self) -> None:
        """Until no child writes a snapshot (before another one is written here)."""
        reaper = self._reaper
        if reaper is not None:
            reaper.join(CHILD_TIMEOUT_S + 5)
