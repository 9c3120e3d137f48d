"""The WebSocket API's ``$connect`` authorizer: a Lambda REQUEST authorizer applying the HTTP
API's JWT rules (``shoal.core.jwt``), so a token one API accepts the other accepts too.

The token comes from ``Authorization`` (``Bearer`` optional, as the HTTP API), or, for browsers,
which cannot set headers on a WebSocket, from ``Sec-WebSocket-Protocol`` as the offered
subprotocol ``bearer.<jwt>`` (a JWT is base64url and dots: RFC 7230 token characters). Never
from the query string: query strings land in access logs.

Allowed: an IAM policy allowing the handshake's ``methodArn``, ``principalId`` the token's
``sub`` and the claims in ``context`` as the HTTP API's JWT authorizer renders them, so that
``Principal.from_claims(requestContext.authorizer)`` gives the HTTP API's principal. Refused:
``AuthorizationFailed``, which the handler turns into ``Exception("Unauthorized")``: API
Gateway answers that (its exact message) with 401, whatever the reason.

The issuer's keys come from its JWKS URL, fetched with a timeout and kept for the container's
life; a kid the cached set does not know fetches it again, at most once a minute (keys rotate;
a flood of made-up kids must not become a flood of fetches).
"""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

from shoal.core.clock import Clock, SystemClock
from shoal.core.config import Config, is_loopback
from shoal.core.jwt import AuthorizationFailed, JwtAuthorizer, bearer_token, keys_by_kid

#: the subprotocol prefix a browser offers its token under
BEARER_PROTOCOL = "bearer."
JWKS_PATH = "/.well-known/jwks.json"
#: a kid the cached keys do not know refetches them, but not more often than this
REFETCH_INTERVAL_S = 60.0
#: before the first successful fetch, a failed one is retried no more often than this
RETRY_INTERVAL_S = 5.0
FETCH_TIMEOUT_S = 3.0
#: a JWKS is a few keys; anything far larger is not one
MAX_JWKS_BYTES = 256 * 1024

#: fetches a JWKS document: (url, timeout_s) -> the parsed document
Fetcher = Callable[[str, float], Mapping[str, Any]]


def jwks_url(config: Config) -> str:
    """``SHOAL_JWKS_URL``, or the issuer's ``/.well-known/jwks.json``."""
    if config.jwks_url:
        return config.jwks_url
    return config.jwt_issuer.rstrip("/") + JWKS_PATH


def check_jwks_url(url: str) -> str:
    """https, or http on loopback (``shoal dev``'s own issuer): keys never come in clear text."""
    parts = urlsplit(url)
    if parts.scheme == "https" and parts.hostname:
        return url
    if parts.scheme == "http" and is_loopback(parts.hostname):
        return url
    raise ValueError(f"the JWKS URL must be https (or http on loopback), got {url!r}")


def fetch_jwks(url: str, timeout_s: float) -> Mapping[str, Any]:
    request = urllib.request.Request(  # noqa: S310 - the scheme is checked (check_jwks_url)
        check_jwks_url(url), headers={"Accept": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310
        body = response.read(MAX_JWKS_BYTES + 1)
    if len(body) > MAX_JWKS_BYTES:
        raise ValueError(f"the JWKS at {url} is larger than {MAX_JWKS_BYTES} bytes")
    document = json.loads(body)
    if not isinstance(document, dict):
        raise ValueError(f"the JWKS at {url} is not a JSON object")
    return document


class CachedKeySet:
    """The issuer's JWKS, fetched on first use and kept; refetched for an unknown kid at most
    once per ``REFETCH_INTERVAL_S`` (``shoal.core.jwt.KeySet``). Thread-safe: ``shoal dev``
    runs a function's invocations on several threads."""

    def __init__(
        self,
        url: str,
        *,
        fetch: Fetcher = fetch_jwks,
        clock: Clock | None = None,
        timeout_s: float = FETCH_TIMEOUT_S,
    ) -> None:
        self.url = check_jwks_url(url)
        self._fetch = fetch
        self._clock = clock or SystemClock()
        self._timeout_s = timeout_s
        self._keys: dict[str, Mapping[str, Any]] | None = None
        self._attempted_ms: int | None = None
        self._lock = threading.Lock()
        #: fetches made (successful or not): what the tests count
        self.fetches = 0

    def key(self, kid: str) -> Mapping[str, Any] | None:
        with self._lock:
            if self._keys is not None and kid in self._keys:
                return self._keys[kid]
            if self._may_fetch():
                self._refresh()
            return None if self._keys is None else self._keys.get(kid)

    def _may_fetch(self) -> bool:
        if self._attempted_ms is None:
            return True
        interval = REFETCH_INTERVAL_S if self._keys is not None else RETRY_INTERVAL_S
        return self._clock.now_ms() - self._attempted_ms >= interval * 1000

    def _refresh(self) -> None:
        self._attempted_ms = self._clock.now_ms()
        self.fetches += 1
        try:
            document = self._fetch(self.url, self._timeout_s)
        except Exception as exc:
            # the keys we had stay good; without any, every handshake is refused until a
            # fetch succeeds
            raise AuthorizationFailed("the issuer's keys could not be fetched") from exc
        self._keys = keys_by_kid(document)


def _header(event: Mapping[str, Any], name: str) -> str | None:
    """One request header, by case-insensitive name; repeated values joined with commas
    (RFC 9110 §5.3), as a proxy would."""
    multi = event.get("multiValueHeaders") or {}
    values = [v for k, vs in multi.items() if k.lower() == name for v in (vs or [])]
    if values:
        return ", ".join(str(v) for v in values)
    for key, value in (event.get("headers") or {}).items():
        if key.lower() == name and value is not None:
            return str(value)
    return None


def handshake_token(event: Mapping[str, Any]) -> str:
    """The token of a ``$connect`` handshake: ``Authorization`` first, else the one
    ``bearer.<jwt>`` subprotocol offered. Never the query string."""
    authorization = _header(event, "authorization")
    if authorization is not None:
        # an Authorization header decides, as on the HTTP API (no falling back)
        return bearer_token(authorization)
    offered = _header(event, "sec-websocket-protocol") or ""
    tokens = [
        p[len(BEARER_PROTOCOL) :]
        for p in (part.strip() for part in offered.split(","))
        if p[: len(BEARER_PROTOCOL)].lower() == BEARER_PROTOCOL
    ]
    if not tokens:
        raise AuthorizationFailed("the handshake carries no token")
    if len(tokens) > 1:
        raise AuthorizationFailed("the handshake offers more than one bearer subprotocol")
    if not tokens[0]:
        raise AuthorizationFailed("the bearer subprotocol carries no token")
    return tokens[0]


def allow_policy(method_arn: str, principal_id: str, context: Mapping[str, str]) -> dict[str, Any]:
    return {
        "principalId": principal_id,
        "policyDocument": {
            "Version": "2012-10-17",
            "Statement": [
                {"Action": "execute-api:Invoke", "Effect": "Allow", "Resource": method_arn}
            ],
        },
        "context": dict(context),
    }


class WebSocketAuthorizer:
    """One REQUEST authorizer event in, the Allow policy out, or ``AuthorizationFailed``."""

    def __init__(self, jwt_authorizer: JwtAuthorizer) -> None:
        self.jwt = jwt_authorizer

    @classmethod
    def from_config(
        cls, config: Config, *, fetch: Fetcher = fetch_jwks, clock: Clock | None = None
    ) -> WebSocketAuthorizer:
        if not config.jwt_issuer or not config.jwt_audiences:
            raise ValueError(
                "the WebSocket authorizer needs SHOAL_JWT_ISSUER and SHOAL_JWT_AUDIENCE"
            )
        keys = CachedKeySet(jwks_url(config), fetch=fetch, clock=clock)
        return cls(
            JwtAuthorizer(
                issuer=config.jwt_issuer, audiences=config.jwt_audiences, jwks=keys, clock=clock
            )
        )

    def authorize(self, event: Mapping[str, Any]) -> dict[str, Any]:
        method_arn = event.get("methodArn")
        if not isinstance(method_arn, str) or not method_arn:
            raise AuthorizationFailed("the event names no methodArn")
        claims = self.jwt.authorize_token(handshake_token(event)).claims
        sub = claims.get("sub")
        if not sub:
            # a principal is its sub (shoal.core.auth.Principal); the HTTP API's functions
            # refuse a token without one too, after its authorizer let it through
            raise AuthorizationFailed("the token has no sub claim")
        return allow_policy(method_arn, sub, claims)
