"""The lanes of a push tap (``shoal.push.admin.tap_lanes``): one behind the produce pointer."""

from __future__ import annotations

from shoal.push.admin import tap_lanes


def test_a_tap_at_or_after_the_produce_pointer_runs_its_most_parallel_members_lanes() -> None:
    # Given members of parallelism 2 and 4 / Then 4 lanes at the pointer and after it
    assert tap_lanes([2, 4], storage_index=1, produce_pointer=1) == 4
    assert tap_lanes([2, 4], storage_index=2, produce_pointer=1) == 4


def test_a_tap_behind_the_produce_pointer_runs_one_lane_whatever_its_members_ask() -> None:
    # Given members of parallelism 2 and 4 of storage topics behind the pointer / Then 1 lane
    assert tap_lanes([2, 4], storage_index=0, produce_pointer=1) == 1
    assert tap_lanes([10], storage_index=3, produce_pointer=5) == 1


def test_a_tap_without_parallelism_runs_one_lane() -> None:
    # Given no member parallelism at all / Then one lane
    assert tap_lanes([], storage_index=0, produce_pointer=0) == 1
