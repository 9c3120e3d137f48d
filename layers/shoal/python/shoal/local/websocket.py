"""The WebSocket API of ``shoal dev``: API Gateway's WebSocket API, emulated on loopback.

The routes are the deployment's (``Deployment.ws_routes()`` and ``WebSocketDef.mock_routes``),
selected on the frame's ``action`` with ``$default`` as the fallback, exactly as API Gateway's
route selection expression ``$request.body.action`` does. The handshake runs the REQUEST
authorizer function and then ``$connect``; every text frame runs its route's function with the
MESSAGE event; a close, from either side and for any reason, runs ``$disconnect``. The
``@connections`` management API (POST, GET, DELETE ``/@connections/{id}``) is served by the
HTTP gateway (in-process for the functions of this process), which hands each call over to this
server's event loop (``ConnectionsApi``); a POST is answered once its frame is queued there.

API Gateway's quotas are enforced the same way: a binary frame closes with 1003, a frame over
32 KB or a message over 128 KB with 1009, 10 minutes idle or 2 hours connected with 1001.

The server is an asyncio ``websockets`` server in a thread of its own with its own event loop:
an idle connection is a socket and a small object, no thread. Functions block (they are the
in-process Lambda of ``shoal.local.runtime``), so they run in a bounded thread pool, never on
the event loop.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import datetime as dt
import functools
import json
import logging
import os
import resource
import secrets
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.frames import CloseCode
from websockets.http11 import Request, Response

from shoal.declarations import Deployment, FunctionDef, WebSocketDef
from shoal.local.context import REGION
from shoal.local.gateway import HttpResponse, frames
from shoal.local.provision import ACCOUNT_ID
from shoal.local.wsledger import ConnectionLedger, OpenConnection
from shoal.local.wspolicy import PolicyRefused, authorizer_policy
from shoal.local.wsroutes import CONNECT, DISCONNECT, WsRouteTable

log = logging.getLogger("shoal-dev.websocket")

API_ID = "localws"
#: the environment variables that shorten the idle and whole-connection lifetimes (tests)
IDLE_TIMEOUT_ENV = "SHOAL_WS_IDLE_TIMEOUT_S"
MAX_CONNECTION_ENV = "SHOAL_WS_MAX_CONNECTION_S"
#: functions running at once for the WebSocket API (each function also has its own sandbox
#: limit in the runtime): a burst of handshakes queues here instead of starting threads
HANDLER_THREADS = 16
#: functions running at once for ``$disconnect``, apart from the frames': API Gateway invokes it
#: on its own, so a close reaches the service while other connections' frames queue (a will's
#: delay and a takeover both turn on when the service learns of the close)
DISCONNECT_THREADS = 4
#: connections the kernel queues before the server accepts them: a burst of clients connecting
#: at once must queue, not be reset
LISTEN_BACKLOG = 4096
#: how long a management call from the HTTP gateway waits for the event loop
MANAGEMENT_TIMEOUT_S = 10.0
#: stopping: how long the connections' closes and their $disconnect invocations may take
STOP_TIMEOUT_S = 15.0

INTERNAL_ERROR = "Internal server error"
#: API Gateway's close for a connection deleted through @connections: code 1000, and the
#: $disconnect event says "Connection Closed Normally" (API Gateway's execution logs quoted in
#: boto/boto3#3789 and aws/chalice#2060; DeleteConnection takes no code or reason)
DELETED = (CloseCode.NORMAL_CLOSURE, "Connection Closed Normally")
#: idle or connected too long: API Gateway closes with 1001 "Going away"
GOING_AWAY = (CloseCode.GOING_AWAY, "Going away")
#: API Gateway refuses binary frames (close 1003)
BINARY = (CloseCode.UNSUPPORTED_DATA, "Binary frames are not supported")


@dataclass(frozen=True)
class WsLimits:
    """API Gateway's WebSocket quotas, which ``shoal dev`` enforces as deployed."""

    max_frame_bytes: int = 32 * 1024
    max_message_bytes: int = 128 * 1024
    idle_timeout_s: float = 600.0
    max_connection_s: float = 7200.0

    @classmethod
    def of(
        cls,
        websocket: WebSocketDef,
        *,
        idle_timeout_s: float | None = None,
        max_connection_s: float | None = None,
    ) -> WsLimits:
        return cls(
            max_frame_bytes=websocket.max_frame_bytes,
            max_message_bytes=websocket.max_message_bytes,
            idle_timeout_s=float(idle_timeout_s or websocket.idle_timeout_s),
            max_connection_s=float(max_connection_s or websocket.max_connection_s),
        )


def lifetimes_from_environment(env: Mapping[str, str] = os.environ) -> dict[str, float | None]:
    """The idle and whole-connection lifetimes a test may shorten (None: API Gateway's)."""

    def seconds(name: str) -> float | None:
        text = env.get(name, "").strip()
        if not text:
            return None
        value = float(text)
        if value <= 0:
            raise ValueError(f"{name} must be a positive number of seconds")
        return value

    return {
        "idle_timeout_s": seconds(IDLE_TIMEOUT_ENV),
        "max_connection_s": seconds(MAX_CONNECTION_ENV),
    }


def raise_open_files_limit() -> int:
    """Raise this process's soft limit of open files to the hard limit: every connection is a
    file descriptor, and the usual soft limit (1,024) would cap ``shoal dev`` near 1,000."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            log.warning("cannot raise the open files limit above %d", soft)
    return soft


def _stamp_close(conn: _Connection, _lost: object) -> None:
    if not conn.closed_at_ms:
        conn.closed_at_ms = _now_ms()


def _new_id() -> str:
    # API Gateway's connection and request ids: 10 random bytes in base64's URL-safe alphabet
    # ("d-8k5eP3IAMCIsQ="): never a "/", so an id is one path segment of @connections
    return base64.urlsafe_b64encode(secrets.token_bytes(10)).decode()


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _iso(ms: int) -> str:
    at = dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC)
    return at.isoformat(timespec="milliseconds").replace("+00:00", "Z")


# --- connections and events ------------------------------------------------------------------


@dataclass(slots=True, eq=False)
class _Connection:
    """What one connection keeps between frames: small, for many idle connections."""

    connection_id: str
    connected_at_ms: int
    source_ip: str
    user_agent: str
    headers: dict[str, str]
    multi_headers: dict[str, list[str]]
    #: the authorizer's context and principalId (``requestContext.authorizer``)
    authorizer: dict[str, Any] | None = None
    #: the headers the $connect function answered, for the 101 answer
    answer_headers: list[tuple[str, str]] = field(default_factory=list)
    last_active_ms: int = 0
    ws: ServerConnection | None = None
    #: the close this server chose (code, reason), for $disconnect
    closed_by_server: tuple[int, str] | None = None
    gone: bool = False
    #: when the connection was lost (its socket closed), whatever its frame under way: the
    #: $disconnect event's time, as API Gateway's is the close's and not its function's start
    closed_at_ms: int = 0


Invoke = Callable[[FunctionDef, dict[str, Any]], Any]


class _Refusal(Exception):
    """The handshake refused with this answer."""

    def __init__(self, status: int, body: bytes, headers: tuple[tuple[str, str], ...] = ()):
        super().__init__(status)
        self.status = status
        self.body = body
        self.headers = headers


def _message_body(message: str) -> bytes:
    return json.dumps({"message": message}, separators=(",", ":")).encode()


class WebSocketServer:
    """The WebSocket API on ``host:port`` (port 0: any free port), bound at construction."""

    def __init__(
        self,
        deployment: Deployment,
        invoke: Invoke,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        limits: WsLimits | None = None,
        handler_threads: int = HANDLER_THREADS,
        ledger: ConnectionLedger | None = None,
    ) -> None:
        self.deployment = deployment
        self.websocket = deployment.websocket
        self.routes = WsRouteTable(deployment)
        self.limits = limits or WsLimits.of(deployment.websocket)
        self._authorizer = next(
            (f for f in deployment.functions if f.name == self.websocket.authorizer), None
        )
        self._invoke = invoke
        #: the open connections on disk: a restart runs the $disconnect a kill left owed
        self.ledger = ledger
        self.host = host
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG)
        self.port = self._socket.getsockname()[1]
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=handler_threads, thread_name_prefix="shoal-ws"
        )
        self._disconnect_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=DISCONNECT_THREADS, thread_name_prefix="shoal-ws-disconnect"
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: Server | None = None
        self._stopped: asyncio.Event | None = None
        #: accepted handshakes, by their ServerConnection, until the handler takes them
        self._pending: dict[ServerConnection, _Connection] = {}
        #: open connections by id; touched only on the event loop
        self._connections: dict[str, _Connection] = {}
        #: closes under way (the loop keeps only weak references to its tasks)
        self._closing: set[asyncio.Task[None]] = set()
        #: frames posted through @connections, being sent (held: the loop keeps weak references)
        self._sending: set[asyncio.Task[None]] = set()
        self.method_arn = (
            f"arn:aws:execute-api:{REGION}:{ACCOUNT_ID}:{API_ID}/{self.websocket.stage}/{CONNECT}"
        )

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"ws://{host}:{self.port}"

    @property
    def connection_count(self) -> int:
        return len(self._connections)

    # -- lifecycle --

    def start(self) -> None:
        raise_open_files_limit()
        owed = self.ledger.take_owed() if self.ledger is not None else []
        if owed:
            log.info("%d connections of the last run ended without $disconnect: run now", len(owed))
        started = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self._main(started, owed))
            except BaseException as exc:
                failure.append(exc)
                started.set()
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name="shoal-websocket", daemon=True)
        self._thread.start()
        started.wait()
        if failure:
            raise failure[0]

    async def _main(self, started: threading.Event, owed: list[OpenConnection]) -> None:
        self._stopped = asyncio.Event()
        limits = self.limits
        self._server = await serve(
            self._serve_connection,
            sock=self._socket,
            process_request=self._handshake,
            process_response=self._answer_handshake,
            # API Gateway neither compresses (a deflate context per connection is also most of
            # a connection's memory) nor pings: a client keeps its connection with `ping` frames
            compression=None,
            ping_interval=None,
            # (message, frame): each beyond its quota closes with 1009, as API Gateway does
            max_size=(limits.max_message_bytes, limits.max_frame_bytes),
            # a connection's frames wait here while one runs its function: one at a time
            max_queue=16,
            server_header=None,
            open_timeout=30,
        )
        started.set()
        for entry in owed:
            task = asyncio.create_task(self._disconnect_owed(entry))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        await self._stopped.wait()
        self._server.close(close_connections=False)
        for conn in list(self._connections.values()):
            self._close(conn, GOING_AWAY)
        await self._server.wait_closed()

    def stop(self) -> None:
        """Close every connection (each runs $disconnect), then stop; safe to call twice."""
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None and thread.is_alive():
            stopped = self._stopped
            if stopped is not None:
                loop.call_soon_threadsafe(stopped.set)
            thread.join(STOP_TIMEOUT_S)
        self._thread = None
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._disconnect_pool.shutdown(wait=False, cancel_futures=True)
        self._socket.close()
        if self.ledger is not None:
            self.ledger.close()

    # -- invoking functions --

    async def _run(
        self,
        fn: FunctionDef,
        event: dict[str, Any],
        pool: concurrent.futures.ThreadPoolExecutor | None = None,
    ) -> Any:
        assert self._loop is not None
        return await self._loop.run_in_executor(pool or self._pool, self._invoke, fn, event)

    def _request_context(
        self,
        conn: _Connection,
        route_key: str,
        event_type: str,
        *,
        request_id: str,
        now_ms: int,
    ) -> dict[str, Any]:
        at = dt.datetime.fromtimestamp(now_ms / 1000, tz=dt.UTC)
        context: dict[str, Any] = {
            "routeKey": route_key,
            "eventType": event_type,
            "extendedRequestId": request_id,
            "requestTime": at.strftime("%d/%b/%Y:%H:%M:%S +0000"),
            "messageDirection": "IN",
            "stage": self.websocket.stage,
            "connectedAt": conn.connected_at_ms,
            "requestTimeEpoch": now_ms,
            "identity": {"sourceIp": conn.source_ip, "userAgent": conn.user_agent},
            "requestId": request_id,
            "domainName": f"{self.host}:{self.port}",
            "connectionId": conn.connection_id,
            "apiId": API_ID,
        }
        if conn.authorizer is not None:
            context["authorizer"] = dict(conn.authorizer)
        return context

    # -- the handshake --

    async def _handshake(self, ws: ServerConnection, request: Request) -> Response | None:
        """The authorizer, then ``$connect``: None accepts, a Response refuses."""
        remote = ws.remote_address
        headers = {name: value for name, value in request.headers.raw_items()}
        multi: dict[str, list[str]] = {}
        for name, value in request.headers.raw_items():
            multi.setdefault(name, []).append(value)
        conn = _Connection(
            connection_id=_new_id(),
            connected_at_ms=_now_ms(),
            source_ip=str(remote[0]) if remote else "127.0.0.1",
            user_agent=request.headers.get("User-Agent", ""),
            headers=headers,
            multi_headers=multi,
        )
        conn.last_active_ms = conn.connected_at_ms
        query: dict[str, str] = {}
        multi_query: dict[str, list[str]] = {}
        for name, value in parse_qsl(urlsplit(request.path).query, keep_blank_values=True):
            query[name] = value
            multi_query.setdefault(name, []).append(value)
        try:
            conn.authorizer = await self._authorize(conn, query, multi_query)
            conn.answer_headers = await self._connect(conn, query, multi_query)
        except _Refusal as refusal:
            return Response(
                refusal.status,
                _reason(refusal.status),
                Headers([("Content-Type", "application/json"), *refusal.headers]),
                refusal.body,
            )
        self._pending[ws] = conn
        return None

    async def _authorize(
        self,
        conn: _Connection,
        query: dict[str, str],
        multi_query: dict[str, list[str]],
    ) -> dict[str, Any] | None:
        if self._authorizer is None:
            return None
        now = _now_ms()
        request_id = _new_id()
        context = self._request_context(conn, CONNECT, "CONNECT", request_id=request_id, now_ms=now)
        event = {
            "type": "REQUEST",
            "methodArn": self.method_arn,
            "headers": dict(conn.headers),
            "multiValueHeaders": {k: list(v) for k, v in conn.multi_headers.items()},
            "queryStringParameters": dict(query),
            "multiValueQueryStringParameters": {k: list(v) for k, v in multi_query.items()},
            "stageVariables": {},
            "requestContext": context,
        }
        started = time.monotonic()
        try:
            result = await self._run(self._authorizer, event)
        except Exception as exc:
            # a Lambda authorizer that fails with "Unauthorized" is API Gateway's 401; any
            # other failure is its 500
            if str(exc) == "Unauthorized":
                raise _Refusal(401, _message_body("Unauthorized")) from None
            log.error("authorizer raised %s\n%s", type(exc).__name__, frames(exc))
            raise _Refusal(500, _message_body(INTERNAL_ERROR)) from None
        latency = round((time.monotonic() - started) * 1000)
        try:
            principal, context_values = authorizer_policy(result, self.method_arn)
        except PolicyRefused as refused:
            message = "Forbidden" if refused.status == 403 else INTERNAL_ERROR
            raise _Refusal(refused.status, _message_body(message)) from None
        return {**context_values, "principalId": principal, "integrationLatency": latency}

    async def _connect(
        self,
        conn: _Connection,
        query: dict[str, str],
        multi_query: dict[str, list[str]],
    ) -> list[tuple[str, str]]:
        selected = self.routes.special(CONNECT)
        if selected is None or selected.function is None:
            return []
        request_id = _new_id()
        event = {
            "headers": dict(conn.headers),
            "multiValueHeaders": {k: list(v) for k, v in conn.multi_headers.items()},
            "queryStringParameters": dict(query),
            "multiValueQueryStringParameters": {k: list(v) for k, v in multi_query.items()},
            "requestContext": self._request_context(
                conn, CONNECT, "CONNECT", request_id=request_id, now_ms=_now_ms()
            ),
            "isBase64Encoded": False,
        }
        try:
            result = await self._run(selected.function, event)
        except Exception as exc:
            log.error("$connect raised %s\n%s", type(exc).__name__, frames(exc))
            raise _Refusal(500, _message_body(INTERNAL_ERROR)) from None
        if not isinstance(result, dict):
            return []
        try:
            status = int(result.get("statusCode", 200))
        except (TypeError, ValueError):
            raise _Refusal(500, _message_body(INTERNAL_ERROR)) from None
        headers = [(str(k), str(v)) for k, v in (result.get("headers") or {}).items()]
        if not 200 <= status < 300:
            body = result.get("body")
            payload = (
                (body if isinstance(body, str) else json.dumps(body)).encode() if body else b""
            )
            raise _Refusal(status, payload, tuple(headers))
        return headers

    def _answer_handshake(
        self, ws: ServerConnection, request: Request, response: Response
    ) -> Response | None:
        conn = self._pending.get(ws)
        if conn is None:
            return None
        if response.status_code != 101:
            # refused after $connect accepted it (a malformed upgrade): no connection
            self._pending.pop(ws, None)
            return None
        for name, value in conn.answer_headers:
            if name.lower() in ("connection", "upgrade", "sec-websocket-accept", "content-length"):
                continue
            response.headers[name] = value
        return None

    # -- one connection's life --

    async def _serve_connection(self, ws: ServerConnection) -> None:
        conn = self._pending.pop(ws)
        conn.ws = ws
        # stamped when the socket goes, even while a frame's function runs (the frames of a
        # connection run one at a time, so $disconnect itself waits for the one under way)
        ws.connection_lost_waiter.add_done_callback(functools.partial(_stamp_close, conn))
        self._connections[conn.connection_id] = conn
        if self.ledger is not None:
            self.ledger.opened(
                OpenConnection(
                    conn.connection_id,
                    conn.connected_at_ms,
                    conn.source_ip,
                    conn.user_agent,
                    conn.authorizer,
                )
            )
        try:
            await self._receive(conn, ws)
        finally:
            conn.gone = True
            self._connections.pop(conn.connection_id, None)
            await self._disconnect(conn, *_close_of(conn, ws))

    async def _disconnect_owed(self, entry: OpenConnection) -> None:
        """The $disconnect of a connection the last run left open (``shoal.local.wsledger``):
        lost (1006), when its socket closed if the ledger says, else at this start's time."""
        conn = _Connection(
            connection_id=entry.connection_id,
            connected_at_ms=entry.connected_at_ms,
            source_ip=entry.source_ip,
            user_agent=entry.user_agent,
            headers={},
            multi_headers={},
            authorizer=entry.authorizer,
            gone=True,
            closed_at_ms=entry.went_at_ms or _now_ms(),
        )
        await self._disconnect(conn, int(CloseCode.ABNORMAL_CLOSURE), "Connection lost")

    async def _receive(self, conn: _Connection, ws: ServerConnection) -> None:
        limits = self.limits
        ends_at = conn.connected_at_ms + limits.max_connection_s * 1000
        while True:
            now = _now_ms()
            idle_ends_at = conn.last_active_ms + limits.idle_timeout_s * 1000
            wait_ms = min(ends_at, idle_ends_at) - now
            if wait_ms <= 0:
                self._close(conn, GOING_AWAY)
                await ws.wait_closed()
                return
            try:
                message = await asyncio.wait_for(ws.recv(), wait_ms / 1000)
            except TimeoutError:
                continue
            except ConnectionClosed:
                # the client closed, the connection broke, or a frame over its quota (the
                # library closed with 1009)
                return
            if isinstance(message, bytes):
                self._close(conn, BINARY)
                await ws.wait_closed()
                return
            # only the client's frames count as activity; a server push does not keep a
            # connection from its idle timeout
            conn.last_active_ms = _now_ms()
            # A connection's frames are handled in order, one at a time. API Gateway promises
            # no order between the invocations of one connection's frames; doing them in order
            # keeps what tests see deterministic, and a client must not rely on either.
            await self._message(conn, ws, message)

    async def _message(self, conn: _Connection, ws: ServerConnection, body: str) -> None:
        selected = self.routes.select(body)
        request_id = _new_id()
        if selected is None:
            await self._send(
                ws,
                json.dumps(
                    {
                        "message": "Forbidden",
                        "connectionId": conn.connection_id,
                        "requestId": request_id,
                    }
                ),
            )
            return
        if selected.mock is not None:
            # a mock integration: API Gateway answers (or, one way, says nothing); no function runs
            if selected.mock.response is not None:
                await self._send(ws, selected.mock.response)
            return
        assert selected.route is not None and selected.function is not None
        event = {
            "requestContext": {
                **self._request_context(
                    conn, selected.key, "MESSAGE", request_id=request_id, now_ms=_now_ms()
                ),
                "messageId": _new_id(),
            },
            "body": body,
            "isBase64Encoded": False,
        }
        try:
            result = await self._run(selected.function, event)
        except Exception as exc:
            log.error("%s raised %s\n%s", selected.function.name, type(exc).__name__, frames(exc))
            await self._send(
                ws,
                json.dumps(
                    {
                        "message": INTERNAL_ERROR,
                        "connectionId": conn.connection_id,
                        "requestId": request_id,
                    }
                ),
            )
            return
        if selected.route.two_way:
            answer = _answer_body(result)
            if answer:
                await self._send(ws, answer)

    async def _send(self, ws: ServerConnection, text: str) -> None:
        # a connection closing meanwhile: there is nobody to answer
        with contextlib.suppress(ConnectionClosed):
            await ws.send(text)

    def _close(self, conn: _Connection, why: tuple[int, str]) -> None:
        """Close from this side (without waiting for the client's answer)."""
        if conn.ws is None or conn.closed_by_server is not None:
            return
        conn.closed_by_server = why
        conn.gone = True
        assert self._loop is not None
        task = self._loop.create_task(conn.ws.close(why[0], why[1]))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _disconnect(self, conn: _Connection, code: int, reason: str) -> None:
        selected = self.routes.special(DISCONNECT)
        if selected is None or selected.function is None:
            self._settled(conn)
            return
        request_id = _new_id()
        closed_at = conn.closed_at_ms or _now_ms()
        if self.ledger is not None:  # a kill before the $disconnect runs keeps when it went
            self.ledger.went(conn.connection_id, closed_at)
        context = self._request_context(
            conn, DISCONNECT, "DISCONNECT", request_id=request_id, now_ms=closed_at
        )
        context["disconnectStatusCode"] = code
        context["disconnectReason"] = reason
        event = {
            "headers": dict(conn.headers),
            "multiValueHeaders": {k: list(v) for k, v in conn.multi_headers.items()},
            "requestContext": context,
            "isBase64Encoded": False,
        }
        try:
            await self._run(selected.function, event, self._disconnect_pool)
        except Exception as exc:
            # API Gateway does not invoke it again either: the session's bound expires it
            log.error("$disconnect raised %s\n%s", type(exc).__name__, frames(exc))
        self._settled(conn)

    def _settled(self, conn: _Connection) -> None:
        if self.ledger is not None:
            self.ledger.closed(conn.connection_id)

    # -- @connections, called from the HTTP gateway's threads --

    def manage(self, method: str, connection_id: str, body: bytes) -> HttpResponse:
        """``{method} /@connections/{connection_id}``, answered as API Gateway does."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return _gone()
        if method.upper() == "POST":
            return self._post(loop, connection_id, body)
        coroutine = self._manage(method.upper(), connection_id)
        try:
            return asyncio.run_coroutine_threadsafe(coroutine, loop).result(MANAGEMENT_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            return HttpResponse.json(504, {"message": "Endpoint request timed out"})
        except RuntimeError:
            coroutine.close()
            return _gone()

    def _post(
        self, loop: asyncio.AbstractEventLoop, connection_id: str, body: bytes
    ) -> HttpResponse:
        """A frame for the connection: answered at once, as API Gateway answers a POST once it
        took the frame, not once the client has it. The frame is queued on the event loop, in
        the order posted. Waiting for the loop to send it made each POST a hand-over between
        threads and back: under load a router's wave of 10 frames took 50-180 ms."""
        if len(body) > self.limits.max_message_bytes:
            return _too_long()
        conn = self._connections.get(connection_id)
        if conn is None or conn.gone or conn.ws is None:
            return _gone()
        try:
            payload: str | bytes = body.decode("utf-8")
        except UnicodeDecodeError:
            payload = body
        try:
            loop.call_soon_threadsafe(self._queue_frame, conn, payload)
        except RuntimeError:  # the loop closed meanwhile
            return _gone()
        return HttpResponse(200, [], b"")

    def _queue_frame(self, conn: _Connection, payload: str | bytes) -> None:
        # one task a frame, made in the order posted: each writes its frame in its first step
        assert self._loop is not None
        task = self._loop.create_task(self._send_posted(conn, payload))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send_posted(self, conn: _Connection, payload: str | bytes) -> None:
        if conn.gone or conn.ws is None:
            return  # closed after the POST was answered: lost, as on AWS
        with contextlib.suppress(ConnectionClosed):
            await conn.ws.send(payload)

    async def _manage(self, method: str, connection_id: str) -> HttpResponse:
        """GET and DELETE (and any other method, refused), on the loop; POST is ``_post``."""
        conn = self._connections.get(connection_id)
        if method not in ("GET", "DELETE"):
            return HttpResponse.json(
                405, {"message": "Method Not Allowed"}, [("Allow", "DELETE, GET, POST")]
            )
        if conn is None or conn.gone or conn.ws is None:
            return _gone()
        if method == "GET":
            return HttpResponse.json(
                200,
                {
                    "connectedAt": _iso(conn.connected_at_ms),
                    "identity": {"sourceIp": conn.source_ip, "userAgent": conn.user_agent},
                    "lastActiveAt": _iso(conn.last_active_ms),
                },
            )
        self._close(conn, DELETED)
        return HttpResponse(204, [], b"")


def _too_long() -> HttpResponse:
    return HttpResponse.json(
        400, {"message": "Message too long"}, [("x-amzn-ErrorType", "PayloadTooLargeException")]
    )


def _gone() -> HttpResponse:
    # what the management API answers for a connection that is closed or never was
    return HttpResponse.json(410, {"message": None}, [("x-amzn-ErrorType", "GoneException")])


def _reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


def _answer_body(result: Any) -> str:
    """The frame a two-way route sends back: the function's ``body`` ("" for none)."""
    if isinstance(result, dict):
        body = result.get("body")
        if body is None:
            return ""
        return body if isinstance(body, str) else json.dumps(body)
    if result is None:
        return ""
    return result if isinstance(result, str) else json.dumps(result)


def _close_of(conn: _Connection, ws: ServerConnection) -> tuple[int, str]:
    """The close ``$disconnect`` reports: the one this server chose, the one the library sent
    (1009 for a frame over the quota), the client's, or 1006 when none came."""
    if conn.closed_by_server is not None:
        return conn.closed_by_server
    protocol = ws.protocol
    sent, received = protocol.close_sent, protocol.close_rcvd
    if sent is not None and not protocol.close_rcvd_then_sent:
        return int(sent.code), sent.reason
    if received is not None:
        return int(received.code), received.reason
    return int(CloseCode.ABNORMAL_CLOSURE), "Connection lost"
