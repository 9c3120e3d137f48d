"""Claims become a principal once; API Gateway's stringified claims parse like real JSON ones."""

from __future__ import annotations

import pytest
from shoal.core.auth import Principal
from shoal.core.errors import Forbidden, Unauthorized

from tests.helpers import load_event


def test_claims_as_api_gateway_renders_them() -> None:
    claims = load_event("http_api_request.json")["requestContext"]["authorizer"]["jwt"]["claims"]
    p = Principal.from_claims(claims)
    assert p.sub == "alice"
    assert p.clients == ("alice-*", "sensor-1")
    assert p.publish == ("orders/#", "sensors/+/temp")
    assert p.subscribe == ("orders/#",)
    assert p.admin is False


def test_claims_as_json_values() -> None:
    p = Principal.from_claims(
        {"sub": "ops", "shoal:admin": True, "shoal:publish": ["a/b", "c/#"], "shoal:clients": []}
    )
    assert (p.admin, p.publish, p.clients) == (True, ("a/b", "c/#"), ())


def test_json_array_rendered_as_string_is_read_as_json() -> None:
    p = Principal.from_claims({"sub": "x", "shoal:subscribe": '["a b/c", "d"]'})
    assert p.subscribe == ("a b/c", "d")


def test_defaults_connect_as_sub_only_and_grant_nothing() -> None:
    p = Principal.from_claims({"sub": "bob"})
    assert p.clients == ("bob",)
    assert (p.publish, p.subscribe, p.admin) == ((), (), False)
    assert p.may_connect_as("bob")
    assert not p.may_connect_as("bob2")


@pytest.mark.parametrize(
    ("pattern", "client", "allowed"),
    [
        ("alice-*", "alice-1", True),
        ("alice-*", "alice-", True),
        ("alice-*", "alic", False),
        ("alice", "alice-1", False),
        ("*", "anyone", True),
        ("a*b", "a*b", True),
        ("a*b", "axb", False),
    ],
)
def test_client_patterns_wildcard_only_at_end(pattern: str, client: str, allowed: bool) -> None:
    p = Principal.from_claims({"sub": "s", "shoal:clients": [pattern]})
    assert p.may_connect_as(client) is allowed


def test_require_admin_and_client() -> None:
    p = Principal.from_claims({"sub": "s", "shoal:admin": "false"})
    with pytest.raises(Forbidden):
        p.require_admin()
    with pytest.raises(Forbidden):
        p.require_client("other")
    p.require_client("s")


@pytest.mark.parametrize("claims", [None, {}, {"sub": ""}, {"iss": "x"}])
def test_no_subject_is_unauthorized(claims: dict[str, str] | None) -> None:
    with pytest.raises(Unauthorized):
        Principal.from_claims(claims)
