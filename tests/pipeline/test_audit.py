"""The audit finds planted losses, duplicates and reorderings, and nothing in clean traffic.

Every story is planted under its own consumer in one archive (``audited``), audited once; each
test reads its consumer's row (see ``tests.pipeline.data``).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from pyspark.sql import SparkSession

from pipeline.audit import AuditResult, AuditWindow, audit, report, summarize
from tests.pipeline.data import (
    SECOND,
    T0,
    Scenario,
    events_df,
    messages_df,
    subscriptions_df,
)

pytestmark = pytest.mark.pipeline

HORIZON_MS = 60 * SECOND
LONG_AFTER = T0 + 10**6


def _stories() -> tuple[list[Scenario], list[dict[str, Any]]]:
    stories: list[Scenario] = []

    def story(name: str, kind: str = "session") -> Scenario:
        stories.append(Scenario(name, kind))
        return stories[-1]

    for name in ("clean-a", "clean-b"):
        s = story(name)
        for n in range(5):
            s.clean(n)

    s = story("lost")
    s.clean(0)
    s.publish(1)
    s.record("routed", 1, 0.01)

    s = story("late")
    s.clean(0, ack_after_s=90)

    s = story("dup")  # delivered twice as new (ordinals 0 and 7), each copy acked
    s.clean(0)
    s.ack(0, 6, s.delivery(0, 5, ordinal=7))

    s = story("redelivered")  # dup after the ack timeout, the ack retried: one delivery id
    s.publish(0)
    first = s.delivery(0, 0.01)
    s.record("redelivered", 0, 30, delivery_id=first)
    s.ack(0, 30.1, first)
    s.ack(0, 30.2, first)

    s = story("retained")  # m0 acked, then sent again as retained on a new subscribe
    s.clean(0)
    s.ack(0, 60, s.delivery(0, 59, ordinal=5, retain=True))

    s = story("retained-only")  # subscribed after m0's publish: only its retained copy
    s.publish(0)
    s.ack(0, 20, s.delivery(0, 19, retain=True))

    s = story("lost-ack")  # the ack lost: dup with the same delivery id, acked then
    s.publish(0)
    first = s.delivery(0, 0.02)
    s.record("redelivered", 0, 30, delivery_id=first)
    s.ack(0, 30.1, first)

    s = story("acked-then-dup")  # acked, the answer lost on the way back: dup, acked again
    s.publish(0)
    first = s.delivery(0, 0.02)
    s.ack(0, 1, first)
    s.record("redelivered", 0, 30, delivery_id=first)
    s.ack(0, 30.1, first)

    s = story("group-named", "group")  # a group's consumer id is a digest
    s.clean(0)
    for e in s.events:
        e.update(consumer="3f9a6c0e5b71d2a4c8e1f0b9", subscription="$share/workers/jobs/#")
        e.update(label="member-session")

    s = story("reorder")  # one key, acked m0, m2, m1
    s.clean(0, ack_after_s=1)
    s.clean(1, ack_after_s=2)  # T0 + 3 s
    s.clean(2, ack_after_s=0.5)  # T0 + 2.5 s

    # acked m0, m2, m1 without an explicit key: a group spreads such messages over its lanes
    for name, kind, keyed in (
        ("group-unkeyed", "group", False),
        ("group-keyed", "group", True),
        ("session-unkeyed", "session", False),
    ):
        s = story(name, kind)
        key = f"{name}/k" if keyed else None  # the archive records an unkeyed one's topic
        s.clean(0, ack_after_s=1, keyed=keyed, key=key)
        s.clean(1, ack_after_s=2, keyed=keyed, key=key)
        s.clean(2, ack_after_s=0.5, keyed=keyed, key=key)

    s = story("per-key")  # m1 (key b) acked before m0 (key a)
    s.clean(0, ack_after_s=5, key="per-key/a")
    s.clean(1, ack_after_s=0.1, key="per-key/b")

    s = story("storage-order")  # publish clocks disagree with storage topic order
    s.clean(5, ack_after_s=5, storage_topic=0, sequence=9)  # acked T0 + 10 s
    s.clean(4, ack_after_s=7, storage_topic=1, sequence=1)  # acked T0 + 11 s

    s = story("sequence-as-number")  # the stream has 9 before 10, though "10" < "9" as strings
    s.clean(0, ack_after_s=5, sequence=10)  # acked T0 + 5 s
    s.clean(1, ack_after_s=1, sequence=9)  # acked T0 + 2 s: first, as the stream has it

    s = story("archived-twice")  # a bisected batch archived m0 twice
    s.clean(0)
    s.publish(0)

    s = story("events-twice")  # a re-cut batch recorded every event twice
    s.clean(0)
    s.events *= 2

    s = story("push-dlq", "push")
    s.publish(0)
    s.record("dead_lettered", 0, 5, reason="http 400")

    s = story("dropped")
    s.publish(0)
    s.record("routed", 0, 0.01)
    s.record("dropped", 0, 1, reason="expired")

    # a session that ended (expiry, a clean start) with m1 handed out and m2 not yet: both go
    # with it (MQTT 5 §4.1); m0 was acked before; m3, published after the end, was routed to
    # it anyway (a late router) and is lost, as any unacked one
    s = story("session-ended")
    s.clean(0)
    for n in (1, 2, 3):
        s.publish(n)
        s.record("routed", n, 0.01)
    s.delivery(1, 0.02)
    s.end(2.5)
    s.end(2.6)  # an end retried after a crash records it again

    # a shared group removed by its last member's leave: its backlog goes unserved
    s = story("group-removed", "group")
    s.publish(0)
    s.record("routed", 0, 0.01)
    s.end(5, reason="group_removed")

    # [MQTT-4.8.2-4/5]: a QoS 2 group message handed to a member whose session then ended
    s = story("group-qos2-ended", "group")
    s.publish(0, qos=2)
    s.record("routed", 0, 0.01, qos=2)
    s.delivery(0, 0.02, qos=2, label="member-a")
    s.record("dropped", 0, 30, qos=2, reason="session_ended", label="member-a")

    # the same member reconnected and got it again (dup, the same id), then acked it
    s = story("group-qos2-held", "group")
    s.publish(0, qos=2)
    s.record("routed", 0, 0.01, qos=2)
    kept = s.delivery(0, 0.02, qos=2, label="member-a")
    s.record("redelivered", 0, 30, delivery_id=kept, qos=2, label="member-a")
    s.ack(0, 30.1, kept)

    s = story("qos0")
    s.publish(0, qos=0)
    s.delivery(0, 0.01, qos=0)

    s = story("subscribed")  # subscribed to subscribed/# from T0; m1 never routed
    s.clean(0, topic="subscribed/x")
    s.publish(1, topic="subscribed/y")
    s.publish(2, topic="elsewhere/x")

    s = story("late-subscriber")  # subscribed 5 s after its only message
    s.publish(0, topic="late-subscriber/x")

    s = story("latency")
    for n in range(10):
        s.clean(n, ack_after_s=n + 1)

    def held(consumer: str, topic_filter: str, since: int) -> dict[str, Any]:
        return {
            "consumer_kind": "session",
            "consumer": consumer,
            "filter": topic_filter,
            "qos": 1,
            "since": since,
            "until": None,
        }

    subscriptions = [
        held("subscribed", "subscribed/#", T0),
        held("late-subscriber", "late-subscriber/+", T0 + 5 * SECOND),
    ]
    return stories, subscriptions


@pytest.fixture(scope="module")
def audited(spark: SparkSession) -> AuditResult:
    stories, subscriptions = _stories()
    return audit(
        messages_df(spark, [m for s in stories for m in s.messages]),
        events_df(spark, [e for s in stories for e in s.events]),
        AuditWindow(horizon_ms=HORIZON_MS, as_of=LONG_AFTER),
        subscriptions_df(spark, subscriptions),
    )


@pytest.fixture(scope="module")
def rows(audited: AuditResult) -> dict[str, dict[str, Any]]:
    return {row["consumer"]: row for row in summarize(audited).consumers}


def findings(row: dict[str, Any]) -> tuple[int, int, int]:
    return row["lost"], row["duplicated"], row["reordered"]


def test_clean_traffic_has_no_findings(rows: dict[str, dict[str, Any]]) -> None:
    # Given two sessions that each got and acked every message once, in order
    for name in ("clean-a", "clean-b"):
        # Then nothing is lost, duplicated or reordered, and all five count as acked
        assert findings(rows[name]) == (0, 0, 0)
        assert (rows[name]["acked"], rows[name]["delivered_after_ack"]) == (5, 0)


def test_routed_but_never_acked_is_lost_once_the_horizon_passed(
    rows: dict[str, dict[str, Any]],
) -> None:
    # Given m1 routed and never acked, the data reaching far past the horizon
    # Then m1 is lost and m0 is not
    assert (rows["lost"]["lost"], rows["lost"]["acked"]) == (1, 1)


def test_acked_after_the_horizon_is_late_not_lost(rows: dict[str, dict[str, Any]]) -> None:
    # Given m0 acked 90 s after publish with a 60 s horizon
    # Then it is late
    assert (rows["late"]["late"], rows["late"]["lost"], rows["late"]["acked"]) == (1, 0, 0)


def test_a_message_acked_under_two_delivery_ids_is_duplicated(
    rows: dict[str, dict[str, Any]],
) -> None:
    # Given m0 delivered twice as new and each copy acked
    # Then it is one duplicated message, handed out again after its first ack
    assert rows["dup"]["duplicated"] == 1
    assert rows["dup"]["delivered_after_ack"] == 1


def test_a_redelivery_acked_twice_under_its_own_id_is_no_duplicate(
    rows: dict[str, dict[str, Any]],
) -> None:
    # Given m0 redelivered with dup and its ack retried, all under one delivery id
    row = rows["redelivered"]
    # Then nothing is duplicated and the redelivery is counted
    assert (row["duplicated"], row["redeliveries"], row["redelivered_messages"]) == (0, 1, 1)


def test_acks_out_of_publish_order_on_one_key_are_reordered(
    rows: dict[str, dict[str, Any]],
) -> None:
    # Given m0, m1, m2 on one key acked m0, m2, m1
    # Then one message (m1) was acked after a later one
    assert rows["reorder"]["reordered"] == 1


def test_a_groups_unkeyed_messages_are_not_judged_for_order(
    rows: dict[str, dict[str, Any]],
) -> None:
    # Given m0, m1, m2 acked m0, m2, m1 by a group (unkeyed and explicitly keyed) and by a
    # session (unkeyed)
    # Then only the group's unkeyed messages may come in any order (its lanes spread them);
    # explicit keys keep order in a group, and a session keeps per-topic order
    assert rows["group-unkeyed"]["reordered"] == 0
    assert rows["group-keyed"]["reordered"] == 1
    assert rows["session-unkeyed"]["reordered"] == 1


def test_order_is_judged_per_ordering_key(rows: dict[str, dict[str, Any]]) -> None:
    # Given m1 (key b) acked before m0 (key a)
    # Then no key saw its messages out of order
    assert rows["per-key"]["reordered"] == 0


def test_publish_order_is_storage_topic_then_sequence(rows: dict[str, dict[str, Any]]) -> None:
    # Given one key's message in storage topic 0 published later by clock than the one in
    # storage topic 1, acked in storage topic order
    # Then that is in order
    assert rows["storage-order"]["reordered"] == 0


def test_sequence_numbers_order_as_numbers(rows: dict[str, dict[str, Any]]) -> None:
    # Given one key's m1 (sequence 9, published later by clock) acked before m0 (sequence 10)
    # Then that is in order: 9 comes first in the stream, though not as a string
    assert rows["sequence-as-number"]["reordered"] == 0


def test_a_message_archived_twice_is_judged_once(rows: dict[str, dict[str, Any]]) -> None:
    row = rows["archived-twice"]
    assert (row["matched"], row["acked"], row["duplicated"]) == (1, 1, 0)


def test_events_recorded_twice_count_once(rows: dict[str, dict[str, Any]]) -> None:
    row = rows["events-twice"]
    assert (row["acked"], row["duplicated"], row["lost"]) == (1, 0, 0)


def test_a_qos2_group_message_of_an_ended_session_is_dropped_not_lost(
    rows: dict[str, dict[str, Any]],
) -> None:
    # Given a QoS 2 group message whose member's session ended before it acked
    # Then it is dropped (it went to no other member, [MQTT-4.8.2-5]), never lost
    row = rows["group-qos2-ended"]
    assert (row["dropped"], row["lost"], row["acked"]) == (1, 0, 0)
    # and one held for its member and acked after a reconnect is acked once, no duplicate
    row = rows["group-qos2-held"]
    assert (row["acked"], row["lost"], row["duplicated"]) == (1, 0, 0)


def test_what_an_ended_consumer_did_not_ack_is_dropped_not_lost(
    rows: dict[str, dict[str, Any]],
) -> None:
    # Given a session that ended with one message handed out and one waiting, after acking one
    row = rows["session-ended"]
    # Then those two are dropped with it; one published after its end is still lost
    assert (row["acked"], row["dropped"], row["lost"]) == (1, 2, 1)
    # And a removed group's backlog is dropped, not lost
    row = rows["group-removed"]
    assert (row["dropped"], row["lost"]) == (1, 0)


def test_dead_lettered_and_dropped_are_not_lost(rows: dict[str, dict[str, Any]]) -> None:
    # Given a push subscription that dead-lettered m0 and a session that dropped m0 (expired)
    # Then neither is lost
    assert (rows["push-dlq"]["dead_lettered"], rows["push-dlq"]["lost"]) == (1, 0)
    assert rows["push-dlq"]["consumer_kind"] == "push"
    assert (rows["dropped"]["dropped"], rows["dropped"]["lost"]) == (1, 0)


def test_qos0_deliveries_are_not_judged(rows: dict[str, dict[str, Any]]) -> None:
    row = rows["qos0"]
    assert (row["qos0"], row["lost"], row["judged"]) == (1, 0, 0)


def test_a_subscription_at_publish_time_catches_a_message_never_routed(
    rows: dict[str, dict[str, Any]],
) -> None:
    # Given subscribed/# held from T0 and subscribed/y never routed to it
    # Then subscribed/y is lost, and elsewhere/x was never expected
    assert (rows["subscribed"]["matched"], rows["subscribed"]["lost"]) == (2, 1)


def test_a_subscription_made_after_the_publish_does_not_expect_it(
    rows: dict[str, dict[str, Any]],
) -> None:
    assert "late-subscriber" not in rows


def test_latency_percentiles_are_publish_to_first_ack(rows: dict[str, dict[str, Any]]) -> None:
    # Given ten messages acked 1..10 s after publish
    row = rows["latency"]
    # Then the percentiles (the nearest rank: the smallest value with that share of values at
    # or below it; exact for every value of one bucket) are the fifth and the tenth
    assert row["latency_ms"]["p50"] == 5000
    assert row["latency_ms"]["p99"] == 10_000
    assert row["latency_ms"]["max"] == 10_000


def _latencies(s: Scenario) -> list[int]:
    """Publish to ack of each of a story's clean messages, from its recorded events."""
    published = {m["message_id"]: m["published_at"] for m in s.messages}
    message_of = {e["delivery_id"]: e["message_id"] for e in s.events if e["event"] == "delivered"}
    return sorted(
        e["at"] - published[message_of[e["delivery_id"]]] for e in s.events if e["event"] == "acked"
    )


def _nearest_rank(ordered: list[int], p: int) -> int:
    return ordered[math.ceil(len(ordered) * p / 100) - 1]


def test_latency_percentiles_are_exact_below_1024_ms_and_within_0_2_percent_above(
    spark: SparkSession,
) -> None:
    # Given one session acking 1,000 messages 1..1,000 ms after publish, and another acking
    # 200 messages 10 to 11 minutes after publish, 300 ms apart (about three to a bucket)
    fast, slow = Scenario("fast"), Scenario("slow")
    for k in range(1000):
        fast.clean(k, ack_after_s=(k + 1) / 1000)
    for k in range(200):
        slow.clean(k, ack_after_s=600 + 0.3 * k)
    exact = {"fast": _latencies(fast), "slow": _latencies(slow)}
    every = sorted(exact["fast"] + exact["slow"])
    # When audited
    result = audit(
        messages_df(spark, fast.messages + slow.messages),
        events_df(spark, fast.events + slow.events),
        AuditWindow(horizon_ms=HORIZON_MS, as_of=LONG_AFTER),
    )
    summary = summarize(result)
    found = {row["consumer"]: row["latency_ms"] for row in summary.consumers}
    found["every"] = summary.overall["latency_ms"]
    # Then below 1,024 ms each percentile is the exact nearest rank; above, it is a latency
    # of the input at most 0.2% above the exact one; the maximum is exact
    for who, ordered in (*exact.items(), ("every", every)):
        assert found[who]["max"] == ordered[-1]
        for p in (50, 90, 99):
            want, got = _nearest_rank(ordered, p), found[who][f"p{p}"]
            if want < 1024:
                assert got == want, (who, p)
            else:
                assert got in ordered and want <= got <= want * (1 + 2**-9), (who, p, got, want)
    assert (found["fast"]["p50"], found["every"]["p50"]) == (500, 600)


def test_a_negative_latency_is_its_own_bucket(spark: SparkSession) -> None:
    # Given acks recorded 5 ms and 3 ms before their publish time (the clocks disagree) and
    # one 2 s after
    s = Scenario("skewed")
    for n, after_s in enumerate((-0.005, -0.003, 2)):
        s.clean(n, ack_after_s=after_s)
    result = audit(messages_df(spark, s.messages), events_df(spark, s.events), AuditWindow())
    # Then the percentiles are the latencies as recorded
    [row] = summarize(result).consumers
    assert row["latency_ms"] == {"p50": -3, "p90": 2000, "p99": 2000, "max": 2000}


def test_a_retained_resend_on_a_new_subscribe_is_no_duplicate(
    rows: dict[str, dict[str, Any]],
) -> None:
    # Given m0 acked, then sent again (a new delivery id, retain set) when the session
    # subscribed again, and acked
    row = rows["retained"]
    # Then it is one acked message with a retained delivery, not a duplicate
    assert findings(row) == (0, 0, 0)
    assert (row["acked"], row["retained_deliveries"], row["delivered_after_ack"]) == (1, 1, 0)
    # and a message the session only got as retained is not judged
    only = rows["retained-only"]
    assert (only["retained"], only["judged"], only["lost"]) == (1, 0, 0)


def test_a_redelivery_after_a_lost_ack_is_no_fault(rows: dict[str, dict[str, Any]]) -> None:
    # Given a delivery whose ack was lost (or whose ack's answer was), redelivered with dup
    # under the same delivery id and acked then (MQTT 5 §4.4)
    for name in ("lost-ack", "acked-then-dup"):
        row = rows[name]
        # Then nothing is found: one acked message, redelivered once
        assert findings(row) == (0, 0, 0), name
        assert (row["acked"], row["delivered_after_ack"], row["redeliveries"]) == (1, 0, 1)


def test_a_group_is_named_by_its_share_name(rows: dict[str, dict[str, Any]]) -> None:
    # Given a shared group's events (consumer: a digest; subscription: $share/workers/jobs/#)
    row = rows["3f9a6c0e5b71d2a4c8e1f0b9"]
    # Then the report names it by its share name, with its subscription
    assert (row["label"], row["subscription"]) == ("workers", "$share/workers/jobs/#")


def test_report_json_carries_per_consumer_counts_and_examples(audited: AuditResult) -> None:
    # When the planted stories are reported
    doc = report(audited)
    by_name = {c["consumer"]: c for c in doc["consumers"]}
    # Then each consumer has its counts and latency, the totals add them up, and the
    # examples name the planted findings
    assert findings(by_name["lost"]) == (1, 0, 0)
    assert set(by_name["lost"]["latency_ms"]) == {"p50", "p90", "p99", "max"}
    assert doc["totals"]["lost"] == 3  # lost, subscribed, session-ended's after its end
    assert doc["totals"]["duplicated"] == 1
    assert doc["totals"]["reordered"] == 3  # reorder, group-keyed, session-unkeyed
    assert {e["message_id"] for e in doc["examples"]["lost"]} == {
        "lost/m1",
        "subscribed/m1",
        "session-ended/m3",
    }
    assert {e["message_id"] for e in doc["examples"]["reordered"]} == {
        "reorder/m1",
        "group-keyed/m1",
        "session-unkeyed/m1",
    }
    assert doc["clean"] is False
    assert doc["totals"]["retained_deliveries"] == 2


def test_a_clean_audit_with_retained_resends_and_lost_acks_is_titled_clean(
    audited: AuditResult,
) -> None:
    # Given only the stories of correct MQTT behaviour: clean, retained re-sends, redeliveries
    # after a lost ack, a named group
    correct = {"clean-a", "clean-b", "retained", "retained-only", "lost-ack", "acked-then-dup"}
    only = audited.restricted(sorted(correct))
    # When reported
    doc = report(only)
    # Then the report is clean (its title says no delivery faults)
    assert doc["clean"] is True, doc["totals"]


def test_zero_case_empty_archive_reports_nothing(spark: SparkSession) -> None:
    # Given an archive and an event log with nothing in them
    result = audit(messages_df(spark, []), events_df(spark, []), AuditWindow())
    # When reported
    doc = report(result)
    # Then there are no consumers, every total is zero and the audit is clean
    assert doc["consumers"] == []
    assert (doc["totals"]["messages"], doc["totals"]["lost"]) == (0, 0)
    assert doc["clean"] is True


def test_window_and_as_of_decide_what_is_judged_and_what_is_pending(
    spark: SparkSession,
) -> None:
    # Given m0..m3 routed to one session, m1 also delivered, none acked
    s = Scenario("windowed")
    for n in range(4):
        s.publish(n)
        s.record("routed", n, 0.01)
    s.delivery(1, 0.02)
    # When audited for publish times [T0 + 1 s, T0 + 3 s) as of T0 + 11 s, horizon 60 s
    window = AuditWindow(
        since=T0 + SECOND, until=T0 + 3 * SECOND, horizon_ms=HORIZON_MS, as_of=T0 + 11 * SECOND
    )
    result = audit(messages_df(spark, s.messages), events_df(spark, s.events), window)
    [row] = summarize(result).consumers
    # Then only m1 and m2 are judged, and both are still pending, not lost
    assert (row["matched"], row["pending"], row["lost"]) == (2, 2, 0)
