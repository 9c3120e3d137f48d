"""Subscriptions and delivery end to end over a real `shoal dev` (router on its mappings)."""

from __future__ import annotations

import base64
import time
from typing import Any

import pytest

from tests.e2e.conftest import DevFactory, DevServer

pytestmark = pytest.mark.e2e

#: short, so that redelivery after the ack timeout is seen within the test
ACK_TIMEOUT_S = 2


class Client:
    """One client id's session over HTTP."""

    def __init__(self, dev: DevServer, token: str, client_id: str) -> None:
        self.dev, self.token, self.client_id = dev, token, client_id
        self.channel = ""

    def call(self, method: str, suffix: str = "", json: Any = None) -> tuple[int, Any]:
        headers = {"Shoal-Channel": self.channel} if self.channel else None
        path = f"/v1/sessions/{self.client_id}{suffix}"
        return self.dev.request(method, path, token=self.token, json=json, headers=headers)

    def connect(self, clean_start: bool = False, session_expiry_s: int = 600) -> dict[str, Any]:
        self.channel = ""
        status, body = self.call(
            "PUT", json={"clean_start": clean_start, "session_expiry_s": session_expiry_s}
        )
        assert status == 200, body
        self.channel = body["channel"]
        return dict(body)

    def subscribe(self, *subscriptions: dict[str, Any]) -> list[Any]:
        status, body = self.call("POST", "/subscriptions", {"subscriptions": list(subscriptions)})
        assert status == 200, body
        return list(body["granted"])

    def get(self, max_messages: int = 10, wait_ms: int = 0) -> list[dict[str, Any]]:
        status, body = self.call("GET", f"/messages?max={max_messages}&wait_ms={wait_ms}")
        assert status == 200, body
        return list(body["messages"])

    def ack(self, messages: list[dict[str, Any]]) -> int:
        status, body = self.call("POST", "/acks", {"ids": [m["id"] for m in messages]})
        assert status == 200, body
        return int(body["acked"])

    def collect(self, count: int, timeout_s: float = 30, ack: bool = True) -> list[dict[str, Any]]:
        """Get (long polls) until ``count`` messages came or the time is up."""
        out: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout_s
        while len(out) < count and time.monotonic() < deadline:
            got = self.get(100, wait_ms=2000)
            if ack and got:
                self.ack(got)
            out += got
        return out

    def quiet(self, wait_ms: int = 1500) -> list[dict[str, Any]]:
        """What comes within a short wait (expected: nothing)."""
        return self.get(100, wait_ms=wait_ms)


def text(message: dict[str, Any]) -> str:
    return base64.b64decode(message["payload"]).decode()


def publish(dev: DevServer, token: str, topic: str, body: str, **extra: Any) -> str:
    status, answer = dev.request(
        "POST", "/v1/messages", token=token, json={"topic": topic, "text": body, **extra}
    )
    assert status in (200, 201), answer
    return str(answer["message_id"])


@pytest.fixture(scope="module")
def delivery_dev(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from tests.e2e.conftest import _servers

    with _servers(tmp_path_factory.mktemp("delivery-dev")) as start:
        yield start(default_partitions=2, env={"SHOAL_ACK_TIMEOUT_S": str(ACK_TIMEOUT_S)})


def test_two_sessions_overlapping_filters_qos_and_retained(delivery_dev: DevServer) -> None:
    dev = delivery_dev
    alice_token = dev.token("alice", clients=["alice-*"], publish=["#"], subscribe=["#"])
    bob_token = dev.token("bob", clients=["bob-*"], subscribe=["sensors/+/temp"])
    # Given a retained message published before anyone subscribed
    publish(dev, alice_token, "sensors/hall/temp", "19", retain=True)
    # and routed before anyone subscribes: the router runs on its own schedule (every 0.5 s
    # under shoal dev), and a record routed after a subscribe reaches that new subscription
    # too (a known gap, noted on the shared-groups issue: the router does not compare a
    # message's publish time with the subscription's)
    time.sleep(2)
    alice, bob = Client(dev, alice_token, "alice-1"), Client(dev, bob_token, "bob-1")
    alice.connect()
    bob.connect()
    # When both subscribe, with overlapping filters, wildcards and a filter outside bob's rights
    assert alice.subscribe(
        {"filter": "sensors/#", "qos": 0}, {"filter": "sensors/+/temp", "qos": 2}
    ) == [0, 2]
    assert bob.subscribe(
        {"filter": "sensors/+/temp", "qos": 1}, {"filter": "sensors/#", "qos": 1}
    ) == [1, "not_authorized"]
    # Then each gets the retained message, flagged as retained
    for client in (alice, bob):
        (retained,) = client.collect(1)
        assert (retained["topic"], retained["retain"], text(retained)) == (
            "sensors/hall/temp",
            True,
            "19",
        )
    # When messages of each QoS are published
    for qos in (0, 1, 2):
        publish(dev, alice_token, "sensors/kitchen/temp", f"t{qos}", qos=qos)
    publish(dev, alice_token, "sensors/kitchen/door", "open", qos=2)
    # Then alice gets each once, with the highest granted QoS and its subscription named
    # (between equals, the first filter in sort order)
    got = alice.collect(4)
    assert [(text(m), m["qos"], m["subscription"]) for m in got] == [
        ("t0", 0, "sensors/#"),
        ("t1", 1, "sensors/+/temp"),
        ("t2", 2, "sensors/+/temp"),
        ("open", 0, "sensors/#"),
    ]
    assert [m["retain"] for m in got] == [False] * 4
    # and bob only the temperatures, at most QoS 1
    assert [(text(m), m["qos"]) for m in bob.collect(3)] == [("t0", 0), ("t1", 1), ("t2", 1)]
    assert alice.quiet() == [] and bob.quiet() == []


def test_offline_accumulation_takeover_and_redelivery(delivery_dev: DevServer) -> None:
    dev = delivery_dev
    token = dev.token("carol", clients=["carol-*"], publish=["jobs/#"], subscribe=["jobs/#"])
    carol = Client(dev, token, "carol-1")
    carol.connect(session_expiry_s=600)
    carol.subscribe({"filter": "jobs/#", "qos": 1})
    # Given the session offline while messages arrive
    status, _ = carol.call("DELETE")
    assert status == 204
    for n in range(3):
        publish(dev, token, "jobs/a", f"offline{n}")
    time.sleep(2)  # the router runs on its own schedule; the session is offline meanwhile
    # When it reconnects, Then it gets all of them
    assert carol.connect()["session_present"] is True
    assert [text(m) for m in carol.collect(3)] == ["offline0", "offline1", "offline2"]
    # Given two delivered but unacked messages and one not yet delivered
    for n in range(3):
        publish(dev, token, "jobs/b", f"m{n}")
    first = carol.collect(2, ack=False)
    first += carol.get(2 - len(first)) if len(first) < 2 else []
    assert [text(m) for m in first[:2]] == ["m0", "m1"]
    # When another channel takes the session over
    old_channel = carol.channel
    taker = Client(dev, token, "carol-1")
    assert taker.connect()["session_present"] is True
    carol.channel = old_channel
    status, body = carol.call("GET", "/messages")
    assert (status, body["error"]["code"]) == (409, "session_taken_over")
    # Then the new channel gets the unacked ones again at once (dup, same ids), then the rest
    got = taker.collect(3, ack=False)
    assert [text(m) for m in got] == ["m0", "m1", "m2"]
    assert [(m["id"], m["dup"]) for m in got[:2]] == [(m["id"], True) for m in first[:2]]
    # And a message not acked comes again with dup after the ack timeout; once acked, never
    taker.ack(got[:2])
    time.sleep(ACK_TIMEOUT_S + 0.5)
    again = taker.collect(1, ack=False)
    assert [(text(m), m["dup"], m["id"]) for m in again] == [("m2", True, got[2]["id"])]
    assert taker.ack(again) == 1
    time.sleep(ACK_TIMEOUT_S + 0.5)
    assert taker.quiet() == []


def test_publish_right_after_subscribe_is_delivered_every_time(delivery_dev: DevServer) -> None:
    dev = delivery_dev
    token = dev.token("dave", clients=["dave-*"], publish=["fresh/#"], subscribe=["fresh/#"])
    dave = Client(dev, token, "dave-1")
    dave.connect()
    sent = []
    for n in range(15):
        dave.subscribe({"filter": f"fresh/{n}/#", "qos": 1})
        publish(dev, token, f"fresh/{n}/x", f"m{n}")
        sent.append(f"m{n}")
    assert sorted(text(m) for m in dave.collect(15)) == sorted(sent)


def test_clean_start_discards_and_unsubscribe_drops(dev_factory: DevFactory) -> None:
    dev = dev_factory()
    token = dev.token("erin", clients=["erin-*"], publish=["x/#"], subscribe=["x/#"])
    erin = Client(dev, token, "erin-1")
    erin.connect()
    erin.subscribe({"filter": "x/#", "qos": 1})
    publish(dev, token, "x/1", "before")
    time.sleep(2)
    # When it connects with clean_start, Then the session and its messages are gone
    assert erin.connect(clean_start=True)["session_present"] is False
    assert erin.quiet() == []
    publish(dev, token, "x/1", "after")
    assert erin.quiet() == []
    # And unsubscribing drops what was not delivered
    erin.subscribe({"filter": "x/#", "qos": 1})
    publish(dev, token, "x/2", "dropped")
    time.sleep(2)
    status, body = erin.call("POST", "/unsubscribe", {"filters": ["x/#"]})
    assert (status, body) == (200, {"unsubscribed": ["success"]})
    assert erin.quiet() == []
