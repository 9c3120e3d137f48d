"""AWS SDK clients: one per service and profile per process, made from one boto3 session.

Making a client parses the service's model files: tens of milliseconds and megabytes each
time, and a new boto3 session parses them again. One session per process, and one client per
(service, region, profile), keeps a cold start to a few such parses; under ``shoal dev``,
where every concurrent invocation of a function is a sandbox of its own, the sandboxes share
them (clients are thread-safe; making one is not, hence the lock).
"""

from __future__ import annotations

import threading
from typing import Any

import boto3
from botocore.config import Config as BotoConfig
from botocore.exceptions import ClientError

#: connections a client keeps per endpoint; ``shoal dev`` runs many invocations at once
MAX_POOL_CONNECTIONS = 64
#: the publish path's Kinesis writer never retries by itself and gives up on a call after at
#: most ``PUT_CALL_BOUND_MS`` (connect plus read timeout); Kinesis answers a put in tens of ms
PUT_CONNECT_TIMEOUT_S = 1
PUT_READ_TIMEOUT_S = 4
PUT_CALL_BOUND_MS = (PUT_CONNECT_TIMEOUT_S + PUT_READ_TIMEOUT_S) * 1000

PROFILES: dict[str, BotoConfig] = {
    # retries as the environment says (AWS_MAX_ATTEMPTS, AWS_RETRY_MODE)
    "default": BotoConfig(max_pool_connections=MAX_POOL_CONNECTIONS),
    # stream and mapping management: short timeouts, the SDK's standard retries
    "streams": BotoConfig(
        connect_timeout=2,
        read_timeout=5,
        retries={"mode": "standard"},
        max_pool_connections=MAX_POOL_CONNECTIONS,
    ),
    # the router's inbox writes: hundreds of items an invocation, all built by Shoal's own
    # code, so the SDK's client-side check of every value (a fifth of a batch write's time in
    # the profile of issue 15) buys nothing; DynamoDB still refuses a malformed request
    "hot_writer": BotoConfig(
        parameter_validation=False,
        max_pool_connections=MAX_POOL_CONNECTIONS,
    ),
    # puts of the publish path: a retried put after a timeout may store a record twice, so
    # only the publish path decides what to retry, and a call's duration is bounded
    "kinesis_writer": BotoConfig(
        connect_timeout=PUT_CONNECT_TIMEOUT_S,
        read_timeout=PUT_READ_TIMEOUT_S,
        retries={"mode": "standard", "total_max_attempts": 1},
        max_pool_connections=MAX_POOL_CONNECTIONS,
    ),
    # the WebSocket API's @connections: a push that fails loses nothing (the inbox holds the
    # delivery, redelivered with dup on reconnect or after the ack timeout), so it is not worth
    # waiting for, and never retried: a POST that was delivered but answered late would reach
    # the client twice, the second time without dup (seen over shoal dev under load)
    "connections": BotoConfig(
        connect_timeout=1,
        read_timeout=5,
        retries={"mode": "standard", "total_max_attempts": 1},
        max_pool_connections=MAX_POOL_CONNECTIONS,
    ),
}


def error_code(error: ClientError) -> str:
    """The service's error code of an SDK error (any AWS service)."""
    return str(error.response.get("Error", {}).get("Code", ""))


_lock = threading.Lock()
#: the process's one boto3 session (made on first use), and the clients made from it
_sessions: list[boto3.session.Session] = []
_clients: dict[tuple[str, str, str, str], Any] = {}


def client(
    service: str, region: str, profile: str = "default", *, endpoint_url: str | None = None
) -> Any:
    """The process's client of ``service`` in ``region`` with a profile of ``PROFILES``;
    ``endpoint_url`` for an API with one endpoint per resource (a WebSocket API's
    ``@connections``)."""
    key = (service, region, profile, endpoint_url or "")
    found = _clients.get(key)
    if found is not None:
        return found
    with _lock:
        if key not in _clients:
            if not _sessions:
                _sessions.append(boto3.session.Session())
            _clients[key] = _sessions[0].client(
                service,  # type: ignore[call-overload]
                region_name=region,
                config=PROFILES[profile],
                endpoint_url=endpoint_url,
            )
        return _clients[key]


def made_sessions() -> list[boto3.session.Session]:
    """The process's shared session, when it was made (none yet: an empty list)."""
    with _lock:
        return list(_sessions)


def reset() -> None:
    """Forget every client (tests that change the endpoint or credentials in between)."""
    with _lock:
        _clients.clear()
        _sessions.clear()
