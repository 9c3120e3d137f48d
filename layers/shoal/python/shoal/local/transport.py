"""The functions' calls to the embedded emulator, handed to it in-process instead of over a socket.

Under ``shoal dev`` the functions run in the emulator's own process. Their SDK calls used to go
to the emulator's loopback HTTP server: a connection, a server thread and werkzeug's request
parsing per call, about half of a call's CPU (measured with a GetItem loop: 3.5 to 4.3 ms of CPU
per call over loopback, 1.5 to 2.4 ms handed over in-process). On two cores, with ten clients
long-polling, that overhead was what a get waited for.

Everything a call means still happens: botocore signs and serializes the request and parses
the response as it does against AWS, and the request goes through the same
``SerializedApp`` (the backend lock, the journal, the bounded wait for the lock) as one that
arrives over HTTP. Only the socket is skipped. Other processes (the CLI, tests, the AWS CLI)
still use the HTTP endpoint.

How: botocore emits ``before-send`` before it sends a prepared request, and a handler that
returns a response replaces the send (the mechanism botocore's Stubber and moto's in-process
mock use). The handler answers only requests addressed to this emulator's URL.
"""

from __future__ import annotations

import io
import logging
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from urllib.parse import urlsplit

from botocore import handlers
from botocore.awsrequest import AWSPreparedRequest, AWSResponse
from botocore.compat import HTTPHeaders

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


class InProcessTransport:
    """Answers the SDK requests addressed to ``url`` by calling ``app`` in this process."""

    def __init__(self, url: str, app: WsgiApp) -> None:
        self.url = url.rstrip("/")
        self.app = app
        self.calls = 0
        self.closed = False

    def __call__(self, request: AWSPreparedRequest, **_: Any) -> AWSResponse | None:
        if self.closed or not (request.url == self.url or request.url.startswith(self.url + "/")):
            # another endpoint, or a stopped emulator (its clients then meet a closed port,
            # as over HTTP): botocore sends it as usual
            return None
        try:
            status_line, pairs, payload = call_wsgi(self.app, environ_for(request))
        except Exception:
            # over HTTP the server would log it and answer 500; the caller sees the same
            log.exception("emulator: a request failed in-process")
            status_line, pairs, payload = "500 INTERNAL SERVER ERROR", [], _SERVER_ERROR
        self.calls += 1
        status = int(status_line.split(" ", 1)[0])
        headers = HTTPHeaders.from_pairs(pairs)
        return AWSResponse(request.url, status, headers, _Body(payload))

    # -- installing --

    def install(self) -> None:
        """Answer every botocore session made from now on in this process (botocore registers
        its built-in handlers on each new session, which is how moto's mock reaches them)."""
        entry = ("before-send", self)
        if entry not in handlers.BUILTIN_HANDLERS:
            handlers.BUILTIN_HANDLERS.append(entry)

    def uninstall(self) -> None:
        # sessions made meanwhile keep the handler: closed, it lets their calls go to the socket
        self.closed = True
        entry = ("before-send", self)
        while entry in handlers.BUILTIN_HANDLERS:
            handlers.BUILTIN_HANDLERS.remove(entry)
