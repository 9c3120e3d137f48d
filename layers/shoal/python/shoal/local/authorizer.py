"""The local identity provider behind ``shoal dev``'s JWT authorizer.

The checks themselves (``JwtAuthorizer``: the deployed HTTP API's JWT authorizer's rules) live
in ``shoal.core.jwt``, shipped in the Lambda layer, because the WebSocket API's ``$connect``
authorizer applies them deployed; they are re-exported here for ``shoal dev``'s gateway.

``SigningKey`` is the local identity provider's RSA key (kept in the state directory, mode
0600), which ``shoal dev`` publishes as a JWKS and ``shoal token`` signs with.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from shoal.core.auth import CLAIM_ADMIN, CLAIM_CLIENTS, CLAIM_PUBLISH, CLAIM_SUBSCRIBE
from shoal.core.jwt import (
    ALGORITHM,
    AuthorizationFailed,
    Authorized,
    JwtAuthorizer,
    bearer_token,
    stringify_claim,
    stringify_claims,
)

__all__ = [
    "ALGORITHM",
    "DEFAULT_AUDIENCE",
    "UNAUTHORIZED_BODY",
    "AuthorizationFailed",
    "Authorized",
    "IssuerSettings",
    "JwtAuthorizer",
    "SigningKey",
    "bearer_token",
    "mint_token",
    "shoal_claims",
    "stringify_claim",
    "stringify_claims",
    "unauthorized_header",
]

KEY_FILE = "jwt-signing-key.pem"
#: issuer and audience of the running ``shoal dev``, so ``shoal token`` mints matching tokens
SETTINGS_FILE = "authorizer.json"
DEFAULT_AUDIENCE = "shoal"


#: API Gateway's own 401 body; the reason goes in ``WWW-Authenticate`` (``unauthorized_header``)
UNAUTHORIZED_BODY = {"message": "Unauthorized"}


def unauthorized_header(reason: str) -> str:
    """The ``www-authenticate`` value API Gateway's JWT authorizer sends with its 401."""
    # the reason is this module's own text; keep the quoted-string well formed all the same
    safe = "".join(c for c in reason if c.isprintable() and c not in '"\\')
    return f'Bearer scope="" error="invalid_token" error_description="{safe}"'


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
