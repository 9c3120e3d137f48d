"""The pusher: takes the push queue's messages (``shoal.edge.pushwork``) and posts connected
sessions' deliveries to their WebSocket connections (``shoal.edge.push``)."""

from __future__ import annotations

from typing import Any

from shoal import wiring
from shoal.core.observability import observed
from shoal.wiring import PerConfig

worker = PerConfig(wiring.push_worker)


@observed
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    return worker().handle(event)
