"""Who is calling: the principal from the JWT authorizer's claims, checked before the request.

The principal is always read before the request's shape: an admin route refuses a caller
without ``shoal:admin`` (``admin_only``, a middleware of every route of the admin resolvers),
and a session-scoped call a client id outside the caller's ``shoal:clients`` (``session_call``),
whatever else is wrong with the request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from aws_lambda_powertools.event_handler import APIGatewayHttpResolver, Response
from aws_lambda_powertools.event_handler.middlewares import NextMiddleware
from pydantic import ValidationError

from shoal.core.auth import Principal
from shoal.core.errors import (
    ShoalError,
)

#: the header naming the caller's channel on every session-scoped call but connect
CHANNEL_HEADER = "shoal-channel"


def principal(app: APIGatewayHttpResolver) -> Principal:
    """The caller, from the claims API Gateway's JWT authorizer verified."""
    authorizer = app.current_event.raw_event.get("requestContext", {}).get("authorizer") or {}
    claims = (authorizer.get("jwt") or {}).get("claims")
    return Principal.from_claims(claims)


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


def has_channel(app: APIGatewayHttpResolver) -> bool:
    """Whether the request names a channel at all (an empty or malformed one counts: it is
    refused as a channel call, never read as the read-only view)."""
    return CHANNEL_HEADER in (app.current_event.headers or {})


def session_view_call(app: APIGatewayHttpResolver, client_id: str) -> SessionCall:
    """The read-only view of a session: an admin may read any client id's; anyone else only a
    client id its ``shoal:clients`` allows, checked before anything else as ``session_call``
    does (the session's owner is checked by the registry, after its one read)."""
    who = principal(app)
    name = unquote(client_id)
    if not who.admin:
        who.require_client(name)
    return SessionCall(who, name, None)


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


def admin_only(app: APIGatewayHttpResolver, next_middleware: NextMiddleware) -> Response[Any]:
    """Route middleware of the admin functions: 403 without the ``shoal:admin`` claim."""
    principal(app).require_admin()
    return next_middleware(app)
