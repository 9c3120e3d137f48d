"""The drain's gate for a shared group: a group stream of a later storage topic is read once
every group stream of the earlier ones handed out and committed past its seal."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace

from shoal.aws.dynamo import Dynamo, to_item
from shoal.composite.model import (
    storage_of,
    stream_name,
)
from shoal.core.clock import Clock
from shoal.core.config import Config
from shoal.delivery.inbox import InboxItem
from shoal.delivery.model import item_key, source_id
from shoal.drain import RECHECK_MS, SOURCE_END, DrainStore, DrainView
from shoal.groups.streams import (
    StreamProgress,
    StreamReader,
    lane_streams,
    stream_lane,
)


class GroupGate:
    """Whether a shared group's stream of a later storage topic may be read yet."""

    def __init__(
        self,
        view: DrainView,
        dynamo: Dynamo,
        table: str,
        stream_prefix: str,
        progress: Callable[[str, str], Mapping[str, StreamProgress]],
    ) -> None:
        self.view = view
        self.dynamo = dynamo
        self.table = table
        self.stream_prefix = stream_prefix
        #: (group key, source) -> the progress of the source's streams (its lanes), by name
        self.progress = progress
        self.reader = StreamReader(dynamo, table)
        #: (group partition, earlier stream) found passed: stays so
        self._passed: set[tuple[str, str]] = set()
        self._not_yet: dict[tuple[str, str], int] = {}

    def admits(self, group_key: str, partition: str, lanes: int, item: InboxItem) -> bool:
        if item.stream is None:
            return True
        storage = storage_of(item.stream, self.stream_prefix)
        if storage is None:
            return True
        topic, index = storage
        for earlier_index in range(index):
            earlier = stream_name(self.stream_prefix, topic, earlier_index)
            if (partition, earlier) in self._passed:
                continue
            shards = self.view.sealed_shards(earlier)
            if shards is None or not self._passed_now(group_key, partition, lanes, earlier, shards):
                return False
            self._passed.add((partition, earlier))
        return True

    def _passed_now(
        self, group_key: str, partition: str, lanes: int, stream: str, shards: Iterable[str]
    ) -> bool:
        """Every group stream (every lane) of ``stream`` handed out its last message and has
        nothing in flight (all acked: its committed progress is past the seal)."""
        now = self.view.clock.now_ms()
        key = (partition, stream)
        if now - self._not_yet.get(key, -RECHECK_MS) < RECHECK_MS:
            return False
        for shard in shards:
            source = source_id(stream, shard)
            rows = self.dynamo.query(
                self.table,
                KeyConditionExpression="#p = :p AND #k BETWEEN :a AND :b",
                ExpressionAttributeNames={"#p": "inbox", "#k": "position"},
                ExpressionAttributeValues=to_item(
                    {":p": partition, ":a": f"{source}#", ":b": item_key(source, SOURCE_END)}
                ),
                ConsistentRead=True,
                ScanIndexForward=False,
                Limit=1,
            )
            if not rows:
                continue  # nothing of this shard ever reached the group
            messages = InboxItem.from_record(rows[0]).messages
            last = messages[-1].position if messages else ""
            found = self.progress(group_key, source)
            for lane in lane_streams(source, lanes):
                progress = found.get(lane)
                if (
                    progress is None
                    or progress.in_flight() > 0
                    or not self._read_past(partition, source, lanes, progress, last)
                ):
                    self._not_yet[key] = now
                    return False
        self._not_yet.pop(key, None)
        return True

    def _read_past(
        self, partition: str, source: str, lanes: int, progress: StreamProgress, last: str
    ) -> bool:
        """The stream's cursor is at ``last``, or (a lane) nothing of its lane lies between:
        a lane's holder saves its passing over other lanes' messages only now and then."""
        if progress.cursor >= last:
            return True
        if lanes == 1:
            return False
        lane = stream_lane(progress.source, lanes)[1]
        for found in self.reader.after(partition, source, replace(progress)):
            if lane.holds(found.message):
                return False
            if found.message.position >= last:
                return True
        # the read stopped at its bound before ``last``: the lane's holder moves on first
        return False


def group_gate(
    config: Config, clock: Clock, progress: Callable[[str, str], Mapping[str, StreamProgress]]
) -> GroupGate:
    store = DrainStore.from_config(config)
    return GroupGate(
        DrainView(store, clock), store.dynamo, store.table, config.stream_prefix, progress
    )
