"""The census: how many WebSocket connections, connected sessions, shared groups and dead
letters there are now, reported as levels (``shoal.core.metrics.GAUGES``) by the reaper on
each of its runs, so that the console's Overview and the stack's dashboard can graph them.

No event says how many connections are open: API Gateway counts connects but not the
connections that stay, and a ``$disconnect`` may never come (its items then go by TTL, with
no function run). So the census counts what the tables hold, with ``Select=COUNT`` scans:
nothing comes back, but every item read is charged (0.5 read units per 4 KB, eventually
consistent). At 100,000 connected WebSocket clients, about 45 MB of the connections table
and the sessions' heads a run: docs/operations.md ("The census") gives the price. A push
subscription's dead letters are the sum its blocked keys' states keep (what ``GET
/v1/subscriptions/{name}`` answers as ``dlq_depth``): one query of the blocked-key index each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shoal.aws import tables
from shoal.aws.dynamo import Dynamo, Expression
from shoal.core import metrics
from shoal.core.clock import Clock, SystemClock
from shoal.core.config import Config
from shoal.core.observability import gauge, logger
from shoal.edge.connections import CONNECTION
from shoal.groups.records import LEADER
from shoal.push.store import KeyStore, PushSubscriptionStore
from shoal.sessions.model import HEAD

#: push subscriptions whose dead letters one run counts (a query each), the first by name: the
#: most the Overview draws (``shoal.overview.MAX_SUBSCRIPTIONS``), and a bound on the custom
#: metrics the subscription dimension makes
MAX_SUBSCRIPTIONS = 50


#: a census is due this much before ``every_s`` has passed since the last one: the reaper's
#: schedule wanders by a few seconds from run to run
DUE_SLACK_S = 5.0


def census_due(now_ms: int, last_ms: int | None, every_s: int) -> bool:
    """Whether a reaper run at ``now_ms`` counts, the last census of this container having
    been at ``last_ms`` (None: none yet): once ``every_s`` has passed, give or take the
    schedule's wander; never for 0. Deployed, with the reaper once a minute and the default
    60 s, each run counts; under ``shoal dev``, whose reaper may run every second, the census
    still counts once a minute."""
    if every_s <= 0:
        return False
    if last_ms is None:
        return True
    return now_ms - last_ms >= (every_s - min(DUE_SLACK_S, every_s / 2)) * 1000


@dataclass
class CensusReport:
    connections: int = 0
    sessions_connected: int = 0
    shared_groups: int = 0
    #: dead letters by push subscription
    dead_letters: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, int]:
        return {
            "census_connections": self.connections,
            "census_sessions_connected": self.sessions_connected,
            "census_shared_groups": self.shared_groups,
            "census_dead_letters": sum(self.dead_letters.values()),
        }


class Census:
    def __init__(
        self,
        dynamo: Dynamo,
        config: Config,
        subscriptions: PushSubscriptionStore,
        key_states: KeyStore,
        clock: Clock | None = None,
    ) -> None:
        self.clock = clock or SystemClock()
        #: when this container last counted (a census is per run, not per container)
        self.last_ms: int | None = None
        self.dynamo = dynamo
        self.connections_table = config.table(tables.CONNECTIONS)
        self.sessions_table = config.table(tables.SESSIONS)
        self.groups_table = config.table(tables.GROUPS)
        self.subscriptions = subscriptions
        self.key_states = key_states

    @classmethod
    def from_config(cls, config: Config, clock: Clock | None = None) -> Census:
        clock = clock or SystemClock()
        return cls(
            Dynamo.from_config(config),
            config,
            PushSubscriptionStore.from_config(config, clock),
            KeyStore.from_config(config),
            clock,
        )

    def run_if_due(self, every_s: int) -> CensusReport | None:
        """``run``, when ``every_s`` (``SHOAL_CENSUS_EVERY_S``) has passed since this
        container's last census; None when it has not."""
        now = self.clock.now_ms()
        if not census_due(now, self.last_ms, every_s):
            return None
        self.last_ms = now
        return self.run()

    def figures_if_due(self, every_s: int) -> dict[str, Any]:
        """``run_if_due``'s figures for the reaper's report: none when not due, or when it
        failed (logged: the figures wait for the next run, the reaper's own work is done)."""
        try:
            counted = self.run_if_due(every_s)
        except Exception as exc:
            logger.warning("census failed", extra={"error_type": type(exc).__name__})
            return {}
        return counted.as_dict() if counted is not None else {}

    def run(self) -> CensusReport:
        """Counts, and reports each count as a gauge of this invocation."""
        report = CensusReport(
            connections=self._connections(),
            sessions_connected=self._sessions_connected(),
            shared_groups=self._shared_groups(),
            dead_letters=self._dead_letters(),
        )
        gauge(metrics.CONNECTIONS, report.connections)
        gauge(metrics.SESSIONS_CONNECTED, report.sessions_connected)
        gauge(metrics.SHARED_GROUPS, report.shared_groups)
        for name, depth in sorted(report.dead_letters.items()):
            gauge(metrics.DEAD_LETTERS, depth, **{metrics.SUBSCRIPTION_DIMENSION: name})
        return report

    def _connections(self) -> int:
        # a connection's item once its connect was answered (``shoal.edge.connections``)
        e = Expression()
        kept = f"begins_with({e.n('key')}, {e.v(CONNECTION)})"
        return self.dynamo.count(self.connections_table, **_filter(e, kept))

    def _sessions_connected(self) -> int:
        e = Expression()
        kept = f"{e.n('item')} = {e.v(HEAD)} AND {e.n('connected')} = {e.v(True)}"
        return self.dynamo.count(self.sessions_table, **_filter(e, kept))

    def _shared_groups(self) -> int:
        e = Expression()
        kept = f"{e.n('item')} = {e.v(LEADER)}"
        return self.dynamo.count(self.groups_table, **_filter(e, kept))

    def _dead_letters(self) -> dict[str, int]:
        # the first by name, as the Overview draws them (``shoal.overview``)
        names: list[str] = []
        after: str | None = None
        while True:
            page, after = self.subscriptions.page(100, after)
            names += [s.name for s in page]
            if after is None:
                break
        return {
            name: sum(b.dlq_depth for b in self.key_states.blocked(name))
            for name in sorted(names)[:MAX_SUBSCRIPTIONS]
        }


def _filter(e: Expression, kept: str) -> dict[str, Any]:
    return {"FilterExpression": kept, **e.params()}
