"""Request bodies and query strings: broken input is a coded 4xx before any service sees it.

Every body is checked below its schema first (size, content type, UTF-8, JSON, nesting,
lone surrogates: ``read_json``), then against its pydantic model (``parse_body``).
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from typing import Any, TypeVar

from aws_lambda_powertools.event_handler import APIGatewayHttpResolver
from pydantic import BaseModel, ConfigDict

from shoal.core.config import get_config
from shoal.core.errors import (
    BadRequest,
    BodyTooLarge,
    MalformedJson,
    UnsupportedMediaType,
)

M = TypeVar("M", bound=BaseModel)


#: JSON nested deeper than this is refused; the deepest body the API takes has 5 levels
MAX_JSON_DEPTH = 32


#: a ``\uD800``-``\uDFFF`` escape in the text: the only way JSON can carry a lone surrogate
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


_SURROGATE = re.compile("[\ud800-\udfff]")


def _body_bytes(app: APIGatewayHttpResolver) -> bytes:
    event = app.current_event
    body = event.body
    if not body:
        return b""
    if event.is_base64_encoded:
        # API Gateway sends a body as base64 unless its content type is text and it is UTF-8
        try:
            return base64.b64decode(body, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise MalformedJson("the request body is not valid base64") from exc
    return body.encode("utf-8", "surrogatepass")


def _no_constant(name: str) -> Any:
    # Python's json takes NaN and Infinity, which are not JSON (RFC 8259, section 6)
    raise ValueError(f"{name} is not a JSON number")


def _check_tree(data: Any, *, depth: bool, strings: bool) -> None:
    """Refuse nesting beyond ``MAX_JSON_DEPTH`` and strings holding a lone surrogate.

    A lone surrogate (``"\\ud800"``) is valid JSON syntax but no Unicode scalar value: UTF-8
    cannot encode it, so it could be neither stored nor sent on (RFC 8259 section 8.2; MQTT 5
    [MQTT-1.5.4-1] forbids the code points U+D800..U+DFFF in every UTF-8 string).
    """
    stack: list[tuple[Any, int, tuple[str | int, ...]]] = [(data, 1, ())]
    while stack:
        value, level, path = stack.pop()
        if isinstance(value, dict):
            if depth and level > MAX_JSON_DEPTH:
                raise MalformedJson(f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
            for key, item in value.items():
                if strings and _SURROGATE.search(key):
                    raise _lone_surrogate((*path, key))
                stack.append((item, level + 1, (*path, key)))
        elif isinstance(value, list):
            if depth and level > MAX_JSON_DEPTH:
                raise MalformedJson(f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
            stack.extend((item, level + 1, (*path, n)) for n, item in enumerate(value))
        elif strings and isinstance(value, str) and _SURROGATE.search(value):
            raise _lone_surrogate(path)


def _lone_surrogate(path: tuple[str | int, ...]) -> MalformedJson:
    return MalformedJson(
        "a string holds a lone surrogate (\\ud800-\\udfff), which is not Unicode text",
        field=".".join(str(p) for p in path),
    )


def read_json(app: APIGatewayHttpResolver) -> Any:
    """The request body as JSON: size, content type, encoding, syntax, depth and strings checked.

    Every way a body can be broken answers a coded 400 (or 413/415) before any schema or
    service sees it: bytes that are not UTF-8, JSON that is not JSON (NaN, Infinity, numbers of
    thousands of digits), nesting deep enough to exhaust a parser, and lone surrogates.
    """
    event = app.current_event
    limit = get_config().max_body_bytes
    raw = _body_bytes(app)
    if len(raw) > limit:
        raise BodyTooLarge(f"the request body exceeds {limit} bytes", limit=limit)
    content_type = (event.headers or {}).get("content-type", "application/json")
    if raw and "json" not in content_type.lower():
        raise UnsupportedMediaType("send the body as application/json")
    if not raw:
        return {}
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MalformedJson("the request body is not UTF-8 text") from exc
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except RecursionError as exc:
        raise MalformedJson(f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from exc
    except ValueError as exc:
        raise MalformedJson("the request body is not valid JSON") from exc
    # both checks are skipped, at C speed, for the bodies that cannot fail them
    deep = text.count("[") + text.count("{") > MAX_JSON_DEPTH
    escaped = _SURROGATE_ESCAPE.search(text) is not None
    if deep or escaped:
        _check_tree(data, depth=deep, strings=escaped)
    return data


def parse_body(app: APIGatewayHttpResolver, model: type[M]) -> M:
    """The request body as ``model``: ``read_json``'s checks, then the schema."""
    data = read_json(app)
    if not isinstance(data, dict):
        raise BadRequest("the request body must be a JSON object")
    return model.model_validate(data)


def query_int(raw: str | None, name: str, default: int) -> int:
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise BadRequest(f"{name} must be an integer", field=name) from exc


class NoBody(BaseModel):
    """A route that takes no fields: an empty object (or no body) only."""

    model_config = ConfigDict(extra="forbid")
