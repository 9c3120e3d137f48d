"""``shoal dev``'s console: its files at /console/, and the local token its button mints."""

from __future__ import annotations

import json
from typing import Any

import pytest
from shoal.console import STATIC_NAMES, asset
from shoal.local.console import TOKEN_PATH, DevConsole
from shoal.local.gateway import HttpRequest, HttpResponse

WS_URL = "ws://127.0.0.1:8081"


class Minted:
    """The runtime's ``mint_token`` stand-in: remembers what it was asked."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, sub: str, **claims: Any) -> str:
        self.calls.append((sub, claims))
        return f"token-of-{sub}"


@pytest.fixture
def minted() -> Minted:
    return Minted()


@pytest.fixture
def console(minted: Minted) -> DevConsole:
    return DevConsole(ws_url=WS_URL, mint=minted)


def get(console: DevConsole, path: str, method: str = "GET") -> HttpResponse:
    answer = console.handle(HttpRequest(method, path, headers=[("Host", "127.0.0.1:8080")]))
    assert answer is not None
    return answer


def mint_request(
    body: Any = None,
    *,
    host: str = "127.0.0.1:8080",
    source_ip: str = "127.0.0.1",
    content_type: str = "application/json",
    origin: str | None = "http://127.0.0.1:8080",
) -> HttpRequest:
    headers = [("Host", host), ("Content-Type", content_type)]
    if origin is not None:
        headers.append(("Origin", origin))
    data = json.dumps({"sub": "console"} if body is None else body).encode()
    return HttpRequest("POST", TOKEN_PATH, headers=headers, body=data, source_ip=source_ip)


def header(response: HttpResponse, name: str) -> str | None:
    return next((v for k, v in response.headers if k.lower() == name.lower()), None)


def test_the_page_is_served_at_the_prefix_with_a_strict_policy(console: DevConsole) -> None:
    # Given the console, When the browser asks for /console/
    page = get(console, "/console/")
    # Then it gets the page, which may load nothing but the console's files and its two APIs
    assert page.status == 200
    assert header(page, "Content-Type") == "text/html; charset=utf-8"
    assert b"console.js" in page.body
    policy = header(page, "Content-Security-Policy") or ""
    assert "script-src 'self';" in policy
    assert f"connect-src 'self' {WS_URL};" in policy
    assert "frame-ancestors 'none'" in policy


def test_the_bare_prefix_redirects_so_relative_links_resolve(console: DevConsole) -> None:
    answer = get(console, "/console")
    assert (answer.status, header(answer, "Location")) == (308, "/console/")


def test_every_file_the_page_loads_is_served(console: DevConsole) -> None:
    assert {"index.html", "console.js", "console.css"} <= STATIC_NAMES
    for name, media in (("console.js", "text/javascript"), ("console.css", "text/css")):
        answer = get(console, f"/console/{name}")
        assert answer.status == 200
        assert (header(answer, "Content-Type") or "").startswith(media)


def test_config_names_the_websocket_api_and_the_mint(console: DevConsole) -> None:
    answer = get(console, "/console/config.json")
    assert answer.status == 200
    assert json.loads(answer.body) == {
        "ws_url": WS_URL,
        "api_url": "",
        "local_mint": True,
        "max_connection_s": 7200.0,
        "overview_refresh_s": 5.0,
    }


@pytest.mark.parametrize(
    "path",
    [
        "/console/../../etc/passwd",
        "/console/..%2F__init__.py",
        "/console/%2e%2e/__init__.py",
        "/console/static/index.html",
        "/console/nothing.js",
    ],
)
def test_nothing_but_the_console_files_is_read(console: DevConsole, path: str) -> None:
    # Then the request goes on to the routes, where $default answers the API's coded 404
    request = HttpRequest("GET", path, headers=[("Host", "127.0.0.1:8080")])
    assert console.handle(request) is None


def test_asset_knows_only_its_own_names() -> None:
    assert asset("../__init__.py") is None
    assert asset("") == asset("index.html")


def test_the_console_answers_only_reads(console: DevConsole) -> None:
    request = HttpRequest("POST", "/console/", headers=[("Host", "127.0.0.1:8080")])
    assert console.handle(request) is None


def test_other_paths_go_on_to_the_routes(console: DevConsole) -> None:
    request = HttpRequest("GET", "/v1/topics", headers=[("Host", "127.0.0.1:8080")])
    assert console.handle(request) is None


def test_mint_signs_what_the_button_asks(console: DevConsole, minted: Minted) -> None:
    # Given a request from the console's page on loopback
    body = {
        "sub": "console",
        "admin": True,
        "clients": ["console*"],
        "publish": ["#"],
        "subscribe": ["#"],
    }
    # When it asks for a token
    answer = console.handle(mint_request(body))
    # Then it gets one with the claims asked for, valid an hour, never cached
    assert answer is not None and answer.status == 201
    assert json.loads(answer.body) == {"token": "token-of-console", "ttl_s": 3600}
    assert header(answer, "Cache-Control") == "no-store"
    assert minted.calls == [
        (
            "console",
            {
                "admin": True,
                "clients": ["console*"],
                "publish": ["#"],
                "subscribe": ["#"],
                "ttl_s": 3600,
            },
        )
    ]


@pytest.mark.parametrize(
    ("request_", "status"),
    [
        # another machine
        (mint_request(source_ip="10.0.0.7"), 403),
        # a DNS-rebound name resolving to 127.0.0.1: a foreign site would be same-origin
        (mint_request(host="evil.example:8080", origin="http://evil.example:8080"), 403),
        # a foreign page's fetch (its Origin), even to the loopback host
        (mint_request(origin="https://evil.example"), 403),
        # a cross-site form can send text/plain without a preflight: not accepted
        (mint_request(content_type="text/plain"), 415),
    ],
)
def test_mint_answers_only_the_console_on_loopback(
    console: DevConsole, minted: Minted, request_: HttpRequest, status: int
) -> None:
    answer = console.handle(request_)
    assert answer is not None
    assert answer.status == status
    assert minted.calls == []


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"sub": ""},
        {"sub": "x", "admin": "yes"},
        {"sub": "x", "ttl_s": 0},
        {"sub": "x", "ttl_s": 10 * 24 * 3600},
        {"sub": "x", "publish": "#"},
        {"sub": "x", "clients": [""]},
        ["sub"],
    ],
)
def test_mint_refuses_a_bad_body_with_the_api_error_shape(
    console: DevConsole, minted: Minted, body: Any
) -> None:
    answer = console.handle(mint_request(body))
    assert answer is not None and answer.status == 400
    assert json.loads(answer.body)["error"]["code"] == "invalid_request"
    assert minted.calls == []


def test_mint_answers_only_post(console: DevConsole) -> None:
    assert get(console, TOKEN_PATH).status == 405
