"""The WebSocket API's ``@connections`` management API: a frame posted to a connection, a
connection closed. API Gateway counts every post against the account's request rate: a post
refused as throttled is tried again here (``Connections.post``), never dropped silently."""

from __future__ import annotations

from typing import Any

from botocore.exceptions import ClientError

from shoal.aws import clients
from shoal.aws.clients import error_code
from shoal.core import metrics
from shoal.core.clock import Clock, SystemClock
from shoal.core.config import Config
from shoal.core.observability import count
from shoal.core.retry import backoff_s
from shoal.edge.frames import ServerDisconnectFrame, encode

GONE = "GoneException"

#: a throttled post is tried this many times in all, with exponential backoff and full
#: jitter between tries (``POST_BACKOFF_S`` doubling up to ``POST_BACKOFF_CAP_S``): at most
#: about 4 s of waiting, then the push returns its chunk to the queue
POST_ATTEMPTS = 6
POST_BACKOFF_S = 0.05
POST_BACKOFF_CAP_S = 2.0
#: what API Gateway answers a post past the account's request rate (429)
THROTTLED = frozenset({"LimitExceededException", "TooManyRequestsException", "ThrottlingException"})


class ConnectionGone(Exception):
    """The connection was closed (``@connections`` answered 410)."""


class PostThrottled(Exception):
    """``@connections`` kept refusing a post as throttled (``LimitExceededException``) past
    ``POST_ATTEMPTS``: the frame did not go; its delivery stays where the inbox has it."""


class Connections:
    """The WebSocket API's ``@connections`` management API."""

    def __init__(self, client: Any, clock: Clock | None = None) -> None:
        self.client = client
        #: sleeps between a throttled post's tries (injected: tests advance it)
        self.clock = clock or SystemClock()

    @classmethod
    def from_config(cls, config: Config, clock: Clock | None = None) -> Connections | None:
        if not config.connections_endpoint:
            return None
        return cls(
            clients.client(
                "apigatewaymanagementapi",
                config.region,
                "connections",
                endpoint_url=config.connections_endpoint,
            ),
            clock,
        )

    def post(self, connection_id: str, frame: str) -> None:
        """One frame to the connection. API Gateway counts every post against the account's
        request rate, shared by every API of the region, and refuses past it (429): such a
        post is tried again after a jittered, growing wait (never dropped silently), up to
        ``POST_ATTEMPTS``, then ``PostThrottled``. A 429 took nothing, so a try again never
        sends a frame twice (the client itself is not retried: ``clients.PROFILES``)."""
        data = frame.encode()
        for attempt in range(POST_ATTEMPTS):
            try:
                self.client.post_to_connection(ConnectionId=connection_id, Data=data)
                return
            except ClientError as exc:
                code = error_code(exc)
                if code == GONE:
                    raise ConnectionGone(connection_id) from exc
                if code not in THROTTLED:
                    raise
                count(metrics.POSTS_THROTTLED)
                if attempt + 1 == POST_ATTEMPTS:
                    raise PostThrottled(connection_id) from exc
                self.clock.sleep(backoff_s(attempt, POST_BACKOFF_S, POST_BACKOFF_CAP_S))

    def close(self, connection_id: str) -> None:
        """Closes the connection (API Gateway then invokes ``$disconnect``); a gone one is
        closed already."""
        try:
            self.client.delete_connection(ConnectionId=connection_id)
        except ClientError as exc:
            if error_code(exc) != GONE:
                raise

    def disconnect(self, connection_id: str, reason: str, ref: str | None = None) -> None:
        """Sends the service's ``disconnect`` frame, then closes the connection (MQTT 5
        §3.14: the server's DISCONNECT, then the network connection is closed)."""
        try:
            self.post(connection_id, encode(ServerDisconnectFrame(reason=reason, ref=ref)))  # type: ignore[arg-type]
        except ConnectionGone:
            return
        except PostThrottled:
            pass  # closed all the same: the client learns why from its close
        self.close(connection_id)
