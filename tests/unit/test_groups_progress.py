"""A group stream's progress: the lease fence, acks, the floor, delivery ids."""

from __future__ import annotations

import pytest
from shoal.groups.streams import (
    GroupDelivery,
    StaleLease,
    StreamProgress,
    StreamRun,
    StreamState,
    delivery_id,
    parse_delivery_id,
)


def held(lease: int = 2, handed: int = 5) -> StreamProgress:
    """A stream held by m1 under ``lease`` with ``handed`` messages out under that lease."""
    progress = StreamProgress("src1", "inc1", lease=lease, holder="m1", state=StreamState.GRANTED)
    progress.runs.append(StreamRun(0, handed, "", f"p{handed}", "src1#p1", 0, lease))
    progress.next = handed
    progress.cursor = f"p{handed}"
    return progress


def test_acks_under_the_current_lease_move_the_floor() -> None:
    # Given five messages out
    progress = held()
    # When 0, 1 and 3 are acked
    assert progress.ack("m1", 2, [0, 1, 3]) == 3
    # Then the floor passes 0 and 1, and 3 waits above it; two are still in flight
    assert (progress.floor, progress.done, progress.in_flight()) == (2, {3}, 2)
    # When the rest are acked, nothing is in flight and no run is left
    assert progress.ack("m1", 2, [2, 4]) == 2
    assert (progress.floor, progress.in_flight(), progress.runs) == (5, 0, [])


def test_an_ack_under_another_lease_or_by_another_member_is_refused() -> None:
    # Given a stream held by m1 under lease 2
    progress = held()
    # When m1 acks under lease 1, or m2 under lease 2
    # Then both are refused and nothing changes
    with pytest.raises(StaleLease):
        progress.ack("m1", 1, [0])
    with pytest.raises(StaleLease):
        progress.ack("m2", 2, [0])
    assert progress.floor == 0 and progress.done == set()


def test_a_revoked_stream_takes_no_ack() -> None:
    # Given a stream nobody holds any more (its holder's lease expired)
    progress = held()
    progress.state, progress.holder = StreamState.REVOKED, None
    # Then its last holder's ack is refused
    with pytest.raises(StaleLease):
        progress.ack("m1", 2, [0])


def test_ordinals_handed_out_under_an_older_lease_are_not_acked_under_the_new_one() -> None:
    # Given messages handed out under lease 1 and not yet handed out again under lease 2
    progress = held(lease=1)
    progress.lease = 2
    # When the new holder acks their ordinals
    # Then none counts: it never received them under its lease
    assert progress.ack("m1", 2, [0, 1]) == 0
    assert progress.in_flight() == 5


def test_acking_twice_or_beyond_what_was_handed_out_counts_nothing() -> None:
    progress = held()
    assert progress.ack("m1", 2, [0]) == 1
    assert progress.ack("m1", 2, [0, 99]) == 0


def test_progress_survives_its_record() -> None:
    # Given progress with a floor, done ordinals and a run
    progress = held()
    progress.ack("m1", 2, [0, 3])
    # When it is written and read back
    back = StreamProgress.from_record(progress.record("gk"))
    # Then it is the same
    assert back == progress
    assert progress.record("gk")["f"] == 3


def test_delivery_ids_name_group_stream_lease_and_ordinal() -> None:
    text = delivery_id("abc", "src1", 3, 42)
    assert parse_delivery_id(text) == GroupDelivery("abc", "src1", 3, 42)
    # an inbox delivery's id, and malformed ones, are not group deliveries
    for other in ("0123abcd.7", "g-abc.src1.x.1", "g-abc.src1.1", "g-.src1.1.1", ""):
        assert parse_delivery_id(other) is None
