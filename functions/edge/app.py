"""The WebSocket API's routes: $connect, $disconnect and every client frame
(``shoal.edge``)."""

from __future__ import annotations

from typing import Any

from shoal import wiring
from shoal.core.observability import observed
from shoal.edge.routes import handle
from shoal.wiring import PerConfig

service = PerConfig(wiring.edge_service)


@observed
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    return handle(service, event)
