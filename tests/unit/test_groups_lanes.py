"""Lanes of a shared group (``shoal.groups.streams``) and the leader's steps that hand them
over, as pure functions."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from shoal.core.clock import ManualClock
from shoal.core.config import DEFAULT_GROUP_PARALLELISM, Config
from shoal.delivery.inbox import InboxMessage
from shoal.groups.records import default_lanes
from shoal.groups.state import (
    add_streams,
    advance,
    concerns,
    join,
    new_group,
)
from shoal.groups.streams import (
    Lane,
    StreamState,
    key_hash,
    lane_stream,
    lane_streams,
    source_of,
    stream_lane,
)

TIMEOUT_MS = 6_000


def message(n: int, key: str | None = None) -> InboxMessage:
    return InboxMessage(
        position=f"{n:020d}.00000",
        message_id=f"{n:08x}-id",
        topic="jobs/a",
        payload=b"",
        qos=1,
        subscription="$share/w/jobs/#",
        sid="g",
        published_at_ms=0,
        key_hash=None if key is None else key_hash(key),
    )


def test_every_message_is_in_exactly_one_lane() -> None:
    lanes = [Lane(n, 4) for n in range(4)]
    for n in range(200):
        m = message(n, key=None if n % 3 else f"k{n % 7}")
        assert sum(lane.holds(m) for lane in lanes) == 1


def test_unkeyed_messages_spread_over_the_lanes_and_a_key_stays_in_one() -> None:
    lanes = [Lane(n, 4) for n in range(4)]
    spread = Counter(
        next(i for i, lane in enumerate(lanes) if lane.holds(message(n))) for n in range(400)
    )
    # every lane gets a fair part of 400 unkeyed messages (25% each, give or take)
    assert set(spread) == {0, 1, 2, 3} and min(spread.values()) >= 60
    keyed = {
        next(i for i, lane in enumerate(lanes) if lane.holds(message(n, "k1"))) for n in range(50)
    }
    assert len(keyed) == 1


def test_one_lane_holds_everything() -> None:
    assert all(Lane().holds(message(n, key="k" if n % 2 else None)) for n in range(20))


def test_lane_stream_names_parse_back() -> None:
    assert lane_stream("abc123", 0, 1) == "abc123"
    assert lane_streams("abc123", 3) == ["abc123-0", "abc123-1", "abc123-2"]
    assert stream_lane("abc123-2", 3) == ("abc123", Lane(2, 3))
    assert stream_lane("abc123", 1) == ("abc123", Lane())
    assert source_of("abc123-2") == source_of("abc123") == "abc123"


def test_a_source_of_a_group_of_lanes_is_its_lanes_to_the_leader() -> None:
    state = new_group("w", "jobs/#", "inc", 0, lanes=4)
    state = add_streams(state, ["src1"])
    assert sorted(state.streams) == ["src1-0", "src1-1", "src1-2", "src1-3"]
    # a lane's own progress item names itself
    assert sorted(add_streams(state, ["src1-2"]).streams) == sorted(state.streams)
    one = add_streams(new_group("w", "jobs/#", "inc", 0), ["src1"])
    assert list(one.streams) == ["src1"]


def test_four_members_of_one_shard_each_hold_lanes() -> None:
    clock = ManualClock()
    state = add_streams(new_group("w", "jobs/#", "inc", clock.now_ms(), lanes=8), ["src1"])
    for n in range(4):
        state = join(state, f"m{n}", f"c{n}", clock.now_ms())
        state = advance(state, clock.now_ms(), TIMEOUT_MS)
    held = Counter(x.holder for x in state.streams.values() if x.state is StreamState.GRANTED)
    assert held == {"m0": 2, "m1": 2, "m2": 2, "m3": 2}


def test_a_join_takes_an_idle_lane_in_one_step() -> None:
    # Given m0 holding all four lanes with nothing in flight
    clock = ManualClock()
    state = add_streams(new_group("w", "jobs/#", "inc", clock.now_ms(), lanes=4), ["src1"])
    state = advance(join(state, "m0", "c0", clock.now_ms()), clock.now_ms(), TIMEOUT_MS)
    # When m1 joins and one advance runs
    state = advance(join(state, "m1", "c1", clock.now_ms()), clock.now_ms(), TIMEOUT_MS)
    # Then m1 already holds its two lanes, granted (no revoking lane waits for a later call)
    granted = Counter(x.holder for x in state.streams.values() if x.state is StreamState.GRANTED)
    assert granted == {"m0": 2, "m1": 2}


def test_a_join_waits_for_a_busy_lanes_final_progress() -> None:
    clock = ManualClock()
    state = add_streams(new_group("w", "jobs/#", "inc", clock.now_ms(), lanes=2), ["src1"])
    state = advance(join(state, "m0", "c0", clock.now_ms()), clock.now_ms(), TIMEOUT_MS)
    busy = {s: replace(x, in_flight=3) for s, x in state.streams.items()}
    state = advance(
        join(replace(state, streams=busy), "m1", "c1", clock.now_ms()), clock.now_ms(), TIMEOUT_MS
    )
    states = sorted((x.holder, x.state.value) for x in state.streams.values())
    assert states == [("m0", "granted"), ("m0", "revoking")]


def test_a_transition_is_written_by_the_members_it_concerns_or_the_steward() -> None:
    clock = ManualClock()
    state = add_streams(new_group("w", "jobs/#", "inc", clock.now_ms(), lanes=4), ["src1"])
    for n in range(3):
        state = join(state, f"m{n}", f"c{n}", clock.now_ms())
    state = advance(state, clock.now_ms(), TIMEOUT_MS)
    # When m3 joins: the lanes it is granted come from m0 (who held the ceiling)
    joined = join(state, "m3", "c3", clock.now_ms())
    new = advance(joined, clock.now_ms(), TIMEOUT_MS)
    assert not new.same_assignment(joined)
    concerned = {m for m in joined.members if concerns(joined, new, m, clock.now_ms(), TIMEOUT_MS)}
    # the joiner and the member it takes from write it; m0 is also the steward; m2 leaves it
    assert "m3" in concerned and "m0" in concerned and "m2" not in concerned


def test_lanes_and_parallelism_come_from_the_environment() -> None:
    assert Config.from_env({}).groups.lanes is None
    assert Config.from_env({}).groups.parallelism == DEFAULT_GROUP_PARALLELISM
    assert Config.from_env({"SHOAL_GROUP_LANES": "16"}).groups.lanes == 16
    assert Config.from_env({"SHOAL_GROUP_PARALLELISM": "4"}).groups.parallelism == 4


def test_a_groups_default_lanes_spread_it_over_its_parallelism_on_any_partition_count() -> None:
    # one partition: 8 lanes; 4 partitions: 2 each; 8 or more: none needed
    assert [default_lanes(8, p) for p in (None, 1, 2, 3, 4, 8, 12, 64)] == [8, 8, 4, 3, 2, 1, 1, 1]
    assert default_lanes(200, 1) == 64  # at most MAX_LANES
