"""The functions' ``@connections`` calls under ``shoal dev`` are answered in-process
(``shoal.local.transport.InProcessEndpoint``), whenever the process's shared SDK session was
made: the runtime makes it (provisioning, the emulator's first calls) before it knows the
gateway's URL and installs the endpoint."""

from __future__ import annotations

from collections.abc import Iterator

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
