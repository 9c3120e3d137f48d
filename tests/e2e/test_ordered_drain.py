"""Ordered drain end to end: a session gets each key's messages in publish order across a
SwitchProduce, over a real ``shoal dev`` (router on its mappings, the reaper sealing)."""

from __future__ import annotations

import base64
import time
from typing import Any

import pytest

from tests.e2e.conftest import DevFactory

pytestmark = pytest.mark.e2e

KEYS = ("a", "b", "c")


def test_a_session_gets_each_key_in_publish_order_across_a_switch(dev_factory: DevFactory) -> None:
    # Given shoal dev with the reaper every second and a one-second seal grace
    dev = dev_factory(extra_args=["--schedule", "reaper=1"], env={"SHOAL_SEAL_GRACE_S": "1"})
    admin = dev.token("ops", admin=True)
    token = dev.token("alice", clients=["alice-*"], publish=["#"], subscribe=["#"])
    status, body = dev.request(
        "POST", "/v1/topics", token=admin, json={"name": "orders", "partitions": 2}
    )
    assert status == 201, body
    status, body = dev.request("PUT", "/v1/sessions/alice-1", token=token, json={})
    assert status == 200, body
    headers = {"Shoal-Channel": body["channel"]}

    def call(method: str, suffix: str, json: Any = None) -> Any:
        status, answer = dev.request(
            method, f"/v1/sessions/alice-1{suffix}", token=token, json=json, headers=headers
        )
        assert status == 200, answer
        return answer

    call("POST", "/subscriptions", {"subscriptions": [{"filter": "orders/#", "qos": 1}]})
    published: dict[str, list[str]] = {k: [] for k in KEYS}

    def publish(n: int) -> None:
        key = KEYS[n % len(KEYS)]
        status, answer = dev.request(
            "POST",
            "/v1/messages",
            token=token,
            json={"topic": f"orders/{key}", "text": f"{key}{n}", "qos": 1, "ordering_key": key},
        )
        assert status in (200, 201), answer
        published[key].append(f"{key}{n}")

    # When a dozen messages go to T0, the topic switches to T1, and a dozen more follow
    for n in range(12):
        publish(n)
    status, body = dev.request(
        "POST", "/v1/topics/orders/storage-topics", token=admin, json={"partitions": 2}
    )
    assert status == 201, body
    status, body = dev.request("POST", "/v1/topics/orders/switch-produce", token=admin)
    assert status == 200, body
    for n in range(12, 24):
        publish(n)
    # Then the session gets all 24, each key in publish order
    got: list[str] = []
    deadline = time.monotonic() + 40
    while len(got) < 24 and time.monotonic() < deadline:
        answer = call("GET", "/messages?max=100&wait_ms=2000")
        messages = answer["messages"]
        if messages:
            call("POST", "/acks", {"ids": [m["id"] for m in messages]})
        got += [base64.b64decode(m["payload"]).decode() for m in messages]
    assert sorted(got) == sorted(t for texts in published.values() for t in texts)
    for key in KEYS:
        assert [t for t in got if t.startswith(key)] == published[key]


def test_a_message_after_a_switch_arrives_without_waiting_for_the_reaper(
    dev_factory: DevFactory,
) -> None:
    # Given shoal dev with no grace set, and the reaper held back (an hour) so that only the
    # switch call can seal
    dev = dev_factory(extra_args=["--schedule", "reaper=3600"])
    admin = dev.token("ops", admin=True)
    token = dev.token("bob", clients=["bob-*"], publish=["#"], subscribe=["#"])
    assert (
        dev.request("POST", "/v1/topics", token=admin, json={"name": "grow", "partitions": 1})[0]
        == 201
    )
    status, body = dev.request("PUT", "/v1/sessions/bob-1", token=token, json={})
    headers = {"Shoal-Channel": body["channel"]}
    subscribe = {"subscriptions": [{"filter": "grow/#", "qos": 1}]}
    path = "/v1/sessions/bob-1"
    assert (
        dev.request("POST", f"{path}/subscriptions", token=token, json=subscribe, headers=headers)[
            0
        ]
        == 200
    )

    def publish(text: str) -> dict[str, Any]:
        body = {"topic": "grow/a", "text": text, "ordering_key": "a"}
        status, answer = dev.request("POST", "/v1/messages", token=token, json=body)
        assert status == 201, answer
        return dict(answer)

    publish("before")
    status, body = dev.request(
        "POST", "/v1/topics/grow/storage-topics", token=admin, json={"partitions": 1}
    )
    assert status == 201, body
    # When produce switches, and a message is published as soon as the call answers
    status, body = dev.request("POST", "/v1/topics/grow/switch-produce", token=admin)
    assert status == 200, body
    switched = time.monotonic()
    assert publish("after")["storage_topic"] == 1
    # Then the call left the old storage topic sealed, and the new message follows the old
    # one within the usual delivery time (the bound is waited out inside the call)
    got: list[str] = []
    while "after" not in got and time.monotonic() - switched < 30:
        status, answer = dev.request(
            "GET", f"{path}/messages?max=10&wait_ms=2000", token=token, headers=headers
        )
        assert status == 200, answer
        messages = answer["messages"]
        if messages:
            dev.request(
                "POST",
                f"{path}/acks",
                token=token,
                json={"ids": [m["id"] for m in messages]},
                headers=headers,
            )
        got += [base64.b64decode(m["payload"]).decode() for m in messages]
    assert got == ["before", "after"]
