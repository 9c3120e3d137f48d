"""Ordered drain for push subscriptions over moto: a key's T1 messages wait for its T0 ones.

The push taps are driven by hand (``PushHarness.main_event``), so a test chooses the order in
which the taps of T0 and T1 take their batches; the sealer runs on the harness' clock.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from shoal.aws.dynamo import Dynamo
from shoal.drain import DrainStore, Sealer
from shoal.push.api import UpdateRequest
from shoal.push.gate import PushGate, push_consumer

from tests.integration.test_push_harness import PushHarness

T0, T1 = "shoal-default-0", "shoal-default-1"
GRACE_MS = 5_000
KEY = "k"


class Drain:
    def __init__(self, h: PushHarness) -> None:
        self.store = DrainStore(Dynamo(h.session.client("dynamodb")), h.config.table("inboxes"))
        h.consumer.gate = PushGate(self.store, h.clock, h.config.stream_prefix)
        self.sealer = Sealer(h.streams, self.store, h.store.scan, h.clock, grace_ms=GRACE_MS)


@pytest.fixture
def harness(aws: boto3.Session, monkeypatch: pytest.MonkeyPatch) -> Iterator[PushHarness]:
    yield PushHarness(aws, monkeypatch)


def tap(h: PushHarness, stream: str) -> list[dict[str, Any]]:
    """The tap of ``stream`` takes every record of its shard; the records given back."""
    failures: list[dict[str, Any]] = h.consumer.handle(h.main_event(stream), 60_000)[
        "batchItemFailures"
    ]
    return failures


def switch(h: PushHarness) -> None:
    h.topics.add_storage_topic("default", 1)
    h.topics.switch_produce("default")
    h.clock.advance(2)  # past the publishers' topic cache


def seal(h: PushHarness, drain: Drain) -> None:
    h.clock.advance(GRACE_MS / 1000 + 1)
    assert drain.sealer.run() == 1


def posted(h: PushHarness) -> list[str]:
    return [message_id for _, message_id in h.endpoint.delivered()]


def switched(h: PushHarness) -> tuple[Drain, list[str]]:
    """A push subscription, m0-m2 of one key in T0, a switch, m3-m5 of that key in T1."""
    drain = Drain(h)
    h.subscribe()
    ids = [h.publish(KEY, n) for n in range(3)]
    switch(h)
    ids += [h.publish(KEY, n) for n in range(3, 6)]
    return drain, ids


def test_t1_is_held_until_the_tap_passed_t0s_seals_then_all_in_publish_order(
    harness: PushHarness,
) -> None:
    # Given T1's tap batch comes before T0's
    drain, ids = switched(harness)
    # Then T1 posts nothing and gives its batch back
    assert tap(harness, T1) != []
    assert posted(harness) == []
    # When T0's tap takes its messages (T0 not sealed yet): they are posted, T1 still waits
    assert tap(harness, T0) == []
    assert posted(harness) == ids[:3]
    assert tap(harness, T1) != []
    assert posted(harness) == ids[:3]
    # When the sealer ran but T0's tap has not taken the seals yet: T1 still waits
    seal(harness, drain)
    assert tap(harness, T1) != []
    assert posted(harness) == ids[:3]
    # When T0's tap takes the seal: T1's messages follow, all in publish order
    assert tap(harness, T0) == []
    assert tap(harness, T1) == []
    assert posted(harness) == ids


def test_a_retried_batch_holding_a_seal_changes_nothing(harness: PushHarness) -> None:
    # Given T0 sealed, its tap passed the seal and T1 delivered
    drain, ids = switched(harness)
    seal(harness, drain)
    assert tap(harness, T0) == []
    assert tap(harness, T1) == []
    sub = harness.admin.subscriptions.load("orders")
    assert sub is not None
    consumer = push_consumer(sub.name, sub.spec.incarnation, sub.generation)
    passed = drain.store.passed(T0, consumer)
    # When Lambda hands both batches again
    assert tap(harness, T0) == []
    assert tap(harness, T1) == []
    # Then nothing is posted twice and the seal marks are the same
    assert posted(harness) == ids
    assert drain.store.passed(T0, consumer) == passed
    assert len(passed) == 1


def test_a_subscription_made_after_the_seal_is_not_held(harness: PushHarness) -> None:
    # Given T0 sealed (its tap never ran) before the subscription was made
    drain = Drain(harness)
    harness.publish(KEY, 0)
    switch(harness)
    seal(harness, drain)
    harness.clock.advance(10)
    harness.subscribe()
    late = harness.publish(KEY, 1)
    # When T1's tap takes its batch
    failures = tap(harness, T1)
    # Then its message is posted at once
    assert failures == []
    assert posted(harness) == [late]


def test_an_unordered_subscription_is_not_held(harness: PushHarness) -> None:
    # Given an unordered subscription and messages on both sides of a switch
    drain = Drain(harness)
    harness.subscribe(ordered=False)
    harness.publish(KEY, 0)
    switch(harness)
    late = harness.publish(KEY, 1)
    # When T1's tap takes its batch first
    failures = tap(harness, T1)
    # Then it is posted at once: the subscription asked for no order
    assert failures == []
    assert posted(harness) == [late]
    assert drain.store.record(T0).sealed is None


# -- a tap of several lanes and the seals --------------------------------------------------


def mapping_of(h: PushHarness, stream: str) -> dict[str, Any]:
    kinesis = h.session.client("kinesis")
    arn = kinesis.describe_stream_summary(StreamName=stream)["StreamDescriptionSummary"][
        "StreamARN"
    ]
    (mapping,) = h.session.client("lambda").list_event_source_mappings(
        EventSourceArn=arn, FunctionName=h.config.functions["push"]
    )["EventSourceMappings"]
    return dict(mapping)


def lanes_of(h: PushHarness, stream: str) -> tuple[int, int]:
    """(the tap mapping's ParallelizationFactor, the tap item's lanes)."""
    item = h.admin.subscriptions.tap(stream)
    assert item is not None
    return int(mapping_of(h, stream)["ParallelizationFactor"]), item.lanes


def refit_crashes(monkeypatch: pytest.MonkeyPatch) -> None:
    """SwitchProduce's refit of the taps left behind fails (as a crash right after the switch)."""

    def crash(*_args: Any) -> None:
        raise RuntimeError("crashed before the refit")

    monkeypatch.setattr("shoal.push.admin.TapHooks.produce_switched", crash)


def passed(h: PushHarness, drain: Drain, stream: str = T0) -> frozenset[str]:
    sub = h.admin.subscriptions.load("orders")
    assert sub is not None
    return drain.store.passed(stream, push_consumer(sub.name, sub.spec.incarnation, 0))


def lane(event: dict[str, Any], *partition_keys: str) -> dict[str, Any]:
    """The part of a shard's event that the lane of these partition keys takes."""
    return {
        "Records": [r for r in event["Records"] if r["kinesis"]["partitionKey"] in partition_keys]
    }


def seal_sequence(event: dict[str, Any]) -> str:
    (record,) = lane(event, "seal")["Records"]
    return str(record["kinesis"]["sequenceNumber"])


def test_switch_produce_drains_the_storage_topic_left_behind_with_one_lane(
    harness: PushHarness,
) -> None:
    # Given a push subscription of parallelism 4 and a second storage topic
    harness.subscribe(parallelism=4)
    harness.topics.add_storage_topic("default", 1)
    assert lanes_of(harness, T0) == (4, 4)
    # When produce switches to T1
    harness.topics.switch_produce("default")
    # Then T0's tap runs one lane, T1's keeps four
    assert lanes_of(harness, T0) == (1, 1)
    assert lanes_of(harness, T1) == (4, 4)
    # And a PATCH keeps T0's tap at one lane while it changes T1's
    harness.admin.update("orders", UpdateRequest(parallelism=6))
    assert lanes_of(harness, T0) == (1, 1)
    assert lanes_of(harness, T1) == (6, 6)


def test_a_patch_after_a_crash_between_the_switch_and_the_refit_repairs_the_lanes(
    harness: PushHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a switch whose refit of T0's tap crashed: the switch stands, the tap runs 4 lanes
    harness.subscribe(parallelism=4)
    harness.topics.add_storage_topic("default", 1)
    refit_crashes(monkeypatch)
    assert harness.topics.switch_produce("default").produce_pointer == 1
    assert lanes_of(harness, T0) == (4, 4)
    # When the subscription is PATCHed (same parallelism)
    harness.admin.update("orders", UpdateRequest(parallelism=4))
    # Then T0's tap runs one lane, T1's still four
    assert lanes_of(harness, T0) == (1, 1)
    assert lanes_of(harness, T1) == (4, 4)


def test_a_tap_of_several_lanes_gives_the_seal_back_and_takes_the_records_before_it(
    harness: PushHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given T0 holds a message of "a" and one of "b", then its seal, and its tap runs 4 lanes
    drain = Drain(harness)
    harness.subscribe(parallelism=4)
    ids = [harness.publish("a", 0), harness.publish("b", 1)]
    refit_crashes(monkeypatch)
    switch(harness)
    seal(harness, drain)
    event = harness.main_event(T0)
    # When the tap takes the whole shard
    failures = harness.consumer.handle(event, 60_000)["batchItemFailures"]
    # Then the messages before the seal are posted, the seal is not passed, and the batch is
    # given back from the seal
    assert posted(harness) == ids
    assert passed(harness, drain) == frozenset()
    assert failures == [{"itemIdentifier": seal_sequence(event)}]


def test_a_seal_taken_by_one_lane_waits_for_the_others_then_t1_follows_in_key_order(
    harness: PushHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given m0 of "a" in T0, a switch whose refit crashed (T0's tap runs 4 lanes), m1 of "a"
    # in T1, and T0 sealed
    drain = Drain(harness)
    harness.subscribe(parallelism=4)
    ids = [harness.publish("a", 0)]
    refit_crashes(monkeypatch)
    switch(harness)
    ids.append(harness.publish("a", 1))
    seal(harness, drain)
    event = harness.main_event(T0)
    # When the seal's lane runs before the lane of "a"
    failures = harness.consumer.handle(lane(event, "seal"), 60_000)["batchItemFailures"]
    # Then the seal is given back, not passed, and T1 stays held (m1 would overtake m0)
    assert failures == [{"itemIdentifier": seal_sequence(event)}]
    assert passed(harness, drain) == frozenset()
    assert tap(harness, T1) != []
    assert posted(harness) == []
    # When the lane of "a" runs: m0 is posted, T1 still waits for the seal
    assert harness.consumer.handle(lane(event, "a"), 60_000) == {"batchItemFailures": []}
    assert tap(harness, T1) != []
    assert posted(harness) == ids[:1]
    # When a PATCH refits T0's tap to one lane and the retried shard comes from its checkpoint
    harness.admin.update("orders", UpdateRequest(parallelism=4))
    assert lanes_of(harness, T0) == (1, 1)
    assert tap(harness, T0) == []
    # Then the seal is passed and T1 follows: every message once, in key order
    assert len(passed(harness, drain)) == 1
    assert tap(harness, T1) == []
    assert posted(harness) == ids


def test_under_the_mapping_emulator_a_refitted_tap_posts_every_key_in_order(
    harness: PushHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given 4 lanes, two messages of each of 8 keys in T0, a switch whose refit crashed, one
    # more message of each key in T1, and T0 sealed
    drain = Drain(harness)
    harness.subscribe(parallelism=4)
    keys = list("abcdefgh")
    ids = {key: [harness.publish(key, n) for n in range(2)] for key in keys}
    refit_crashes(monkeypatch)
    switch(harness)
    for key in keys:
        ids[key].append(harness.publish(key, 2))
    seal(harness, drain)
    # When the mappings run while T0's tap still runs 4 lanes
    harness.drain_for(30)
    # Then T0's messages are posted, the seal is not passed, and T1 is held
    assert sorted(posted(harness)) == sorted(i for key in keys for i in ids[key][:2])
    assert passed(harness, drain) == frozenset()
    # When a PATCH refits T0's tap and the mappings run on
    harness.admin.update("orders", UpdateRequest(parallelism=4))
    harness.drain()
    # Then every message is posted once, each key in publish order
    assert len(posted(harness)) == len(set(posted(harness))) == 3 * len(keys)
    by_key = {key: [i for k, i in harness.endpoint.delivered() if k == key] for key in keys}
    assert by_key == ids
