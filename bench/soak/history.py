"""The soak's history: every operation a client made and every answer it got, append-only.

Jepsen's model: nothing is judged while the run goes on. Each process of the run (the driver,
each client worker, each life of a worker after a kill -9) appends JSON lines to a file of its
own in the run's history folder, and ``bench.soak.checker`` reads the folder afterwards. A line
is written with one ``os.write`` on an ``O_APPEND`` descriptor before the operation's effect is
used (a delivery is recorded before the application sees it), so a process killed at any point
leaves every line it wrote whole except, at worst, the last (the reader skips and counts it).

Every record has ``t`` (wall clock, seconds: every process of a run shares the machine's clock,
and the server's ``published_at`` is read from the same clock), ``w`` (the writer: ``driver``,
``worker-3``), ``life`` (the writer's life: a worker killed and started again writes a new file
with the next life), ``n`` (the record's number within its file: the order its writer saw) and
``op``. The operations and their fields:

- ``publish`` (``phase`` ``invoke`` / ``ok`` / ``fail`` / ``info``): one record per message of
  a request (``rq`` names the request, ``i`` the message's place in it); ``client``, ``pub``
  (publisher id), ``seq``, ``mk`` (the soak's own key of the message, carried in its payload),
  ``topic``, ``qos``, ``retain``, ``key`` (the ordering key given, or None); ``ok`` adds
  ``message_id`` and ``duplicate``; ``fail`` ``status`` and ``code`` (refused: not accepted);
  ``info`` ``error`` (no answer: unknown, the exactly-once client sends it again).
- ``connect`` (``invoke`` / ``ok`` / ``fail``): ``client``, ``conn`` (the soak's id of the
  connection: a WebSocket connection, or an HTTP channel), ``transport`` (``ws`` / ``http``),
  ``clean_start``, ``session_expiry_s``, ``keepalive_s``, ``will`` (``{wid, topic, delay_s}``
  or None; ``wid`` is carried in the will's payload); ``ok`` adds ``channel`` and
  ``session_present``. ``renew`` moves a live channel to a new WebSocket connection (no will
  question: the session never lost its connection).
- ``disconnect`` (``invoke`` / ``ok`` / ``fail``): ``client``, ``conn``: a normal DISCONNECT.
- ``lost``: the client lost ``conn`` without a DISCONNECT; ``how`` is ``dropped`` (the
  WebSocket's TCP connection shut without a close frame), ``silent`` (an HTTP channel that stops
  calling: ``last_invoke`` / ``last_answer`` are its last call's times), ``crashed`` (the
  client thread stopped without a goodbye), or ``ended`` (the server ended it: a takeover or
  an expired channel).
- ``subscribe`` / ``unsubscribe`` (``invoke`` / ``ok`` / ``fail``): ``client``, ``filters``
  (``[{filter, qos}]`` or names), ``granted``.
- ``deliver``: one message received, before the client's own de-duplication: ``client``,
  ``transport``, ``conn``, ``ti`` (for a long poll: when the get that returned it was sent),
  ``id`` (delivery id), ``message_id``, ``mk`` / ``wid`` (from the payload), ``topic``, ``qos``,
  ``retain``, ``dup``, ``sub`` (the subscription it came under), ``published_at`` (ms).
- ``ack`` (``invoke`` / ``ok`` / ``fail``): ``client``, ``conn``, ``rq``, ``ids``; ``ok`` adds
  ``acked`` (how many the server counted).
- ``push_sub`` (``invoke`` / ``ok``): ``name``, ``filter``, ``ordered``.
- ``push_hit``: one POST to the push endpoint: ``mk``, ``message_id``, ``attempt``, ``key``,
  ``status`` (what the endpoint answered), ``fate`` (what the endpoint does with that message:
  ``ok``, ``transient`` (fails its first attempts), ``reject`` (400: dead-letters at once),
  ``exhaust`` (503 always: dead-letters when its attempts run out)).
- ``push_final``: the subscription at the end: ``name``, ``dlq`` (``[{message_id, mk, reason,
  attempts}]``), ``retry_depth``, ``dlq_depth``.
- ``topic``: an admin change of a composite topic (``action`` ``create`` / ``grow`` /
  ``switch``, ``name``, ``phase``).
- ``fault``: ``kind`` (``server_kill``, ``server_up``, ``client_kill``, ``client_restart``,
  ``ws_drop``, ``token_expiry``, ``token_renewed``), with what it hit.
- ``phase``: ``name`` ``start`` (with the run's settings: ``reaper_s``, ``keepalive_s``, the
  throttle), ``traffic_end`` (no new operations from here, only draining), ``end``.
- ``sample``: ``server`` (whether it was up), the clients' ``clients_rss_kb``, the machine's
  ``load``; while up, the server's ``pid``, ``rss_kb``, ``fds``, ``threads`` and ``cpu_s``
  (the CPU seconds, user and system, its process tree has used since it started; older
  histories have neither ``pid`` nor ``cpu_s``) (``bench.soak.driver.Sampler``).
- ``state_memory``: at the end, the server's ``server_rss_kb`` and ``state_rss_kb``, a fresh
  process's holding the same state (``bench.soak.server.state_rss_kb``).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

Record = dict[str, Any]

#: the folder's files end so; anything else in it is not read
SUFFIX = ".jsonl"


class History:
    """One writer's append-only history: a file (``path``), or memory only (``path`` None:
    the checker's tests build histories with it and a clock of their own)."""

    def __init__(
        self,
        path: Path | None,
        *,
        writer: str,
        life: int = 0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = path
        self.writer = writer
        self.life = life
        self.clock = clock
        self.records: list[Record] = []
        self._n = 0
        self._lock = threading.Lock()
        self._fd: int | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def record(self, op: str, **fields: Any) -> Record:
        """Append one record (``t`` taken now unless given) and return it."""
        with self._lock:
            self._n += 1
            record: Record = {
                "t": round(fields.pop("t") if "t" in fields else self.clock(), 6),
                "w": self.writer,
                "life": self.life,
                "n": self._n,
                "op": op,
                **fields,
            }
            if self._fd is not None:
                line = json.dumps(record, separators=(",", ":"), default=str) + "\n"
                os.write(self._fd, line.encode())
            else:
                self.records.append(record)
        return record

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def history_file(folder: Path, writer: str, life: int) -> Path:
    return folder / f"{writer}.{life}{SUFFIX}"


def read_history(where: Path | Iterable[Path]) -> tuple[list[Record], int]:
    """Every record of a history file or folder (or of the files given), in time order (ties:
    writer, life, number), and how many torn lines were skipped (a writer killed mid-line)."""
    if isinstance(where, Path):
        files = sorted(where.glob(f"*{SUFFIX}")) if where.is_dir() else [where]
    else:
        files = list(where)
    records: list[Record] = []
    torn = 0
    for path in files:
        for line in _lines(path):
            try:
                record = json.loads(line)
            except ValueError:
                torn += 1
                continue
            if isinstance(record, dict) and "op" in record and "t" in record:
                records.append(record)
            else:
                torn += 1
    records.sort(key=order_key)
    return records, torn


def order_key(record: Record) -> tuple[float, str, int, int]:
    return (
        float(record["t"]),
        str(record.get("w", "")),
        int(record.get("life", 0)),
        int(record.get("n", 0)),
    )


def _lines(path: Path) -> Iterator[str]:
    with path.open("r", encoding="utf-8", errors="replace") as handle:
        for line in handle:
            if line.strip():
                yield line
