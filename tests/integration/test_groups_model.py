"""A model test of shared groups against the handlers (hypothesis stateful testing).

Random joins, leaves, crashes, restarts, heartbeats, publishes, gets, acks and waits, over
every handler with moto and a manual clock. Clients behave as MQTT clients do: they ack what
they got in the order they got it (a prefix at a time), a crashed client forgets what it held,
and an ack the server refuses (its lease was lost) is dropped.

At every step: no lease number of a stream is held by two members, and at most one member
can commit on a stream (it holds ids of the stream's current lease and the fence names it).
At the end, once everyone heartbeats, gets and acks for long enough: every published message
was acked, none twice for the group, and per ordering key in publish order.

The same machine runs on a group of four lanes per shard (``LaneMachine``), publishing
unkeyed messages too: a lane is a stream to the leader, so the same promises hold per lane,
and the order promise holds for every explicit ordering key.
"""

from __future__ import annotations

import itertools
from typing import Any, ClassVar

import boto3
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from shoal.groups.streams import parse_delivery_id

from tests.integration.test_groups_support import LEASE_S, GroupWorld, gworld

__all__ = ["gworld"]  # fixture

CLIENTS = ("c0", "c1", "c2", "c3")
KEYS = ("k0", "k1", "k2")
SETTLE_ROUNDS = 60
_examples = itertools.count()


class GroupMachine(RuleBasedStateMachine):
    world: ClassVar[GroupWorld]

    def __init__(self) -> None:
        super().__init__()
        n = next(_examples)
        self.share = f"model{n}"
        self.text = f"$share/{self.share}/orders/#"
        self.prefix = f"alice-m{n}"
        self.channels: dict[str, str] = {}
        self.sessions: dict[str, str] = {}
        self.members: set[str] = set()
        self.outstanding: dict[str, list[dict[str, Any]]] = {c: [] for c in CLIENTS}
        #: (message id, its ordering key or None: unkeyed)
        self.published: list[tuple[str, str | None]] = []
        self.acked: list[str] = []

    # -- helpers

    def cid(self, client: str) -> str:
        return f"{self.prefix}-{client}"

    def _connect(self, client: str) -> None:
        body: dict[str, Any] = {"clean_start": False, "session_expiry_s": 3600, "keepalive_s": 0}
        # a reconnect is a newer channel: versions order by connect time
        self.world.clock.advance(0.001)
        self.channels[client] = self.world.connect(self.cid(client), **body)
        self.outstanding[client] = []

    def _join(self, client: str) -> None:
        if client not in self.channels:
            self._connect(client)
        granted = self.world.subscribe(
            self.cid(client), self.channels[client], {"filter": self.text, "qos": 1}
        )
        assert granted == [1]
        self.members.add(client)
        self.sessions[client] = self.world.session_id(self.cid(client))

    def _ack(self, client: str, count: int) -> None:
        for message in self.outstanding[client][:count]:
            status, answer = self.world.ack(
                self.cid(client), self.channels[client], [message["id"]]
            )
            assert status == 200, answer
            if answer["acked"] == 1:
                self.acked.append(message["message_id"])
        del self.outstanding[client][:count]

    def _get(self, client: str, count: int) -> None:
        got = self.world.get(self.cid(client), self.channels[client], count)
        self.outstanding[client] += got

    # -- rules

    @initialize()
    def first_members_and_messages(self) -> None:
        # every example starts with two members and a backlog over every key
        self._join("c0")
        self._join("c1")
        for n in range(6):
            self.publish(KEYS[n % len(KEYS)], 1)

    @rule(client=st.sampled_from(CLIENTS))
    def join(self, client: str) -> None:
        if client not in self.members:
            self._join(client)

    @precondition(lambda self: len(self.members) > 1)
    @rule(client=st.sampled_from(CLIENTS))
    def leave(self, client: str) -> None:
        if client not in self.members or client not in self.channels:
            return
        status, answer = self.world.unsubscribe(self.cid(client), self.channels[client], self.text)
        assert status == 200, answer
        self.members.discard(client)
        self.outstanding[client] = []

    @rule(client=st.sampled_from(CLIENTS))
    def crash(self, client: str) -> None:
        # the process dies: no disconnect, and whatever it held unacked is forgotten
        self.channels.pop(client, None)
        self.outstanding[client] = []

    @rule(client=st.sampled_from(CLIENTS))
    def restart(self, client: str) -> None:
        if client in self.members and client not in self.channels:
            self._connect(client)

    @rule(client=st.sampled_from(CLIENTS))
    def heartbeat(self, client: str) -> None:
        if client in self.channels:
            self.world.heartbeat(self.cid(client), self.channels[client])

    @rule(key=st.sampled_from(KEYS), count=st.integers(1, 3))
    def publish(self, key: str, count: int) -> None:
        for _ in range(count):
            message_id = self.world.publish(f"orders/{key}", "m", ordering_key=key, qos=1)
            self.published.append((message_id, key))
        self.world.route()

    @rule(client=st.sampled_from(CLIENTS), count=st.integers(1, 5))
    def get(self, client: str, count: int) -> None:
        if client in self.channels:
            self._get(client, count)

    @rule(client=st.sampled_from(CLIENTS), count=st.integers(1, 5))
    def ack(self, client: str, count: int) -> None:
        if client in self.channels:
            self._ack(client, count)

    @rule(seconds=st.sampled_from([1.0, LEASE_S / 2, LEASE_S + 1, 31.0]))
    def wait(self, seconds: float) -> None:
        self.world.clock.advance(seconds)

    # -- at every step

    @invariant()
    def one_member_per_lease_and_one_committer_per_stream(self) -> None:
        owners: dict[tuple[str, int], str] = {}
        for client, messages in self.outstanding.items():
            for message in messages:
                delivery = parse_delivery_id(message["id"])
                assert delivery is not None
                owner = owners.setdefault((delivery.source, delivery.lease), client)
                assert owner == client, f"lease {delivery.lease} of {delivery.source} twice"
        key = self.world.groups.store
        for source in {s for s, _ in owners}:
            fence = key.progress(self._group_key(), source)
            assert fence is not None
            committers = {
                client
                for (s, lease), client in owners.items()
                if s == source
                and lease == fence.lease
                and fence.holder == self.sessions.get(client)
                and fence.state.value != "revoked"
            }
            assert len(committers) <= 1, (source, committers)

    def _group_key(self) -> str:
        from shoal.groups.store import group_key

        return group_key(self.share, "orders/#")

    # -- at the end

    def teardown(self) -> None:
        # everyone comes back, acks what it holds, then heartbeats, gets and acks until done
        for client in sorted(self.members):
            if client not in self.channels:
                self._connect(client)
            self._ack(client, len(self.outstanding[client]))
        wanted = {m for m, _ in self.published}
        for _ in range(SETTLE_ROUNDS):
            if wanted <= set(self.acked):
                break
            self.world.clock.advance(2.0)
            for client in sorted(self.members):
                self.world.heartbeat(self.cid(client), self.channels[client])
            for client in sorted(self.members):
                self._get(client, 100)
                self._ack(client, len(self.outstanding[client]))
        # every published message was acked, none twice for the group
        assert sorted(self.acked) == sorted(wanted)
        # per ordering key, acked in publish order
        key_of = dict(self.published)
        for key in KEYS:
            assert [m for m in self.acked if key_of[m] == key] == [
                m for m, k in self.published if k == key
            ]
        # the group goes with its last member (later examples start from a clean slate)
        for client in sorted(self.members):
            status, _ = self.world.unsubscribe(self.cid(client), self.channels[client], self.text)
            assert status == 200
        assert self.world.group(self.share, "orders/#") is None


class LaneMachine(GroupMachine):
    @rule(count=st.integers(1, 4))
    def publish_unkeyed(self, count: int) -> None:
        for n in range(count):
            message_id = self.world.publish(f"orders/u{n}", "m", qos=1)
            self.published.append((message_id, None))
        self.world.route()


def test_shared_groups_keep_their_promises_under_random_operations(gworld: GroupWorld) -> None:
    GroupMachine.world = gworld
    run_state_machine_as_test(
        GroupMachine,
        settings=settings(
            max_examples=20,
            stateful_step_count=40,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        ),
    )


def test_lanes_keep_the_promises_under_random_operations(
    aws: boto3.Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    world = GroupWorld(aws, monkeypatch, lanes=4)
    world.topic("default", 2)
    LaneMachine.world = world
    run_state_machine_as_test(
        LaneMachine,
        settings=settings(
            max_examples=15,
            stateful_step_count=40,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
