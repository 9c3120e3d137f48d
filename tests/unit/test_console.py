"""The console deployed: the health function, which API Gateway's ``$default`` route reaches with
every path no other route has, serves the console's files on the HTTP API's own origin."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from shoal.console import serve, websocket_url
from shoal.core.config import get_config
from shoal.declarations import DEFAULT_ROUTE

from functions.health.app import handler as health
from tests.helpers import FakeContext, http_event

#: what the stack gives every function: the WebSocket stage's @connections endpoint
CONNECTIONS = "https://abc123.execute-api.eu-west-1.amazonaws.com/v1"


@pytest.fixture(autouse=True)
def deployed(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("SHOAL_CONNECTIONS_ENDPOINT", CONNECTIONS)
    get_config.cache_clear()
    yield
    get_config.cache_clear()


def get(path: str, method: str = "GET") -> dict[str, Any]:
    answer: dict[str, Any] = health(
        http_event(method, path, route_key=DEFAULT_ROUTE), FakeContext()
    )
    return answer


def test_the_page_is_served_with_its_policy() -> None:
    answer = get("/console/")
    assert answer["statusCode"] == 200
    assert answer["headers"]["Content-Type"] == "text/html; charset=utf-8"
    assert "console.js" in answer["body"]
    policy = answer["headers"]["Content-Security-Policy"]
    assert "connect-src 'self' wss://abc123.execute-api.eu-west-1.amazonaws.com/v1;" in policy


def test_config_names_the_stacks_websocket_api_and_no_mint() -> None:
    answer = get("/console/config.json")
    assert json.loads(answer["body"]) == {
        "ws_url": "wss://abc123.execute-api.eu-west-1.amazonaws.com/v1",
        "api_url": "",
        "local_mint": False,
        "max_connection_s": 7200.0,
        "overview_refresh_s": 60.0,
    }


def test_the_bare_prefix_redirects_to_the_page() -> None:
    answer = get("/console")
    assert (answer["statusCode"], answer["headers"]["Location"]) == (308, "/console/")


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/console/../app.py"), ("GET", "/console/nothing.js"), ("POST", "/console/")],
)
def test_anything_else_under_the_prefix_is_the_apis_coded_404(method: str, path: str) -> None:
    answer = get(path, method)
    assert answer["statusCode"] == 404
    assert json.loads(answer["body"])["error"]["code"] == "route_not_found"


def test_health_is_still_answered() -> None:
    answer = get("/v1/health")
    assert answer["statusCode"] == 200
    assert json.loads(answer["body"])["status"] == "ok"


@pytest.mark.parametrize(
    ("endpoint", "url"),
    [
        (CONNECTIONS, "wss://abc123.execute-api.eu-west-1.amazonaws.com/v1"),
        ("http://127.0.0.1:8080/", "ws://127.0.0.1:8080"),
        ("", ""),
    ],
)
def test_the_websocket_url_is_the_connections_endpoints_host_and_stage(
    endpoint: str, url: str
) -> None:
    assert websocket_url(endpoint) == url


def test_serve_answers_only_reads_of_its_own_files() -> None:
    assert serve("GET", "/v1/topics", ws_url="") is None
    assert serve("DELETE", "/console/index.html", ws_url="") is None
    head = serve("HEAD", "/console/console.css", ws_url="")
    assert head is not None and head.status == 200
