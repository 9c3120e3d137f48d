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

``Qos2Machine`` subscribes with QoS 2, publishes QoS 2 messages beside QoS 1 ones, and ends
sessions (a clean start) ([MQTT-4.8.2-4/5]): at every step no QoS 2 message has been handed to
more than one session; at the end every message was acked once, except QoS 2 messages whose
session ended (or left the group) before acking them, which no one acked.
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
    #: the members' subscription QoS
    qos: ClassVar[int] = 1

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
            self.cid(client), self.channels[client], {"filter": self.text, "qos": self.qos}
        )
        assert granted == [self.qos]
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
        self._handed(client, got)

    def _handed(self, client: str, got: list[dict[str, Any]]) -> None:
        """What a get handed out (QoS 2 bookkeeping in ``Qos2Machine``)."""

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
        self._leaving(client)
        status, answer = self.world.unsubscribe(self.cid(client), self.channels[client], self.text)
        assert status == 200, answer
        self.members.discard(client)
        self.outstanding[client] = []

    def _leaving(self, client: str) -> None:
        """A member leaves the group (QoS 2 bookkeeping in ``Qos2Machine``)."""

    def _settled(self) -> bool:
        return {m for m, _ in self.published} <= set(self.acked)

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
        from shoal.groups.records import group_key

        return group_key(self.share, "orders/#")

    # -- at the end

    def _settle(self) -> None:
        # everyone comes back, acks what it holds, then heartbeats, gets and acks until done
        for client in sorted(self.members):
            if client not in self.channels:
                self._connect(client)
            self._ack(client, len(self.outstanding[client]))
        for _ in range(SETTLE_ROUNDS):
            if self._settled():
                break
            self.world.clock.advance(2.0)
            for client in sorted(self.members):
                self.world.heartbeat(self.cid(client), self.channels[client])
            for client in sorted(self.members):
                self._get(client, 100)
                self._ack(client, len(self.outstanding[client]))

    def _remove_group(self) -> None:
        # the group goes with its last member (later examples start from a clean slate)
        for client in sorted(self.members):
            status, _ = self.world.unsubscribe(self.cid(client), self.channels[client], self.text)
            assert status == 200
        assert self.world.group(self.share, "orders/#") is None

    def teardown(self) -> None:
        self._settle()
        wanted = {m for m, _ in self.published}
        # every published message was acked, none twice for the group
        assert sorted(self.acked) == sorted(wanted)
        # per ordering key, acked in publish order
        key_of = dict(self.published)
        for key in KEYS:
            assert [m for m in self.acked if key_of[m] == key] == [
                m for m, k in self.published if k == key
            ]
        self._remove_group()


class Qos2Machine(GroupMachine):
    qos: ClassVar[int] = 2

    def __init__(self) -> None:
        super().__init__()
        #: QoS 2 message id -> every session it was handed to
        self.pinned: dict[str, set[str]] = {}
        #: sessions that ended (or left the group): their unacked QoS 2 messages go to no one
        self.ended: set[str] = set()

    def _handed(self, client: str, got: list[dict[str, Any]]) -> None:
        for message in got:
            if message["qos"] == 2:
                self.pinned.setdefault(message["message_id"], set()).add(self.sessions[client])

    @rule(key=st.sampled_from(KEYS), count=st.integers(1, 3))
    def publish_qos2(self, key: str, count: int) -> None:
        for _ in range(count):
            message_id = self.world.publish(f"orders/{key}", "m", ordering_key=key, qos=2)
            self.published.append((message_id, key))
        self.world.route()

    @precondition(lambda self: len(self.members) > 1)
    @rule(client=st.sampled_from(CLIENTS))
    def end_session(self, client: str) -> None:
        # a clean start discards the session: it leaves the group, its QoS 2 messages drop
        if client not in self.members:
            return
        self.ended.add(self.sessions[client])
        self.world.clock.advance(0.001)
        self.channels[client] = self.world.connect(self.cid(client), clean_start=True)
        self.outstanding[client] = []
        self.members.discard(client)

    def _leaving(self, client: str) -> None:
        self.ended.add(self.sessions[client])

    def _settled(self) -> bool:
        return all(
            m in self.acked or self.pinned.get(m, {""}) <= self.ended for m, _ in self.published
        )

    @invariant()
    def a_qos2_message_goes_to_one_session(self) -> None:
        for message_id, sessions in self.pinned.items():
            assert len(sessions) == 1, (message_id, sessions)

    def teardown(self) -> None:
        self._settle()
        acked = set(self.acked)
        assert len(self.acked) == len(acked), "a message acked twice for the group"
        for message_id, _ in self.published:
            if message_id in acked:
                continue
            # only a QoS 2 message of a session that ended before acking it may go unacked
            sessions = self.pinned.get(message_id, set())
            assert sessions and sessions <= self.ended, (message_id, sessions)
        self._remove_group()


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


def test_qos2_in_a_group_stays_with_its_session_under_random_operations(
    gworld: GroupWorld,
) -> None:
    Qos2Machine.world = gworld
    run_state_machine_as_test(
        Qos2Machine,
        settings=settings(
            max_examples=8,
            stateful_step_count=30,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
