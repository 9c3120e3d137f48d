"""Get and ack a session's messages (``shoal.delivery.DeliveryService``)."""

from __future__ import annotations

from typing import Any

from shoal import wiring
from shoal.delivery.model import AckRequest
from shoal.http.body import parse_body, query_int
from shoal.http.caller import owner_first, session_call
from shoal.http.resolver import lambda_handler, make_resolver
from shoal.wiring import PerConfig

app = make_resolver()
service = PerConfig(wiring.delivery_service)
# an ack's final progress hands a shared-group lane to another member, maybe one connected
# over the WebSocket API: pushed when the request ends
hand_overs = PerConfig(wiring.hand_overs)


@app.get("/v1/sessions/<client_id>/messages")
def get_messages(client_id: str) -> dict[str, Any]:
    call = session_call(app, client_id)
    event = app.current_event
    with owner_first(lambda: service().registry.require_owner(call.who, call.client_id)):
        max_messages = query_int(event.get_query_string_value("max"), "max", 10)
        wait_ms = query_int(event.get_query_string_value("wait_ms"), "wait_ms", 0)
    with hand_overs().watching(service().groups):
        return service().get(call.who, call.client_id, call.channel, max_messages, wait_ms)


@app.post("/v1/sessions/<client_id>/acks")
def ack(client_id: str) -> dict[str, Any]:
    call = session_call(app, client_id)
    with owner_first(lambda: service().registry.require_owner(call.who, call.client_id)):
        request = parse_body(app, AckRequest)
    with hand_overs().watching(service().groups):
        return service().ack(call.who, call.client_id, call.channel, request)


handler = lambda_handler(app)
