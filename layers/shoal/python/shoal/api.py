"""The HTTP frame every API function shares: one resolver factory, one error mapping.

Only this module turns exceptions into status codes. Handlers stay thin: parse with
``parse_body``, take the caller from ``principal``, call one service, return a dict.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import unquote

from aws_lambda_powertools.event_handler import APIGatewayHttpResolver, Response, content_types
from aws_lambda_powertools.utilities.typing import LambdaContext
from pydantic import BaseModel, ValidationError

from shoal.core.auth import Principal
from shoal.core.config import get_config
from shoal.core.errors import (
    BadRequest,
    BodyTooLarge,
    MalformedJson,
    RouteNotFound,
    ShoalError,
    UnsupportedMediaType,
)
from shoal.core.observability import logger

M = TypeVar("M", bound=BaseModel)

#: the header naming the caller's channel on every session-scoped call but connect
CHANNEL_HEADER = "shoal-channel"
#: JSON nested deeper than this is refused; the deepest body the API takes has 5 levels
MAX_JSON_DEPTH = 32
#: a ``\uD800``-``\uDFFF`` escape in the text: the only way JSON can carry a lone surrogate
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _dumps(body: Any) -> str:
    # compact, as the resolver serializes the dicts routes return
    return json.dumps(body, separators=(",", ":"))


def error_response(error: ShoalError) -> Response[str]:
    return Response(
        status_code=error.status,
        content_type=content_types.APPLICATION_JSON,
        body=_dumps(error.body()),
        headers=error.headers() or None,
    )


def json_response(status: int, body: Any, headers: dict[str, str] | None = None) -> Response[str]:
    return Response(
        status_code=status,
        content_type=content_types.APPLICATION_JSON,
        body=_dumps(body),
        headers=headers,
    )


class _Resolver(APIGatewayHttpResolver):
    """Powertools' resolver, holding the request per thread.

    Powertools keeps the current event on a class attribute shared by every resolver in the
    process. A Lambda environment serves one request at a time, but ``shoal dev`` runs all
    handlers in one process, where concurrent requests would read each other's event.
    """

    _request = threading.local()

    @property
    def current_event(self) -> Any:
        return self._request.event

    @current_event.setter
    def current_event(self, value: Any) -> None:
        self._request.event = value

    def resolve(self, event: Mapping[str, Any], context: LambdaContext) -> dict[str, Any]:
        self._request.event = self._to_proxy_event(dict(event))
        return super().resolve(event, context)


def make_resolver() -> APIGatewayHttpResolver:
    """A resolver whose every failure becomes a coded ``{"error": ...}`` response."""
    app = _Resolver()

    @app.exception_handler(ShoalError)
    def _shoal_error(error: ShoalError) -> Response[str]:
        if error.status >= 500:
            logger.error("request failed", extra={"code": error.code})
        return error_response(error)

    @app.exception_handler(ValidationError)
    def _validation_error(error: ValidationError) -> Response[str]:
        fields = [
            {"field": ".".join(str(p) for p in e["loc"]), "problem": e["msg"]}
            for e in error.errors(include_input=False, include_url=False)
        ]
        return error_response(BadRequest("the request body does not fit the schema", fields=fields))

    @app.not_found
    def _not_found(_: Exception) -> Response[str]:
        event = app.current_event
        return error_response(
            RouteNotFound(f"no route for {event.request_context.http.method} {event.path}")
        )

    @app.exception_handler(Exception)
    def _unexpected(error: Exception) -> Response[str]:
        # The type only: messages of arbitrary exceptions may quote request data.
        logger.exception("unexpected error", extra={"error_type": type(error).__name__})
        return error_response(ShoalError("an internal error occurred; retry the request"))

    return app


def principal(app: APIGatewayHttpResolver) -> Principal:
    """The caller, from the claims API Gateway's JWT authorizer verified."""
    authorizer = app.current_event.raw_event.get("requestContext", {}).get("authorizer") or {}
    claims = (authorizer.get("jwt") or {}).get("claims")
    return Principal.from_claims(claims)


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


@dataclass(frozen=True)
class SessionCall:
    """A session-scoped call: its caller, allowed by its claims to act as ``client_id``."""

    who: Principal
    client_id: str
    channel: str | None


def session_call(app: APIGatewayHttpResolver, client_id: str) -> SessionCall:
    """The principal first, before anything about the request's shape is looked at.

    A client id outside the principal's ``shoal:clients`` answers 403 whatever else is wrong
    with the request, so a caller learns nothing about sessions it may not touch.
    """
    who = principal(app)
    # API Gateway matches routes on the raw path: the parameter arrives percent-encoded
    name = unquote(client_id)
    who.require_client(name)
    return SessionCall(who, name, (app.current_event.headers or {}).get(CHANNEL_HEADER))


@contextmanager
def owner_first(require_owner: Callable[[], None]) -> Iterator[None]:
    """Run a request's shape checks; if one fails, check ownership before answering it.

    The claims may allow a client id whose session another principal holds: that answers 403,
    never a 400 about the body or the query. The ownership read happens only on the failure
    path, so a well-formed call pays nothing for it.
    """
    try:
        yield
    except (ShoalError, ValidationError):
        require_owner()
        raise


def lambda_handler(
    app: APIGatewayHttpResolver,
) -> Callable[[dict[str, Any], LambdaContext], dict[str, Any]]:
    """The Lambda entry point for a resolver, with the request id in every log line."""

    @logger.inject_lambda_context(clear_state=True)
    def handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
        return app.resolve(event, context)

    return handler
