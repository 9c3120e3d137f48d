"""Get and ack a session's messages (``shoal.delivery.DeliveryService``)."""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

from shoal.api import lambda_handler, make_resolver, parse_body, principal
from shoal.delivery import AckRequest, DeliveryService, query_int
from shoal.streams import PerConfig

app = make_resolver()
service = PerConfig(DeliveryService.from_config)

CHANNEL_HEADER = "shoal-channel"


def _channel() -> str | None:
    return (app.current_event.headers or {}).get(CHANNEL_HEADER)


@app.get("/v1/sessions/<client_id>/messages")
def get_messages(client_id: str) -> dict[str, Any]:
    event = app.current_event
    max_messages = query_int(event.get_query_string_value("max"), "max", 10)
    wait_ms = query_int(event.get_query_string_value("wait_ms"), "wait_ms", 0)
    return service().get(principal(app), unquote(client_id), _channel(), max_messages, wait_ms)


@app.post("/v1/sessions/<client_id>/acks")
def ack(client_id: str) -> dict[str, Any]:
    request = parse_body(app, AckRequest)
    return service().ack(principal(app), unquote(client_id), _channel(), request)


handler = lambda_handler(app)
