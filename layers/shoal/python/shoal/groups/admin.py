"""An operator's view of one shared group (``GET /v1/groups/{share}?filter=``): its members,
its lanes and who holds them, read and never advanced.

The group is found by its key, a digest of (ShareName, filter) (``group_key``): one strongly
consistent query of its partition (``GroupStore.load``, as every transition reads it) and one
batch read of its members' session heads (connected or not). Nothing is written: a view that
advanced the leader would race the members it shows. So the view is the leader as stored:
a lane whose holder's lease has lapsed still names that holder until some member, or the
reaper, advances the group; ``live`` says whether the holder's renewal is within the lease
timeout.

No route lists groups: the groups table has no index to list them by, and the subscription
store finds a group's subscribers only within the bucket of its filter's first level; a list
would be a scan.
"""

from __future__ import annotations

from typing import Any

from shoal.core.clock import Clock, SystemClock
from shoal.core.config import Config
from shoal.core.errors import BadRequest, GroupNotFound, InvalidFilter
from shoal.groups.records import group_key
from shoal.groups.state import GroupState
from shoal.groups.store import GroupStore
from shoal.groups.streams import StreamState, stream_lane
from shoal.sessions.model import Head
from shoal.sessions.repository import SessionRepository
from shoal.topics.filters import SEPARATOR, SHARE_PREFIX, parse_shared


def shared_text(share: str | None, topic_filter: str | None) -> tuple[str, str]:
    """The (ShareName, filter) of a request, checked as a subscribe checks
    ``$share/{ShareName}/{filter}``: ``invalid_filter`` (400) otherwise."""
    if topic_filter is None:
        raise BadRequest(
            "the query parameter filter (the group's topic filter) is required",
            fields=[{"field": "filter", "problem": "required"}],
        )
    if not share or SEPARATOR in share:
        # "a/b" with filter "c" would name the group of share "a" and filter "b/c"
        raise InvalidFilter("a share name is not empty and holds no '/'")
    parsed = parse_shared(f"{SHARE_PREFIX}{share}{SEPARATOR}{topic_filter}")
    assert parsed is not None  # the text starts with $share/
    return parsed


class GroupView:
    """Reads a shared group for an admin: the group store and the session registry's heads."""

    def __init__(
        self, store: GroupStore, sessions: SessionRepository, clock: Clock | None = None
    ) -> None:
        self.store = store
        self.sessions = sessions
        self.clock = clock or store.clock

    @classmethod
    def from_config(cls, config: Config, clock: Clock | None = None) -> GroupView:
        clock = clock or SystemClock()
        return cls(
            GroupStore.from_config(config, clock), SessionRepository.from_config(config), clock
        )

    def describe(self, share: str | None, topic_filter: str | None) -> dict[str, Any]:
        """The group's document; ``group_not_found`` (404) when it has no member now."""
        share, topic_filter = shared_text(share, topic_filter)
        loaded = self.store.load(group_key(share, topic_filter))
        if loaded is None:
            raise GroupNotFound(f"no shared group {SHARE_PREFIX}{share}{SEPARATOR}{topic_filter}")
        state = loaded.state
        heads = self.sessions.heads(m.client_id for m in state.members.values())
        now = self.clock.now_ms()
        timeout = self.store.settings.lease_timeout_ms
        return {
            "group": f"{SHARE_PREFIX}{share}{SEPARATOR}{topic_filter}",
            "share": share,
            "filter": topic_filter,
            "version": state.version,
            "created_at_ms": state.created_at_ms,
            "lanes_per_source": state.lanes,
            "lease_timeout_ms": timeout,
            "members": _members(state, heads, loaded.held, now, timeout),
            "lanes": _lanes(state),
        }


def _members(
    state: GroupState,
    heads: dict[str, Head],
    held: dict[str, int],
    now_ms: int,
    timeout_ms: int,
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for member_id, member in sorted(state.members.items(), key=lambda m: (m[1].client_id, m[0])):
        head = heads.get(member.client_id)
        # the client id's head may hold a newer session than the member's (a clean start
        # whose clean-up of the old one has not run): then whether it is connected is unknown
        connected = head.connected if head is not None and head.session_id == member_id else None
        out.append(
            {
                "session_id": member_id,
                "client_id": member.client_id,
                "joined_at_ms": member.joined_at_ms,
                "renewed_at_ms": member.renewed_at_ms,
                "live": member.alive(now_ms, timeout_ms),
                "connected": connected,
                "lanes_held": len(state.holdings(member_id)),
                "held_qos2": held.get(member_id, 0),
            }
        )
    return out


def _lanes(state: GroupState) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for stream, lease in sorted(state.streams.items()):
        source, lane = stream_lane(stream, state.lanes)
        holder = state.members.get(lease.holder) if lease.holder is not None else None
        out.append(
            {
                "stream": stream,
                "source": source,
                "lane": lane.index,
                # revoked: free, the next advance grants it
                "state": lease.state.value if lease.held else StreamState.REVOKED.value,
                "holder": lease.holder if lease.held else None,
                "holder_client_id": holder.client_id if holder is not None and lease.held else None,
                "lease": lease.lease,
                "since_ms": lease.since_ms,
                "in_flight": lease.in_flight,
            }
        )
    return out
