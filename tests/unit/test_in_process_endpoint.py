"""The functions' ``@connections`` calls under ``shoal dev`` are answered in-process
(``shoal.local.transport.InProcessEndpoint``), whenever the process's shared SDK session was
made: the runtime makes it (provisioning, the emulator's first calls) before it knows the
gateway's URL and installs the endpoint."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
from shoal.aws import clients
from shoal.local.transport import Answer, InProcessEndpoint

#: nothing listens here: a post that went to the socket would fail to connect
URL = "http://127.0.0.1:9"


@pytest.fixture
def fresh_clients() -> Iterator[None]:
    clients.reset()
    yield
    clients.reset()


def test_a_post_from_a_session_made_before_the_install_is_answered_in_process(
    fresh_clients: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    seen: list[tuple[str, str, bytes]] = []

    def respond(method: str, path: str, body: bytes) -> Answer:
        seen.append((method, path, body))
        return 200, [], b""

    # Given the process's shared session made first (as the runtime's provisioning does)
    clients.client("sts", "us-east-1")
    endpoint = InProcessEndpoint(URL, respond)
    endpoint.install()
    try:
        # When a function makes its @connections client afterwards and posts a frame
        api = clients.client("apigatewaymanagementapi", "us-east-1", endpoint_url=URL)
        api.post_to_connection(ConnectionId="c1", Data=b"frame")
    finally:
        endpoint.uninstall()
    # Then the endpoint answered it, and no socket was tried
    assert seen == [("POST", "/@connections/c1", b"frame")]
    assert endpoint.calls == 1


def test_a_post_answered_in_process_skips_only_the_signature_arithmetic(
    fresh_clients: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing checks a post's signature in this process: it carries the credential scope, not
    a computed signature. A post to another endpoint is signed in full."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    signed: list[str] = []

    def keep(request: Any, **_: Any) -> None:
        signed.append(request.headers["Authorization"].decode())

    endpoint = InProcessEndpoint(URL, lambda method, path, body: (200, [], b""))
    endpoint.install()
    try:
        api = clients.client("apigatewaymanagementapi", "us-east-1", endpoint_url=URL)
        api.meta.events.register_first("before-send", keep)
        api.post_to_connection(ConnectionId="c1", Data=b"frame")
        elsewhere = clients.client(
            "apigatewaymanagementapi", "us-east-1", endpoint_url="http://127.0.0.1:7"
        )
        elsewhere.meta.events.register_first("before-send", keep)
        answered = InProcessEndpoint("http://127.0.0.1:7", lambda m, p, b: (200, [], b""))
        # answered by a handler of its own, so no socket is tried, but not installed: the
        # signer does not know it, as it knows no endpoint in another process
        elsewhere.meta.events.register("before-send", answered)
        elsewhere.post_to_connection(ConnectionId="c1", Data=b"frame")
    finally:
        endpoint.uninstall()
    assert signed[0].endswith("Signature=in-process")
    assert "/us-east-1/execute-api/aws4_request" in signed[0]
    assert re.search(r"Signature=[0-9a-f]{64}$", signed[1])
