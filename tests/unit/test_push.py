"""Push subscriptions, the pure parts: routing decisions, group-state transitions, policies."""

from __future__ import annotations

from dataclasses import replace
from typing import Any
from urllib.parse import unquote

import pytest
from shoal.core.clock import ManualClock
from shoal.core.config import Config
from shoal.core.errors import (
    InvalidEndpoint,
    InvalidFilter,
    InvalidParallelism,
    InvalidRetryPolicy,
    InvalidSubscriptionName,
)
from shoal.push.decisions import MainAction, Outcome, RetryAction, decide_main, decide_retry, judge
from shoal.push.endpoint import DeliveryResult, EndpointPolicy, delivery_request
from shoal.push.entries import (
    BLOCKED,
    Entry,
    Source,
    decode_entry,
    encode_entry,
    main_position,
    partition_key,
)
from shoal.push.model import (
    DLQ,
    RQ,
    RetryPolicy,
    parse_retry_policy,
    validate_filter,
    validate_name,
    validate_parallelism,
)
from shoal.push.state import EntryReservation, KeyState, Pos, RetryHead
from shoal.records import MalformedRecord, encode_record

from tests.unit.test_push_support import FakeEndpoint, failing_keys, message

POLICY = RetryPolicy(max_attempts=3, initial_backoff_s=1, max_backoff_s=4, multiplier=2)
SOURCE = Source("shoal-default-0", "shardId-000000000000", "7", 0)


def reservation(
    queue: str, n: int, main: str, *, message_id: str = "m", **fields: Any
) -> EntryReservation:
    base = EntryReservation(
        queue=RQ if queue == RQ else DLQ,
        n=n,
        message_id=message_id,
        main=main,
        source=SOURCE,
        attempts=0,
        due_ms=0,
        reason=BLOCKED,
        status=None,
        at_ms=1_000,
        published_at_ms=500,
    )
    return replace(base, **fields)


def pos(n: int) -> str:
    return main_position(0, str(n), 0)


def entry(n: int, main: str, *, attempts: int = 0, due_ms: int = 0, key: str = "k") -> Entry:
    return Entry(
        message=message(n, key),
        queue=RQ,
        n=n,
        main=main,
        attempts=attempts,
        due_ms=due_ms,
        reason=None,
        status=None,
        at_ms=0,
    )


def blocked_in_rq() -> KeyState:
    return KeyState().reserve("mq", [reservation(RQ, 1, pos(10))], generation=0)


# -- the MQ decision ------------------------------------------------------------------------


def test_an_unblocked_key_is_delivered() -> None:
    # Given a key with nothing pending / When a new message comes / Then it is POSTed
    action = decide_main(
        KeyState(), main=pos(1), message_id="m1", generation=0, skip_before_ms=0, ordered=True
    )
    assert action is MainAction.DELIVER


def test_a_message_of_a_key_pending_in_rq_follows_it_into_rq() -> None:
    state = blocked_in_rq()
    action = decide_main(
        state, main=pos(11), message_id="m2", generation=0, skip_before_ms=0, ordered=True
    )
    assert action is MainAction.FOLLOW_RQ


def test_a_key_pending_only_in_dlq_sends_later_messages_to_dlq() -> None:
    # Given a key whose RQ drained into DLQ
    state = KeyState().reserve("mq", [reservation(DLQ, 1, pos(10))], generation=0)
    action = decide_main(
        state, main=pos(11), message_id="m2", generation=0, skip_before_ms=0, ordered=True
    )
    assert action is MainAction.FOLLOW_DLQ


def test_rq_comes_before_dlq_when_both_hold_the_key() -> None:
    state = KeyState().reserve("mq", [reservation(DLQ, 1, pos(10))], generation=0)
    state = state.reserve("mq", [reservation(RQ, 1, pos(11))], generation=0)
    action = decide_main(
        state, main=pos(12), message_id="m3", generation=0, skip_before_ms=0, ordered=True
    )
    assert action is MainAction.FOLLOW_RQ


def test_an_unordered_subscription_delivers_a_blocked_keys_message() -> None:
    action = decide_main(
        blocked_in_rq(),
        main=pos(11),
        message_id="m2",
        generation=0,
        skip_before_ms=0,
        ordered=False,
    )
    assert action is MainAction.DELIVER


def test_a_message_routed_before_is_skipped_on_a_retried_batch() -> None:
    # Given m1 (main 10) routed, then m2 (main 11) routed after it
    state = blocked_in_rq().reserve(
        "mq", [reservation(RQ, 2, pos(11), message_id="m2")], generation=0
    )
    # When the batch comes again with m1 / Then m1 is skipped: RQ holds it
    action = decide_main(
        state, main=pos(10), message_id="m", generation=0, skip_before_ms=0, ordered=True
    )
    assert action is MainAction.SKIP


def test_the_last_routed_message_is_put_again_on_a_retried_batch() -> None:
    # Given the reservation of m1 whose put may not have landed
    state = blocked_in_rq()
    action = decide_main(
        state, main=pos(10), message_id="m", generation=0, skip_before_ms=0, ordered=True
    )
    assert action is MainAction.REPUT


def test_a_seek_generation_voids_the_routed_mark() -> None:
    # Given m1 routed in generation 0 / When the subscription rewound (generation 1)
    state = KeyState().reserve("mq", [reservation(DLQ, 1, pos(10))], generation=0)
    action = decide_main(
        state, main=pos(10), message_id="m", generation=1, skip_before_ms=0, ordered=True
    )
    # Then m1 is a message like any other: behind the key's pending entry
    assert action is MainAction.FOLLOW_DLQ


def test_routing_from_a_later_storage_topic_never_skips_an_earlier_ones_messages() -> None:
    # Given key k's message of storage topic 1 routed to RQ first (its tap ran ahead)
    later = main_position(1, "5", 0)
    state = KeyState().reserve("mq", [reservation(RQ, 1, later, message_id="t1")], generation=0)
    # When the tap of storage topic 0 comes to an older message of k
    action = decide_main(
        state, main=pos(10), message_id="t0", generation=0, skip_before_ms=0, ordered=False
    )
    # Then it is delivered, not skipped (positions of two storage topics do not compare)
    assert action is MainAction.DELIVER


def test_a_message_routed_before_a_later_storage_topic_routed_is_still_skipped() -> None:
    # Given m1 of storage topic 0 routed, then a message of storage topic 1 routed
    state = blocked_in_rq().reserve(
        "mq", [reservation(RQ, 2, main_position(1, "5", 0), message_id="t1")], generation=0
    )
    # When storage topic 0's batch comes again with m1 / Then m1 is skipped: RQ holds it
    action = decide_main(
        state, main=pos(10), message_id="m", generation=0, skip_before_ms=0, ordered=True
    )
    assert action is MainAction.SKIP


def test_a_key_marked_finished_skips_what_it_finished_in_that_storage_topic() -> None:
    # Given a key marked finished up to main 10 of storage topic 0 in generation 2
    state = KeyState().mark(pos(10), 2)

    def action(main: str, generation: int = 2) -> MainAction:
        return decide_main(
            state, main=main, message_id="x", generation=generation, skip_before_ms=0, ordered=True
        )

    # Then a replay of main 10 is skipped, main 11 is delivered
    assert action(pos(10)) is MainAction.SKIP
    assert action(pos(11)) is MainAction.DELIVER
    # And the mark says nothing of another storage topic, nor after a seek
    assert action(main_position(1, "5", 0)) is MainAction.DELIVER
    assert action(pos(10), generation=3) is MainAction.DELIVER


def test_a_mark_only_moves_forward_and_a_stale_generation_leaves_it() -> None:
    state = KeyState().mark(pos(10), 2)
    # When an older position, or one read before the seek, is marked / Then nothing changes
    assert state.mark(pos(9), 2) is state
    assert state.mark(pos(99), 1) is state
    # When a later position is marked / Then the mark moves and survives the item's JSON
    later = state.mark(pos(12), 2)
    assert later.finished(pos(12), 2) and not later.finished(pos(13), 2)
    assert KeyState.from_json(later.to_json(), 1).marks == later.marks


def test_routing_in_a_new_generation_voids_the_marks() -> None:
    # Given a mark of generation 1 up to main 30 / When main 20 is routed in generation 2
    state = KeyState().mark(pos(30), 1)
    routed = state.reserve("mq", [reservation(RQ, 1, pos(20))], generation=2)
    # Then the old mark no longer skips anything: only what generation 2 routed is finished
    assert not routed.finished(pos(25), 2)
    assert routed.finished(pos(20), 2)


def test_entries_older_than_a_seek_time_do_not_block() -> None:
    # Given the key's only pending entry published at 500 / When skip_before is 600
    action = decide_main(
        blocked_in_rq(),
        main=pos(11),
        message_id="m2",
        generation=0,
        skip_before_ms=600,
        ordered=True,
    )
    assert action is MainAction.DELIVER


# -- the RQ decision ------------------------------------------------------------------------


def decide(
    state: KeyState, e: Entry, now_ms: int = 0, *, skip_before_ms: int = 0, ordered: bool = True
) -> RetryAction:
    return decide_retry(
        state, e, policy=POLICY, now_ms=now_ms, skip_before_ms=skip_before_ms, ordered=ordered
    ).action


def test_the_head_entry_is_delivered_when_due() -> None:
    assert decide(blocked_in_rq(), entry(1, pos(10), due_ms=100), now_ms=100) is RetryAction.DELIVER


def test_the_head_entry_waits_for_its_attempt_time() -> None:
    result = decide_retry(
        blocked_in_rq(),
        entry(1, pos(10), attempts=1, due_ms=5_000),
        policy=POLICY,
        skip_before_ms=0,
        ordered=True,
        now_ms=1_000,
    )
    assert (result.action, result.due_ms) == (RetryAction.WAIT, 5_000)


def test_the_heads_recorded_progress_overrides_the_records_attempts() -> None:
    # Given the head retried twice already (recorded in the key state, not in the record)
    state = blocked_in_rq().retry_later(RetryHead(1, 2, 9_000, "http_503", 503))
    result = decide_retry(
        state,
        entry(1, pos(10), attempts=1),
        policy=POLICY,
        skip_before_ms=0,
        ordered=True,
        now_ms=9_000,
    )
    assert (result.action, result.attempts) == (RetryAction.DELIVER, 2)


def test_an_entry_with_its_attempts_used_up_is_exhausted() -> None:
    state = blocked_in_rq().retry_later(RetryHead(1, 3, 0, "http_503", 503))
    assert decide(state, entry(1, pos(10))) is RetryAction.EXHAUSTED


def test_a_consumed_offset_is_stale() -> None:
    state = blocked_in_rq().consume(RQ, 1, pos(10))
    assert decide(state, entry(1, pos(10))) is RetryAction.STALE


def test_a_consumed_entry_whose_move_to_dlq_may_be_lost_is_put_again() -> None:
    # Given the head moved to DLQ (the RQ consumer's reservation, from offset 1)
    state = blocked_in_rq().consume(RQ, 1, pos(10))
    moved = reservation(DLQ, 1, pos(10), message_id="m0001-k", origin_n=1)
    state = state.reserve("rq", [moved])
    assert decide(state, entry(1, pos(10))) is RetryAction.REPUT


def test_a_later_offset_before_its_predecessor_is_a_gap() -> None:
    state = blocked_in_rq().reserve("mq", [reservation(RQ, 2, pos(11))], generation=0)
    assert decide(state, entry(2, pos(11))) is RetryAction.GAP


def test_an_entry_published_before_the_seek_time_is_skipped() -> None:
    e = entry(1, pos(10))
    assert decide(blocked_in_rq(), e, skip_before_ms=e.message.published_at_ms + 1) is (
        RetryAction.SKIP
    )


def test_an_entry_newer_than_a_dead_lettered_message_follows_it_to_dlq() -> None:
    # Given m1 dead-lettered (DLQ offset 1, main 10) and m2 still in RQ
    state = KeyState().reserve("mq", [reservation(DLQ, 1, pos(10))], generation=0)
    state = state.reserve("mq", [reservation(RQ, 1, pos(11))], generation=0)
    assert decide(state, entry(1, pos(11))) is RetryAction.FOLLOW_DLQ


def test_a_redriven_entry_is_delivered_though_newer_ones_wait_in_dlq() -> None:
    # Given m1, m2 dead-lettered, and m1 alone redriven into RQ
    state = KeyState().reserve(
        "mq", [reservation(DLQ, 1, pos(10)), reservation(DLQ, 2, pos(11))], generation=0
    )
    state = state.consume(DLQ, 1, pos(10)).reserve("rd", [reservation(RQ, 1, pos(10))])
    # Then m1 (main 10, not newer than DLQ's consumed mark) goes out
    assert decide(state, entry(1, pos(10)), now_ms=1) is RetryAction.DELIVER


def test_an_unordered_subscription_retries_regardless_of_dlq() -> None:
    state = KeyState().reserve("mq", [reservation(DLQ, 1, pos(10))], generation=0)
    state = state.reserve("mq", [reservation(RQ, 1, pos(11))], generation=0)
    assert decide(state, entry(1, pos(11)), ordered=False) is RetryAction.DELIVER


# -- group-state transitions ----------------------------------------------------------------


def test_a_key_is_blocked_while_produced_and_consumed_differ() -> None:
    state = blocked_in_rq()
    assert state.blocked()
    assert (state.rq.p, state.rq.c) == (Pos(1, pos(10)), Pos(0, ""))
    assert not state.consume(RQ, 1, pos(10)).blocked()


def test_offsets_are_reserved_and_consumed_in_order() -> None:
    with pytest.raises(AssertionError):
        KeyState().reserve("mq", [reservation(RQ, 2, pos(10))])
    with pytest.raises(AssertionError):
        blocked_in_rq().reserve("mq", [reservation(RQ, 2, pos(11))]).consume(RQ, 2, pos(11))


def test_consuming_the_head_clears_its_retry_progress() -> None:
    state = blocked_in_rq().retry_later(RetryHead(1, 2, 0, "timeout", None))
    assert state.consume(RQ, 1, pos(10)).head is None


def test_a_redrive_consumes_dlq_and_produces_rq_in_one_state() -> None:
    state = KeyState().reserve(
        "mq", [reservation(DLQ, 1, pos(10)), reservation(DLQ, 2, pos(11))], generation=0
    )
    moved = state.consume(DLQ, 1, pos(10)).consume(DLQ, 2, pos(11))
    moved = moved.reserve("rd", [reservation(RQ, 1, pos(10)), reservation(RQ, 2, pos(11))])
    assert (moved.dlq.depth, moved.rq.depth) == (0, 2)
    assert moved.blocked()


def test_the_state_survives_its_json() -> None:
    state = blocked_in_rq().retry_later(RetryHead(1, 2, 77, "http_500", 500))
    state = state.reserve("rd", [reservation(DLQ, 1, pos(3), origin_n=4)])
    again = KeyState.from_json(state.to_json(), version=3)
    assert again == replace(state, version=3)


def test_a_fast_forward_consumes_queues_that_predate_it() -> None:
    state = blocked_in_rq().reserve("mq", [reservation(DLQ, 1, pos(11), published_at_ms=900)])
    skipped = state.skip_before(600)
    assert (skipped.rq.depth, skipped.dlq.depth) == (0, 1)


# -- what an attempt leads to ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("result", "attempt", "outcome"),
    [
        (DeliveryResult(status=204), 1, Outcome.DONE),
        (DeliveryResult(status=503), 1, Outcome.RETRY),
        (DeliveryResult(status=429), 2, Outcome.RETRY),
        (DeliveryResult(status=503), 3, Outcome.DEAD),
        (DeliveryResult(status=400), 1, Outcome.DEAD),
        (DeliveryResult(status=302), 1, Outcome.DEAD),
        (DeliveryResult(error="timeout"), 1, Outcome.RETRY),
    ],
)
def test_judge_follows_retry_on(result: DeliveryResult, attempt: int, outcome: Outcome) -> None:
    assert judge(result, POLICY, attempt) is outcome


def test_retry_on_can_name_codes_and_classes() -> None:
    policy = parse_retry_policy({"retry_on": [404, "4xx"], "max_attempts": 2})
    assert judge(DeliveryResult(status=409), policy, 1) is Outcome.RETRY
    assert judge(DeliveryResult(status=503), policy, 1) is Outcome.DEAD
    assert judge(DeliveryResult(error="timeout"), policy, 1) is Outcome.DEAD


def test_backoff_grows_with_jitter_and_stays_bounded() -> None:
    # Given initial 1 s, multiplier 2, max 4 s
    waits = [POLICY.backoff_ms(a, "m1") for a in range(1, 6)]
    ceilings = [1000, 2000, 4000, 4000, 4000]
    # Then each wait is within [ceiling/2, ceiling]
    assert all(c / 2 <= w <= c for w, c in zip(waits, ceilings, strict=True))
    # and a retried batch computes the same time, another message another one
    assert POLICY.backoff_ms(2, "m1") == waits[1]
    assert len({POLICY.backoff_ms(1, f"m{i}") for i in range(20)}) > 1


@pytest.mark.parametrize(
    "raw",
    [
        "x",
        {"max_attempts": 0},
        {"initial_backoff_s": 10, "max_backoff_s": 1},
        {"retry_on": [99]},
        {"retry_on": ["3xx"]},
        {"retry_on": [True]},
        {"multiplier": 0.5},
        {"unknown": 1},
    ],
)
def test_a_bad_retry_policy_is_refused(raw: object) -> None:
    with pytest.raises(InvalidRetryPolicy):
        parse_retry_policy(raw)


def test_names_filters_and_parallelism_are_checked() -> None:
    assert validate_name("orders_push-1") == "orders_push-1"
    for bad in ("", "a.b", "a#b", "x" * 65, 3):
        with pytest.raises(InvalidSubscriptionName):
            validate_name(bad)
    assert validate_filter("orders/+/eu") == "orders/+/eu"
    for bad_filter in ("a/#/b", "$share/g/a", "", 7):
        with pytest.raises(InvalidFilter):
            validate_filter(bad_filter)
    for bad_parallelism in (0, 11, True, "2"):
        with pytest.raises(InvalidParallelism):
            validate_parallelism(bad_parallelism)


# -- endpoints ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "http://example.com/hook",
        "http://127.0.0.1:8080/hook",
        "https://user:pw@example.com/",
        "https://169.254.169.254/latest",
        "https://127.0.0.1/",
        "https://localhost/",
        "ftp://example.com/",
        "https:///nohost",
        "https://example.com/#frag",
        "https://example.com:99999/",
    ],
)
def test_deployed_only_https_to_an_outside_host_is_allowed(url: str) -> None:
    with pytest.raises(InvalidEndpoint):
        EndpointPolicy().validate(url)


def test_deployed_https_is_allowed() -> None:
    assert EndpointPolicy().validate("https://hooks.example.com/a?b=1") == (
        "https://hooks.example.com/a?b=1"
    )


def test_under_shoal_dev_http_to_loopback_only_is_allowed() -> None:
    local = EndpointPolicy.from_config(
        Config.from_env({"AWS_ENDPOINT_URL": "http://127.0.0.1:4566"})
    )
    assert local.validate("http://127.0.0.1:9000/hook") == "http://127.0.0.1:9000/hook"
    assert local.validate("http://[::1]:9000/") == "http://[::1]:9000/"
    with pytest.raises(InvalidEndpoint):
        local.validate("http://example.com/hook")
    # a real endpoint URL, or none, is no emulator
    assert not Config.from_env({}).push_loopback_http
    assert not Config.from_env(
        {"AWS_ENDPOINT_URL": "https://kinesis.us-east-1.amazonaws.com"}
    ).push_loopback_http
    assert Config.from_env({"AWS_ENDPOINT_URL": "http://localhost:4566"}).push_loopback_http


def test_the_request_carries_the_dedup_headers_and_the_message() -> None:
    m = message(3, "clé/ü ü")
    request = delivery_request("orders", "https://example.com/", m, attempt=2)
    assert request.headers["Shoal-Message-Id"] == m.message_id
    assert request.headers["Shoal-Attempt"] == "2"
    key_header = request.headers["Shoal-Ordering-Key"]
    assert key_header.isascii() and unquote(key_header) == "clé/ü ü"
    assert b'"payload":"cGF5bG9hZCAz"' in request.body


def test_the_fake_endpoint_answers_by_key() -> None:
    endpoint = FakeEndpoint(failing_keys("bad"))
    good = endpoint.deliver(delivery_request("s", "https://e/", message(1, "good"), 1))
    bad = endpoint.deliver(delivery_request("s", "https://e/", message(2, "bad"), 1))
    assert (good.ok, bad.ok) == (True, False)
    assert endpoint.delivered() == [("good", message(1, "good").message_id)]


# -- queue records --------------------------------------------------------------------------


def test_a_queue_entry_survives_its_record() -> None:
    e = replace(entry(4, pos(9), attempts=2, due_ms=123), reason="http_503", status=503)
    assert decode_entry(encode_entry(e)) == e


def test_a_storage_record_is_no_queue_entry() -> None:
    with pytest.raises(MalformedRecord):
        decode_entry(encode_record([message(1)]))


def test_long_ordering_keys_get_a_digest_partition_key() -> None:
    assert partition_key("k") == "k"
    assert len(partition_key("k" * 300)) == 32


def test_a_manual_clock_drives_attempt_times() -> None:
    # Given the head's next attempt due in 2 s on an injected clock
    clock = ManualClock(0)
    state = blocked_in_rq().retry_later(RetryHead(1, 1, clock.now_ms() + 2_000, "timeout", None))
    e = entry(1, pos(10))
    assert decide(state, e, now_ms=clock.now_ms()) is RetryAction.WAIT
    # When the clock moves past it / Then the entry goes out
    clock.advance(2)
    assert decide(state, e, now_ms=clock.now_ms()) is RetryAction.DELIVER
