"""The local gateway selects routes, builds events and maps answers as an HTTP API does."""

from __future__ import annotations

import base64
import json
import os
import resource
import socket
import time
from collections.abc import Callable
from typing import Any

import pytest
from shoal.core.clock import ManualClock
from shoal.declarations import DEFAULT_ROUTE, FunctionDef, Route
from shoal.local.authorizer import JwtAuthorizer, SigningKey
from shoal.local.context import NotInvoked
from shoal.local.gateway import (
    INTEGRATION_TIMEOUT_S,
    INVOCATIONS_PATH,
    MAX_REQUEST_BYTES,
    Gateway,
    HttpRequest,
    RouteMatch,
    RouteTable,
    build_event,
    to_http_response,
)
from shoal.local.transport import peer_closed

TOPICS = FunctionDef(
    name="topics",
    routes=(
        Route("GET", "/v1/topics"),
        Route("POST", "/v1/topics"),
        Route("GET", "/v1/topics/{name}"),
        Route("POST", "/v1/topics/{name}/switch-produce"),
        Route("GET", "/v1/topics/default"),
    ),
)
FILES = FunctionDef(
    name="files",
    routes=(
        Route("GET", "/v1/files/{path+}"),
        Route("ANY", "/v1/files/special/{rest+}"),
        Route("ANY", "/{proxy+}", authorized=False),
    ),
)
ITEMS = FunctionDef(
    name="items",
    routes=(Route("ANY", "/v1/items/{id}"), Route("DELETE", "/v1/items/{id}")),
)
FALLBACK = FunctionDef(name="fallback", routes=(Route("ANY", DEFAULT_ROUTE, authorized=False),))
ALL = (TOPICS, FILES, ITEMS, FALLBACK)


def table(*functions: FunctionDef) -> RouteTable:
    return RouteTable([(r, f) for f in functions for r in f.routes])


def matched(method: str, path: str, functions: tuple[FunctionDef, ...] = ALL) -> RouteMatch:
    match = table(*functions).match(method, path)
    assert match is not None
    return match


# --- route selection -------------------------------------------------------------------------


def test_exact_route_and_method() -> None:
    match = matched("GET", "/v1/topics")
    assert (match.route.key, match.path_parameters) == ("GET /v1/topics", {})


def test_path_variable_binds_one_segment() -> None:
    match = matched("GET", "/v1/topics/orders")
    assert (match.route.key, match.path_parameters) == ("GET /v1/topics/{name}", {"name": "orders"})


def test_literal_segment_beats_variable() -> None:
    assert matched("GET", "/v1/topics/default").route.key == "GET /v1/topics/default"


def test_path_variables_are_url_decoded() -> None:
    assert matched("GET", "/v1/topics/a%20b%2Fc").path_parameters == {"name": "a b/c"}


def test_explicit_method_beats_any() -> None:
    assert matched("DELETE", "/v1/items/7").route.key == "DELETE /v1/items/{id}"
    assert matched("PUT", "/v1/items/7").route.key == "ANY /v1/items/{id}"


def test_greedy_variable_takes_the_rest_of_the_path() -> None:
    match = matched("GET", "/v1/files/a/b/c.txt")
    assert (match.route.key, match.path_parameters) == (
        "GET /v1/files/{path+}",
        {"path": "a/b/c.txt"},
    )


def test_longer_greedy_prefix_wins() -> None:
    match = matched("GET", "/v1/files/special/x/y")
    assert (match.route.key, match.path_parameters) == (
        "ANY /v1/files/special/{rest+}",
        {"rest": "x/y"},
    )


def test_greedy_needs_at_least_one_segment() -> None:
    # /v1/files itself is not a child resource of /v1/files/{path+}: the root greedy takes it
    assert matched("GET", "/v1/files").route.key == "ANY /{proxy+}"


def test_non_greedy_match_beats_greedy() -> None:
    # a full match (with variables) comes before any greedy route
    assert matched("POST", "/v1/topics/x/switch-produce").route.key == (
        "POST /v1/topics/{name}/switch-produce"
    )


def test_method_mismatch_falls_through_to_greedy_then_default() -> None:
    # POST /v1/topics/x has no full match: the root greedy route takes it
    assert matched("POST", "/v1/topics/x").route.key == "ANY /{proxy+}"
    # without greedy routes, $default takes it
    match = matched("POST", "/v1/topics/x", (TOPICS, FALLBACK))
    assert (match.route.key, match.function.name) == ("$default", "fallback")


def test_no_route_and_no_default_is_none() -> None:
    assert table(TOPICS).match("GET", "/v2/nothing") is None


def test_trailing_slash_is_an_empty_segment_that_matches_no_variable() -> None:
    assert matched("GET", "/v1/topics/", (TOPICS, FALLBACK)).route.key == "$default"


# --- events ----------------------------------------------------------------------------------


def request(**overrides: Any) -> HttpRequest:
    base: dict[str, Any] = {
        "method": "POST",
        "raw_path": "/v1/topics/orders%2Feu/switch-produce",
        "raw_query": "a=1&b=two%20words&a=3&flag",
        "headers": [
            ("Host", "127.0.0.1:8080"),
            ("User-Agent", "curl/8"),
            ("Content-Type", "application/json"),
            ("X-Multi", "one"),
            ("x-multi", "two"),
            ("Cookie", "c1=v1; c2=v2"),
            ("Authorization", "Bearer abc"),
        ],
        "body": b'{"k": "v"}',
        "source_ip": "127.0.0.1",
    }
    return HttpRequest(**{**base, **overrides})


def event_for(req: HttpRequest, **kwargs: Any) -> dict[str, Any]:
    match = table(TOPICS).match(req.method, req.raw_path)
    assert match is not None
    return build_event(req, match, request_id="rid", now_ms=1_795_239_598_390, **kwargs)


def test_event_carries_the_route_and_raw_request() -> None:
    event = event_for(request())
    assert event["version"] == "2.0"
    assert event["routeKey"] == "POST /v1/topics/{name}/switch-produce"
    assert event["rawPath"] == "/v1/topics/orders%2Feu/switch-produce"
    assert event["rawQueryString"] == "a=1&b=two%20words&a=3&flag"
    assert event["pathParameters"] == {"name": "orders/eu"}
    context = event["requestContext"]
    assert context["routeKey"] == event["routeKey"]
    assert context["http"] == {
        "method": "POST",
        "path": "/v1/topics/orders%2Feu/switch-produce",
        "protocol": "HTTP/1.1",
        "sourceIp": "127.0.0.1",
        "userAgent": "curl/8",
    }
    assert (context["stage"], context["requestId"]) == ("$default", "rid")
    assert (context["time"], context["timeEpoch"]) == ("21/Nov/2026:05:39:58 +0000", 1795239598390)
    assert context["domainName"] == "127.0.0.1"


def test_repeated_headers_and_query_parameters_are_comma_joined() -> None:
    event = event_for(request())
    assert event["headers"]["x-multi"] == "one,two"
    assert event["queryStringParameters"] == {"a": "1,3", "b": "two words", "flag": ""}


def test_header_names_are_lower_cased_and_cookies_split_out() -> None:
    event = event_for(request())
    assert all(name == name.lower() for name in event["headers"])
    assert "cookie" not in event["headers"]
    assert event["cookies"] == ["c1=v1", "c2=v2"]
    assert event["headers"]["x-forwarded-for"] == "127.0.0.1"


def test_absent_parts_are_left_out() -> None:
    event = event_for(request(raw_path="/v1/topics", raw_query="", headers=[], body=b""))
    for absent in ("queryStringParameters", "pathParameters", "cookies", "body"):
        assert absent not in event
    assert event["isBase64Encoded"] is False
    assert "authorizer" not in event["requestContext"]


def test_json_body_is_text() -> None:
    event = event_for(request())
    assert (event["body"], event["isBase64Encoded"]) == ('{"k": "v"}', False)


@pytest.mark.parametrize(
    "content_type",
    ["application/octet-stream", "image/png", "application/x-www-form-urlencoded", None],
)
def test_other_bodies_are_base64(content_type: str | None) -> None:
    headers = [("Content-Type", content_type)] if content_type else []
    event = event_for(request(headers=headers, body=b"\x00\xffdata"))
    assert event["isBase64Encoded"] is True
    assert base64.b64decode(event["body"]) == b"\x00\xffdata"


@pytest.mark.parametrize(
    "content_type", ["text/plain; charset=utf-8", "application/merge-patch+json", "text/csv"]
)
def test_textual_types_are_text(content_type: str) -> None:
    event = event_for(request(headers=[("Content-Type", content_type)], body=b"hi"))
    assert (event["body"], event["isBase64Encoded"]) == ("hi", False)


def test_invalid_utf8_in_a_text_type_goes_base64() -> None:
    event = event_for(request(body=b"\xff\xfe"))
    assert event["isBase64Encoded"] is True


# --- responses -------------------------------------------------------------------------------


def test_full_response_is_passed_through() -> None:
    response = to_http_response(
        {
            "statusCode": 201,
            "headers": {"Content-Type": "application/json", "X-A": "1"},
            "cookies": ["s=1; HttpOnly", "t=2"],
            "body": '{"ok": true}',
        }
    )
    assert response.status == 201
    assert ("X-A", "1") in response.headers
    assert [v for k, v in response.headers if k == "Set-Cookie"] == ["s=1; HttpOnly", "t=2"]
    assert response.body == b'{"ok": true}'


def test_base64_response_body_is_decoded() -> None:
    response = to_http_response(
        {"statusCode": 200, "body": base64.b64encode(b"\x00\x01").decode(), "isBase64Encoded": True}
    )
    assert response.body == b"\x00\x01"


@pytest.mark.parametrize("result", [{"status": "ok"}, ["a", 1], "text", None, 7])
def test_answer_without_status_code_is_200_json(result: Any) -> None:
    response = to_http_response(result)
    assert response.status == 200
    assert ("Content-Type", "application/json") in response.headers
    assert json.loads(response.body) == result


def test_bad_status_code_is_500() -> None:
    assert to_http_response({"statusCode": "teapot"}).status == 500


# --- the gateway -----------------------------------------------------------------------------

ISSUER = "http://127.0.0.1:8080"


class Recorder:
    def __init__(self, result: Any = None, error: Exception | None = None) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.deadlines: list[float | None] = []
        self.abandoned: list[Callable[[], bool] | None] = []
        self.result = result if result is not None else {"statusCode": 204}
        self.error = error

    def __call__(
        self,
        fn: FunctionDef,
        event: dict[str, Any],
        *,
        deadline: float | None = None,
        abandoned: Callable[[], bool] | None = None,
    ) -> Any:
        self.calls.append((fn.name, event))
        self.deadlines.append(deadline)
        self.abandoned.append(abandoned)
        if self.error:
            raise self.error
        return self.result


@pytest.fixture(scope="module")
def key() -> SigningKey:
    return SigningKey.generate()


def gateway(key: SigningKey, invoke: Recorder) -> Gateway:
    clock = ManualClock(start_ms=1_800_000_000_000)
    authorizer = JwtAuthorizer(issuer=ISSUER, audiences=["shoal"], jwks=key.jwks(), clock=clock)
    return Gateway(table(*ALL), authorizer, invoke, jwks=key.jwks(), public_url=ISSUER)


def good_token(key: SigningKey) -> str:
    return key.sign(
        {"sub": "alice", "iss": ISSUER, "aud": "shoal", "exp": 1_800_000_060, "shoal:admin": True}
    )


def call(gw: Gateway, method: str, path: str, **kwargs: Any) -> tuple[int, Any]:
    response = gw.handle(HttpRequest(method=method, raw_path=path, **kwargs))
    return response.status, json.loads(response.body) if response.body else None


def test_authorized_route_without_token_is_api_gateways_401(key: SigningKey) -> None:
    # Given an authorized route
    invoke = Recorder()
    # When it is called without a token
    response = gateway(key, invoke).handle(HttpRequest(method="GET", raw_path="/v1/topics"))
    # Then API Gateway's own answer comes back, byte for byte, with the reason in its header,
    # and no function ran
    assert (response.status, response.body) == (401, b'{"message":"Unauthorized"}')
    header = dict((k.lower(), v) for k, v in response.headers)["www-authenticate"]
    assert 'error="invalid_token"' in header
    assert "no Authorization header" in header
    assert invoke.calls == []


def test_authorized_route_with_token_gets_the_claims(key: SigningKey) -> None:
    invoke = Recorder()
    headers = [("Authorization", f"Bearer {good_token(key)}")]
    status, _ = call(gateway(key, invoke), "GET", "/v1/topics", headers=headers)
    assert status == 204
    ((name, event),) = invoke.calls
    claims = event["requestContext"]["authorizer"]["jwt"]["claims"]
    assert (name, claims["sub"], claims["shoal:admin"]) == ("topics", "alice", "true")


def test_unauthorized_route_needs_no_token(key: SigningKey) -> None:
    invoke = Recorder({"statusCode": 404, "body": "{}"})
    status, _ = call(gateway(key, invoke), "GET", "/nowhere")
    assert status == 404
    assert invoke.calls[0][1]["routeKey"] == "ANY /{proxy+}"


def test_function_that_raises_is_api_gateways_500(key: SigningKey) -> None:
    invoke = Recorder(error=RuntimeError("secret payload"))
    status, body = call(gateway(key, invoke), "GET", "/x/y")
    assert (status, body) == (500, {"message": "Internal Server Error"})


def test_a_request_no_sandbox_took_in_the_integrations_time_is_api_gateways_503(
    key: SigningKey,
) -> None:
    """API Gateway waits for its integration 30 s at most, and answers 503 then; here a request
    may wait for one of a function's few sandboxes, so it waits until that deadline, and the
    function never runs after it (``NotInvoked``)."""
    invoke = Recorder(error=NotInvoked("no sandbox"))
    gone = lambda: False  # noqa: E731 - the client's connection, as the server sees it
    before = time.monotonic()
    response = gateway(key, invoke).handle(HttpRequest(method="GET", raw_path="/x", gone=gone))
    assert (response.status, response.body) == (503, b'{"message":"Service Unavailable"}')
    # the invocation was given the integration's deadline from the request's arrival, and the
    # way to tell that its client has gone
    [deadline] = invoke.deadlines
    assert deadline is not None
    assert before + INTEGRATION_TIMEOUT_S <= deadline <= time.monotonic() + INTEGRATION_TIMEOUT_S
    assert invoke.abandoned == [gone]


def test_body_over_10_mb_is_413_without_invoking(key: SigningKey) -> None:
    invoke = Recorder()
    status, body = call(gateway(key, invoke), "POST", "/x", body=b"x" * (MAX_REQUEST_BYTES + 1))
    assert (status, body) == (413, {"message": "Request Entity Too Large"})
    assert invoke.calls == []


def test_no_route_without_default_is_api_gateways_404(key: SigningKey) -> None:
    clock = ManualClock()
    authorizer = JwtAuthorizer(issuer=ISSUER, audiences=["shoal"], jwks=key.jwks(), clock=clock)
    gw = Gateway(table(TOPICS), authorizer, Recorder(), jwks=key.jwks())
    assert call(gw, "GET", "/v2") == (404, {"message": "Not Found"})


def test_jwks_and_discovery_are_served(key: SigningKey) -> None:
    gw = gateway(key, Recorder())
    assert call(gw, "GET", "/.well-known/jwks.json") == (200, key.jwks())
    status, discovery = call(gw, "GET", "/.well-known/openid-configuration")
    assert status == 200
    assert discovery["issuer"] == ISSUER
    assert discovery["jwks_uri"] == f"{ISSUER}/.well-known/jwks.json"


def test_response_carries_a_request_id(key: SigningKey) -> None:
    response = gateway(key, Recorder()).handle(HttpRequest("GET", "/x"))
    assert any(name == "apigw-requestid" and value for name, value in response.headers)


def test_invocation_counts_are_answered_to_loopback_clients_only(key: SigningKey) -> None:
    clock = ManualClock()
    authorizer = JwtAuthorizer(issuer=ISSUER, audiences=["shoal"], jwks=key.jwks(), clock=clock)
    gw = Gateway(
        table(TOPICS),
        authorizer,
        Recorder(),
        jwks=key.jwks(),
        invocations=lambda: {"edge": 3, "wsauth": 2},
    )
    assert call(gw, "GET", INVOCATIONS_PATH) == (200, {"edge": 3, "wsauth": 2})
    assert call(gw, "GET", INVOCATIONS_PATH, source_ip="::1")[0] == 200
    # from another host it is no route at all
    assert call(gw, "GET", INVOCATIONS_PATH, source_ip="10.0.0.7") == (
        404,
        {"message": "Not Found"},
    )
    # a gateway not given the counts has no such path
    plain = Gateway(table(TOPICS), authorizer, Recorder(), jwks=key.jwks())
    assert call(plain, "GET", INVOCATIONS_PATH) == (404, {"message": "Not Found"})


def test_a_client_that_closed_its_connection_is_seen_gone_and_one_still_there_is_not() -> None:
    server_side, client_side = socket.socketpair()
    _judged_open_then_closed(server_side, client_side)


def test_a_connection_numbered_past_1023_is_judged_as_any_other() -> None:
    """``shoal dev`` holding thousands of WebSocket connections numbers its HTTP sockets past
    select's limit (1,023): those were taken for gone, and every request answered 503."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1100:
        pytest.skip("this machine allows fewer than 1,100 open files")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1100), hard))
    fillers = [os.open(os.devnull, os.O_RDONLY) for _ in range(1030)]
    try:
        server_side, client_side = socket.socketpair()
        assert server_side.fileno() > 1023
        _judged_open_then_closed(server_side, client_side)
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _judged_open_then_closed(server_side: socket.socket, client_side: socket.socket) -> None:
    with server_side, client_side:
        server_side.settimeout(60)  # as the server's connections: no wait in the check
        assert not peer_closed(server_side)
        # a pipelined next request is a client still there
        client_side.sendall(b"GET / HTTP/1.1\r\n")
        assert not peer_closed(server_side)
        assert server_side.recv(64)
        client_side.close()
        assert peer_closed(server_side)
