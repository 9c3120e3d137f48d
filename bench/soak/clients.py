"""The soak's clients: ``shoal.client``'s HTTP and WebSocket clients with a recorder under them,
and the roles they play.

The recorders sit below the clients' own bookkeeping, where the wire is: every publish request
and its answer, every connect, subscribe, ack and disconnect, and every message as it arrived,
before the client drops a second copy of one it processed. So the history shows what the server
did, not what the client let through. One change of behaviour: the WebSocket client's acks ask
for an answer (a ``ref``), so that the history knows when an ack counted; the library's own
client sends them unanswered.

Each message's payload is ``{"mk": "<client>.<life>.<n>"}`` (a will's ``{"wid": ...}``): the
soak's own key of it, which the checker follows from publish to delivery. A will's ``wid`` is
made fresh for every connect, so each connection's will is told apart.
"""

from __future__ import annotations

import base64
import contextlib
import json
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shoal.client.errors import ApiError, ClientError, SessionTakenOver, Unavailable
from shoal.client.http import ShoalClient
from shoal.client.publishing import Publishing
from shoal.client.support import CallRetry, FlowControl, Outages
from shoal.client.tokens import FileToken
from shoal.client.ws import ShoalWsClient
from shoal.client.wslink import Link, Socket

from bench.soak.history import History

#: the soak topics' areas (``soak/a{n}/...``)
AREAS = 8
#: the WebSocket clients' window (receive maximum)
WINDOW = 50
#: an HTTP will client's keep-alive: the reaper (every 2 s under the soak) expires its channel
#: 6 s after its last call
WILL_KEEPALIVE_S = 4
#: will delays the will clients choose from (0: at once)
WILL_DELAYS_S = (0, 3, 8)
#: a session outlives its connection this long (the soak never lets one expire)
SESSION_EXPIRY_S = 3600
#: how long a stopping WebSocket client waits for its acks' answers
SETTLE_S = 5.0


def payload_text(**fields: str) -> str:
    return json.dumps(fields, separators=(",", ":"))


def payload_keys(raw: Mapping[str, Any]) -> dict[str, Any]:
    """``mk`` / ``wid`` of a delivered message (the API's base64 payload, or ``text``)."""
    data: Any = None
    try:
        if isinstance(raw.get("payload"), str):
            data = json.loads(base64.b64decode(raw["payload"]))
        elif isinstance(raw.get("text"), str):
            data = json.loads(raw["text"])
    except (ValueError, TypeError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: data[k] for k in ("mk", "wid") if isinstance(data.get(k), str)}


def _mk_of(body: Mapping[str, Any]) -> str | None:
    keys = payload_keys(body)
    return keys.get("mk")


def _delivery(raw: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "id": raw.get("id"),
        "message_id": raw.get("message_id"),
        "topic": raw.get("topic"),
        "qos": raw.get("qos"),
        "retain": bool(raw.get("retain")),
        "dup": bool(raw.get("dup")),
        "sub": raw.get("subscription"),
        "published_at": raw.get("published_at"),
        **payload_keys(raw),
    }


def _fresh_will(will: Mapping[str, Any] | None) -> tuple[dict[str, Any] | None, Any]:
    """The will with a payload naming a new ``wid``, and what the history keeps of it."""
    if not will:
        return None, None
    wid = uuid.uuid4().hex[:12]
    sent = {k: v for k, v in will.items() if k not in ("text", "payload")}
    sent["text"] = payload_text(wid=wid)
    kept = {"wid": wid, "topic": will.get("topic"), "delay_s": will.get("delay_s", 0)}
    return sent, kept


class RecordingHttpClient(ShoalClient):
    """``ShoalClient`` whose every request of the session and publish routes is recorded."""

    def __init__(
        self, *args: Any, history: History, record_heartbeats: bool = False, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.history = history
        self.record_heartbeats = record_heartbeats
        #: the soak's id of the channel in use (a new one per connect)
        self.conn: str | None = None
        self.last_invoke = 0.0
        self.last_answer = 0.0

    def record_lost(self, how: str) -> None:
        """Its channel went without a disconnect (``how``: crashed, silent): the checker
        judges the will by when the client last called and was last answered."""
        self.history.record(
            "lost",
            client=self.client_id,
            conn=self.conn,
            how=how,
            last_invoke=self.last_invoke,
            last_answer=self.last_answer,
        )

    def _send(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: Mapping[str, Any] | None = None,
        channel: str | None = None,
        extra_wait_s: float = 0.0,
    ) -> tuple[Any, bool]:
        kind = _route(method, path)
        if kind is None:
            return super()._send(
                method, path, body=body, params=params, channel=channel, extra_wait_s=extra_wait_s
            )
        rq = uuid.uuid4().hex[:12]
        common: dict[str, Any] = {"client": self.client_id, "rq": rq}
        if kind == "connect":
            self.conn = f"{self.client_id}/h{rq}"
            will, kept = _fresh_will(body.get("will"))
            body = {**body, "will": will} if will else body
            common |= {"conn": self.conn, "transport": "http"}
            self.history.record(
                "connect",
                phase="invoke",
                clean_start=body.get("clean_start"),
                session_expiry_s=body.get("session_expiry_s"),
                keepalive_s=body.get("keepalive_s"),
                will=kept,
                **common,
            )
        elif kind in ("disconnect", "subscribe", "unsubscribe", "ack", "heartbeat"):
            common["conn"] = self.conn
            fields = _session_fields(kind, body)
            if kind != "heartbeat" or self.record_heartbeats:
                self.history.record(kind, phase="invoke", **common, **fields)
        elif kind in ("publish", "batch"):
            self._record_publishes("invoke", body, common)
        invoked = time.time()
        self.last_invoke = invoked
        try:
            answer, uncertain = super()._send(
                method, path, body=body, params=params, channel=channel, extra_wait_s=extra_wait_s
            )
        except Unavailable as exc:
            self._record_failure(kind, body, common, exc, phase="info")
            raise
        except ApiError as exc:
            # a 4xx refused it (nothing done); a 5xx may have come after it was done
            refused = exc.status < 500 and exc.status != 429
            self._record_failure(kind, body, common, exc, phase="fail" if refused else "info")
            if isinstance(exc, SessionTakenOver) and self.conn is not None:
                self.history.record("lost", client=self.client_id, conn=self.conn, how="ended")
            raise
        self.last_answer = time.time()
        self._record_answer(kind, body, answer, common, invoked)
        return answer, uncertain

    def _record_publishes(
        self, phase: str, body: Any, common: dict[str, Any], results: list[Any] | None = None
    ) -> None:
        messages = body.get("messages") if "messages" in body else [body]
        for i, message in enumerate(messages):
            fields: dict[str, Any] = {
                "pub": message.get("publisher_id"),
                "seq": message.get("publisher_seq"),
                "mk": _mk_of(message),
                "i": i,
            }
            if phase == "invoke":
                fields |= {
                    "topic": message.get("topic"),
                    "qos": message.get("qos", 1),
                    "retain": bool(message.get("retain")),
                    "key": message.get("ordering_key"),
                }
                self.history.record("publish", phase="invoke", **common, **fields)
                continue
            result = results[i] if results is not None and i < len(results) else None
            if isinstance(result, dict) and "message_id" in result:
                self.history.record(
                    "publish",
                    phase="ok",
                    message_id=result["message_id"],
                    duplicate=bool(result.get("duplicate")),
                    storage_topic=result.get("storage_topic"),
                    partition=result.get("partition"),
                    **common,
                    **fields,
                )
            elif isinstance(result, dict) and isinstance(result.get("error"), dict):
                error = result["error"]
                self.history.record(
                    "publish",
                    phase="fail",
                    status=error.get("status"),
                    code=error.get("code"),
                    **common,
                    **fields,
                )
            else:
                self.history.record("publish", phase="info", error="no result", **common, **fields)

    def _record_failure(
        self, kind: str, body: Any, common: dict[str, Any], exc: ApiError, *, phase: str
    ) -> None:
        if kind in ("publish", "batch"):
            messages = body.get("messages") if "messages" in body else [body]
            error = {"error": {"status": exc.status, "code": exc.code}}
            self._record_publishes(
                phase if phase == "fail" else "info",
                body,
                common,
                [error] * len(messages) if phase == "fail" else [],
            )
        elif kind != "get" and (kind != "heartbeat" or self.record_heartbeats):
            self.history.record(kind, phase=phase, status=exc.status, code=exc.code, **common)

    def _record_answer(
        self, kind: str, body: Any, answer: Any, common: dict[str, Any], invoked: float
    ) -> None:
        answer = answer or {}
        if kind == "connect":
            self.history.record(
                "connect",
                phase="ok",
                channel=answer.get("channel"),
                session_present=bool(answer.get("session_present")),
                **common,
            )
        elif kind == "get":
            for raw in answer.get("messages") or []:
                self.history.record(
                    "deliver",
                    client=self.client_id,
                    transport="http",
                    conn=self.conn,
                    ti=round(invoked, 6),
                    **_delivery(raw),
                )
        elif kind == "ack":
            self.history.record("ack", phase="ok", acked=answer.get("acked"), **common)
        elif kind == "subscribe":
            self.history.record(
                "subscribe",
                phase="ok",
                granted=answer.get("granted"),
                **common,
                **_session_fields(kind, body),
            )
        elif kind in ("disconnect", "unsubscribe") or (
            kind == "heartbeat" and self.record_heartbeats
        ):
            self.history.record(kind, phase="ok", **common, **_session_fields(kind, body))
        elif kind in ("publish", "batch"):
            results = answer.get("results") if kind == "batch" else [answer]
            self._record_publishes("ok", body, common, list(results or []))


def _route(method: str, path: str) -> str | None:
    if path == "/v1/messages" and method == "POST":
        return "publish"
    if path == "/v1/messages:batch" and method == "POST":
        return "batch"
    if not path.startswith("/v1/sessions/"):
        return None
    rest = path[len("/v1/sessions/") :]
    if "/" not in rest:
        return {"PUT": "connect", "DELETE": "disconnect"}.get(method)
    suffix = rest.split("/", 1)[1]
    return {
        ("POST", "subscriptions"): "subscribe",
        ("POST", "unsubscribe"): "unsubscribe",
        ("GET", "messages"): "get",
        ("POST", "acks"): "ack",
        ("POST", "heartbeat"): "heartbeat",
    }.get((method, suffix))


def _session_fields(kind: str, body: Any) -> dict[str, Any]:
    body = body or {}
    if kind == "subscribe":
        return {
            "filters": [
                {"filter": s.get("filter"), "qos": s.get("qos", 1)}
                for s in body.get("subscriptions", [])
            ]
        }
    if kind == "unsubscribe":
        return {"filters": list(body.get("filters", []))}
    if kind == "ack":
        return {"ids": list(body.get("ids", []))}
    return {}


class _RecordedSocket:
    """A WebSocket connection with the soak's id, and a way to drop it without a close."""

    def __init__(self, inner: Socket, conn: str) -> None:
        self.inner = inner
        self.conn = conn

    def send(self, message: str) -> None:
        self.inner.send(message)

    def recv(self, timeout: float | None = None) -> str | bytes:
        return self.inner.recv(timeout)

    def close(self, code: int = 1000, reason: str = "") -> None:
        self.inner.close(code, reason)

    def abort(self) -> None:
        """Shut the TCP connection under it: no close frame, the server sees 1006."""
        raw = getattr(getattr(self.inner, "ws", None), "socket", None)
        if raw is not None:
            with contextlib.suppress(OSError):
                raw.shutdown(socket.SHUT_RDWR)


class RecordingWsClient(ShoalWsClient):
    """``ShoalWsClient`` whose connections, frames and pushed messages are recorded."""

    def __init__(self, *args: Any, history: History, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.history = history
        self._rx_conn: str | None = None
        #: the soak's id of the connection whose connect (or renew) was answered last
        self.conn: str | None = None
        #: acks sent with a ref and not answered yet: ref -> ids
        self._ack_refs: dict[str, list[str]] = {}

    def _open_socket(self) -> Socket:
        inner = super()._open_socket()
        return _RecordedSocket(inner, f"{self.client_id}/w{uuid.uuid4().hex[:12]}")

    @staticmethod
    def _conn_of(link: Link) -> str | None:
        return getattr(link.socket, "conn", None)

    def _ask_on(self, link: Link, frame: Mapping[str, Any]) -> dict[str, Any]:
        action = frame.get("action")
        if action not in ("connect", "renew", "subscribe", "unsubscribe", "disconnect"):
            return super()._ask_on(link, frame)
        common: dict[str, Any] = {
            "client": self.client_id,
            "conn": self._conn_of(link),
            "transport": "ws",
            "rq": uuid.uuid4().hex[:12],
        }
        fields: dict[str, Any] = {}
        if action == "connect":
            will, kept = _fresh_will(frame.get("will"))
            frame = {**frame, "will": will} if will else frame
            fields = {
                "clean_start": frame.get("clean_start"),
                "session_expiry_s": frame.get("session_expiry_s"),
                "keepalive_s": frame.get("keepalive_s"),
                "will": kept,
            }
        elif action == "subscribe":
            fields = _session_fields("subscribe", frame)
        elif action == "unsubscribe":
            fields = _session_fields("unsubscribe", frame)
        self.history.record(str(action), phase="invoke", **common, **fields)
        try:
            answer = super()._ask_on(link, frame)
        except ApiError as exc:
            # refused (a 4xx): not done; a 5xx or 429 (``_Busy`` holds one): done or not
            phase = "fail" if exc.status < 500 and exc.status != 429 else "info"
            self.history.record(str(action), phase=phase, code=exc.code, **common, **fields)
            raise
        except Exception as exc:
            # no answer (the connection lost, the answer late): done or not, nobody knows
            error = type(exc).__name__
            self.history.record(str(action), phase="info", error=error, **common, **fields)
            raise
        if action in {"connect", "renew"}:
            self.conn = common["conn"]
            fields = {
                "channel": answer.get("channel"),
                "session_present": bool(answer.get("session_present")),
            }
        elif action == "subscribe":
            fields["granted"] = answer.get("granted")
        self.history.record(str(action), phase="ok", **common, **fields)
        return answer

    def _receive_on(self, link: Link, timeout_s: float) -> bool:
        self._rx_conn = self._conn_of(link)
        return super()._receive_on(link, timeout_s)

    def _handle(self, frame: dict[str, Any]) -> None:
        ref = frame.get("ref")
        if isinstance(ref, str) and ref in self._ack_refs:
            ids = self._ack_refs.pop(ref)
            common = {"client": self.client_id, "conn": self._rx_conn, "rq": ref}
            if frame.get("action") == "acked":
                self.history.record("ack", phase="ok", acked=frame.get("acked"), **common)
                return
            code = (frame.get("error") or {}).get("code") if isinstance(frame, dict) else None
            self.history.record("ack", phase="fail", code=code, n=len(ids), **common)
        elif frame.get("action") in (None, "error"):
            # a frame refused or failed without naming ours: API Gateway's "Internal server
            # error", a throttle; which frame it was is not said (never its text: it is ours)
            error = frame["error"] if isinstance(frame.get("error"), dict) else {}
            self.history.record(
                "frame_error",
                client=self.client_id,
                conn=self._rx_conn,
                status=frame.get("status"),
                code=error.get("code"),
                message=str(frame.get("message"))[:80] if frame.get("message") else None,
            )
        super()._handle(frame)

    def _received(self, frame: dict[str, Any]) -> None:
        self.history.record(
            "deliver", client=self.client_id, transport="ws", conn=self._rx_conn, **_delivery(frame)
        )
        super()._received(frame)

    def _flush_acks(self, *, answered: bool = False) -> int:
        """The library's, with a ``ref`` on each ack frame (its answer says what counted)."""
        sent = 0
        while True:
            with self._lock:
                link = self._link
                if link is None or not self._acks:
                    return sent
                ids, last = self._acks.next_frame()
                ref = uuid.uuid4().hex[:12]
                self.history.record(
                    "ack",
                    phase="invoke",
                    client=self.client_id,
                    conn=self._conn_of(link),
                    rq=ref,
                    ids=ids,
                )
                self._ack_refs[ref] = list(ids)
                self._send_on(link, {"action": "ack", "ids": ids, "ref": ref})
                self._acks.sent(ids)
            sent += len(ids)
            if answered and last:
                # as the library does: a disconnect sent next must not overtake the last ack
                deadline = time.monotonic() + SETTLE_S
                with contextlib.suppress(Exception):
                    while ref in self._ack_refs and time.monotonic() < deadline:
                        self._receive_on(link, 0.2)

    def settle(self, timeout_s: float = SETTLE_S) -> None:
        """Send the acks pending and wait (at most ``timeout_s``) for their answers."""
        deadline = time.monotonic() + timeout_s
        with contextlib.suppress(Exception):
            self._flush_acks()
            while self._ack_refs and self._link is not None and time.monotonic() < deadline:
                self._receive_on(self._link, 0.2)

    def drop(self) -> str | None:
        """Drop the live connection without a close frame; its soak id (None if none)."""
        link = self._link
        if link is None or not isinstance(link.socket, _RecordedSocket):
            return None
        self.history.record("lost", client=self.client_id, conn=link.socket.conn, how="dropped")
        link.socket.abort()
        return link.socket.conn

    def abandon(self) -> None:
        """As a crashed process leaves it: no ack flushed, no goodbye; the state file let go."""
        self._closed = True
        self._stop.set()
        with contextlib.suppress(Exception):
            self.state.close()


# -- the roles ----------------------------------------------------------------------------------


@dataclass
class Context:
    """What every role of a worker shares."""

    url: str
    ws_url: str
    state_dir: Path
    token_files: dict[str, Path]
    history: History
    life: int
    seed: int
    #: no new traffic from here (publishers settle, will clients end cleanly)
    traffic_end: threading.Event = field(default_factory=threading.Event)
    #: stop: acks are settled and the clients closed (no DISCONNECT: sessions stay)
    stop: threading.Event = field(default_factory=threading.Event)
    #: the WebSocket clients live now, for a drop
    live_ws: dict[str, RecordingWsClient] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def rng(self, client: str) -> random.Random:
        return random.Random(f"{self.seed}/{client}/{self.life}")

    def http(self, spec: Mapping[str, Any], **kwargs: Any) -> RecordingHttpClient:
        return RecordingHttpClient(
            self.url,
            FileToken(self.token_files[spec.get("token", "main")]),
            client_id=spec["client"],
            publisher_id=spec["client"],
            state=self.state_dir / f"{spec['client']}.json",
            history=self.history,
            **kwargs,
        )

    def ws(self, spec: Mapping[str, Any]) -> RecordingWsClient:
        client = RecordingWsClient(
            self.ws_url,
            FileToken(self.token_files[spec.get("token", "main")]),
            client_id=spec["client"],
            state=self.state_dir / f"{spec['client']}.json",
            state_scope=self.url,
            flow=FlowControl(max_messages=WINDOW),
            history=self.history,
        )
        with self.lock:
            self.live_ws[spec["client"]] = client
        return client

    def forget(self, client: RecordingWsClient) -> None:
        with self.lock:
            if self.live_ws.get(client.client_id) is client:
                del self.live_ws[client.client_id]

    def error(self, spec: Mapping[str, Any], exc: BaseException) -> None:
        self.history.record(
            "client_error",
            client=spec["client"],
            error=type(exc).__name__,
            code=getattr(exc, "code", None),
        )

    def pause(self, seconds: float, *, until: threading.Event | None = None) -> bool:
        """Sleep, or less if ``until`` (default: stop) is set; whether it was set."""
        return (until or self.stop).wait(seconds)


def _consume(
    ctx: Context,
    spec: Mapping[str, Any],
    client: RecordingHttpClient | RecordingWsClient,
    seconds: float | None,
) -> None:
    """Receive (each message acked once the loop asks for the next) for ``seconds`` (None:
    until stopped)."""
    until = None if seconds is None else time.monotonic() + seconds
    while not ctx.stop.is_set():
        left_s = 2.0 if until is None else until - time.monotonic()
        if left_s <= 0:
            return
        step = client.clock.now_ms() + int(min(left_s, 2.0) * 1000)
        try:
            if isinstance(client, RecordingWsClient):
                for _ in client.messages(until_ms=step):
                    pass
            else:
                for _ in client.messages(max_messages=50, wait_ms=2000, until_ms=step):
                    pass
        except SessionTakenOver:
            continue  # the next call connects again (not clean)
        except ClientError as exc:
            ctx.error(spec, exc)
            ctx.pause(1.0)


def _close(ctx: Context, client: RecordingHttpClient | RecordingWsClient) -> None:
    if isinstance(client, RecordingWsClient):
        client.settle()
        ctx.forget(client)
    with contextlib.suppress(Exception):
        client.close()


def _subscribe(
    ctx: Context, spec: Mapping[str, Any], client: RecordingHttpClient | RecordingWsClient
) -> bool:
    while not ctx.stop.is_set():
        try:
            client.subscribe(list(spec["filters"]))
            return True
        except SessionTakenOver:
            continue
        except ClientError as exc:
            ctx.error(spec, exc)
            ctx.pause(1.0)
    return False


def _client_for(ctx: Context, spec: Mapping[str, Any]) -> RecordingHttpClient | RecordingWsClient:
    if spec.get("transport") == "ws":
        return ctx.ws(spec)
    return ctx.http(spec)


def subscriber(ctx: Context, spec: Mapping[str, Any]) -> None:
    """Subscribes (every life: subscribing again keeps the subscription) and consumes."""
    client = _client_for(ctx, spec)
    try:
        if _subscribe(ctx, spec, client):
            _consume(ctx, spec, client, None)
    finally:
        _close(ctx, client)


def group_member(ctx: Context, spec: Mapping[str, Any]) -> None:
    """An anchor stays in its group; a churning member joins, works a while, then leaves (an
    unsubscribe) or crashes (its connection dropped, its client abandoned without a word),
    and comes back."""
    if spec.get("anchor"):
        subscriber(ctx, spec)
        return
    rng = ctx.rng(spec["client"])
    while not ctx.stop.is_set():
        client = _client_for(ctx, spec)
        try:
            if not _subscribe(ctx, spec, client):
                return
            _consume(ctx, spec, client, rng.uniform(15, 45))
            if ctx.traffic_end.is_set():
                _consume(ctx, spec, client, None)
                return
            if rng.random() < 0.5:
                with contextlib.suppress(ClientError):
                    client.unsubscribe([spec["filters"][0]["filter"]])
                _consume(ctx, spec, client, 2)  # what was in flight
            elif isinstance(client, RecordingWsClient):
                client.drop()
                ctx.forget(client)
                client.abandon()
                client = None  # type: ignore[assignment]
            else:
                # an HTTP member that crashes just stops calling: its lease lapses
                client.record_lost("crashed")
                with contextlib.suppress(Exception):
                    client.state.close()
                client = None  # type: ignore[assignment]
        finally:
            if client is not None:
                _close(ctx, client)
        ctx.pause(rng.uniform(3, 10))


def prober(ctx: Context, spec: Mapping[str, Any]) -> None:
    """Subscribes to retained topics again and again: each subscribe gets their retained
    messages, and starts where it was made."""
    rng = ctx.rng(spec["client"])
    client = _client_for(ctx, spec)
    name = spec["filters"][0]["filter"]
    try:
        while not ctx.stop.is_set():
            if not _subscribe(ctx, spec, client):
                return
            _consume(ctx, spec, client, rng.uniform(8, 15))
            if ctx.traffic_end.is_set():
                _consume(ctx, spec, client, None)
                return
            try:
                client.unsubscribe([name])
            except ClientError as exc:
                ctx.error(spec, exc)
            _consume(ctx, spec, client, rng.uniform(2, 5))
    finally:
        _close(ctx, client)


@dataclass
class Topics:
    """Where a publisher publishes: a topic family and its ordering keys."""

    family: str
    keyed: bool

    def pick(self, rng: random.Random, n: int) -> tuple[str, str | None]:
        if self.family == "soak":
            area = rng.randrange(AREAS)
            topic, key = f"soak/a{area}/t{n % 3}", f"k{rng.randrange(6)}"
        elif self.family == "jobs":
            topic, key = f"jobs/{n % 5}", f"j{rng.randrange(6)}"
        elif self.family == "work":
            topic, key = f"work/{n % 5}", f"w{rng.randrange(4)}"
        elif self.family == "hooks":
            topic, key = f"hooks/{n % 4}", f"pk{rng.randrange(8)}"
        else:
            topic, key = f"retained/r{rng.randrange(4)}", None
        return topic, (key if self.keyed else None)


def publisher(ctx: Context, spec: Mapping[str, Any]) -> None:
    """An exactly-once publisher: single publishes or batches, keyed or not, at its rate; at
    the end of traffic it settles what it left in flight."""
    rng = ctx.rng(spec["client"])
    topics = Topics(str(spec["family"]), bool(spec.get("keyed")))
    qos = int(spec.get("qos", 1))
    retain = bool(spec.get("retain"))
    batch = int(spec.get("batch", 1))
    pace_s = batch / float(spec.get("rate", 1.0))
    client = ctx.http(spec, policy=CallRetry(attempts=4))
    n = 0
    try:
        while not ctx.traffic_end.is_set():
            began = time.monotonic()
            bodies = []
            for _ in range(batch):
                topic, key = topics.pick(rng, n)
                text = payload_text(mk=f"{spec['client']}.{ctx.life}.{n}")
                n += 1
                bodies.append(
                    Publishing.message_body(
                        topic, text=text, qos=qos, retain=retain, ordering_key=key
                    )
                )
            try:
                if batch == 1:
                    body = bodies[0]
                    client.publish(
                        body["topic"],
                        text=body["text"],
                        qos=qos,
                        retain=retain,
                        ordering_key=body.get("ordering_key"),
                    )
                else:
                    client.publish_many(bodies)
            except ClientError as exc:
                ctx.error(spec, exc)
                ctx.pause(1.0, until=ctx.traffic_end)
            ctx.pause(max(0.0, pace_s - (time.monotonic() - began)), until=ctx.traffic_end)
        for _ in range(20):
            try:
                client.finish_pending()
                break
            except ClientError as exc:
                ctx.error(spec, exc)
                ctx.pause(2.0)
    finally:
        with contextlib.suppress(Exception):
            client.close()


def _will(spec: Mapping[str, Any], rng: random.Random) -> dict[str, Any]:
    return {
        "topic": f"wills/{spec['client']}",
        "text": "-",
        "qos": 1,
        "retain": False,
        "delay_s": rng.choice(WILL_DELAYS_S),
    }


def _away_s(rng: random.Random, delay_s: float) -> float:
    """How long a will client stays away: within its delay (no will due) or well past it."""
    if delay_s >= 2 and rng.random() < 0.5:
        return rng.uniform(0.3, delay_s / 3)
    return delay_s + rng.uniform(WILL_KEEPALIVE_S * 2, WILL_KEEPALIVE_S * 4)


def will_ws(ctx: Context, spec: Mapping[str, Any]) -> None:
    """Connections with a will, each ended normally or dropped without a close (its will then
    due after its delay, unless the client comes back within it)."""
    rng = ctx.rng(spec["client"])
    client = ctx.ws(spec)
    try:
        while not ctx.stop.is_set() and not ctx.traffic_end.is_set():
            will = _will(spec, rng)
            try:
                client.connect(session_expiry_s=SESSION_EXPIRY_S, will=will)
                for _ in client.messages(
                    until_ms=client.clock.now_ms() + int(rng.uniform(5, 20) * 1000),
                    outages=Outages(forever=False),
                ):
                    pass
            except ClientError as exc:
                _lost_by_server(client)
                ctx.error(spec, exc)
                client._drop_link()
                ctx.pause(1.0)
                continue
            if ctx.traffic_end.is_set() or rng.random() < 0.4:
                with contextlib.suppress(ClientError):
                    client.disconnect()
                ctx.pause(rng.uniform(1, 4))
            else:
                client.drop()
                client._drop_link()
                ctx.pause(_away_s(rng, float(will["delay_s"])))
        if client.connection is not None:
            with contextlib.suppress(ClientError):
                client.disconnect()
    finally:
        _close(ctx, client)


def _lost_by_server(client: RecordingWsClient) -> None:
    """The connection went without the client asking (a server killed, a takeover)."""
    if client.conn is not None:
        client.history.record("lost", client=client.client_id, conn=client.conn, how="ended")


def will_http(ctx: Context, spec: Mapping[str, Any]) -> None:
    """HTTP channels with a will and a short keep-alive, each ended normally or left silent
    (the reaper then expires it and publishes its will after its delay, unless the client
    connects again within it)."""
    rng = ctx.rng(spec["client"])
    client = ctx.http(spec, record_heartbeats=True)
    try:
        while not ctx.stop.is_set() and not ctx.traffic_end.is_set():
            will = _will(spec, rng)
            try:
                client.connect(
                    session_expiry_s=SESSION_EXPIRY_S, keepalive_s=WILL_KEEPALIVE_S, will=will
                )
                stay_until = time.monotonic() + rng.uniform(5, 20)
                while time.monotonic() < stay_until and not ctx.traffic_end.is_set():
                    client.heartbeat()
                    ctx.pause(1.0)
            except ClientError as exc:
                ctx.error(spec, exc)
                client.connection = None
                ctx.pause(1.0)
                continue
            if ctx.traffic_end.is_set() or rng.random() < 0.4:
                with contextlib.suppress(ClientError):
                    client.disconnect()
                ctx.pause(rng.uniform(1, 4))
            else:
                client.record_lost("silent")
                client.connection = None
                ctx.pause(_away_s(rng, float(will["delay_s"])))
        if client.connection is not None:
            with contextlib.suppress(ClientError):
                client.disconnect()
    finally:
        with contextlib.suppress(Exception):
            client.close()


ROLES: dict[str, Callable[[Context, Mapping[str, Any]], None]] = {
    "subscriber": subscriber,
    "group_member": group_member,
    "prober": prober,
    "publisher": publisher,
    "will_ws": will_ws,
    "will_http": will_http,
}
