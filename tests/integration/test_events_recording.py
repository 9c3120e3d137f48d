"""What the services record for the audit (``shoal.delivery.events``): the router, session get
and ack, shared-group get and ack, push attempts; one log record per invocation, archived by
the archiver (``archive_events``), and a retried invocation's record replaces its first."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from botocore.client import BaseClient
from shoal.core.config import get_config
from shoal.core.faults import ROUTER_STEPS, FaultPlan, InjectedFault
from shoal.delivery.events import EVENT_LOG, EVENTS_PREFIX, Recording
from shoal.delivery.subscriptions import SubscriptionRetirer

import functions.router.app as router_app
from tests.helpers import archive_events
from tests.integration.test_delivery_support import World, world
from tests.integration.test_groups_support import GroupWorld, gworld
from tests.integration.test_push_harness import PushHarness
from tests.unit.test_push_support import Switch

__all__ = ["gworld", "world"]  # fixtures

FAST = {"max_attempts": 2, "initial_backoff_s": 1, "max_backoff_s": 1}


def objects(session: boto3.Session) -> dict[str, list[dict[str, Any]]]:
    """Every delivery-event object, once the archiver has had the log: key -> its lines."""
    archive_events(session)
    s3 = session.client("s3")
    bucket = get_config().buckets["archive"]
    listed = s3.list_objects_v2(Bucket=bucket, Prefix=EVENTS_PREFIX + "/").get("Contents", [])
    return {
        o["Key"]: [
            json.loads(line)
            for line in s3.get_object(Bucket=bucket, Key=o["Key"])["Body"].read().splitlines()
        ]
        for o in listed
    }


def recording_of(session: boto3.Session, clock: Any) -> Recording:
    return Recording(get_config().streams[EVENT_LOG], clock, session.client("kinesis"))


def log_records(session: boto3.Session) -> int:
    """Records in the event log (one shard)."""
    kinesis = session.client("kinesis")
    stream = get_config().streams[EVENT_LOG]
    [shard] = kinesis.list_shards(StreamName=stream)["Shards"]
    iterator = kinesis.get_shard_iterator(
        StreamName=stream, ShardId=shard["ShardId"], ShardIteratorType="TRIM_HORIZON"
    )["ShardIterator"]
    return len(kinesis.get_records(ShardIterator=iterator)["Records"])


def events(session: boto3.Session) -> list[dict[str, Any]]:
    return [e for lines in objects(session).values() for e in lines]


def kinds(session: boto3.Session, consumer_kind: str) -> Counter[str]:
    return Counter(e["event"] for e in events(session) if e["consumer_kind"] == consumer_kind)


@pytest.fixture
def recording(world: World, aws: boto3.Session) -> Iterator[World]:
    world.delivery.events = recording_of(aws, world.clock)
    yield world


class OneFault:
    """The router's fault switch failing its first invocation at one step, then never."""

    def __init__(self, step: str) -> None:
        self.step: str | None = step

    def plan(self, steps: Any) -> FaultPlan:
        step, self.step = self.step, None
        return FaultPlan(step)


def test_route_get_and_ack_record_routed_delivered_and_acked(
    recording: World, aws: boto3.Session
) -> None:
    w = recording
    # Given a subscribed session and three messages routed to it
    channel = w.connect("alice-1")
    w.subscribe("alice-1", channel, "orders/#")
    ids = [w.publish("orders/a", f"m{n}") for n in range(3)]
    w.route()
    # When it gets and acks them
    got = w.get("alice-1", channel)
    status, _ = w.ack("alice-1", channel, [m["id"] for m in got])
    assert status == 200
    # Then one routed, one delivered and one acked event per message, all for its session
    lines = events(aws)
    session_ids = {e["consumer"] for e in lines}
    assert len(session_ids) == 1
    by_kind = {k: [e for e in lines if e["event"] == k] for k in ("routed", "delivered", "acked")}
    assert [e["message_id"] for e in by_kind["routed"]] == ids
    assert [e["message_id"] for e in by_kind["delivered"]] == ids
    assert {e["label"] for e in by_kind["delivered"]} == {"alice-1"}
    assert sorted(e["delivery_id"] for e in by_kind["acked"]) == sorted(m["id"] for m in got)
    # And each invocation appended one record (router, get, ack), archived as one object
    assert log_records(aws) == 3
    assert len(objects(aws)) == 1


@pytest.mark.parametrize("step", ROUTER_STEPS)
def test_a_router_failing_at_any_step_records_each_routed_message_once(
    recording: World, aws: boto3.Session, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    w = recording
    # Given a router whose first invocation fails at one step
    switch = OneFault(step)
    monkeypatch.setattr(router_app.router(), "faults", switch)
    channel = w.connect("alice-1")
    w.subscribe("alice-1", channel, "orders/#")
    ids = [w.publish("orders/a", f"m{n}") for n in range(3)]
    # When the mapping retries the batch until it succeeds
    w.route()
    # Then the messages are delivered once and every one is recorded as routed
    assert [m["message_id"] for m in w.drain("alice-1", channel)] == ids
    routed = Counter(e["message_id"] for e in events(aws) if e["event"] == "routed")
    assert set(routed) == set(ids)
    assert switch.step is None and w.invocations >= 2
    # And once only if the failed attempt wrote no object (after it, the mapping bisects the
    # batch: its halves are other objects, whose lines the audit drops as held twice)
    if ROUTER_STEPS.index(step) < ROUTER_STEPS.index("after_events"):
        assert set(routed.values()) == {1}


def test_the_fault_step_raises_only_at_its_step() -> None:
    # Given a plan failing after the inbox writes
    plan = FaultPlan("after_inbox")
    # Then other steps pass and that one raises
    plan.at("before_inbox")
    with pytest.raises(InjectedFault):
        plan.at("after_inbox")


def test_a_redelivery_keeps_its_delivery_id_and_is_recorded_as_such(
    recording: World, aws: boto3.Session
) -> None:
    w = recording
    # Given a message handed out and never acked
    channel = w.connect("alice-1")
    w.subscribe("alice-1", channel, "orders/#")
    w.publish("orders/a", "m")
    w.route()
    [first] = w.get("alice-1", channel)
    # When the ack timeout passes and the session gets again
    w.clock.advance(w.settings.ack_timeout_s + 1)
    [again] = w.get("alice-1", channel)
    # Then the second hand-out is recorded as redelivered, under the same delivery id
    handed = [e for e in events(aws) if e["event"] in ("delivered", "redelivered")]
    assert sorted((e["event"], e["delivery_id"]) for e in handed) == [
        ("delivered", first["id"]),
        ("redelivered", first["id"]),
    ]
    assert again["dup"] is True


def test_a_retried_ack_replaces_its_first_record(recording: World, aws: boto3.Session) -> None:
    w = recording
    # Given a delivered and acked message
    channel = w.connect("alice-1")
    w.subscribe("alice-1", channel, "orders/#")
    w.publish("orders/a", "m")
    w.route()
    [got] = w.get("alice-1", channel)
    w.ack("alice-1", channel, [got["id"]])
    # When the same ack comes again (a client retry after a lost answer)
    status, answer = w.ack("alice-1", channel, [got["id"]])
    # Then nothing is acked now; the ack recorded its batch again (the same key hint), and
    # the archiver keeps one copy of it, as the same object key was overwritten before
    assert (status, answer["acked"]) == (200, 0)
    assert log_records(aws) == 4
    acked = [e for e in events(aws) if e["event"] == "acked"]
    assert [e["delivery_id"] for e in acked] == [got["id"]]


def test_messages_of_a_dropped_subscription_are_recorded_as_dropped(
    recording: World, aws: boto3.Session
) -> None:
    w = recording
    # Given a message routed to a subscription the session then drops
    channel = w.connect("alice-1")
    w.subscribe("alice-1", channel, "orders/#")
    message_id = w.publish("orders/a", "m")
    w.route()
    w.unsubscribe("alice-1", channel, "orders/#")
    # When the session gets
    assert w.get("alice-1", channel) == []
    # Then the message is recorded as dropped, unsubscribed
    [dropped] = [e for e in events(aws) if e["event"] == "dropped"]
    assert (dropped["message_id"], dropped["reason"]) == (message_id, "unsubscribed")


def test_shared_group_get_and_ack_record_under_the_group(
    gworld: GroupWorld, aws: boto3.Session
) -> None:
    w = gworld
    recording = recording_of(aws, w.clock)
    w.groups.events = recording
    # Given the only member of a shared group and two messages routed to the group
    channel = w.connect("alice-1")
    w.subscribe("alice-1", channel, "$share/g/orders/#")
    ids = [w.publish("orders/a", f"m{n}", ordering_key="k") for n in range(2)]
    w.route()
    # When the member gets and acks them
    got = w.drain("alice-1", channel)
    # Then routed, delivered and acked are recorded for the group, the member as label
    assert [m["message_id"] for m in got] == ids
    group = [e for e in events(aws) if e["consumer_kind"] == "group"]
    assert Counter(e["event"] for e in group) == {"routed": 2, "delivered": 2, "acked": 2}
    assert len({e["consumer"] for e in group}) == 1
    member = w.session_id("alice-1")
    assert {e["label"] for e in group if e["event"] != "routed"} == {member}
    acked = sorted(e["delivery_id"] for e in group if e["event"] == "acked")
    assert acked == sorted(m["id"] for m in got)


def test_a_group_message_that_expires_before_any_member_gets_it_is_recorded_as_dropped(
    gworld: GroupWorld, aws: boto3.Session
) -> None:
    w = gworld
    w.groups.events = recording_of(aws, w.clock)
    # Given a group member and a short-lived message routed to the group, then a long-lived one
    channel = w.connect("alice-1")
    w.subscribe("alice-1", channel, "$share/g/orders/#")
    short = w.publish("orders/a", "short", properties={"message_expiry_s": 5})
    long = w.publish("orders/a", "long", properties={"message_expiry_s": 600})
    w.route()
    # When the member gets after the first expired (heartbeating, so it keeps its stream)
    for _ in range(5):
        w.clock.advance(2)
        w.heartbeat("alice-1", channel)
    got = w.get("alice-1", channel)
    # Then only the long-lived one goes out, and the expired one is recorded as dropped
    assert [m["message_id"] for m in got] == [long]
    group = [e for e in events(aws) if e["consumer_kind"] == "group"]
    [dropped] = [e for e in group if e["event"] == "dropped"]
    assert (dropped["message_id"], dropped["reason"]) == (short, "expired")
    assert [e["message_id"] for e in group if e["event"] == "delivered"] == [long]


@pytest.fixture
def push(aws: boto3.Session, monkeypatch: pytest.MonkeyPatch) -> Iterator[PushHarness]:
    h = PushHarness(aws, monkeypatch)
    h.consumer.events = recording_of(aws, h.clock)
    yield h


def test_push_attempts_record_delivered_redelivered_acked_and_dead_lettered(
    push: PushHarness, aws: boto3.Session
) -> None:
    # Given a push subscription whose endpoint fails key "bad" and takes key "good"
    push.subscribe(retry=FAST)
    push.endpoint.respond = Switch("bad")
    good = push.publish("good", 1)
    bad = push.publish("bad", 1)
    # When the push function works until nothing moves
    push.drain()
    # Then the good one is delivered and acked, the bad one tried twice and dead-lettered
    lines = [e for e in events(aws) if e["consumer_kind"] == "push"]
    seen = sorted((e["message_id"] == good, e["event"], e.get("attempt")) for e in lines)
    assert seen == [
        (False, "dead_lettered", 2),
        (False, "delivered", 1),
        (False, "redelivered", 2),
        (True, "acked", 1),
        (True, "delivered", 1),
    ]
    [dead] = [e for e in lines if e["event"] == "dead_lettered"]
    assert (dead["message_id"], dead["reason"], dead["consumer"]) == (bad, "http_503", "orders")


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Every AWS call any client makes from here on, as "service.Operation" (over moto)."""
    counted: Counter[str] = Counter()
    make_call = getattr(BaseClient, "_make_api_call")  # noqa: B009 - private, untyped

    def counting(client: Any, operation: str, params: Any) -> Any:
        counted[f"{client.meta.service_model.service_name}.{operation}"] += 1
        return make_call(client, operation, params)

    monkeypatch.setattr(BaseClient, "_make_api_call", counting)
    return counted


def test_a_get_and_an_ack_each_append_one_record_and_write_no_object(
    recording: World, aws: boto3.Session, calls: Counter[str]
) -> None:
    w = recording
    # Given a session with three messages routed to it
    channel = w.connect("alice-1")
    w.subscribe("alice-1", channel, "orders/#")
    for n in range(3):
        w.publish("orders/a", f"m{n}")
    w.route()
    # When it gets them
    calls.clear()
    got = w.get("alice-1", channel)
    # Then the get made one PutRecords and no S3 write
    assert len(got) == 3
    assert (calls["kinesis.PutRecords"], calls["s3.PutObject"]) == (1, 0)
    # And so did the ack
    calls.clear()
    w.ack("alice-1", channel, [m["id"] for m in got])
    assert (calls["kinesis.PutRecords"], calls["s3.PutObject"]) == (1, 0)


def test_a_sessions_end_is_recorded_so_what_it_did_not_ack_is_dropped_not_lost(
    recording: World, aws: boto3.Session
) -> None:
    """MQTT 5 lets the server discard an ended session's state (§4.1): its unacked messages go
    with it. The audit judged them lost, since nothing said so; the end is now an event."""
    w = recording
    retirer = w.registry.on_session_end
    assert isinstance(retirer, SubscriptionRetirer)
    retirer.events = recording_of(aws, w.clock)
    # Given a session with a message routed to it and never acked
    channel = w.connect("alice-1")
    w.subscribe("alice-1", channel, "orders/#")
    w.publish("orders/a", "m")
    w.route()
    old = w.registry.repository.head("alice-1")
    assert old is not None and old.session_id
    # When a connect with a clean start ends it
    w.connect("alice-1", clean_start=True)
    # Then the old session's end is recorded, naming no message
    [ended] = [e for e in events(aws) if e["event"] == "ended"]
    assert (ended["consumer_kind"], ended["consumer"]) == ("session", old.session_id)
    assert (ended["reason"], ended["message_id"]) == ("session_ended", "")


def test_a_shared_groups_removal_is_recorded_so_its_backlog_is_dropped_not_lost(
    gworld: GroupWorld, aws: boto3.Session
) -> None:
    w = gworld
    w.groups.events = recording_of(aws, w.clock)
    # Given the only member of a shared group, and a message routed to the group
    channel = w.connect("alice-1")
    w.subscribe("alice-1", channel, "$share/g/orders/#")
    w.publish("orders/a", "m")
    w.route()
    # When the member leaves, the last, so the group is removed with its backlog
    w.unsubscribe("alice-1", channel, "$share/g/orders/#")
    assert w.group("g", "orders/#") is None
    # Then the group's end is recorded
    [ended] = [e for e in events(aws) if e["event"] == "ended"]
    assert (ended["consumer_kind"], ended["reason"]) == ("group", "group_removed")
    [routed] = [e for e in events(aws) if e["event"] == "routed"]
    assert ended["consumer"] == routed["consumer"]
