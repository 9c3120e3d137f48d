"""Exactly-once publishing with (publisher_id, publisher_seq), including crashes at every step."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import boto3
import pytest
from shoal.aws.dynamo import Dynamo
from shoal.aws.kinesis import OutRecord, PutOutcome, Streams
from shoal.core.auth import Principal
from shoal.core.errors import PublisherSeqGap, ServerBusy
from shoal.publish.request import PublishRequest
from shoal.publish.sequences import RESERVATION_HOLD_MS, publisher_key
from shoal.publish.service import PublishService

from tests.integration.test_publish_harness import Crash, Harness, admin_call

ALICE = Principal(sub="alice", clients=("alice",), publish=("#",))
BOB = Principal(sub="bob", clients=("bob",), publish=("#",))


@pytest.fixture
def harness(aws: boto3.Session, monkeypatch: pytest.MonkeyPatch) -> Iterator[Harness]:
    h = Harness(aws)
    h.install(monkeypatch)
    h.default(partitions=1)
    admin_call("POST", "/v1/topics", {"name": "orders", "partitions": 4})
    h.catch_up()
    yield h


def request(seq: int, text: str = "m", pid: str = "p", **extra: Any) -> PublishRequest:
    return PublishRequest(
        topic="orders/1", text=f"{text}{seq}", publisher_id=pid, publisher_seq=seq, **extra
    )


def stored(harness: Harness, stream: str = "shoal-orders-0") -> list[tuple[str, int | None]]:
    return [(m.message_id, m.publisher_seq) for _, m in harness.messages(stream)]


def pending(harness: Harness, sub: str = "alice", pid: str = "p") -> dict[int, Any]:
    state = harness.sequences().read(publisher_key(sub, pid))
    assert state is not None
    return state.pending


def expire_holds(harness: Harness) -> None:
    harness.clock.advance(RESERVATION_HOLD_MS / 1000 + 1)


def test_a_repeated_seq_is_a_duplicate_with_the_original_id(harness: Harness) -> None:
    status, first = harness.publish.publish(ALICE, request(1))
    again_status, again = harness.publisher().publish(ALICE, request(1))
    assert (status, first["duplicate"]) == (201, False)
    assert (again_status, again["duplicate"]) == (200, True)
    assert again["message_id"] == first["message_id"]
    assert (again["storage_topic"], again["partition"]) == (
        first["storage_topic"],
        first["partition"],
    )
    assert stored(harness) == [(first["message_id"], 1)]


def test_any_seq_at_or_below_the_last_is_a_duplicate(harness: Harness) -> None:
    ids = [harness.publish.publish(ALICE, request(n))[1]["message_id"] for n in range(1, 6)]
    status, body = harness.publish.publish(ALICE, request(2))
    assert (status, body["message_id"], body["duplicate"]) == (200, ids[1], True)
    assert len(stored(harness)) == 5


def test_a_duplicate_reports_where_the_original_went_after_a_switch(harness: Harness) -> None:
    # Given seq 1 went to storage topic 0, then the topic grew and switched
    _, first = harness.publish.publish(ALICE, request(1))
    admin_call("POST", "/v1/topics/orders/storage-topics", {"partitions": 8})
    admin_call("POST", "/v1/topics/orders/switch-produce")
    _, second = harness.publish.publish(ALICE, request(2))
    assert second["storage_topic"] == 1
    # When seq 1 is repeated, Then the answer is where it really went
    _, again = harness.publisher().publish(ALICE, request(1))
    assert (again["storage_topic"], again["partition"]) == (0, first["partition"])


def test_a_gap_is_refused_with_the_expected_seq_and_changes_nothing(harness: Harness) -> None:
    harness.publish.publish(ALICE, request(1))
    before = harness.snapshot()
    with pytest.raises(PublisherSeqGap) as raised:
        harness.publish.publish(ALICE, request(3))
    assert raised.value.details == {"expected": 2}
    assert harness.snapshot() == before


def test_a_new_publisher_starts_at_one(harness: Harness) -> None:
    with pytest.raises(PublisherSeqGap) as raised:
        harness.publish.publish(ALICE, request(5))
    assert raised.value.details == {"expected": 1}


def test_sequences_belong_to_the_principal(harness: Harness) -> None:
    # Given alice's publisher "p" at seq 3
    for n in (1, 2, 3):
        harness.publish.publish(ALICE, request(n))
    # Then bob's publisher "p" is another sequence: his seq 1 is new, with another id
    status, body = harness.publish.publish(BOB, request(1))
    assert (status, body["duplicate"]) == (201, False)
    assert body["message_id"] not in {m for m, _ in stored(harness)[:3]}


def test_racing_retries_make_one_record_and_one_id(harness: Harness) -> None:
    # When eight copies of one publish race (as from a client retrying on timeouts)
    outcomes: list[tuple[int, dict[str, Any]] | ServerBusy] = []

    def attempt() -> None:
        try:
            outcomes.append(harness.publisher().publish(ALICE, request(1)))
        except ServerBusy as exc:
            outcomes.append(exc)

    threads = [threading.Thread(target=attempt) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Then exactly one created the message, any others saw a duplicate or were told to retry
    answers = [o for o in outcomes if not isinstance(o, ServerBusy)]
    assert [s for s, _ in answers].count(201) == 1
    assert {b["message_id"] for _, b in answers} == {stored(harness)[0][0]}
    # And the log holds one record, confirmed
    _, final = harness.publisher().publish(ALICE, request(1))
    assert stored(harness) == [(final["message_id"], 1)]
    assert pending(harness) == {}


def crash_in(
    harness: Harness, service: PublishService, point: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Make ``service`` die at ``point``: ``before:`` the step runs, or ``after:`` it."""
    when, step = point.split(":")
    owner: Any = {
        "reserve": service.sequences,
        "put": service.streams,
        "retain": service.retained,
        "settle": service.sequences,
    }[step]
    name = {"reserve": "reserve", "put": "put_record", "retain": "apply", "settle": "settle"}[step]
    real: Callable[..., Any] = getattr(owner, name)

    def dying(*args: Any, **kwargs: Any) -> Any:
        if when == "after":
            real(*args, **kwargs)
        raise Crash

    monkeypatch.setattr(owner, name, dying)


def crashing_service(harness: Harness, aws: boto3.Session) -> PublishService:
    # its own clients and stores, so that patching them leaves the retrying container intact
    streams = Streams(aws.client("kinesis"), aws.client("lambda"), harness.clock)
    return harness.publisher(streams, Dynamo(aws.client("dynamodb")))


CRASH_POINTS = [
    "before:reserve",
    "after:reserve",
    "before:put",
    "after:put",
    "before:retain",
    "after:retain",
    "before:settle",
    "after:settle",
]


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_a_crash_at_any_step_neither_loses_nor_doubles_the_message(
    harness: Harness, aws: boto3.Session, monkeypatch: pytest.MonkeyPatch, point: str
) -> None:
    # Given a publish (retained, so every step runs) that dies at `point`
    dying = crashing_service(harness, aws)
    crash_in(harness, dying, point, monkeypatch)
    harness.catch_up()
    with pytest.raises(Crash):
        dying.publish(ALICE, request(1, retain=True))
    # When the client retries on another container, after any hold has run out
    expire_holds(harness)
    status, body = harness.publisher().publish(ALICE, request(1, retain=True))
    # Then the log holds the message exactly once, under the one id, and it is retained
    assert stored(harness) == [(body["message_id"], 1)]
    assert getattr(harness.retained().get("orders/1"), "message_id", None) == body["message_id"]
    assert pending(harness) == {}
    # And the answer is "created" only if nothing was recorded before the crash
    assert (status, body["duplicate"]) == (
        (201, False) if point == "before:reserve" else (200, True)
    )
    # And the next seq follows on
    assert harness.publisher().publish(ALICE, request(2))[0] == 201


def test_a_retry_while_the_lease_is_alive_is_told_to_retry(
    harness: Harness, aws: boto3.Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a publish that died after its reservation
    dying = crashing_service(harness, aws)
    crash_in(harness, dying, "before:put", monkeypatch)
    with pytest.raises(Crash):
        dying.publish(ALICE, request(1))
    # When the client retries at once, Then it is told to retry (the holder may still put)
    before = harness.snapshot()
    with pytest.raises(ServerBusy):
        harness.publisher().publish(ALICE, request(1))
    assert harness.snapshot()["records"] == before["records"]
    # And once the hold is over, the retry publishes it
    expire_holds(harness)
    assert harness.publisher().publish(ALICE, request(1))[0] == 200
    assert len(stored(harness)) == 1


def test_a_retry_holds_back_later_seqs_while_an_earlier_one_is_in_flight(
    harness: Harness, aws: boto3.Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a batch of seqs 1..2 whose request is still running (it reserved them, no put yet:
    # its client gave up waiting for the answer)
    dying = crashing_service(harness, aws)
    crash_in(harness, dying, "before:put", monkeypatch)
    with pytest.raises(Crash):
        dying.publish_batch(ALICE, [request(n).model_dump(exclude_none=True) for n in (1, 2)])
    # When the client retries its in-flight messages with a new one after them, at once
    batch = [request(n).model_dump(exclude_none=True) for n in (1, 2, 3)]
    results = harness.publisher().publish_batch(ALICE, batch)
    # Then every one is told to retry, seq 3 too: put now it would precede 1 and 2
    assert [r["error"]["code"] for r in results] == ["server_busy"] * 3
    assert stored(harness) == []
    assert sorted((r.lo, r.hi) for r in pending(harness).values()) == [(1, 2)]
    # And once the hold is over, the retry puts all three in seq order
    expire_holds(harness)
    results = harness.publisher().publish_batch(ALICE, batch)
    assert [r.get("error") for r in results] == [None] * 3
    assert [seq for _, seq in stored(harness)] == [1, 2, 3]
    assert pending(harness) == {}


def failing_puts(harness: Harness, monkeypatch: pytest.MonkeyPatch, *, lands: bool) -> None:
    """Every put reports failure; with ``lands`` the record is written anyway (a timeout)."""
    real = Streams.put_record.__get__(harness.streams)

    def failing(stream: str, record: OutRecord) -> PutOutcome:
        if lands:
            real(stream, record)
        return PutOutcome(error_code="ReadTimeoutError", ambiguous=True)

    monkeypatch.setattr(harness.streams, "put_record", failing)


@pytest.mark.parametrize("lands", [False, True])
def test_a_failed_put_is_retried_at_once_without_a_second_record(
    harness: Harness, monkeypatch: pytest.MonkeyPatch, lands: bool
) -> None:
    # Given a put that fails (or times out after the record landed)
    with monkeypatch.context() as patch:
        failing_puts(harness, patch, lands=lands)
        with pytest.raises(ServerBusy):
            harness.publish.publish(ALICE, request(1))
    # When the client retries at once (the reservation was released, no hold to wait for)
    status, body = harness.publisher().publish(ALICE, request(1))
    # Then the message is in the log once
    assert (status, body["duplicate"]) == (200, True)
    assert stored(harness) == [(body["message_id"], 1)]
    assert pending(harness) == {}


def test_a_crashed_batch_recovers_the_seqs_each_retry_carries(
    harness: Harness, aws: boto3.Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a batch of seqs 1..3 that died after its reservation
    dying = crashing_service(harness, aws)
    crash_in(harness, dying, "before:put", monkeypatch)  # one partition: one record
    batch = [request(n).model_dump(exclude_none=True) for n in (1, 2, 3)]
    with pytest.raises(Crash):
        dying.publish_batch(ALICE, batch)
    expire_holds(harness)
    # When the client retries only seq 2
    _, answer = harness.publisher().publish(ALICE, request(2))
    # Then seq 2 is published; 1 and 3 stay reserved for their own retries
    assert stored(harness) == [(answer["message_id"], 2)]
    assert sorted((r.lo, r.hi) for r in pending(harness).values()) == [(1, 1), (3, 3)]
    # And retrying the whole batch publishes 1 and 3 once, 2 not again
    results = harness.publisher().publish_batch(ALICE, batch)
    assert [r["duplicate"] for r in results] == [True, True, True]
    assert sorted(seq or 0 for _, seq in stored(harness)) == [1, 2, 3]
    assert pending(harness) == {}


def _died_before_its_put_then_switched(
    harness: Harness, aws: boto3.Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Alice's seq 1 died before its put into storage topic 0; then the topic grew and
    switched produce, and the publish's hold ran out."""
    dying = crashing_service(harness, aws)
    crash_in(harness, dying, "before:put", monkeypatch)
    with pytest.raises(Crash):
        dying.publish(ALICE, request(1))
    admin_call("POST", "/v1/topics/orders/storage-topics", {"partitions": 8})
    admin_call("POST", "/v1/topics/orders/switch-produce")
    expire_holds(harness)


def test_a_recovery_after_a_switch_puts_into_the_producing_storage_topic(
    harness: Harness, aws: boto3.Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a publish that died before its put, then the topic switched produce
    _died_before_its_put_then_switched(harness, aws, monkeypatch)
    # When it is retried
    _, body = harness.publisher().publish(ALICE, request(1))
    # Then it went to the new storage topic once, and duplicates say so
    assert body["storage_topic"] == 1
    assert stored(harness, "shoal-orders-1") == [(body["message_id"], 1)]
    assert stored(harness, "shoal-orders-0") == []
    _, again = harness.publisher().publish(ALICE, request(1))
    assert (again["storage_topic"], again["partition"]) == (1, body["partition"])


def test_a_recovery_finds_a_put_made_before_a_switch(
    harness: Harness, aws: boto3.Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a publish that died after its put into storage topic 0, then a switch
    dying = crashing_service(harness, aws)
    crash_in(harness, dying, "after:put", monkeypatch)
    with pytest.raises(Crash):
        dying.publish(ALICE, request(1))
    admin_call("POST", "/v1/topics/orders/storage-topics", {"partitions": 8})
    admin_call("POST", "/v1/topics/orders/switch-produce")
    expire_holds(harness)
    # When it is retried, Then the read-back finds it where it landed: no second record
    _, body = harness.publisher().publish(ALICE, request(1))
    assert body["storage_topic"] == 0
    assert stored(harness, "shoal-orders-0") == [(body["message_id"], 1)]
    assert stored(harness, "shoal-orders-1") == []


def test_a_batch_repeating_a_seq_publishes_it_once(harness: Harness) -> None:
    results = harness.publish.publish_batch(
        ALICE, [request(n).model_dump(exclude_none=True) for n in (1, 2, 2, 3)]
    )
    assert [r["duplicate"] for r in results] == [False, False, True, False]
    assert results[1]["message_id"] == results[2]["message_id"]
    assert [seq for _, seq in stored(harness)] == [1, 2, 3]


def test_a_batch_skipping_a_seq_fails_only_the_gap(harness: Harness) -> None:
    results = harness.publish.publish_batch(
        ALICE, [request(n).model_dump(exclude_none=True) for n in (1, 2, 4, 3)]
    )
    assert [r.get("error", {}).get("code") for r in results] == [
        None,
        None,
        "publisher_seq_gap",
        None,
    ]
    assert results[2]["error"]["expected"] == 3
    assert [seq for _, seq in stored(harness)] == [1, 2, 3]


def test_a_batch_is_classified_against_the_true_last_seq(harness: Harness) -> None:
    # Given seqs 1..6 already published
    for n in range(1, 7):
        harness.publish.publish(ALICE, request(n))
    # When a batch repeats 5 and 6 and goes on with 7 (the optimistic guess "last = 4" fails)
    results = harness.publisher().publish_batch(
        ALICE, [request(n).model_dump(exclude_none=True) for n in (5, 7, 6)]
    )
    # Then 7 is not a gap: 5 and 6 are duplicates, 7 is new
    assert [(r.get("duplicate"), r.get("error")) for r in results] == [
        (True, None),
        (False, None),
        (True, None),
    ]
    assert [seq for _, seq in stored(harness)] == [1, 2, 3, 4, 5, 6, 7]


def test_a_duplicate_after_a_recovery_found_the_put_reports_where_it_went(
    harness: Harness, aws: boto3.Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a publish that died before its put into storage topic 0, then a switch
    _died_before_its_put_then_switched(harness, aws, monkeypatch)
    # and its retry (a recovery) that put it into storage topic 1 and died before confirming
    second = crashing_service(harness, aws)
    crash_in(harness, second, "before:settle", monkeypatch)
    with pytest.raises(Crash):
        second.publish(ALICE, request(1))
    expire_holds(harness)
    # When the next retry reads it back there and is answered
    _, found = harness.publisher().publish(ALICE, request(1))
    assert stored(harness, "shoal-orders-1") == [(found["message_id"], 1)]
    assert found["storage_topic"] == 1
    # Then every later retry is answered with that same place, not the first attempt's route
    _, again = harness.publisher().publish(ALICE, request(1))
    assert (again["storage_topic"], again["partition"]) == (1, found["partition"])
    assert stored(harness, "shoal-orders-0") == []


def test_a_recovered_retained_publish_never_replaces_a_newer_one(
    harness: Harness, aws: boto3.Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given seq 1 published, and a batch repeating it with a retained seq 2 whose request is
    # slow between its routing and its reservation (the read of the publisher's state), while
    # bob publishes a newer retained message on the same topic
    harness.publish.publish(ALICE, request(1))
    dying = crashing_service(harness, aws)
    crash_in(harness, dying, "before:settle", monkeypatch)
    read = dying.sequences.read
    newer: dict[str, Any] = {}

    def slow_read(key: str) -> Any:
        harness.clock.advance(0.05)
        if not newer:
            bob = PublishRequest(topic="orders/1", text="newer", retain=True)
            newer.update(harness.publisher().publish(BOB, bob)[1])
        harness.clock.advance(0.05)
        return read(key)

    monkeypatch.setattr(dying.sequences, "read", slow_read)
    batch = [request(n, retain=n == 2).model_dump(exclude_none=True) for n in (1, 2)]
    # When the batch dies after its put (the retained apply kept bob's, the newer)
    with pytest.raises(Crash):
        dying.publish_batch(ALICE, batch)
    older = [m for _, m in harness.messages("shoal-orders-0") if m.publisher_seq == 2]
    assert len(older) == 1 and older[0].published_at_ms < newer_published(harness)
    assert getattr(harness.retained().get("orders/1"), "message_id", None) == newer["message_id"]
    # and the client retries it after the hold
    expire_holds(harness)
    results = harness.publisher().publish_batch(ALICE, batch)
    assert [r.get("error") for r in results] == [None, None]
    # Then bob's newer retained message still stands
    assert getattr(harness.retained().get("orders/1"), "message_id", None) == newer["message_id"]


def _retained_seq1_died_after_its_put(
    harness: Harness, aws: boto3.Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Alice's retained seq 1 died after its put and its retained copy, before it settled."""
    dying = crashing_service(harness, aws)
    crash_in(harness, dying, "before:settle", monkeypatch)
    with pytest.raises(Crash):
        dying.publish(ALICE, request(1, retain=True))


def newer_published(harness: Harness) -> int:
    retained = harness.retained().get("orders/1")
    assert retained is not None
    return retained.published_at_ms


def test_a_late_retry_of_a_retained_seq_never_replaces_the_next_one_of_the_same_instant(
    harness: Harness, aws: boto3.Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given retained seq 1 whose request died after its put (and its retained copy)
    _retained_seq1_died_after_its_put(harness, aws, monkeypatch)
    # and retained seq 2 on the same topic, published in the same millisecond
    _, second = harness.publisher().publish(ALICE, request(2, retain=True))
    assert getattr(harness.retained().get("orders/1"), "message_id", None) == second["message_id"]
    # When the client retries seq 1 after the hold
    expire_holds(harness)
    status, first = harness.publisher().publish(ALICE, request(1, retain=True))
    assert (status, first["duplicate"]) == (200, True)
    # Then seq 2 stays retained: it is the later publish
    assert getattr(harness.retained().get("orders/1"), "message_id", None) == second["message_id"]


def test_a_late_retry_of_a_retained_publish_never_undoes_a_later_clear(
    harness: Harness, aws: boto3.Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a retained publish that died after its put (and its retained copy)
    _retained_seq1_died_after_its_put(harness, aws, monkeypatch)
    # and a later publish clearing the topic's retained message
    harness.clock.advance(1)
    harness.publisher().publish(BOB, PublishRequest(topic="orders/1", text="", retain=True))
    assert harness.retained().get("orders/1") is None
    # When the first publish is retried after the hold
    expire_holds(harness)
    assert harness.publisher().publish(ALICE, request(1, retain=True))[0] == 200
    # Then the topic stays cleared
    assert harness.retained().get("orders/1") is None
