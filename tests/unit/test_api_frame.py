"""The error frame: every failure is a coded 4xx/5xx body, never an unhandled exception."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict
from shoal.api import lambda_handler, make_resolver, parse_body, principal
from shoal.errors import TopicNotFound

from tests.helpers import FakeContext, http_event, response_json

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
    from shoal.config import get_config

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
