"""Shared by the delivery and router fan-out tests: every handler over moto, one manual clock.

(No tests here.) A ``World`` wires sessions, subscriptions, messages, publish and the router to
the ``aws`` fixture's account with the Harness's ManualClock, installs them into the handler
modules, and runs the router through the emulated event source mappings (``drain``), exactly
as ``shoal dev`` does, with Lambda's retry semantics.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import boto3
import moto.kinesis.models
import pytest
from shoal.aws.dynamo import Dynamo
from shoal.composite.store import TopicStore
from shoal.core.config import DeliverySettings, get_config
from shoal.delivery.inbox import InboxStore, PayloadStore
from shoal.delivery.retained import RetainedReader
from shoal.delivery.service import DeliveryService
from shoal.delivery.subscriptions import SubscriptionRetirer, SubscriptionService, SubscriptionStore
from shoal.local.esm.mappings import EventSourceMappings
from shoal.router.fanout import Fanout, SubscriptionCache
from shoal.sessions.registry import SessionRegistry
from shoal.sessions.repository import SessionRepository

import functions.messages.app as messages_app
import functions.router.app as router_app
import functions.sessions.app as sessions_app
import functions.subscriptions.app as subscriptions_app
from tests.helpers import FakeContext, http_event, response_json
from tests.integration.test_publish_harness import Harness, admin_call, publish_call

#: claims as the JWT authorizer passes them
ALICE = {
    "sub": "alice",
    "shoal:clients": "[alice-* shared-*]",
    "shoal:publish": "[#]",
    "shoal:subscribe": "[# $SYS/#]",
}
BOB = {
    "sub": "bob",
    "shoal:clients": "[bob-*]",
    "shoal:publish": "[sensors/#]",
    "shoal:subscribe": "[sensors/+/temp orders/#]",
}

Handler = Callable[[dict[str, Any], Any], dict[str, Any]]


class World:
    def __init__(self, session: boto3.Session, monkeypatch: pytest.MonkeyPatch) -> None:
        self.session = session
        self.harness = Harness(session)
        self.clock = self.harness.clock
        # the stream's clock: the emulated Kinesis stamps each record's arrival (what the
        # subscriptions' cuts compare with) by the world's clock, plus a skew a test may set
        self.stream_skew_ms = 0
        monkeypatch.setattr(moto.kinesis.models, "utcnow", self._stream_now)
        config = get_config()
        dynamo = Dynamo(session.client("dynamodb"))
        self.settings = DeliverySettings(ack_timeout_s=30, window=100)
        self.store = SubscriptionStore(dynamo, config.table("subscriptions"))
        self.registry = SessionRegistry(
            SessionRepository(dynamo, config.table("sessions")),
            self.clock,
            on_session_end=SubscriptionRetirer(self.store, self.clock),
        )
        self.inbox = InboxStore(dynamo, config.table("inboxes"))
        self.registry.deliveries = self.inbox
        payloads = PayloadStore(session.client("s3"), config.buckets["archive"])
        retained = RetainedReader(
            dynamo, config.table("retained"), TopicStore(dynamo, config.table("topics")).names
        )
        self.subscriptions = SubscriptionService(
            self.registry, self.store, self.inbox, self.settings, retained, clock=self.clock
        )
        self.delivery = DeliveryService(
            self.registry, self.inbox, self.settings, self.clock, payloads
        )
        # the router runs in containers of its own: its own stores and client
        router_dynamo = Dynamo(session.client("dynamodb"))
        self.fanout = Fanout(
            SubscriptionCache(SubscriptionStore(router_dynamo, config.table("subscriptions"))),
            InboxStore(router_dynamo, config.table("inboxes")),
            self.settings,
            payloads=payloads,
            clock=self.clock,
        )
        self.harness.install(monkeypatch)
        monkeypatch.setattr(sessions_app, "registry", lambda: self.registry)
        monkeypatch.setattr(subscriptions_app, "service", lambda: self.subscriptions)
        monkeypatch.setattr(messages_app, "service", lambda: self.delivery)
        monkeypatch.setattr(router_app.router(), "fanout", self.fanout)
        self.router: Handler = router_app.handler
        self.invocations = 0
        self.esm = EventSourceMappings(session, self._invoke, self.clock)

    def _stream_now(self) -> datetime:
        at = (self.clock.now_ms() + self.stream_skew_ms) / 1000
        return datetime.fromtimestamp(at, tz=UTC).replace(tzinfo=None)

    def _invoke(self, function_name: str, event: dict[str, Any]) -> Any:
        self.invocations += 1
        return self.router(event, FakeContext())

    # -- topics and publishing

    def topic(self, name: str, partitions: int = 1) -> None:
        if name == "default":
            self.harness.default(partitions)
        else:
            status, body = admin_call(
                "POST", "/v1/topics", {"name": name, "partitions": partitions}
            )
            assert status == 201, body

    def publish(self, topic: str, text: str | None = "m", **body: Any) -> str:
        claims = body.pop("claims", ALICE)
        status, answer = publish_call({"topic": topic, "text": text, **body}, claims=claims)
        assert status in (200, 201), answer
        message_id: str = answer["message_id"]
        return message_id

    def publish_batch(self, messages: list[dict[str, Any]], claims: dict[str, Any] = ALICE) -> None:
        status, answer = publish_call({"messages": messages}, batch=True, claims=claims)
        assert status == 200 and all("error" not in r for r in answer["results"]), answer

    def route(self) -> int:
        """Run the router over everything published so far (Lambda's mapping semantics)."""
        self.esm.sync()
        return self.esm.drain()

    # -- the session-scoped calls

    def call(
        self,
        handler: Handler,
        method: str,
        client_id: str,
        suffix: str = "",
        *,
        body: Any = None,
        channel: str | None = None,
        claims: dict[str, Any] = ALICE,
        query: dict[str, str] | None = None,
    ) -> tuple[int, Any]:
        event = http_event(
            method,
            f"/v1/sessions/{client_id}{suffix}",
            body=body,
            claims=claims,
            headers={"Shoal-Channel": channel} if channel is not None else None,
            route_key=f"{method} /v1/sessions/{{client_id}}{suffix}",
            path_parameters={"client_id": client_id},
            query=query,
        )
        event["requestContext"]["timeEpoch"] = self.clock.now_ms()
        response = handler(event, FakeContext())
        return response["statusCode"], response_json(response)

    def connect(self, client_id: str, claims: dict[str, Any] = ALICE, **body: Any) -> str:
        status, answer = self.call(sessions_app.handler, "PUT", client_id, body=body, claims=claims)
        assert status == 200, answer
        channel: str = answer["channel"]
        return channel

    def disconnect(self, client_id: str, channel: str, claims: dict[str, Any] = ALICE) -> None:
        status, answer = self.call(
            sessions_app.handler, "DELETE", client_id, channel=channel, claims=claims
        )
        assert status == 204, answer

    def subscribe_call(
        self, client_id: str, channel: str, *subscriptions: Any, claims: dict[str, Any] = ALICE
    ) -> tuple[int, Any]:
        wanted = [{"filter": s, "qos": 2} if isinstance(s, str) else s for s in subscriptions]
        return self.call(
            subscriptions_app.handler,
            "POST",
            client_id,
            "/subscriptions",
            body={"subscriptions": wanted},
            channel=channel,
            claims=claims,
        )

    def subscribe(
        self, client_id: str, channel: str, *subscriptions: Any, claims: dict[str, Any] = ALICE
    ) -> list[Any]:
        status, answer = self.subscribe_call(client_id, channel, *subscriptions, claims=claims)
        assert status == 200, answer
        granted: list[Any] = answer["granted"]
        return granted

    def unsubscribe(
        self, client_id: str, channel: str, *filters: str, claims: dict[str, Any] = ALICE
    ) -> tuple[int, Any]:
        return self.call(
            subscriptions_app.handler,
            "POST",
            client_id,
            "/unsubscribe",
            body={"filters": list(filters)},
            channel=channel,
            claims=claims,
        )

    def get_call(
        self,
        client_id: str,
        channel: str,
        max_messages: int = 10,
        wait_ms: int = 0,
        claims: dict[str, Any] = ALICE,
    ) -> tuple[int, Any]:
        query = {"max": str(max_messages), "wait_ms": str(wait_ms)}
        return self.call(
            messages_app.handler,
            "GET",
            client_id,
            "/messages",
            channel=channel,
            claims=claims,
            query=query,
        )

    def get(self, client_id: str, channel: str, max_messages: int = 10, **kw: Any) -> list[Any]:
        status, answer = self.get_call(client_id, channel, max_messages, **kw)
        assert status == 200, answer
        messages: list[Any] = answer["messages"]
        return messages

    def ack(
        self, client_id: str, channel: str, ids: list[str], claims: dict[str, Any] = ALICE
    ) -> tuple[int, Any]:
        return self.call(
            messages_app.handler,
            "POST",
            client_id,
            "/acks",
            body={"ids": ids},
            channel=channel,
            claims=claims,
        )

    def drain(self, client_id: str, channel: str, claims: dict[str, Any] = ALICE) -> list[Any]:
        """Get and ack until nothing comes: every message the session receives, in order."""
        out: list[Any] = []
        while True:
            batch = self.get(client_id, channel, 100, claims=claims)
            if not batch:
                return out
            out += batch
            status, _ = self.ack(client_id, channel, [m["id"] for m in batch], claims=claims)
            assert status == 200


def texts(messages: list[Any]) -> list[str]:
    import base64

    return [base64.b64decode(m["payload"]).decode() for m in messages]


@pytest.fixture
def world(aws: boto3.Session, monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    w = World(aws, monkeypatch)
    w.topic("default", 1)
    yield w
