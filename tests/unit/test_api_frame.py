"""The error frame: every failure is a coded 4xx/5xx body, never an unhandled exception."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict
from shoal.core.errors import ServerBusy, TopicNotFound
from shoal.http.body import MAX_JSON_DEPTH, parse_body
from shoal.http.caller import principal
from shoal.http.resolver import lambda_handler, make_resolver

from tests.helpers import FakeContext, binary_body, http_event, response_json

app = make_resolver()


class Echo(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    count: int = 1


@app.post("/v1/echo")
def echo() -> dict[str, Any]:
    who = principal(app)
    return {"sub": who.sub, **parse_body(app, Echo).model_dump()}


@app.get("/v1/missing")
def missing() -> dict[str, Any]:
    raise TopicNotFound("no topic named x")


class Tree(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = ""
    tree: Any = None


@app.post("/v1/tree")
def tree() -> dict[str, Any]:
    return {"ok": parse_body(app, Tree).name}


@app.get("/v1/busy")
def busy() -> dict[str, Any]:
    raise ServerBusy("in flight elsewhere", retry_after_s=4)


@app.get("/v1/boom")
def boom() -> dict[str, Any]:
    raise RuntimeError("secret payload text")


handler = lambda_handler(app)
CLAIMS = {"sub": "alice"}


def call(event: dict[str, Any]) -> tuple[int, Any]:
    response = handler(event, FakeContext())
    return response["statusCode"], response_json(response)


def test_valid_body_reaches_the_route() -> None:
    status, body = call(http_event("POST", "/v1/echo", body={"name": "x"}, claims=CLAIMS))
    assert (status, body) == (200, {"sub": "alice", "name": "x", "count": 1})


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        ("{not json", "malformed_json"),
        ("[1, 2]", "invalid_request"),
        ('{"name": "x", "extra": 1}', "invalid_request"),
        ('{"name": 5}', "invalid_request"),
        ('{"count": 2}', "invalid_request"),
        ('{"name": "x", "count": "many"}', "invalid_request"),
    ],
)
def test_bad_bodies_get_coded_400(raw: str, code: str) -> None:
    status, body = call(http_event("POST", "/v1/echo", raw_body=raw, claims=CLAIMS))
    assert status == 400
    assert body["error"]["code"] == code
    assert body["error"]["message"]


def test_schema_errors_name_the_field_but_not_the_value() -> None:
    status, body = call(
        http_event(
            "POST", "/v1/echo", raw_body='{"name": "hunter2-secret", "zz": 1}', claims=CLAIMS
        )
    )
    assert status == 400
    assert [f["field"] for f in body["error"]["fields"]] == ["zz"]
    assert "hunter2-secret" not in str(body)


def test_oversize_body_is_413(monkeypatch: pytest.MonkeyPatch) -> None:
    from shoal.core.config import get_config

    monkeypatch.setenv("SHOAL_MAX_BODY_BYTES", "64")
    get_config.cache_clear()
    try:
        status, body = call(http_event("POST", "/v1/echo", body={"name": "x" * 100}, claims=CLAIMS))
    finally:
        get_config.cache_clear()
    assert (status, body["error"]["code"]) == (413, "body_too_large")


def test_wrong_content_type_is_415() -> None:
    event = http_event(
        "POST", "/v1/echo", raw_body="name=x", claims=CLAIMS, headers={"content-type": "text/plain"}
    )
    status, body = call(event)
    assert (status, body["error"]["code"]) == (415, "unsupported_media_type")


def test_domain_error_maps_to_its_status_and_code() -> None:
    status, body = call(http_event("GET", "/v1/missing", claims=CLAIMS))
    assert (status, body["error"]["code"]) == (404, "topic_not_found")


def test_unknown_route_is_coded_404() -> None:
    status, body = call(http_event("GET", "/v1/nowhere", claims=CLAIMS))
    assert (status, body["error"]["code"]) == (404, "route_not_found")


def test_unexpected_exception_is_coded_500_without_its_message() -> None:
    status, body = call(http_event("GET", "/v1/boom", claims=CLAIMS))
    assert (status, body["error"]["code"]) == (500, "internal_error")
    assert "secret payload" not in str(body)


def test_missing_claims_are_401() -> None:
    status, body = call(http_event("POST", "/v1/echo", body={"name": "x"}, claims=None))
    assert (status, body["error"]["code"]) == (401, "unauthorized")


def nested(depth: int, leaf: str = "1") -> str:
    return "[" * depth + leaf + "]" * depth


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        # Given bodies that are broken below the schema: deep enough to exhaust a parser,
        (nested(10_000), "nests deeper"),
        ('{"tree": ' + '{"a": ' * 5_000 + "1" + "}" * 5_000 + "}", "nests deeper"),
        ('{"tree": ' + nested(MAX_JSON_DEPTH) + "}", "nests deeper"),
        # not JSON although Python's parser takes it,
        ('{"tree": NaN}', "not valid JSON"),
        ('{"tree": -Infinity}', "not valid JSON"),
        ('{"tree": ' + "9" * 5_000 + "}", "not valid JSON"),
        # strings no UTF-8 can carry, in a value, a key, or deep in a list
        ('{"name": "\\ud800"}', "lone surrogate"),
        ('{"tree": {"\\udfff": 1}}', "lone surrogate"),
        ('{"tree": [1, ["a", "x\\uDBFFy"]]}', "lone surrogate"),
    ],
)
def test_bodies_broken_below_the_schema_are_malformed_json(raw: str, problem: str) -> None:
    # When one is sent
    status, body = call(http_event("POST", "/v1/tree", raw_body=raw, claims=CLAIMS))
    # Then it is a coded 400 that says what is wrong, never a 500
    assert (status, body["error"]["code"]) == (400, "malformed_json")
    assert problem in body["error"]["message"]


def test_a_lone_surrogate_is_named_by_its_field() -> None:
    raw = '{"tree": {"will": {"text": "\\ud83d"}}}'
    status, body = call(http_event("POST", "/v1/tree", raw_body=raw, claims=CLAIMS))
    assert (status, body["error"]["field"]) == (400, "tree.will.text")


def test_nesting_up_to_the_limit_and_surrogate_pairs_are_accepted() -> None:
    # Given JSON nested just to the limit, and an escaped pair that is one real code point
    raw = '{"name": "\\ud83d\\ude00", "tree": ' + nested(MAX_JSON_DEPTH - 1) + "}"
    # Then it reaches the route
    status, body = call(http_event("POST", "/v1/tree", raw_body=raw, claims=CLAIMS))
    assert (status, body) == (200, {"ok": "\U0001f600"})


@pytest.mark.parametrize(
    "data", [b'{"name": "\xff\xfe"}', b"\xc0\xaf", b'{"name": "\xed\xa0\x80"}']
)
def test_a_body_that_is_not_utf8_is_malformed_json(data: bytes) -> None:
    # Given bytes API Gateway passes base64-encoded because they are not UTF-8 text
    event = binary_body(http_event("POST", "/v1/tree", claims=CLAIMS), data)
    status, body = call(event)
    assert (status, body["error"]["code"]) == (400, "malformed_json")
    assert "UTF-8" in body["error"]["message"]


def test_server_busy_says_when_to_come_back() -> None:
    response = handler(http_event("GET", "/v1/busy", claims=CLAIMS), FakeContext())
    assert response["statusCode"] == 503
    assert response["headers"]["Retry-After"] == "4"
    assert response_json(response)["error"]["retry_after_s"] == 4
