"""The push handlers as Lambda invokes them: status codes, error codes, answers fit the spec."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import boto3
import jsonschema
import pytest

import functions.push.app as push_app
import functions.pushadmin.app as admin_app
from tests.helpers import FakeContext, http_event, load_event, response_json
from tests.integration.test_push_harness import PushHarness
from tests.unit.test_openapi import schema
from tests.unit.test_push_support import Switch

ADMIN = {"sub": "ops", "shoal:admin": "true"}
ALICE = {"sub": "alice", "shoal:publish": "[#]"}
BODY = {"name": "orders", "filter": "orders/#", "endpoint": "https://example.com/hook"}


@pytest.fixture
def harness(aws: boto3.Session, monkeypatch: pytest.MonkeyPatch) -> Iterator[PushHarness]:
    h = PushHarness(aws, monkeypatch)
    monkeypatch.setattr(admin_app, "service", lambda: h.admin)
    monkeypatch.setattr(push_app, "service", lambda: h.consumer)
    yield h


def call(
    method: str,
    path: str,
    body: Any = None,
    *,
    claims: dict[str, Any] | None = None,
    query: dict[str, str] | None = None,
    name: str | None = None,
) -> tuple[int, Any]:
    route = path if name is None else path.replace(name, "{name}")
    event = http_event(
        method,
        path,
        body=body,
        claims=ADMIN if claims is None else claims,
        query=query,
        route_key=f"{method} {route}",
        path_parameters={"name": name} if name else None,
    )
    response = admin_app.handler(event, FakeContext())
    return response["statusCode"], response_json(response)


def test_the_sample_create_event_makes_a_subscription(harness: PushHarness) -> None:
    response = admin_app.handler(load_event("push_admin_create.json"), FakeContext())
    assert response["statusCode"] == 201
    doc = response_json(response)
    jsonschema.validate(doc, schema("PushSubscriptionState"))
    assert (doc["name"], doc["parallelism"]) == ("orders-webhook", 2)


def test_a_non_admin_is_forbidden(harness: PushHarness) -> None:
    status, body = call("POST", "/v1/subscriptions", BODY, claims=ALICE)
    assert (status, body["error"]["code"]) == (403, "forbidden")


@pytest.mark.parametrize(
    ("change", "code"),
    [
        ({"name": "a.b"}, "invalid_subscription_name"),
        ({"filter": "orders/#/x"}, "invalid_filter"),
        ({"endpoint": "http://example.com/"}, "invalid_endpoint"),
        ({"retry": {"max_attempts": 0}}, "invalid_retry_policy"),
        ({"parallelism": 11}, "invalid_parallelism"),
        ({"ordered": "yes"}, "invalid_request"),
        ({"surprise": 1}, "invalid_request"),
    ],
)
def test_bad_input_is_a_coded_400_that_changes_nothing(
    harness: PushHarness, change: dict[str, Any], code: str
) -> None:
    status, body = call("POST", "/v1/subscriptions", BODY | change)
    assert (status, body["error"]["code"]) == (400, code)
    jsonschema.validate(body, schema("Error"))
    status, _ = call("GET", "/v1/subscriptions/orders", name="orders")
    assert status == 404


def test_the_admin_routes_answer_as_documented(harness: PushHarness) -> None:
    # Given a subscription with one dead-lettered message
    status, _ = call("POST", "/v1/subscriptions", BODY | {"retry": {"max_attempts": 1}})
    assert status == 201
    assert call("POST", "/v1/subscriptions", BODY)[0] == 409
    harness.endpoint.respond = Switch("k")
    harness.publish("k", 1)
    harness.drain()
    # Then each route answers with its documented shape
    status, described = call("GET", "/v1/subscriptions/orders", name="orders")
    assert status == 200 and described["dlq_depth"] == 1
    jsonschema.validate(described, schema("PushSubscriptionState"))
    status, page = call("GET", "/v1/subscriptions/orders/dlq", name="orders", query={"limit": "5"})
    assert status == 200
    for letter in page["messages"]:
        jsonschema.validate(letter, schema("DeadLetter"))
    bad_page = call("GET", "/v1/subscriptions/orders/dlq", name="orders", query={"after": "!!"})
    assert (bad_page[0], bad_page[1]["error"]["code"]) == (400, "invalid_cursor")
    status, report = call(
        "POST", "/v1/subscriptions/orders/dlq/redrive", {"ordering_keys": ["k"]}, name="orders"
    )
    assert status == 200 and report["redriven"] == 1
    jsonschema.validate(report, schema("RedriveReport"))
    status, body = call(
        "POST", "/v1/subscriptions/orders/dlq/redrive", {"message_ids": "x"}, name="orders"
    )
    assert (status, body["error"]["code"]) == (400, "invalid_redrive")
    status, sought = call("POST", "/v1/subscriptions/orders/seek", {"to": "latest"}, name="orders")
    assert status == 200 and sought["generation"] == 1
    status, body = call("POST", "/v1/subscriptions/orders/seek", {"to": 3}, name="orders")
    assert (status, body["error"]["code"]) == (400, "invalid_seek")
    status, patched = call("PATCH", "/v1/subscriptions/orders", {"parallelism": 4}, name="orders")
    assert status == 200 and patched["parallelism"] == 4
    status, body = call("PATCH", "/v1/subscriptions/orders", {"parallelism": 0}, name="orders")
    assert (status, body["error"]["code"]) == (400, "invalid_parallelism")
    assert call("DELETE", "/v1/subscriptions/orders", name="orders")[0] == 204
    status, body = call("DELETE", "/v1/subscriptions/orders", name="orders")
    assert (status, body["error"]["code"]) == (404, "subscription_not_found")


def test_a_tap_batch_without_subscriptions_is_done(harness: PushHarness) -> None:
    # Given the sample batch of a storage stream no push subscription reads
    response = push_app.handler(load_event("push_tap_batch.json"), FakeContext())
    assert response == {"batchItemFailures": []}
    assert harness.endpoint.calls == []


def test_a_retry_batch_of_an_unknown_subscription_is_dropped(harness: PushHarness) -> None:
    response = push_app.handler(load_event("push_retry_batch.json"), FakeContext())
    assert response == {"batchItemFailures": []}
    assert harness.endpoint.calls == []


def test_the_list_pages_through_every_subscription_and_no_tap(harness: PushHarness) -> None:
    # Given no subscription yet: an empty page, the last one
    assert call("GET", "/v1/subscriptions") == (200, {"subscriptions": [], "next_page_token": None})
    # and then one made through the API (its push tap item shares the table) and four more
    assert call("POST", "/v1/subscriptions", BODY)[0] == 201
    made = harness.admin.subscriptions.require("orders")
    assert [harness.admin.subscriptions.tap(stream) is not None for stream in made.cursors] == [
        True
    ]
    spec = made.spec
    for n in range(4):
        assert harness.admin.subscriptions.create(f"more-{n}", spec, 1, 1, [])
    # When it is read two at a time, each page token given back
    names: list[str] = []
    token: str | None = None
    pages = 0
    while True:
        query = {"limit": "2"} | ({"page_token": token} if token else {})
        status, page = call("GET", "/v1/subscriptions", query=query)
        assert status == 200
        jsonschema.validate(page, schema("PushSubscriptionPage"))
        assert len(page["subscriptions"]) <= 2
        names += [s["name"] for s in page["subscriptions"]]
        pages += 1
        token = page["next_page_token"]
        if token is None:
            break
    # Then every subscription comes once, the tap never, each without the per-key depths
    assert sorted(names) == ["more-0", "more-1", "more-2", "more-3", "orders"]
    assert pages >= 3
    status, whole = call("GET", "/v1/subscriptions")
    orders = next(s for s in whole["subscriptions"] if s["name"] == "orders")
    assert orders == {
        k: v
        for k, v in call("GET", "/v1/subscriptions/orders", name="orders")[1].items()
        if k not in {"blocked_keys", "blocked_key_count", "retry_depth", "dlq_depth"}
    }


def test_the_list_refuses_a_non_admin_and_bad_paging(harness: PushHarness) -> None:
    # one harness for every case: each costs one handler call
    cases: list[tuple[dict[str, str], Any, int, str]] = [
        ({}, ALICE, 403, "forbidden"),
        ({"limit": "0"}, None, 400, "invalid_request"),
        ({"limit": "101"}, None, 400, "invalid_request"),
        ({"limit": "ten"}, None, 400, "invalid_request"),
        ({"page_token": "!!"}, None, 400, "invalid_cursor"),
        ({"page_token": "e30"}, None, 400, "invalid_cursor"),  # "{}"
    ]
    for query, claims, status, code in cases:
        answer = call("GET", "/v1/subscriptions", claims=claims, query=query)
        assert (answer[0], answer[1]["error"]["code"]) == (status, code), query
        jsonschema.validate(answer[1], schema("Error"))
