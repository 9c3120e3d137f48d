"""The JWT rules of the deployed HTTP API's JWT authorizer, in one place.

``shoal dev``'s HTTP gateway (``shoal.local.gateway``) and the WebSocket API's ``$connect``
authorizer (``shoal.edge.authorizer``, deployed in the layer) both check tokens with
``JwtAuthorizer``, so a token one API accepts the other accepts too.

``JwtAuthorizer`` checks a token the way API Gateway's JWT authorizer does: the token from the
Authorization header (with or without ``Bearer``), an RSA signature (RS256) by the JWKS key
named in the header's ``kid``, ``iss`` equal to the configured issuer, ``aud`` (or, only when
``aud`` is absent, ``client_id``) among the configured audiences, ``exp`` in the future and
``nbf``/``iat`` not in the future. It hands the function the claims as API Gateway does: every
value a string, arrays as ``"[a b c]"``, booleans ``"true"``/``"false"``, null claims left out.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

# absolute import: PyJWT, not this module
import jwt

from shoal.core.clock import Clock, SystemClock

ALGORITHM = "RS256"


class AuthorizationFailed(Exception):
    """The request is not authorized; ``reason`` is safe to show (it never quotes the token)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# --- claims as API Gateway passes them -------------------------------------------------------


def _scalar(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value, separators=(",", ":"))


def stringify_claim(value: Any) -> str | None:
    """One claim value rendered as API Gateway renders it; None for a null claim (omitted)."""
    if value is None:
        return None
    if isinstance(value, list):
        return "[" + " ".join(_scalar(v) for v in value) + "]"
    return _scalar(value)


def stringify_claims(claims: Mapping[str, Any]) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, value in claims.items():
        rendered = stringify_claim(value)
        if rendered is not None:
            out[name] = rendered
    return out


# --- the authorizer --------------------------------------------------------------------------


def bearer_token(authorization: str | None) -> str:
    """The token of an Authorization header value, ``Bearer`` optional (as API Gateway)."""
    if authorization is None or not authorization.strip():
        raise AuthorizationFailed("the request carries no Authorization header")
    token = authorization.strip()
    if token[:7].lower() == "bearer ":
        token = token[7:].strip()
    if not token:
        raise AuthorizationFailed("the Authorization header carries no token")
    return token


def _numeric(claims: Mapping[str, Any], name: str) -> float | None:
    value = claims.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise AuthorizationFailed(f"the token's {name} claim is not a number")
    return float(value)


@dataclass(frozen=True)
class Authorized:
    """What the authorizer hands the function: requestContext.authorizer.jwt."""

    claims: dict[str, str]
    scopes: list[str] | None = None

    def context(self) -> dict[str, Any]:
        return {"jwt": {"claims": self.claims, "scopes": self.scopes}}


class KeySet(Protocol):
    """The issuer's signing keys by kid (a JWKS held in memory, or fetched and cached)."""

    def key(self, kid: str) -> Mapping[str, Any] | None: ...


class StaticKeySet:
    """A JWKS document known up front (``shoal dev``'s own issuer, tests)."""

    def __init__(self, jwks: Mapping[str, Any]) -> None:
        self._keys = keys_by_kid(jwks)

    def key(self, kid: str) -> Mapping[str, Any] | None:
        return self._keys.get(kid)


def keys_by_kid(jwks: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    keys = jwks.get("keys", [])
    if not isinstance(keys, list):
        return {}
    return {str(k["kid"]): k for k in keys if isinstance(k, Mapping) and "kid" in k}


class JwtAuthorizer:
    def __init__(
        self,
        *,
        issuer: str,
        audiences: Sequence[str],
        jwks: Mapping[str, Any] | KeySet,
        clock: Clock | None = None,
    ) -> None:
        self.issuer = issuer
        self.audiences = tuple(audiences)
        self._keys: KeySet = StaticKeySet(jwks) if isinstance(jwks, Mapping) else jwks
        self._clock = clock or SystemClock()

    def authorize(self, authorization: str | None) -> Authorized:
        """Check an Authorization header value; ``AuthorizationFailed`` when refused."""
        return self.authorize_token(bearer_token(authorization))

    def authorize_token(self, token: str) -> Authorized:
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError as exc:
            raise AuthorizationFailed("the token is not a well-formed JWT") from exc
        # the algorithm is fixed before any key is looked at: no alg none, no HMAC keyed with
        # the public key
        if header.get("alg") != ALGORITHM:
            raise AuthorizationFailed(f"the token is not signed with {ALGORITHM}")
        jwk = self._keys.key(str(header.get("kid")))
        if jwk is None:
            raise AuthorizationFailed("the token's kid matches no key of the issuer")
        try:
            key = jwt.PyJWK(dict(jwk), algorithm=ALGORITHM).key
            claims: dict[str, Any] = jwt.decode(
                token,
                key=key,
                algorithms=[ALGORITHM],
                # the claims are checked below, against the injected clock
                options={
                    "verify_signature": True,
                    "verify_aud": False,
                    "verify_iss": False,
                    "verify_exp": False,
                    "verify_nbf": False,
                    "verify_iat": False,
                    "require": [],
                },
            )
        except jwt.PyJWTError as exc:
            raise AuthorizationFailed("the token's signature does not verify") from exc
        self._check_claims(claims)
        return Authorized(stringify_claims(claims))

    def _check_claims(self, claims: Mapping[str, Any]) -> None:
        if claims.get("iss") != self.issuer:
            raise AuthorizationFailed("the token was issued by another issuer")
        if "aud" in claims:
            aud = claims["aud"]
            audiences = aud if isinstance(aud, list) else [aud]
        else:
            audiences = [claims.get("client_id")]
        if not any(isinstance(a, str) and a in self.audiences for a in audiences):
            raise AuthorizationFailed("the token is meant for another audience")
        now = self._clock.now_ms() / 1000
        exp = _numeric(claims, "exp")
        if exp is None:
            raise AuthorizationFailed("the token has no exp claim")
        if exp <= now:
            raise AuthorizationFailed("the token has expired")
        nbf = _numeric(claims, "nbf")
        if nbf is not None and nbf > now:
            raise AuthorizationFailed("the token is not valid yet (nbf)")
        iat = _numeric(claims, "iat")
        if iat is not None and iat > now:
            raise AuthorizationFailed("the token was issued in the future (iat)")
