"""Subscribe and unsubscribe (``shoal.delivery.SubscriptionService``)."""

from __future__ import annotations

from typing import Any

from shoal import wiring
from shoal.delivery.model import SubscribeRequest, UnsubscribeRequest
from shoal.http.body import parse_body
from shoal.http.caller import owner_first, session_call
from shoal.http.resolver import lambda_handler, make_resolver
from shoal.wiring import PerConfig

app = make_resolver()
service = PerConfig(wiring.subscription_service)
# a subscribe's or unsubscribe's rebalance hands shared-group lanes to other members, maybe
# ones connected over the WebSocket API: pushed when the request ends
hand_overs = PerConfig(wiring.hand_overs)


@app.post("/v1/sessions/<client_id>/subscriptions")
def subscribe(client_id: str) -> dict[str, Any]:
    call = session_call(app, client_id)
    with owner_first(lambda: service().registry.require_owner(call.who, call.client_id)):
        request = parse_body(app, SubscribeRequest)
    with hand_overs().watching(service().groups):
        return service().subscribe(call.who, call.client_id, call.channel, request)


@app.post("/v1/sessions/<client_id>/unsubscribe")
def unsubscribe(client_id: str) -> dict[str, Any]:
    call = session_call(app, client_id)
    with owner_first(lambda: service().registry.require_owner(call.who, call.client_id)):
        request = parse_body(app, UnsubscribeRequest)
    with hand_overs().watching(service().groups):
        return service().unsubscribe(call.who, call.client_id, call.channel, request)


handler = lambda_handler(app)
