"""Composite-topic rules: names, partitions, K, the router formula, hash ranges, effect times."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st
from shoal.aws.kinesis import HASH_SPACE, even_starting_keys
from shoal.composite.model import (
    MAX_PARTITIONS,
    CompositeTopic,
    StorageTopic,
    is_valid_partitions,
    next_k,
    route,
    stable_hash,
    validate_partitions,
    validate_topic_name,
)
from shoal.core.errors import InvalidPartitions, InvalidTopicName

ALLOWED = [p for p in range(1, MAX_PARTITIONS + 1) if is_valid_partitions(p)]


@pytest.mark.parametrize("partitions", [1, 2, 3, 4, 6, 8, 12, 18, 20, 24, 30, 36, 496, 500])
def test_allowed_partition_counts(partitions: int) -> None:
    assert validate_partitions(partitions) == partitions


@pytest.mark.parametrize(
    "partitions", [0, -4, 5, 7, 9, 10, 14, 502, 504, 1.0, 4.0, "4", True, None]
)
def test_refused_partition_counts(partitions: object) -> None:
    with pytest.raises(InvalidPartitions) as raised:
        validate_partitions(partitions)
    assert raised.value.status == 400


@pytest.mark.parametrize("name", ["a", "orders", "A-b_9", "x" * 64, "default"])
def test_valid_topic_names(name: str) -> None:
    assert validate_topic_name(name) == name


@pytest.mark.parametrize("name", ["", "x" * 65, "a/b", "a b", "é", "a.b", "$x", None, 3])
def test_invalid_topic_names(name: object) -> None:
    with pytest.raises(InvalidTopicName):
        validate_topic_name(name)


@pytest.mark.parametrize(
    ("previous", "new", "k"),
    [
        (None, 4, 1),
        ((4, 1), 8, 2),
        ((8, 2), 16, 4),
        ((8, 2), 4, 1),
        ((8, 2), 12, 3),
        ((8, 2), 6, 1),
        ((6, 1), 12, 2),
        ((3, 1), 6, 2),
        ((1, 1), 4, 4),
        ((12, 3), 8, 2),
    ],
)
def test_k_follows_the_base_partition_count(
    previous: tuple[int, int] | None, new: int, k: int
) -> None:
    before = StorageTopic(0, "s-0", *previous) if previous else None
    assert next_k(before, new) == k


def test_stable_hash_is_pinned() -> None:
    # Given keys hashed by an earlier release, Then the values never change
    assert stable_hash("") == 16476032584258269876
    assert stable_hash("orders/eu/1") == 2552422197172474222
    assert stable_hash("é") == 14635220546840893743


def test_stable_hash_does_not_depend_on_the_process() -> None:
    # Given another interpreter with another hash seed
    code = "from shoal.composite.model import stable_hash; print(stable_hash('sensor-42'))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={"PYTHONHASHSEED": "12345"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert int(out.stdout) == stable_hash("sensor-42") == 18401544965320482926


@given(st.text())
def test_stable_hash_is_64_bits(key: str) -> None:
    assert 0 <= stable_hash(key) < 2**64


growth = st.sampled_from(ALLOWED).flatmap(
    lambda base: st.tuples(
        st.just(base),
        st.lists(st.integers(1, 6), min_size=1, max_size=3),
        st.sampled_from([s for s in range(1, base + 1) if base % s == 0]),
    )
)


@given(growth, st.integers(0, 2**64 - 1))
def test_a_key_keeps_its_subscription_shard_as_partitions_grow_by_k(
    case: tuple[int, list[int], int], h: int
) -> None:
    # Given storage topics whose partitions grew from a base B by factors (K computed as
    # designed), and a subscription shard count S dividing B
    base, factors, shards = case
    previous = StorageTopic(0, "s-0", base, 1)
    topics = [previous]
    for factor in factors:
        partitions = base * factor
        previous = StorageTopic(len(topics), "s", partitions, next_k(previous, partitions))
        topics.append(previous)
    # When a key is routed in each
    # (a subscription shard of S reads the partitions j with j // (P / S) equal to it)
    placed = {route(h, t.partitions, t.k) // (t.partitions // shards) for t in topics}
    # Then it lands in the same subscription shard in every one
    assert len(placed) == 1
    assert all(t.k * base == t.partitions for t in topics)


@given(st.sampled_from(ALLOWED), st.integers(1, 8), st.integers(0, 2**64 - 1))
def test_route_stays_in_range_and_in_the_keys_block(base: int, k: int, h: int) -> None:
    partitions = base * k
    j = route(h, partitions, k)
    assert 0 <= j < partitions
    # the block of K partitions a key may use is fixed by h mod the base
    assert j // k == h % base


def test_route_spreads_keys_over_the_whole_block() -> None:
    # Given P = 8 grown from 4 (K = 2), When many keys are routed, Then all 8 partitions are used
    used = {route(stable_hash(f"key-{n}"), 8, 2) for n in range(200)}
    assert used == set(range(8))


@pytest.mark.parametrize("partitions", [1, 2, 3, 4, 6, 12, 500])
def test_even_starting_keys_split_the_hash_space(partitions: int) -> None:
    keys = even_starting_keys(partitions)
    assert keys[0] == 0
    assert len(keys) == partitions
    assert keys == sorted(keys)
    assert HASH_SPACE - keys[-1] >= HASH_SPACE // partitions


def test_starting_key_prefers_the_streams_own_split() -> None:
    # Given a stream whose shards start elsewhere than the even split
    storage = StorageTopic(0, "s-0", 2, 1, hash_keys=(0, 5))
    assert storage.starting_key(1) == 5
    assert StorageTopic(0, "s-0", 2, 1).starting_key(1) == HASH_SPACE // 2


def _topic(pointer: int, effective_at: int, count: int = 2) -> CompositeTopic:
    storages = tuple(StorageTopic(i, f"s-{i}", 4, 1) for i in range(count))
    return CompositeTopic("t", 1, pointer, storages, effective_at_ms=effective_at)


def test_a_switch_takes_effect_at_its_instant() -> None:
    # Given a switch to storage topic 1 effective at t=100
    topic = _topic(1, 100)
    # Then publishes before use storage topic 0 and publishes from t=100 on use 1
    before, after = topic.producing(99), topic.producing(100)
    assert before is not None and before.index == 0
    assert after is not None and after.index == 1


def test_a_new_topic_is_invisible_until_effective() -> None:
    topic = _topic(0, 100, count=1)
    assert topic.producing(99) is None
    first = topic.producing(100)
    assert first is not None and first.index == 0


def test_a_topic_still_being_created_produces_nowhere() -> None:
    pending = StorageTopic(0, "s-0", 4, 1)
    assert CompositeTopic("t", 1, 0, (), pending=pending).producing(10**15) is None


def test_document_has_exactly_the_api_fields() -> None:
    doc = _topic(1, 0).document()
    assert doc == {
        "name": "t",
        "produce_pointer": 1,
        "storage_topics": [
            {"index": 0, "stream": "s-0", "partitions": 4, "k": 1},
            {"index": 1, "stream": "s-1", "partitions": 4, "k": 1},
        ],
    }
