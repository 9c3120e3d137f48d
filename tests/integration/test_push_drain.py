"""Ordered drain for push subscriptions over moto: a key's T1 messages wait for its T0 ones.

The push taps are driven by hand (``PushHarness.main_event``), so a test chooses the order in
which the taps of T0 and T1 take their batches; the sealer runs on the harness' clock.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from shoal.composite import scan_topics
from shoal.delivery import Dynamo
from shoal.drain import DrainStore, PushGate, Sealer, push_consumer

from tests.integration.test_push_harness import PushHarness

T0, T1 = "shoal-default-0", "shoal-default-1"
GRACE_MS = 5_000
KEY = "k"


class Drain:
    def __init__(self, h: PushHarness) -> None:
        self.store = DrainStore(Dynamo(h.session.client("dynamodb")), h.config.table("inboxes"))
        h.consumer.gate = PushGate(self.store, h.clock, h.config.stream_prefix)
        self.sealer = Sealer(h.streams, self.store, scan_topics, h.clock, grace_ms=GRACE_MS)


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
