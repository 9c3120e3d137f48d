"""Shared by the shared-group handler tests (no tests here).

A ``GroupWorld`` is the delivery tests' ``World`` (every handler over moto, one ManualClock,
the router through the emulated event source mappings) with the groups wired in as each
function's ``from_config`` wires them, but on the world's clock and a short lease timeout.
Groups have one lane unless a test asks for more (a lane is then a stream: what these tests
say of streams holds for each lane, and the lane tests say what lanes add).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from shoal.aws.dynamo import Dynamo
from shoal.core.config import GroupSettings, get_config
from shoal.groups.records import Loaded, group_key
from shoal.groups.service import GroupService, StreamRegistrar
from shoal.groups.store import GroupStore
from shoal.groups.streams import StreamReader

import functions.sessions.app as sessions_app
from tests.integration.test_delivery_support import ALICE, World

LEASE_S = 10.0


class GroupWorld(World):
    def __init__(
        self,
        session: boto3.Session,
        monkeypatch: pytest.MonkeyPatch,
        lease_s: float = LEASE_S,
        lanes: int = 1,
    ) -> None:
        super().__init__(session, monkeypatch)
        config = get_config()
        dynamo = Dynamo(session.client("dynamodb"))
        self.group_store = GroupStore(
            dynamo,
            config.table("groups"),
            config.table("inboxes"),
            settings=GroupSettings(lease_timeout_s=lease_s, lanes=lanes),
            clock=self.clock,
        )
        self.groups = GroupService(
            self.group_store,
            StreamReader(dynamo, config.table("inboxes")),
            self.settings,
            clock=self.clock,
            payloads=self.delivery.payloads,
        )
        self.subscriptions.groups = self.groups
        self.delivery.groups = self.groups
        self.registry.groups = self.groups
        self.retirer.groups = self.groups
        # the router's containers have their own store and client
        router_store = GroupStore(
            Dynamo(session.client("dynamodb")),
            config.table("groups"),
            config.table("inboxes"),
            settings=GroupSettings(lease_timeout_s=lease_s, lanes=lanes),
            clock=self.clock,
        )
        self.fanout.groups = StreamRegistrar(router_store)

    @property
    def retirer(self) -> Any:
        return self.registry.on_session_end

    def heartbeat(
        self, client_id: str, channel: str, claims: dict[str, Any] = ALICE
    ) -> list[dict[str, Any]]:
        status, answer = self.call(
            sessions_app.handler, "POST", client_id, "/heartbeat", channel=channel, claims=claims
        )
        assert status == 200, answer
        leases: list[dict[str, Any]] = answer["leases"]
        return leases

    def group(self, share: str, topic_filter: str) -> Loaded | None:
        return self.group_store.load(group_key(share, topic_filter))

    def session_id(self, client_id: str) -> str:
        head = self.registry.repository.head(client_id)
        assert head is not None and head.session_id is not None
        return head.session_id


@pytest.fixture
def gworld(aws: boto3.Session, monkeypatch: pytest.MonkeyPatch) -> Iterator[GroupWorld]:
    w = GroupWorld(aws, monkeypatch)
    w.topic("default", 2)
    yield w
