"""The HTTP front door of ``shoal dev``: API Gateway's HTTP API, emulated.

A request is matched to a declared route the way an HTTP API selects one (an exact route and
method first, literal segments before ``{param}``, then greedy ``{param+}`` routes by longest
prefix, then ``$default``; a route with an explicit method before ``ANY``), checked by the JWT
authorizer when the route is authorized, turned into a payload format 2.0 event and handed to
the route's function; the function's answer is turned back into HTTP by the 2.0 rules.

Where API Gateway answers by itself the bodies are its own (``{"message": ...}``), the 401 of
the JWT authorizer included (its reason in ``www-authenticate``). The HTTP server in front
answers every request, however broken, with JSON: a framing error 400, a body over API
Gateway's limit 413 (read and discarded, so the client sees the answer), a header over the
line limit 431, a stalled body 408, a method no HTTP API route can have 405.
"""

from __future__ import annotations

import base64
import datetime as dt
import functools
import json
import logging
import secrets
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol
from urllib.parse import parse_qsl, unquote

from shoal.declarations import DEFAULT_ROUTE, FunctionDef, Route
from shoal.local.authorizer import (
    UNAUTHORIZED_BODY,
    AuthorizationFailed,
    Authorized,
    JwtAuthorizer,
    unauthorized_header,
)
from shoal.local.context import NotInvoked
from shoal.local.provision import ACCOUNT_ID
from shoal.local.throttle import POST_THROTTLED_BODY, POST_THROTTLED_HEADERS, Throttles
from shoal.local.transport import Answer, InProcessEndpoint, peer_closed

log = logging.getLogger("shoal-dev.gateway")

#: API Gateway refuses larger request bodies
MAX_REQUEST_BYTES = 10 * 1024 * 1024
#: Lambda refuses a synchronous invocation whose event is larger
MAX_INVOKE_PAYLOAD_BYTES = 6 * 1024 * 1024
#: an oversized body up to this size is read and discarded, so its 413 reaches the client on a
#: connection that stays usable; a larger one is answered at once and the connection closed
MAX_DISCARD_BYTES = 64 * 1024 * 1024
#: a connection idle this long between requests, or a body stalled this long, is given up
IDLE_TIMEOUT_S = 60
#: connections the kernel queues before the server accepts them: a burst of clients must
#: queue, not be reset (``socketserver``'s default of 5 reset 147 of 128 x 3 requests)
LISTEN_BACKLOG = 1024
#: the methods an HTTP API route can have; any other is 405
METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS")
API_ID = "local"
#: the WebSocket API's management API (``shoal.local.websocket``), served here as the functions'
#: ``apigatewaymanagementapi`` client calls it: ``{endpoint}/@connections/{connectionId}``
CONNECTIONS_PATH = "/@connections/"
JWKS_PATH = "/.well-known/jwks.json"
DISCOVERY_PATH = "/.well-known/openid-configuration"
#: ``shoal dev``'s own counters, for tests: invocations so far by function (an idle WebSocket
#: connection must run none). Not API Gateway's; answered to loopback clients only.
INVOCATIONS_PATH = "/_shoal/invocations"
LOOPBACK = frozenset({"127.0.0.1", "::1", "::ffff:127.0.0.1"})

#: request bodies API Gateway passes as text; every other content type arrives base64-encoded
_TEXT_TYPES = frozenset(
    {
        "application/json",
        "application/xml",
        "application/javascript",
        "application/graphql",
    }
)


def is_text_content_type(content_type: str | None) -> bool:
    if not content_type:
        return False
    media = content_type.split(";", 1)[0].strip().lower()
    return (
        media.startswith("text/")
        or media in _TEXT_TYPES
        or media.endswith("+json")
        or media.endswith("+xml")
    )


def frames(exc: BaseException) -> str:
    """Where an exception was raised, without its message (which may quote a payload)."""
    return "".join(traceback.format_tb(exc.__traceback__)).rstrip()


# --- route selection -------------------------------------------------------------------------


@dataclass(frozen=True)
class RouteMatch:
    route: Route
    function: FunctionDef
    path_parameters: dict[str, str]


@dataclass(frozen=True)
class _Template:
    route: Route
    function: FunctionDef
    segments: tuple[str, ...]
    greedy: str | None  # name of the trailing {name+}, if any

    @classmethod
    def parse(cls, route: Route, function: FunctionDef) -> _Template:
        segments = tuple(route.path.strip("/").split("/")) if route.path != "/" else ()
        greedy = None
        if segments and segments[-1].startswith("{") and segments[-1].endswith("+}"):
            greedy = segments[-1][1:-2]
            segments = segments[:-1]
        return cls(route, function, segments, greedy)

    def match(self, parts: tuple[str, ...]) -> dict[str, str] | None:
        if self.greedy is None and len(parts) != len(self.segments):
            return None
        if self.greedy is not None and len(parts) <= len(self.segments):
            return None
        params: dict[str, str] = {}
        for template, part in zip(self.segments, parts, strict=False):
            if template.startswith("{") and template.endswith("}"):
                if not part:
                    return None
                params[template[1:-1]] = unquote(part)
            elif template != part:
                return None
        if self.greedy is not None:
            params[self.greedy] = unquote("/".join(parts[len(self.segments) :]))
        return params

    def rank(self) -> tuple[int, ...]:
        """Bigger is more specific: literal segments before variables, left to right."""
        literals = tuple(0 if s.startswith("{") else 1 for s in self.segments)
        return (len(self.segments), *literals)


class RouteTable:
    def __init__(self, routes: Iterable[tuple[Route, FunctionDef]]) -> None:
        self._exact: list[_Template] = []
        self._greedy: list[_Template] = []
        self._default: RouteMatch | None = None
        for route, function in routes:
            if route.path == DEFAULT_ROUTE:
                self._default = RouteMatch(route, function, {})
                continue
            template = _Template.parse(route, function)
            (self._greedy if template.greedy else self._exact).append(template)

    def match(self, method: str, raw_path: str) -> RouteMatch | None:
        # a trailing slash is an empty last segment: /v1/topics/ is not /v1/topics
        parts = tuple(raw_path[1:].split("/")) if raw_path not in ("", "/") else ()
        method = method.upper()
        for group in (self._exact, self._greedy):
            best: tuple[tuple[int, ...], int, _Template, dict[str, str]] | None = None
            for template in group:
                if template.route.method not in (method, "ANY"):
                    continue
                params = template.match(parts)
                if params is None:
                    continue
                key = (template.rank(), 1 if template.route.method == method else 0)
                if best is None or key > best[:2]:
                    best = (*key, template, params)
            if best is not None:
                _, _, template, params = best
                return RouteMatch(template.route, template.function, params)
        return self._default


# --- events and responses --------------------------------------------------------------------


@dataclass
class HttpRequest:
    method: str
    raw_path: str
    raw_query: str = ""
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""
    source_ip: str = "127.0.0.1"
    protocol: str = "HTTP/1.1"
    #: whether the client has closed its connection (None: not known, in process)
    gone: Callable[[], bool] | None = field(default=None, compare=False, repr=False)

    def header(self, name: str) -> str | None:
        values = [v for k, v in self.headers if k.lower() == name.lower()]
        return ",".join(values) if values else None


@dataclass
class HttpResponse:
    status: int
    headers: list[tuple[str, str]]
    body: bytes

    @classmethod
    def json(cls, status: int, body: Any, headers: Iterable[tuple[str, str]] = ()) -> HttpResponse:
        # compact, as API Gateway writes its own answers ({"message":"Unauthorized"})
        data = json.dumps(body, separators=(",", ":")).encode()
        return cls(status, [("Content-Type", "application/json"), *headers], data)


def _request_id() -> str:
    # API Gateway request ids are 10 random bytes, base64 (e.g. "JKJaXmPLvHcESHA=")
    return base64.b64encode(secrets.token_bytes(10)).decode()


def build_event(
    request: HttpRequest,
    match: RouteMatch,
    *,
    authorized: Authorized | None = None,
    request_id: str | None = None,
    now_ms: int | None = None,
) -> dict[str, Any]:
    """The payload format 2.0 event API Gateway sends the route's function."""
    now_ms = time.time_ns() // 1_000_000 if now_ms is None else now_ms
    request_id = request_id or _request_id()
    headers: dict[str, str] = {}
    cookies: list[str] = []
    for name, value in request.headers:
        lower = name.lower()
        if lower == "cookie":
            cookies.extend(c.strip() for c in value.split(";") if c.strip())
            continue
        headers[lower] = f"{headers[lower]},{value}" if lower in headers else value
    forwarded = headers.get("x-forwarded-for")
    headers["x-forwarded-for"] = (
        f"{forwarded}, {request.source_ip}" if forwarded else request.source_ip
    )
    headers.setdefault("x-forwarded-proto", "http")
    host = headers.get("host", "localhost")
    domain = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    route_key = match.route.key
    at = dt.datetime.fromtimestamp(now_ms / 1000, tz=dt.UTC)
    event: dict[str, Any] = {
        "version": "2.0",
        "routeKey": route_key,
        "rawPath": request.raw_path,
        "rawQueryString": request.raw_query,
        "headers": headers,
    }
    if cookies:
        event["cookies"] = cookies
    query: dict[str, str] = {}
    for name, value in parse_qsl(request.raw_query, keep_blank_values=True):
        query[name] = f"{query[name]},{value}" if name in query else value
    if query:
        event["queryStringParameters"] = query
    if match.path_parameters:
        event["pathParameters"] = dict(match.path_parameters)
    context: dict[str, Any] = {
        "accountId": ACCOUNT_ID,
        "apiId": API_ID,
        "domainName": domain,
        "domainPrefix": domain.split(".", 1)[0],
        "http": {
            "method": request.method.upper(),
            "path": request.raw_path,
            "protocol": request.protocol,
            "sourceIp": request.source_ip,
            "userAgent": headers.get("user-agent", ""),
        },
        "requestId": request_id,
        "routeKey": route_key,
        "stage": "$default",
        "time": at.strftime("%d/%b/%Y:%H:%M:%S +0000"),
        "timeEpoch": now_ms,
    }
    if authorized is not None:
        context["authorizer"] = authorized.context()
    event["requestContext"] = context
    if request.body:
        if is_text_content_type(headers.get("content-type")):
            try:
                event["body"] = request.body.decode("utf-8")
                event["isBase64Encoded"] = False
            except UnicodeDecodeError:
                event["body"] = base64.b64encode(request.body).decode()
                event["isBase64Encoded"] = True
        else:
            event["body"] = base64.b64encode(request.body).decode()
            event["isBase64Encoded"] = True
    else:
        event["isBase64Encoded"] = False
    return event


def internal_server_error() -> HttpResponse:
    return HttpResponse.json(500, {"message": "Internal Server Error"})


def to_http_response(result: Any) -> HttpResponse:
    """A function's answer as API Gateway returns it under payload format 2.0."""
    if not (isinstance(result, dict) and "statusCode" in result):
        # no statusCode: API Gateway assumes 200 and sends the whole answer as JSON
        return HttpResponse.json(200, result)
    try:
        status = int(result["statusCode"])
    except (TypeError, ValueError):
        return internal_server_error()
    headers = [(str(k), str(v)) for k, v in (result.get("headers") or {}).items()]
    headers += [("Set-Cookie", str(c)) for c in result.get("cookies") or []]
    body = result.get("body")
    if body is None:
        payload = b""
    elif not isinstance(body, str):
        payload = json.dumps(body).encode()
    elif result.get("isBase64Encoded"):
        try:
            payload = base64.b64decode(body, validate=True)
        except ValueError:
            return internal_server_error()
    else:
        payload = body.encode()
    return HttpResponse(status, headers, payload)


# --- the gateway -----------------------------------------------------------------------------

#: how long API Gateway's HTTP API waits for its integration, at most (its quota); past it the
#: client is answered 503 ``{"message":"Service Unavailable"}``
INTEGRATION_TIMEOUT_S = 30.0
SERVICE_UNAVAILABLE_BODY = {"message": "Service Unavailable"}


class Invoke(Protocol):
    """Runs a function on an event (``shoal.local.runtime.Functions.invoke_def``): waiting for
    a sandbox until ``deadline`` at most, and not at all once ``abandoned`` says the caller
    has gone (``NotInvoked`` then)."""

    def __call__(
        self,
        fn: FunctionDef,
        event: dict[str, Any],
        *,
        deadline: float | None = None,
        abandoned: Callable[[], bool] | None = None,
    ) -> Any: ...


class ConnectionsApi(Protocol):
    """The WebSocket API's ``@connections``: POST (send a frame), GET, DELETE (close)."""

    def manage(self, method: str, connection_id: str, body: bytes) -> HttpResponse: ...


class Answers(Protocol):
    """What the gateway asks before its routes (``shoal dev``'s console): an answer, or None."""

    def handle(self, request: HttpRequest) -> HttpResponse | None: ...


class Gateway:
    """Routes, authorizes and invokes: one HTTP request in, one HTTP response out."""

    def __init__(
        self,
        routes: RouteTable,
        authorizer: JwtAuthorizer,
        invoke: Invoke,
        *,
        jwks: Mapping[str, Any],
        public_url: str = "",
        connections: ConnectionsApi | None = None,
        invocations: Callable[[], Mapping[str, int]] | None = None,
        console: Answers | None = None,
        throttles: Throttles | None = None,
    ) -> None:
        self.connections = connections
        #: ``SHOAL_DEV_THROTTLE``'s share of ``@connections`` POSTs refused as throttled
        self.throttles = throttles
        self.console = console
        self.invocations = invocations
        self.routes = routes
        self.authorizer = authorizer
        self.invoke = invoke
        self.jwks = jwks
        self.public_url = public_url

    def handle(self, request: HttpRequest) -> HttpResponse:
        # the integration's time runs from the request's arrival, as API Gateway's does
        arrived = time.monotonic()
        if request.method.upper() == "GET" and request.raw_path in (JWKS_PATH, DISCOVERY_PATH):
            return self._identity_provider(request.raw_path)
        if (
            self.invocations is not None
            and request.raw_path == INVOCATIONS_PATH
            and request.method.upper() == "GET"
            and request.source_ip in LOOPBACK
        ):
            return HttpResponse.json(200, dict(self.invocations()))
        managed = self.manage_connection(request.method, request.raw_path, request.body)
        if managed is not None:
            return managed
        if self.console is not None and (answer := self.console.handle(request)) is not None:
            return answer
        if len(request.body) > MAX_REQUEST_BYTES:
            return HttpResponse.json(413, {"message": "Request Entity Too Large"})
        match = self.routes.match(request.method, request.raw_path)
        if match is None:
            return HttpResponse.json(404, {"message": "Not Found"})
        authorized = None
        if match.route.authorized:
            try:
                authorized = self.authorizer.authorize(request.header("authorization"))
            except AuthorizationFailed as exc:
                return HttpResponse.json(
                    401, UNAUTHORIZED_BODY, [("www-authenticate", unauthorized_header(exc.reason))]
                )
        request_id = _request_id()
        event = build_event(request, match, authorized=authorized, request_id=request_id)
        if len(json.dumps(event)) > MAX_INVOKE_PAYLOAD_BYTES:
            return HttpResponse.json(413, {"message": "Request Entity Too Large"})
        try:
            result = self.invoke(
                match.function,
                event,
                deadline=arrived + INTEGRATION_TIMEOUT_S,
                abandoned=request.gone,
            )
        except NotInvoked:
            # no sandbox in the integration's time, or the client left while it waited: the
            # function never ran (a client that left reads no answer)
            response = HttpResponse.json(503, SERVICE_UNAVAILABLE_BODY)
        except Exception as exc:
            # the type only: an exception's message may quote the request
            log.error(
                "function %s raised %s\n%s", match.function.name, type(exc).__name__, frames(exc)
            )
            response = internal_server_error()
        else:
            response = to_http_response(result)
        response.headers.append(("apigw-requestid", request_id))
        return response

    def manage_connection(self, method: str, raw_path: str, body: bytes) -> HttpResponse | None:
        """The answer of the WebSocket API's ``@connections`` to a request for ``raw_path``;
        None when the path is not one of its own. Over HTTP and in-process alike
        (``shoal.local.transport.InProcessEndpoint``)."""
        if self.connections is None or not raw_path.startswith(CONNECTIONS_PATH):
            return None
        connection_id = unquote(raw_path[len(CONNECTIONS_PATH) :])
        if not connection_id or "/" in connection_id:
            return HttpResponse.json(404, {"message": "Not Found"})
        throttles = self.throttles
        if method.upper() == "POST" and throttles is not None and throttles.refuse("posts"):
            # refused before the frame is taken, as API Gateway refuses past the account's rate
            return HttpResponse.json(429, POST_THROTTLED_BODY, POST_THROTTLED_HEADERS)
        return self.connections.manage(method, connection_id, body)

    def _identity_provider(self, path: str) -> HttpResponse:
        if path == JWKS_PATH:
            return HttpResponse.json(200, self.jwks)
        return HttpResponse.json(
            200,
            {
                "issuer": self.authorizer.issuer,
                "jwks_uri": f"{self.public_url}{JWKS_PATH}",
                "id_token_signing_alg_values_supported": ["RS256"],
                "response_types_supported": ["token"],
                "subject_types_supported": ["public"],
            },
        )


# --- the HTTP server -------------------------------------------------------------------------


class Handles(Protocol):
    """What the server needs of what is behind it: the ``Gateway``, or a test's stand-in."""

    def handle(self, request: HttpRequest) -> HttpResponse: ...


class _Refused(Exception):
    """A request the server answers itself, before the gateway: framing, size, timeouts."""

    def __init__(self, status: int, message: str, *, close: bool = True) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.close = close


class _ClientGone(Exception):
    """The client closed its side mid-request: there is nobody to answer."""


_HEX = frozenset("0123456789abcdefABCDEF")
#: headers the server writes itself, whatever a function's answer says
_SERVER_HEADERS = frozenset({"content-length", "connection", "transfer-encoding", "date"})
#: a chunk-size line, its extensions included, is at most this long
_MAX_CHUNK_LINE = 4096
_MAX_TRAILERS = 100


def _chunk_size(line: bytes) -> int:
    text = line.split(b";", 1)[0].strip().decode("latin-1")
    if not text or len(text) > 16 or not set(text) <= _HEX:
        raise _Refused(400, "Bad Request: malformed chunk size")
    return int(text, 16)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "shoal-dev"
    sys_version = ""
    #: a request line too broken to name its version is answered as HTTP/1.1, with a status line
    default_request_version = "HTTP/1.1"
    #: socket timeout for every read and write of a connection (idle keep-alive, stalled body)
    timeout = IDLE_TIMEOUT_S
    #: headers and body go out in two writes; with Nagle's algorithm the second waits for the
    #: client's delayed ACK, ~40 ms on every answer of a keep-alive connection
    disable_nagle_algorithm = True
    server: _Server
    #: the request was refused with bytes of it possibly unread: close gracefully
    _unread = False

    def _serve(self) -> None:
        started = time.perf_counter()
        path, _, query = self.path.partition("?")
        try:
            body = self._read_body()
        except _ClientGone:
            self.close_connection = True
            return
        except _Refused as refused:
            if refused.close:
                self.close_connection = self._unread = True
            response = HttpResponse.json(refused.status, {"message": refused.message})
        else:
            request = HttpRequest(
                method=self.command,
                raw_path=path,
                raw_query=query,
                headers=list(self.headers.items()),
                body=body,
                source_ip=self.client_address[0],
                protocol=self.request_version,
                gone=functools.partial(peer_closed, self.connection),
            )
            try:
                response = self.server.gateway.handle(request)
            except Exception as exc:
                log.error("gateway failed: %s\n%s", type(exc).__name__, frames(exc))
                response = internal_server_error()
        self._respond(response)
        # method, path and status only: never the query string, headers or bodies
        ms = round((time.perf_counter() - started) * 1000, 1)
        log.info(
            "%s %s %d %.1fms",
            self.command,
            path,
            response.status,
            ms,
            extra={"method": self.command, "path": path, "status": response.status, "ms": ms},
        )

    def _respond(self, response: HttpResponse) -> None:
        try:
            self.send_response(response.status)  # with Date
            for name, value in response.headers:
                if name.lower() not in (
                    "content-length",
                    "connection",
                    "transfer-encoding",
                    "date",
                ):
                    self.send_header(name, value)
            self.send_header("Content-Length", str(len(response.body)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(response.body)
            self.wfile.flush()
        except OSError as exc:
            # the client left (a long poll it gave up on): nothing to answer, nothing to log
            log.debug("client went away: %s", type(exc).__name__)
            self.close_connection = True
            return
        if self._unread:
            self._linger()

    def _linger(self) -> None:
        """Close gracefully: unread request bytes would make the kernel reset the connection,
        and a reset can destroy the answer before the client has read it."""
        try:
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(1.0)
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline and self.connection.recv(65536):
                pass
        except OSError:
            pass

    def _read_body(self) -> bytes:
        """The request body; ``_Refused`` for what API Gateway would refuse or cannot frame."""
        encoding = self.headers.get_all("Transfer-Encoding") or []
        lengths = self.headers.get_all("Content-Length") or []
        if encoding and lengths:
            # both framings at once is how requests are smuggled (RFC 9112, section 6.3)
            raise _Refused(400, "Bad Request: both Transfer-Encoding and Content-Length")
        try:
            if encoding:
                if ",".join(encoding).strip().lower() != "chunked":
                    raise _Refused(400, "Bad Request: only chunked Transfer-Encoding is accepted")
                return self._read_chunked()
            return self._read_sized(lengths)
        except TimeoutError as exc:
            raise _Refused(408, "Request Timeout") from exc
        except ConnectionError as exc:
            raise _ClientGone from exc

    def _read_sized(self, lengths: list[str]) -> bytes:
        values = {v.strip() for v in lengths}
        if not values:
            return b""
        if len(values) > 1:
            raise _Refused(400, "Bad Request: conflicting Content-Length headers")
        (text,) = values
        if not text.isascii() or not text.isdigit() or len(text) > 18:
            raise _Refused(400, "Bad Request: malformed Content-Length")
        length = int(text)
        if length > MAX_REQUEST_BYTES:
            if length > MAX_DISCARD_BYTES:
                raise _Refused(413, "Request Entity Too Large")
            self._discard(length)
            raise _Refused(413, "Request Entity Too Large", close=False)
        body = self.rfile.read(length) if length else b""
        if len(body) < length:
            raise _ClientGone
        return body

    def _discard(self, length: int) -> None:
        while length > 0:
            got = self.rfile.read(min(length, 1 << 20))
            if not got:
                raise _ClientGone
            length -= len(got)

    def _read_chunked(self) -> bytes:
        chunks: list[bytes] = []
        total = 0
        while True:
            line = self.rfile.readline(_MAX_CHUNK_LINE + 1)
            if not line:
                raise _ClientGone
            if len(line) > _MAX_CHUNK_LINE:
                raise _Refused(400, "Bad Request: chunk size line too long")
            size = _chunk_size(line)
            if size == 0:
                break
            total += size
            if total > MAX_DISCARD_BYTES:
                raise _Refused(413, "Request Entity Too Large")
            if total > MAX_REQUEST_BYTES:
                self._discard(size)
                chunks.clear()
            else:
                chunk = self.rfile.read(size)
                if len(chunk) < size:
                    raise _ClientGone
                chunks.append(chunk)
            if self.rfile.readline(3) not in (b"\r\n", b"\n"):
                raise _Refused(400, "Bad Request: a chunk does not end where its size says")
        for _ in range(_MAX_TRAILERS):
            trailer = self.rfile.readline(65537)
            if trailer in (b"\r\n", b"\n"):
                break
            if not trailer:
                raise _ClientGone
        else:
            raise _Refused(400, "Bad Request: too many trailers")
        if total > MAX_REQUEST_BYTES:
            raise _Refused(413, "Request Entity Too Large", close=False)
        return b"".join(chunks)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = _serve

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own refusals (request line, headers, method) as JSON, not HTML."""
        headers: list[tuple[str, str]] = []
        if code == HTTPStatus.NOT_IMPLEMENTED:
            # no do_<METHOD>: a method no HTTP API route can have
            code = HTTPStatus.METHOD_NOT_ALLOWED
            headers.append(("Allow", ", ".join(METHODS)))
        phrase = HTTPStatus(code).phrase
        self.close_connection = self._unread = True
        self._respond(HttpResponse.json(code, {"message": phrase}, headers))
        log.info("%s %d (refused by the server)", self.command or "-", code)

    def log_message(self, format: str, *args: Any) -> None:
        # http.server's own lines quote the full request line, query string included
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = LISTEN_BACKLOG
    gateway: Handles

    def handle_error(self, request: Any, client_address: Any) -> None:
        """socketserver prints a traceback for whatever a connection's thread raised; a client
        that hangs up (a long poll it gave up on, a Ctrl-C) is routine: one debug line. Anything
        else: one error line with where it was raised, never its message (it may quote a
        request)."""
        exc = sys.exc_info()[1]
        if exc is None:
            return
        if isinstance(exc, OSError):
            log.debug("client went away: %s", type(exc).__name__)
            return
        log.error("connection failed: %s\n%s", type(exc).__name__, frames(exc))


class _Server6(_Server):
    address_family = socket.AF_INET6


class GatewayServer:
    """The gateway on ``host:port`` (port 0: any free port), one thread per connection.

    The port is bound at construction, so its URL (the default issuer) is known before the
    gateway behind it is built; nothing is served before ``start``.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        server_class = _Server6 if ":" in host else _Server
        self._server = server_class((host, port), _Handler)
        self.host = host
        self.port = self._server.server_address[1]
        self._thread: threading.Thread | None = None

    @property
    def gateway(self) -> Handles:
        return self._server.gateway

    @gateway.setter
    def gateway(self, gateway: Handles) -> None:
        self._server.gateway = gateway

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="shoal-gateway", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            # shutdown() waits for serve_forever, so only a started server may be asked
            self._server.shutdown()
            self._thread.join(timeout=10)
            self._thread = None
        self._server.server_close()


def in_process_connections(url: str, gateway: Gateway) -> InProcessEndpoint:
    """``gateway``'s ``@connections`` for this process's SDK calls to ``url`` (the functions'
    pushes under ``shoal dev``), answered without the socket; not installed yet."""

    def respond(method: str, raw_path: str, body: bytes) -> Answer | None:
        answer = gateway.manage_connection(method, raw_path, body)
        return None if answer is None else (answer.status, answer.headers, answer.body)

    return InProcessEndpoint(url, respond)
