"""The shared-group leader (SGL) as pure transitions, with an injected clock."""

from __future__ import annotations

from dataclasses import replace

import pytest
from shoal.core.clock import ManualClock
from shoal.core.config import DEFAULT_LEASE_TIMEOUT_S, Config
from shoal.groups.state import (
    AgentState,
    AgentView,
    GroupState,
    StreamLease,
    add_streams,
    advance,
    agent_lost,
    agent_sync,
    check_lease,
    expire,
    join,
    leave,
    new_group,
    quotas,
    release,
    renew,
)
from shoal.groups.streams import StaleLease, StreamState

TIMEOUT_MS = 10_000


def group(clock: ManualClock, members: int = 0, streams: int = 0) -> GroupState:
    state = new_group("g", "orders/#", "inc1", clock.now_ms())
    for n in range(members):
        state = join(state, f"m{n:02d}", f"client-{n}", clock.now_ms())
    return add_streams(state, [f"s{n:02d}" for n in range(streams)])


def settle(state: GroupState, now_ms: int, steps: int = 10) -> GroupState:
    """Advance until nothing changes, every holder reporting its final progress at once."""
    for _ in range(steps):
        drained = replace(
            state, streams={s: replace(x, in_flight=0) for s, x in state.streams.items()}
        )
        after = advance(drained, now_ms, TIMEOUT_MS)
        if after.same_assignment(drained):
            return after
        state = after
    raise AssertionError("the leader did not settle")


def counts(state: GroupState) -> dict[str, int]:
    out = {m: 0 for m in state.members}
    for lease in state.streams.values():
        if lease.holder is not None and lease.state is StreamState.GRANTED:
            out[lease.holder] += 1
    return out


def holders(state: GroupState) -> dict[str, str | None]:
    return {s: x.holder for s, x in state.streams.items()}


def test_the_first_member_is_granted_every_stream_under_a_new_lease() -> None:
    # Given a group with one member and three streams nobody holds
    clock = ManualClock()
    state = group(clock, members=1, streams=3)
    # When the leader advances
    state = advance(state, clock.now_ms(), TIMEOUT_MS)
    # Then the member holds all three, granted, under lease 1
    assert {s: (x.holder, x.state, x.lease) for s, x in state.streams.items()} == {
        f"s{n:02d}": ("m00", StreamState.GRANTED, 1) for n in range(3)
    }
    assert state.members["m00"].set_version == 1


def test_a_join_revokes_from_others_and_grants_only_after_their_final_progress() -> None:
    # Given one member holding four streams, two of them with messages in flight
    clock = ManualClock()
    state = advance(group(clock, members=1, streams=4), clock.now_ms(), TIMEOUT_MS)
    state = replace(
        state,
        streams={s: replace(x, in_flight=3) for s, x in state.streams.items()},
    )
    # When a second member joins and the leader advances
    state = join(state, "m01", "client-1", clock.now_ms())
    state = advance(state, clock.now_ms(), TIMEOUT_MS)
    # Then two streams are revoking from the first member, and none is granted to the second yet
    revoking = [s for s, x in state.streams.items() if x.state is StreamState.REVOKING]
    assert len(revoking) == 2
    assert all(state.streams[s].holder == "m00" for s in revoking)
    assert counts(state)["m01"] == 0
    # When one of them is drained (its holder's acks are its final progress)
    drained = {**state.streams, revoking[0]: replace(state.streams[revoking[0]], in_flight=0)}
    state = advance(replace(state, streams=drained), clock.now_ms(), TIMEOUT_MS)
    # Then only that one moves, under the next lease; the other still waits
    assert (state.streams[revoking[0]].holder, state.streams[revoking[0]].lease) == ("m01", 2)
    assert state.streams[revoking[1]].state is StreamState.REVOKING


def test_a_leave_hands_the_members_streams_to_the_others_at_once() -> None:
    # Given two members sharing four streams
    clock = ManualClock()
    state = settle(group(clock, members=2, streams=4), clock.now_ms())
    leaving = [s for s, h in holders(state).items() if h == "m01"]
    # When one leaves
    state = advance(leave(state, "m01", clock.now_ms()), clock.now_ms(), TIMEOUT_MS)
    # Then the other holds everything, and the moved streams carry a new lease
    assert set(holders(state).values()) == {"m00"}
    assert "m01" not in state.members
    assert all(state.streams[s].lease == 2 for s in leaving)


def test_a_holder_whose_renewal_misses_the_lease_timeout_loses_its_streams() -> None:
    # Given two members sharing four streams
    clock = ManualClock()
    state = settle(group(clock, members=2, streams=4), clock.now_ms())
    # When only m00 renews, just before and then past m01's lease timeout
    clock.advance(TIMEOUT_MS / 1000 - 0.001)
    state = advance(renew(state, "m00", clock.now_ms()), clock.now_ms(), TIMEOUT_MS)
    # Then m01 still holds its streams up to the timeout
    assert counts(state) == {"m00": 2, "m01": 2}
    clock.advance(0.001)
    state = advance(renew(state, "m00", clock.now_ms()), clock.now_ms(), TIMEOUT_MS)
    # and at the timeout its streams go to m00; m01 stays a member (offline, durable)
    assert counts(state) == {"m00": 4, "m01": 0}
    assert "m01" in state.members


def kept(state: GroupState, member_id: str, until_ms: int) -> GroupState:
    """``member_id`` kept live by its connection until ``until_ms`` (as the store loads it)."""
    member = replace(state.members[member_id], kept_until_ms=until_ms)
    return replace(state, members={**state.members, member_id: member})


def test_a_member_its_connection_keeps_holds_its_streams_without_renewals() -> None:
    # Given two members sharing four streams, m01 kept live by its connection
    clock = ManualClock()
    state = settle(group(clock, members=2, streams=4), clock.now_ms())
    state = kept(state, "m01", clock.now_ms() + 100 * TIMEOUT_MS)
    # When only m00 renews, for many lease timeouts
    for _ in range(5):
        clock.advance(TIMEOUT_MS / 1000)
        state = advance(renew(state, "m00", clock.now_ms()), clock.now_ms(), TIMEOUT_MS)
    # Then m01 keeps its streams
    assert counts(state) == {"m00": 2, "m01": 2}
    # When its connection ends
    state = advance(release(state, "m01", clock.now_ms()), clock.now_ms(), TIMEOUT_MS)
    # Then its streams go to m00 at once
    assert counts(state) == {"m00": 4, "m01": 0}


def test_a_released_member_is_not_live_until_it_renews_after_the_release() -> None:
    # Given a member renewed just now, kept by its connection
    clock = ManualClock()
    state = settle(group(clock, members=1, streams=2), clock.now_ms())
    state = kept(state, "m00", clock.now_ms() + TIMEOUT_MS)
    # When its connection ends within its lease: the renewal before it counts no more
    clock.advance(1)
    state = release(state, "m00", clock.now_ms())
    assert not state.members["m00"].alive(clock.now_ms(), TIMEOUT_MS)
    # When it renews later (an HTTP call of its session): live again
    clock.advance(1)
    state = renew(state, "m00", clock.now_ms())
    assert state.members["m00"].alive(clock.now_ms(), TIMEOUT_MS)


def test_a_keep_lapses_at_its_bound() -> None:
    # Given a member kept until a bound (API Gateway's limit on its connection)
    clock = ManualClock()
    state = settle(group(clock, members=1, streams=1), clock.now_ms())
    until = clock.now_ms() + 3 * TIMEOUT_MS
    state = kept(state, "m00", until)
    # Then it is live up to the bound, past its lease, and not at the bound
    assert state.members["m00"].alive(until - 1, TIMEOUT_MS)
    assert not state.members["m00"].alive(until, TIMEOUT_MS)


def test_expiry_without_live_members_frees_streams_and_a_returning_member_takes_them() -> None:
    # Given one member holding two streams, then silent past the timeout
    clock = ManualClock()
    state = settle(group(clock, members=1, streams=2), clock.now_ms())
    clock.advance(TIMEOUT_MS / 1000)
    # When the leader advances with nobody live
    state = advance(state, clock.now_ms(), TIMEOUT_MS)
    # Then nobody holds the streams
    assert set(holders(state).values()) == {None}
    # When the member comes back (renews)
    state = advance(renew(state, "m00", clock.now_ms()), clock.now_ms(), TIMEOUT_MS)
    # Then it holds them again under new leases: its old ones are fenced
    assert {x.lease for x in state.streams.values()} == {2}
    with pytest.raises(StaleLease):
        check_lease(state, "m00", "s00", 1)


def test_a_revoke_that_outlasts_the_lease_timeout_hands_the_stream_over_anyway() -> None:
    # Given a stream revoking from a live holder that never drains it
    clock = ManualClock()
    state = advance(group(clock, members=1, streams=2), clock.now_ms(), TIMEOUT_MS)
    state = replace(state, streams={s: replace(x, in_flight=1) for s, x in state.streams.items()})
    state = advance(join(state, "m01", "c1", clock.now_ms()), clock.now_ms(), TIMEOUT_MS)
    (revoking,) = [s for s, x in state.streams.items() if x.state is StreamState.REVOKING]
    # When both renew but the lease timeout passes since the revoke
    clock.advance(TIMEOUT_MS / 1000)
    for m in ("m00", "m01"):
        state = renew(state, m, clock.now_ms())
    state = advance(state, clock.now_ms(), TIMEOUT_MS)
    # Then the stream is granted to the new member
    assert (state.streams[revoking].holder, state.streams[revoking].state) == (
        "m01",
        StreamState.GRANTED,
    )


def test_stale_progress_is_rejected_and_the_current_lease_accepted() -> None:
    # Given a stream that moved from m00 (lease 1) to m01 (lease 2)
    clock = ManualClock()
    state = settle(group(clock, members=1, streams=1), clock.now_ms())
    state = advance(leave(state, "m00", clock.now_ms()), clock.now_ms(), TIMEOUT_MS)
    state = settle(join(state, "m01", "c1", clock.now_ms()), clock.now_ms())
    # When the old holder reports progress or final progress under lease 1
    # Then it is refused; the new holder's lease is accepted
    with pytest.raises(StaleLease):
        check_lease(state, "m00", "s00", 1)
    with pytest.raises(StaleLease):
        check_lease(state, "m00", "s00", 2)  # the right number, the wrong member
    assert check_lease(state, "m01", "s00", 2).holder == "m01"


def test_a_version_mismatch_sends_the_agent_back_to_connecting_with_the_changes() -> None:
    # Given a member's agent that adopted its stream set
    clock = ManualClock()
    state = settle(group(clock, members=1, streams=2), clock.now_ms())
    view, changes = agent_sync(AgentView(), state, "m00")
    assert view.state is AgentState.REPLAYING
    assert {(c.stream, c.lease, c.state) for c in changes} == {
        ("s00", 1, StreamState.GRANTED),
        ("s01", 1, StreamState.GRANTED),
    }
    assert agent_sync(view, state, "m00") == (view, [])
    # When a second member joins and one stream is revoking from the first
    state = join(state, "m01", "c1", clock.now_ms())
    state = advance(
        replace(state, streams={s: replace(x, in_flight=1) for s, x in state.streams.items()}),
        clock.now_ms(),
        TIMEOUT_MS,
    )
    view, changes = agent_sync(view, state, "m00")
    # Then the agent adopts the new set version, updating, told which stream to finish
    assert view.state is AgentState.UPDATING
    assert view.set_version == state.members["m00"].set_version
    assert [(c.stream, c.state) for c in changes] == [("s01", StreamState.REVOKING)]


def test_a_lost_lease_makes_the_agent_resync() -> None:
    # Given a member whose agent is in sync
    clock = ManualClock()
    state = settle(group(clock, members=1, streams=1), clock.now_ms())
    synced, _ = agent_sync(AgentView(), state, "m00")
    # When the agent itself lost a lease (a fenced write failed)
    lost = agent_lost(synced)
    assert lost.state is AgentState.CONNECTING
    # and meanwhile the stream went to another member
    state = advance(leave(state, "m00", clock.now_ms()), clock.now_ms(), TIMEOUT_MS)
    state = advance(join(state, "m00", "client-0", clock.now_ms()), clock.now_ms(), TIMEOUT_MS)
    _, changes = agent_sync(lost, state, "m00")
    # Then the sync reports the old lease revoked and the new one granted
    assert [(c.lease, c.state) for c in changes] == [
        (1, StreamState.REVOKED),
        (2, StreamState.GRANTED),
    ]


def test_a_member_removed_from_the_group_learns_all_its_leases_are_revoked() -> None:
    # Given an agent in sync, holding one stream
    clock = ManualClock()
    state = settle(group(clock, members=1, streams=1), clock.now_ms())
    view, _ = agent_sync(AgentView(), state, "m00")
    # When the group is gone
    view, changes = agent_sync(view, None, "m00")
    # Then it is connecting, and its lease is reported revoked
    assert view == AgentView()
    assert [(c.stream, c.state) for c in changes] == [("s00", StreamState.REVOKED)]


def test_the_leader_is_deterministic() -> None:
    # Given the same state built in two different insertion orders
    clock = ManualClock()
    a = group(clock, members=5, streams=12)
    b = replace(
        a,
        members=dict(reversed(list(a.members.items()))),
        streams=dict(reversed(list(a.streams.items()))),
    )
    # When each advances
    # Then both answer the same assignment
    assert advance(a, clock.now_ms(), TIMEOUT_MS).same_assignment(
        advance(b, clock.now_ms(), TIMEOUT_MS)
    )


def test_quotas_give_the_ceilings_to_the_members_holding_most() -> None:
    # Given 7 streams over 3 members holding 4, 0 and 3
    # Then the two holding most keep 3 and 2... the floor/ceiling split moves the fewest
    assert quotas(7, {"a": 4, "b": 0, "c": 3}) == {"a": 3, "c": 2, "b": 2}
    assert quotas(2, {"a": 0, "b": 0, "c": 0}) == {"a": 1, "b": 1, "c": 0}


def test_rebalance_is_balanced_and_sticky_for_1_to_50_members_and_1_to_64_streams() -> None:
    clock = ManualClock()
    now = clock.now_ms()
    for k in range(1, 51):
        base = group(clock, members=k)
        for n in range(1, 65):
            # Given k members settled over n streams
            state = settle(add_streams(base, [f"s{i:02d}" for i in range(n)]), now, steps=n + 3)
            _assert_balanced(state, n, k)
            before = holders(state)
            # When a member joins
            joined = settle(join(state, "new", "c-new", now), now, steps=n + 3)
            # Then it is balanced, and only streams it now holds moved (as few as can be)
            _assert_balanced(joined, n, k + 1)
            moved = {s for s, h in holders(joined).items() if h != before[s]}
            assert all(joined.streams[s].holder == "new" for s in moved), (k, n)
            assert len(moved) == counts(joined)["new"] == n // (k + 1), (k, n)
            # When a member leaves
            gone = "m00"
            had = {s for s, h in before.items() if h == gone}
            left = settle(leave(state, gone, now), now, steps=n + 3) if k > 1 else None
            # Then it is balanced, and only the leaver's streams moved
            if left is not None:
                _assert_balanced(left, n, k - 1)
                moved = {s for s, h in holders(left).items() if h != before[s]}
                assert moved == had, (k, n)


def _assert_balanced(state: GroupState, n: int, k: int) -> None:
    held = counts(state)
    assert sum(held.values()) == n
    assert set(held.values()) <= {n // k, -(-n // k)}, (n, k, held)
    assert all(x.state is StreamState.GRANTED for x in state.streams.values())


def test_expire_leaves_a_state_unchanged_when_nothing_is_due() -> None:
    # Given a settled group whose members renew
    clock = ManualClock()
    state = settle(group(clock, members=3, streams=6), clock.now_ms())
    # When expiry runs within the timeout
    # Then it returns the very same state (no write needed)
    assert expire(state, clock.now_ms() + TIMEOUT_MS - 1, TIMEOUT_MS) is state
    assert advance(state, clock.now_ms(), TIMEOUT_MS) is state


def test_new_streams_start_unheld_and_known_streams_are_kept() -> None:
    # Given a stream granted under lease 1
    clock = ManualClock()
    state = settle(group(clock, members=1, streams=1), clock.now_ms())
    # When the same and a new stream are added
    state = add_streams(state, ["s00", "s01"])
    # Then the known one keeps its lease; the new one is unheld
    assert state.streams["s00"].lease == 1
    assert state.streams["s01"] == StreamLease()


def test_the_lease_timeout_comes_from_the_environment() -> None:
    # Given no setting, then a setting of 2.5 s
    # Then the default holds, then the setting
    assert Config.from_env({}).groups.lease_timeout_s == DEFAULT_LEASE_TIMEOUT_S
    assert Config.from_env({"SHOAL_GROUP_LEASE_TIMEOUT_S": "2.5"}).groups.lease_timeout_ms == 2500
