"""The reaper's sweep of pushed deliveries: connected sessions whose deliveries passed their ack
timeout (the due index, ``shoal.edge.connections``) pushed again, each armed for its next
deadline; and the sessions a push found held by the ordered drain's gate (``DUE_HELD``)
pushed again whatever their state. A shared group's deliveries are judged by the group (its
stream's progress, or what it holds for the member): the session's state does not know them."""

from __future__ import annotations

from dataclasses import dataclass

from botocore.exceptions import BotoCoreError, ClientError

from shoal.core.clock import Clock, SystemClock
from shoal.core.errors import ShoalError
from shoal.delivery.service import DeliveryService
from shoal.edge.connections import DUE_HELD, DUE_SHARDS, ConnectionStore
from shoal.edge.pushwork import PushQueue


@dataclass
class SweepReport:
    #: sessions found due
    swept: int = 0
    #: sessions whose pushes were handed to the queue (deliveries again, with ``dup``)
    pushed: int = 0
    #: sessions armed again for deliveries still in flight
    armed: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


class PushSweep:
    """The reaper's part: the connected sessions whose pushed deliveries passed their ack
    timeout (the due index), handed to the push queue again, each armed for its next
    deadline; and the connected sessions of held lists (``DUE_HELD``), handed over whatever
    their state."""

    def __init__(
        self,
        connections: ConnectionStore,
        delivery: DeliveryService,
        queue: PushQueue,
        clock: Clock | None = None,
    ) -> None:
        self.connections = connections
        self.delivery = delivery
        self.queue = queue
        self.clock = clock or SystemClock()

    def sweep(self, limit_per_shard: int = 500) -> SweepReport:
        report = SweepReport()
        now = self.clock.now_ms()
        timeout_ms = int(self.delivery.settings.ack_timeout_s * 1000)
        swept: set[str] = set()
        #: sessions of held lists (``DUE_HELD``): pushed whatever their state says
        held: set[str] = set()
        grouped: dict[str, set[str]] = {}
        for shard in range(DUE_SHARDS):
            for key, due_at_ms in self.connections.due(shard, now, limit_per_shard):
                taken = self.connections.take_due(key, due_at_ms)
                swept.update(taken.sessions)
                if key.startswith(DUE_HELD):
                    held.update(taken.sessions)
                for session_id, ids in taken.grouped.items():
                    grouped.setdefault(session_id, set()).update(ids)
        report.swept = len(swept)
        if not swept:
            return report
        # a group's deliveries still out (not acked, not dropped): their push sends them again
        # (the group's get finds their runs due), and arms the session for the next deadline
        held |= self._groups_out(grouped)
        # most sessions acked in time: one batch read of their states says so
        due: set[str] = set()
        later: dict[str, int] = {}
        for session_id, state in self.delivery.inbox.states(swept).items():
            if not state.runs:
                continue
            following = min(r.sent_at_ms for r in state.runs) + timeout_ms
            if following <= now:
                due.add(session_id)
            else:
                later[session_id] = following
        targets = {c.session_id for c in self.connections.targets(due | held | set(later))}
        due &= targets
        pushed = due | (held & targets)
        if pushed:
            self.queue.hand_off(pushed)
            report.pushed = len(pushed)
        if due:
            # their pushes send them again now: their next deadline is a timeout away
            self.connections.arm_sessions(due, now + timeout_ms)
            report.armed += len(due)
        waiting = {s: t for s, t in later.items() if s in targets}
        if waiting:
            # one list for the rest, at the earliest of their deadlines
            self.connections.arm_sessions(waiting, min(waiting.values()))
            report.armed += len(waiting)
        return report

    def _groups_out(self, grouped: dict[str, set[str]]) -> set[str]:
        """The sessions some of whose group deliveries are still out: one batch read of the
        groups' items for all of them (``SharedGroups.acked_since_by_member``: 100 keys a
        call, a stream's progress read once for its group's members); on a failed read, all
        pushed (a push that finds nothing due sends nothing)."""
        groups = self.delivery.groups
        if groups is None or not grouped:
            return set()
        try:
            done = groups.acked_since_by_member(grouped)
        except (ShoalError, ClientError, BotoCoreError):
            return set(grouped)
        return {s for s, ids in grouped.items() if set(ids) - done.get(s, set())}
