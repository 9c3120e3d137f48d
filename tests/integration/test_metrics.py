"""The custom metrics a publish, the router and a get/ack emit, read back from the EMF lines
Powertools prints on stdout (what CloudWatch Logs turns into metrics), and what no log line
or dimension may hold: payloads, tokens, client ids."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from shoal.core import metrics
from shoal.core.observability import logger, service_scope

import functions.messages.app as messages_app
import functions.publish.app as publish_app
from tests.helpers import FakeContext, http_event, response_json
from tests.integration.test_delivery_support import ALICE, World, world

__all__ = ["world"]  # fixture

CLIENT = "alice-metered-7"
PAYLOAD = "reading-that-must-not-leak-42"
TOKEN = "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJhbGljZSJ9.c2lnbmF0dXJlLXNlY3JldA"


def emf_documents(out: str) -> list[dict[str, Any]]:
    """The EMF documents among stdout's lines."""
    found = []
    for line in out.splitlines():
        if line.startswith("{") and '"_aws"' in line:
            found.append(json.loads(line))
    return found


def values(document: dict[str, Any]) -> dict[str, float]:
    """Metric name -> value; one value per metric and invocation (counted per batch)."""
    [directive] = document["_aws"]["CloudWatchMetrics"]
    out = {}
    for metric in directive["Metrics"]:
        [value] = document[metric["Name"]]  # Powertools writes a list of values
        out[metric["Name"]] = value
    return out


def check_bounded(document: dict[str, Any], service: str) -> None:
    """Namespace Shoal, one dimension (the function's name), and nothing else in the line."""
    [directive] = document["_aws"]["CloudWatchMetrics"]
    assert directive["Namespace"] == metrics.NAMESPACE
    assert directive["Dimensions"] == [[metrics.DIMENSION]]
    assert document[metrics.DIMENSION] == service
    declared = set(metrics.COUNTS) | set(metrics.LAGS)
    assert set(values(document)) <= declared
    assert set(document) == {"_aws", metrics.DIMENSION, *values(document)}


@pytest.fixture
def log_lines() -> Iterator[io.StringIO]:
    """Every line the functions' logger writes, from DEBUG up, in its JSON form."""
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    handler.setFormatter(logger.registered_formatter)
    level = logger.log_level
    underlying = logging.getLogger(logger.service)  # the standard logger Powertools wraps
    underlying.addHandler(handler)
    logger.setLevel("DEBUG")
    try:
        yield buffer
    finally:
        underlying.removeHandler(handler)
        logger.setLevel(level)


def call(handler: Any, event: dict[str, Any]) -> tuple[int, Any]:
    # API Gateway passes the bearer token on to the function with the other headers
    event["headers"]["authorization"] = f"Bearer {TOKEN}"
    response = handler(event, FakeContext())
    return response["statusCode"], response_json(response)


def session_event(method: str, suffix: str, channel: str, **kw: Any) -> dict[str, Any]:
    return http_event(
        method,
        f"/v1/sessions/{CLIENT}{suffix}",
        claims=ALICE,
        headers={"Shoal-Channel": channel},
        route_key=f"{method} /v1/sessions/{{client_id}}{suffix}",
        path_parameters={"client_id": CLIENT},
        **kw,
    )


def test_publish_route_get_and_ack_count_once_per_invocation_without_payload_token_or_client(
    world: World,
    capsys: pytest.CaptureFixture[str],
    log_lines: io.StringIO,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    channel = world.connect(CLIENT)
    world.subscribe(CLIENT, channel, {"filter": "sensors/#", "qos": 1})
    capsys.readouterr()

    # a publish counts the message it accepted; its retry (same seq) is a duplicate: no count
    message = {
        "topic": "sensors/kitchen/temp",
        "text": PAYLOAD,
        "publisher_id": "p",
        "publisher_seq": 1,
    }
    with service_scope("publish"):
        for expected in (201, 200):
            status, _ = call(
                publish_app.handler, http_event("POST", "/v1/messages", body=message, claims=ALICE)
            )
            assert status == expected
    out = capsys.readouterr().out
    [published] = emf_documents(out)
    check_bounded(published, "publish")
    assert values(published) == {metrics.PUBLISHED: 1}

    # the router counts per batch, and the batch's lag from the records' arrival
    with service_scope("router"):
        world.route()
    router_out = capsys.readouterr().out
    routed = emf_documents(router_out)
    assert routed
    for document in routed:
        check_bounded(document, "router")
    assert sum(values(d).get(metrics.ROUTED, 0) for d in routed) == 1
    assert sum(values(d).get(metrics.DELIVERIES, 0) for d in routed) == 1
    assert all(values(d)[metrics.ROUTER_LAG] >= 0 for d in routed)

    # a get counts what it handed out, an ack what it acknowledged
    with service_scope("messages"):
        status, got = call(
            messages_app.handler, session_event("GET", "/messages", channel, query={"max": "10"})
        )
        assert status == 200 and len(got["messages"]) == 1
        status, acked = call(
            messages_app.handler,
            session_event("POST", "/acks", channel, body={"ids": [got["messages"][0]["id"]]}),
        )
        assert (status, acked) == (200, {"acked": 1})
        # an empty get counts nothing: no line at all
        status, _ = call(messages_app.handler, session_event("GET", "/messages", channel))
        assert status == 200
    out += capsys.readouterr().out
    handed, acknowledged = emf_documents(out)[1:]
    for document in (handed, acknowledged):
        check_bounded(document, "messages")
    assert values(handed) == {metrics.DELIVERED: 1}
    assert values(acknowledged) == {metrics.ACKED: 1}

    # `shoal dev` (metrics disabled): no EMF line on stdout, the document in the log at DEBUG
    monkeypatch.setenv("POWERTOOLS_METRICS_DISABLED", "true")
    with service_scope("publish"):
        status, _ = call(
            publish_app.handler,
            http_event("POST", "/v1/messages", body=message | {"publisher_seq": 2}, claims=ALICE),
        )
        assert status == 201
    quiet = capsys.readouterr().out
    assert emf_documents(quiet) == []
    [logged] = [json.loads(x) for x in log_lines.getvalue().splitlines() if '"metrics"' in x]
    assert (logged["level"], logged["service"]) == ("DEBUG", "shoal")
    check_bounded(logged["emf"], "publish")
    assert values(logged["emf"]) == {metrics.PUBLISHED: 1}

    # nothing secret or unbounded in any metric line or log line, from DEBUG up
    written = out + router_out + quiet + log_lines.getvalue()
    for secret in (PAYLOAD, TOKEN, CLIENT):
        assert secret not in written
