"""The WebSocket API's route selection, as API Gateway's: ``$request.body.action``, with
``$default`` as the fallback, over the deployment's function routes and mock routes."""

from __future__ import annotations

import json
from dataclasses import dataclass

from shoal.declarations import Deployment, FunctionDef, MockRoute, WsRoute

CONNECT = "$connect"
DISCONNECT = "$disconnect"
DEFAULT = "$default"


@dataclass(frozen=True)
class Selected:
    key: str
    route: WsRoute | None = None
    function: FunctionDef | None = None
    mock: MockRoute | None = None


class WsRouteTable:
    """The WebSocket API's routes: the functions' ``ws_routes`` and the mock routes."""

    def __init__(self, deployment: Deployment) -> None:
        self._routes = {route.key: (route, fn) for route, fn in deployment.ws_routes()}
        self._mocks = {mock.key: mock for mock in deployment.websocket.mock_routes}

    def special(self, key: str) -> Selected | None:
        """``$connect`` or ``$disconnect``, when declared."""
        found = self._routes.get(key)
        return Selected(key, *found) if found else None

    def select(self, body: str) -> Selected | None:
        """The route of a text frame: its ``action`` when a route has that key, else
        ``$default``. A body that is not JSON, or has no string ``action``, goes to ``$default``
        too, as API Gateway's selection does. None: no route and no ``$default``."""
        key: str | None = None
        try:
            frame = json.loads(body)
        except ValueError:
            frame = None
        if isinstance(frame, dict) and isinstance(frame.get("action"), str):
            key = frame["action"]
        # the $-keys are API Gateway's own routes, never chosen by a frame
        if key is not None and not key.startswith("$"):
            if key in self._mocks:
                return Selected(key, mock=self._mocks[key])
            if key in self._routes:
                return Selected(key, *self._routes[key])
        if DEFAULT in self._mocks:
            return Selected(DEFAULT, mock=self._mocks[DEFAULT])
        if DEFAULT in self._routes:
            return Selected(DEFAULT, *self._routes[DEFAULT])
        return None
