"""Durable shared subscriptions: the group leader (SGL) as a state machine stored in DynamoDB.

A shared group is keyed by (ShareName, filter). It is created by its first member's subscribe,
keeps accumulating while it has members (offline durable members too), and is removed, with its
backlog, when its last member unsubscribes or its last member's session ends. The router writes
every matching message once per group into the group's *stream* for the message's source shard
(``shoal.group_streams``); the leader leases those streams to members.

This follows the EMQX "durable shared subscriptions" design (a group leader that grants streams
to agents with versioned stream sets, revokes them, and hands them over once the agent reported
its final progress), with one change: no process runs the leader. Its state is one item, and
whichever invocation touches the group (subscribe, unsubscribe, heartbeat, get, ack, the reaper)
*advances* it: it reads the state, applies the pure transitions below, and writes the result on
condition that the group's ``version`` is still the one it read. A loser re-reads and retries.
Nothing holds a lock, so nothing can be left holding one.

The leader's state
------------------
- ``members``: session id -> the member (its client id, when it joined, its last renewal and the
  version of its stream set, bumped by every grant, revoke or loss that touches it). A member
  stays while its session's subscription does, connected or not; only *live* members (renewed
  within the lease timeout) hold streams.
- ``streams``: source -> the stream's lease: ``holder``, the lease number ``lease`` (the fence:
  bumped by every grant, like the KCL's lease counter on a take), and the state: ``granted``
  (the holder reads it), ``revoking`` (the holder finishes what it has in flight and takes no new
  message from it) or ``revoked`` (nobody holds it: never granted, or its holder's final
  progress is in, or its holder's lease expired; the next rebalance grants it).

Transitions (pure functions of a state, a member and the time; ``advance`` is the one that
invocations run): ``join``, ``leave``, ``renew``, ``add_streams``, ``expire`` (holders whose
renewal missed the lease timeout lose their streams; a revoking stream is revoked once its
holder has nothing in flight, or when its revoke outlasted the lease timeout), ``rebalance``
(balanced: each live member gets the floor or the ceiling of streams / live members; sticky: a
change moves as few streams as possible, and members that hold more keep the ceilings;
deterministic: the same state gives the same answer), ``finish`` (a final progress report) and
``invalidate`` (a member that acted on a lease it no longer holds starts over).

Hand-off: a stream revoked from A goes to B only when A has nothing in flight on it (its acks
are its final progress) or A's lease expired. Every progress write names the lease it was made
under and is refused unless that lease is the stream's current one and its holder is the writer
(``check_lease`` here, a condition on the stream's item in DynamoDB): a member that lost a
stream can never commit on it.

The member's side (the agent) follows the proposal's states: ``connecting`` (it has not yet
adopted the leader's stream set for it, or it lost a lease), ``replaying`` (it reads the streams
it holds) and ``updating`` (it holds new streams while finishing revoked ones). ``agent_sync``
brings a member's view up to the leader's state and says what changed: a heartbeat answers
these lease changes.

In DynamoDB (``GroupStore``), one partition per group (``shoal.aws.tables.GroupItemModel``):

- ``#sgl``, the leader: version, incarnation, members (a map, so that a join is one update
  adding its own entry: racing joins never conflict) and the streams' leases (one JSON value).
  A transition is one transaction: the leader on condition of its version, plus the fence of
  every stream whose holder, lease or state it changed, on condition of that stream's
  progress version (a holder's last get never races a hand-off).
- ``m#<session id>``: the member's last renewal and agent view. A heartbeat renews every group
  of the session in one batch write (no condition can fail); a member is live from its join
  until its first heartbeat.
- ``s#<source>``: one stream's fence and progress (``shoal.group_streams``), created by the
  router the first time it writes to the stream (that is how the leader learns of streams).

Join and leave ride in the subscribe and unsubscribe transactions (one part each, so a call of
20 filters fits DynamoDB's 100 items); a leave only removes the membership, and the advance run
right after it hands the leaver's streams on (``expire`` takes the streams of non-members).
Renewals use the writers' clocks (Lambda's are synchronized); the KCL instead watches a lease
counter with its own clock, which a process-less leader cannot do.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from functools import partial
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from shoal.aws.dynamo import Dynamo, to_item
from shoal.core.clock import Clock, SystemClock
from shoal.core.config import Config
from shoal.core.errors import ServerBusy
from shoal.core.observability import logger
from shoal.core.retry import backoff_s
from shoal.delivery import DeliverySettings, InboxMessage, PayloadStore
from shoal.delivery_events import Recording, record_answers
from shoal.drain import GroupGate, group_gate
from shoal.group_streams import (
    FENCE_ATTRIBUTES,
    STREAM_PREFIX,
    Fence,
    StaleLease,
    StreamProgress,
    StreamReader,
    StreamState,
    answer,
    group_partition,
    parse_delivery_id,
    serve,
    stream_item,
)
from shoal.group_streams import delivery_id as stream_delivery_id
from shoal.topics.filters import parse_shared

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

    def alive(self, now_ms: int, timeout_ms: int) -> bool:
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


# --- transitions -------------------------------------------------------------------------------


def new_group(share: str, topic_filter: str, incarnation: str, now_ms: int) -> GroupState:
    return GroupState(share, topic_filter, incarnation, created_at_ms=now_ms)


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


def add_streams(state: GroupState, sources: Iterable[str]) -> GroupState:
    """Streams the router has written to and the leader does not know yet: nobody holds them."""
    new = {s: StreamLease() for s in sources if s not in state.streams}
    if not new:
        return state
    return replace(state, streams={**state.streams, **new})


def check_lease(state: GroupState, member_id: str, source: str, lease: int) -> StreamLease:
    """The stream's lease, if ``lease`` is its current one and ``member_id`` holds it."""
    current = state.streams.get(source)
    if current is None or current.holder != member_id or current.lease != lease:
        raise StaleLease(f"lease {lease} of stream {source} is not held by this member")
    return current


def finish(state: GroupState, member_id: str, source: str, lease: int, now_ms: int) -> GroupState:
    """A holder's final progress on a revoking stream: nobody holds it any more.

    Raises StaleLease for a lease that is not the stream's current one; a final report on a
    granted stream changes nothing (the leader did not ask for it back).
    """
    current = check_lease(state, member_id, source, lease)
    if current.state is not StreamState.REVOKING:
        return state
    return _bump_members(
        replace(state, streams={**state.streams, source: _free(current, now_ms)}), [member_id]
    )


def invalidate(state: GroupState, member_id: str) -> GroupState:
    """A member that acted on a lease it does not hold: its stream set's version moves on, so
    its agent goes back to connecting and re-reads what it holds."""
    if member_id not in state.members:
        return state
    return _bump_members(state, [member_id])


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


def advance(state: GroupState, now_ms: int, timeout_ms: int) -> GroupState:
    """What any invocation touching the group runs: expiry, then rebalance."""
    return rebalance(expire(state, now_ms, timeout_ms), now_ms, timeout_ms)


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


# --- the member's side -------------------------------------------------------------------------


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


# === DynamoDB ==================================================================================

GROUPS_TABLE = "groups"
INBOXES_TABLE = "inboxes"
LEADER = "#sgl"
MEMBER_PREFIX = "m#"
#: optimistic-concurrency attempts on a group's leader or a stream's progress
ATTEMPTS = 12
DEFAULT_LEASE_TIMEOUT_S = 15.0
#: items of a removed group's backlog deleted at once; TTL removes the rest
MAX_BACKLOG_DELETE = 1000


class GroupSettings(BaseModel):
    """The groups' knobs, from the environment once per container."""

    model_config = ConfigDict(frozen=True)

    #: a member that has not renewed (heartbeat) for this long loses its streams; a revoke
    #: that is not finished in this long is finished by the leader
    lease_timeout_s: float = Field(default=DEFAULT_LEASE_TIMEOUT_S, gt=0)

    @property
    def lease_timeout_ms(self) -> int:
        return int(self.lease_timeout_s * 1000)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> GroupSettings:
        env = os.environ if env is None else env
        raw = env.get("SHOAL_GROUP_LEASE_TIMEOUT_S")
        return cls(lease_timeout_s=float(raw)) if raw else cls()


def group_key(share: str, topic_filter: str) -> str:
    """The group's partition: a digest of (ShareName, filter); a filter reaches 64 KB."""
    raw = f"{share}\x00{topic_filter}".encode("utf-8", "surrogatepass")
    return hashlib.blake2b(raw, digest_size=12).hexdigest()


def member_item(member_id: str) -> str:
    return MEMBER_PREFIX + member_id


def new_incarnation() -> str:
    return os.urandom(8).hex()


@dataclass(frozen=True)
class GroupRef:
    """One of a session's shared subscriptions, as its head holds it."""

    text: str
    share: str
    filter: str
    qos: int
    #: the incarnation the session joined (absent for subscriptions older than groups)
    incarnation: str | None

    @property
    def key(self) -> str:
        return group_key(self.share, self.filter)


def group_refs(subscriptions: Mapping[str, Any]) -> list[GroupRef]:
    """The shared groups among a session's subscriptions, in filter order."""
    out: list[GroupRef] = []
    for text, option in sorted(subscriptions.items()):
        if not isinstance(option, Mapping) or option.get("share") is None:
            continue
        shared = parse_shared(text)
        if shared is None:
            continue
        out.append(
            GroupRef(
                text, shared[0], shared[1], int(option.get("qos", 1)), option.get("group") or None
            )
        )
    return out


# --- records -----------------------------------------------------------------------------------


def leader_record(key: str, state: GroupState) -> dict[str, Any]:
    streams: dict[str, Any] = {}
    for source, lease in state.streams.items():
        entry: dict[str, Any] = {"l": lease.lease, "s": lease.state.value, "t": lease.since_ms}
        if lease.holder is not None:
            entry["h"] = lease.holder
        streams[source] = entry
    return {
        "group": key,
        "item": LEADER,
        "v": state.version,
        "inc": state.incarnation,
        "share": state.share,
        "filter": state.filter,
        "at": state.created_at_ms,
        "mb": {
            m: {"c": x.client_id, "j": x.joined_at_ms, "sv": x.set_version}
            for m, x in state.members.items()
        },
        # one JSON value: a transition rewrites the whole item anyway
        "st": json.dumps(streams, separators=(",", ":"), sort_keys=True),
    }


def member_record(
    key: str, incarnation: str, member_id: str, renewed_at_ms: int, view: AgentView
) -> dict[str, Any]:
    return {
        "group": key,
        "item": member_item(member_id),
        "inc": incarnation,
        "r": renewed_at_ms,
        "vw": json.dumps(
            {
                "s": view.state.value,
                "v": view.set_version,
                "l": {s: [lease, st.value] for s, (lease, st) in sorted(view.leases.items())},
            },
            separators=(",", ":"),
        ),
    }


def _view(row: Mapping[str, Any]) -> AgentView:
    raw = json.loads(row["vw"]) if row.get("vw") else {}
    view = AgentView(
        AgentState(raw.get("s", AgentState.CONNECTING.value)),
        int(raw.get("v", -1)),
        {str(s): (int(x[0]), StreamState(x[1])) for s, x in (raw.get("l") or {}).items()},
    )
    # ``lost``: a fenced write since the view was written (``GroupStore.lost``)
    return agent_lost(view) if row.get("lost") else view


@dataclass
class Loaded:
    """One read of a group's partition: the leader, renewals and fences, as one state."""

    key: str
    state: GroupState
    fences: dict[str, Fence]
    views: dict[str, AgentView]


@dataclass
class GroupStats:
    """Conditional writes per operation, and how many lost a race (for the benchmark)."""

    writes: dict[str, int] = field(default_factory=dict)
    conflicts: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count(self, operation: str, *, conflict: bool) -> None:
        with self._lock:
            self.writes[operation] = self.writes.get(operation, 0) + 1
            if conflict:
                self.conflicts[operation] = self.conflicts.get(operation, 0) + 1

    def as_dict(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {"writes": dict(self.writes), "conflicts": dict(self.conflicts)}


@dataclass
class MembershipPlan:
    """What one subscribe, unsubscribe or session end changes in groups: transaction parts,
    the incarnation each joined filter belongs to, and the groups it removes."""

    parts: list[dict[str, Any]] = field(default_factory=list)
    incarnations: dict[str, str] = field(default_factory=dict)
    #: groups it leaves that stay (their leaders advance once it committed)
    left: list[str] = field(default_factory=list)
    #: groups it removes: (key, incarnation)
    removed: list[tuple[str, str]] = field(default_factory=list)


class GroupStore:
    """The groups table: leaders, members' renewals, streams' progress."""

    def __init__(
        self,
        dynamo: Dynamo,
        table: str,
        inbox_table: str,
        *,
        settings: GroupSettings | None = None,
        clock: Clock | None = None,
        stats: GroupStats | None = None,
    ) -> None:
        self.dynamo = dynamo
        self.table = table
        self.inbox_table = inbox_table
        self.settings = settings or GroupSettings()
        self.clock = clock or SystemClock()
        self.stats = stats or GroupStats()

    @classmethod
    def from_config(cls, config: Config, clock: Clock | None = None) -> GroupStore:
        return cls(
            Dynamo.from_config(config),
            config.table(GROUPS_TABLE),
            config.table(INBOXES_TABLE),
            settings=GroupSettings.from_env(),
            clock=clock,
        )

    # -- reading

    def load(self, key: str) -> Loaded | None:
        """The group's leader with its members' renewals and its streams' progress (one query);
        None when there is no such group."""
        attributes = (
            *FENCE_ATTRIBUTES,
            "v",
            "share",
            "filter",
            "at",
            "mb",
            "st",
            "r",
            "vw",
            "lost",
        )
        names = {f"#a{n}": a for n, a in enumerate(attributes)}
        rows = self.dynamo.query(
            self.table,
            KeyConditionExpression="#g = :g",
            # everything but the streams' progress, which only their holders read
            ProjectionExpression=", ".join(names),
            ExpressionAttributeNames={"#g": "group", **names},
            ExpressionAttributeValues=to_item({":g": key}),
            ConsistentRead=True,
        )
        leader = next((r for r in rows if r["item"] == LEADER), None)
        if leader is None:
            return None
        inc = str(leader["inc"])
        renewals: dict[str, int] = {}
        views: dict[str, AgentView] = {}
        fences: dict[str, Fence] = {}
        for row in rows:
            name = str(row["item"])
            if row.get("inc") != inc:
                continue  # left behind by an earlier incarnation
            if name.startswith(MEMBER_PREFIX):
                member_id = name[len(MEMBER_PREFIX) :]
                renewals[member_id] = int(row.get("r", 0))
                views[member_id] = _view(row)
            elif name.startswith(STREAM_PREFIX):
                fence = Fence.from_record(row)
                fences[fence.source] = fence
        members = {
            m: Member(
                str(x["c"]),
                int(x["j"]),
                max(int(x["j"]), renewals.get(m, 0)),
                int(x.get("sv", 0)),
            )
            for m, x in (leader.get("mb") or {}).items()
        }
        streams: dict[str, StreamLease] = {}
        for source, x in json.loads(leader.get("st") or "{}").items():
            held = fences.get(source)
            streams[source] = StreamLease(
                holder=x.get("h"),
                lease=int(x["l"]),
                state=StreamState(x["s"]),
                since_ms=int(x.get("t", 0)),
                in_flight=held.in_flight if held is not None else 0,
            )
        state = GroupState(
            share=str(leader["share"]),
            filter=str(leader["filter"]),
            incarnation=inc,
            version=int(leader["v"]),
            created_at_ms=int(leader.get("at", 0)),
            members=members,
            streams=streams,
        )
        state = add_streams(state, sorted(fences))
        return Loaded(key, state, fences, views)

    def progress(self, key: str, source: str) -> StreamProgress | None:
        raw = self.dynamo.get(self.table, {"group": key, "item": stream_item(source)})
        return StreamProgress.from_record(raw) if raw else None

    # -- the leader's transitions

    def commit_parts(self, loaded: Loaded, new: GroupState) -> list[dict[str, Any]]:
        """The transaction writing ``new`` over what ``loaded`` read: the leader on condition
        of its version, and the fence of every stream whose holder, lease or state changed, on
        condition of that stream's progress version (a holder's last get races no hand-off)."""
        old = loaded.state
        names = {"#v": "v"}
        parts: list[dict[str, Any]] = [
            {
                "Put": {
                    "TableName": self.table,
                    "Item": to_item(
                        leader_record(loaded.key, replace(new, version=old.version + 1))
                    ),
                    "ConditionExpression": "#v = :v",
                    "ExpressionAttributeNames": names,
                    "ExpressionAttributeValues": to_item({":v": old.version}),
                }
            }
        ]
        for source, lease in sorted(new.streams.items()):
            before = old.streams.get(source, StreamLease())
            if (before.holder, before.lease, before.state) == (
                lease.holder,
                lease.lease,
                lease.state,
            ):
                continue
            parts.append(
                self._fence_part(
                    loaded.key, new.incarnation, source, lease, loaded.fences.get(source)
                )
            )
        return parts

    def _fence_part(
        self,
        key: str,
        incarnation: str,
        source: str,
        lease: StreamLease,
        fence: Fence | None,
    ) -> dict[str, Any]:
        if fence is None:
            fresh = StreamProgress(source, incarnation, lease.lease, lease.holder, lease.state)
            return {
                "Put": {
                    "TableName": self.table,
                    "Item": to_item(fresh.record(key)),
                    "ConditionExpression": "attribute_not_exists(#i) OR #inc <> :inc",
                    "ExpressionAttributeNames": {"#i": "item", "#inc": "inc"},
                    "ExpressionAttributeValues": to_item({":inc": incarnation}),
                }
            }
        names = {"#l": "lease", "#s": "state", "#pv": "pv", "#inc": "inc", "#h": "holder"}
        values: dict[str, Any] = {
            ":l": lease.lease,
            ":s": lease.state.value,
            ":pv": fence.pv,
            ":next": fence.pv + 1,
            ":inc": incarnation,
        }
        expression = "SET #l = :l, #s = :s, #pv = :next"
        if lease.holder is None:
            expression += " REMOVE #h"
        else:
            expression += ", #h = :h"
            values[":h"] = lease.holder
        return {
            "Update": {
                "TableName": self.table,
                "Key": to_item({"group": key, "item": stream_item(source)}),
                "UpdateExpression": expression,
                "ConditionExpression": "#pv = :pv AND #inc = :inc",
                "ExpressionAttributeNames": names,
                "ExpressionAttributeValues": to_item(values),
            }
        }

    def commit(self, loaded: Loaded, new: GroupState, operation: str = "advance") -> bool:
        """Write ``new``; False when another invocation changed the group first."""
        reasons = self.dynamo.transact(self.commit_parts(loaded, new))
        self.stats.count(operation, conflict=reasons is not None)
        return reasons is None

    def advance(
        self, key: str, now_ms: int, *, renewing: str | None = None, operation: str = "advance"
    ) -> Loaded | None:
        """Load the group and advance its leader (``renewing``: a member known live now); the
        state as written, or None when the group does not exist."""
        timeout = self.settings.lease_timeout_ms
        for attempt in range(ATTEMPTS):
            loaded = self.load(key)
            if loaded is None:
                return None
            state = loaded.state
            if renewing is not None:
                state = renew(state, renewing, now_ms)
            new = advance(state, now_ms, timeout)
            if new.same_assignment(loaded.state):
                return replace(loaded, state=new)
            if self.commit(loaded, new, operation):
                return self._applied(loaded, new)
            self.clock.sleep(backoff_s(attempt, 0.005, 0.2))
        raise ServerBusy("this shared group is contended; retry")

    def _applied(self, loaded: Loaded, new: GroupState) -> Loaded:
        """``loaded`` after its commit: the new version and the streams' new fences."""
        fences = dict(loaded.fences)
        for source, lease in new.streams.items():
            before = loaded.state.streams.get(source, StreamLease())
            if (before.holder, before.lease, before.state) == (
                lease.holder,
                lease.lease,
                lease.state,
            ):
                continue
            fence = fences.get(source, Fence(source, new.incarnation))
            fences[source] = replace(
                fence,
                lease=lease.lease,
                holder=lease.holder,
                state=lease.state,
                pv=fence.pv + 1 if source in fences else 0,
            )
        return Loaded(
            loaded.key, replace(new, version=loaded.state.version + 1), fences, loaded.views
        )

    # -- progress

    def save_progress(
        self, key: str, progress: StreamProgress, expected_pv: int, member_id: str
    ) -> bool:
        """Write a holder's progress: only while it holds the stream under the same lease."""
        if not self.dynamo.conditional(
            "put_item",
            TableName=self.table,
            Item=to_item(progress.record(key)),
            ConditionExpression=("#pv = :pv AND #l = :l AND #h = :h AND #s = :s AND #inc = :inc"),
            ExpressionAttributeNames={
                "#pv": "pv",
                "#l": "lease",
                "#h": "holder",
                "#s": "state",
                "#inc": "inc",
            },
            ExpressionAttributeValues=to_item(
                {
                    ":pv": expected_pv,
                    ":l": progress.lease,
                    ":h": member_id,
                    ":s": progress.state.value,
                    ":inc": progress.incarnation,
                }
            ),
        ):
            self.stats.count("progress", conflict=True)
            return False
        self.stats.count("progress", conflict=False)
        return True

    # -- members' renewals and views

    def renew_members(self, records: Sequence[Mapping[str, Any]]) -> None:
        """Members' renewals (and agent views), all in one batch: no condition can fail."""
        if records:
            self.dynamo.batch_put(self.table, list(records))

    def lost(self, key: str, member_id: str) -> None:
        """A member's write was fenced off: its agent goes back to connecting."""
        self.dynamo.conditional(
            "update_item",
            TableName=self.table,
            Key=to_item({"group": key, "item": member_item(member_id)}),
            UpdateExpression="SET #lost = :true",
            ConditionExpression="attribute_exists(#vw)",
            ExpressionAttributeNames={"#vw": "vw", "#lost": "lost"},
            ExpressionAttributeValues=to_item({":true": True}),
        )

    # -- the router's streams

    def ensure_stream(self, key: str, incarnation: str, source: str) -> bool:
        """Make the stream known to the leader (its progress item); True when it was new."""
        fresh = StreamProgress(source, incarnation)
        return self.dynamo.conditional(
            "put_item",
            TableName=self.table,
            Item=to_item(fresh.record(key)),
            ConditionExpression="attribute_not_exists(#i) OR #inc <> :inc",
            ExpressionAttributeNames={"#i": "item", "#inc": "inc"},
            ExpressionAttributeValues=to_item({":inc": incarnation}),
        )

    # -- membership (parts of the subscribe, unsubscribe and session-end transactions)

    def leader_raw(self, key: str) -> dict[str, Any] | None:
        return self.dynamo.get(self.table, {"group": key, "item": LEADER})

    def join_parts(
        self, ref: GroupRef, member_id: str, client_id: str, now_ms: int
    ) -> tuple[str, list[dict[str, Any]]]:
        """Join (creating the group when it does not exist): its incarnation and one part.

        Joining an existing group adds the member with one update of the leader (no read of
        its version: racing joins of many members never conflict), which bumps the version
        so that any racing transition re-reads and sees the new member. The member's item
        (renewal, agent view) comes with its first heartbeat; until then it is live from its
        join.
        """
        key = ref.key
        leader = to_item({"group": key, "item": LEADER})
        raw = self.leader_raw(key)
        if raw is None:
            inc = new_incarnation()
            state = join(
                new_group(ref.share, ref.filter, inc, now_ms), member_id, client_id, now_ms
            )
            return inc, [
                {
                    "Put": {
                        "TableName": self.table,
                        "Item": to_item(leader_record(key, replace(state, version=1))),
                        "ConditionExpression": "attribute_not_exists(#i)",
                        "ExpressionAttributeNames": {"#i": "item"},
                    }
                }
            ]
        inc = str(raw["inc"])
        if member_id in (raw.get("mb") or {}):
            return inc, [
                {
                    "ConditionCheck": {
                        "TableName": self.table,
                        "Key": leader,
                        "ConditionExpression": "#inc = :inc AND attribute_exists(#mb.#m)",
                        "ExpressionAttributeNames": {"#inc": "inc", "#mb": "mb", "#m": member_id},
                        "ExpressionAttributeValues": to_item({":inc": inc}),
                    }
                }
            ]
        return inc, [
            {
                "Update": {
                    "TableName": self.table,
                    "Key": leader,
                    "UpdateExpression": "SET #mb.#m = :m, #v = #v + :one",
                    "ConditionExpression": "#inc = :inc",
                    "ExpressionAttributeNames": {
                        "#mb": "mb",
                        "#m": member_id,
                        "#v": "v",
                        "#inc": "inc",
                    },
                    "ExpressionAttributeValues": to_item(
                        {":m": {"c": client_id, "j": now_ms, "sv": 0}, ":one": 1, ":inc": inc}
                    ),
                }
            }
        ]

    def leave_parts(self, ref: GroupRef, member_id: str) -> tuple[list[dict[str, Any]], str | None]:
        """Leave: one part, and the incarnation when the member is the last one (then the
        group goes).

        The membership goes in one update of the leader; the leaver's streams are handed on by
        the next advance (``expire`` takes the streams of holders that are no members), which
        ``GroupService.after`` runs at once. Its acks count nothing from then on: a session
        acks only in the groups it is subscribed to.
        """
        raw = self.leader_raw(ref.key)
        if raw is None or member_id not in (raw.get("mb") or {}):
            return [], None
        inc = str(raw["inc"])
        if ref.incarnation is not None and ref.incarnation != inc:
            return [], None
        leader = to_item({"group": ref.key, "item": LEADER})
        if set(raw.get("mb") or {}) == {member_id}:
            return [
                {
                    "Delete": {
                        "TableName": self.table,
                        "Key": leader,
                        "ConditionExpression": "#v = :v",
                        "ExpressionAttributeNames": {"#v": "v"},
                        "ExpressionAttributeValues": to_item({":v": int(raw["v"])}),
                    }
                }
            ], inc
        return [
            {
                "Update": {
                    "TableName": self.table,
                    "Key": leader,
                    "UpdateExpression": "REMOVE #mb.#m SET #v = #v + :one",
                    # not the last member any more: a racing leave could have made it so
                    "ConditionExpression": (
                        "#inc = :inc AND attribute_exists(#mb.#m) AND size(#mb) > :one"
                    ),
                    "ExpressionAttributeNames": {
                        "#mb": "mb",
                        "#m": member_id,
                        "#v": "v",
                        "#inc": "inc",
                    },
                    "ExpressionAttributeValues": to_item({":one": 1, ":inc": inc}),
                }
            }
        ], None

    def remove_backlog(self, key: str, incarnation: str) -> int:
        """After a group's removal: its members' and streams' items, and (up to a bound) its
        backlog; TTL removes whatever is left. Idempotent; a newer incarnation's items stay."""
        removed = 0
        rows = self.dynamo.query(
            self.table,
            KeyConditionExpression="#g = :g",
            ExpressionAttributeNames={"#g": "group"},
            ExpressionAttributeValues=to_item({":g": key}),
            ConsistentRead=True,
        )
        for row in rows:
            if row["item"] == LEADER or row.get("inc") != incarnation:
                continue
            if self.dynamo.conditional(
                "delete_item",
                TableName=self.table,
                Key=to_item({"group": key, "item": row["item"]}),
                ConditionExpression="#inc = :inc",
                ExpressionAttributeNames={"#inc": "inc"},
                ExpressionAttributeValues=to_item({":inc": incarnation}),
            ):
                removed += 1
        partition = group_partition(incarnation)
        items = self.dynamo.query(
            self.inbox_table,
            KeyConditionExpression="#p = :p",
            ExpressionAttributeNames={"#p": "inbox", "#k": "position"},
            ExpressionAttributeValues=to_item({":p": partition}),
            ProjectionExpression="#p, #k",
            Limit=MAX_BACKLOG_DELETE,
        )
        keys = [{"inbox": partition, "position": row["position"]} for row in items]
        for start in range(0, len(keys), 25):
            requests = [{"DeleteRequest": {"Key": to_item(k)}} for k in keys[start : start + 25]]
            # best effort: what a throttled batch leaves unprocessed, TTL removes
            self.dynamo.call("batch_write_item", RequestItems={self.inbox_table: requests})
        return removed + len(keys)


# === the session's side ========================================================================


class GroupService:
    """What sessions do with their shared groups: join and leave (inside the subscribe and
    unsubscribe transactions), heartbeat (renewal and lease changes), get and ack."""

    def __init__(
        self,
        store: GroupStore,
        reader: StreamReader,
        delivery: DeliverySettings,
        *,
        clock: Clock | None = None,
        payloads: PayloadStore | None = None,
        events: Recording | None = None,
        drain: GroupGate | None = None,
    ) -> None:
        self.store = store
        self.reader = reader
        self.delivery = delivery
        self.clock = clock or store.clock
        self.payloads = payloads
        #: delivery events (``shoal.delivery_events``) of gets and acks; None records nothing
        self.events = events
        #: streams of a later storage topic wait for the earlier ones' (``shoal.drain``)
        self.drain = drain
        self._turn = 0

    @classmethod
    def from_config(
        cls,
        config: Config,
        clock: Clock | None = None,
        *,
        payloads: bool = True,
        events: Recording | None = None,
    ) -> GroupService:
        store = GroupStore.from_config(config, clock)
        return cls(
            store,
            StreamReader(store.dynamo, config.table(INBOXES_TABLE)),
            DeliverySettings.from_env(),
            clock=clock,
            payloads=PayloadStore.from_config(config) if payloads else None,
            events=events,
            drain=group_gate(config, clock or store.clock, store.progress),
        )

    # -- membership

    def membership(
        self,
        client_id: str,
        session_id: str,
        *,
        joins: Iterable[str] = (),
        leaves: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> MembershipPlan:
        """The group parts of a subscribe (``joins``: filter texts), an unsubscribe or a
        session's end (``leaves``: filter text -> the session's option for it). Read fresh on
        every attempt of the caller's transaction."""
        now = self.clock.now_ms()
        plan = MembershipPlan()
        for text in joins:
            shared = parse_shared(text)
            if shared is None:
                continue
            ref = GroupRef(text, shared[0], shared[1], 1, None)
            inc, parts = self.store.join_parts(ref, session_id, client_id, now)
            plan.incarnations[text] = inc
            plan.parts += parts
        for ref in group_refs(leaves or {}):
            parts, removed = self.store.leave_parts(ref, session_id)
            plan.parts += parts
            if removed is not None:
                plan.removed.append((ref.key, removed))
            elif parts:
                plan.left.append(ref.key)
        return plan

    def after(self, plan: MembershipPlan) -> None:
        """Once the caller's transaction committed: the groups left hand the leaver's streams
        on, and a removed group's items and backlog go. Best effort: the next advance does
        the former, TTL the latter."""
        now = self.clock.now_ms()
        for key in plan.left:
            try:
                self.store.advance(key, now, operation="leave")
            except Exception:
                logger.exception("advancing a group after a leave failed")
        for key, incarnation in plan.removed:
            try:
                self.store.remove_backlog(key, incarnation)
            except Exception:
                # nothing reads a removed incarnation again; TTL removes what is left
                logger.exception("removing a group's backlog failed")

    def channel_expired(self, client_id: str, head: Any) -> int:
        """The reaper found a member's channel dead (keepalive): advance its groups, so that
        leases it let expire move to live members even while none of them calls. How many
        groups it advanced."""
        now = self.clock.now_ms()
        refs = group_refs(getattr(head, "subscriptions", {}) or {})
        for ref in refs:
            self.store.advance(ref.key, now, operation="reaper")
        return len(refs)

    # -- heartbeat

    def heartbeat(self, session_id: str, subscriptions: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Renew the session's leases in all its groups (one batch write) and answer what
        changed since the member last heard: new, revoking and revoked streams."""
        now = self.clock.now_ms()
        records: list[dict[str, Any]] = []
        changes: list[dict[str, Any]] = []
        for ref in group_refs(subscriptions):
            loaded = self.store.advance(ref.key, now, renewing=session_id, operation="heartbeat")
            if loaded is None or not _same(ref, loaded) or session_id not in loaded.state.members:
                continue
            view = loaded.views.get(session_id, AgentView())
            view, delta = agent_sync(view, loaded.state, session_id)
            records.append(member_record(ref.key, loaded.state.incarnation, session_id, now, view))
            changes += [
                {"group": ref.text, "stream": c.stream, "lease": c.lease, "state": c.state.value}
                for c in delta
            ]
        self.store.renew_members(records)
        return changes

    # -- get

    def get(
        self,
        session_id: str,
        subscriptions: Mapping[str, Any],
        wanted: int,
        channel: str = "",
    ) -> list[dict[str, Any]]:
        """Up to ``wanted`` messages from the streams the session holds, in each stream's order."""
        refs = group_refs(subscriptions)
        out: list[dict[str, Any]] = []
        if not refs or wanted <= 0:
            return out
        now = self.clock.now_ms()
        self._turn += 1
        for ref in _rotated(refs, self._turn):
            if len(out) >= wanted:
                break
            loaded = self.store.advance(ref.key, now)
            if loaded is None or not _same(ref, loaded):
                continue
            mine = sorted(
                s for s, x in loaded.state.streams.items() if x.holder == session_id and x.held
            )
            for source in _rotated(mine, self._turn):
                if len(out) >= wanted:
                    break
                out += self._serve(
                    ref,
                    loaded,
                    source,
                    session_id,
                    wanted=wanted - len(out),
                    now=now,
                    channel=channel,
                )
        return out

    def _serve(
        self,
        ref: GroupRef,
        loaded: Loaded,
        source: str,
        member_id: str,
        *,
        wanted: int,
        now: int,
        channel: str,
    ) -> list[dict[str, Any]]:
        lease = loaded.state.streams[source]
        progress = self.store.progress(ref.key, source)
        partition = group_partition(loaded.state.incarnation)
        gate = self.drain
        for attempt in range(ATTEMPTS):
            if progress is None:
                return []
            if (progress.holder, progress.lease, progress.state) != (
                member_id,
                lease.lease,
                lease.state,
            ):
                # the fence moved since the leader was read: this lease is lost
                self.store.lost(ref.key, member_id)
                return []
            expected = progress.pv
            work = progress
            dropped: list[InboxMessage] = []
            handed, changed = serve(
                work,
                reader=self.reader,
                partition=partition,
                granted=lease.state is StreamState.GRANTED,
                qos=ref.qos,
                wanted=wanted,
                window=self.delivery.window,
                now_ms=now,
                ack_timeout_ms=int(self.delivery.ack_timeout_s * 1000),
                channel=channel,
                admit=None if gate is None else partial(gate.admits, ref.key, partition),
                dropped=dropped,
            )
            if not changed:
                if lease.state is StreamState.REVOKING and work.in_flight() == 0:
                    self.store.advance(ref.key, now)
                return []
            work.pv = expected + 1
            if self.store.save_progress(ref.key, work, expected, member_id):
                if lease.state is StreamState.REVOKING and work.in_flight() == 0:
                    # nothing left in flight: that was the final progress, hand it over
                    self.store.advance(ref.key, now)
                answers = [
                    answer(
                        group_key=ref.key,
                        source=source,
                        lease=lease.lease,
                        handed=h,
                        subscription=ref.text,
                        qos=ref.qos,
                        now_ms=now,
                        payloads=self.payloads,
                    )
                    for h in handed
                ]
                if self.events is not None and self.events.enabled and (answers or dropped):
                    events = self.events.new()
                    record_answers(events, "group", ref.key, answers, label=member_id)
                    for message in dropped:
                        events.add(
                            "dropped",
                            "group",
                            ref.key,
                            message_id=message.message_id,
                            topic=message.topic,
                            published_at=message.published_at_ms,
                            qos=message.qos,
                            reason="expired",
                            label=member_id,
                        )
                    events.flush(f"group-get/{ref.key}/{source}/{work.pv}")
                return answers
            progress = self.store.progress(ref.key, source)
            self.clock.sleep(backoff_s(attempt, 0.005, 0.2))
        raise ServerBusy("this group stream is contended; retry")

    # -- ack

    def ack(self, session_id: str, subscriptions: Mapping[str, Any], ids: Iterable[str]) -> int:
        """Ack group deliveries; ids of other deliveries are the caller's. How many were new."""
        refs = {r.key: r for r in group_refs(subscriptions)}
        wanted: dict[tuple[str, str], dict[int, set[int]]] = {}
        for text in ids:
            parsed = parse_delivery_id(text)
            if parsed is None or parsed.group_key not in refs:
                continue
            by_lease = wanted.setdefault((parsed.group_key, parsed.source), {})
            by_lease.setdefault(parsed.lease, set()).add(parsed.ordinal)
        total = 0
        for (key, source), by_lease in sorted(wanted.items()):
            total += self._ack_stream(refs[key], source, by_lease, session_id)
        return total

    def _ack_stream(
        self, ref: GroupRef, source: str, by_lease: Mapping[int, set[int]], member_id: str
    ) -> int:
        for attempt in range(ATTEMPTS):
            progress = self.store.progress(ref.key, source)
            if progress is None or (
                ref.incarnation is not None and progress.incarnation != ref.incarnation
            ):
                return 0
            expected = progress.pv
            count = 0
            fenced = False
            for lease, ordinals in sorted(by_lease.items()):
                try:
                    count += progress.ack(member_id, lease, ordinals)
                except StaleLease:
                    fenced = True
            if fenced:
                self.store.lost(ref.key, member_id)
            if count == 0:
                self._record_acks(ref, source, by_lease, progress, member_id)
                return 0
            progress.pv = expected + 1
            if self.store.save_progress(ref.key, progress, expected, member_id):
                if progress.state is StreamState.REVOKING and progress.in_flight() == 0:
                    # the holder's final progress: hand the stream over now
                    self.store.advance(ref.key, self.clock.now_ms())
                self._record_acks(ref, source, by_lease, progress, member_id)
                return count
            self.clock.sleep(backoff_s(attempt, 0.005, 0.2))
        raise ServerBusy("this group stream is contended; retry")

    def _record_acks(
        self,
        ref: GroupRef,
        source: str,
        by_lease: Mapping[int, set[int]],
        progress: StreamProgress,
        member_id: str,
    ) -> None:
        """``acked`` for every requested delivery of the current lease that is done now, fresh
        or acked before (a retried ack repairs a crash between its write and this flush)."""
        if self.events is None or not self.events.enabled:
            return
        done = sorted(o for o in by_lease.get(progress.lease, ()) if progress.is_done(o))
        if not done:
            return
        events = self.events.new()
        for ordinal in done:
            events.add(
                "acked",
                "group",
                ref.key,
                delivery_id=stream_delivery_id(ref.key, source, progress.lease, ordinal),
                label=member_id,
            )
        events.flush(f"group-ack/{ref.key}/{source}/{progress.pv}/{progress.lease}/{done[0]}")

    # -- the session document

    def describe(self, session_id: str, subscriptions: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The session's groups with the streams it holds (``GET /v1/sessions/{client_id}``)."""
        out: list[dict[str, Any]] = []
        for ref in group_refs(subscriptions):
            loaded = self.store.load(ref.key)
            if loaded is None or not _same(ref, loaded):
                continue
            out.append(
                {
                    "group": ref.text,
                    "members": len(loaded.state.members),
                    "leases": [
                        {"stream": s, "lease": x.lease, "state": x.state.value}
                        for s, x in sorted(loaded.state.holdings(session_id).items())
                    ],
                }
            )
        return out


def _same(ref: GroupRef, loaded: Loaded) -> bool:
    return ref.incarnation is None or ref.incarnation == loaded.state.incarnation


def _rotated(items: Sequence[Any], turn: int) -> list[Any]:
    if not items:
        return []
    cut = turn % len(items)
    return [*items[cut:], *items[:cut]]


class StreamRegistrar:
    """The router's side: makes each (group, source) it writes to known to the leader once."""

    def __init__(self, store: GroupStore, limit: int = 100_000) -> None:
        self.store = store
        self.limit = limit
        self._known: set[tuple[str, str, str]] = set()

    def ensure(self, key: str, incarnation: str, source: str) -> None:
        marker = (key, incarnation, source)
        if marker in self._known:
            return
        self.store.ensure_stream(key, incarnation, source)
        if len(self._known) >= self.limit:
            self._known.clear()
        self._known.add(marker)
