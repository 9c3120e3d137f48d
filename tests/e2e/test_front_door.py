"""The front door as a new user meets it: ``shoal dev`` over HTTP, every route, bad input.

Every body a function takes is refused with a coded 400 when it is not UTF-8, nests too deep
or holds a lone surrogate, and nothing changes; the principal is checked before anything about
a request's shape; a burst of clients is served without a reset.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.e2e.conftest import DevServer

pytestmark = pytest.mark.e2e

#: every route that takes a JSON body: (method, path, a body it accepts, whose token)
BODY_ROUTES = [
    ("POST", "/v1/topics", {"name": "fd-never", "partitions": 1}, "admin"),
    ("POST", "/v1/topics/default/storage-topics", {"partitions": 1}, "admin"),
    ("POST", "/v1/topics/default/switch-produce", {}, "admin"),
    ("POST", "/v1/messages", {"topic": "fd/x", "text": "t"}, "user"),
    ("POST", "/v1/messages:batch", {"messages": [{"topic": "fd/x", "text": "t"}]}, "user"),
    ("PUT", "/v1/sessions/fd-user", {"clean_start": False}, "user"),
    ("POST", "/v1/sessions/fd-user/subscriptions", {"subscriptions": []}, "user"),
    ("POST", "/v1/sessions/fd-user/unsubscribe", {"filters": []}, "user"),
    ("POST", "/v1/sessions/fd-user/acks", {"ids": []}, "user"),
    ("POST", "/v1/subscriptions", {"name": "fd-never"}, "admin"),
    ("PATCH", "/v1/subscriptions/fd-never", {"parallelism": 2}, "admin"),
    ("POST", "/v1/subscriptions/fd-never/seek", {"to": "earliest"}, "admin"),
    ("POST", "/v1/subscriptions/fd-never/dlq/redrive", {"ordering_keys": ["k"]}, "admin"),
]

BROKEN_BODIES = {
    "not UTF-8": b'{"name": "\xff\xfe\xfd"}',
    "nested 10,000 deep": b"[" * 10_000 + b"]" * 10_000,
    "objects nested 5,000 deep": b'{"a":' * 5_000 + b"1" + b"}" * 5_000,
}


class World:
    """The server, its tokens, a live session of ``fd-user`` and a way to see the state."""

    def __init__(self, dev: DevServer) -> None:
        self.dev = dev
        self.admin = dev.token("fd-ops", admin=True)
        self.user = dev.token("fd-user", clients=["fd-*"], publish=["#"], subscribe=["#"])
        status, answer = self.call("PUT", "/v1/sessions/fd-user", self.user, {"clean_start": True})
        assert status == 200
        self.channel = answer["channel"]
        status, _ = self.call(
            "POST",
            "/v1/sessions/fd-user/subscriptions",
            self.user,
            {"subscriptions": [{"filter": "fd/#", "qos": 1}]},
        )
        assert status == 200

    def token(self, who: str) -> str:
        return self.admin if who == "admin" else self.user

    def call(
        self, method: str, path: str, token: str | None, body: Any = None, **kw: Any
    ) -> tuple[int, Any]:
        headers = {"Shoal-Channel": self.channel} if hasattr(self, "channel") else {}
        headers.update(kw.pop("headers", {}))
        return self.dev.request(method, path, token=token, json=body, headers=headers, **kw)

    def raw(self, method: str, path: str, token: str, data: bytes) -> tuple[int, Any]:
        headers = {"Content-Type": "application/json", "Shoal-Channel": self.channel}
        return self.dev.request(method, path, token=token, body=data, headers=headers)

    def state(self) -> Any:
        """What a bad request could have changed, as the API shows it."""
        topics = self.call("GET", "/v1/topics", self.admin)
        session = self.call("GET", "/v1/sessions/fd-user", self.user)[1]
        session.pop("expires_at_ms", None)
        push = self.call("GET", "/v1/subscriptions/fd-never", self.admin)
        return topics, session, push


@pytest.fixture(scope="module")
def world(shared_dev: DevServer) -> World:
    return World(shared_dev)


@pytest.mark.parametrize("kind", sorted(BROKEN_BODIES))
def test_every_json_route_refuses_a_broken_body_and_changes_nothing(
    world: World, kind: str
) -> None:
    # Given the state before
    before = world.state()
    answers = {}
    # When every route that takes a body is sent one that is broken below any schema
    for method, path, _, who in BODY_ROUTES:
        status, body = world.raw(method, path, world.token(who), BROKEN_BODIES[kind])
        answers[f"{method} {path}"] = (status, body["error"]["code"])
    # Then each answers a coded 400, and nothing changed
    assert answers == {f"{m} {p}": (400, "malformed_json") for m, p, _, _ in BODY_ROUTES}
    assert world.state() == before


def with_surrogate(body: dict[str, Any], path: tuple[Any, ...]) -> bytes:
    """``body`` as JSON text with the string at ``path`` holding a lone surrogate escape."""
    marker = "@@SURROGATE@@"
    node: Any = body
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = f"a{marker}b"
    return json.dumps(body).replace(marker, "\\ud800").encode()


#: every string a route stores or sends on: (method, path, body, the field, whose token)
STORED_STRINGS: list[tuple[str, str, Callable[[], dict[str, Any]], tuple[Any, ...], str]] = [
    ("POST", "/v1/topics", lambda: {"name": "x", "partitions": 1}, ("name",), "admin"),
    ("POST", "/v1/messages", lambda: {"topic": "fd/x", "text": "t"}, ("topic",), "user"),
    ("POST", "/v1/messages", lambda: {"topic": "fd/x", "text": "t"}, ("text",), "user"),
    (
        "POST",
        "/v1/messages",
        lambda: {"topic": "fd/x", "text": "t", "ordering_key": "k"},
        ("ordering_key",),
        "user",
    ),
    (
        "POST",
        "/v1/messages",
        lambda: {"topic": "fd/x", "text": "t", "publisher_id": "p", "publisher_seq": 1},
        ("publisher_id",),
        "user",
    ),
    (
        "POST",
        "/v1/messages",
        lambda: {"topic": "fd/x", "text": "t", "properties": {"content_type": "c"}},
        ("properties", "content_type"),
        "user",
    ),
    (
        "POST",
        "/v1/messages",
        lambda: {"topic": "fd/x", "text": "t", "properties": {"user_properties": {"k": "v"}}},
        ("properties", "user_properties", "k"),
        "user",
    ),
    (
        "POST",
        "/v1/messages:batch",
        lambda: {"messages": [{"topic": "fd/x", "text": "t"}]},
        ("messages", 0, "text"),
        "user",
    ),
    (
        "PUT",
        "/v1/sessions/fd-user",
        lambda: {"clean_start": False, "will": {"topic": "fd/will", "text": "bye"}},
        ("will", "text"),
        "user",
    ),
    (
        "PUT",
        "/v1/sessions/fd-user",
        lambda: {"clean_start": False, "will": {"topic": "fd/will", "text": "bye"}},
        ("will", "topic"),
        "user",
    ),
    (
        "POST",
        "/v1/sessions/fd-user/subscriptions",
        lambda: {"subscriptions": [{"filter": "fd/y", "qos": 1}]},
        ("subscriptions", 0, "filter"),
        "user",
    ),
    (
        "POST",
        "/v1/sessions/fd-user/unsubscribe",
        lambda: {"filters": ["fd/#"]},
        ("filters", 0),
        "user",
    ),
    ("POST", "/v1/sessions/fd-user/acks", lambda: {"ids": ["m"]}, ("ids", 0), "user"),
    (
        "POST",
        "/v1/subscriptions",
        lambda: {"name": "fd-push", "filter": "fd/#", "endpoint": "http://127.0.0.1:9/x"},
        ("endpoint",),
        "admin",
    ),
    (
        "POST",
        "/v1/subscriptions",
        lambda: {"name": "fd-push", "filter": "fd/#", "endpoint": "http://127.0.0.1:9/x"},
        ("filter",),
        "admin",
    ),
    (
        "POST",
        "/v1/subscriptions/fd-never/dlq/redrive",
        lambda: {"ordering_keys": ["k"]},
        ("ordering_keys", 0),
        "admin",
    ),
]


def test_a_lone_surrogate_in_any_stored_string_is_refused_and_stores_nothing(
    world: World,
) -> None:
    before = world.state()
    answers = {}
    for method, path, body, field, who in STORED_STRINGS:
        # When the field holds "\ud800", which no UTF-8 text can carry
        status, answer = world.raw(method, path, world.token(who), with_surrogate(body(), field))
        error = answer["error"]
        answers[(path, field)] = (status, error["code"], error.get("field"))
    # Then each is a coded 400 naming the field
    assert answers == {
        (path, field): (400, "malformed_json", ".".join(str(p) for p in field))
        for _, path, _, field, _ in STORED_STRINGS
    }
    # and nothing was stored: no topic, no will, no subscription, no push subscription
    assert world.state() == before
    assert world.call("GET", "/v1/subscriptions/fd-push", world.admin)[0] == 404


#: every session-scoped route, and a way each can be malformed besides the missing channel
SESSION_CALLS = [
    ("GET", "/v1/sessions/fd-user", None, ""),
    ("DELETE", "/v1/sessions/fd-user", None, ""),
    ("POST", "/v1/sessions/fd-user/heartbeat", None, ""),
    ("GET", "/v1/sessions/fd-user/messages", None, "?max=banana"),
    ("POST", "/v1/sessions/fd-user/acks", {"ids": "not-a-list"}, ""),
    ("POST", "/v1/sessions/fd-user/subscriptions", {"subscriptions": 7}, ""),
    ("POST", "/v1/sessions/fd-user/unsubscribe", {"filters": 7}, ""),
    ("PUT", "/v1/sessions/fd-user", {"keepalive_s": "soon"}, ""),
]


@pytest.mark.parametrize("shape", ["no channel", "malformed"])
def test_another_principals_session_answers_403_whatever_the_shape(
    world: World, shape: str
) -> None:
    # Given a principal whose claims allow the client id, though another principal holds it,
    # and one whose claims do not allow it at all
    mallory = world.dev.token("fd-mallory", clients=["fd-*"], publish=["#"], subscribe=["#"])
    outsider = world.dev.token("fd-outsider", clients=["zz-*"])
    before = world.state()
    answers = {}
    for method, path, body, query in SESSION_CALLS:
        for name, token in (("mallory", mallory), ("outsider", outsider)):
            if shape == "no channel":
                # When it calls without a Shoal-Channel (connect needs none: a bad body instead)
                data = b'{"keepalive_s": "soon"}' if method == "PUT" else None
                status, answer = world.dev.request(method, path, token=token, body=data)
            else:
                # When it calls with a body or query that is malformed, and no channel
                payload = json.dumps(body).encode() if body is not None else None
                status, answer = world.dev.request(
                    method,
                    path + query,
                    token=token,
                    body=payload,
                    headers={"Content-Type": "application/json"},
                )
            answers[(name, method, path)] = (status, answer["error"]["code"])
    # Then every answer is 403: nothing tells a caller more about a session it may not touch
    assert set(answers.values()) == {(403, "forbidden")}
    assert world.state() == before


def test_the_owner_still_gets_400_for_its_own_malformed_calls(world: World) -> None:
    malformed = {"Shoal-Channel": "not-a-channel!"}
    status, answer = world.dev.request(
        "GET", "/v1/sessions/fd-user", token=world.user, headers=malformed
    )
    assert (status, answer["error"]["code"]) == (400, "invalid_request")
    # without the header at all, the owner gets the read-only view
    status, answer = world.dev.request("GET", "/v1/sessions/fd-user", token=world.user)
    assert (status, answer["channel"]) == (200, None)
    status, answer = world.call("GET", "/v1/sessions/fd-user/messages?max=banana", world.user)
    assert (status, answer["error"]["code"]) == (400, "invalid_request")


def test_128_concurrent_clients_are_all_answered(world: World) -> None:
    # Given 128 clients that start at once, each on its own connection
    dev = world.dev
    token = dev.token("fd-crowd", clients=["crowd-*"], publish=["crowd/#"], subscribe=["crowd/#"])
    host, port = dev.url.rsplit("/", 1)[1].split(":")
    barrier = threading.Barrier(128)
    outcomes: list[Any] = []

    def client(n: int) -> None:
        headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        barrier.wait()
        try:
            conn = http.client.HTTPConnection(host, int(port), timeout=120)

            def call(method: str, path: str, body: Any = None) -> Any:
                data = json.dumps(body).encode() if body is not None else None
                for _attempt in range(5):
                    conn.request(method, path, body=data, headers=headers)
                    response = conn.getresponse()
                    answer = json.loads(response.read() or b"null")
                    # 503 server_busy is an answer (the local runtime sheds a burst as Lambda
                    # throttles one): a client sends the request again
                    if response.status != 503:
                        break
                    time.sleep(1.0)
                outcomes.append(response.status)
                if response.status >= 300:
                    raise RuntimeError(f"{method} {path}: {response.status} {answer}")
                return answer

            # When each connects, publishes and gets
            channel = call("PUT", f"/v1/sessions/crowd-{n}", {"clean_start": True})["channel"]
            headers["Shoal-Channel"] = channel
            call("POST", "/v1/messages", {"topic": f"crowd/{n}", "text": "hi"})
            call("GET", f"/v1/sessions/crowd-{n}/messages?max=1")
            conn.close()
        except Exception as exc:
            outcomes.append(f"client {n}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=client, args=(n,)) for n in range(128)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    # Then no connection was reset and nothing failed (a failure is named, with its message:
    # on CI's machine 17 answers were missing once, and the comparison hid why)
    assert [o for o in outcomes if isinstance(o, str)] == []
    assert sorted(outcomes) == sorted([200, 201, 200] * 128)


def test_of_32_racing_connects_the_newest_is_answered_and_live(world: World) -> None:
    # Given 32 connects of one client id, racing, each with its own connect time
    dev = world.dev
    token = dev.token("fd-racer", clients=["fd-race"])
    barrier = threading.Barrier(32)
    answers: dict[int, tuple[int, Any]] = {}
    base = 1_700_000_000_000

    def connect(n: int) -> None:
        barrier.wait()
        try:
            answers[n] = dev.request(
                "PUT",
                "/v1/sessions/fd-race",
                token=token,
                json={"clean_start": False, "session_expiry_s": 60, "connected_at_ms": base + n},
                timeout=120,
            )
        except OSError as exc:
            answers[n] = (0, type(exc).__name__)

    threads = [threading.Thread(target=connect, args=(n,)) for n in range(32)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    # Then every request got an answer (none reset), the newest connect won,
    # and the others are outdated or taken over
    unexpected = {n: a for n, a in answers.items() if a[0] not in (200, 409, 503)}
    assert unexpected == {}
    status, newest = answers[31]
    if status == 503:
        # the registry's retries ran out under the race: a client retries, and then it wins
        status, newest = dev.request(
            "PUT",
            "/v1/sessions/fd-race",
            token=token,
            json={"clean_start": False, "session_expiry_s": 60, "connected_at_ms": base + 31},
        )
    assert status == 200
    status, session = dev.request(
        "GET", "/v1/sessions/fd-race", token=token, headers={"Shoal-Channel": newest["channel"]}
    )
    assert (status, session["channel"]) == (200, newest["channel"])
