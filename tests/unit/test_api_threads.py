"""Concurrent requests in one process (as under shoal dev) each see their own event."""

from __future__ import annotations

import threading
from typing import Any

from shoal.http.resolver import lambda_handler, make_resolver

from tests.helpers import FakeContext, http_event, response_json

app = make_resolver()
inside = threading.Barrier(2)


@app.get("/v1/who/<name>")
def who(name: str) -> dict[str, Any]:
    # Both requests are inside their routes at once before either reads its event again.
    inside.wait(timeout=5)
    return {"name": name, "path": app.current_event.path}


handler = lambda_handler(app)


def test_two_concurrent_requests_keep_their_own_event() -> None:
    answers: dict[str, Any] = {}

    def call(name: str) -> None:
        response = handler(http_event("GET", f"/v1/who/{name}"), FakeContext())
        answers[name] = response_json(response)

    threads = [threading.Thread(target=call, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert answers == {
        "a": {"name": "a", "path": "/v1/who/a"},
        "b": {"name": "b", "path": "/v1/who/b"},
    }
