"""The ordered drain's bookkeeping without AWS: seal records, when a storage topic is due,
drained marks, and the readers' cache of them (an injected clock)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shoal.aws.kinesis import OutRecord, PutOutcome
from shoal.composite.model import ROUTED_PUT_BOUND_MS, CompositeTopic, StorageTopic, storage_of
from shoal.core.clock import ManualClock
from shoal.core.config import Config
from shoal.delivery.inbox import DeliveryState, InboxItem
from shoal.drain import RECHECK_MS, DrainRecord, DrainView, Sealer, due, seal_grace_ms
from shoal.records import decode_record, is_seal, seal_record

GRACE = 5_000


def topic(pointer: int, effective_at_ms: int, count: int = 3) -> CompositeTopic:
    storage = tuple(StorageTopic(i, f"shoal-orders-{i}", 2, 1) for i in range(count))
    return CompositeTopic("orders", 5, pointer, storage, effective_at_ms=effective_at_ms)


def test_a_seal_record_is_recognised_and_holds_no_message() -> None:
    # Given a seal record
    data = seal_record("shoal-orders-0", "shardId-000000000001", 123)
    # Then it is a seal, and decoding it yields no message (nothing counts it)
    assert is_seal(data)
    assert decode_record(data) == []
    assert not is_seal(b'{"v":1,"m":[]}\n')


def test_the_grace_is_the_routed_put_bound_unless_the_environment_sets_it() -> None:
    # Then without the variable it is the publish path's bound on a put after routing (10 s)
    # and the skew margin, not a function timeout
    assert seal_grace_ms() == ROUTED_PUT_BOUND_MS + 1_000 == 11_000
    assert seal_grace_ms(Config.from_env({"SHOAL_SEAL_GRACE_S": "0.5"}).seal_grace_s) == 500


def test_a_stream_name_gives_its_topic_and_index() -> None:
    assert storage_of("shoal-my-topic-12", "shoal") == ("my-topic", 12)
    assert storage_of("other-orders-1", "shoal") is None
    assert storage_of("shoal-orders", "shoal") is None


def test_storage_topics_before_the_pointer_are_due_only_after_the_grace() -> None:
    # Given a switch to T2 effective at t=1000
    switched = topic(pointer=2, effective_at_ms=1_000)
    # Then nothing is due within the grace, and T0 and T1 after it
    assert due(switched, 1_000 + GRACE - 1, GRACE) == []
    assert due(switched, 1_000 + GRACE, GRACE) == [0, 1]
    # and a topic that never switched has nothing to seal
    assert due(topic(pointer=0, effective_at_ms=0), 10**12, GRACE) == []


def test_fully_drained_needs_the_seal_mark_and_every_sealed_shard_drained() -> None:
    assert not DrainRecord().fully_drained
    # routed seals without the sealer's mark (it crashed before it): not yet
    assert not DrainRecord(None, frozenset({"a", "b"})).fully_drained
    assert not DrainRecord(("a", "b"), frozenset({"a"})).fully_drained
    assert DrainRecord(("a", "b"), frozenset({"a", "b"})).fully_drained


@dataclass
class FakeStore:
    records: dict[str, DrainRecord] = field(default_factory=dict)
    reads: int = 0
    sealed: list[tuple[str, list[str]]] = field(default_factory=list)

    def record(self, stream: str) -> DrainRecord:
        self.reads += 1
        return self.records.get(stream, DrainRecord())

    def mark_sealed(self, stream: str, shards: list[str], at_ms: int) -> None:
        self.sealed.append((stream, sorted(shards)))
        self.records[stream] = DrainRecord(tuple(sorted(shards)))


def test_the_view_caches_drained_forever_and_asks_again_for_not_yet() -> None:
    # Given a storage topic not drained yet
    store, clock = FakeStore(), ManualClock(0)
    view = DrainView(store, clock)  # type: ignore[arg-type]
    assert view.sealed_shards("s") is None
    # Then a second question within RECHECK_MS reads nothing
    assert view.sealed_shards("s") is None
    assert store.reads == 1
    # When it is drained and the recheck time has passed
    store.records["s"] = DrainRecord(("a",), frozenset({"a"}))
    clock.advance(RECHECK_MS / 1000)
    assert view.sealed_shards("s") == ("a",)
    # Then it is never read again
    clock.advance(3600)
    assert view.sealed_shards("s") == ("a",)
    assert store.reads == 2


@dataclass
class FakeKinesis:
    shards: list[dict[str, Any]]

    def list_shards(self, **_: Any) -> dict[str, Any]:
        return {"Shards": self.shards}


@dataclass
class FakeStreams:
    kinesis: FakeKinesis
    fail: bool = False
    puts: list[tuple[str, OutRecord]] = field(default_factory=list)

    def put_record(self, stream: str, record: OutRecord) -> PutOutcome:
        self.puts.append((stream, record))
        return PutOutcome(error_code="Throttled") if self.fail else PutOutcome("x", "1")


def shard(n: int, start: int, closed: bool = False) -> dict[str, Any]:
    numbers = {"StartingSequenceNumber": "1"} | ({"EndingSequenceNumber": "9"} if closed else {})
    return {
        "ShardId": f"shardId-{n:012d}",
        "HashKeyRange": {"StartingHashKey": str(start)},
        "SequenceNumberRange": numbers,
    }


def sealer_of(
    topics: list[CompositeTopic], streams: FakeStreams, clock: ManualClock
) -> tuple[Sealer, FakeStore]:
    store = FakeStore()
    sealer = Sealer(streams, store, lambda: topics, clock, grace_ms=GRACE)  # type: ignore[arg-type]
    return sealer, store


def test_the_sealer_puts_one_seal_per_open_shard_at_its_starting_key_then_marks() -> None:
    # Given a topic switched to T1 at t=0, a stream of two open shards and a closed one
    streams = FakeStreams(FakeKinesis([shard(1, 2**127), shard(0, 0), shard(2, 5, closed=True)]))
    clock = ManualClock(0)
    sealer, store = sealer_of([topic(pointer=1, effective_at_ms=0, count=2)], streams, clock)
    # When it runs within the grace: nothing
    assert sealer.run() == 0 and streams.puts == []
    # When it runs after the grace
    clock.advance(GRACE / 1000)
    assert sealer.run() == 1
    # Then each open shard got a seal at its starting hash key, and T0 is marked sealed
    assert [(s, r.explicit_hash_key, is_seal(r.data)) for s, r in streams.puts] == [
        ("shoal-orders-0", 0, True),
        ("shoal-orders-0", 2**127, True),
    ]
    assert store.sealed == [("shoal-orders-0", ["shardId-000000000000", "shardId-000000000001"])]
    # and a later run seals nothing again (and, in this container, reads nothing)
    reads = store.reads
    assert sealer.run() == 0
    assert len(streams.puts) == 2 and store.reads == reads


def test_a_failed_seal_put_leaves_the_topic_unmarked_for_the_next_run() -> None:
    # Given a put that fails
    streams = FakeStreams(FakeKinesis([shard(0, 0)]), fail=True)
    clock = ManualClock(GRACE)
    sealer, store = sealer_of([topic(pointer=1, effective_at_ms=0, count=2)], streams, clock)
    # Then the run seals nothing and marks nothing
    assert sealer.run() == 0 and store.sealed == []
    # When Kinesis takes puts again, the next run seals
    streams.fail = False
    assert sealer.run() == 1 and len(store.sealed) == 1


def test_the_label_and_the_passed_storage_topics_survive_their_items() -> None:
    # Given an inbox item labelled with its stream and a state that passed T0 of orders
    item = InboxItem("s1", "abc#01", (), "01", 0, stream="shoal-orders-1")
    state = DeliveryState(drained={"orders": 1})
    # Then both read back from what is stored; an unlabelled item stores no label
    assert InboxItem.from_record(item.record()).stream == "shoal-orders-1"
    assert "st" not in InboxItem("s1", "abc#01", (), "01", 0).record()
    assert DeliveryState.from_record(state.record("s1", 0)).drained == {"orders": 1}
