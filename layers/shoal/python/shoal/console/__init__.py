"""The console: a page in the browser over the HTTP and WebSocket APIs (issue 35).

Static files only (``static/``: HTML, CSS and plain JavaScript, no build step, nothing from
elsewhere). The page asks for ``config.json`` beside it: where the WebSocket API is, and
whether a local token can be minted (``shoal dev`` only). It holds no secret: the token is
pasted (or minted under ``shoal dev``) and kept in the tab's session storage.

``serve`` answers a request for them: ``shoal dev`` asks it before its routes
(``shoal.local.console``), and deployed, the health function, which API Gateway's ``$default``
route reaches with every path no other route has, asks it before its resolver. So the page is
on the HTTP API's own origin in both (no CORS), and any other path under ``/console/`` gets the
API's coded 404.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib.resources import files
from typing import Any

#: the page's URL path under the server that serves it
PREFIX = "/console/"
INDEX = "index.html"
CONFIG = "config.json"
#: API Gateway closes every WebSocket connection at 2 hours (a quota it does not raise)
MAX_CONNECTION_S = 7200.0
#: how often the Overview asks for its figures again while it is shown: deployed, each time is
#: a CloudWatch GetMetricData (billed by the metrics it names) of one-minute data
OVERVIEW_REFRESH_S = 60.0

CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".svg": "image/svg+xml",
    ".json": "application/json",
}


@dataclass(frozen=True)
class Asset:
    content_type: str
    body: bytes


def _static_names() -> frozenset[str]:
    folder = files(__name__) / "static"
    return frozenset(
        entry.name
        for entry in folder.iterdir()
        if entry.is_file() and "." + entry.name.rsplit(".", 1)[-1] in CONTENT_TYPES
    )


#: the files the console is made of: a name not listed here is never read, so no path a
#: request makes up (``..``, a backslash, a URL-encoded slash) reaches the filesystem
STATIC_NAMES = _static_names()


def asset(name: str) -> Asset | None:
    """One of the console's files by name (``""`` is the page itself), or None."""
    name = name or INDEX
    if name not in STATIC_NAMES:
        return None
    body = (files(__name__) / "static" / name).read_bytes()
    return Asset(CONTENT_TYPES["." + name.rsplit(".", 1)[-1]], body)


@dataclass(frozen=True)
class Served:
    status: int
    headers: list[tuple[str, str]]
    body: bytes


def serve(
    method: str,
    path: str,
    *,
    ws_url: str,
    api_url: str = "",
    local_mint: bool = False,
    max_connection_s: float = MAX_CONNECTION_S,
    overview_refresh_s: float = OVERVIEW_REFRESH_S,
) -> Served | None:
    """The answer to ``method path`` when it asks for one of the console's files (or
    ``/console``, redirected to the page), else None."""
    if method.upper() not in ("GET", "HEAD"):
        return None
    if path == PREFIX.rstrip("/"):
        # the page's links are relative: they must resolve under the prefix
        return Served(308, [("Location", PREFIX)], b"")
    if not path.startswith(PREFIX):
        return None
    name = path[len(PREFIX) :]
    if name == CONFIG:
        found: Asset | None = config_asset(
            ws_url=ws_url,
            api_url=api_url,
            local_mint=local_mint,
            max_connection_s=max_connection_s,
            overview_refresh_s=overview_refresh_s,
        )
    else:
        found = asset(name)
    if found is None:
        return None
    headers = [("Content-Type", found.content_type), *security_headers(ws_url, api_url)]
    return Served(200, headers, found.body)


def websocket_url(connections_endpoint: str) -> str:
    """The WebSocket API's URL from its ``@connections`` endpoint, which every function's
    environment names (``https://{api}.execute-api.{region}.amazonaws.com/{stage}``): the
    same host and stage, over ``wss``. Empty without one."""
    for plain, secure in (("https://", "wss://"), ("http://", "ws://")):
        if connections_endpoint.startswith(plain):
            return secure + connections_endpoint[len(plain) :].rstrip("/")
    return ""


def config_asset(
    *,
    ws_url: str,
    api_url: str = "",
    local_mint: bool = False,
    max_connection_s: float = MAX_CONNECTION_S,
    overview_refresh_s: float = OVERVIEW_REFRESH_S,
) -> Asset:
    """``config.json``: what the page cannot know by itself. ``api_url`` empty: the HTTP API is
    the page's own origin. ``max_connection_s``: when the WebSocket API closes a connection,
    which the page's live session renews before (``shoal dev`` may be told a shorter one).
    ``overview_refresh_s``: how often the Overview refreshes while shown."""
    config: dict[str, Any] = {
        "ws_url": ws_url,
        "api_url": api_url,
        "local_mint": local_mint,
        "max_connection_s": max_connection_s,
        "overview_refresh_s": overview_refresh_s,
    }
    return Asset(CONTENT_TYPES[".json"], json.dumps(config).encode())


def security_headers(ws_url: str, api_url: str = "") -> list[tuple[str, str]]:
    """Headers for every console file: nothing is loaded or run but the console's own files,
    the page is never framed (clickjacking), and it talks only to its two APIs."""
    connect = " ".join(["'self'", *(u for u in (ws_url, api_url) if u)])
    return [
        (
            "Content-Security-Policy",
            "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
            f"connect-src {connect}; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
        ),
        ("X-Content-Type-Options", "nosniff"),
        ("Referrer-Policy", "no-referrer"),
        ("Cache-Control", "no-store"),
    ]
