"""Shared by the ordered-drain tests (no tests here): a router fed stream by stream.

``Feed`` hands the router the records of one storage stream that it has not had yet, as the
event source mapping would, so a test chooses the order in which storage topics are routed
(T1 before T0). ``wire`` turns the drain on in a delivery ``World``: the router labels and
marks, get gates sessions (and group streams, in a ``GroupWorld``), a sealer on the world's
clock.
"""

from __future__ import annotations

from typing import Any

from shoal.aws.dynamo import Dynamo
from shoal.core.config import get_config
from shoal.delivery.gate import SessionGate
from shoal.drain import DrainStore, DrainView, RouterDrain, Sealer
from shoal.groups.gate import GroupGate
from shoal.local.esm.invocation import event_of

from tests.helpers import FakeContext
from tests.integration.test_delivery_support import World

#: the grace the tests' sealer waits after a switch is in effect
GRACE_MS = 5_000


class Feed:
    def __init__(self, world: World) -> None:
        self.world = world
        #: (stream, shard) -> every record handed to the router so far, in order
        self.sent: dict[tuple[str, str], list[Any]] = {}

    def route(self, stream: str) -> int:
        """Route the stream's new records, shard by shard; how many records."""
        total = 0
        for shard in self.world.harness.shards(stream):
            shard_id = shard["ShardId"]
            sent = self.sent.setdefault((stream, shard_id), [])
            records = self._records(stream, shard_id)[len(sent) :]
            if records:
                self._invoke(stream, shard_id, records)
                sent += records
                total += len(records)
        return total

    def replay(self, stream: str) -> None:
        """Lambda retries every batch already handed over, whole (a replayed mapping)."""
        for shard in self.world.harness.shards(stream):
            sent = self.sent.get((stream, shard["ShardId"]), [])
            if sent:
                self._invoke(stream, shard["ShardId"], sent)

    def _records(self, stream: str, shard_id: str) -> list[Any]:
        kinesis = self.world.session.client("kinesis")
        iterator = kinesis.get_shard_iterator(
            StreamName=stream, ShardId=shard_id, ShardIteratorType="TRIM_HORIZON"
        )["ShardIterator"]
        out: list[Any] = []
        while True:
            response = kinesis.get_records(ShardIterator=iterator, Limit=10_000)
            if not response["Records"]:
                return out
            out += response["Records"]
            iterator = response["NextShardIterator"]

    def _invoke(self, stream: str, shard_id: str, records: list[Any]) -> None:
        event = event_of(records, stream=stream, shard_id=shard_id)
        response = self.world.router(event, FakeContext())
        assert not response.get("batchItemFailures"), response


class Drain:
    """The drain's pieces in a world: its store, the sealer, and the gates wired in."""

    def __init__(self, world: World) -> None:
        config = get_config()
        self.store = DrainStore(Dynamo(world.session.client("dynamodb")), config.table("inboxes"))
        world.fanout.drain = RouterDrain(self.store, config.stream_prefix, world.clock)
        self.session_gate = SessionGate(
            DrainView(self.store, world.clock),
            self.store.dynamo,
            self.store.table,
            config.stream_prefix,
        )
        world.delivery.drain = self.session_gate
        groups = getattr(world, "groups", None)
        self.group_gate: GroupGate | None = None
        if groups is not None:
            self.group_gate = GroupGate(
                DrainView(self.store, world.clock),
                self.store.dynamo,
                self.store.table,
                config.stream_prefix,
                groups.store.lane_progress,
            )
            groups.drain = self.group_gate
        self.sealer = Sealer(
            world.harness.streams,
            self.store,
            world.harness.store.scan,
            world.clock,
            grace_ms=GRACE_MS,
        )


def switch(topic: str, partitions: int = 1) -> None:
    """AddStorageTopic, then SwitchProduce (the admin calls return once it is in effect)."""
    from tests.integration.test_publish_harness import admin_call

    status, body = admin_call(
        "POST", f"/v1/topics/{topic}/storage-topics", {"partitions": partitions}
    )
    assert status in (200, 201), body
    status, body = admin_call("POST", f"/v1/topics/{topic}/switch-produce")
    assert status == 200, body
