"""Sessions: connect, disconnect, heartbeat and read a session (``shoal.sessions``)."""

from __future__ import annotations

from functools import cache
from typing import Any
from urllib.parse import unquote

from aws_lambda_powertools.event_handler import Response
from shoal.api import lambda_handler, make_resolver, parse_body, principal
from shoal.config import get_config
from shoal.sessions import ConnectRequest, SessionRegistry

app = make_resolver()

CHANNEL_HEADER = "shoal-channel"


@cache
def registry() -> SessionRegistry:
    return SessionRegistry.from_config(get_config())


def _channel() -> str | None:
    return (app.current_event.headers or {}).get(CHANNEL_HEADER)


@app.put("/v1/sessions/<client_id>")
def connect(client_id: str) -> dict[str, Any]:
    request = parse_body(app, ConnectRequest)
    # default version: the gateway's request time, so that retries of one connect keep it
    requested_at = app.current_event.request_context.time_epoch
    return registry().connect(principal(app), unquote(client_id), request, requested_at).as_dict()


@app.delete("/v1/sessions/<client_id>")
def disconnect(client_id: str) -> Response[str]:
    registry().disconnect(principal(app), unquote(client_id), _channel())
    return Response(status_code=204, body="")


@app.get("/v1/sessions/<client_id>")
def session(client_id: str) -> dict[str, Any]:
    return registry().session(principal(app), unquote(client_id), _channel())


@app.post("/v1/sessions/<client_id>/heartbeat")
def heartbeat(client_id: str) -> dict[str, Any]:
    return registry().heartbeat(principal(app), unquote(client_id), _channel())


handler = lambda_handler(app)
