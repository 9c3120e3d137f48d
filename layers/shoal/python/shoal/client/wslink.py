"""The connection under a WebSocket session (``shoal.client.ws``): its timings, the socket it
needs, and how a handshake or a connection fails.

Keep-alive. API Gateway closes a connection after 10 minutes without a frame *from the client*
(pushes do not count). The client sends a keep-alive (taken by API Gateway itself, no function
runs) after ``ping_every_s`` of its own silence, from a small thread too, so a handler that runs
long does not cost the connection. One in ``check_every`` is a ``ping``, whose ``pong`` proves the
connection alive; the others are one-way ``keepalive`` frames, half the billed messages.

Never logged: tokens, payloads.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

from shoal.client.errors import ClientError, error_of
from shoal.client.support import Connection

#: the close code API Gateway's 2-hour limit and a normal client close use
NORMAL_CLOSURE = 1000


@dataclass(frozen=True)
class WsSettings:
    """The connection's timings. API Gateway closes a connection idle (no client frame) for 10
    minutes and any connection after 2 hours; ``shoal dev`` does the same."""

    #: a keep-alive after this long without a client frame: 30 s under the 10-minute idle
    #: limit (the keep-alive thread wakes when one is due). Each is a billed WebSocket message
    #: (a ping two, with its pong), the largest line of an idle client's bill after the
    #: connection minutes (bench/cost.py, "fleet"): at 240 s they were $0.0216 a client-month
    ping_every_s: float = 570.0
    #: one keep-alive in this many is a ``ping`` (answered ``pong``: a check that the connection
    #: is alive), the others one-way ``keepalive`` frames (one billed message, not two). A
    #: half-open connection is found within ``ping_every_s * check_every + pong_timeout_s``
    #: (38.5 minutes by default, AWS IoT Core's 1.5 keep-alives at its longest keep-alive
    #: being 30); 1 checks at every keep-alive
    check_every: int = 4
    #: after a ``ping``, nothing received for this long: the connection is dead (half-open TCP)
    pong_timeout_s: float = 30.0
    #: API Gateway's limit on a connection's life
    max_connection_s: float = 7200.0
    #: reconnect this long (plus up to as much again, jittered) before ``max_connection_s``:
    #: a renewal is a handshake and a ``renew`` frame (4 function invocations, about 6 write
    #: units), so every minute of a connection's life used is a cheaper month (bench/cost.py)
    renew_before_s: float = 120.0
    #: the WebSocket handshake's timeout (it runs the authorizer and ``$connect`` functions)
    open_timeout_s: float = 30.0
    #: how long a frame's answer may take: API Gateway's integration timeout is 29 s, so an
    #: answer not there by then is not coming (the frame is sent again on a new connection)
    answer_timeout_s: float = 30.0
    #: send keep-alive pings from a thread too (while the application's handler runs)
    keepalive_thread: bool = True

    def __post_init__(self) -> None:
        timings = (self.ping_every_s, self.pong_timeout_s, self.open_timeout_s)
        if min(*timings, self.answer_timeout_s) <= 0:
            raise ValueError("ping_every_s and the timeouts must be positive")
        if self.check_every < 1:
            raise ValueError("check_every must be at least 1")
        if not 0 <= self.renew_before_s * 2 < self.max_connection_s:
            raise ValueError("renew_before_s must be under half of max_connection_s")


class Socket(Protocol):
    """What the client needs of a WebSocket connection (``websockets.sync`` gives it)."""

    def send(self, message: str) -> None: ...

    def recv(self, timeout: float | None = None) -> str | bytes: ...

    def close(self, code: int = NORMAL_CLOSURE, reason: str = "") -> None: ...


#: opens a connection: (URL, extra headers, open timeout) -> a socket. Raises ``HandshakeRefused``
#: for an HTTP answer other than 101, ``LinkLost`` for anything else that failed.
Connector = Callable[[str, Mapping[str, str], float], Socket]


class LinkLost(Exception):
    """The connection failed or was closed (``code`` as received, None when none came)."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class HandshakeRefused(Exception):
    """The server answered the handshake with an HTTP status (401, 403, 429, 5xx)."""

    def __init__(self, status: int, body: bytes = b"") -> None:
        super().__init__(f"the handshake was answered {status}")
        self.status = status
        self.body = body


def websockets_connector(url: str, headers: Mapping[str, str], open_timeout_s: float) -> Socket:
    """A ``websockets.sync.client`` connection, as API Gateway wants it: no compression (it
    offers none), no protocol-level pings (the client sends ``ping`` frames: API Gateway's
    idle timer counts only data frames), frames up to its 128 KB message limit."""
    # imported here: the HTTP client and the CLI's other commands do not need the library
    from websockets.exceptions import (
        ConnectionClosed,
        InvalidHandshake,
        InvalidStatus,
        InvalidURI,
    )
    from websockets.sync.client import connect

    try:
        ws = connect(
            url,
            additional_headers=dict(headers),
            user_agent_header=None,
            compression=None,
            open_timeout=open_timeout_s,
            ping_interval=None,
            close_timeout=5,
            max_size=256 * 1024,
        )
    except InvalidStatus as exc:
        raise HandshakeRefused(exc.response.status_code, bytes(exc.response.body or b"")) from exc
    except InvalidURI as exc:
        raise ClientError(f"{url!r} is not a ws:// or wss:// URL") from exc
    except (OSError, TimeoutError, InvalidHandshake, ConnectionClosed) as exc:
        # a server that dies mid-handshake closes the connection under it: websockets raises
        # ConnectionClosedError, not a handshake error (the soak's kill -9 found it, and the
        # subscriber's loop ended instead of riding the outage out)
        raise LinkLost(f"cannot open {url} ({type(exc).__name__})") from exc
    # the connection's context is entered here and left by ``close``: it lives as long as the
    # link, not a ``with`` block (websockets 17.1 warns on a connection used without it)
    return _WebsocketsSocket(ws.__enter__())


class _WebsocketsSocket:
    def __init__(self, ws: Any) -> None:
        self.ws = ws

    def send(self, message: str) -> None:
        from websockets.exceptions import ConnectionClosed

        try:
            self.ws.send(message)
        except ConnectionClosed as exc:
            raise LinkLost("the connection was closed", _code(exc)) from exc
        except OSError as exc:
            raise LinkLost(f"the connection broke ({type(exc).__name__})") from exc

    def recv(self, timeout: float | None = None) -> str | bytes:
        from websockets.exceptions import ConnectionClosed

        try:
            message: str | bytes = self.ws.recv(timeout)
        except ConnectionClosed as exc:
            raise LinkLost("the connection was closed", _code(exc)) from exc
        return message

    def close(self, code: int = NORMAL_CLOSURE, reason: str = "") -> None:
        with contextlib.suppress(Exception):
            self.ws.close(code, reason)


@dataclass
class Link:
    """One open connection and what the client tracks of it (times on the client's clock)."""

    socket: Socket
    opened_ms: int
    #: when to open the next connection, before API Gateway's 2-hour close
    renew_at_ms: int
    last_sent_ms: int
    last_received_ms: int
    #: a ping sent and nothing received since: when it was sent
    ping_sent_ms: int | None = None
    #: keep-alives sent on this connection (every ``check_every``-th is a ping)
    keepalives: int = 0
    connection: Connection | None = None
    receive_maximum: int = 0

    def keepalive_frame(self, settings: WsSettings, now_ms: int) -> str | None:
        """The keep-alive due now, if one is, counted as sent: a one-way ``keepalive`` (API
        Gateway takes it and answers nothing), or every ``check_every``-th a ``ping`` it
        answers itself (no ref: its mock answer cannot echo one)."""
        if now_ms - self.last_sent_ms < settings.ping_every_s * 1000:
            return None
        self.keepalives += 1
        self.last_sent_ms = now_ms
        if self.keepalives % settings.check_every:
            return '{"action":"keepalive"}'
        if self.ping_sent_ms is None:
            self.ping_sent_ms = now_ms
        return '{"action":"ping"}'

    def keepalive_due_ms(self, settings: WsSettings) -> float:
        return self.last_sent_ms + settings.ping_every_s * 1000

    def check(self, settings: WsSettings, now_ms: int) -> None:
        """Raise ``LinkLost`` for a connection whose ping went unanswered too long."""
        if self.ping_sent_ms is None:
            return
        if now_ms - self.ping_sent_ms >= settings.pong_timeout_s * 1000:
            raise LinkLost(f"no answer to a ping in {settings.pong_timeout_s:g} s")


def _code(closed: Any) -> int | None:
    rcvd = getattr(closed, "rcvd", None)
    return int(rcvd.code) if rcvd is not None else None


def check_ws_url(url: str) -> str:
    """``url`` without its trailing slash if it can be a WebSocket API's URL; else ValueError."""
    parts = urlsplit(url)
    if parts.scheme not in ("ws", "wss") or not parts.netloc:
        raise ValueError(f"{url!r} is not a ws:// or wss:// URL")
    return url.rstrip("/")


def handshake_error(refused: HandshakeRefused) -> Exception:
    """What a refused handshake means: a busy server is a loss (tried again), the rest final."""
    try:
        answer = json.loads(refused.body or b"null")
    except ValueError:
        answer = None
    error = error_of(refused.status, answer)
    if refused.status in (429, 500, 502, 503, 504):
        return LinkLost(f"the handshake was answered {refused.status}")
    return error
