"""What delivery needs from shared groups, as a port: the wiring root passes the groups
service in (``shoal.wiring``), so delivery imports nothing of ``shoal.groups``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from shoal.sessions.model import Channel
from shoal.sessions.ports import KeptBy


@dataclass
class MembershipPlan:
    """What one subscribe, unsubscribe or session end changes in groups: transaction parts,
    the incarnation each joined filter belongs to, and the groups it removes."""

    parts: list[dict[str, Any]] = field(default_factory=list)
    incarnations: dict[str, str] = field(default_factory=dict)
    #: each joined filter's group cut (None: a group made before cuts existed)
    cuts: dict[str, int | None] = field(default_factory=dict)
    #: groups it joins that existed (their leaders advance once it committed: a join is
    #: granted its streams at once, not at the next call)
    joined: list[str] = field(default_factory=list)
    #: groups it leaves that stay (their leaders advance once it committed)
    left: list[str] = field(default_factory=list)
    #: groups it removes: (key, incarnation)
    removed: list[tuple[str, str]] = field(default_factory=list)
    #: (group key, session id) of every leave: its held QoS 2 deliveries are dropped
    leavers: list[tuple[str, str]] = field(default_factory=list)
    #: the session whose membership this is, and the connection over the WebSocket API that
    #: keeps its joins live once they committed (None: a call over HTTP)
    member: str = ""
    kept_by: KeptBy | None = None


class SharedGroups(Protocol):
    """The shared groups a session's subscriptions join (``shoal.groups.service.GroupService``):
    joined and left inside the subscribe and unsubscribe transactions, read by get and ack."""

    def membership(
        self,
        client_id: str,
        session_id: str,
        *,
        joins: Iterable[str] = (),
        leaves: Mapping[str, Mapping[str, Any]] | None = None,
        lanes: Mapping[str, int] | None = None,
        cut_ms: int | None = None,
        kept_by: KeptBy | None = None,
    ) -> MembershipPlan: ...

    def after(self, plan: MembershipPlan) -> None: ...

    def get(
        self, session_id: str, subscriptions: Mapping[str, Any], wanted: int, channel: Channel = ""
    ) -> list[dict[str, Any]]: ...

    def foreign(self, subscriptions: Mapping[str, Any], ids: Iterable[str]) -> bool: ...

    def ack(self, session_id: str, subscriptions: Mapping[str, Any], ids: Iterable[str]) -> int: ...

    def acked_since_by_member(
        self, delivery_ids: Mapping[str, Iterable[str]]
    ) -> dict[str, set[str]]: ...
