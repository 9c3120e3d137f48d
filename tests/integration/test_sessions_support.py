"""Shared by the session and reaper tests: the handlers over moto, driven by a manual clock.

(No tests here; the module name only keeps it inside the session tests' files.)
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import boto3
import pytest
from moto import mock_aws
from shoal import wiring
from shoal.core.clock import ManualClock
from shoal.core.config import get_config
from shoal.core.errors import ShoalError
from shoal.local.aws import adapt_moto
from shoal.local.provision import LocalNames
from shoal.local.serialize import serialized_moto
from shoal.sessions.model import RegistryView, Version, WillMessage
from shoal.sessions.registry import SessionRegistry
from shoal.sessions.repository import SessionRepository

import functions.sessions.app as sessions_app
from tests.account import provision_account
from tests.helpers import FakeContext, http_event, response_json

#: claims as the JWT authorizer passes them (lists as "[a b]")
ALICE = {"sub": "alice", "shoal:clients": "[sensor-* race-*]", "shoal:publish": "[devices/#]"}
MALLORY = {"sub": "mallory", "shoal:clients": "[sensor-* race-*]", "shoal:publish": "[#]"}

Handler = Callable[[dict[str, Any], Any], dict[str, Any]]


def handler_copy(module: str = "functions.sessions.app") -> ModuleType:
    """A fresh copy of a handler module, as a separate Lambda execution environment has.

    Powertools' resolver keeps the current event on a module-level object, so concurrent
    invocations need separate copies, exactly as Lambda gives them separate environments.
    """
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.loader is not None
    copy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy)
    return copy


@dataclass
class RecordingPublisher:
    """The will publisher the reaper gets in tests: remembers what it was asked to publish."""

    published: list[tuple[str, str, WillMessage, str]] = field(default_factory=list)
    failures: int = 0
    refusal: ShoalError | None = None

    def publish_will(self, sub: str, client_id: str, will: WillMessage, will_id: str) -> None:
        if self.refusal is not None:
            raise self.refusal
        if self.failures:
            self.failures -= 1
            raise RuntimeError("the stream is unavailable")
        self.published.append((sub, client_id, will, will_id))


@dataclass
class Sessions:
    """The sessions function over the emulated account, with its clock in the test's hand."""

    session: boto3.Session
    clock: ManualClock
    registry: SessionRegistry
    handler: Handler = sessions_app.handler

    @property
    def repository(self) -> SessionRepository:
        return self.registry.repository

    def call(
        self,
        method: str,
        client_id: str,
        *,
        suffix: str = "",
        body: Any = None,
        raw_body: str | None = None,
        channel: str | None = None,
        claims: dict[str, Any] | None = None,
        handler: Handler | None = None,
    ) -> tuple[int, Any]:
        path = f"/v1/sessions/{client_id}{suffix}"
        event = http_event(
            method,
            path,
            body=body,
            raw_body=raw_body,
            claims=ALICE if claims is None else claims,
            headers={"Shoal-Channel": channel} if channel is not None else None,
            route_key=f"{method} /v1/sessions/{{client_id}}{suffix}",
            path_parameters={"client_id": client_id},
        )
        event["requestContext"]["timeEpoch"] = self.clock.now_ms()
        response = (handler or self.handler)(event, FakeContext())
        return response["statusCode"], response_json(response)

    def connect(self, client_id: str, **body: Any) -> tuple[int, Any]:
        claims = body.pop("claims", None)
        return self.call("PUT", client_id, body=body, claims=claims)

    def connected(self, client_id: str, **body: Any) -> str:
        """Connect, expecting success; the channel."""
        status, answer = self.connect(client_id, **body)
        assert status == 200, answer
        channel: str = answer["channel"]
        return channel

    def heartbeat(self, client_id: str, channel: str, **kwargs: Any) -> tuple[int, Any]:
        return self.call("POST", client_id, suffix="/heartbeat", channel=channel, **kwargs)

    def disconnect(self, client_id: str, channel: str, **kwargs: Any) -> tuple[int, Any]:
        return self.call("DELETE", client_id, channel=channel, **kwargs)

    def get(self, client_id: str, channel: str, **kwargs: Any) -> tuple[int, Any]:
        return self.call("GET", client_id, channel=channel, **kwargs)

    def view(self, client_id: str) -> RegistryView:
        return self.repository.read(client_id, consistent=True)

    def items(self, client_id: str) -> list[dict[str, Any]]:
        """Every stored item of the client id, raw: the state a refused call must not change."""
        table = self.session.resource("dynamodb").Table(self.repository.table)
        found: list[dict[str, Any]] = table.query(
            KeyConditionExpression="client_id = :c",
            ExpressionAttributeValues={":c": client_id},
            ConsistentRead=True,
        )["Items"]
        return found

    def give_session(self, client_id: str, channel: str, subscriptions: dict[str, Any]) -> None:
        """Subscriptions, written as a live channel's subscribe would (the transaction part
        conditional on the channel being live)."""
        head = self.repository.head(client_id)
        assert head is not None and head.is_live(Version.parse(channel))
        part = self.repository.subscriptions_part(
            client_id, head, self.clock.now_ms(), put=subscriptions
        )
        assert self.repository.dynamo.transact([part]) is None


@pytest.fixture(scope="module")
def account() -> Iterator[boto3.Session]:
    """The ``aws`` fixture's emulated account, provisioned once per module.

    Provisioning takes most of a second on these machines; the session tests share one
    account and empty the sessions table before each test instead.
    """
    names = LocalNames.for_deployment()
    with pytest.MonkeyPatch.context() as patch:
        for key, value in names.environment().items():
            patch.setenv(key, value)
        get_config.cache_clear()
        # as the ``aws`` fixture: moto's own delivery of stream records needs Docker, and
        # which module first made an account must not decide whether a publish works
        adapt_moto()
        with mock_aws(), serialized_moto():
            session = boto3.Session(region_name="us-east-1")
            provision_account(session, names)
            yield session
    get_config.cache_clear()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


def empty_sessions_table(account: boto3.Session) -> None:
    """Drop every item: moto copies a whole table for each part of every transaction, so a
    table that grows over a module makes each later connect slower."""
    table = account.resource("dynamodb").Table(get_config().table("sessions"))
    keys = table.scan(
        ProjectionExpression="client_id, #i", ExpressionAttributeNames={"#i": "item"}
    )["Items"]
    with table.batch_writer() as batch:
        for key in keys:
            batch.delete_item(Key=key)


@pytest.fixture
def sessions(
    account: boto3.Session, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Sessions]:
    empty_sessions_table(account)
    registry = wiring.session_registry(get_config(), clock)
    monkeypatch.setattr(sessions_app, "registry", lambda: registry)
    yield Sessions(account, clock, registry)


class DynamoCalls:
    """The DynamoDB operations one client makes, by name, in order."""

    def __init__(self, client: Any) -> None:
        self.names: list[str] = []
        client.meta.events.register("before-call.dynamodb", self._record)

    def _record(self, model: Any, **_: Any) -> None:
        self.names.append(model.name)

    def take(self) -> list[str]:
        names, self.names = self.names, []
        return names


class Interleaved(SessionRepository):
    """A repository that lets a test act between a connect's steps (another racer, a reaper).

    ``on_read(consistent)`` runs after each read; ``on_register()`` before each registration.
    """

    def __init__(self, base: SessionRepository) -> None:
        super().__init__(base.dynamo, base.table)
        self.on_read: Callable[[bool], object] | None = None
        self.on_register: Callable[[], None] | None = None
        self.stale_reads = False
        self.lose_own_commit = False

    def read(self, client_id: str, *, consistent: bool) -> RegistryView:
        if self.stale_reads and not consistent:
            view = RegistryView()  # a replica that has not seen this client id yet
        else:
            view = super().read(client_id, consistent=consistent)
        if self.on_read is not None:
            self.on_read(consistent)
        return view

    def register(self, client_id: str, **kwargs: Any) -> bool:
        if self.on_register is not None:
            hook, self.on_register = self.on_register, None
            hook()
        committed = super().register(client_id, **kwargs)
        if committed and self.lose_own_commit:
            # as when the SDK retried a transaction that had landed and its condition failed
            self.lose_own_commit = False
            return False
        return committed
