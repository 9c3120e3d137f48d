"""``GET /v1/metrics`` through the admin function over moto, its CloudWatch client stubbed
(botocore's ``Stubber``): the one ``GetMetricData`` the route sends, what it answers from
CloudWatch's results, and its refusals. The query's names against the stack's are in
``tests/infra/test_overview.py``."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from typing import Any

import boto3
import jsonschema
import pytest
from botocore.stub import Stubber
from shoal.composite.store import TopicStore
from shoal.core import metrics
from shoal.core.config import get_config
from shoal.overview import Overview, plan
from shoal.push.store import PushSubscriptionStore

import functions.admin.app as admin_app
from tests.helpers import FakeContext, http_event, response_json
from tests.integration.test_push_harness import PushHarness
from tests.unit.test_openapi import schema

ADMIN = {"sub": "ops", "shoal:admin": "true"}
NOW_MS = 1_796_421_450_000  # 2026-12-04 21:57:30 UTC


class Route:
    def __init__(self, harness: PushHarness, monkeypatch: pytest.MonkeyPatch) -> None:
        config = get_config()
        self.harness = harness
        self.cloudwatch = boto3.client("cloudwatch", region_name="us-east-1")
        self.stub = Stubber(self.cloudwatch)
        harness.clock.advance((NOW_MS - harness.clock.now_ms()) / 1000)
        self.overview = Overview(
            self.cloudwatch,
            config,
            TopicStore.from_config(config),
            PushSubscriptionStore.from_config(config, harness.clock),
            clock=harness.clock,
        )
        monkeypatch.setattr(admin_app, "overview", lambda: self.overview)

    def call(self, query: dict[str, str] | None = None, claims: Any = ADMIN) -> tuple[int, Any]:
        event = http_event(
            "GET", "/v1/metrics", claims=claims, query=query, route_key="GET /v1/metrics"
        )
        with self.stub:
            response = admin_app.handler(event, FakeContext())
        return response["statusCode"], response_json(response)


@pytest.fixture
def route(aws: boto3.Session, monkeypatch: pytest.MonkeyPatch) -> Iterator[Route]:
    yield Route(PushHarness(aws, monkeypatch), monkeypatch)


def _at(minute: int) -> dt.datetime:
    return dt.datetime(2026, 12, 4, 21, 43, tzinfo=dt.UTC) + dt.timedelta(minutes=minute)


def test_one_get_metric_data_fills_the_view_and_the_figures(route: Route) -> None:
    # Given a push subscription (its dead letters are a series) and what CloudWatch holds
    route.harness.subscribe("orders")
    expected = plan("15m", _at(14) + dt.timedelta(seconds=30), get_config(), ["orders"])
    by_query = {query_id: part for query_id, (_, part) in expected.queries.items()}

    def held(query_id: str) -> dict[str, Any]:
        part = by_query[query_id]
        service = dict(part.dimensions).get(metrics.DIMENSION)
        if (part.metric, service) == (metrics.PUBLISHED, "publish"):
            return {"Id": query_id, "Timestamps": [_at(13), _at(14)], "Values": [60.0, 6.0]}
        if part.metric == metrics.DEAD_LETTERS:
            return {"Id": query_id, "Timestamps": [_at(14)], "Values": [3.0]}
        if part.metric == "Errors" and dict(part.dimensions)["FunctionName"].endswith("-router"):
            return {"Id": query_id, "Timestamps": [_at(2)], "Values": [4.0]}
        return {"Id": query_id, "Timestamps": [], "Values": []}

    request = expected.request()
    route.stub.add_response(
        "get_metric_data",
        {"MetricDataResults": [held(q["Id"]) for q in request["MetricDataQueries"]]},
        request,
    )
    # When an admin asks for the last 15 minutes
    status, view = route.call({"range": "15m"})
    # Then the answer is what the one request's results say, in the documented shape
    assert status == 200, view
    route.stub.assert_no_pending_responses()
    jsonschema.validate(view, schema("Metrics"))
    charts = {c["id"]: {s["id"]: s for s in c["series"]} for c in view["charts"]}
    published = charts["messages"]["published"]
    assert (published["total"], published["values"][-2:]) == (66.0, [1.0, 0.1])
    assert charts["dead_letters"]["dead_letters:orders"]["latest"] == 3.0
    errors = {f["function"]: f["errors"] for f in view["functions"]}
    assert errors["router"] == 4 and errors["publish"] == 0
    assert view["figures"]["push_subscriptions"] == 1
    assert view["figures"]["topics"] >= 1 and view["figures"]["storage_topics"] >= 1
    assert view["figures"]["groups"] is None  # no census in the range


def test_a_throttled_cloudwatch_is_server_busy(route: Route) -> None:
    route.stub.add_client_error(
        "get_metric_data", service_error_code="Throttling", http_status_code=400
    )
    status, body = route.call()
    assert (status, body["error"]["code"]) == (503, "server_busy")


def test_a_range_it_does_not_know_is_refused_before_anything_is_asked(route: Route) -> None:
    status, body = route.call({"range": "1w"})
    assert (status, body["error"]["code"]) == (400, "invalid_range")
    route.stub.assert_no_pending_responses()


def test_a_non_admin_is_refused(route: Route) -> None:
    status, body = route.call(claims={"sub": "alice", "shoal:publish": "[#]"})
    assert (status, body["error"]["code"]) == (403, "forbidden")
