"""The local JWT authorizer checks tokens exactly as API Gateway's HTTP API JWT authorizer."""

from __future__ import annotations

import base64
import json
import stat
from pathlib import Path
from typing import Any

import jwt
import pytest
from shoal.core.auth import Principal
from shoal.core.clock import ManualClock
from shoal.local.authorizer import (
    AuthorizationFailed,
    JwtAuthorizer,
    SigningKey,
    mint_token,
    stringify_claims,
    unauthorized_header,
)

ISSUER = "http://127.0.0.1:8080"
NOW_S = 1_800_000_000


@pytest.fixture(scope="module")
def key() -> SigningKey:
    return SigningKey.generate()


@pytest.fixture(scope="module")
def other_key() -> SigningKey:
    return SigningKey.generate()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(start_ms=NOW_S * 1000)


@pytest.fixture
def authorizer(key: SigningKey, clock: ManualClock) -> JwtAuthorizer:
    return JwtAuthorizer(issuer=ISSUER, audiences=["shoal"], jwks=key.jwks(), clock=clock)


def token(key: SigningKey, **claims: Any) -> str:
    base = {"sub": "alice", "iss": ISSUER, "aud": "shoal", "iat": NOW_S, "exp": NOW_S + 60}
    return key.sign({**base, **claims})


def _b64(data: dict[str, Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b"=").decode()


def refused(authorizer: JwtAuthorizer, header: str | None) -> str:
    with pytest.raises(AuthorizationFailed) as caught:
        authorizer.authorize(header)
    return caught.value.reason


def test_good_token_passes_its_claims(key: SigningKey, authorizer: JwtAuthorizer) -> None:
    # Given a token signed by the issuer's key, for our audience, not expired
    # When the authorizer checks it
    authorized = authorizer.authorize(f"Bearer {token(key)}")
    # Then the function gets its claims as strings, and no scopes
    assert authorized.claims["sub"] == "alice"
    assert authorized.claims["exp"] == str(NOW_S + 60)
    assert authorized.context() == {"jwt": {"claims": authorized.claims, "scopes": None}}


@pytest.mark.parametrize("prefix", ["Bearer ", "bearer ", "BEARER  ", ""])
def test_bearer_prefix_is_optional(key: SigningKey, authorizer: JwtAuthorizer, prefix: str) -> None:
    assert authorizer.authorize(prefix + token(key)).claims["sub"] == "alice"


@pytest.mark.parametrize("header", [None, "", "   ", "Bearer ", "Bearer"])
def test_missing_token_is_refused(authorizer: JwtAuthorizer, header: str | None) -> None:
    assert refused(authorizer, header)


def test_signature_by_another_key_is_refused(
    key: SigningKey, other_key: SigningKey, authorizer: JwtAuthorizer
) -> None:
    # Given a token signed by another key that claims our key's kid
    forged = other_key.sign(
        {"sub": "alice", "iss": ISSUER, "aud": "shoal", "exp": NOW_S + 60},
        headers={"kid": key.kid},
    )
    # Then the signature does not verify
    assert "signature" in refused(authorizer, forged)


def test_tampered_payload_is_refused(key: SigningKey, authorizer: JwtAuthorizer) -> None:
    header, _, signature = token(key).split(".")
    payload = _b64({"sub": "mallory", "iss": ISSUER, "aud": "shoal", "exp": NOW_S + 60})
    assert "signature" in refused(authorizer, f"{header}.{payload}.{signature}")


def test_unknown_kid_is_refused(other_key: SigningKey, authorizer: JwtAuthorizer) -> None:
    # Given a well-signed token whose kid is not in the issuer's JWKS
    assert "kid" in refused(authorizer, token(other_key))


@pytest.mark.parametrize(
    "alg_header",
    [{"alg": "none", "typ": "JWT"}, {"alg": "HS256", "typ": "JWT"}, {"alg": "RS512"}],
)
def test_algorithms_other_than_rs256_are_refused(
    key: SigningKey, authorizer: JwtAuthorizer, alg_header: dict[str, str]
) -> None:
    # Given a token whose header names another algorithm (alg none, or HMAC keyed with the
    # public key, the classic confusion attack)
    claims = _b64({"sub": "alice", "iss": ISSUER, "aud": "shoal", "exp": NOW_S + 60})
    forged = f"{_b64({**alg_header, 'kid': key.kid})}.{claims}."
    # Then it is refused before any key is used
    assert "RS256" in refused(authorizer, forged)


def test_hs256_signed_with_the_public_key_is_refused(
    key: SigningKey, authorizer: JwtAuthorizer
) -> None:
    public_n = key.jwk()["n"].encode()
    forged = jwt.encode(
        {"sub": "alice", "iss": ISSUER, "aud": "shoal", "exp": NOW_S + 60},
        public_n,
        algorithm="HS256",
        headers={"kid": key.kid},
    )
    assert "RS256" in refused(authorizer, forged)


def test_garbage_is_refused(authorizer: JwtAuthorizer) -> None:
    assert "well-formed" in refused(authorizer, "Bearer not.a.jwt")


def test_wrong_issuer_is_refused(key: SigningKey, authorizer: JwtAuthorizer) -> None:
    assert "issuer" in refused(authorizer, token(key, iss="https://evil.example.com"))


def test_missing_issuer_is_refused(key: SigningKey, authorizer: JwtAuthorizer) -> None:
    claims = {"sub": "alice", "aud": "shoal", "exp": NOW_S + 60}
    assert "issuer" in refused(authorizer, key.sign(claims))


@pytest.mark.parametrize("aud", ["other", ["other", "another"], [], None])
def test_wrong_audience_is_refused(key: SigningKey, authorizer: JwtAuthorizer, aud: Any) -> None:
    assert "audience" in refused(authorizer, token(key, aud=aud))


def test_audience_list_with_ours_passes(key: SigningKey, authorizer: JwtAuthorizer) -> None:
    assert authorizer.authorize(token(key, aud=["other", "shoal"])).claims["aud"] == "[other shoal]"


def test_client_id_counts_only_without_aud(key: SigningKey, authorizer: JwtAuthorizer) -> None:
    # Given an access token with client_id instead of aud (as Cognito issues them)
    access = key.sign({"sub": "alice", "iss": ISSUER, "client_id": "shoal", "exp": NOW_S + 60})
    assert authorizer.authorize(access).claims["client_id"] == "shoal"
    # But when aud is present, aud alone decides
    assert "audience" in refused(authorizer, token(key, aud="other", client_id="shoal"))


def test_expired_token_is_refused(
    key: SigningKey, authorizer: JwtAuthorizer, clock: ManualClock
) -> None:
    # Given a token that expires in 60 s
    good = token(key)
    # When 60 s have passed
    clock.advance(60)
    # Then it is expired (exp must be after now)
    assert "expired" in refused(authorizer, good)


def test_token_without_exp_is_refused(key: SigningKey, authorizer: JwtAuthorizer) -> None:
    claims = {"sub": "alice", "iss": ISSUER, "aud": "shoal"}
    assert "exp" in refused(authorizer, key.sign(claims))


def test_nbf_in_the_future_is_refused_until_it_passes(
    key: SigningKey, authorizer: JwtAuthorizer, clock: ManualClock
) -> None:
    early = token(key, nbf=NOW_S + 10)
    assert "nbf" in refused(authorizer, early)
    clock.advance(10)
    assert authorizer.authorize(early).claims["nbf"] == str(NOW_S + 10)


def test_iat_in_the_future_is_refused(key: SigningKey, authorizer: JwtAuthorizer) -> None:
    assert "iat" in refused(authorizer, token(key, iat=NOW_S + 10))


def test_non_numeric_exp_is_refused(key: SigningKey, authorizer: JwtAuthorizer) -> None:
    assert "exp" in refused(authorizer, token(key, exp=str(NOW_S + 60)))


def test_claims_are_stringified_as_api_gateway_does() -> None:
    # Given claims of every JSON type
    claims = {
        "sub": "alice",
        "exp": 1900000000,
        "ratio": 1.5,
        "shoal:admin": True,
        "shoal:debug": False,
        "shoal:publish": ["orders/#", "sensors/+/temp"],
        "mixed": ["a", 1, True],
        "empty": [],
        "nothing": None,
        "nested": {"a": 1},
    }
    # Then every value is a string, arrays bracketed and space-separated, nulls left out
    assert stringify_claims(claims) == {
        "sub": "alice",
        "exp": "1900000000",
        "ratio": "1.5",
        "shoal:admin": "true",
        "shoal:debug": "false",
        "shoal:publish": "[orders/# sensors/+/temp]",
        "mixed": "[a 1 true]",
        "empty": "[]",
        "nested": '{"a":1}',
    }


def test_minted_claims_parse_into_the_principal(key: SigningKey, authorizer: JwtAuthorizer) -> None:
    # Given a token minted with Shoal's permission claims
    minted = mint_token(
        key,
        issuer=ISSUER,
        sub="bob",
        admin=True,
        clients=["bob-*"],
        publish=["orders/#"],
        subscribe=["orders/#", "$share/g/orders/+"],
        now_s=NOW_S,
    )
    # When it passes the authorizer, in API Gateway's string form
    claims = authorizer.authorize(minted).claims
    # Then the principal reads back what was minted
    principal = Principal.from_claims(claims)
    assert principal == Principal(
        sub="bob",
        clients=("bob-*",),
        publish=("orders/#",),
        subscribe=("orders/#", "$share/g/orders/+"),
        admin=True,
    )


def test_minted_token_defaults_clients_to_sub(key: SigningKey, authorizer: JwtAuthorizer) -> None:
    claims = authorizer.authorize(mint_token(key, issuer=ISSUER, sub="carol", now_s=NOW_S)).claims
    principal = Principal.from_claims(claims)
    assert (principal.clients, principal.admin, principal.publish) == (("carol",), False, ())


def test_unauthorized_header_is_api_gateways() -> None:
    # the reason goes where API Gateway's JWT authorizer puts it; quotes cannot break it
    assert unauthorized_header('the token has "expired"') == (
        'Bearer scope="" error="invalid_token" error_description="the token has expired"'
    )


def test_refusal_reasons_never_quote_the_token(key: SigningKey, authorizer: JwtAuthorizer) -> None:
    bad = token(key, iss="https://evil.example.com")
    assert bad not in refused(authorizer, bad)


def test_signing_key_is_created_once_with_mode_0600(tmp_path: Path) -> None:
    # Given an empty state directory
    # When the key is asked for twice
    first = SigningKey.load_or_create(tmp_path)
    second = SigningKey.load_or_create(tmp_path)
    # Then it was created once, readable by its owner only, and the kid is stable
    pem = next(tmp_path.glob("*.pem"))
    assert stat.S_IMODE(pem.stat().st_mode) == 0o600
    assert first.kid == second.kid
    assert first.jwks() == second.jwks()


def test_jwks_publishes_only_the_public_key(key: SigningKey) -> None:
    (jwk,) = key.jwks()["keys"]
    assert set(jwk) == {"kty", "n", "e", "kid", "alg", "use"}
    assert (jwk["kty"], jwk["alg"], jwk["use"]) == ("RSA", "RS256", "sig")
