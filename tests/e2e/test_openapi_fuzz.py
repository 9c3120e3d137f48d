"""docs/openapi.yaml against a running ``shoal dev``: every answer documented, no 5xx ever.

For every operation of the document, Schemathesis generates requests from the schema (valid
ones and ones that break it: wrong types, missing fields, values out of range), a fixed
number per operation from a fixed seed, and they are sent to ``shoal dev`` with a token
allowed to do everything. Each answer must be no 5xx, a documented status code, of the
documented content type, with the documented headers, and have a body valid against that
status code's schema: a 2xx body against its schema, a 4xx in the documented frame
(``{"error": {...}}`` from a function, ``{"message": ...}`` from API Gateway itself).

Session-scoped operations need a live channel to get past 404/409: every other valid case of
one is sent as a pool client id with a fresh channel (connected just before), so the
session's own answers are exercised too. The pool's sessions subscribe to ``#`` and messages
are published before the run, so ``getMessages`` answers with real deliveries.

``test_the_documented_flow_answers_as_documented`` walks every operation once with valid
data in the order a client would, so that each 2xx schema is checked against a real answer;
``test_without_a_valid_token_every_route_answers_api_gateways_401`` sends each operation
without a token and with a wrong one; ``test_api_gateways_payload_limit_answers_as_documented``
sends bodies over the 6 MB and 10 MB limits.

Bounded for CI: ``MAX_EXAMPLES`` cases per operation, derandomized, no shrinking, no example
database; fuzzed topics get at most 12 shards. ``SHOAL_FUZZ_MAX_EXAMPLES=150`` makes a deeper
run (``SHOAL_FUZZ_MAX_PARTITIONS=500``: topics of any size), ``SHOAL_FUZZ_SEED=<n>`` a
different one. Schemathesis's own CLI adds its coverage phase (boundary and negative values
derived from the schema) against a running ``shoal dev``: ``schemathesis run
docs/openapi.yaml --url http://127.0.0.1:8080 -H "Authorization: Bearer $(shoal token --sub
fuzzer --admin --clients '*' --publish '#' --subscribe '#' --state-dir .shoal)"``.

The tests drive Schemathesis through its Python API (``as_strategy``, ``call_and_validate``)
under ``pytest.mark.parametrize`` rather than its ``schema.parametrize()``: under pytest 9.2
every item that decorator generates gets the same node id, so pytest-xdist runs only one of
them (and its lazy ``from_fixture`` fails outright).
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import hypothesis
import pytest
import requests
import schemathesis
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.result import Err
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.e2e.conftest import DevServer

SPEC_PATH = Path(__file__).resolve().parents[2] / "docs" / "openapi.yaml"
#: generated cases per operation, valid and invalid ones together (5 on CI's slow machine,
#: where each case took about 1.3 s through `shoal dev` and 10 took eleven minutes)
MAX_EXAMPLES = int(os.environ.get("SHOAL_FUZZ_MAX_EXAMPLES", "5"))
#: each valid case of these creates streams (up to 500 shards) or queues: fewer of them
COSTLY = frozenset({"createTopic", "addStorageTopic", "createPushSubscription"})
#: the most shards a fuzzed topic gets (CI: the emulated Kinesis polls every one)
MAX_PARTITIONS = int(os.environ.get("SHOAL_FUZZ_MAX_PARTITIONS", "12"))
#: ``SHOAL_FUZZ_SEED=<n>`` draws other cases than the fixed ones CI runs
SEED = os.environ.get("SHOAL_FUZZ_SEED")
#: the longest long poll a case on a live session may ask for
MAX_WAIT_MS = 500
#: client ids whose sessions stay live for the run: session-scoped cases borrow them
POOL = ("fuzz-pool-0", "fuzz-pool-1")
POOL_TOPIC = "fuzz/pool"
CHANNEL = "Shoal-Channel"

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]

schema = schemathesis.openapi.from_path(
    SPEC_PATH,
    config=schemathesis.Config.from_dict(
        # the tests send their own Authorization header; generated ones would only be refused
        {"generation": {"with-security-parameters": False}}
    ),
)


def _operations() -> list[schemathesis.APIOperation]:
    operations = []
    for result in schema.get_all_operations():
        if isinstance(result, Err):
            raise result.err()
        operations.append(result.ok())
    return operations


OPERATIONS = _operations()


def _operation_id(operation: schemathesis.APIOperation) -> str:
    return str(operation.definition.raw["operationId"])


def _run(
    strategy: st.SearchStrategy[schemathesis.Case],
    max_examples: int,
    test: Callable[[schemathesis.Case], None],
) -> None:
    """``test`` on ``max_examples`` cases: the same cases every run, no shrinking."""

    @hypothesis.settings(
        max_examples=max_examples,
        derandomize=SEED is None,
        database=None,
        deadline=None,
        phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate],
        suppress_health_check=list(hypothesis.HealthCheck),
        print_blob=False,
    )
    @hypothesis.given(case=strategy)
    def run(case: schemathesis.Case) -> None:
        test(case)

    if SEED is not None:
        run = hypothesis.seed(int(SEED))(run)
    run()


@dataclass
class Fuzz:
    """The running server, a token allowed everything, and the pool of live sessions."""

    dev: DevServer
    token: str
    http: requests.Session = field(default_factory=requests.Session)
    _turn: Iterator[int] = field(default_factory=itertools.count)

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def connect(self, client_id: str, **body: Any) -> str:
        """A fresh channel for ``client_id``, keeping its session (and subscriptions)."""
        answer = self.http.put(
            f"{self.dev.url}/v1/sessions/{quote(client_id, safe='')}",
            json={"clean_start": False, "session_expiry_s": 3600, "keepalive_s": 0, **body},
            headers=self.auth,
            timeout=30,
        )
        assert answer.status_code == 200, answer.text
        channel: str = answer.json()["channel"]
        return channel

    def prepare(self, case: schemathesis.Case) -> None:
        """Every other positive session-scoped case goes to a pool session's live channel."""
        body = case.body if isinstance(case.body, dict) else {}
        if _operation_id(case.operation) in COSTLY and _many_shards(body.get("partitions")):
            # a Kinesis stream of that many shards, each polled by the router until the
            # server stops: keep them few (SHOAL_FUZZ_MAX_PARTITIONS=500 for a deeper run)
            body["partitions"] = MAX_PARTITIONS
        path, method = case.operation.path, case.method.upper()
        if not path.startswith("/v1/sessions/{client_id}") or (
            method == "PUT" and path == "/v1/sessions/{client_id}"
        ):
            return
        if case.meta is not None and case.meta.generation.mode.is_negative:
            return
        turn = next(self._turn)
        if turn % 2:
            return
        client_id = POOL[turn // 2 % len(POOL)]
        case.path_parameters["client_id"] = client_id
        case.headers[CHANNEL] = self.connect(client_id)
        wait_ms = (case.query or {}).get("wait_ms")
        if isinstance(wait_ms, int) and wait_ms > MAX_WAIT_MS:
            # a live session long-polls for as long as it is asked (up to 20 s): bound the run
            case.query["wait_ms"] = MAX_WAIT_MS


def _many_shards(partitions: object) -> bool:
    """A valid partition count (a multiple of 4 or 6, at most 500) above MAX_PARTITIONS."""
    return (
        isinstance(partitions, int)
        and MAX_PARTITIONS < partitions <= 500
        and (partitions % 4 == 0 or partitions % 6 == 0)
    )


@pytest.fixture(scope="module")
def fuzz(own_dev: DevServer) -> Fuzz:
    token = own_dev.token("fuzzer", admin=True, clients=["*"], publish=["#"], subscribe=["#"])
    run = Fuzz(own_dev, token)
    for client_id in POOL:
        channel = run.connect(client_id, clean_start=True)
        answer = run.http.post(
            f"{own_dev.url}/v1/sessions/{client_id}/subscriptions",
            json={"subscriptions": [{"filter": "#", "qos": 1}]},
            headers={**run.auth, CHANNEL: channel},
            timeout=30,
        )
        assert answer.status_code == 200, answer.text
    for n, qos in enumerate((0, 1, 2, 1)):
        message = {
            "topic": f"{POOL_TOPIC}/{n}",
            "text": f"message {n}",
            "qos": qos,
            "properties": {"content_type": "text/plain", "user_properties": {"n": str(n)}},
        }
        answer = run.http.post(
            f"{own_dev.url}/v1/messages", json=message, headers=run.auth, timeout=30
        )
        assert answer.status_code == 201, answer.text
    return run


@pytest.mark.e2e
@pytest.mark.parametrize("operation", OPERATIONS, ids=_operation_id)
def test_every_answer_is_documented(operation: schemathesis.APIOperation, fuzz: Fuzz) -> None:
    def check(case: schemathesis.Case) -> None:
        fuzz.prepare(case)
        case.call_and_validate(
            base_url=fuzz.dev.url, session=fuzz.http, headers=fuzz.auth, checks=CHECKS, timeout=60
        )

    strategy = st.one_of(
        operation.as_strategy(generation_mode=GenerationMode.POSITIVE),
        operation.as_strategy(generation_mode=GenerationMode.NEGATIVE),
    )
    costly = _operation_id(operation) in COSTLY
    _run(strategy, max(1, MAX_EXAMPLES // 2) if costly else MAX_EXAMPLES, check)


@pytest.mark.e2e
@pytest.mark.parametrize("operation", OPERATIONS, ids=_operation_id)
def test_without_a_valid_token_every_route_answers_api_gateways_401(
    operation: schemathesis.APIOperation, fuzz: Fuzz
) -> None:
    public = not operation.definition.raw.get("security", True)

    def check(case: schemathesis.Case) -> None:
        for headers in ({}, {"Authorization": "Bearer not-a-token"}):
            response = case.call_and_validate(
                base_url=fuzz.dev.url, session=fuzz.http, headers=headers, checks=CHECKS, timeout=60
            )
            if public:
                assert response.status_code < 400
            else:
                assert response.status_code == 401
                assert response.json() == {"message": "Unauthorized"}
                assert _header(response, "www-authenticate").startswith("Bearer ")

    _run(operation.as_strategy(generation_mode=GenerationMode.POSITIVE), 1, check)


def _header(response: schemathesis.Response, name: str) -> str:
    values = {k.lower(): v for k, v in response.headers.items()}.get(name.lower()) or [""]
    return values[0]


class Flow:
    """Calls of documented operations with valid data, each validated as the fuzz cases are."""

    def __init__(self, fuzz: Fuzz) -> None:
        self.fuzz = fuzz

    def __call__(
        self,
        method: str,
        path: str,
        expect: int,
        *,
        params: dict[str, str] | None = None,
        channel: str | None = None,
        query: dict[str, Any] | None = None,
        body: Any = None,
    ) -> Any:
        operation = schema[path][method]
        data: dict[str, Any] = {"path_parameters": params or {}, "query": query or {}}
        if channel is not None:
            data["headers"] = {CHANNEL: channel}
        if body is not None:
            data["body"] = body
        response = operation.Case(**data).call_and_validate(
            base_url=self.fuzz.dev.url,
            session=self.fuzz.http,
            headers=self.fuzz.auth,
            checks=CHECKS,
            timeout=60,
        )
        assert response.status_code == expect, f"{method} {path}: {response.text}"
        return response.json() if response.content else None


@pytest.mark.e2e
def test_the_documented_flow_answers_as_documented(fuzz: Fuzz) -> None:
    call = Flow(fuzz)
    # health and composite topics
    call("GET", "/v1/health", 200)
    topic = {"name": "fuzzflow"}
    call("POST", "/v1/topics", 201, body={**topic, "partitions": 1})
    call("GET", "/v1/topics", 200)
    call("GET", "/v1/topics/{name}", 200, params=topic)
    call("POST", "/v1/topics/{name}/storage-topics", 201, params=topic, body={"partitions": 2})
    switched = call("POST", "/v1/topics/{name}/switch-produce", 200, params=topic)
    assert switched["produce_pointer"] == 1
    # a session: connect, subscribe (one filter refused), publish, read, ack, and leave
    client = {"client_id": "fuzzflow-client"}
    will = {"topic": "fuzzflow/will", "text": "gone", "qos": 1, "delay_s": 30}
    connected = call(
        "PUT",
        "/v1/sessions/{client_id}",
        200,
        params=client,
        body={"clean_start": True, "session_expiry_s": 60, "keepalive_s": 60, "will": will},
    )
    channel = connected["channel"]
    session = {"params": client, "channel": channel}
    # a retained message on a topic whose first level is empty: it belongs to `default`
    kept = {"topic": "/fuzzflow-retained", "text": "kept", "qos": 1, "retain": True}
    call("POST", "/v1/messages", 201, body=kept)
    filters = [
        {"filter": "fuzzflow-messages/#", "qos": 2, "retain_handling": 0},
        {"filter": "$share/flow/fuzzflow/shared/#", "qos": 1},
        {"filter": "/fuzzflow-retained", "qos": 1, "retain_handling": 0},
        {"filter": "fuzzflow/#/bad"},
    ]
    granted = call(
        "POST",
        "/v1/sessions/{client_id}/subscriptions",
        200,
        **session,
        body={"subscriptions": filters},
    )
    assert granted["granted"] == [2, 1, 1, "invalid_filter"]
    message = {
        "topic": "fuzzflow-messages/a",
        "payload": "aGVsbG8=",
        "qos": 1,
        "retain": True,
        "ordering_key": "k",
        "publisher_id": "fuzzflow-publisher",
        "publisher_seq": 1,
        "properties": {"content_type": "text/plain", "message_expiry_s": 600},
    }
    nameless = {"topic": "fuzzflow-messages/b", "properties": {"user_properties": {"": "x"}}}
    assert call("POST", "/v1/messages", 400, body=nameless)["error"]["code"] == "invalid_request"
    first = call("POST", "/v1/messages", 201, body=message)
    again = call("POST", "/v1/messages", 200, body=message)
    assert (again["duplicate"], again["message_id"]) == (True, first["message_id"])
    batch = [{"topic": "fuzzflow/b", "text": "b", "qos": 2}, {"topic": "fuzzflow/+"}]
    results = call("POST", "/v1/messages:batch", 200, body={"messages": batch})["results"]
    assert "message_id" in results[0]
    assert results[1]["error"]["code"] == "invalid_topic"
    wanted = {"/fuzzflow-retained", "fuzzflow-messages/a"}
    topics: set[str] = set()
    deadline = time.monotonic() + 30
    while not wanted <= topics and time.monotonic() < deadline:
        query = {"max": 10, "wait_ms": 2000}
        got = call("GET", "/v1/sessions/{client_id}/messages", 200, **session, query=query)
        if got["messages"]:
            ids = [m["id"] for m in got["messages"]]
            acked = call("POST", "/v1/sessions/{client_id}/acks", 200, **session, body={"ids": ids})
            assert acked["acked"] == len(ids)
        topics |= {m["topic"] for m in got["messages"]}
    assert wanted <= topics, f"delivered in 30 s: {sorted(topics)}"
    call("POST", "/v1/sessions/{client_id}/heartbeat", 200, **session)
    # the shared group it joined, as an admin sees it; another share name of it is no group
    group = call(
        "GET",
        "/v1/groups/{share}",
        200,
        params={"share": "flow"},
        query={"filter": "fuzzflow/shared/#"},
    )
    assert [m["client_id"] for m in group["members"]] == [client["client_id"]]
    absent = {"share": "flow-none"}
    of_filter = {"filter": "fuzzflow/shared/#"}
    missing = call("GET", "/v1/groups/{share}", 404, params=absent, query=of_filter)
    assert missing["error"]["code"] == "group_not_found"
    call("GET", "/v1/sessions/{client_id}", 200, **session)
    # the read-only view (no Shoal-Channel): the same session, no channel handed out
    assert call("GET", "/v1/sessions/{client_id}", 200, params=client)["channel"] is None
    call(
        "POST",
        "/v1/sessions/{client_id}/unsubscribe",
        200,
        **session,
        body={"filters": ["fuzzflow-messages/#", "never/subscribed"]},
    )
    call("DELETE", "/v1/sessions/{client_id}", 204, **session)
    # a push subscription to an endpoint nobody listens on
    push = {"name": "fuzzflow-push"}
    call(
        "POST",
        "/v1/subscriptions",
        201,
        body={
            **push,
            "filter": "fuzzflow/#",
            "endpoint": "http://127.0.0.1:9/hook",
            "topic": "fuzzflow",
            "retry": {"max_attempts": 2, "retry_on": [429, "5xx", "timeout"]},
        },
    )
    call("GET", "/v1/subscriptions/{name}", 200, params=push)
    call("GET", "/v1/subscriptions", 200, query={"limit": 2})
    call("PATCH", "/v1/subscriptions/{name}", 200, params=push, body={"parallelism": 2})
    call("POST", "/v1/subscriptions/{name}/seek", 200, params=push, body={"to": "earliest"})
    call("GET", "/v1/subscriptions/{name}/dlq", 200, params=push, query={"limit": 5})
    call(
        "POST",
        "/v1/subscriptions/{name}/dlq/redrive",
        200,
        params=push,
        body={"ordering_keys": ["k"]},
    )
    call("DELETE", "/v1/subscriptions/{name}", 204, params=push)


@pytest.mark.e2e
@pytest.mark.parametrize("megabytes", [7, 11])
def test_api_gateways_payload_limit_answers_as_documented(fuzz: Fuzz, megabytes: int) -> None:
    # Over Lambda's 6 MB event limit, and over API Gateway's own 10 MB: API Gateway's 413
    call = Flow(fuzz)
    body = {"topic": "fuzz/big", "text": "x" * (megabytes << 20)}
    assert call("POST", "/v1/messages", 413, body=body) == {"message": "Request Entity Too Large"}
