"""Delivery's pure parts: permission covering, positions, buckets, packing, the delivery state."""

from __future__ import annotations

import itertools

import pytest
from shoal.core.config import Config
from shoal.delivery.inbox import (
    DeliveryState,
    InboxMessage,
    SessionRun,
    delivery_id,
    ordinal_of,
    pack,
)
from shoal.delivery.model import MAX_ITEM_BYTES, bucket_of, covers, position, record_end, seq_key
from shoal.topics.filters import matches

# (allowed, requested, covered?)
COVERS = [
    ("#", "#", True),
    ("#", "a/b", True),
    ("#", "+/+", True),
    ("#", "$SYS/#", False),  # '#' matches no $-topic
    ("#", "$SYS", False),
    ("$SYS/#", "$SYS/broker/load", True),
    ("$SYS/#", "$SYS", True),  # 'x/#' matches its parent 'x'
    ("a/#", "a", True),
    ("a/#", "a/#", True),
    ("a/#", "a/b/c", True),
    ("a/#", "a/+/c", True),
    ("a/#", "b/#", False),
    ("a/#", "#", False),
    ("a/+", "a/b", True),
    ("a/+", "a/+", True),
    ("a/+", "a/#", False),  # a/# also matches a and a/b/c
    ("a/+", "a", False),
    ("a/+", "a/b/c", False),
    ("a/b", "a/b", True),
    ("a/b", "a/+", False),
    ("a/b", "a/b/c", False),
    ("a/b", "a", False),
    ("+/b", "a/b", True),
    ("+/b", "+/b", True),
    ("+/b", "$SYS/b", False),  # a leading wildcard matches no $-topic
    ("+/+", "a/b", True),
    ("+/#", "#", True),  # every topic name has at least one level
    ("+/#", "a/#", True),  # '+/#' matches "a" too: '#' matches its parent level
    ("a/+/#", "a/#", False),  # a/# matches "a", a/+/# does not
    ("a/+/#", "a/b/#", True),
    ("a//b", "a//b", True),  # an empty level is a level
    ("a//b", "a/+/b", False),
    ("a/+/b", "a//b", True),
    ("bad/#/x", "bad/x", False),  # an invalid allowed filter covers nothing
    ("a/#", "a/#/b", False),  # nor is an invalid request covered
]


@pytest.mark.parametrize(("allowed", "requested", "expected"), COVERS)
def test_covers(allowed: str, requested: str, expected: bool) -> None:
    assert covers(allowed, requested) is expected


def _topics() -> list[str]:
    levels = ["a", "b", "", "$SYS"]
    out = []
    for n in (1, 2, 3):
        out += ["/".join(p) for p in itertools.product(levels, repeat=n)]
    return [t for t in out if t]


@pytest.mark.parametrize(("allowed", "requested", "_"), COVERS)
def test_covering_agrees_with_matching_on_a_small_universe(
    allowed: str, requested: str, _: bool
) -> None:
    # Given the topics of a small universe, Then "covered" holds exactly when no topic the
    # requested filter matches escapes the allowed one
    escapes = [t for t in _topics() if matches(requested, t) and not matches(allowed, t)]
    if covers(allowed, requested):
        assert not escapes
    elif any(matches(requested, t) for t in _topics()):
        assert escapes, (allowed, requested)


def test_sequence_keys_sort_as_numbers() -> None:
    numbers = [0, 7, 10, 99, 100, 49590338271490256608559692538361571095921575989136588898]
    assert sorted(numbers, key=seq_key) == sorted(numbers)
    assert [seq_key(n) for n in numbers] == sorted(seq_key(n) for n in numbers)


def test_positions_order_by_record_then_index() -> None:
    assert position(9, 3) < position(10, 0) < position(10, 1) < record_end(10) < position(11, 0)


def test_buckets_split_by_first_level() -> None:
    assert bucket_of("a/b") == bucket_of("a/+") == bucket_of("a/#") == bucket_of("a") == "L:a"
    assert bucket_of("+/b") == bucket_of("#") == "W"
    assert bucket_of("*/b") == "L:*"  # '*' is a literal level in MQTT
    assert bucket_of("x" * 600).startswith("H:")


def test_delivery_ids_belong_to_their_session() -> None:
    assert ordinal_of("s1", delivery_id("s1", 42)) == 42
    assert ordinal_of("s2", delivery_id("s1", 42)) is None
    assert ordinal_of("s1", "s1.x") is None


def _message(n: int, size: int = 10) -> InboxMessage:
    return InboxMessage(
        position=position(n, 0),
        message_id=f"m{n}",
        topic="a/b",
        payload=b"x" * size,
        qos=1,
        subscription="a/#",
        sid="s",
        published_at_ms=0,
    )


def test_small_deliveries_share_one_item() -> None:
    items = pack("sess", "src", [_message(n) for n in range(50)], record_end(60), 0)
    assert len(items) == 1
    assert items[0].key == "src#" + position(0, 0)
    assert items[0].covered == record_end(60)


def test_large_deliveries_split_in_order_and_only_the_last_covers_the_batch() -> None:
    messages = [_message(n, MAX_ITEM_BYTES // 3) for n in range(7)]
    items = pack("sess", "src", messages, record_end(9), 0)
    assert len(items) > 1
    assert [m for i in items for m in i.messages] == messages
    assert [i.covered for i in items[:-1]] == [i.messages[-1].position for i in items[:-1]]
    assert items[-1].covered == record_end(9)


def _run(first: int, count: int) -> SessionRun:
    return SessionRun(first, count, "src", "", position(first + count, 0), "src#x", 0, "ch")


def test_acks_move_the_floor_over_done_ordinals_only() -> None:
    # Given ordinals 0..4 handed out, 1 of them QoS 0 (done at once)
    state = DeliveryState(next_ordinal=5, runs=[_run(0, 5)], acked={1})
    state.normalize()
    assert (state.floor, state.in_flight()) == (0, 4)
    # When 0 and 3 are acked, Then the floor moves to 2 (1 was done), 3 waits above it
    state.acked |= {0, 3}
    state.normalize()
    assert state.floor == 2 and state.acked == {3} and state.in_flight() == 2
    # When the rest is acked, Then nothing is in flight and the run is forgotten
    state.acked |= {2, 4}
    state.normalize()
    assert (state.floor, state.acked, state.runs, state.in_flight()) == (5, set(), [], 0)


def test_state_survives_its_record() -> None:
    state = DeliveryState(
        version=3,
        next_ordinal=9,
        floor=2,
        acked={4, 5, 7},
        cursors={"src": position(8, 0)},
        partial={"src": "src#x"},
        runs=[_run(2, 7)],
    )
    assert DeliveryState.from_record(state.record("sess", 0)) == state


def test_settings_come_from_the_environment() -> None:
    settings = Config.from_env(
        {"SHOAL_ACK_TIMEOUT_S": "2.5", "SHOAL_INFLIGHT_WINDOW": "7"}
    ).delivery
    assert (settings.ack_timeout_s, settings.window) == (2.5, 7)
    assert Config.from_env({}).delivery.ack_timeout_s == 30
