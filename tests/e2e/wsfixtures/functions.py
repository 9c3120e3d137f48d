"""The fixture deployment's functions: a REQUEST authorizer and one function for every route.

The authorizer reads ``Authorization: Bearer <word>`` (or ``bearer.<word>`` offered in
``Sec-WebSocket-Protocol``): ``allow-<sub>`` allows ``sub``, ``deny`` denies, ``boom`` fails,
anything else or nothing is "Unauthorized".
"""

from __future__ import annotations

import json
from typing import Any

from tests.e2e.wsfixtures import record


def _token(headers: dict[str, str]) -> str | None:
    for name, value in headers.items():
        if name.lower() == "authorization" and value.startswith("Bearer "):
            return value[len("Bearer ") :]
        if name.lower() == "sec-websocket-protocol":
            for offered in value.split(","):
                if offered.strip().startswith("bearer."):
                    return offered.strip()[len("bearer.") :]
    return None


def authorize(event: dict[str, Any], context: Any) -> dict[str, Any]:
    record.add(event)
    token = _token(event["headers"])
    if token == "boom":
        raise RuntimeError("the authorizer broke")
    if token is None or not (token == "deny" or token.startswith("allow-")):
        # the one failure API Gateway reads as 401
        raise Exception("Unauthorized")
    effect = "Deny" if token == "deny" else "Allow"
    sub = token.removeprefix("allow-")
    return {
        "principalId": sub,
        "policyDocument": {
            "Version": "2012-10-17",
            "Statement": [
                {"Action": "execute-api:Invoke", "Effect": effect, "Resource": event["methodArn"]}
            ],
        },
        "context": {"sub": sub, "admin": "false"},
    }


def edge(event: dict[str, Any], context: Any) -> dict[str, Any]:
    record.add(event)
    ctx = event["requestContext"]
    route = ctx["routeKey"]
    if route == "$connect":
        headers = {k.lower(): v for k, v in event["headers"].items()}
        if "x-refuse" in headers:
            return {"statusCode": int(headers["x-refuse"]), "body": "refused"}
        offered = [p.strip() for p in headers.get("sec-websocket-protocol", "").split(",")]
        if "shoal.v1" in offered:
            return {"statusCode": 200, "headers": {"Sec-WebSocket-Protocol": "shoal.v1"}}
        return {"statusCode": 200}
    if route == "boom":
        raise RuntimeError("the route broke")
    if route == "hold":
        # a frame whose function runs until the test releases it (at most 30 s)
        with record.LOCK:
            record.HOLDING[0] += 1
        try:
            record.RELEASE.wait(30)
        finally:
            with record.LOCK:
                record.HOLDING[0] -= 1
    answer = {
        "route": route,
        "connectionId": ctx.get("connectionId"),
        "principalId": ctx.get("authorizer", {}).get("principalId"),
        "body": event.get("body"),
    }
    return {"statusCode": 200, "body": json.dumps(answer)}
