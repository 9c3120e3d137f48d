"""What sessions need from other contexts, as ports: the will publisher (the publish path),
the session's shared group leases, its deliveries in flight, the end-of-session hook, and the
due timer (a queue's delayed message). The wiring root (``shoal.wiring``) passes the
implementations in."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from shoal.core.observability import logger
from shoal.sessions.model import Head, WillMessage


class WillPublisher(Protocol):
    def publish_will(self, sub: str, client_id: str, will: WillMessage, will_id: str) -> None:
        """Publish ``will`` as principal ``sub``; ``will_id`` is the same on every retry."""
        ...


class DueTimer(Protocol):
    """Reaps an item of the sessions table when it is due (``shoal.sessions.timers``)."""

    def arm(self, client_id: str, item: str, due_at_ms: int) -> None:
        """The reaper runs its step on ``item`` of ``client_id`` once ``due_at_ms`` is past (a
        timer that comes early is armed again; one may come twice). Raises when the timer
        could not be armed."""
        ...


@dataclass(frozen=True)
class KeptBy:
    """The connection over the WebSocket API that keeps its session's shared-group members
    live: an idle connection runs nothing that would renew a lease, so the member is live
    while the connection lives, and no longer once it ends (``shoal.groups``)."""

    connection_id: str
    channel: str
    #: API Gateway closes every connection by then: a keep whose end was lost lapses there
    until_ms: int


class ConnectionKeeps(Protocol):
    """Which WebSocket connection holds a session's channel (``shoal.edge.connections``)."""

    def kept_by(self, session_id: str, channel: str) -> KeptBy | None:
        """What keeps the session's group members live while that connection lives; None
        when no connection holds ``channel``."""
        ...


class GroupLeases(Protocol):
    """The session's shared groups (``shoal.groups.GroupService``)."""

    def heartbeat(
        self, session_id: str, subscriptions: Mapping[str, Any]
    ) -> list[dict[str, Any]]: ...

    def describe(
        self, session_id: str, subscriptions: Mapping[str, Any]
    ) -> list[dict[str, Any]]: ...

    def keep(self, session_id: str, subscriptions: Mapping[str, Any], by: KeptBy) -> int:
        """The session's members of its groups are kept live by ``by``; how many."""
        ...

    def connection_ended(
        self, session_id: str, subscriptions: Mapping[str, Any], connection_id: str
    ) -> int:
        """The connection that kept the session's members live ended: they are not live from
        now (their lanes go on at once); how many it kept."""
        ...

    def channel_taken_over(
        self, session_id: str, subscriptions: Mapping[str, Any], channel: str
    ) -> int:
        """An HTTP connect took the session over from ``channel``: the members a connection
        kept for that channel are not live from now (their lanes go on at once)."""
        ...


class InFlight(Protocol):
    """The session's deliveries waiting for their ack (``shoal.delivery.InboxStore``)."""

    def in_flight(self, session_id: str) -> int: ...


class SessionEndHook(Protocol):
    def __call__(self, client_id: str, head: Head) -> object:
        """A session ended (discarded by a connect, or expired): clean up after it."""
        ...


def call_end_hook(hook: SessionEndHook | None, client_id: str, head: Head) -> None:
    if hook is None:
        return
    try:
        hook(client_id, head)
    except Exception as exc:
        logger.warning("cleaning up an ended session failed", extra={"error": type(exc).__name__})
