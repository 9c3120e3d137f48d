"""The HTTP frame every API function shares: one resolver factory, one error mapping.

Only this module turns exceptions into status codes. Handlers stay thin: parse with
``shoal.http.body.parse_body``, take the caller from ``shoal.http.caller``, call one service,
return a dict.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from typing import Any

from aws_lambda_powertools.event_handler import APIGatewayHttpResolver, Response, content_types
from aws_lambda_powertools.utilities.typing import LambdaContext
from pydantic import ValidationError

from shoal.core.errors import (
    BadRequest,
    RouteNotFound,
    ShoalError,
)
from shoal.core.observability import logger, observed


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


def query_values(app: APIGatewayHttpResolver, *names: str) -> tuple[str | None, ...]:
    """The current request's query string values of ``names`` (None for an absent one)."""
    query = app.current_event.query_string_parameters or {}
    return tuple(query.get(name) for name in names)


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


def lambda_handler(
    app: APIGatewayHttpResolver,
) -> Callable[[dict[str, Any], LambdaContext], dict[str, Any]]:
    """The Lambda entry point for a resolver, with the request id in every log line and one
    metrics flush per invocation (``shoal.core.observability.observed``)."""

    @observed
    def handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
        return app.resolve(event, context)

    return handler
