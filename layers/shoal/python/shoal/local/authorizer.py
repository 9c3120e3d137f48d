"""The JWT authorizer of the deployed HTTP API, and the local identity provider behind it.

``JwtAuthorizer`` checks a request the way API Gateway's JWT authorizer does: the token from
the Authorization header (with or without ``Bearer``), an RSA signature (RS256) by the JWKS key
named in the header's ``kid``, ``iss`` equal to the configured issuer, ``aud`` (or, only when
``aud`` is absent, ``client_id``) among the configured audiences, ``exp`` in the future and
``nbf``/``iat`` not in the future. It hands the function the claims as API Gateway does: every
value a string, arrays as ``"[a b c]"``, booleans ``"true"``/``"false"``, null claims left out.

``SigningKey`` is the local identity provider's RSA key (kept in the state directory, mode
0600), which ``shoal dev`` publishes as a JWKS and ``shoal token`` signs with.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from shoal.core.auth import CLAIM_ADMIN, CLAIM_CLIENTS, CLAIM_PUBLISH, CLAIM_SUBSCRIBE
from shoal.core.clock import Clock, SystemClock

KEY_FILE = "jwt-signing-key.pem"
#: issuer and audience of the running ``shoal dev``, so ``shoal token`` mints matching tokens
SETTINGS_FILE = "authorizer.json"
DEFAULT_AUDIENCE = "shoal"
ALGORITHM = "RS256"


class AuthorizationFailed(Exception):
    """The request is not authorized; ``reason`` is safe to show (it never quotes the token)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


#: API Gateway's own 401 body; the reason goes in ``WWW-Authenticate`` (``unauthorized_header``)
UNAUTHORIZED_BODY = {"message": "Unauthorized"}


def unauthorized_header(reason: str) -> str:
    """The ``www-authenticate`` value API Gateway's JWT authorizer sends with its 401."""
    # the reason is this module's own text; keep the quoted-string well formed all the same
    safe = "".join(c for c in reason if c.isprintable() and c not in '"\\')
    return f'Bearer scope="" error="invalid_token" error_description="{safe}"'


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


def _bearer_token(authorization: str | None) -> str:
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


class JwtAuthorizer:
    def __init__(
        self,
        *,
        issuer: str,
        audiences: Sequence[str],
        jwks: Mapping[str, Any],
        clock: Clock | None = None,
    ) -> None:
        self.issuer = issuer
        self.audiences = tuple(audiences)
        self._keys = {k["kid"]: k for k in jwks.get("keys", []) if "kid" in k}
        self._clock = clock or SystemClock()

    def authorize(self, authorization: str | None) -> Authorized:
        token = _bearer_token(authorization)
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError as exc:
            raise AuthorizationFailed("the token is not a well-formed JWT") from exc
        if header.get("alg") != ALGORITHM:
            raise AuthorizationFailed(f"the token is not signed with {ALGORITHM}")
        jwk = self._keys.get(str(header.get("kid")))
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


# --- the local identity provider -------------------------------------------------------------


def _b64url_uint(value: int) -> str:
    raw = value.to_bytes((value.bit_length() + 7) // 8, "big")
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


class SigningKey:
    """An RSA key for RS256 with its JWK; its kid is the RFC 7638 thumbprint."""

    def __init__(self, private_key: rsa.RSAPrivateKey) -> None:
        self._private = private_key
        numbers = private_key.public_key().public_numbers()
        self._public = {"e": _b64url_uint(numbers.e), "kty": "RSA", "n": _b64url_uint(numbers.n)}
        canonical = json.dumps(self._public, separators=(",", ":"), sort_keys=True)
        digest = hashlib.sha256(canonical.encode()).digest()
        self.kid = base64.urlsafe_b64encode(digest).rstrip(b"=").decode()

    @classmethod
    def generate(cls) -> SigningKey:
        return cls(rsa.generate_private_key(public_exponent=65537, key_size=2048))

    @classmethod
    def load_or_create(cls, directory: Path) -> SigningKey:
        """The key in ``directory``, created there (mode 0600) on first use."""
        path = directory / KEY_FILE
        if path.exists():
            loaded = serialization.load_pem_private_key(path.read_bytes(), password=None)
            if not isinstance(loaded, rsa.RSAPrivateKey):
                raise ValueError(f"{path} does not hold an RSA private key")
            return cls(loaded)
        directory.mkdir(parents=True, exist_ok=True)
        key = cls.generate()
        pem = key._private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        # O_EXCL: two processes racing to create the key cannot both win
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
        return key

    def jwk(self) -> dict[str, str]:
        return {**self._public, "kid": self.kid, "alg": ALGORITHM, "use": "sig"}

    def jwks(self) -> dict[str, Any]:
        return {"keys": [self.jwk()]}

    def sign(self, claims: Mapping[str, Any], headers: Mapping[str, Any] | None = None) -> str:
        return jwt.encode(
            dict(claims),
            self._private,
            algorithm=ALGORITHM,
            headers={"kid": self.kid, **(headers or {})},
        )


def shoal_claims(
    *,
    sub: str,
    admin: bool = False,
    clients: Iterable[str] | None = None,
    publish: Iterable[str] = (),
    subscribe: Iterable[str] = (),
) -> dict[str, Any]:
    """Shoal's permission claims (API.md); clients default to exactly ``sub`` when omitted."""
    claims: dict[str, Any] = {"sub": sub}
    if clients is not None:
        claims[CLAIM_CLIENTS] = list(clients)
    if publish:
        claims[CLAIM_PUBLISH] = list(publish)
    if subscribe:
        claims[CLAIM_SUBSCRIBE] = list(subscribe)
    if admin:
        claims[CLAIM_ADMIN] = True
    return claims


def mint_token(
    key: SigningKey,
    *,
    issuer: str,
    audience: str = DEFAULT_AUDIENCE,
    sub: str,
    admin: bool = False,
    clients: Iterable[str] | None = None,
    publish: Iterable[str] = (),
    subscribe: Iterable[str] = (),
    ttl_s: int = 3600,
    now_s: int | None = None,
    extra: Mapping[str, Any] | None = None,
) -> str:
    now = int(time.time()) if now_s is None else now_s
    claims = shoal_claims(
        sub=sub, admin=admin, clients=clients, publish=publish, subscribe=subscribe
    )
    claims |= {"iss": issuer, "aud": audience, "iat": now, "nbf": now, "exp": now + ttl_s}
    claims |= dict(extra or {})
    return key.sign(claims)


@dataclass(frozen=True)
class IssuerSettings:
    """Issuer and audience of a state directory's ``shoal dev``, for ``shoal token``."""

    issuer: str
    audience: str = DEFAULT_AUDIENCE

    def save(self, directory: Path) -> None:
        path = directory / SETTINGS_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"issuer": self.issuer, "audience": self.audience}))
        tmp.replace(path)

    @classmethod
    def load(cls, directory: Path) -> IssuerSettings | None:
        path = directory / SETTINGS_FILE
        if not path.exists():
            return None
        data = json.loads(path.read_text())
        return cls(issuer=data["issuer"], audience=data.get("audience", DEFAULT_AUDIENCE))
