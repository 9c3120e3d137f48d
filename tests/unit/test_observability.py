"""One metrics flush per invocation, counts kept apart between concurrent invocations and carried
into worker threads, and the service dimension a function's environment names."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from shoal.core import metrics
from shoal.core.observability import (
    InvocationMetrics,
    carried,
    count,
    gauge,
    invocation,
    lag,
    observed,
    service_scope,
    set_emf_writer,
)
from shoal.declarations import DEPLOYMENT, function_environment
from shoal.local.provision import LocalNames
from shoal.local.runtime import Functions, _Sandboxes

from tests.helpers import FakeContext


def lines(out: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in out.splitlines() if '"_aws"' in x]


def test_an_invocation_flushes_its_counts_once_with_worker_threads_counted_in(
    capsys: pytest.CaptureFixture[str],
) -> None:
    @observed
    def handler(event: dict[str, Any], context: Any) -> None:
        count(metrics.DELIVERED, 2)
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(carried(lambda n: count(metrics.ACKED, n)), [1, 2, 3]))
        lag(metrics.PUSH_LAG, 40)
        lag(metrics.PUSH_LAG, 25)  # the oldest record of the invocation is its lag

    with service_scope("push"):
        handler({}, FakeContext())
    [document] = lines(capsys.readouterr().out)
    assert document["service"] == "push"
    assert document[metrics.DELIVERED] == [2.0]
    assert document[metrics.ACKED] == [6.0]
    assert document[metrics.PUSH_LAG] == [40.0]
    units = {m["Name"]: m["Unit"] for m in document["_aws"]["CloudWatchMetrics"][0]["Metrics"]}
    assert units[metrics.PUSH_LAG] == "Milliseconds"


def test_concurrent_invocations_do_not_see_each_others_counts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    both = threading.Barrier(2)

    def invoke(service: str, n: int) -> None:
        with service_scope(service), invocation():
            count(metrics.PUBLISHED, n)
            both.wait()  # both invocations are open at once
            count(metrics.PUBLISHED, n)

    workers = [threading.Thread(target=invoke, args=a) for a in (("publish", 1), ("reaper", 5))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    found = {d["service"]: d[metrics.PUBLISHED] for d in lines(capsys.readouterr().out)}
    assert found == {"publish": [2.0], "reaper": [10.0]}


def test_counting_outside_an_invocation_and_an_invocation_without_counts_write_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    count(metrics.PUBLISHED, 3)  # a service called directly (tests, benchmarks, the pipeline)
    with invocation():
        count(metrics.PUBLISHED, 0)
    assert capsys.readouterr().out == ""


def test_a_flush_that_fails_fails_no_invocation(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(self: InvocationMetrics, service: str) -> None:
        raise ValueError("no EMF today")

    monkeypatch.setattr(InvocationMetrics, "document", broken)

    @observed
    def handler(event: dict[str, Any], context: Any) -> str:
        count(metrics.PUBLISHED)
        return "answered"

    assert handler({}, FakeContext()) == "answered"
    assert lines(capsys.readouterr().out) == []


def test_each_function_is_its_own_service_deployed_and_under_shoal_dev(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # deployed: the stack sets it in each function's environment
    assert {
        f.name: function_environment(f)["POWERTOOLS_SERVICE_NAME"] for f in DEPLOYMENT.functions
    } == {f.name: f.name for f in DEPLOYMENT.functions}
    # shoal dev: one process for every function, so the invocation names its function
    from shoal.core.observability import service_name

    monkeypatch.setattr(
        _Sandboxes, "acquire", lambda self, deadline=None: lambda event, context: service_name()
    )
    monkeypatch.setattr(_Sandboxes, "release", lambda self, handler: None)
    functions = Functions(DEPLOYMENT, LocalNames.for_deployment())
    assert functions.invoke_def(DEPLOYMENT.function("router"), {}) == "router"
    assert functions.invoke_def(DEPLOYMENT.function("messages"), {}) == "messages"


def test_gauges_go_in_a_document_of_their_own_per_extra_dimension(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Given an invocation that counts, and reports levels with and without a subscription
    @observed
    def handler(event: dict[str, Any], context: Any) -> None:
        count(metrics.PUBLISHED, 3)
        gauge(metrics.CONNECTIONS, 4)
        gauge(metrics.CONNECTIONS, 5)  # a level: the last report stands
        gauge(metrics.DEAD_LETTERS, 2, subscription="orders")
        gauge(metrics.DEAD_LETTERS, 0, subscription="audit")

    # When it ends
    with service_scope("reaper"):
        handler({}, FakeContext())
    documents = lines(capsys.readouterr().out)
    # Then the counts and plain levels share one document; each subscription has its own
    plain, *extra = documents
    assert plain["service"] == "reaper" and "subscription" not in plain
    assert plain[metrics.PUBLISHED] == [3.0] and plain[metrics.CONNECTIONS] == [5.0]
    by_subscription = {d["subscription"]: d[metrics.DEAD_LETTERS] for d in extra}
    assert by_subscription == {"orders": [2.0], "audit": [0.0]}
    for document in extra:
        [directive] = document["_aws"]["CloudWatchMetrics"]
        assert sorted(directive["Dimensions"][0]) == ["service", "subscription"]
        assert document["service"] == "reaper"


def test_an_emf_writer_takes_each_document_instead_of_stdout_when_metrics_are_disabled(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given shoal dev's settings: metrics disabled, a writer set (its CloudWatch)
    monkeypatch.setenv("POWERTOOLS_METRICS_DISABLED", "true")
    taken: list[dict[str, Any]] = []
    set_emf_writer(taken.append)
    try:

        @observed
        def handler(event: dict[str, Any], context: Any) -> None:
            count(metrics.PUBLISHED, 1)

        # When an invocation ends
        with service_scope("publish"):
            handler({}, FakeContext())
    finally:
        set_emf_writer(None)
    # Then the writer has its document, and stdout has no EMF line
    assert [d[metrics.PUBLISHED] for d in taken] == [[1.0]]
    assert taken[0]["service"] == "publish"
    assert lines(capsys.readouterr().out) == []
