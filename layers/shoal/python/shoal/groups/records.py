"""A shared group's items as the group store (``shoal.groups.store``) writes and reads them:
keys, records, the references a session's subscriptions hold, and what a load returns."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from shoal.groups.state import (
    AgentState,
    AgentView,
    GroupState,
    agent_lost,
)
from shoal.groups.streams import (
    MAX_LANES,
    Fence,
    StreamState,
)
from shoal.topics.filters import parse_shared

LEADER = "#sgl"


MEMBER_PREFIX = "m#"


HELD_PREFIX = "q#"


def held_prefix(member_id: str) -> str:
    return f"{HELD_PREFIX}{member_id}#"


def held_item(member_id: str, delivery_id: str) -> str:
    """A QoS 2 delivery held for its member off the group's streams ([MQTT-4.8.2-4/5])."""
    return held_prefix(member_id) + delivery_id


def held_record(
    key: str,
    incarnation: str,
    member_id: str,
    delivery_id: str,
    message: Mapping[str, Any],
) -> dict[str, Any]:
    """``message``: the delivery as get answers it (``streams.answer``), kept whole."""
    return {
        "group": key,
        "item": held_item(member_id, delivery_id),
        "inc": incarnation,
        "mid": member_id,
        "d": delivery_id,
        "msg": json.dumps(message, separators=(",", ":")),
        # never sent from here yet: due at once
        "sa": 0,
        "ch": "",
    }


def group_key(share: str, topic_filter: str) -> str:
    """The group's partition: a digest of (ShareName, filter); a filter reaches 64 KB."""
    raw = f"{share}\x00{topic_filter}".encode("utf-8", "surrogatepass")
    return hashlib.blake2b(raw, digest_size=12).hexdigest()


def default_lanes(parallelism: int, partitions: int | None) -> int:
    """Lanes per shard for a group to spread over at least ``parallelism`` members on a topic
    of ``partitions`` shards (unknown: one). Lanes cost a progress write per lane a get or an
    ack touches, so a topic with shards enough gets none."""
    return max(1, min(MAX_LANES, -(-parallelism // max(1, partitions or 1))))


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
    #: the lanes a subscribe asked the group to be created with (None: the default)
    lanes: int | None = None

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


def leader_record(key: str, state: GroupState) -> dict[str, Any]:
    streams: dict[str, Any] = {}
    for source, lease in state.streams.items():
        entry: dict[str, Any] = {"l": lease.lease, "s": lease.state.value, "t": lease.since_ms}
        if lease.holder is not None:
            entry["h"] = lease.holder
        streams[source] = entry
    record: dict[str, Any] = {
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
        "ln": state.lanes,
    }
    if state.cut_ms is not None:
        record["cut"] = state.cut_ms
    return record


#: a member item's keep (``Keep``): the connection, its channel, until when, since when; and
#: when the last keep ended
KEEP_ATTRIBUTES = ("kc", "kch", "ku", "ka", "ke")


@dataclass(frozen=True)
class Keep:
    """A connection over the WebSocket API keeps the member live (``shoal.sessions.KeptBy``),
    kept on the member's item beside its renewal."""

    connection_id: str
    channel: str
    until_ms: int
    #: when it was written: a keep older than the member's join is a past membership's
    at_ms: int

    @classmethod
    def from_record(cls, row: Mapping[str, Any]) -> Keep | None:
        if row.get("kc") is None:
            return None
        return cls(str(row["kc"]), str(row.get("kch", "")), int(row["ku"]), int(row.get("ka", 0)))


def member_record(
    key: str,
    incarnation: str,
    member_id: str,
    renewed_at_ms: int,
    view: AgentView,
) -> dict[str, Any]:
    """The item a heartbeat writes: its renewal and view only (``GroupStore.renew_members``
    leaves a keep and a release as they are)."""
    record: dict[str, Any] = {
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
    return record


def agent_view(row: Mapping[str, Any]) -> AgentView:
    raw = json.loads(row["vw"]) if row.get("vw") else {}
    view = AgentView(
        AgentState(raw.get("s", AgentState.CONNECTING.value)),
        int(raw.get("v", -1)),
        {str(s): (int(x[0]), StreamState(x[1])) for s, x in (raw.get("l") or {}).items()},
    )
    # ``lost``: a fenced write since the view was written (``GroupStore.lost``; a token)
    return agent_lost(view) if row.get("lost") else view


@dataclass
class Loaded:
    """One read of a group's partition: the leader, renewals and fences, as one state."""

    key: str
    state: GroupState
    fences: dict[str, Fence]
    views: dict[str, AgentView]
    #: members' renewals as stored (``state`` may hold a renewal not written yet)
    renewed: dict[str, int] = field(default_factory=dict)
    #: QoS 2 deliveries held for a member off its streams (``q#`` items), by member
    held: dict[str, int] = field(default_factory=dict)
    #: the connections keeping members live (``Keep``), by member, as stored
    kept: dict[str, Keep] = field(default_factory=dict)
    #: members' fenced-off marks (``MemberItems.lost``), by member, as stored: a heartbeat
    #: clears the mark it read and no other (``MemberItems.renew_members``)
    lost: dict[str, Any] = field(default_factory=dict)


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


@dataclass(frozen=True)
class Ending:
    """A connection that may keep a member live ended: the member's keep ends if it is that
    connection's (``connection_id``) or that channel's (``channel``: the reaper's expiry of a
    channel whose ``$disconnect`` never came)."""

    member_id: str
    connection_id: str | None = None
    channel: str | None = None

    def ends(self, keep: Keep | None) -> bool:
        if keep is None:
            return False
        if self.connection_id is not None and keep.connection_id != self.connection_id:
            return False
        return self.channel is None or keep.channel == self.channel
