"""What the emulator holds per mapping and shard: lanes, batches in flight, what is done, and how
a lane's pending records are cut into batches."""

from __future__ import annotations

import threading
import uuid
from collections import deque
from dataclasses import dataclass, field

from shoal.local.checkpoints import Position
from shoal.local.esm.config import MappingConfig
from shoal.local.esm.invocation import MAX_PAYLOAD_BYTES, StreamRecord


@dataclass
class Batch:
    records: list[StreamRecord]
    #: failed invocations charged against MaximumRetryAttempts (splits are not charged)
    failures: int = 0
    #: approximateInvokeCount of the on-failure record
    invokes: int = 0
    function_error: bool = False
    request_id: str = field(default_factory=lambda: str(uuid.uuid4()))


@dataclass
class Lane:
    pending: deque[StreamRecord] = field(default_factory=deque)
    #: halves of a bisected batch, oldest first: they go before anything newer
    queued: deque[Batch] = field(default_factory=deque)
    #: the batch being tried (first try or retry); None between batches
    current: Batch | None = None
    window_start_ms: int | None = None

    def buffered(self) -> int:
        held = sum(len(b.records) for b in self.queued)
        return len(self.pending) + held + (len(self.current.records) if self.current else 0)


@dataclass
class ShardState:
    shard_id: str
    parent_ids: tuple[str, ...]
    #: where reading starts: the checkpoint, or the mapping's starting position
    start: Position
    #: the position last written to the checkpoint store
    persisted: Position | None
    lanes: list[Lane]
    iterator: str | None = None
    last_read: int | None = None
    #: sequence numbers read and not yet done, in shard order
    outstanding: deque[int] = field(default_factory=deque)
    done: set[int] = field(default_factory=set)
    #: the shard is closed and every record of it was read
    end_of_shard: bool = False

    @property
    def finished(self) -> bool:
        return self.end_of_shard and not self.outstanding


@dataclass
class MappingState:
    config: MappingConfig
    role_arn: str
    shards: dict[str, ShardState] = field(default_factory=dict)
    lock: threading.RLock = field(default_factory=threading.RLock)


def ready(config: MappingConfig, lane: Lane, now_ms: int) -> bool:
    """Whether a lane's pending records make a batch now (full, too big, or window over)."""
    if not lane.pending:
        return False
    if len(lane.pending) >= config.batch_size or config.batching_window_s <= 0:
        return True
    if sum(r.size for r in lane.pending) >= MAX_PAYLOAD_BYTES:
        return True
    started = lane.window_start_ms if lane.window_start_ms is not None else now_ms
    return now_ms - started >= config.batching_window_s * 1000


def cut(config: MappingConfig, lane: Lane, now_ms: int) -> Batch:
    """The next batch of a lane's pending records: the batch size and the payload limit."""
    records: list[StreamRecord] = []
    size = 0
    while lane.pending and len(records) < config.batch_size:
        nxt = lane.pending[0]
        if records and size + nxt.size > MAX_PAYLOAD_BYTES:
            break
        records.append(lane.pending.popleft())
        size += nxt.size
    # What is left waits for a window of its own, as if the poller had just started.
    lane.window_start_ms = now_ms if lane.pending else None
    return Batch(records)
