"""The functions' calls to the embedded emulator, handed to it in-process instead of over a socket.

Under ``shoal dev`` the functions run in the emulator's own process. Their SDK calls used to go
to the emulator's loopback HTTP server: a connection, a server thread and werkzeug's request
parsing per call, about half of a call's CPU (measured with a GetItem loop: 3.5 to 4.3 ms of CPU
per call over loopback, 1.5 to 2.4 ms handed over in-process). On two cores, with ten clients
long-polling, that overhead was what a get waited for.

Everything a call means still happens: botocore serializes the request and parses the
response as it does against AWS, and the request goes through the same ``SerializedApp`` (the
backend lock, the journal, the bounded wait for the lock) as one that arrives over HTTP. Only
the socket is skipped. Other processes (the CLI, tests, the AWS CLI) still use the HTTP
endpoint.

Two more things are skipped for the JSON-protocol calls (DynamoDB, Kinesis, SQS: every call
of the hot paths), because the emulator would do them for nothing (and the signature for the
gateway's ``@connections`` posts too, which nothing checks in this process either). Profiled
at 100 WebSocket and 100 long-polling sessions (py-spy, 2026-11-30), botocore's client side
was 43 % of the process's time and moto's Flask front 22 %, against 18 % in moto's DynamoDB
and Kinesis models:

- **the signature's arithmetic** (``SigV4Auth.add_auth``, about a seventh of a GetItem's CPU):
  moto checks no signature. The request still gets its date, its token and an
  ``Authorization`` header with the credential scope, which moto reads (the key id names the
  account, the scope the region) and the journal keeps; credentials are still required.
- **Flask**: ``SerializedApp.serve_in_process`` hands the call to moto's handler for that
  service as moto's own in-process mock does, under the same lock and journal.

And botocore rebuilds its user-agent string twice a call from the same parts, sanitizing each
character; the sanitizing is a pure function of its text, so its answers are kept.

How: botocore emits ``before-send`` before it sends a prepared request, and a handler that
returns a response replaces the send (the mechanism botocore's Stubber and moto's in-process
mock use). The handler answers only requests addressed to this emulator's URL.
"""

from __future__ import annotations

import functools
import io
import logging
import select
import socket
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from urllib.parse import urlsplit

from botocore import handlers
from botocore.awsrequest import AWSPreparedRequest, AWSResponse
from botocore.compat import HTTPHeaders
from botocore.exceptions import NoCredentialsError

from shoal.aws import clients
from shoal.local.attribute_values import parse_attribute_values_directly

log = logging.getLogger("shoal-dev.aws")

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]

#: headers werkzeug's server puts in the environ under their own names, not HTTP_*
_UNPREFIXED = {"CONTENT_TYPE", "CONTENT_LENGTH"}
#: where moto's request handler keeps the original spelling of underscored header names
PRESERVED_NAMES_KEY = "moto.preserved_header_names"
#: what werkzeug's server answers when the application raises
_SERVER_ERROR = b"<!doctype html><title>500 Internal Server Error</title>"


class _Body(io.BytesIO):
    """A response body botocore can read whole (``stream``) or as a stream (S3 GetObject)."""

    def stream(self, amt: int = 2**16, decode_content: bool | None = None) -> Iterator[bytes]:
        while chunk := self.read(amt):
            yield chunk


def _request_body(request: AWSPreparedRequest) -> bytes:
    body = request.body
    if body is None:
        return b""
    if isinstance(body, str):
        return body.encode("utf-8")
    if isinstance(body, bytes | bytearray):
        return bytes(body)
    # a file-like body (an S3 upload): read it whole, as the socket would have been sent it
    data = body.read()
    return data.encode("utf-8") if isinstance(data, str) else bytes(data)


def environ_for(request: AWSPreparedRequest) -> dict[str, Any]:
    """The WSGI environ werkzeug's server would have built for ``request``."""
    url = urlsplit(request.url)
    body = _request_body(request)
    environ: dict[str, Any] = {
        "REQUEST_METHOD": request.method,
        "SCRIPT_NAME": "",
        "PATH_INFO": url.path or "/",
        "QUERY_STRING": url.query,
        "REQUEST_URI": request.url[len(f"{url.scheme}://{url.netloc}") :],
        "SERVER_NAME": url.hostname or "127.0.0.1",
        "SERVER_PORT": str(url.port or 80),
        "SERVER_PROTOCOL": "HTTP/1.1",
        "HTTP_HOST": url.netloc,
        "wsgi.version": (1, 0),
        "wsgi.url_scheme": url.scheme,
        "wsgi.input": io.BytesIO(body),
        "wsgi.errors": sys.stderr,
        "wsgi.multithread": True,
        "wsgi.multiprocess": False,
        "wsgi.run_once": False,
    }
    environ["RAW_URI"] = environ["REQUEST_URI"]
    preserved: dict[str, str] = {}
    for name, value in request.headers.items():
        text = value.decode("latin-1") if isinstance(value, bytes) else str(value)
        key = name.upper().replace("-", "_")
        key = key if key in _UNPREFIXED else f"HTTP_{key}"
        if "_" in name:
            # werkzeug's server drops these (X_Foo could spoof X-Foo); moto's request handler
            # puts S3 metadata back under its own spelling, and so does this
            if not name.lower().startswith("x-amz-meta-"):
                continue
            preserved.setdefault(key, name)
        environ[key] = text
    environ[PRESERVED_NAMES_KEY] = preserved
    environ["CONTENT_LENGTH"] = str(len(body))
    return environ


def call_wsgi(app: WsgiApp, environ: dict[str, Any]) -> tuple[str, list[tuple[str, str]], bytes]:
    """Call a WSGI app and collect its answer: status line, headers, body."""
    captured: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
        captured["status"], captured["headers"] = status, headers
        return lambda _data: None

    result = app(environ, start_response)
    try:
        payload = b"".join(result)
    finally:
        close = getattr(result, "close", None)
        if close is not None:
            close()
    return str(captured["status"]), captured["headers"], payload


class _InProcess:
    """A ``before-send`` handler answering the SDK requests addressed to ``url`` in this
    process (``answer``); None from ``answer``: the request goes to the socket as usual."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.calls = 0
        self.closed = False
        self._handler_id = f"shoal-in-process-{id(self)}"

    def __call__(self, request: AWSPreparedRequest, **_: Any) -> AWSResponse | None:
        if not self.answers(request.url):
            # another endpoint, or a stopped emulator (its clients then meet a closed port,
            # as over HTTP): botocore sends it as usual
            return None
        try:
            answer = self.answer(request)
        except Exception:
            # over HTTP the server would log it and answer 500; the caller sees the same
            log.exception("shoal dev: a request failed in-process")
            answer = 500, [], _SERVER_ERROR
        if answer is None:
            return None
        status, pairs, payload = answer
        self.calls += 1
        headers = HTTPHeaders.from_pairs(pairs)
        return AWSResponse(request.url, status, headers, _Body(payload))

    def answer(self, request: AWSPreparedRequest) -> Answer | None:
        raise NotImplementedError

    def answers(self, url: str) -> bool:
        return not self.closed and (url == self.url or url.startswith(self.url + "/"))

    # -- installing --

    def install(self) -> None:
        """Answer every botocore session made from now on in this process (botocore registers
        its built-in handlers on each new session, which is how moto's mock reaches them)."""
        entry = ("before-send", self)
        if entry not in handlers.BUILTIN_HANDLERS:
            handlers.BUILTIN_HANDLERS.append(entry)
        # and the process's shared session if it was made already (the runtime's provisioning
        # makes it before the gateway's URL is known): the clients it makes from now on, as a
        # function's @connections client, take this handler too (without it every push under
        # `shoal dev` went over loopback HTTP)
        for session in clients.made_sessions():
            # botocore types a handler as returning None; a before-send handler's answer is
            # the response that replaces the request's (its documented use)
            handler: Any = self
            session.events.register("before-send", handler, unique_id=self._handler_id)
        _OPEN.append(self)

    def uninstall(self) -> None:
        # sessions made meanwhile keep the handler: closed, it lets their calls go to the socket
        self.closed = True
        while self in _OPEN:
            _OPEN.remove(self)
        entry = ("before-send", self)
        while entry in handlers.BUILTIN_HANDLERS:
            handlers.BUILTIN_HANDLERS.remove(entry)
        for session in clients.made_sessions():
            session.events.unregister("before-send", unique_id=self._handler_id)


#: an answer: status, headers, body
Answer = tuple[int, list[tuple[str, str]], bytes]


class InProcessTransport(_InProcess):
    """Answers the SDK requests addressed to ``url`` by calling ``app`` in this process."""

    def __init__(self, url: str, app: WsgiApp) -> None:
        super().__init__(url)
        self.app = app
        #: of the calls, those handed to moto's handler without Flask (``serve_in_process``)
        self.handed = 0

    def answer(self, request: AWSPreparedRequest) -> Answer:
        direct = getattr(self.app, "serve_in_process", None)
        answer = direct(request) if direct is not None else None
        if answer is not None:
            self.handed += 1
            return answer
        status_line, pairs, payload = call_wsgi(self.app, environ_for(request))
        return int(status_line.split(" ", 1)[0]), pairs, payload

    def install(self) -> None:
        super().install()
        _sign_in_process_cheaply()
        parse_attribute_values_directly()
        _keep_user_agent_parts()
        _keep_user_agents()


class InProcessEndpoint(_InProcess):
    """Answers the SDK requests to ``url`` that ``respond`` (method, raw path, body) answers,
    in this process: ``shoal dev``'s ``@connections``, which the functions' pushes call once a
    frame. Over loopback each POST was also a connection's request parsed by a server thread
    (under load a router's wave of 10 posts took 50-120 ms, for 0.64 ms of CPU a post);
    in-process it is the gateway's own answer, the same one a request over HTTP gets."""

    def __init__(self, url: str, respond: Callable[[str, str, bytes], Answer | None]) -> None:
        super().__init__(url)
        self.respond = respond

    def install(self) -> None:
        super().install()
        _sign_in_process_cheaply()

    def answer(self, request: AWSPreparedRequest) -> Answer | None:
        url = urlsplit(request.url)
        return self.respond(request.method, url.path, _request_body(request))


#: the transports answering in this process now (a test may start and stop several)
_OPEN: list[_InProcess] = []


def json_target(request: Any) -> str | None:
    """The ``X-Amz-Target`` of a JSON-protocol request (DynamoDB, Kinesis), as text."""
    target = request.headers.get("X-Amz-Target")
    if isinstance(target, bytes):
        return target.decode("latin-1")
    return target


def _sign_in_process_cheaply() -> None:
    """SigV4 for a JSON-protocol call this process hands to its emulator: the headers and the
    credential scope without the arithmetic (see the module's note). Process-wide, once."""
    import botocore.auth

    if getattr(botocore.auth.SigV4Auth.add_auth, "shoal_in_process", False):
        return
    sign = botocore.auth.SigV4Auth.add_auth

    def add_auth(auth: botocore.auth.SigV4Auth, request: Any) -> None:
        if not _unchecked(request):
            sign(auth, request)
            return
        if auth.credentials is None:
            raise NoCredentialsError()
        request.context["timestamp"] = time.strftime(botocore.auth.SIGV4_TIMESTAMP, time.gmtime())
        auth._modify_request_before_signing(request)  # type: ignore[attr-defined]
        request.headers["Authorization"] = (
            f"AWS4-HMAC-SHA256 Credential={auth.scope(request)}, SignedHeaders=host, "
            "Signature=in-process"
        )

    add_auth.shoal_in_process = True  # type: ignore[attr-defined]
    botocore.auth.SigV4Auth.add_auth = add_auth  # type: ignore[method-assign,assignment]


def _unchecked(request: Any) -> bool:
    """Whether what answers ``request`` in this process checks no signature: the emulator's
    JSON-protocol calls (moto checks none), and the gateway's ``@connections`` posts (answered
    by method, path and body). Computing the signature of a post read its body's headers back
    through botocore's case-insensitive mapping: about 7 % of the process's CPU when a
    fan-out to 1,000 connections was posted (py-spy, 2026-12-05)."""
    for transport in list(_OPEN):
        if not transport.answers(request.url):
            continue
        if isinstance(transport, InProcessEndpoint):
            return True
        if isinstance(transport, InProcessTransport) and json_target(request):
            return True
    return False


def _keep_user_agent_parts() -> None:
    """botocore's user-agent sanitizer, its answers kept (a pure function of its arguments)."""
    import botocore.useragent

    sanitize = botocore.useragent.sanitize_user_agent_string_component
    if hasattr(sanitize, "cache_info"):
        return
    botocore.useragent.sanitize_user_agent_string_component = functools.lru_cache(maxsize=4096)(
        sanitize
    )


def _keep_user_agents() -> None:
    """A client's User-Agent string kept per set of features, not built twice a call
    (process-wide, once).

    botocore builds a client's User-Agent from the same parts at each request, then again
    when the request is made (to add the features the call used): about a twelfth of an
    in-process GetItem's CPU. The string is a function of the client's own settings and of
    the features named (the client's and the call's context's): kept by those features, on
    the client's own ``UserAgentString`` (a copy made for another client config keeps its
    own). Measured side by side in one process: a GetItem 0.621 ms of CPU, 0.563 ms kept."""
    import botocore.useragent
    from botocore.context import get_context

    strings = botocore.useragent.UserAgentString
    if getattr(strings.to_string, "shoal_kept", False):
        return
    build = strings.to_string

    def to_string(self: botocore.useragent.UserAgentString) -> str:
        context = get_context()
        features = (
            frozenset(getattr(self, "_client_features", None) or ()),
            frozenset(context.features) if context is not None else frozenset(),
        )
        kept: tuple[int, dict[Any, str]] | None = self.__dict__.get("_shoal_kept")
        if kept is None or kept[0] != id(self):
            # none yet, or the one of the object this was copied from (with_client_config)
            kept = self.__dict__["_shoal_kept"] = (id(self), {})
        text = kept[1].get(features)
        if text is None:
            text = kept[1][features] = build(self)
        return text

    to_string.shoal_kept = True  # type: ignore[attr-defined]
    strings.to_string = to_string  # type: ignore[method-assign]


def peer_closed(connection: socket.socket) -> bool:
    """Whether the peer has closed its side: readable with nothing to read (a pipelined next
    request is something). No wait: on a socket with a timeout, recv would wait. ``poll``, not
    ``select``: select refuses a descriptor past 1,023, and a ``shoal dev`` holding a thousand
    WebSocket connections numbers its HTTP sockets past that, so every request was taken for
    gone and answered 503 (``python -m bench connections`` at 10,000)."""
    try:
        poller = select.poll()
        poller.register(connection, select.POLLIN)
        if not poller.poll(0):
            return False
        return connection.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True
