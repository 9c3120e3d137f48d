"""The WebSocket API's $connect authorizer (functions/wsauth) accepts exactly the tokens the
HTTP API's JWT authorizer accepts, with the issuer's keys fetched from a JWKS served on
loopback, and refuses every other handshake with API Gateway's 401 ("Unauthorized")."""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import jwt
import pytest
from shoal.core.auth import Principal
from shoal.core.clock import ManualClock
from shoal.core.config import Config, get_config
from shoal.core.jwt import AuthorizationFailed, JwtAuthorizer
from shoal.edge.authorizer import (
    REFETCH_INTERVAL_S,
    CachedKeySet,
    WebSocketAuthorizer,
    check_jwks_url,
    handshake_token,
    jwks_url,
)
from shoal.local.authorizer import SigningKey, mint_token

from functions.wsauth import app
from tests.helpers import FakeContext, load_event

AUDIENCE = "shoal"


class Jwks:
    """A JWKS served on loopback, as ``shoal dev``'s issuer (or a real one) serves it."""

    def __init__(self) -> None:
        self.key = SigningKey.generate()
        self.document: dict[str, Any] = self.key.jwks()
        self.requests = 0
        jwks = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                jwks.requests += 1
                body = json.dumps(jwks.document).encode()
                self.send_response(200 if self.path == "/.well-known/jwks.json" else 404)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.issuer = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def issuer() -> Iterator[Jwks]:
    served = Jwks()
    yield served
    served.close()


@pytest.fixture
def env(issuer: Jwks, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # the environment the stack and shoal dev give every function (SHOAL_JWT_*)
    monkeypatch.setenv("SHOAL_JWT_ISSUER", issuer.issuer)
    monkeypatch.setenv("SHOAL_JWT_AUDIENCE", f"other,{AUDIENCE}")
    monkeypatch.delenv("SHOAL_JWKS_URL", raising=False)
    get_config.cache_clear()
    app.authorizer.cache_clear()
    yield
    get_config.cache_clear()
    app.authorizer.cache_clear()


@pytest.fixture(scope="module")
def spare_keys() -> tuple[SigningKey, SigningKey]:
    """Two keys the issuer does not publish (RSA keys take a while to make: once a module)."""
    return SigningKey.generate(), SigningKey.generate()


def good_token(issuer: Jwks, **extra: Any) -> str:
    return mint_token(
        issuer.key,
        issuer=issuer.issuer,
        audience=AUDIENCE,
        sub="alice",
        clients=["alice-*"],
        subscribe=["orders/#"],
        extra=extra,
    )


def connect_event(name: str, token: str) -> dict[str, Any]:
    """A sample event from events/, with a token where it holds ``<jwt>``."""
    text = json.dumps(load_event(name)).replace("<jwt>", token)
    return dict(json.loads(text))


def invoke(event: dict[str, Any]) -> dict[str, Any]:
    return dict(app.handler(event, FakeContext()))


def refused(event: dict[str, Any]) -> None:
    with pytest.raises(Exception) as caught:
        invoke(event)
    # exactly the exception API Gateway answers with 401
    assert type(caught.value) is Exception
    assert str(caught.value) == "Unauthorized"


def _b64(data: dict[str, Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b"=").decode()


def _claims(issuer: Jwks, **overrides: Any) -> dict[str, Any]:
    now = int(time.time())
    return {"sub": "alice", "iss": issuer.issuer, "aud": AUDIENCE, "exp": now + 60, **overrides}


# -- accepted --------------------------------------------------------------------------------


@pytest.mark.usefixtures("env")
def test_bearer_token_in_authorization_is_allowed_with_the_claims(issuer: Jwks) -> None:
    # Given a handshake with a good token in Authorization
    token = good_token(issuer)
    event = connect_event("wsauth_connect.json", token)
    # When the authorizer runs
    result = invoke(event)
    # Then it allows exactly this $connect, as alice, with the claims as the HTTP API has them
    assert result["principalId"] == "alice"
    assert result["policyDocument"] == {
        "Version": "2012-10-17",
        "Statement": [
            {"Action": "execute-api:Invoke", "Effect": "Allow", "Resource": event["methodArn"]}
        ],
    }
    http = JwtAuthorizer(
        issuer=issuer.issuer, audiences=[AUDIENCE], jwks=issuer.key.jwks()
    ).authorize(f"Bearer {token}")
    assert result["context"] == http.claims
    assert all(isinstance(v, str) for v in result["context"].values())
    assert Principal.from_claims(result["context"]) == Principal(
        sub="alice", clients=("alice-*",), subscribe=("orders/#",)
    )


@pytest.mark.usefixtures("env")
def test_token_in_sec_websocket_protocol_is_allowed(issuer: Jwks) -> None:
    # Given a browser's handshake: the token offered as the subprotocol bearer.<jwt>
    event = connect_event("wsauth_connect_browser.json", good_token(issuer))
    assert "Authorization" not in event["headers"]
    # When / Then it is allowed as alice
    assert invoke(event)["principalId"] == "alice"


@pytest.mark.usefixtures("env")
def test_headers_are_matched_without_regard_to_case(issuer: Jwks) -> None:
    event = connect_event("wsauth_connect.json", good_token(issuer))
    event["multiValueHeaders"] = None
    event["headers"] = {"authorization": event["headers"].pop("Authorization")}
    assert invoke(event)["principalId"] == "alice"


@pytest.mark.usefixtures("env")
def test_keys_are_fetched_once_per_container(issuer: Jwks) -> None:
    # Given a fresh container
    before = issuer.requests
    # When three handshakes are authorized
    for _ in range(3):
        invoke(connect_event("wsauth_connect.json", good_token(issuer)))
    # Then the JWKS was fetched once
    assert issuer.requests - before == 1


# -- refused: the HTTP authorizer's attack list ------------------------------------------------


@pytest.mark.usefixtures("env")
@pytest.mark.parametrize("alg", ["none", "HS256"])
def test_alg_none_and_hmac_headers_are_refused(issuer: Jwks, alg: str) -> None:
    forged = f"{_b64({'alg': alg, 'typ': 'JWT', 'kid': issuer.key.kid})}.{_b64(_claims(issuer))}."
    refused(connect_event("wsauth_connect.json", forged))


@pytest.mark.usefixtures("env")
def test_hs256_signed_with_the_public_key_is_refused(issuer: Jwks) -> None:
    # the classic confusion: HMAC keyed with the issuer's public key
    forged = jwt.encode(
        _claims(issuer),
        issuer.key.jwk()["n"].encode(),
        algorithm="HS256",
        headers={"kid": issuer.key.kid},
    )
    refused(connect_event("wsauth_connect.json", forged))


@pytest.mark.usefixtures("env")
def test_unknown_kid_is_refused(issuer: Jwks, spare_keys: tuple[SigningKey, SigningKey]) -> None:
    other = spare_keys[0]
    refused(connect_event("wsauth_connect.json", other.sign(_claims(issuer))))


@pytest.mark.usefixtures("env")
def test_another_key_claiming_our_kid_is_refused(
    issuer: Jwks, spare_keys: tuple[SigningKey, SigningKey]
) -> None:
    other = spare_keys[0]
    forged = other.sign(_claims(issuer), headers={"kid": issuer.key.kid})
    refused(connect_event("wsauth_connect.json", forged))


@pytest.mark.usefixtures("env")
def test_tampered_payload_is_refused(issuer: Jwks) -> None:
    header, _, signature = good_token(issuer).split(".")
    payload = _b64(_claims(issuer, sub="mallory", **{"shoal:admin": True}))
    refused(connect_event("wsauth_connect.json", f"{header}.{payload}.{signature}"))


# The times are offsets from the moment the test runs: parameters are made at collection, and
# on CI's slow machine a test ran half an hour after that (a fixed "now + 600" lay in the past).
@pytest.mark.usefixtures("env")
@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({"exp": -1}, id="expired"),
        pytest.param({"nbf": 600}, id="nbf-in-the-future"),
        pytest.param({"iat": 600}, id="iat-in-the-future"),
        pytest.param({"iss": "https://evil.example.com"}, id="wrong-issuer"),
        pytest.param({"aud": "someone-else"}, id="wrong-audience"),
        pytest.param({"sub": None}, id="no-sub"),
    ],
)
def test_bad_claims_are_refused(issuer: Jwks, overrides: dict[str, Any]) -> None:
    now = int(time.time())
    timed = {k: now + v if k in ("exp", "nbf", "iat") else v for k, v in overrides.items()}
    claims = {k: v for k, v in _claims(issuer, **timed).items() if v is not None}
    refused(connect_event("wsauth_connect.json", issuer.key.sign(claims)))


@pytest.mark.usefixtures("env")
@pytest.mark.parametrize("authorization", ["", "Bearer ", "Basic YWxpY2U6c2VjcmV0"])
def test_missing_or_empty_token_is_refused(issuer: Jwks, authorization: str) -> None:
    event = load_event("wsauth_connect.json")
    event["headers"]["Authorization"] = authorization
    event["multiValueHeaders"]["Authorization"] = [authorization]
    refused(event)


@pytest.mark.usefixtures("env")
def test_no_token_at_all_is_refused() -> None:
    event = load_event("wsauth_connect.json")
    del event["headers"]["Authorization"], event["multiValueHeaders"]["Authorization"]
    refused(event)


@pytest.mark.usefixtures("env")
def test_token_only_in_the_query_string_is_refused(issuer: Jwks) -> None:
    # Given a good token, but in the query string (where access logs keep it)
    event = connect_event("wsauth_connect_query_token.json", good_token(issuer))
    assert event["queryStringParameters"]["token"].count(".") == 2
    # Then the handshake is refused all the same
    refused(event)


@pytest.mark.usefixtures("env")
def test_a_bad_authorization_header_is_not_rescued_by_the_subprotocol(issuer: Jwks) -> None:
    # Given a bad Authorization and a good token offered as a subprotocol
    event = connect_event("wsauth_connect_browser.json", good_token(issuer))
    event["headers"]["Authorization"] = "Bearer not.a.jwt"
    event["multiValueHeaders"]["Authorization"] = ["Bearer not.a.jwt"]
    # Then the header decides, as on the HTTP API
    refused(event)


@pytest.mark.usefixtures("env")
def test_two_bearer_subprotocols_are_refused(issuer: Jwks) -> None:
    event = connect_event("wsauth_connect_browser.json", good_token(issuer))
    offered = f"shoal.v1, bearer.{good_token(issuer)}, bearer.{good_token(issuer)}"
    event["headers"]["Sec-WebSocket-Protocol"] = offered
    event["multiValueHeaders"]["Sec-WebSocket-Protocol"] = [offered]
    refused(event)


@pytest.mark.usefixtures("env")
def test_refusals_never_log_the_token(issuer: Jwks, caplog: pytest.LogCaptureFixture) -> None:
    # Given a well-signed token from another issuer
    token = issuer.key.sign(_claims(issuer, iss="https://evil.example.com"))
    # When it is refused
    with caplog.at_level(logging.DEBUG):
        refused(connect_event("wsauth_connect.json", token))
    # Then the log says why, and never quotes the token (nor its signature), in any field
    [record] = [r for r in caplog.records if r.getMessage() == "handshake refused"]
    assert record.__dict__["reason"] == "the token was issued by another issuer"
    logged = " ".join(str(r.__dict__) for r in caplog.records)
    assert token not in logged and token.split(".")[2] not in logged


# -- the issuer's keys: fetched, cached, refetched ----------------------------------------------


class Fetches:
    def __init__(self, *documents: dict[str, Any] | Exception) -> None:
        self.documents = list(documents)
        self.urls: list[str] = []

    def __call__(self, url: str, timeout_s: float) -> dict[str, Any]:
        assert timeout_s > 0
        self.urls.append(url)
        document = self.documents[min(len(self.urls), len(self.documents)) - 1]
        if isinstance(document, Exception):
            raise document
        return document


def test_unknown_kid_refetches_at_most_once_a_minute(
    spare_keys: tuple[SigningKey, SigningKey],
) -> None:
    # Given a cached key set whose issuer rotates to a new key
    old, new = spare_keys
    fetches = Fetches(old.jwks(), {"keys": [old.jwk(), new.jwk()]})
    clock = ManualClock(start_ms=1_800_000_000_000)
    keys = CachedKeySet("https://issuer.example.com/jwks", fetch=fetches, clock=clock)
    assert keys.key(old.kid) is not None
    # When a token names the new kid within the minute
    clock.advance(30)
    assert keys.key(new.kid) is None
    assert keys.key("made-up") is None
    assert len(fetches.urls) == 1
    # Then once a minute has passed since the last fetch, an unknown kid refetches
    clock.advance(REFETCH_INTERVAL_S - 30)
    assert keys.key(new.kid) is not None
    assert keys.key(old.kid) is not None
    assert len(fetches.urls) == 2


def test_a_failed_fetch_refuses_and_is_retried_later(
    spare_keys: tuple[SigningKey, SigningKey],
) -> None:
    key = spare_keys[0]
    fetches = Fetches(OSError("connection refused"), key.jwks())
    clock = ManualClock(start_ms=1_800_000_000_000)
    keys = CachedKeySet("https://issuer.example.com/jwks", fetch=fetches, clock=clock)
    with pytest.raises(AuthorizationFailed, match="could not be fetched"):
        keys.key(key.kid)
    # not again at once: a down issuer is not hammered once per handshake
    assert keys.key(key.kid) is None
    clock.advance(5)
    assert keys.key(key.kid) is not None
    assert len(fetches.urls) == 2


def test_jwks_url_defaults_to_the_issuers_well_known() -> None:
    config = Config(jwt_issuer="https://issuer.example.com/", jwt_audiences=("shoal",))
    assert jwks_url(config) == "https://issuer.example.com/.well-known/jwks.json"
    custom = config.model_copy(update={"jwks_url": "https://keys.example.com/k.json"})
    assert jwks_url(custom) == "https://keys.example.com/k.json"


@pytest.mark.parametrize(
    "url",
    ["http://issuer.example.com/jwks", "file:///etc/passwd", "ftp://127.0.0.1/jwks", "https://"],
)
def test_keys_come_over_https_or_from_loopback_only(url: str) -> None:
    with pytest.raises(ValueError, match="https"):
        check_jwks_url(url)


def test_loopback_http_is_allowed_for_shoal_dev() -> None:
    assert check_jwks_url("http://127.0.0.1:8080/.well-known/jwks.json")
    assert check_jwks_url("http://localhost:8080/.well-known/jwks.json")


def test_the_authorizer_needs_issuer_and_audience() -> None:
    with pytest.raises(ValueError, match="SHOAL_JWT_ISSUER"):
        WebSocketAuthorizer.from_config(Config())


def test_the_query_string_is_never_read() -> None:
    event = load_event("wsauth_connect_query_token.json")
    with pytest.raises(AuthorizationFailed, match="no token"):
        handshake_token(event)
