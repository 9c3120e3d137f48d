"""A shared group's state machine, pure (no AWS): members, stream leases and their
transitions (join, leave, renew, expire, rebalance, advance), and a member's own view."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum

from shoal.groups.streams import (
    StaleLease,
    StreamState,
    is_lane,
    lane_streams,
)

#: streams one transition grants or takes at most: each is a write of the stream's item in the
#: transaction that writes the leader (a transaction holds 100 items); the rest come next time
MAX_CHANGES_PER_STEP = 90


@dataclass(frozen=True)
class Member:
    client_id: str
    joined_at_ms: int
    #: the last renewal (heartbeat) the leader knows of
    renewed_at_ms: int
    #: bumped whenever a stream is granted to, revoked from or taken from this member
    set_version: int = 0
    #: live until then without renewals: its session's connection over the WebSocket API
    #: keeps it (an idle connection runs nothing that would renew it); 0: no connection does
    kept_until_ms: int = 0
    #: when the last connection that kept it ended: renewals before it count no more
    released_at_ms: int = 0

    def alive(self, now_ms: int, timeout_ms: int) -> bool:
        if now_ms < self.kept_until_ms:
            return True
        if self.renewed_at_ms <= self.released_at_ms:
            return False
        return now_ms < self.renewed_at_ms + timeout_ms


@dataclass(frozen=True)
class StreamLease:
    holder: str | None = None
    lease: int = 0
    state: StreamState = StreamState.REVOKED
    #: when the stream entered its state (a revoke's deadline runs from it)
    since_ms: int = 0
    #: messages handed out under the current lease and not yet done (from the stream's
    #: progress; never stored with the leader)
    in_flight: int = 0

    @property
    def held(self) -> bool:
        return self.holder is not None and self.state is not StreamState.REVOKED


@dataclass(frozen=True)
class GroupState:
    share: str
    filter: str
    #: a group removed and created again is a new incarnation: its streams start empty
    incarnation: str
    version: int = 0
    created_at_ms: int = 0
    members: Mapping[str, Member] = field(default_factory=dict)
    streams: Mapping[str, StreamLease] = field(default_factory=dict)
    #: lanes per source (``shoal.groups.streams``), set when the group is created
    lanes: int = 1
    #: the group's cut (``shoal.delivery.subscriptions``): it gets the records that arrived
    #: at Kinesis after it, whichever member joins when; None (groups made before): all
    cut_ms: int | None = None

    def holdings(self, member_id: str) -> dict[str, StreamLease]:
        """The streams a member holds (granted or revoking), by source."""
        return {s: lease for s, lease in self.streams.items() if lease.holder == member_id}

    def live_members(self, now_ms: int, timeout_ms: int) -> list[str]:
        return sorted(m for m, x in self.members.items() if x.alive(now_ms, timeout_ms))

    def same_assignment(self, other: GroupState) -> bool:
        """Equal as the leader stores it (renewals and in-flight counts live elsewhere)."""
        return stored_view(self) == stored_view(other)


def stored_view(state: GroupState) -> tuple[object, ...]:
    """What a transition changes in the leader's item (not renewals, not progress)."""
    return (
        state.incarnation,
        state.lanes,
        tuple(
            sorted(
                (m, x.client_id, x.joined_at_ms, x.set_version) for m, x in state.members.items()
            )
        ),
        tuple(
            sorted(
                (s, x.holder or "", x.lease, x.state.value, x.since_ms)
                for s, x in state.streams.items()
            )
        ),
    )


def new_group(
    share: str,
    topic_filter: str,
    incarnation: str,
    now_ms: int,
    lanes: int = 1,
    *,
    cut_ms: int | None = None,
) -> GroupState:
    return GroupState(
        share, topic_filter, incarnation, created_at_ms=now_ms, lanes=lanes, cut_ms=cut_ms
    )


def join(state: GroupState, member_id: str, client_id: str, now_ms: int) -> GroupState:
    """Add a member (live from now); joining again only renews."""
    if member_id in state.members:
        return renew(state, member_id, now_ms)
    members = {**state.members, member_id: Member(client_id, now_ms, now_ms)}
    return replace(state, members=members)


def leave(state: GroupState, member_id: str, now_ms: int) -> GroupState:
    """Remove a member. Its streams are revoked at once: leaving ends its reading, so what it
    committed is its final progress and what it had in flight goes to the next holder."""
    if member_id not in state.members:
        return state
    members = {m: x for m, x in state.members.items() if m != member_id}
    streams = {
        s: _free(lease, now_ms) if lease.holder == member_id else lease
        for s, lease in state.streams.items()
    }
    return replace(state, members=members, streams=streams)


def renew(state: GroupState, member_id: str, now_ms: int) -> GroupState:
    member = state.members.get(member_id)
    if member is None or member.renewed_at_ms >= now_ms:
        return state
    members = {**state.members, member_id: replace(member, renewed_at_ms=now_ms)}
    return replace(state, members=members)


def release(state: GroupState, member_id: str, now_ms: int) -> GroupState:
    """The connection that kept a member live ended: the member is not live from now (as if
    its lease had run out), until it renews or a connection keeps it again."""
    member = state.members.get(member_id)
    if member is None:
        return state
    members = {
        **state.members,
        member_id: replace(
            member, kept_until_ms=0, released_at_ms=max(now_ms, member.renewed_at_ms)
        ),
    }
    return replace(state, members=members)


def add_streams(state: GroupState, sources: Iterable[str]) -> GroupState:
    """Streams the router has written to and the leader does not know yet: nobody holds them.
    A source of a group of several lanes is its lanes (a lane's name passes as it is)."""
    names: list[str] = []
    for source in sources:
        names += (
            [source] if is_lane(source) or state.lanes == 1 else lane_streams(source, state.lanes)
        )
    new = {s: StreamLease() for s in names if s not in state.streams}
    if not new:
        return state
    return replace(state, streams={**state.streams, **new})


def check_lease(state: GroupState, member_id: str, source: str, lease: int) -> StreamLease:
    """The stream's lease, if ``lease`` is its current one and ``member_id`` holds it."""
    current = state.streams.get(source)
    if current is None or current.holder != member_id or current.lease != lease:
        raise StaleLease(f"lease {lease} of stream {source} is not held by this member")
    return current


def expire(state: GroupState, now_ms: int, timeout_ms: int) -> GroupState:
    """Take streams from holders that left or whose renewal missed the lease timeout, and
    revoke the revoking streams whose holder has nothing in flight or whose revoke expired."""
    streams = dict(state.streams)
    touched: list[str] = []
    for source, lease in sorted(state.streams.items()):
        if not lease.held:
            continue
        assert lease.holder is not None
        member = state.members.get(lease.holder)
        gone = member is None or not member.alive(now_ms, timeout_ms)
        finished = lease.state is StreamState.REVOKING and (
            lease.in_flight == 0 or now_ms >= lease.since_ms + timeout_ms
        )
        if gone or finished:
            streams[source] = _free(lease, now_ms)
            touched.append(lease.holder)
    if not touched:
        return state
    return _bump_members(replace(state, streams=streams), touched)


def quotas(total: int, held: Mapping[str, int]) -> dict[str, int]:
    """Each member's share of ``total`` streams: the floor or the ceiling of total / members.

    The ceilings go to the members holding the most (then the smallest ids), so that reaching
    the quotas moves as few streams as possible, the same way every time.
    """
    if not held:
        return {}
    base, extra = divmod(total, len(held))
    order = sorted(held, key=lambda m: (-held[m], m))
    return {m: base + (1 if i < extra else 0) for i, m in enumerate(order)}


def rebalance(
    state: GroupState, now_ms: int, timeout_ms: int, max_changes: int = MAX_CHANGES_PER_STEP
) -> GroupState:
    """Revoke what live members hold beyond their quota; grant free streams below it."""
    live = state.live_members(now_ms, timeout_ms)
    if not live or not state.streams:
        return state
    streams = dict(state.streams)
    granted: dict[str, list[str]] = {m: [] for m in live}
    for source, lease in sorted(streams.items()):
        if lease.state is StreamState.GRANTED and lease.holder in granted:
            granted[lease.holder].append(source)
    quota = quotas(len(streams), {m: len(s) for m, s in granted.items()})
    touched: list[str] = []
    changes = 0
    for member in live:
        excess = len(granted[member]) - quota[member]
        if excess <= 0:
            continue
        # the highest sources go: any choice is as sticky, this one is deterministic
        taken = granted[member][-excess:][: max(0, max_changes - changes)]
        if not taken:
            continue
        for source in taken:
            streams[source] = replace(streams[source], state=StreamState.REVOKING, since_ms=now_ms)
        changes += len(taken)
        granted[member] = [s for s in granted[member] if s not in taken]
        touched.append(member)
    for source in sorted(s for s, lease in streams.items() if not lease.held):
        needy = [m for m in live if len(granted[m]) < quota[m]]
        if not needy or changes >= max_changes:
            break
        taker = min(needy, key=lambda m: (len(granted[m]) - quota[m], m))
        old = streams[source]
        streams[source] = StreamLease(
            holder=taker, lease=old.lease + 1, state=StreamState.GRANTED, since_ms=now_ms
        )
        granted[taker].append(source)
        touched.append(taker)
        changes += 1
    if not touched:
        return state
    return _bump_members(replace(state, streams=streams), touched)


#: rounds of expiry and rebalance one advance runs at most
ADVANCE_ROUNDS = 3


def advance(state: GroupState, now_ms: int, timeout_ms: int) -> GroupState:
    """What any invocation touching the group runs: expiry, then rebalance, again until
    nothing changes. A revoke whose holder has nothing in flight is finished and granted in
    the same step: a join or a leave hands an idle stream over in one transaction, where one
    round per step left it with nobody until the next invocation."""
    for _ in range(ADVANCE_ROUNDS):
        new = rebalance(expire(state, now_ms, timeout_ms), now_ms, timeout_ms)
        if new is state:
            break
        state = new
    return state


def concerns(
    old: GroupState, new: GroupState, member_id: str, now_ms: int, timeout_ms: int
) -> bool:
    """Whether a transition from ``old`` to ``new`` is ``member_id``'s to write: it changes
    that member's streams, the member holds fewer than its share (the transition works for
    it), or the member is the group's steward (its first live member).

    Members that are not concerned leave the write to those that are: racing heartbeats and
    gets of a large group would otherwise all try the same transaction and all but one lose.
    A transition always concerns a live member when one exists (the steward), so it is never
    left undone while live members call.
    """
    before = old.members.get(member_id)
    after = new.members.get(member_id)
    if before is None or after is None or before.set_version != after.set_version:
        return True
    live = old.live_members(now_ms, timeout_ms)
    if not live or live[0] == member_id:
        return True
    held = sum(1 for x in old.streams.values() if x.holder == member_id and x.held)
    return held < len(old.streams) // len(live)


def _free(lease: StreamLease, now_ms: int) -> StreamLease:
    # the lease number stays: the next grant bumps it, which fences the previous holder
    return StreamLease(None, lease.lease, StreamState.REVOKED, now_ms)


def _bump_members(state: GroupState, member_ids: Iterable[str]) -> GroupState:
    members = dict(state.members)
    for member_id in set(member_ids):
        member = members.get(member_id)
        if member is not None:
            members[member_id] = replace(member, set_version=member.set_version + 1)
    return replace(state, members=members)


class AgentState(StrEnum):
    CONNECTING = "connecting"
    REPLAYING = "replaying"
    UPDATING = "updating"


@dataclass(frozen=True)
class AgentView:
    """What a member last learned from the leader: kept with its renewal."""

    state: AgentState = AgentState.CONNECTING
    #: the member's stream-set version it adopted (-1: none yet)
    set_version: int = -1
    #: source -> (lease, state) as last reported to the member
    leases: Mapping[str, tuple[int, StreamState]] = field(default_factory=dict)


@dataclass(frozen=True)
class LeaseChange:
    stream: str
    lease: int
    #: granted (new to the member, or granted again under a new lease), revoking (finish it),
    #: revoked (no longer the member's: whatever it has in flight goes to the next holder)
    state: StreamState


def agent_sync(
    view: AgentView, state: GroupState | None, member_id: str
) -> tuple[AgentView, list[LeaseChange]]:
    """Bring a member's view up to the leader's state; the changes it has to learn of."""
    member = state.members.get(member_id) if state is not None else None
    if state is None or member is None:
        lost = [
            LeaseChange(s, lease, StreamState.REVOKED)
            for s, (lease, _) in sorted(view.leases.items())
        ]
        return AgentView(), lost
    if view.state is not AgentState.CONNECTING and view.set_version == member.set_version:
        return view, []
    # a version mismatch: the member is connecting again, and adopts the current stream set
    current = {
        s: (lease.lease, lease.state) for s, lease in sorted(state.holdings(member_id).items())
    }
    changes: list[LeaseChange] = []
    for source, (lease, _) in sorted(view.leases.items()):
        now = current.get(source)
        if now is None or now[0] != lease:
            changes.append(LeaseChange(source, lease, StreamState.REVOKED))
    for source, (lease, now_state) in current.items():
        before = view.leases.get(source)
        if before != (lease, now_state):
            changes.append(LeaseChange(source, lease, now_state))
    revoking = any(s is StreamState.REVOKING for _, s in current.values())
    adopted = AgentView(
        AgentState.UPDATING if revoking else AgentState.REPLAYING, member.set_version, current
    )
    return adopted, changes


def agent_lost(view: AgentView) -> AgentView:
    """A write under a lease the member no longer holds: back to connecting."""
    return replace(view, state=AgentState.CONNECTING, set_version=-1)


def freed_for(old: GroupState, new: GroupState) -> set[str]:
    """When ``new`` leaves a stream free that ``old`` had held, the members that could take
    it: none was live to be granted it, and a member's next get renews it and takes the
    stream. Without this, a lane handed on with no live member to take it would wait for the
    next message routed to the group (at a stream's end, for ever). A member connected over
    the WebSocket API is kept live by its connection, but not every such member is: one whose
    keep was not written (a crash between its connection's bind and the keep, a subscription
    older than incarnations) renews its lease only by the functions it runs, and lapses."""
    freed = any(
        not lease.held and (before := old.streams.get(source)) is not None and before.held
        for source, lease in new.streams.items()
    )
    return set(new.members) if freed else set()


def granted_to(old: GroupState, new: GroupState) -> set[str]:
    """The members holding a stream in ``new`` under a grant ``old`` did not have: the ones
    with something new to read."""
    out: set[str] = set()
    for source, lease in new.streams.items():
        before = old.streams.get(source)
        if lease.holder is None or lease.state is not StreamState.GRANTED:
            continue
        if before is None or (before.holder, before.lease, before.state) != (
            lease.holder,
            lease.lease,
            lease.state,
        ):
            out.add(lease.holder)
    return out
