"""The principal: who is calling, and what its JWT claims let it touch.

API Gateway's JWT authorizer hands a function the token's claims with every value turned into
a string: lists arrive as ``"[a b c]"``, booleans as ``"true"``. ``Principal.from_claims``
accepts both that wire form and real JSON values (tests, other front doors). Because the wire
form separates list items with spaces, a filter in a claim cannot contain a space.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shoal.core.errors import Forbidden, Unauthorized

CLAIM_CLIENTS = "shoal:clients"
CLAIM_PUBLISH = "shoal:publish"
CLAIM_SUBSCRIBE = "shoal:subscribe"
CLAIM_ADMIN = "shoal:admin"


def _as_list(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, list | tuple):
        return tuple(str(v) for v in value)
    text = str(value).strip()
    if text.startswith("[") and text.endswith("]"):
        try:
            parsed = json.loads(text)
        except ValueError:
            # API Gateway's rendering of a JSON array: "[a b c]"
            return tuple(text[1:-1].split())
        if isinstance(parsed, list):
            return tuple(str(v) for v in parsed)
    return tuple(text.split()) if text else ()


def _as_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    return str(value).strip().lower() == "true"


def pattern_allows(pattern: str, client_id: str) -> bool:
    """A client-id pattern: exact, or a prefix followed by one ``*`` at the end."""
    if pattern.endswith("*"):
        return client_id.startswith(pattern[:-1])
    return pattern == client_id


@dataclass(frozen=True)
class Principal:
    sub: str
    clients: tuple[str, ...]
    publish: tuple[str, ...] = ()
    subscribe: tuple[str, ...] = ()
    admin: bool = False

    @classmethod
    def from_claims(cls, claims: Mapping[str, Any] | None) -> Principal:
        if not claims or not claims.get("sub"):
            raise Unauthorized("the request carries no authenticated principal")
        sub = str(claims["sub"])
        clients = _as_list(claims.get(CLAIM_CLIENTS)) if CLAIM_CLIENTS in claims else (sub,)
        return cls(
            sub=sub,
            clients=clients,
            publish=_as_list(claims.get(CLAIM_PUBLISH)),
            subscribe=_as_list(claims.get(CLAIM_SUBSCRIBE)),
            admin=_as_bool(claims.get(CLAIM_ADMIN, False)),
        )

    def may_connect_as(self, client_id: str) -> bool:
        return any(pattern_allows(p, client_id) for p in self.clients)

    def require_client(self, client_id: str) -> None:
        if not self.may_connect_as(client_id):
            raise Forbidden(f"principal may not act as client id {client_id!r}")

    def require_admin(self) -> None:
        if not self.admin:
            raise Forbidden("this route needs the shoal:admin claim")
