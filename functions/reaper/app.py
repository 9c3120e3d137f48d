"""The reaper, on a schedule: keepalive expiry, wills after their delay, session expiry, pushed
deliveries past their ack timeout (``shoal.edge.push``), seals of storage topics a SwitchProduce
left behind (``shoal.drain``); last, the census (``shoal.census``)."""

from __future__ import annotations

from functools import cache
from typing import Any

from aws_lambda_powertools.utilities.typing import LambdaContext
from shoal import wiring
from shoal.census import Census
from shoal.core.config import get_config
from shoal.core.observability import logger, observed
from shoal.drain import Sealer
from shoal.edge.push import PushSweep
from shoal.edge.pushwork import HandOffs
from shoal.sessions.reaper import Reaper


@cache
def hand_offs() -> HandOffs:
    # the members a dead channel's groups hand streams to: their pushes, when connected
    return wiring.hand_overs(get_config())


@cache
def reaper() -> Reaper:
    return wiring.reaper(get_config(), hand_offs=hand_offs())


@cache
def sealer() -> Sealer:
    return wiring.sealer(get_config())


@cache
def sweep() -> PushSweep | None:
    return wiring.push_sweep(get_config())


@cache
def census() -> Census:
    return wiring.census(get_config())


@observed
def handler(event: dict[str, Any], context: LambdaContext) -> dict[str, int]:
    report = reaper().run().as_dict()
    report["push_handed_over"] = hand_offs().flush()
    push = sweep()
    if push is not None:
        # WebSocket sessions whose pushed deliveries passed their ack timeout: again, dup
        swept = push.sweep()
        report |= {"push_swept": swept.swept, "push_again": swept.pushed}
    # after the sessions' work: a failing seal fails the run (the next one seals again)
    report["storage_topics_sealed"] = sealer().run()
    if any(report.values()):
        logger.info("reaped", extra=report)
    return report | census().figures_if_due(get_config().census_every_s)
