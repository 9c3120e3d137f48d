"""Durable shared subscriptions over ``shoal dev``: sharing, a killed member, offline members,
and a group next to a plain subscription; and on a topic of one partition, its lanes: members
share its unkeyed messages, keyed messages keep their order, a killed member's unacked
messages move. The lease timeout is 2 s here (the deployed default is 6 s), so a dead
member's streams move within seconds; groups have the default lane count."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import DevServer, _servers

pytestmark = pytest.mark.e2e

LEASE_S = 2.0
DEADLINE_S = 120.0


@pytest.fixture(scope="module")
def groups_dev(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevServer]:
    """One ``shoal dev`` with a short group lease timeout and the ``orders`` topic (4 shards)."""
    directory: Path = tmp_path_factory.mktemp("groups-dev")
    with _servers(directory) as start:
        dev = start(env={"SHOAL_GROUP_LEASE_TIMEOUT_S": str(LEASE_S)})
        admin = dev.token("ops", admin=True)
        status, body = dev.request(
            "POST", "/v1/topics", token=admin, json={"name": "orders", "partitions": 4}
        )
        assert status == 201, body
        status, body = dev.request(
            "POST", "/v1/topics", token=admin, json={"name": "jobs", "partitions": 1}
        )
        assert status == 201, body
        yield dev


class Member:
    """One client session over HTTP, subscribed to one filter."""

    def __init__(self, dev: DevServer, token: str, client_id: str, topic_filter: str) -> None:
        self.dev = dev
        self.token = token
        self.client_id = client_id
        self.channel = ""
        self.connect(clean_start=True)
        status, body = self.call(
            "POST", "/subscriptions", json={"subscriptions": [{"filter": topic_filter, "qos": 1}]}
        )
        assert (status, body) == (200, {"granted": [1]}), body

    def call(self, method: str, suffix: str = "", **kw: Any) -> tuple[int, Any]:
        headers = {"Shoal-Channel": self.channel} if self.channel else None
        return self.dev.request(
            method,
            f"/v1/sessions/{self.client_id}{suffix}",
            token=self.token,
            headers=headers,
            **kw,
        )

    def connect(self, *, clean_start: bool) -> bool:
        self.channel = ""
        body = {"clean_start": clean_start, "session_expiry_s": 600, "keepalive_s": 60}
        status, answer = self.call("PUT", json=body)
        assert status == 200, answer
        self.channel = answer["channel"]
        return bool(answer["session_present"])

    def disconnect(self) -> None:
        assert self.call("DELETE")[0] == 204

    def heartbeat(self) -> list[dict[str, Any]]:
        status, answer = self.call("POST", "/heartbeat")
        assert status == 200, answer
        leases: list[dict[str, Any]] = answer["leases"]
        return leases

    def get(self, max_messages: int = 100) -> list[dict[str, Any]]:
        status, answer = self.call("GET", f"/messages?max={max_messages}")
        assert status == 200, answer
        messages: list[dict[str, Any]] = answer["messages"]
        return messages

    def ack(self, ids: list[str]) -> int:
        status, answer = self.call("POST", "/acks", json={"ids": ids})
        assert status == 200, answer
        acked: int = answer["acked"]
        return acked


def publish(dev: DevServer, token: str, topic_prefix: str, count: int, keys: int) -> list[str]:
    """Publish ``count`` messages over ``keys`` ordering keys (0: without one); their ids in
    publish order."""
    ids: list[str] = []
    for start in range(0, count, 500):
        batch = [
            {
                "topic": f"{topic_prefix}/{n % 10}",
                "text": f"m{n}",
                **({"ordering_key": f"k{n % keys}"} if keys else {}),
            }
            for n in range(start, min(count, start + 500))
        ]
        for _attempt in range(5):
            status, body = dev.request(
                "POST", "/v1/messages:batch", token=token, json={"messages": batch}
            )
            # a batch none of whose messages the storage topic took (503 server_busy for each,
            # seen on CI's starved machine) stored nothing: a publisher sends it again
            if status != 200 or any(
                r.get("error", {}).get("code") != "server_busy" for r in body["results"]
            ):
                break
            time.sleep(2.0)
        assert status == 200, body
        assert all("error" not in r for r in body["results"]), body
        ids += [r["message_id"] for r in body["results"]]
    return ids


def holding(member: Member) -> list[str]:
    """The ids of the first messages ``member`` gets (heartbeating until some come), which it
    then holds unacked."""
    held: list[str] = []
    deadline = time.monotonic() + DEADLINE_S
    while not held and time.monotonic() < deadline:
        member.heartbeat()
        held = [m["message_id"] for m in member.get()]
    return held


#: a member beats this often while it acks (its keepalive is 60 s: silent 90 s, it is disconnected)
HEARTBEAT_EVERY_S = 20.0


class Tally:
    """What members got and acked: every accepted ack, in the order the test saw them."""

    def __init__(self, *, one_by_one: bool = True) -> None:
        self.one_by_one = one_by_one
        self.acked: list[str] = []
        self.acked_by: dict[str, int] = {}
        self.dup: set[str] = set()
        #: acks of a batch that were not all accepted (which ones, the count does not say)
        self.partial = 0

    def round(self, member: Member) -> int:
        member.heartbeat()
        beat = time.monotonic()
        got = member.get()
        self.dup |= {m["message_id"] for m in got if m["dup"]}
        if self.one_by_one:
            # one id per ack: the answer says whether this very message was acked now. Gets and
            # acks do not refresh the keepalive (60 s; only a heartbeat does): a client keeps
            # beating while it acks a page one by one, which took 208 s on CI's starved machine
            accepted = []
            for m in got:
                if time.monotonic() - beat > HEARTBEAT_EVERY_S:
                    member.heartbeat()
                    beat = time.monotonic()
                if member.ack([m["id"]]) == 1:
                    accepted.append(m)
        elif got:
            count = member.ack([m["id"] for m in got])
            accepted = got if count == len(got) else []
            self.partial += 0 if count == len(got) else count
        else:
            accepted = []
        self.acked += [m["message_id"] for m in accepted]
        self.acked_by[member.client_id] = self.acked_by.get(member.client_id, 0) + len(accepted)
        return len(got)

    def drain(self, members: list[Member], total: int) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while len(self.acked) < total and time.monotonic() < deadline:
            if sum(self.round(m) for m in members) == 0:
                time.sleep(0.1)


def test_three_members_share_a_thousand_messages_each_acked_once(groups_dev: DevServer) -> None:
    dev = groups_dev
    token = dev.token("shop", clients=["sh-*"], publish=["orders/#"], subscribe=["orders/#"])
    # Given three members of $share/g/orders/#
    members = [Member(dev, token, f"sh-{n}", "$share/g/orders/#") for n in range(3)]
    for member in members:
        member.heartbeat()
    # When 1,000 messages over 20 ordering keys are published and the members get and ack
    published = publish(dev, token, "orders/eu", 1000, keys=20)
    tally = Tally(one_by_one=False)
    tally.drain(members, len(published))
    # Then every message was acked exactly once, by the group, spread over all three members
    assert tally.partial == 0
    assert sorted(tally.acked) == sorted(published)
    assert len(tally.acked) == len(set(tally.acked)) == 1000
    assert all(tally.acked_by.get(f"sh-{n}") for n in range(3)), tally.acked_by
    # and per ordering key in publish order
    key_of = {m: n % 20 for n, m in enumerate(published)}
    for key in range(20):
        assert [m for m in tally.acked if key_of[m] == key] == [
            m for m in published if key_of[m] == key
        ]


def test_a_killed_members_unacked_messages_reach_the_others_after_the_lease_timeout(
    groups_dev: DevServer,
) -> None:
    dev = groups_dev
    token = dev.token("kill", clients=["kl-*"], publish=["orders/#"], subscribe=["orders/#"])
    members = [Member(dev, token, f"kl-{n}", "$share/k/orders/#") for n in range(3)]
    for member in members:
        member.heartbeat()
    published = publish(dev, token, "orders/us", 150, keys=12)
    # Given the first member holding messages it never acks, then killed (it calls no more)
    victim, survivors = members[0], members[1:]
    held = holding(victim)
    assert held
    # When the others keep heartbeating, getting and acking
    tally = Tally()
    tally.drain(survivors, len(published))
    # Then every message, the victim's too, was acked once by the survivors
    assert sorted(tally.acked) == sorted(published)
    assert set(tally.acked_by) <= {"kl-1", "kl-2"}
    # and the victim's came again, marked dup
    assert set(held) <= tally.dup


def test_messages_accumulate_while_all_members_are_offline(groups_dev: DevServer) -> None:
    dev = groups_dev
    token = dev.token("away", clients=["aw-*"], publish=["orders/#"], subscribe=["orders/#"])
    # Given two members that disconnect (their sessions stay: session expiry 600 s)
    members = [Member(dev, token, f"aw-{n}", "$share/a/orders/#") for n in range(2)]
    for member in members:
        member.heartbeat()
        member.disconnect()
    # When messages are published while nobody is connected
    published = publish(dev, token, "orders/asia", 100, keys=5)
    time.sleep(LEASE_S)
    # Then a member that comes back gets all of them
    returning = members[0]
    assert returning.connect(clean_start=False) is True
    tally = Tally()
    tally.drain([returning], len(published))
    assert sorted(tally.acked) == sorted(published)


def test_a_group_and_a_plain_subscription_on_one_topic_both_get_everything(
    groups_dev: DevServer,
) -> None:
    dev = groups_dev
    token = dev.token("both", clients=["bo-*"], publish=["orders/#"], subscribe=["orders/#"])
    # Given one group member and one plain subscriber of the same topics
    grouped = Member(dev, token, "bo-group", "$share/b/orders/mx/#")
    plain = Member(dev, token, "bo-plain", "orders/mx/#")
    grouped.heartbeat()
    # When 50 messages are published
    published = publish(dev, token, "orders/mx", 50, keys=5)
    # Then each gets all 50
    for member in (grouped, plain):
        tally = Tally()
        tally.drain([member], len(published))
        assert sorted(tally.acked) == sorted(published), member.client_id


# -- one partition, several members: lanes ------------------------------------------------------


def test_four_members_share_one_partitions_unkeyed_messages(groups_dev: DevServer) -> None:
    dev = groups_dev
    token = dev.token("pool", clients=["po-*"], publish=["jobs/#"], subscribe=["jobs/#"])
    # Given four members of a group on a topic of one partition
    members = [Member(dev, token, f"po-{n}", "$share/pool/jobs/#") for n in range(4)]
    for member in members:
        member.heartbeat()
    # When 400 messages without an ordering key are published and the members get and ack
    published = publish(dev, token, "jobs/a", 400, keys=0)
    tally = Tally(one_by_one=False)
    tally.drain(members, len(published))
    # Then every message was acked once, and every member did at least 10% of the work
    assert tally.partial == 0
    assert sorted(tally.acked) == sorted(published)
    assert len(tally.acked) == len(set(tally.acked))
    assert all(tally.acked_by.get(f"po-{n}", 0) >= 40 for n in range(4)), tally.acked_by


def test_keyed_messages_of_one_partition_keep_their_order_over_members(
    groups_dev: DevServer,
) -> None:
    dev = groups_dev
    token = dev.token("keys", clients=["ky-*"], publish=["jobs/#"], subscribe=["jobs/#"])
    members = [Member(dev, token, f"ky-{n}", "$share/keys/jobs/#") for n in range(4)]
    for member in members:
        member.heartbeat()
    # When 300 messages over 12 ordering keys are published to one partition
    published = publish(dev, token, "jobs/b", 300, keys=12)
    tally = Tally(one_by_one=False)
    tally.drain(members, len(published))
    # Then each was acked once, per key in publish order, and more than one member worked
    assert tally.partial == 0
    assert sorted(tally.acked) == sorted(published)
    key_of = {m: n % 12 for n, m in enumerate(published)}
    for key in range(12):
        assert [m for m in tally.acked if key_of[m] == key] == [
            m for m in published if key_of[m] == key
        ]
    assert sum(1 for n in tally.acked_by.values() if n) > 1, tally.acked_by


def test_a_killed_members_unacked_messages_of_one_partition_move_within_the_lease_timeout(
    groups_dev: DevServer,
) -> None:
    dev = groups_dev
    token = dev.token("lost", clients=["ls-*"], publish=["jobs/#"], subscribe=["jobs/#"])
    members = [Member(dev, token, f"ls-{n}", "$share/lost/jobs/#") for n in range(3)]
    for member in members:
        member.heartbeat()
    published = publish(dev, token, "jobs/c", 120, keys=0)
    # Given the first member holding messages of its lanes it never acks, then killed
    victim, survivors = members[0], members[1:]
    held = holding(victim)
    assert held
    killed_at = time.monotonic()
    # When the others keep heartbeating, getting and acking
    tally = Tally(one_by_one=False)
    moved_at: float | None = None
    deadline = time.monotonic() + DEADLINE_S
    while len(tally.acked) < len(published) and time.monotonic() < deadline:
        if sum(tally.round(m) for m in survivors) == 0:
            time.sleep(0.1)
        if moved_at is None and set(held) <= set(tally.acked):
            moved_at = time.monotonic()
    # Then every message, the victim's too, was acked once by the survivors, the victim's as
    # dup, once its lease ran out (plus a heartbeat; the bound is loose: shared machines)
    assert sorted(tally.acked) == sorted(published)
    assert set(held) <= tally.dup
    # (CI's machine took 10.1 s with a 2 s lease: the bound says "soon after the lease", and a
    # minute is what a starved machine needs for the reaper's sweep and the survivors' gets)
    assert moved_at is not None and moved_at - killed_at < LEASE_S + 60.0


def test_a_new_group_gets_nothing_published_before_it_not_even_a_retained_message(
    groups_dev: DevServer,
) -> None:
    """A subscription starts where it was made (issue 33): the router is about a second
    behind, so before the cut a group made right after a publish got that message live."""
    dev = groups_dev
    token = dev.token("cut", clients=["ct-*"], publish=["jobs/#"], subscribe=["jobs/#"])

    def publish_one(text: str, **body: Any) -> str:
        status, answer = dev.request(
            "POST", "/v1/messages", token=token, json={"topic": "jobs/cut", "text": text, **body}
        )
        assert status == 201, answer
        message_id: str = answer["message_id"]
        return message_id

    # Given a retained publish, then at once a new shared subscription (its group's first)
    publish_one("retained-1", retain=True)
    member = Member(dev, token, "ct-a", "$share/cut/jobs/cut")
    # Then nothing reaches it within 2 s (the router has long passed the record by then)
    got: list[dict[str, Any]] = []
    until = time.monotonic() + 2.0
    while time.monotonic() < until:
        member.heartbeat()
        got += member.get()
        time.sleep(0.2)
    assert got == []
    # and a job published now does reach it
    later = publish_one("job-2")
    assert holding(member) == [later]
