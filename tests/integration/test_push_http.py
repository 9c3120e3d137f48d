"""The requests-based deliverer against a real HTTP server on loopback."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from shoal.push.endpoint import EndpointPolicy, HttpDeliverer, delivery_request
from shoal.push.model import RetryPolicy

from tests.unit.test_push_support import message

Behaviour = Callable[[BaseHTTPRequestHandler], None]


def _ok(handler: BaseHTTPRequestHandler) -> None:
    handler.send_response(200)
    handler.end_headers()


class Server:
    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.behaviour: Behaviour = _ok
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                server.requests.append(
                    {
                        "path": self.path,
                        "headers": dict(self.headers),
                        "body": self.rfile.read(length),
                    }
                )
                server.behaviour(self)

            def log_message(self, *_: Any) -> None:
                return

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server()
    yield s
    s.close()


def deliverer(read_timeout_s: float = 1.0) -> HttpDeliverer:
    return HttpDeliverer(
        EndpointPolicy(allow_loopback_http=True),
        connect_timeout_s=1.0,
        read_timeout_s=read_timeout_s,
    )


def test_the_endpoint_gets_the_message_and_its_headers(server: Server) -> None:
    m = message(1, "key one")
    result = deliverer().deliver(delivery_request("orders", server.url + "/hook", m, 3))
    assert result.ok
    (got,) = server.requests
    assert got["headers"]["Shoal-Message-Id"] == m.message_id
    assert got["headers"]["Shoal-Attempt"] == "3"
    assert got["headers"]["Shoal-Ordering-Key"] == "key%20one"
    assert json.loads(got["body"])["id"] == m.message_id


def test_a_redirect_is_not_followed(server: Server) -> None:
    def redirect(h: BaseHTTPRequestHandler) -> None:
        if h.path == "/hook":
            h.send_response(307)
            h.send_header("Location", "/elsewhere")
            h.end_headers()
        else:
            h.send_response(200)
            h.end_headers()

    server.behaviour = redirect
    result = deliverer().deliver(delivery_request("o", server.url + "/hook", message(1), 1))
    assert result.status == 307
    assert [r["path"] for r in server.requests] == ["/hook"]


def test_a_huge_answer_is_not_read_to_its_end(server: Server) -> None:
    # Given an endpoint that announces 10 MB, sends 256 KB and then stalls
    def huge(h: BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Content-Length", str(10 * 1024 * 1024))
        h.end_headers()
        h.wfile.write(b"x" * 256 * 1024)
        h.wfile.flush()
        time.sleep(3)

    server.behaviour = huge
    # Then the delivery succeeds (it reads a bounded prefix), no read timeout
    result = deliverer().deliver(delivery_request("o", server.url, message(1), 1))
    assert result.status == 200


def test_a_slow_endpoint_times_out(server: Server) -> None:
    def slow(h: BaseHTTPRequestHandler) -> None:
        time.sleep(2)
        h.send_response(200)
        h.end_headers()

    server.behaviour = slow
    result = deliverer(read_timeout_s=0.5).deliver(delivery_request("o", server.url, message(1), 1))
    assert (result.ok, result.error) == (False, "timeout")


def test_no_listener_is_a_refused_connection_not_a_timeout(server: Server) -> None:
    # Given an endpoint where nothing listens (the port closed)
    url = server.url
    server.close()
    result = deliverer().deliver(delivery_request("o", url, message(1), 1))
    # Then the reason says so (the DLQ shows it), and it retries as a no-answer does
    assert result.error == "connection_refused"
    assert RetryPolicy().retries(result)


def test_a_refused_endpoint_is_not_called(server: Server) -> None:
    deployed = HttpDeliverer(EndpointPolicy())
    result = deployed.deliver(delivery_request("o", server.url, message(1), 1))
    assert result.error == "endpoint_refused"
    assert server.requests == []
