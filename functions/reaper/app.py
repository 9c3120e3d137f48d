"""The reaper, on a schedule: keepalive expiry, wills after their delay, session expiry, pushed
deliveries past their ack timeout (``shoal.edge.push``), seals of storage topics a SwitchProduce
left behind (``shoal.drain``); last, the census (``shoal.census``). And on the wills queue's
timers (its mapping): each due item reaped at its time (``shoal.sessions.timers``)."""

from __future__ import annotations

from functools import cache
from typing import Any

from aws_lambda_powertools.utilities.typing import LambdaContext
from shoal import wiring
from shoal.core.config import get_config
from shoal.core.observability import logger, observed
from shoal.edge.pushwork import HandOffs
from shoal.sessions.reaper import Reaper
from shoal.wiring import PerConfig

sealer = PerConfig(wiring.sealer)
sweep = PerConfig(wiring.push_sweep)
census = PerConfig(wiring.census)


@cache
def hand_offs() -> HandOffs:
    # the members a dead channel's groups hand streams to: their pushes, when connected
    return wiring.hand_overs(get_config())


@cache
def reaper() -> Reaper:
    return wiring.reaper(get_config(), hand_offs=hand_offs())


@observed
def handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    if "Records" in event:
        # the wills queue's timers: the partial batch response
        answer = reaper().on_timers(event)
        hand_offs().flush()
        return answer
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
