"""The reaper, run on a schedule: keepalive expiry, wills after their delay, session expiry, and
the seals of storage topics a SwitchProduce left behind (``shoal.drain``)."""

from __future__ import annotations

from functools import cache
from typing import Any

from aws_lambda_powertools.utilities.typing import LambdaContext
from shoal.core.config import get_config
from shoal.core.observability import logger
from shoal.delivery import SubscriptionRetirer
from shoal.drain import Sealer
from shoal.publish.service import PublishService
from shoal.sessions import Reaper, ServiceWillPublisher, SessionRepository


@cache
def reaper() -> Reaper:
    config = get_config()
    publisher = ServiceWillPublisher(PublishService.from_config(config))
    # an ended session's subscriptions leave the router's subscription store
    retire = SubscriptionRetirer.from_config(config)
    # a dead channel's shared groups advance (its expired leases go to live members), and an
    # ended session leaves them (``shoal.groups``)
    return Reaper(
        SessionRepository.from_config(config),
        publisher,
        on_session_end=retire,
        on_channel_expired=retire.groups.channel_expired if retire.groups else None,
    )


@cache
def sealer() -> Sealer:
    return Sealer.from_config(get_config())


@logger.inject_lambda_context(clear_state=True)
def handler(event: dict[str, Any], context: LambdaContext) -> dict[str, int]:
    report = reaper().run().as_dict()
    # after the sessions' work: a failing seal fails the run (the next one seals again)
    report["storage_topics_sealed"] = sealer().run()
    if any(report.values()):
        logger.info("reaped", extra=report)
    return report
