"""A fake Shoal for the client's tests: the API's publish and session routes, in memory.

``FakeShoal.handle`` answers one request as the API contract says (publisher sequences,
channels, subscriptions, get/ack with redelivery on reconnect). ``transport(fake)`` is a
``requests.Session`` whose adapter calls it directly and can inject faults; ``serve(fake)``
puts it behind a real HTTP server on 127.0.0.1 for the CLI.
"""

from __future__ import annotations

import base64
import json
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import requests
import shoal.topics.filters as topics
from requests.adapters import BaseAdapter


class Crash(BaseException):
    """The client process dies here (no except clause of the client sees it)."""


@dataclass
class Fault:
    """What happens to the next request whose ``"METHOD /path"`` starts with ``route``.

    kind: ``refuse`` (connection refused, nothing done), ``lose`` (done, the answer lost),
    ``crash`` (done, then the client dies), ``crash_before`` (the client dies before sending),
    or an HTTP status answered without doing anything (``code`` names the error).
    """

    route: str
    kind: str | int
    code: str = "server_busy"
    headers: dict[str, str] = field(default_factory=dict)
    #: the answer's body as it is, instead of Shoal's error frame (API Gateway's own answers)
    body: Any = None


@dataclass
class FakeSession:
    channel: str
    subscriptions: dict[str, int] = field(default_factory=dict)
    inbox: list[dict[str, Any]] = field(default_factory=list)
    in_flight: dict[str, dict[str, Any]] = field(default_factory=dict)
    acked: set[str] = field(default_factory=set)


def _error(status: int, code: str, **details: Any) -> tuple[int, Any]:
    return status, {"error": {"code": code, "message": code.replace("_", " "), **details}}


class FakeShoal:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.published: list[dict[str, Any]] = []
        self.publishers: dict[str, dict[int, str]] = {}
        self.sessions: dict[str, FakeSession] = {}
        self.requests: list[str] = []
        self.headers: list[dict[str, str]] = []
        self.bodies: list[Any] = []
        self.faults: list[Fault] = []

    # -- test helpers --

    def fail(self, route: str, kind: str | int, times: int = 1, **options: Any) -> None:
        self.faults.extend(Fault(route, kind, **options) for _ in range(times))

    def texts(self) -> list[str]:
        return [m["text"] for m in self.published]

    def bodies_of(self, route: str) -> list[Any]:
        return [b for r, b in zip(self.requests, self.bodies, strict=True) if r.startswith(route)]

    def take_fault(self, route: str) -> Fault | None:
        for n, fault in enumerate(self.faults):
            if route.startswith(fault.route):
                return self.faults.pop(n)
        return None

    # -- the API --

    def handle(
        self, method: str, path: str, query: dict[str, str], headers: dict[str, str], body: Any
    ) -> tuple[int, Any]:
        with self.lock:
            if path == "/v1/messages" and method == "POST":
                return self._publish(body)
            if path == "/v1/messages:batch" and method == "POST":
                return self._publish_batch(body)
            parts = path.split("/")
            if parts[:3] != ["", "v1", "sessions"] or len(parts) < 4:
                return _error(404, "route_not_found")
            client_id = unquote(parts[3])
            action = parts[4] if len(parts) > 4 else ""
            if (method, action) == ("PUT", ""):
                return self._connect(client_id, body)
            session = self.sessions.get(client_id)
            channel = {k.lower(): v for k, v in headers.items()}.get("shoal-channel")
            if session is None or channel != session.channel:
                return _error(409, "session_taken_over")
            return self._session_call(session, method, action, query, body)

    def _publish_batch(self, body: dict[str, Any]) -> tuple[int, Any]:
        results = []
        for message in body["messages"]:
            status, answer = self._publish(message)
            if status >= 400:
                answer["error"]["status"] = status
            results.append(answer)
        return 200, {"results": results}

    def _publish(self, body: dict[str, Any]) -> tuple[int, Any]:
        topic = body["topic"]
        if not topics.is_publishable_topic(topic):
            return _error(400, "invalid_topic")
        seqs = self.publishers.setdefault(body["publisher_id"], {})
        seq = body["publisher_seq"]
        last = max(seqs, default=0)
        if seq <= last:
            answer = {"message_id": seqs[seq], "topic": topic, "duplicate": True}
            return 200, answer | {"storage_topic": "default-0", "partition": 0}
        if seq != last + 1:
            return _error(409, "publisher_seq_gap", expected=last + 1)
        message_id = f"m{len(self.published) + 1}"
        seqs[seq] = message_id
        text = body.get("text")
        payload = body.get("payload") or base64.b64encode(str(text).encode()).decode()
        if text is None:
            text = base64.b64decode(payload).decode(errors="replace")
        message = {"id": message_id, "topic": topic, "text": text, "qos": body.get("qos", 1)}
        self.published.append(message)
        for session in self.sessions.values():
            matched = [f for f in session.subscriptions if topics.matches(f, topic)]
            if matched:
                qos = min(message["qos"], max(session.subscriptions[f] for f in matched))
                session.inbox.append(
                    {
                        "id": message_id,
                        "topic": topic,
                        "payload": payload,
                        "qos": qos,
                        "retain": False,
                        "dup": False,
                        "subscription": matched[0],
                        "properties": {},
                        "published_at": 0,
                    }
                )
        answer = {"message_id": message_id, "topic": topic, "duplicate": False}
        return 201, answer | {"storage_topic": "default-0", "partition": 0}

    def _connect(self, client_id: str, body: dict[str, Any]) -> tuple[int, Any]:
        channel = uuid.uuid4().hex
        session = self.sessions.get(client_id)
        present = session is not None and not body.get("clean_start", True)
        if session is None or not present:
            session = self.sessions[client_id] = FakeSession(channel)
        else:
            session.channel = channel
            self.redeliver(client_id)
        answer = {"session_present": present, "channel": channel, "keepalive_s": 60}
        return 200, answer | {"keepalive_s": body.get("keepalive_s", 60)}

    def redeliver(self, client_id: str) -> None:
        """Unacked messages go back to the front of the inbox, marked dup (as on reconnect)."""
        session = self.sessions[client_id]
        again = [m | {"dup": True} for m in session.in_flight.values()]
        session.in_flight.clear()
        session.inbox[:0] = again

    def _session_call(
        self, session: FakeSession, method: str, action: str, query: dict[str, str], body: Any
    ) -> tuple[int, Any]:
        if (method, action) == ("DELETE", ""):
            return 204, None
        if (method, action) == ("POST", "heartbeat"):
            return 200, {"leases": []}
        if (method, action) == ("POST", "subscriptions"):
            for item in body["subscriptions"]:
                session.subscriptions[item["filter"]] = item["qos"]
            return 200, {"granted": [item["qos"] for item in body["subscriptions"]]}
        if (method, action) == ("POST", "unsubscribe"):
            for item in body["filters"]:
                session.subscriptions.pop(item, None)
            return 200, {}
        if (method, action) == ("GET", "messages"):
            batch: list[Any] = []
            while session.inbox and len(batch) < int(query.get("max", 10)):
                message = session.inbox.pop(0)
                if message["id"] in session.acked:
                    continue
                batch.append(message)
                if message["qos"] > 0:
                    session.in_flight[message["id"]] = message
            return 200, {"messages": batch}
        if (method, action) == ("POST", "acks"):
            acked = [i for i in body["ids"] if session.in_flight.pop(i, None) is not None]
            session.acked.update(body["ids"])
            return 200, {"acked": len(acked)}
        return _error(404, "route_not_found")


class FakeAdapter(BaseAdapter):
    """requests' transport into a FakeShoal, with the faults it was told to inject."""

    def __init__(self, fake: FakeShoal) -> None:
        super().__init__()
        self.fake = fake
        self.timeouts: list[Any] = []
        # a client that crashed sends nothing more (no cleanup code runs in a killed process)
        self.dead = False

    def send(  # type: ignore[override]
        self, request: requests.PreparedRequest, timeout: Any = None, **_: Any
    ) -> requests.Response:
        url = urlsplit(request.url or "")
        route = f"{request.method} {url.path}"
        if self.dead:
            raise Crash(route)
        self.timeouts.append(timeout)
        body = json.loads(request.body) if request.body else None
        self.fake.requests.append(route)
        self.fake.headers.append(dict(request.headers))
        self.fake.bodies.append(body)
        fault = self.fake.take_fault(route)
        if fault is not None and fault.kind == "refuse":
            raise requests.ConnectionError("connection refused")
        if fault is not None and fault.kind == "crash_before":
            self.dead = True
            raise Crash(route)
        if fault is not None and isinstance(fault.kind, int):
            status, answer = _error(fault.kind, fault.code)
            if fault.body is not None:
                answer = fault.body
            return self._response(request, status, answer, fault.headers)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        status, answer = self.fake.handle(
            request.method or "GET", url.path, query, dict(request.headers), body
        )
        if fault is not None and fault.kind == "lose":
            raise requests.ReadTimeout("the answer was lost")
        if fault is not None and fault.kind == "cut":
            # the server died while it sent the body: requests reads it and finds it short
            return self._cut(request, status)
        if fault is not None and fault.kind == "crash":
            self.dead = True
            raise Crash(route)
        return self._response(request, status, answer, {})

    @staticmethod
    def _response(
        request: requests.PreparedRequest, status: int, answer: Any, headers: dict[str, str]
    ) -> requests.Response:
        response = requests.Response()
        response.status_code = status
        response._content = json.dumps(answer).encode() if answer is not None else b""
        response.headers.update({"Content-Type": "application/json", **headers})
        response.request = request
        response.url = request.url or ""
        return response

    @staticmethod
    def _cut(request: requests.PreparedRequest, status: int) -> requests.Response:
        from urllib3.exceptions import IncompleteRead, ProtocolError

        class CutBody:
            def stream(self, *_: Any, **__: Any) -> Iterator[bytes]:
                yield b'{"mess'
                raise ProtocolError("Connection broken", IncompleteRead(6, 15))

        response = requests.Response()
        response.status_code = status
        response.raw = CutBody()
        response.headers.update({"Content-Type": "application/json"})
        response.request = request
        response.url = request.url or ""
        return response

    def close(self) -> None:
        pass


def transport(fake: FakeShoal) -> tuple[requests.Session, FakeAdapter]:
    session = requests.Session()
    adapter = FakeAdapter(fake)
    session.mount("http://", adapter)
    return session, adapter


@contextmanager
def serve(fake: FakeShoal) -> Iterator[str]:
    """The fake behind a real HTTP server on a free loopback port; yields its URL."""

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            url = urlsplit(self.path)
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            fake.requests.append(f"{self.command} {url.path}")
            fake.headers.append(dict(self.headers))
            body = json.loads(raw) if raw else None
            fake.bodies.append(body)
            status, answer = fake.handle(self.command, url.path, query, dict(self.headers), body)
            data = json.dumps(answer).encode() if answer is not None else b""
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PUT = do_DELETE = _answer

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
