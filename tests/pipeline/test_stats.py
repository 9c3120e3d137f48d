"""Stats: throughput per topic and hour, lag, retry and dead-letter rates per consumer."""

from __future__ import annotations

from typing import Any

import pytest
from pyspark.sql import SparkSession

from pipeline.audit import AuditWindow, audit, summarize
from pipeline.stats import stats
from tests.pipeline.data import SECOND, T0, Scenario, events_df, message, messages_df

pytestmark = pytest.mark.pipeline

HOUR = 3600 * SECOND


@pytest.fixture(scope="module")
def doc(spark: SparkSession) -> dict[str, Any]:
    messages = [
        message(0, topic="a/x", payload="AAAA"),  # 3 bytes
        message(1, topic="a/x", payload="AAAA"),
        message(2, topic="a/y", at=T0 + HOUR),
    ]
    # a session: m0 acked, m1 redelivered then acked, m2 unacked (backlog)
    s = Scenario("s1")
    s.clean(0)
    d = s.delivery(1, 0.5)
    s.record("redelivered", 1, 30, delivery_id=d)
    s.ack(1, 31, d)
    s.publish(2)
    s.delivery(2, 2.0)
    # a push subscription: m0 delivered, m1 dead-lettered
    p = Scenario("p1", "push")
    p.record("delivered", 0, 0.1)
    p.record("dead_lettered", 1, 10)
    events = s.events + p.events
    # the scenario names its message ids "<name>/m<n>": point them at the archive's
    for e in events:
        e["message_id"] = e["message_id"].rsplit("/", 1)[-1] if e["message_id"] else ""
    return stats(messages_df(spark, messages), events_df(spark, events), as_of=T0 + HOUR + 60_000)


def test_throughput_per_topic_and_hour(doc: dict[str, Any]) -> None:
    rows = {(r["topic"], r["hour"]): r for r in doc["throughput"]}
    # Then two messages of a/x (3 bytes each) in the first hour, one of a/y an hour later
    first_hour = "2023-11-14T22:00Z"
    assert (rows[("a/x", first_hour)]["messages"], rows[("a/x", first_hour)]["bytes"]) == (2, 6)
    assert rows[("a/y", "2023-11-14T23:00Z")]["messages"] == 1


def test_lag_is_the_unacked_backlog_and_its_age(doc: dict[str, Any]) -> None:
    s1 = next(c for c in doc["consumers"] if c["consumer"] == "s1")
    # Then m2 is the backlog, waiting since its publish a minute before as_of
    assert s1["backlog"] == 1
    assert s1["oldest_unacked_ms"] == 60_000


def test_retry_and_dlq_rates(doc: dict[str, Any]) -> None:
    by_name = {c["consumer"]: c for c in doc["consumers"]}
    # Then s1 redelivered one of three deliveries, p1 dead-lettered one of two messages
    assert by_name["s1"]["retry_rate"] == pytest.approx(1 / 3)
    assert by_name["p1"]["dlq_rate"] == pytest.approx(1 / 2)
    assert doc["totals"]["dead_lettered"] == 1


def test_stats_and_the_audit_agree_on_one_archive(spark: SparkSession) -> None:
    # Given a push subscription whose messages were all dead-lettered once, three of them
    # redriven and acked after, and a session known by a digest, labelled with its client id
    p = Scenario("hooked", "push")
    for n in range(4):
        p.publish(n)
        p.record("delivered", n, 0.1, attempt=1)
        p.record("dead_lettered", n, 1, reason="connection_refused")
    for n in range(1, 4):
        p.record("delivered", n, 20, attempt=2)
        p.record("acked", n, 21)
    s = Scenario("1a401f7f899af9bd69296189")
    s.publish(4)
    d = s.delivery(4, 0.5, label="desk-1", subscription="sensors/#")
    s.record("redelivered", 4, 30, delivery_id=d, label="desk-1")
    s.ack(4, 31, d)
    messages = messages_df(spark, p.messages + s.messages)
    events = events_df(spark, p.events + s.events)
    # When both reports read it
    doc = stats(messages, events, as_of=T0 + HOUR)
    audited = summarize(audit(messages, events, AuditWindow(as_of=T0 + HOUR)))
    # Then every count they share is the same, consumer by consumer, and both name them alike
    by_stats = {c["consumer"]: c for c in doc["consumers"]}
    for counts in audited.consumers:
        mine = by_stats[counts["consumer"]]
        assert (mine["label"], mine["subscription"]) == (counts["label"], counts["subscription"])
        assert mine["messages"] == counts["matched"]
        assert mine["dead_lettered"] == counts["dead_lettered"]
        assert mine["redeliveries"] == counts["redeliveries"]
    assert by_stats["hooked"]["dead_lettered"] == 1
    assert by_stats["1a401f7f899af9bd69296189"]["label"] == "desk-1"
    assert doc["totals"]["dead_lettered"] == sum(c["dead_lettered"] for c in audited.consumers)


def test_an_ended_consumer_s_unacked_messages_are_not_its_backlog(spark: SparkSession) -> None:
    # Given a session that acked m0, then ended (MQTT 5 §4.1) with m1 handed out and m2 only
    # routed, and had m3, published after its end, routed to it anyway
    ended = Scenario("ended")
    ended.clean(0)
    for n in (1, 2):
        ended.publish(n)
        ended.record("routed", n, 0.01)
    ended.delivery(1, 0.02)
    ended.end(2.5)
    ended.publish(3)
    ended.record("routed", 3, 0.01)
    # And a shared group removed by its last member's leave with m0 routed, never handed out
    group = Scenario("removed", "group")
    group.publish(0)
    group.record("routed", 0, 0.01)
    group.end(5, reason="group_removed")
    # And a live session with m0 and m1 handed out, not acked
    live = Scenario("live")
    for n in (0, 1):
        live.publish(n)
        live.delivery(n, 0.1)
    stories = (ended, group, live)
    messages = messages_df(spark, [m for s in stories for m in s.messages])
    events = events_df(spark, [e for s in stories for e in s.events])
    # When the stats and the audit read them
    as_of = T0 + HOUR
    doc = stats(messages, events, as_of=as_of)
    audited = summarize(audit(messages, events, AuditWindow(as_of=as_of)))
    by_name = {c["consumer"]: c for c in doc["consumers"]}
    # Then what the ended consumers had not acked is no backlog: only m3, after the end, is
    assert by_name["ended"]["backlog"] == 1
    assert by_name["ended"]["oldest_unacked_ms"] == as_of - (T0 + 3 * SECOND)
    assert (by_name["removed"]["backlog"], by_name["removed"]["oldest_unacked_ms"]) == (0, None)
    # And the live session's unacked messages still are, waiting since m0's publish
    assert by_name["live"]["backlog"] == 2
    assert by_name["live"]["oldest_unacked_ms"] == as_of - T0
    assert doc["totals"]["backlog"] == 3
    # And the backlog is what the audit has neither settled nor dropped
    for counts in audited.consumers:
        assert by_name[counts["consumer"]]["backlog"] == counts["lost"] + counts["pending"]
