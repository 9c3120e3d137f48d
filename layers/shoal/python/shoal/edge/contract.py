"""The WebSocket protocol's AsyncAPI 3.0 document, made from the frame models.

``python -m shoal.edge.contract > docs/asyncapi.yaml`` writes it; a test holds the committed
file equal to what this makes, so the contract and the handlers have one source
(``shoal.edge.frames``). The channel is the connection; the client's frames are what the
service receives, the service's frames what it sends.
"""

from __future__ import annotations

import sys
from typing import Any

from pydantic import BaseModel

from shoal import __version__
from shoal.declarations import DEPLOYMENT
from shoal.edge.frames import CLIENT_FRAMES, SERVICE_FRAMES

REF_TEMPLATE = "#/components/schemas/{model}"


def _action(model: type[BaseModel]) -> str:
    field = model.model_fields["action"]
    if field.default is not None and isinstance(field.default, str):
        return field.default
    return str(field.annotation.__args__[0])  # type: ignore[union-attr]


def _schemas(models: tuple[type[BaseModel], ...], mode: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for model in models:
        schema = model.model_json_schema(ref_template=REF_TEMPLATE, mode=mode)  # type: ignore[arg-type]
        for name, nested in schema.pop("$defs", {}).items():
            out.setdefault(name, nested)
        out[model.__name__] = schema
    return out


def document() -> dict[str, Any]:
    ws = DEPLOYMENT.websocket
    client = {_action(m): m for m in CLIENT_FRAMES}
    service = {_action(m): m for m in SERVICE_FRAMES}
    messages: dict[str, Any] = {}
    for prefix, frames in (("client", client), ("service", service)):
        for action, model in frames.items():
            messages[f"{prefix}.{action}"] = {
                "name": action,
                "title": model.__name__,
                "summary": " ".join((model.__doc__ or "").strip().split("\n\n")[0].split()),
                "contentType": "application/json",
                "payload": {"$ref": REF_TEMPLATE.format(model=model.__name__)},
            }
    schemas = _schemas(CLIENT_FRAMES, "validation")
    schemas.update(_schemas(SERVICE_FRAMES, "serialization"))
    channel_messages = {name: {"$ref": f"#/components/messages/{name}"} for name in messages}
    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": "Shoal WebSocket API",
            "version": __version__,
            "description": (
                "A session's whole life in JSON text frames over API Gateway's WebSocket API; "
                "deliveries are pushed. Route selection: the frame's `action`. Binary frames are "
                f"closed with 1003; frames over {ws.max_frame_bytes} bytes and messages over "
                f"{ws.max_message_bytes} bytes with 1009. A connection idles at most "
                f"{ws.idle_timeout_s} s and lives at most {ws.max_connection_s} s. The handshake "
                "carries the HTTP API's JWT: `Authorization: Bearer <jwt>`, or the subprotocols "
                "`shoal.v1, bearer.<jwt>` (the answer selects `shoal.v1`); never the query string."
            ),
        },
        "servers": {
            "deployed": {
                "host": "{apiId}.execute-api.{region}.amazonaws.com",
                "pathname": f"/{ws.stage}",
                "protocol": "wss",
                "variables": {"apiId": {}, "region": {"default": "us-east-1"}},
            },
            "local": {"host": "127.0.0.1:8081", "protocol": "ws"},
        },
        "channels": {
            "connection": {
                "address": "/",
                "title": "One WebSocket connection",
                "messages": channel_messages,
            }
        },
        "operations": {
            "receiveClientFrame": {
                "action": "receive",
                "channel": {"$ref": "#/channels/connection"},
                "summary": "What the service accepts from a client",
                "messages": [
                    {"$ref": f"#/channels/connection/messages/client.{a}"} for a in client
                ],
            },
            "sendServiceFrame": {
                "action": "send",
                "channel": {"$ref": "#/channels/connection"},
                "summary": "What the service sends: answers (echoing `ref`), deliveries, errors",
                "messages": [
                    {"$ref": f"#/channels/connection/messages/service.{a}"} for a in service
                ],
            },
        },
        "components": {"messages": messages, "schemas": dict(sorted(schemas.items()))},
    }


def render() -> str:
    import yaml

    header = "# Generated from shoal.edge.frames by `python -m shoal.edge.contract`; do not edit.\n"
    return header + yaml.safe_dump(document(), sort_keys=False, width=100, allow_unicode=True)


if __name__ == "__main__":
    sys.stdout.write(render())
