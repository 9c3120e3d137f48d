"""What the fixture functions saw. The runtime loads a function module once per sandbox (a copy
per concurrent invocation), so what they share lives here, in a module imported normally."""

from __future__ import annotations

import threading
from typing import Any

LOCK = threading.Lock()
#: every event the fixture functions were invoked with, in order
EVENTS: list[dict[str, Any]] = []
#: what the ``hold`` route waits for (a test sets it), and how many hold now
RELEASE = threading.Event()
HOLDING = [0]


def add(event: dict[str, Any]) -> None:
    with LOCK:
        EVENTS.append(event)


def of_route(route_key: str, connection_id: str | None = None) -> list[dict[str, Any]]:
    with LOCK:
        return [
            e
            for e in EVENTS
            if e.get("requestContext", {}).get("routeKey") == route_key
            and e.get("type") != "REQUEST"
            and (connection_id is None or e["requestContext"]["connectionId"] == connection_id)
        ]
