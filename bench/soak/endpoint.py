"""The push subscription's endpoint: a local HTTP server that fails a share of requests.

Each message's fate is fixed by a digest of (seed, its soak key), never by the attempt, so a
message delivered again after a kill of the server meets the same answer and ends in one place
only (delivered, or dead-lettered):

- ``ok``: 200 at once;
- ``transient``: 503 on its first one or two attempts, then 200 (the subscription retries);
- ``reject``: 400 (not retried: dead-lettered at once), only on the ordering keys ``POISONED``;
- ``exhaust``: 503 always (dead-lettered when its attempts run out), only on those keys too.

Dead letters are kept to a few keys because an ordered subscription keeps a key's later
messages behind a dead-lettered one (they follow it into the DLQ until a redrive): spread over
every key, the DLQ would soon swallow everything.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote

from bench.soak.clients import payload_keys
from bench.soak.history import History

#: the ordering keys whose messages may be dead-lettered
POISONED = ("pk6", "pk7")
TRANSIENT_SHARE = 0.25
DEAD_SHARE = 0.15


def fate(seed: int, mk: str | None, key: str) -> tuple[str, int]:
    """(fate, failing attempts) of a message: see the module's docstring."""
    digest = hashlib.blake2b(f"{seed}/{mk}".encode(), digest_size=8).digest()
    roll = int.from_bytes(digest, "big") / 2**64
    if key in POISONED and roll < DEAD_SHARE:
        return ("reject", 0) if roll < DEAD_SHARE / 2 else ("exhaust", 0)
    if roll > 1 - TRANSIENT_SHARE:
        return "transient", 1 + digest[0] % 2
    return "ok", 0


class PushEndpoint:
    """``http://127.0.0.1:{port}/``: answers each push by its message's fate, records each."""

    def __init__(self, history: History, seed: int, name: str) -> None:
        self.history = history
        self.seed = seed
        self.name = name
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                status = endpoint.answer(raw, self.headers)
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                return  # quiet: the history has every request

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/"

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def answer(self, raw: bytes, headers: Any) -> int:
        try:
            body = json.loads(raw)
        except ValueError:
            body = {}
        mk = payload_keys(body).get("mk") if isinstance(body, dict) else None
        key = unquote(str(headers.get("Shoal-Ordering-Key") or ""))
        attempt = int(headers.get("Shoal-Attempt") or 1)
        kind, failing = fate(self.seed, mk, key)
        if kind == "reject":
            status = 400
        elif kind == "exhaust" or (kind == "transient" and attempt <= failing):
            status = 503
        else:
            status = 200
        self.history.record(
            "push_hit",
            name=self.name,
            mk=mk,
            message_id=headers.get("Shoal-Message-Id"),
            attempt=attempt,
            key=key,
            status=status,
            fate=kind,
        )
        return status
