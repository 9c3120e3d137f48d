"""Event factories: sample events live in events/*.json; these build the variants tests need."""

from __future__ import annotations

import base64
import copy
import json
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from shoal.local.context import LambdaContext

EVENTS = Path(__file__).resolve().parent.parent / "events"


@cache
def _load(name: str) -> dict[str, Any]:
    return json.loads((EVENTS / name).read_text())


def load_event(name: str) -> dict[str, Any]:
    return copy.deepcopy(_load(name))


def FakeContext() -> LambdaContext:
    """A Lambda context for handlers called directly in tests."""
    return LambdaContext("shoal-test", log_stream="test")


def http_event(
    method: str,
    path: str,
    *,
    body: Any = None,
    raw_body: str | None = None,
    claims: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
    query: dict[str, str] | None = None,
    route_key: str | None = None,
    path_parameters: dict[str, str] | None = None,
) -> dict[str, Any]:
    """An API Gateway HTTP API (payload 2.0) event; claims as the JWT authorizer passes them."""
    event = load_event("http_api_request.json")
    event["routeKey"] = event["requestContext"]["routeKey"] = route_key or f"{method} {path}"
    event["rawPath"] = event["requestContext"]["http"]["path"] = path
    event["requestContext"]["http"]["method"] = method
    event["rawQueryString"] = urlencode(query or {})
    event["queryStringParameters"] = query or None
    event["pathParameters"] = path_parameters
    if claims is None:
        del event["requestContext"]["authorizer"]
    else:
        event["requestContext"]["authorizer"]["jwt"]["claims"] = claims
    event["headers"].update({k.lower(): v for k, v in (headers or {}).items()})
    if raw_body is not None:
        event["body"] = raw_body
    elif body is not None:
        event["body"] = json.dumps(body)
    return event


def binary_body(event: dict[str, Any], data: bytes) -> dict[str, Any]:
    event["body"] = base64.b64encode(data).decode()
    event["isBase64Encoded"] = True
    return event


def response_json(response: dict[str, Any]) -> Any:
    return json.loads(response["body"]) if response.get("body") else None
