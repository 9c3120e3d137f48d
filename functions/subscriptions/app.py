"""Subscribe and unsubscribe (``shoal.delivery.SubscriptionService``)."""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

from shoal.api import lambda_handler, make_resolver, parse_body, principal
from shoal.delivery import SubscribeRequest, SubscriptionService, UnsubscribeRequest
from shoal.streams import PerConfig

app = make_resolver()
service = PerConfig(SubscriptionService.from_config)

CHANNEL_HEADER = "shoal-channel"


def _channel() -> str | None:
    return (app.current_event.headers or {}).get(CHANNEL_HEADER)


@app.post("/v1/sessions/<client_id>/subscriptions")
def subscribe(client_id: str) -> dict[str, Any]:
    request = parse_body(app, SubscribeRequest)
    return service().subscribe(principal(app), unquote(client_id), _channel(), request)


@app.post("/v1/sessions/<client_id>/unsubscribe")
def unsubscribe(client_id: str) -> dict[str, Any]:
    request = parse_body(app, UnsubscribeRequest)
    return service().unsubscribe(principal(app), unquote(client_id), _channel(), request)


handler = lambda_handler(app)
