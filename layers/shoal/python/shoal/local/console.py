"""The console under ``shoal dev``: its files at ``/console/``, and a token minted for it.

Served by the HTTP gateway's port, so the page and the HTTP API share one origin (no CORS), as
deployed, where the health function serves the same files (``shoal.console.serve``); a path
under ``/console/`` that is not one of them goes on to the routes and gets the API's 404;
the WebSocket API is on its own port, which a browser reaches without CORS too (the page
offers its token as the ``bearer.<jwt>`` subprotocol, as ``docs/asyncapi.yaml`` says).

``POST /_shoal/token`` mints what ``shoal token`` mints, for the page's "mint a local token"
button. It is not API Gateway's and a deployed stack has nothing like it. Anyone who may ask
it is as powerful as an admin, so it answers only a request that is plainly the console's own:
from a loopback address, to a loopback host name (a DNS-rebound name is refused), with a JSON
body (a cross-site form cannot send one without a CORS preflight, which nothing here answers)
and, when the browser names an origin, this server's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from shoal.console import MAX_CONNECTION_S, serve
from shoal.local.gateway import LOOPBACK, HttpRequest, HttpResponse

TOKEN_PATH = "/_shoal/token"  # noqa: S105 - a URL path, not a secret
#: the host names a loopback server is reached by; any other Host is a rebound name
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "[::1]"})
MAX_TTL_S = 24 * 3600
DEFAULT_TTL_S = 3600
#: the Overview's refresh under ``shoal dev``: its metrics are put every two seconds
#: (``shoal.local.metrics``) and a query costs nothing here
OVERVIEW_REFRESH_S = 5.0

Mint = Callable[..., str]


def _error(status: int, code: str, message: str) -> HttpResponse:
    return HttpResponse.json(status, {"error": {"code": code, "message": message}})


def _host_name(host: str) -> str:
    if host.startswith("["):
        return host.split("]", 1)[0] + "]"
    return host.rsplit(":", 1)[0] if ":" in host else host


def _filters(body: dict[str, Any], name: str) -> list[str]:
    value = body.get(name, [])
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"{name} must be a list of non-empty strings")
    return list(value)


class DevConsole:
    """What the gateway asks before its routes: a console file, the mint, or None."""

    def __init__(
        self, *, ws_url: str, mint: Mint, max_connection_s: float = MAX_CONNECTION_S
    ) -> None:
        self.ws_url = ws_url
        self.mint = mint
        #: the WebSocket server's whole-connection lifetime (a test may shorten it)
        self.max_connection_s = max_connection_s

    def handle(self, request: HttpRequest) -> HttpResponse | None:
        if request.raw_path == TOKEN_PATH:
            return self._mint(request)
        served = serve(
            request.method,
            request.raw_path,
            ws_url=self.ws_url,
            local_mint=True,
            max_connection_s=self.max_connection_s,
            overview_refresh_s=OVERVIEW_REFRESH_S,
        )
        if served is None:
            return None
        return HttpResponse(served.status, served.headers, served.body)

    def _mint(self, request: HttpRequest) -> HttpResponse:
        if request.method.upper() != "POST":
            return HttpResponse.json(405, {"message": "Method Not Allowed"}, [("Allow", "POST")])
        if request.source_ip not in LOOPBACK:
            return _error(403, "forbidden", "local tokens are minted for loopback clients only")
        host = _host_name(request.header("host") or "")
        if host not in LOOPBACK_HOSTS:
            return _error(403, "forbidden", "local tokens are minted for a loopback host only")
        origin = request.header("origin")
        if origin is not None and _host_name(urlsplit(origin).netloc) not in LOOPBACK_HOSTS:
            return _error(403, "forbidden", "local tokens are minted for the console only")
        media = (request.header("content-type") or "").split(";", 1)[0].strip().lower()
        if media != "application/json":
            return _error(415, "unsupported_media_type", "the body must be application/json")
        try:
            body = json.loads(request.body or b"{}")
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
            sub = body.get("sub")
            if not isinstance(sub, str) or not sub.strip():
                raise ValueError("sub must be a non-empty string")
            ttl_s = body.get("ttl_s", DEFAULT_TTL_S)
            if not isinstance(ttl_s, int) or isinstance(ttl_s, bool) or not 0 < ttl_s <= MAX_TTL_S:
                raise ValueError(f"ttl_s must be a whole number of seconds, 1 to {MAX_TTL_S}")
            admin = body.get("admin", False)
            if not isinstance(admin, bool):
                raise ValueError("admin must be true or false")
            clients = _filters(body, "clients") if "clients" in body else None
            publish = _filters(body, "publish")
            subscribe = _filters(body, "subscribe")
        except ValueError as exc:
            return _error(400, "invalid_request", str(exc))
        token = self.mint(
            sub.strip(),
            admin=admin,
            clients=clients,
            publish=publish,
            subscribe=subscribe,
            ttl_s=ttl_s,
        )
        return HttpResponse.json(
            201, {"token": token, "ttl_s": ttl_s}, [("Cache-Control", "no-store")]
        )
