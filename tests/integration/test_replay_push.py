"""Replay into a push subscription (``pipeline.replay.PushSubscriptionTarget`` over
``shoal.push.replay``) on the emulated account: every replayed message is POSTed once, in
per-key archive order, ahead of the key's newer messages; a replay run again, or run again
after it died half-way, POSTs nothing twice."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from shoal.core.errors import ServerBusy
from shoal.push.api import SeekRequest
from shoal.push.entries import REPLAYED
from shoal.push.queues import Queues
from shoal.push.replay import PushReplay
from shoal.push.store import KeyStore, PushSubscriptionStore

from pipeline.replay import PushSubscriptionTarget, ReplayMessage, archived
from tests.integration.test_push_harness import PushHarness

KEYS = ["a", "b", "c"]
PER_KEY = 4
T_OLD = 1_600_000_000_000


@pytest.fixture
def harness(aws: boto3.Session, monkeypatch: pytest.MonkeyPatch) -> Iterator[PushHarness]:
    h = PushHarness(aws, monkeypatch)
    h.subscribe()
    yield h


def old_message(seq: int, key: str, topic: str = "orders/1") -> ReplayMessage:
    """An archived message at sequence number ``seq``, with the plan's replay position."""
    digits = str(seq)
    return ReplayMessage(
        replay_message_id=f"replayed-{seq}",
        message_id=f"old-{key}-{seq}",
        topic=topic,
        ordering_key=key,
        qos=1,
        published_at=T_OLD + seq,
        payload=f"old {seq}".encode(),
        replay_position=f"0a1b2c3d.0000.4e5f6a7b.{len(digits):03d}{digits}.00000",
        composite_topic="default",
    )


def plan() -> list[ReplayMessage]:
    """PER_KEY messages of each key, interleaved, in replay-position order."""
    return [old_message(10 + n, KEYS[n % 3]) for n in range(PER_KEY * len(KEYS))]


def target(h: PushHarness, replay_id: str = "replay-1") -> PushSubscriptionTarget:
    service = PushReplay(
        h.config,
        PushSubscriptionStore.from_config(h.config, h.clock),
        KeyStore.from_config(h.config),
        h.queues,
        clock=h.clock,
    )
    return PushSubscriptionTarget("orders", replay_id, service=service, clock=h.clock)


def by_key(h: PushHarness) -> dict[str, list[str]]:
    out: dict[str, list[str]] = defaultdict(list)
    for key, message_id in h.endpoint.delivered():
        out[key].append(message_id)
    return dict(out)


def expected() -> dict[str, list[str]]:
    out: dict[str, list[str]] = defaultdict(list)
    for m in plan():
        out[m.ordering_key].append(m.message_id)
    return dict(out)


def test_replayed_messages_are_posted_once_in_order_ahead_of_newer_ones(
    harness: PushHarness,
) -> None:
    h = harness
    # Given 12 archived messages of 3 keys and one the subscription's filter does not match
    messages = [*plan(), old_message(99, "a", topic="billing/1")]
    # When they are replayed, and a newer message of key a is published before any goes out
    t = target(h)
    assert t.inject(messages) == PER_KEY * len(KEYS)
    newer = h.publish("a", 1)
    h.drain()
    # Then each replayed message is POSTed once, per key in archive order, under its original
    # id, as attempt 1; the newer message of a comes after a's replayed ones
    want = expected()
    want["a"].append(newer)
    assert by_key(h) == want
    assert t.unmatched == 1
    replayed = [c for c in h.endpoint.calls if c.message_id.startswith("old-")]
    assert {c.headers["Shoal-Message-Id"] for c in replayed} == {m.message_id for m in plan()}
    assert {c.attempt for c in replayed} == {1}
    assert h.admin.describe("orders")["blocked_keys"] == []


def test_the_same_replay_again_posts_nothing(harness: PushHarness) -> None:
    h = harness
    # Given a replay delivered
    assert target(h).inject(plan()) == PER_KEY * len(KEYS)
    h.drain()
    calls = len(h.endpoint.calls)
    # When it runs again (a new target, as a second job would)
    again = target(h)
    assert again.inject(plan()) == 0
    h.drain()
    # Then nothing more is POSTed, and the run says why
    assert len(h.endpoint.calls) == calls
    assert again.already == PER_KEY * len(KEYS)


def test_another_replay_of_the_same_messages_posts_them_again(harness: PushHarness) -> None:
    h = harness
    # Given a replay delivered / When a replay under another id selects the same messages
    target(h).inject(plan())
    assert target(h, "replay-2").inject(plan()) == PER_KEY * len(KEYS)
    h.drain()
    # Then they go out twice: each replay is a request of its own
    assert by_key(h) == {k: v * 2 for k, v in expected().items()}


def dying_after(monkeypatch: pytest.MonkeyPatch, puts: int) -> Any:
    """Queues.put raising after ``puts`` entries went in: the job died there."""
    real_put = Queues.put
    calls = {"n": 0}

    def dying(self: Queues, storage: Any, entry: Any) -> None:
        calls["n"] += 1
        if calls["n"] > puts:
            raise ServerBusy("the replay job died here")
        real_put(self, storage, entry)

    monkeypatch.setattr(Queues, "put", dying)
    return real_put


@pytest.mark.parametrize("puts", [0, 2, 5])
def test_a_replay_that_died_half_way_then_ran_again_posts_each_once(
    harness: PushHarness, monkeypatch: pytest.MonkeyPatch, puts: int
) -> None:
    h = harness
    # Given a replay that died after `puts` RQ entries went in
    real_put = dying_after(monkeypatch, puts)
    with pytest.raises(ServerBusy):
        target(h).inject(plan())
    monkeypatch.setattr(Queues, "put", real_put)
    # When it runs again, and then everything is delivered
    target(h).inject(plan())
    h.drain()
    # Then each message went out once, per key in archive order
    assert by_key(h) == expected()


def test_a_gap_left_by_a_dead_replay_is_repaired_by_the_consumer(
    harness: PushHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = harness
    # Given a replay that died after reserving key a's entries and putting one of them
    real_put = dying_after(monkeypatch, 1)
    with pytest.raises(ServerBusy):
        target(h).inject(plan())
    monkeypatch.setattr(Queues, "put", real_put)
    # When a newer message of key a follows into RQ, and the replay is never run again
    newer = h.publish("a", 1)
    h.drain()
    # Then the consumer read a's missing entries from where the replay staged them: all of a
    # went out once, in order, then the newer message (b and c were never reserved)
    assert by_key(h) == {"a": [*expected()["a"], newer]}


def test_a_seek_before_the_replay_does_not_skip_it(harness: PushHarness) -> None:
    h = harness
    # Given a subscription sought to the latest position (older messages are skipped)
    h.admin.seek("orders", SeekRequest(to="latest"))
    h.clock.advance(1)
    # When messages published long before are replayed, and a newer one of key a follows
    target(h).inject(plan())
    newer = h.publish("a", 1)
    h.drain()
    # Then they go out, the newer one behind a's: a replayed entry counts as published when it
    # was replayed, so it is neither skipped nor overtaken
    want = expected()
    want["a"].append(newer)
    assert by_key(h) == want
    replayed = [e for e in h.rq_entries() if e.message.message_id.startswith("old-")]
    assert {e.reason for e in replayed} == {REPLAYED}


def test_a_key_with_too_many_pending_replayed_entries_defers_the_rest(
    harness: PushHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = harness
    monkeypatch.setattr("shoal.push.replay.MAX_UNCONSUMED", 2)
    service = PushReplay(
        h.config,
        PushSubscriptionStore.from_config(h.config, h.clock),
        KeyStore.from_config(h.config),
        h.queues,
        clock=h.clock,
    )
    messages = [archived(m) for m in plan()]
    # Given at most 2 replayed entries of a key pending / When the plan is replayed
    first = service.replay("orders", "replay-1", messages)
    # Then each key took 2, the rest came back in order
    assert (first.injected, len(first.deferred)) == (6, 6)
    # When the subscription delivered them and the deferred ones are passed again
    h.drain()
    second = service.replay("orders", "replay-1", first.deferred)
    h.drain()
    # Then everything went out once, per key in order
    assert second.injected == 6
    assert by_key(h) == expected()
