"""Sessions: connect, disconnect, heartbeat and read a session, as its live channel or
read-only (``shoal.sessions``)."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.event_handler import Response
from shoal import wiring
from shoal.http.body import parse_body
from shoal.http.caller import has_channel, owner_first, session_call, session_view_call
from shoal.http.resolver import lambda_handler, make_resolver
from shoal.sessions.model import ConnectRequest
from shoal.wiring import PerConfig

app = make_resolver()
# a connect that takes a WebSocket connection's channel over releases the group members it
# kept: their lanes go to other members, maybe idle WebSocket ones, pushed when it ends
hand_overs = PerConfig(wiring.hand_overs)
registry = PerConfig(wiring.session_registry)


@app.put("/v1/sessions/<client_id>")
def connect(client_id: str) -> dict[str, Any]:
    call = session_call(app, client_id)
    with owner_first(lambda: registry().require_owner(call.who, call.client_id, connecting=True)):
        request = parse_body(app, ConnectRequest)
    # default version: the gateway's request time, so that retries of one connect keep it
    requested_at = app.current_event.request_context.time_epoch
    with hand_overs().watching(registry().groups):
        return registry().connect(call.who, call.client_id, request, requested_at).as_dict()


@app.delete("/v1/sessions/<client_id>")
def disconnect(client_id: str) -> Response[str]:
    call = session_call(app, client_id)
    registry().disconnect(call.who, call.client_id, call.channel)
    return Response(status_code=204, body="")


@app.get("/v1/sessions/<client_id>")
def session(client_id: str) -> dict[str, Any]:
    if not has_channel(app):
        # without Shoal-Channel: the read-only view, for an admin or the session's principal
        call = session_view_call(app, client_id)
        return registry().view(call.who, call.client_id)
    call = session_call(app, client_id)
    return registry().session(call.who, call.client_id, call.channel)


@app.post("/v1/sessions/<client_id>/heartbeat")
def heartbeat(client_id: str) -> dict[str, Any]:
    call = session_call(app, client_id)
    return registry().heartbeat(call.who, call.client_id, call.channel)


handler = lambda_handler(app)
