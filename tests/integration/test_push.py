"""Push subscriptions over moto: admin, MQ/RQ/DLQ routing, redrive, seek, retries, races."""

from __future__ import annotations

import random
import threading
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import boto3
import pytest
from shoal.core.errors import (
    InvalidEndpoint,
    InvalidRedrive,
    InvalidSeek,
    ServerBusy,
    SubscriptionExists,
    SubscriptionNotFound,
)
from shoal.push.api import RedriveRequest, SeekRequest, UpdateRequest
from shoal.push.endpoint import DeliveryRequest, DeliveryResult
from shoal.push.queues import Queues

from tests.integration.test_push_harness import PushHarness
from tests.unit.test_push_support import OK, Switch

FAST = {"max_attempts": 4, "initial_backoff_s": 1, "max_backoff_s": 2}


@pytest.fixture
def harness(aws: boto3.Session, monkeypatch: pytest.MonkeyPatch) -> Iterator[PushHarness]:
    yield PushHarness(aws, monkeypatch)


def order_by_key(deliveries: list[tuple[str, str]]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = defaultdict(list)
    for key, message_id in deliveries:
        out[key].append(message_id)
    return dict(out)


def publish_round_robin(h: PushHarness, keys: list[str], per_key: int) -> dict[str, list[str]]:
    ids: dict[str, list[str]] = defaultdict(list)
    for n in range(per_key):
        for key in keys:
            ids[key].append(h.publish(key, n))
    return dict(ids)


def redrive(h: PushHarness, **selector: Any) -> dict[str, Any]:
    return h.admin.redrive("orders", RedriveRequest(**selector))


# -- admin ----------------------------------------------------------------------------------


def test_create_makes_queues_and_mappings(harness: PushHarness, aws: boto3.Session) -> None:
    # When a subscription is created
    doc = harness.subscribe(parallelism=3)
    # Then its RQ and DLQ streams exist, the RQ has a mapping with that parallelism, and the
    # topic's storage stream has the push tap
    kinesis, awslambda = aws.client("kinesis"), aws.client("lambda")
    rq = doc["retry_queue"]["storage_topics"][0]["stream"]
    dlq = doc["dead_letter_queue"]["storage_topics"][0]["stream"]
    streams = set(kinesis.list_streams()["StreamNames"])
    assert {rq, dlq} <= streams
    push = harness.config.functions["push"]
    by_stream = {
        m["EventSourceArn"].rsplit("/", 1)[1]: m
        for m in awslambda.list_event_source_mappings(FunctionName=push)["EventSourceMappings"]
    }
    assert by_stream[rq]["ParallelizationFactor"] == 3
    assert "shoal-default-0" in by_stream
    assert doc["state"] == "active" and doc["topic"] == "default"


def test_create_twice_is_a_conflict(harness: PushHarness) -> None:
    harness.subscribe()
    with pytest.raises(SubscriptionExists):
        harness.subscribe()


def test_a_bad_endpoint_changes_nothing(harness: PushHarness, aws: boto3.Session) -> None:
    before = set(aws.client("kinesis").list_streams()["StreamNames"])
    with pytest.raises(InvalidEndpoint):
        harness.subscribe(endpoint="http://example.com/")
    assert set(aws.client("kinesis").list_streams()["StreamNames"]) == before
    with pytest.raises(SubscriptionNotFound):
        harness.admin.describe("orders")


def test_delete_removes_queues_mappings_and_group_states(
    harness: PushHarness, aws: boto3.Session
) -> None:
    # Given a subscription with a blocked key
    doc = harness.subscribe(retry={"max_attempts": 1})
    harness.endpoint.respond = Switch("k")
    harness.publish("k", 1)
    harness.drain()
    assert harness.admin.describe("orders")["blocked_keys"] == ["k"]
    # When it is deleted
    harness.admin.delete("orders")
    # Then its streams, mappings and key states are gone, and so is the tap (no members)
    streams = set(aws.client("kinesis").list_streams()["StreamNames"])
    assert doc["retry_queue"]["storage_topics"][0]["stream"] not in streams
    push = harness.config.functions["push"]
    mappings = aws.client("lambda").list_event_source_mappings(FunctionName=push)
    assert mappings["EventSourceMappings"] == []
    assert list(harness.admin.key_states.blocked("orders")) == []
    with pytest.raises(SubscriptionNotFound):
        harness.admin.describe("orders")


def test_parallelism_changes_the_retry_queue_mapping(
    harness: PushHarness, aws: boto3.Session
) -> None:
    doc = harness.subscribe()
    assert harness.admin.update("orders", UpdateRequest(parallelism=5))["parallelism"] == 5
    rq = doc["retry_queue"]["storage_topics"][0]["stream"]
    arn = aws.client("kinesis").describe_stream_summary(StreamName=rq)["StreamDescriptionSummary"][
        "StreamARN"
    ]
    mapping = aws.client("lambda").list_event_source_mappings(EventSourceArn=arn)
    assert mapping["EventSourceMappings"][0]["ParallelizationFactor"] == 5


def tap_mapping(h: PushHarness, aws: boto3.Session, stream: str = "shoal-default-0") -> Any:
    arn = aws.client("kinesis").describe_stream_summary(StreamName=stream)[
        "StreamDescriptionSummary"
    ]["StreamARN"]
    (mapping,) = aws.client("lambda").list_event_source_mappings(
        EventSourceArn=arn, FunctionName=h.config.functions["push"]
    )["EventSourceMappings"]
    return mapping


def test_the_tap_runs_as_many_lanes_as_its_most_parallel_member(
    harness: PushHarness, aws: boto3.Session
) -> None:
    # Given two subscriptions of one stream, parallelism 3 and 1
    harness.subscribe(parallelism=3)
    harness.subscribe(name="audit", parallelism=1)
    # Then the tap's mapping runs 3 lanes per shard, and the tap says so
    assert tap_mapping(harness, aws)["ParallelizationFactor"] == 3
    assert getattr(harness.admin.subscriptions.tap("shoal-default-0"), "lanes", None) == 3
    # When the first drops to 1 / Then so does the tap
    harness.admin.update("orders", UpdateRequest(parallelism=1))
    assert tap_mapping(harness, aws)["ParallelizationFactor"] == 1
    assert getattr(harness.admin.subscriptions.tap("shoal-default-0"), "lanes", None) == 1
    # When the other rises to 6 / Then the tap follows it
    harness.admin.update("audit", UpdateRequest(parallelism=6))
    assert tap_mapping(harness, aws)["ParallelizationFactor"] == 6


def test_a_lane_running_ahead_never_makes_another_lane_skip_its_records(
    harness: PushHarness,
) -> None:
    # Given a tap of two lanes and keys "a" and "b" published interleaved
    harness.subscribe(parallelism=2)
    ids = publish_round_robin(harness, ["a", "b"], 3)
    event = harness.main_event()
    lane: dict[str, dict[str, Any]] = {
        key: {"Records": [r for r in event["Records"] if r["kinesis"]["partitionKey"] == key]}
        for key in ("a", "b")
    }
    # When the lane of "b" (whose records come later in the shard) finishes first
    assert harness.consumer.handle(lane["b"], 60_000) == {"batchItemFailures": []}
    assert harness.consumer.handle(lane["a"], 60_000) == {"batchItemFailures": []}
    # Then "a" was delivered too, each key in order
    assert order_by_key(harness.endpoint.first_deliveries()) == ids
    # And the shard cursor stayed; a replay of the whole shard delivers nothing twice
    sub = harness.admin.subscriptions.load("orders")
    assert sub is not None and dict(sub.cursors["shoal-default-0"].shards) == {}
    harness.consumer.handle(event, 60_000)
    assert len(harness.endpoint.calls) == 6


class CrashOnce:
    """Stands in for a method: the first call raises (a crash before the step), later ones run
    the real method."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == 1:
            raise ServerBusy("crash")
        return self.real(*args, **kwargs)


def push_mappings(h: PushHarness, aws: boto3.Session) -> list[str]:
    """The streams the push function's mappings read, one entry per mapping."""
    found = aws.client("lambda").list_event_source_mappings(
        FunctionName=h.config.functions["push"]
    )["EventSourceMappings"]
    return sorted(m["EventSourceArn"].rsplit("/", 1)[1] for m in found)


DELETE_STEPS = [
    ("subscriptions", "set_state"),
    ("subscriptions", "leave_tap"),
    ("admin", "_settle_tap"),
    ("queues", "delete_mapping"),
    ("queues", "delete_stream"),
    ("key_states", "delete_all"),
    ("subscriptions", "delete"),
]


@pytest.mark.parametrize(("owner", "step"), DELETE_STEPS)
def test_a_delete_that_crashed_at_any_step_is_finished_by_repeating_it(
    harness: PushHarness, aws: boto3.Session, monkeypatch: pytest.MonkeyPatch, owner: str, step: str
) -> None:
    # Given a subscription with a blocked key, and a delete that crashes before `step`
    doc = harness.subscribe(retry={"max_attempts": 1})
    harness.endpoint.respond = Switch("k")
    harness.publish("k", 1)
    harness.drain()
    target = harness.admin if owner == "admin" else getattr(harness.admin, owner)
    monkeypatch.setattr(target, step, CrashOnce(getattr(target, step)))
    with pytest.raises(ServerBusy):
        harness.admin.delete("orders")
    # When the delete is repeated
    harness.admin.delete("orders")
    # Then nothing of the subscription is left: item, tap membership, mappings, queues, keys
    with pytest.raises(SubscriptionNotFound):
        harness.admin.describe("orders")
    tap = harness.admin.subscriptions.tap("shoal-default-0")
    assert tap is not None and tap.members == frozenset()
    assert push_mappings(harness, aws) == []
    streams = set(aws.client("kinesis").list_streams()["StreamNames"])
    for queue in ("retry_queue", "dead_letter_queue"):
        assert doc[queue]["storage_topics"][0]["stream"] not in streams
    assert list(harness.admin.key_states.blocked("orders")) == []
    assert harness.admin.key_states.get("orders", "k").version == 0


def test_a_subscription_being_deleted_gets_nothing_and_takes_no_change(
    harness: PushHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a delete that crashed right after marking the subscription deleting
    harness.subscribe()
    crash = CrashOnce(harness.admin.subscriptions.leave_tap)
    monkeypatch.setattr(harness.admin.subscriptions, "leave_tap", crash)
    with pytest.raises(ServerBusy):
        harness.admin.delete("orders")
    assert harness.admin.describe("orders")["state"] == "deleting"
    # When a message is published and the tap's batch reaches the push function
    harness.publish("k", 1)
    assert harness.consumer.handle(harness.main_event(), 60_000) == {"batchItemFailures": []}
    # Then it is not delivered, and a change or a repeated create is refused
    assert harness.endpoint.calls == []
    with pytest.raises(SubscriptionNotFound):
        harness.admin.update("orders", UpdateRequest(parallelism=2))
    with pytest.raises(SubscriptionExists):
        harness.subscribe()


# -- a storage topic added later ------------------------------------------------------------


def test_a_new_storage_topic_reaches_push_subscriptions_without_a_patch(
    harness: PushHarness, aws: boto3.Session
) -> None:
    # Given a push subscription of `default`
    harness.subscribe(parallelism=2)
    before = harness.publish("k", 1)
    # When a storage topic is added, produce switches to it, and more is published
    harness.topics.add_storage_topic("default", 2)
    harness.topics.switch_produce("default")
    after = [harness.publish("k", 2), harness.publish("j", 3)]
    harness.drain()
    # Then everything is delivered (no PATCH), the new stream has its one tap mapping
    delivered = {i for _, i in harness.endpoint.first_deliveries()}
    assert delivered == {before, *after}
    assert push_mappings(harness, aws).count("shoal-default-1") == 1
    assert tap_mapping(harness, aws, "shoal-default-1")["ParallelizationFactor"] == 2


@pytest.mark.parametrize(
    ("owner", "step"), [("subscriptions", "join_tap"), ("admin", "_settle_tap")]
)
def test_a_storage_topic_completion_that_crashed_leaves_one_tap_mapping(
    harness: PushHarness, aws: boto3.Session, monkeypatch: pytest.MonkeyPatch, owner: str, step: str
) -> None:
    # Given a push subscription, and a topic completion that crashes before `step`
    harness.subscribe()
    real = getattr(harness.admin if owner == "admin" else harness.admin.subscriptions, step)
    crash = CrashOnce(real)
    cls = "admin.PushAdmin" if owner == "admin" else "store.PushSubscriptionStore"
    monkeypatch.setattr(f"shoal.push.{cls}.{step}", lambda _self, *a, **k: crash(*a, **k))
    with pytest.raises(ServerBusy):
        harness.topics.add_storage_topic("default", 1)
    assert harness.topics.get("default").pending is not None
    # When the request is repeated
    harness.topics.add_storage_topic("default", 1)
    # Then the new stream has exactly one tap mapping and the subscription reads it
    assert push_mappings(harness, aws).count("shoal-default-1") == 1
    sub = harness.admin.subscriptions.load("orders")
    assert sub is not None and "shoal-default-1" in sub.cursors
    harness.topics.switch_produce("default")
    message = harness.publish("k", 1)
    harness.drain()
    assert [i for _, i in harness.endpoint.first_deliveries()] == [message]


# -- delivery and retry routing -------------------------------------------------------------


def test_matching_messages_are_delivered_in_order_and_others_skipped(
    harness: PushHarness,
) -> None:
    harness.subscribe(filter="orders/eu/#")
    wanted = [harness.publish("k", n, topic="orders/eu/1") for n in range(3)]
    harness.publish("k", 9, topic="orders/us/1")
    harness.drain()
    assert harness.endpoint.first_deliveries() == [("k", i) for i in wanted]
    assert {c.headers["Shoal-Attempt"] for c in harness.endpoint.calls} == {"1"}


def test_a_failing_key_waits_in_rq_while_other_keys_flow(harness: PushHarness) -> None:
    # Given key "bad" failing with 503
    harness.subscribe(retry={**FAST, "max_attempts": 50})
    switch = Switch("bad")
    harness.endpoint.respond = switch
    ids = publish_round_robin(harness, ["good", "bad", "other"], 4)
    # When the pipeline runs
    harness.drain_for(seconds=10)
    # Then the other keys were delivered completely, in order, and "bad" not at all yet
    delivered = order_by_key(harness.endpoint.first_deliveries())
    assert delivered == {"good": ids["good"], "other": ids["other"]}
    described = harness.admin.describe("orders")
    assert described["blocked_keys"] == ["bad"] and described["retry_depth"] == 4
    # When "bad" recovers / Then its messages arrive in order, after more attempts
    switch.failing.clear()
    harness.drain()
    delivered = order_by_key(harness.endpoint.first_deliveries())
    assert delivered["bad"] == ids["bad"]
    assert max(harness.endpoint.attempts(ids["bad"][0])) > 2
    assert harness.admin.describe("orders")["blocked_keys"] == []


def test_exhausted_retries_land_in_dlq_with_reason_and_attempts(harness: PushHarness) -> None:
    harness.subscribe(retry=FAST)
    harness.endpoint.respond = Switch("bad")
    bad = [harness.publish("bad", n) for n in range(3)]
    harness.drain()
    page = harness.admin.dead_letters("orders", None, None)
    assert [m["id"] for m in page["messages"]] == bad
    first, follower = page["messages"][0], page["messages"][1]
    assert (first["reason"], first["attempts"], first["status"]) == ("http_503", 4, 503)
    assert (follower["reason"], follower["attempts"]) == ("ordering_key_blocked", 0)
    assert harness.endpoint.attempts(bad[0]) == [1, 2, 3, 4]
    assert harness.endpoint.attempts(bad[1]) == []
    described = harness.admin.describe("orders")
    assert (described["dlq_depth"], described["retry_depth"]) == (3, 0)


def test_a_non_retryable_answer_dead_letters_at_once(harness: PushHarness) -> None:
    harness.subscribe(retry=FAST)
    harness.endpoint.respond = Switch("bad", status=400)
    bad = harness.publish("bad", 1)
    harness.drain()
    (dead,) = harness.admin.dead_letters("orders", None, None)["messages"]
    assert (dead["id"], dead["reason"], dead["attempts"]) == (bad, "http_400", 1)


def test_messages_of_a_dead_lettered_key_queue_behind_it(harness: PushHarness) -> None:
    harness.subscribe(retry={**FAST, "max_attempts": 1})
    switch = Switch("bad")
    harness.endpoint.respond = switch
    first = harness.publish("bad", 1)
    harness.drain()
    # When the endpoint recovers but nobody redrives / Then later messages still wait
    switch.failing.clear()
    later = harness.publish("bad", 2)
    harness.drain()
    assert harness.endpoint.first_deliveries() == []
    ids = [m["id"] for m in harness.admin.dead_letters("orders", None, None)["messages"]]
    assert ids == [first, later]


def test_dlq_pages_with_a_cursor(harness: PushHarness) -> None:
    harness.subscribe(retry={**FAST, "max_attempts": 1})
    harness.endpoint.respond = Switch("bad")
    bad = [harness.publish("bad", n) for n in range(5)]
    harness.drain()
    first = harness.admin.dead_letters("orders", 2, None)
    second = harness.admin.dead_letters("orders", 2, first["next"])
    third = harness.admin.dead_letters("orders", 2, second["next"])
    listed = [m["id"] for page in (first, second, third) for m in page["messages"]]
    assert listed == bad
    assert third["next"] is None or harness.admin.dead_letters("orders", 2, third["next"]) == {
        "messages": [],
        "next": None,
    }


# -- redrive --------------------------------------------------------------------------------


def dead_key(harness: PushHarness, count: int = 3) -> tuple[Switch, list[str]]:
    harness.subscribe(retry={**FAST, "max_attempts": 2})
    switch = Switch("bad")
    harness.endpoint.respond = switch
    bad = [harness.publish("bad", n) for n in range(count)]
    harness.drain()
    return switch, bad


def test_redrive_by_key_delivers_in_order_and_unblocks(harness: PushHarness) -> None:
    switch, bad = dead_key(harness)
    switch.failing.clear()
    report = redrive(harness, ordering_keys=["bad"])
    assert (report["redriven"], report["ordering_keys"]) == (3, ["bad"])
    harness.drain()
    assert harness.endpoint.first_deliveries() == [("bad", i) for i in bad]
    # Then the key flows again: a new message goes straight out
    later = harness.publish("bad", 9)
    harness.drain()
    assert harness.endpoint.first_deliveries()[-1] == ("bad", later)
    assert harness.admin.describe("orders")["dlq_depth"] == 0


def test_redriven_messages_go_ahead_of_newer_ones(harness: PushHarness) -> None:
    switch, bad = dead_key(harness, 2)
    switch.failing.clear()
    redrive(harness, ordering_keys=["bad"])
    # Given a newer message published before the redriven ones went out
    newer = harness.publish("bad", 5)
    harness.drain()
    assert [i for _, i in harness.endpoint.first_deliveries()] == [*bad, newer]


def test_redrive_by_message_id_takes_only_a_prefix_of_the_key(harness: PushHarness) -> None:
    switch, bad = dead_key(harness)
    switch.failing.clear()
    # When only the second message is named / Then nothing moves: the first is older
    report = redrive(harness, message_ids=[bad[1]])
    assert report["redriven"] == 0
    assert report["skipped"] == [{"ordering_key": "bad", "reason": "older_dead_letter_pending"}]
    # When the first is named / Then it alone is redriven; the key stays blocked
    assert redrive(harness, message_ids=[bad[0]])["redriven"] == 1
    harness.drain()
    assert harness.endpoint.first_deliveries() == [("bad", bad[0])]
    remaining = [m["id"] for m in harness.admin.dead_letters("orders", None, None)["messages"]]
    assert remaining == bad[1:]


def test_redrive_by_failure_time(harness: PushHarness) -> None:
    switch, bad = dead_key(harness)
    switch.failing.clear()
    assert redrive(harness, failed_after=0)["redriven"] == 3
    harness.drain()
    assert [i for _, i in harness.endpoint.first_deliveries()] == bad


def test_redrive_skips_a_key_still_retrying(harness: PushHarness) -> None:
    harness.subscribe(retry={**FAST, "max_attempts": 1})
    switch = Switch("bad")
    harness.endpoint.respond = switch
    harness.publish("bad", 1)
    harness.drain()
    # Given a DLQ entry, and an entry of the key in RQ that the RQ consumer has not reached
    # (reserved by hand: a follower on its way)
    state = harness.admin.key_states.get("orders", "bad")
    assert state.dlq.depth == 1
    follower = replace(state.reserved("mq")[-1], queue="rq", n=1)
    assert (
        harness.admin.key_states.save("orders", "bad", state.reserve("mq", [follower])) is not None
    )
    report = redrive(harness, ordering_keys=["bad"])
    assert report["skipped"] == [{"ordering_key": "bad", "reason": "retry_pending"}]


def test_a_redrive_names_exactly_one_selector(harness: PushHarness) -> None:
    harness.subscribe()
    selectors: list[dict[str, Any]] = [
        {},
        {"ordering_keys": ["a"], "failed_after": 0},
        {"message_ids": []},
    ]
    for selector in selectors:
        with pytest.raises(InvalidRedrive):
            redrive(harness, **selector)
    with pytest.raises(InvalidRedrive):
        redrive(harness, ordering_keys=[f"k{i}" for i in range(101)])


# -- seek -----------------------------------------------------------------------------------


def test_seek_to_earliest_redelivers_history(harness: PushHarness) -> None:
    harness.subscribe()
    ids = [harness.publish("k", n) for n in range(3)]
    harness.drain()
    harness.admin.seek("orders", SeekRequest(to="earliest"))
    harness.drain()
    assert [i for _, i in harness.endpoint.delivered()] == [*ids, *ids]


def test_seek_of_one_subscription_leaves_another_alone(harness: PushHarness) -> None:
    harness.subscribe()
    harness.subscribe("audit")
    ids = [harness.publish("k", n) for n in range(2)]
    harness.drain()
    harness.admin.seek("orders", SeekRequest(to="earliest"))
    harness.drain()
    subs = defaultdict(list)
    for call in harness.endpoint.calls:
        subs[call.headers["Shoal-Subscription"]].append(call.message_id)
    assert subs["orders"] == [*ids, *ids]
    assert subs["audit"] == ids


def test_seek_to_latest_skips_the_backlog_and_pending_retries(harness: PushHarness) -> None:
    harness.subscribe(retry={**FAST, "max_attempts": 1})
    switch = Switch("bad")
    harness.endpoint.respond = switch
    harness.publish("bad", 1)
    harness.drain()
    assert harness.admin.describe("orders")["dlq_depth"] == 1
    harness.clock.advance(1)
    harness.admin.seek("orders", SeekRequest(to="latest"))
    # Then the dead-lettered message no longer holds the key
    switch.failing.clear()
    harness.clock.advance(1)
    later = harness.publish("bad", 2)
    harness.drain()
    assert harness.endpoint.first_deliveries() == [("bad", later)]
    assert harness.admin.describe("orders")["dlq_depth"] == 0


def test_seek_to_a_time_rewinds_to_it(harness: PushHarness) -> None:
    harness.subscribe()
    harness.publish("k", 1)
    harness.clock.advance(10)
    middle = harness.clock.now_ms()
    harness.clock.advance(10)
    later = harness.publish("k", 2)
    harness.drain()
    harness.admin.seek("orders", SeekRequest(to_time=middle))
    harness.drain()
    assert [i for _, i in harness.endpoint.delivered()][-1:] == [later]
    assert len(harness.endpoint.delivered()) == 3


def test_a_seek_names_exactly_one_target(harness: PushHarness) -> None:
    harness.subscribe()
    for request in (SeekRequest(), SeekRequest(to="soon"), SeekRequest(to_time="yesterday")):
        with pytest.raises(InvalidSeek):
            harness.admin.seek("orders", request)


# -- retries of batches, races, crashes -----------------------------------------------------


def test_a_retried_mq_batch_routes_nothing_twice(harness: PushHarness) -> None:
    harness.subscribe(retry={**FAST, "max_attempts": 50})
    harness.endpoint.respond = Switch("bad")
    for n in range(3):
        harness.publish("bad", n)
    event = harness.main_event()
    assert harness.consumer.handle(event, 60_000) == {"batchItemFailures": []}
    first = harness.admin.key_states.get("orders", "bad")
    # When the same batch is handed over again (Lambda retried it)
    assert harness.consumer.handle(event, 60_000) == {"batchItemFailures": []}
    # Then the key state did not move: every message was recognized as routed
    assert harness.admin.key_states.get("orders", "bad") == first
    assert first.rq.p.n == 3


def test_concurrent_invocations_of_one_batch_keep_the_state_whole(harness: PushHarness) -> None:
    harness.subscribe(retry={**FAST, "max_attempts": 50})
    harness.endpoint.respond = Switch(*[f"k{i}" for i in range(8)])
    for n in range(3):
        for i in range(8):
            harness.publish(f"k{i}", n)
    event = harness.main_event()
    results: list[Any] = []
    threads = [
        threading.Thread(target=lambda: results.append(harness.consumer.handle(event, 60_000)))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Then each key's three messages are reserved once each, whatever the interleaving
    for i in range(8):
        state = harness.admin.key_states.get("orders", f"k{i}")
        assert state.rq.p.n == 3, state
    entries = harness.rq_entries()
    assert len({(e.ordering_key, e.n) for e in entries}) == 24


def test_a_put_lost_after_its_reservation_is_repaired(
    harness: PushHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given key "bad" failing, and the RQ put of its second message lost (the invocation died
    # between the reservation and the put, and a seek replaced the tap before its batch came
    # again)
    harness.subscribe(retry={**FAST, "max_attempts": 50})
    switch = Switch("bad")
    harness.endpoint.respond = switch
    ids = [harness.publish("bad", n) for n in range(2)]
    real_put = Queues.put
    calls = {"n": 0}

    def lossy(self: Queues, storage: Any, entry: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            return  # the record never reaches the stream
        real_put(self, storage, entry)

    monkeypatch.setattr(Queues, "put", lossy)
    harness.drain_for(seconds=5)
    monkeypatch.setattr(Queues, "put", real_put)
    # When the key recovers and a third message follows into RQ
    switch.failing.clear()
    third = harness.publish("bad", 2)
    harness.drain()
    # Then the missing entry was taken from where its message is, in order
    assert [i for _, i in harness.endpoint.first_deliveries()] == [*ids, third]


def test_a_redrive_that_died_mid_way_is_completed_by_the_consumer(
    harness: PushHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given three dead letters of "bad", and a redrive whose second put fails
    switch, bad = dead_key(harness)
    switch.failing.clear()
    real_put = Queues.put
    calls = {"n": 0}

    def dying(self: Queues, storage: Any, entry: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise ServerBusy("the redrive's invocation died here")
        real_put(self, storage, entry)

    monkeypatch.setattr(Queues, "put", dying)
    with pytest.raises(ServerBusy):
        redrive(harness, ordering_keys=["bad"])
    monkeypatch.setattr(Queues, "put", real_put)
    # When a newer message of the key follows into RQ
    newer = harness.publish("bad", 7)
    harness.drain()
    # Then the redriven entries the stream lacks were read from the DLQ, all in order
    assert [i for _, i in harness.endpoint.first_deliveries()] == [*bad, newer]
    assert harness.admin.describe("orders")["blocked_keys"] == []


def test_a_failed_put_fails_the_record_and_the_retry_puts_it(
    harness: PushHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    harness.subscribe(retry={**FAST, "max_attempts": 50})
    switch = Switch("bad")
    harness.endpoint.respond = switch
    bad = harness.publish("bad", 1)
    real_put = Queues.put
    failures = {"left": 1}

    def flaky(self: Queues, storage: Any, entry: Any) -> None:
        if failures["left"]:
            failures["left"] -= 1
            raise ServerBusy("kinesis said no")
        real_put(self, storage, entry)

    monkeypatch.setattr(Queues, "put", flaky)
    event = harness.main_event()
    response = harness.consumer.handle(event, 60_000)
    assert response["batchItemFailures"] != []
    # When Lambda hands the batch over again / Then the reserved entry is put
    assert harness.consumer.handle(event, 60_000) == {"batchItemFailures": []}
    switch.failing.clear()
    harness.drain()
    assert harness.endpoint.first_deliveries() == [("bad", bad)]


def test_a_key_that_came_due_while_another_was_delivered_is_resumed(
    harness: PushHarness,
) -> None:
    # Given two failing keys whose endpoint calls are slow (each failing call takes 3 s), so
    # that one key's retry is due before the other's delivery returns
    harness.subscribe(parallelism=1, retry={**FAST, "max_attempts": 50})
    calls = {"a": 0, "b": 0}

    def slow_then_fine(request: DeliveryRequest) -> DeliveryResult:
        calls[request.ordering_key] += 1
        if calls[request.ordering_key] <= 3:
            harness.clock.advance(3)
            return DeliveryResult(status=503)
        return OK

    harness.endpoint.respond = slow_then_fine
    ids = {key: harness.publish(key, 1) for key in ("a", "b")}
    # When the pipeline runs / Then no invocation failed, and both arrived
    harness.drain()
    assert sorted(i for _, i in harness.endpoint.first_deliveries()) == sorted(ids.values())


# -- parallelism and the big one ------------------------------------------------------------


def test_unordered_subscription_lets_later_messages_pass(harness: PushHarness) -> None:
    harness.subscribe(ordered=False, retry={**FAST, "max_attempts": 50})
    fail_first = {"left": 1}

    def respond(request: DeliveryRequest) -> DeliveryResult:
        if fail_first["left"]:
            fail_first["left"] -= 1
            return DeliveryResult(status=503)
        return OK

    harness.endpoint.respond = respond
    ids = [harness.publish("k", n) for n in range(3)]
    harness.drain()
    assert [i for _, i in harness.endpoint.first_deliveries()] == [ids[1], ids[2], ids[0]]


@pytest.mark.parametrize("parallelism", [1, 4])
def test_random_failures_lose_nothing_and_keep_per_key_order(
    harness: PushHarness, parallelism: int
) -> None:
    # Given 400 messages over 20 keys and 10% of calls failing at random
    harness.subscribe(parallelism=parallelism, retry={**FAST, "max_attempts": 100})
    rng = random.Random(parallelism)
    lock = threading.Lock()

    def flaky(_request: DeliveryRequest) -> DeliveryResult:
        with lock:
            fail = rng.random() < 0.1
        return DeliveryResult(status=503) if fail else OK

    harness.endpoint.respond = flaky
    keys = [f"key-{i}" for i in range(20)]
    ids = publish_round_robin(harness, keys, 20)
    harness.drain()
    # Then every message was delivered, each key in publish order (no key overtaken)
    assert order_by_key(harness.endpoint.first_deliveries()) == ids
    assert harness.admin.describe("orders")["blocked_keys"] == []
