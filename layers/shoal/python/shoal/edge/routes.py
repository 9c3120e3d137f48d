"""The WebSocket API's Lambda proxy events, turned into service calls and back: the one place
that maps the edge's errors to frames (as ``shoal.http.resolver`` does for HTTP)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from shoal.core.auth import Principal
from shoal.core.errors import ShoalError
from shoal.core.observability import logger
from shoal.edge.frames import encode, error_frame, frame_ref, parse_client_frame
from shoal.edge.service import EdgeService, chosen_subprotocol, requested_at

CONNECT = "$connect"
DISCONNECT = "$disconnect"


def _header(event: Mapping[str, Any], name: str) -> str | None:
    for key, value in (event.get("headers") or {}).items():
        if key.lower() == name:
            return str(value)
    return None


def handle(service: Callable[[], EdgeService], event: Mapping[str, Any]) -> dict[str, Any]:
    context = event.get("requestContext") or {}
    route = context.get("routeKey")
    connection_id = str(context.get("connectionId") or "")
    if route == CONNECT:
        # the authorizer admitted the handshake; a browser that offered the subprotocol (its
        # token beside it) gets it back, never the token
        chosen = chosen_subprotocol(_header(event, "sec-websocket-protocol"))
        return {
            "statusCode": 200,
            **({"headers": {"Sec-WebSocket-Protocol": chosen}} if chosen else {}),
        }
    if route == DISCONNECT:
        try:
            # the event's time is the close's: the will's delay runs from it
            service().disconnected(connection_id, requested_at(context))
        except ShoalError as exc:
            logger.info("disconnect not recorded", extra={"code": exc.code})
        return {"statusCode": 200}
    body = event.get("body")
    ref = frame_ref(body)
    try:
        who = Principal.from_claims(context.get("authorizer"))
        frame = parse_client_frame(body)
        answer = service().frame(connection_id, who, frame, requested_at(context))
    except ShoalError as error:
        if error.status >= 500:
            logger.error("frame failed", extra={"code": error.code})
        return {"statusCode": 200, "body": encode(error_frame(error, ref))}
    except Exception as error:
        # the type only: messages of arbitrary exceptions may quote frame data
        logger.exception("unexpected error", extra={"error_type": type(error).__name__})
        failed = ShoalError("an internal error occurred; retry the frame")
        return {"statusCode": 200, "body": encode(error_frame(failed, ref))}
    return {"statusCode": 200, **({"body": answer.frame} if answer.frame else {})}
