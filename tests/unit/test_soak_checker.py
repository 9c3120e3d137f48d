"""The soak's checker (bench.soak.checker) on small histories written as the soak writes them:
a clean one passes, and each planted fault is caught with the records that show it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from shoal.groups.records import group_key

from bench.soak.checker import Report, check, check_path, matches
from bench.soak.history import History, history_file, read_history

T0 = 1_700_000_000.0


class Run:
    """A history written record by record with the soak's History on a clock of its own."""

    def __init__(self) -> None:
        self.now = T0
        self.history = History(None, writer="worker-0", clock=lambda: self.now)
        self.history.record("phase", name="start", reaper_s=2.0)
        self.seqs: dict[str, int] = {}

    def at(self, seconds: float) -> Run:
        self.now = T0 + seconds
        return self

    def tick(self, seconds: float = 0.01) -> None:
        self.now += seconds

    def rec(self, op: str, **fields: Any) -> dict[str, Any]:
        return self.history.record(op, **fields)

    def connect(
        self,
        client: str,
        conn: str,
        *,
        transport: str = "ws",
        will: dict[str, Any] | None = None,
        present: bool = True,
        keepalive_s: int = 0,
        clean_start: bool = False,
    ) -> None:
        common = {"client": client, "conn": conn, "transport": transport}
        self.rec(
            "connect",
            phase="invoke",
            clean_start=clean_start,
            session_expiry_s=3600,
            keepalive_s=keepalive_s,
            will=will,
            **common,
        )
        self.tick()
        self.rec("connect", phase="ok", channel=f"ch-{conn}", session_present=present, **common)
        self.tick()

    def subscribe(self, client: str, name: str, qos: int = 1) -> None:
        filters = [{"filter": name, "qos": qos}]
        self.rec("subscribe", phase="invoke", client=client, filters=filters)
        self.tick()
        self.rec("subscribe", phase="ok", client=client, filters=filters, granted=[qos])
        self.tick()

    def unsubscribe(self, client: str, name: str) -> None:
        self.rec("unsubscribe", phase="invoke", client=client, filters=[name])
        self.tick()
        self.rec("unsubscribe", phase="ok", client=client, filters=[name])
        self.tick()

    def publish(
        self,
        mk: str,
        topic: str,
        *,
        qos: int = 1,
        key: str | None = None,
        pub: str = "pub-1",
        retain: bool = False,
    ) -> None:
        seq = self.seqs[pub] = self.seqs.get(pub, 0) + 1
        fields = {"client": pub, "pub": pub, "seq": seq, "mk": mk, "rq": f"rq-{mk}"}
        self.rec("publish", phase="invoke", topic=topic, qos=qos, retain=retain, key=key, **fields)
        self.tick()
        self.rec("publish", phase="ok", message_id=f"m-{mk}", duplicate=False, **fields)
        self.tick()

    def deliver(
        self,
        client: str,
        mk: str,
        *,
        sub: str,
        conn: str,
        delivery_id: str | None = None,
        qos: int = 1,
        dup: bool = False,
        retain: bool = False,
        transport: str = "ws",
        topic: str = "",
        **extra: Any,
    ) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "client": client,
            "transport": transport,
            "conn": conn,
            "id": delivery_id or f"d-{client}-{mk}",
            "message_id": f"m-{mk}",
            "mk": mk,
            "topic": topic,
            "qos": qos,
            "retain": retain,
            "dup": dup,
            "sub": sub,
            "published_at": int(self.now * 1000),
        }
        if transport == "http":
            fields["ti"] = self.now - 0.005
        record = self.rec("deliver", **(fields | extra))
        self.tick()
        return record

    def ack(self, client: str, ids: list[str], *, conn: str, acked: int | None = None) -> None:
        rq = f"ack-{client}-{self.now}"
        self.rec("ack", phase="invoke", client=client, conn=conn, rq=rq, ids=ids)
        self.tick()
        counted = len(ids) if acked is None else acked
        self.rec("ack", phase="ok", client=client, conn=conn, rq=rq, acked=counted)
        self.tick()

    def consume(self, client: str, mk: str, *, sub: str, conn: str, **kw: Any) -> None:
        """Delivered and acked."""
        record = self.deliver(client, mk, sub=sub, conn=conn, **kw)
        self.ack(client, [record["id"]], conn=conn)

    def check(self) -> Report:
        self.tick(60)
        self.rec("phase", name="end")
        return check(self.history.records)


def violations(report: Report, name: str) -> list[str]:
    return [v.summary for v in report.violations if v.property == name]


# -- a clean history --------------------------------------------------------------------------


def clean_run() -> Run:
    """Two sessions, a shared group, a will, a push subscription: everything as promised."""
    run = Run()
    run.connect("alice", "a1")
    run.subscribe("alice", "soak/#")
    run.connect("bob", "b1", transport="http")
    run.subscribe("bob", "soak/+/x")
    for member in ("m1", "m2"):
        run.connect(member, f"{member}-c")
        run.subscribe(member, "$share/g/jobs/#", qos=2)
    run.connect("watcher", "w1")
    run.subscribe("watcher", "wills/#")
    run.rec("push_sub", phase="invoke", name="hooks", filter="hooks/#", ordered=True)
    run.tick()
    run.rec("push_sub", phase="ok", name="hooks", filter="hooks/#", ordered=True)
    for n in range(3):
        run.publish(f"k{n}", "soak/a/x", key="k")
        run.consume("alice", f"k{n}", sub="soak/#", conn="a1")
        run.consume("bob", f"k{n}", sub="soak/+/x", conn="b1", transport="http")
    run.publish("j1", "jobs/1", qos=2, key="j")
    run.consume("m1", "j1", sub="$share/g/jobs/#", conn="m1-c", qos=2)
    run.publish("j2", "jobs/2", qos=1, key="j")
    run.consume("m2", "j2", sub="$share/g/jobs/#", conn="m2-c")
    # a will connection dropped; its will published after its 2 s delay
    run.connect("dev", "d1", will={"wid": "w-1", "topic": "wills/dev", "delay_s": 2})
    run.rec("lost", client="dev", conn="d1", how="dropped")
    run.tick(3)
    run.consume("watcher", "", sub="wills/#", conn="w1", wid="w-1", delivery_id="d-will-1")
    run.tick(10)
    # a will connection ended normally: no will
    run.connect("dev", "d2", will={"wid": "w-2", "topic": "wills/dev", "delay_s": 0})
    run.rec("disconnect", phase="invoke", client="dev", conn="d2")
    run.tick()
    run.rec("disconnect", phase="ok", client="dev", conn="d2")
    # the push endpoint takes h1, refuses h2 for good (dead-lettered)
    run.publish("h1", "hooks/1", key="pk")
    run.publish("h2", "hooks/2", key="pk2")
    run.rec("push_hit", name="hooks", mk="h1", attempt=1, key="pk", status=200, fate="ok")
    run.rec("push_hit", name="hooks", mk="h2", attempt=1, key="pk2", status=400, fate="reject")
    run.rec(
        "push_final",
        name="hooks",
        dlq=[{"message_id": "m-h2", "mk": "h2", "reason": "http_400", "attempts": 1}],
        retry_depth=0,
        dlq_depth=1,
    )
    return run


def test_a_clean_history_passes() -> None:
    # Given a history in which every promise is kept
    run = clean_run()

    # When it is checked
    report = run.check()

    # Then nothing is violated, and the properties had something to judge
    assert report.ok, report.render()
    assert report.counts["owed_session"] == 6
    assert report.counts["owed_group"] == 2
    assert report.counts["wills_required"] == 1
    assert report.counts["wills_forbidden"] == 1
    assert report.counts["push_hooks_owed"] == 2


# -- loss ---------------------------------------------------------------------------------------


def test_a_message_never_delivered_is_lost() -> None:
    # Given a subscription held to the end and a message published after it, never delivered
    run = clean_run()
    run.publish("k9", "soak/b/x", key="k")

    # When the history is checked
    report = run.check()

    # Then the message is lost, for both sessions whose filter it matches
    lost = violations(report, "lost")
    assert len(lost) == 2
    assert all("k9" in summary for summary in lost)


def test_a_message_first_answered_after_the_drain_is_owed_to_no_one() -> None:
    # Given a message never delivered that is lost if answered before the drain ended, and a
    # second one whose publish was first answered after it (a retry that got through while
    # the clients were being stopped)
    run = clean_run()
    run.publish("k8", "soak/b/x", key="k")
    run.rec("phase", name="traffic_end")
    run.tick(5)
    run.rec("phase", name="drained", after_s=5)
    run.tick()
    run.publish("k9", "soak/b/x", key="k")

    # When the history is checked
    report = run.check()

    # Then only the first is lost, for both sessions; the second was owed to no one
    lost = violations(report, "lost")
    assert len(lost) == 2 and all("k8" in summary for summary in lost)
    assert report.counts["acked_after_drain"] == 1


def test_a_message_delivered_to_a_killed_client_and_never_again_is_lost() -> None:
    # Given a message delivered once to a client killed before its ack, never delivered again
    run = clean_run()
    run.publish("k7", "soak/q", key="q")
    run.deliver("alice", "k7", sub="soak/#", conn="a1")
    run.rec("fault", kind="client_kill", clients=["alice"])

    # When the history is checked
    report = run.check()

    # Then it is lost: the server still held it unacked
    assert violations(report, "lost") == [
        "k7 (soak/q) reached alice under soak/# but never again after it went unacked"
    ]


def test_a_message_published_before_the_subscription_is_not_owed() -> None:
    # Given a message answered before a later session subscribed, never delivered to it
    run = clean_run()
    run.publish("early", "soak/late/x")
    run.connect("carol", "c1")
    run.subscribe("carol", "soak/late/#")

    # When the history is checked
    report = run.check()

    # Then carol lost nothing (alice did: the message matches her filter)
    assert all("carol" not in v for v in violations(report, "lost"))
    assert any("alice" in v for v in violations(report, "lost"))


def test_a_group_message_that_reached_no_member_is_lost() -> None:
    # Given a message to the shared group's filter that no member got
    run = clean_run()
    run.publish("j9", "jobs/9")

    # When the history is checked
    report = run.check()

    # Then it is lost for the group
    assert violations(report, "lost") == [
        "j9 (jobs/9, QoS 1) never reached any member under $share/g/jobs/#"
    ]


# -- duplicates after ack ---------------------------------------------------------------------


def test_a_long_poll_sent_after_an_answered_ack_must_not_return_its_id() -> None:
    # Given bob's ack of k1 answered, and a later get returning k1 again
    run = clean_run()
    run.tick(1)
    run.deliver("bob", "k1", sub="soak/+/x", conn="b1", transport="http", dup=True)

    # When the history is checked
    report = run.check()

    # Then it is a duplicate after ack
    assert violations(report, "duplicate_after_ack") == [
        "bob got k1 (d-bob-k1) again after its ack was answered"
    ]


def test_a_push_on_a_connection_opened_after_the_ack_must_not_carry_its_id() -> None:
    # Given alice's ack of k0 answered, then a new connection of hers that gets k0 again
    run = clean_run()
    run.connect("alice", "a2")
    run.deliver("alice", "k0", sub="soak/#", conn="a2", dup=True)

    # When the history is checked
    report = run.check()

    # Then it is a duplicate after ack
    assert violations(report, "duplicate_after_ack") == [
        "alice got k0 (d-alice-k0) again after its ack was answered"
    ]


def test_a_push_racing_the_ack_on_its_connection_is_counted_not_failed() -> None:
    # Given a push of k8 that arrives just after its ack's answer, on the same connection
    run = clean_run()
    run.publish("k8", "soak/r")
    run.consume("alice", "k8", sub="soak/#", conn="a1")
    run.deliver("alice", "k8", sub="soak/#", conn="a1", dup=True)

    # When the history is checked
    report = run.check()

    # Then it is a race (decided before the ack committed), not a violation
    assert violations(report, "duplicate_after_ack") == []
    assert report.counts["ack_races"] == 1


def test_an_ack_that_counted_fewer_ids_than_it_named_confirms_none() -> None:
    # Given a member's ack answered as counting nothing (its lease was lost), and the message
    # then handed to another member
    run = clean_run()
    run.publish("j5", "jobs/5", key="j5")
    record = run.deliver("m1", "j5", sub="$share/g/jobs/#", conn="m1-c")
    run.ack("m1", [record["id"]], conn="m1-c", acked=0)
    run.tick(10)
    run.consume("m2", "j5", sub="$share/g/jobs/#", conn="m2-c", dup=True)

    # When the history is checked
    report = run.check()

    # Then nothing is wrong: the first ack never took
    assert report.ok, report.render()


def test_a_group_message_acked_by_one_member_must_not_reach_another() -> None:
    # Given m1's answered ack of j1, and later a new connection of m2 that gets j1
    run = clean_run()
    run.connect("m2", "m2-d")
    run.deliver("m2", "j1", sub="$share/g/jobs/#", conn="m2-d", qos=1, dup=True)

    # When the history is checked
    report = run.check()

    # Then it is a duplicate after ack, in the group
    assert violations(report, "duplicate_after_ack") == [
        "m2 got j1 of $share/g/jobs/# after m1's ack of it was answered"
    ]


# -- flags ------------------------------------------------------------------------------------


def test_a_redelivery_without_dup_is_caught() -> None:
    # Given a message delivered twice under one delivery id, the second without dup
    run = clean_run()
    run.publish("k5", "soak/c")
    run.deliver("alice", "k5", sub="soak/#", conn="a1")
    run.consume("alice", "k5", sub="soak/#", conn="a1")

    # When the history is checked
    report = run.check()

    # Then the dup flag is missing
    assert violations(report, "dup_flag") == ["alice got delivery d-alice-k5 again without dup"]


def test_a_group_message_two_members_got_without_dup_is_caught() -> None:
    # Given j2, handed to m2, then handed to m1 too, neither time with dup
    run = clean_run()
    run.deliver("m1", "j2", sub="$share/g/jobs/#", conn="m1-c", delivery_id="d-m1-j2-again")

    # When the history is checked
    report = run.check()

    # Then one of them should have said it was a redelivery
    assert violations(report, "dup_flag") == ["m1 got j2 of $share/g/jobs/# without dup, as m2 had"]


def test_a_group_message_first_handed_out_but_received_after_a_redelivery_is_allowed() -> None:
    # Given j3 handed to m1 first (its frame posted late, under load), redelivered with dup
    # to m2, which got it before m1 did
    run = clean_run()
    run.publish("j3", "jobs/3", qos=1, key="j3")
    run.consume("m2", "j3", sub="$share/g/jobs/#", conn="m2-c", dup=True)
    run.deliver("m1", "j3", sub="$share/g/jobs/#", conn="m1-c")

    # When the history is checked
    report = run.check()

    # Then the flags are as promised: the one copy without dup is the first hand-out's
    assert violations(report, "dup_flag") == []


def test_a_qos0_message_delivered_twice_is_caught() -> None:
    # Given a QoS 0 message delivered twice to one session
    run = clean_run()
    run.publish("z", "soak/z", qos=0)
    run.deliver("alice", "z", sub="soak/#", conn="a1", qos=0)
    run.deliver("alice", "z", sub="soak/#", conn="a1", qos=0)

    # When the history is checked
    report = run.check()

    # Then QoS 0's at most once is broken
    assert violations(report, "qos0_twice") == ["alice got QoS 0 z twice"]


# -- order ------------------------------------------------------------------------------------


def test_messages_of_a_key_delivered_out_of_publish_order_are_caught() -> None:
    # Given two messages of one key, the first answered before the second was sent, and a
    # session that gets the second first
    run = clean_run()
    run.publish("o1", "soak/o/1", key="ko", pub="pub-2")
    run.publish("o2", "soak/o/2", key="ko", pub="pub-3")
    run.consume("alice", "o2", sub="soak/#", conn="a1")
    run.consume("alice", "o1", sub="soak/#", conn="a1")

    # When the history is checked
    report = run.check()

    # Then the order is broken
    assert violations(report, "order") == [
        "alice under soak/# got o2 before o1, published before it (key ko)"
    ]


def test_a_message_first_seen_as_a_redelivery_is_not_judged_for_order() -> None:
    # Given two messages of one key in publish order, the second seen first and the first
    # seen only later with dup (its first handing out was never seen: a lost answer)
    run = clean_run()
    run.publish("l1", "soak/l/1", key="kl", pub="pub-2")
    run.publish("l2", "soak/l/2", key="kl", pub="pub-3")
    run.consume("bob", "l2", sub="soak/+/x", conn="b1", transport="http", topic="soak/l/x")
    run.consume("bob", "l1", sub="soak/+/x", conn="b1", transport="http", dup=True)

    # When the history is checked
    report = run.check()

    # Then no order is judged between them
    assert violations(report, "order") == []


def test_one_publishers_sequence_orders_its_batch() -> None:
    # Given one publisher's batch of two messages of one key (invoked together, answered
    # together), delivered in the reverse of their sequence numbers
    run = clean_run()
    fields = {"client": "pub-9", "pub": "pub-9", "rq": "batch-1", "topic": "soak/b", "key": "kb"}
    for i, mk in enumerate(("b1", "b2")):
        run.rec("publish", phase="invoke", seq=i + 1, mk=mk, i=i, qos=1, retain=False, **fields)
    run.tick()
    for i, mk in enumerate(("b1", "b2")):
        run.rec("publish", phase="ok", seq=i + 1, mk=mk, i=i, message_id=f"m-{mk}", **fields)
    run.tick()
    run.consume("alice", "b2", sub="soak/#", conn="a1")
    run.consume("alice", "b1", sub="soak/#", conn="a1")

    # When the history is checked
    report = run.check()

    # Then the order is broken
    assert violations(report, "order") == [
        "alice under soak/# got b2 before b1, published before it (key kb)"
    ]


def test_concurrent_publishes_may_arrive_in_either_order() -> None:
    # Given two publishes of one key in flight at once, delivered in the other order
    run = clean_run()
    for mk in ("c1", "c2"):
        fields = {"client": mk, "pub": mk, "seq": 1, "mk": mk, "rq": mk}
        run.rec("publish", phase="invoke", topic="soak/c", qos=1, retain=False, key="kc", **fields)
    run.tick()
    for mk in ("c1", "c2"):
        fields = {"client": mk, "pub": mk, "seq": 1, "mk": mk, "rq": mk}
        run.rec("publish", phase="ok", message_id=f"m-{mk}", **fields)
    run.tick()
    run.consume("alice", "c2", sub="soak/#", conn="a1")
    run.consume("alice", "c1", sub="soak/#", conn="a1")

    # When the history is checked
    report = run.check()

    # Then no order was promised between them
    assert violations(report, "order") == []


# -- shared groups ------------------------------------------------------------------------------


def test_a_qos2_group_message_handed_to_a_second_member_is_caught() -> None:
    # Given a QoS 2 message of the group delivered to m1, then to m2
    run = clean_run()
    run.publish("q2", "jobs/q", qos=2)
    run.deliver("m1", "q2", sub="$share/g/jobs/#", conn="m1-c", qos=2)
    run.consume("m2", "q2", sub="$share/g/jobs/#", conn="m2-c", qos=2, dup=True)

    # When the history is checked
    report = run.check()

    # Then QoS 2 left its member
    assert violations(report, "qos2_member") == [
        "QoS 2 q2 of $share/g/jobs/# went to 2 members: m1, m2"
    ]


def test_a_qos2_message_whose_member_left_is_dropped_not_lost() -> None:
    # Given a QoS 2 message handed to m2, which then leaves the group without acking it
    run = clean_run()
    run.publish("q3", "jobs/q3", qos=2)
    run.deliver("m2", "q3", sub="$share/g/jobs/#", conn="m2-c", qos=2)
    run.unsubscribe("m2", "$share/g/jobs/#")

    # When the history is checked
    report = run.check()

    # Then it is counted dropped, not lost
    assert report.ok, report.render()
    assert report.counts["qos2_dropped_on_leave"] == 1


def test_a_qos2_message_the_service_dropped_unseen_is_counted_not_lost() -> None:
    # Given a QoS 2 message of the group that no member recorded (the answer that carried it
    # was lost), which the service archived as dropped: its member's session ended
    run = clean_run()
    run.publish("q4", "jobs/q4", qos=2)
    run.rec(
        "server_drops",
        events=[
            {
                "consumer": group_key("g", "jobs/#"),
                "message_id": "m-q4",
                "reason": "session_ended",
                "label": "s-1",
            }
        ],
    )

    # When the history is checked
    report = run.check()

    # Then it is counted dropped, not lost
    assert report.ok, report.render()
    assert report.counts["qos2_dropped_unseen"] == 1


@pytest.mark.parametrize(
    "event",
    [
        # another group's drop
        {"consumer": group_key("other", "jobs/#"), "message_id": "m-q5", "reason": "session_ended"},
        # another message's
        {"consumer": group_key("g", "jobs/#"), "message_id": "m-q6", "reason": "session_ended"},
        # a drop for another reason
        {"consumer": group_key("g", "jobs/#"), "message_id": "m-q5", "reason": "expired"},
    ],
)
def test_a_lost_qos2_message_is_not_excused_by_another_drop(event: dict[str, str]) -> None:
    # Given a QoS 2 message of the group that no member got, and a drop that is not its own
    run = clean_run()
    run.publish("q5", "jobs/q5", qos=2)
    run.rec("server_drops", events=[event])

    # When the history is checked
    report = run.check()

    # Then it is lost
    assert [v.summary for v in report.violations if v.property == "lost"], report.render()


# -- where a subscription starts --------------------------------------------------------------


def test_a_message_answered_before_the_subscribe_must_not_reach_it() -> None:
    # Given a message answered before carol subscribed, delivered to her all the same
    run = clean_run()
    run.publish("old", "news/1")
    run.connect("carol", "c1")
    run.subscribe("carol", "news/#")
    run.consume("carol", "old", sub="news/#", conn="c1")

    # When the history is checked
    report = run.check()

    # Then the subscription did not start where it was made
    assert violations(report, "subscription_start") == [
        "carol got old under news/#, published while it was not subscribed"
    ]


def test_a_message_published_between_an_unsubscribe_and_a_resubscribe_must_not_arrive() -> None:
    # Given carol subscribed, unsubscribed (answered), a message published and answered, and
    # carol subscribed again, then getting that message
    run = clean_run()
    run.connect("carol", "c1")
    run.subscribe("carol", "news/#")
    run.unsubscribe("carol", "news/#")
    run.publish("gap", "news/2")
    run.subscribe("carol", "news/#")
    run.consume("carol", "gap", sub="news/#", conn="c1")

    # When the history is checked
    report = run.check()

    # Then it reached a subscription made after it
    assert violations(report, "subscription_start") == [
        "carol got gap under news/#, published while it was not subscribed"
    ]


def test_the_retained_copy_a_subscribe_asks_for_is_allowed_but_must_be_the_newest() -> None:
    # Given two retained messages on one topic, the second replacing the first, then a
    # subscribe that gets the first as its retained copy
    run = clean_run()
    run.publish("r1", "state/1", retain=True)
    run.publish("r2", "state/1", retain=True)
    run.connect("carol", "c1")
    run.subscribe("carol", "state/#")
    run.consume("carol", "r1", sub="state/#", conn="c1", retain=True)

    # When the history is checked
    report = run.check()

    # Then the retained copy is stale (a retained copy as such starts nothing early)
    assert violations(report, "subscription_start") == []
    assert violations(report, "retained_current") == [
        "carol subscribed to state/# after r2 replaced r1 on state/1, and got r1"
    ]


def resubscribed_after_r2() -> Run:
    """carol subscribed to state/# while r1 was retained, unsubscribed, r2 replaced r1 and was
    answered, and carol subscribed again: neither subscribe's copy seen yet."""
    run = clean_run()
    run.publish("r1", "state/1", retain=True)
    run.connect("carol", "c1")
    run.subscribe("carol", "state/#")
    run.unsubscribe("carol", "state/#")
    run.publish("r2", "state/1", retain=True)
    run.subscribe("carol", "state/#")
    return run


def test_an_earlier_subscribes_retained_copy_arriving_after_a_resubscribe_is_allowed() -> None:
    # Given carol subscribed while r1 was retained (its copy not sent yet), unsubscribed, r2
    # replacing r1 and answered, and carol subscribing again: then both subscribes' copies
    # arrive, r1's first (MQTT 5 §3.10.4: what was queued may still be delivered)
    run = resubscribed_after_r2()
    run.consume("carol", "r1", sub="state/#", conn="c1", retain=True)
    run.consume("carol", "r2", sub="state/#", conn="c1", retain=True)

    # When the history is checked
    report = run.check()

    # Then r1 is the first subscribe's copy, current when it was made: no violation
    assert violations(report, "retained_current") == []


def test_copies_queued_behind_each_other_are_laid_to_their_own_subscribes() -> None:
    # Given three subscribes of carol, each made while the then retained message was current
    # (the second a subscribe again while subscribed, the third after an unsubscribe), and
    # each subscribe's copy arriving late, after the next subscribe was made (the server
    # behind, the copies waiting in carol's inbox): r2's after r3 replaced it
    run = clean_run()
    run.publish("r1", "state/1", retain=True)
    run.connect("carol", "c1")
    run.subscribe("carol", "state/#")
    run.publish("r2", "state/1", retain=True)
    run.subscribe("carol", "state/#")
    run.consume("carol", "r1", sub="state/#", conn="c1", retain=True)
    run.unsubscribe("carol", "state/#")
    run.publish("r3", "state/1", retain=True)
    run.subscribe("carol", "state/#")
    run.consume("carol", "r2", sub="state/#", conn="c1", retain=True)
    run.consume("carol", "r3", sub="state/#", conn="c1", retain=True)

    # When the history is checked
    report = run.check()

    # Then r2 is the second subscribe's copy, current when it was made: no violation
    assert violations(report, "retained_current") == []


def test_a_stale_copy_after_the_earlier_subscribes_own_came_is_caught() -> None:
    # Given carol's first subscribe's copy of r1 delivered, then r2 replacing r1, answered,
    # and a second subscribe that gets r1 again as its retained copy
    run = clean_run()
    run.publish("r1", "state/1", retain=True)
    run.connect("carol", "c1")
    run.subscribe("carol", "state/#")
    run.consume("carol", "r1", sub="state/#", conn="c1", retain=True)
    run.unsubscribe("carol", "state/#")
    run.publish("r2", "state/1", retain=True)
    run.subscribe("carol", "state/#")
    run.consume("carol", "r1", sub="state/#", conn="c1", retain=True)

    # When the history is checked
    report = run.check()

    # Then the second copy can only be the second subscribe's, and it is stale
    assert violations(report, "retained_current") == [
        "carol subscribed to state/# after r2 replaced r1 on state/1, and got r1"
    ]


def test_a_retained_copy_sent_again_unacked_after_a_new_subscribe_is_not_stale() -> None:
    # Given carol's subscribe's copy of r1, whose ack a kill lost; r2 replacing r1; carol
    # connecting again, unsubscribing and subscribing; and the unacked r1 sent again (dup)
    run = clean_run()
    run.publish("r1", "state/1", retain=True)
    run.connect("carol", "c1")
    run.subscribe("carol", "state/#")
    run.deliver("carol", "r1", sub="state/#", conn="c1", retain=True, delivery_id="d-7")
    run.publish("r2", "state/1", retain=True)
    run.connect("carol", "c2")
    run.unsubscribe("carol", "state/#")
    run.subscribe("carol", "state/#")
    run.consume("carol", "r1", sub="state/#", conn="c2", retain=True, delivery_id="d-7", dup=True)
    run.consume("carol", "r2", sub="state/#", conn="c2", retain=True)

    # When the history is checked
    report = run.check()

    # Then r1 is the first subscribe's copy sent again ([MQTT-4.4.0-1]): not stale
    assert violations(report, "retained_current") == []


def test_a_retained_copy_first_seen_sent_again_after_a_later_subscribes_copy_is_not_stale() -> None:
    # Given carol's subscribe's copy of r1 handed out unseen (a long poll's answer lost), an
    # unsubscribe, r2 replacing r1, a subscribe again whose copy of r2 comes first, and then
    # r1 sent again (dup) after the ack timeout
    run = resubscribed_after_r2()
    run.consume("carol", "r2", sub="state/#", conn="c1", retain=True, delivery_id="d-2")
    run.consume("carol", "r1", sub="state/#", conn="c1", retain=True, delivery_id="d-1", dup=True)

    # When the history is checked
    report = run.check()

    # Then r1 is the first subscribe's copy, current when it was made: not stale
    assert violations(report, "retained_current") == []


def test_a_resumed_session_that_comes_back_empty_is_caught() -> None:
    # Given alice reconnecting (not clean) soon after her last answer, told no session exists
    run = clean_run()
    run.connect("alice", "a3", present=False)

    # When the history is checked
    report = run.check()

    # Then her session was lost
    assert len(violations(report, "session_kept")) == 1


# -- wills ------------------------------------------------------------------------------------


def will_run(delay_s: float = 2.0, transport: str = "ws", keepalive_s: int = 0) -> Run:
    run = Run()
    run.connect("watcher", "w1")
    run.subscribe("watcher", "wills/#")
    will = {"wid": "w-9", "topic": "wills/dev", "delay_s": delay_s}
    run.connect("dev", "d9", will=will, transport=transport, keepalive_s=keepalive_s)
    return run


def see_will(run: Run, wid: str = "w-9", n: int = 1) -> None:
    run.consume("watcher", "", sub="wills/#", conn="w1", wid=wid, delivery_id=f"d-will-{n}")


def test_a_will_published_after_a_normal_disconnect_is_caught() -> None:
    # Given a connection ended with a normal DISCONNECT, whose will was published anyway
    run = will_run()
    run.rec("disconnect", phase="invoke", client="dev", conn="d9")
    run.tick()
    run.rec("disconnect", phase="ok", client="dev", conn="d9")
    run.tick(5)
    see_will(run)

    # When the history is checked
    report = run.check()

    # Then the will broke [MQTT-3.1.2-8]
    assert violations(report, "will") == [
        "dev's will w-9 was published though it ended with a normal DISCONNECT [MQTT-3.1.2-8]"
    ]


def test_a_will_missing_after_a_dropped_connection_is_caught() -> None:
    # Given a connection dropped without a DISCONNECT, no reconnect, and no will seen for long
    run = will_run()
    run.rec("lost", client="dev", conn="d9", how="dropped")
    run.tick(120)

    # When the history is checked
    report = run.check()

    # Then the will should have been published
    assert violations(report, "will") == [
        "dev's will w-9 was never published though it was dropped and no new connection came "
        "within its 2 s delay [MQTT-3.1.2-8]"
    ]


def test_a_will_published_though_the_client_came_back_within_the_delay_is_caught() -> None:
    # Given a dropped connection whose client connected again within the 10 s delay, and the
    # will published all the same
    run = will_run(delay_s=10)
    run.rec("lost", client="dev", conn="d9", how="dropped")
    run.tick(1)
    run.connect("dev", "d10")
    run.tick(15)
    see_will(run)

    # When the history is checked
    report = run.check()

    # Then the will broke [MQTT-3.1.3-9]
    assert violations(report, "will") == [
        "dev's will w-9 was published though a new connection came within its 10 s delay "
        "[MQTT-3.1.3-9]"
    ]


def test_a_will_published_before_its_delay_is_caught() -> None:
    # Given a dropped connection with a 10 s delay whose will came after 1 s
    run = will_run(delay_s=10)
    run.rec("lost", client="dev", conn="d9", how="dropped")
    run.tick(1)
    see_will(run)

    # When the history is checked
    report = run.check()

    # Then it came too early
    (found,) = violations(report, "will")
    assert "before its delay of 10 s ran out" in found


def test_a_will_published_twice_is_caught() -> None:
    # Given a dropped connection whose will reached the watcher under two message ids
    run = will_run()
    run.rec("lost", client="dev", conn="d9", how="dropped")
    run.tick(3)
    see_will(run, n=1)
    run.consume(
        "watcher",
        "",
        sub="wills/#",
        conn="w1",
        wid="w-9",
        delivery_id="d-will-2",
        message_id="m-other",
    )

    # When the history is checked
    report = run.check()

    # Then it was published twice
    assert violations(report, "will") == ["dev's will w-9 was published 2 times [MQTT-3.1.2-10]"]


def test_a_silent_http_channel_gets_its_will_after_its_keepalive() -> None:
    # Given an HTTP channel (keepalive 4 s, no delay) that stops calling and whose will comes
    # 7 s later
    run = will_run(delay_s=0, transport="http", keepalive_s=4)
    last = run.now
    run.rec("lost", client="dev", conn="d9", how="silent", last_invoke=last, last_answer=last)
    run.tick(7)
    see_will(run)

    # When the history is checked
    report = run.check()

    # Then all is as MQTT says
    assert report.ok, report.render()
    assert report.counts["wills_required"] == 1


def test_a_will_without_delay_may_go_when_a_new_connection_takes_the_channel_over() -> None:
    # Given an HTTP channel (keepalive 4 s, no delay) whose client is killed, started again and
    # connects 2 s later (before a keepalive ran out), and whose will comes right after
    run = will_run(delay_s=0, transport="http", keepalive_s=4)
    run.rec("fault", kind="client_kill", clients=["dev"])
    run.tick(2)
    run.connect("dev", "d10")
    run.tick(0.5)
    see_will(run)

    # When the history is checked
    report = run.check()

    # Then the takeover closed the old channel at once, and the will went then [MQTT-3.1.4-3]
    assert not violations(report, "will"), report.render()


def test_a_will_without_delay_before_any_close_or_takeover_is_caught() -> None:
    # Given the same killed HTTP channel whose will comes 2 s later, with no new connection
    run = will_run(delay_s=0, transport="http", keepalive_s=4)
    run.rec("fault", kind="client_kill", clients=["dev"])
    run.tick(2)
    see_will(run)

    # When the history is checked
    report = run.check()

    # Then it came before the server could call the channel closed
    (found,) = violations(report, "will")
    assert "before its delay of 0 s ran out" in found


def test_a_will_cut_by_a_server_kill_is_judged_only_on_at_most_once() -> None:
    # Given a dropped connection whose server was killed before it could see the close, and no
    # will ever seen
    run = will_run()
    run.rec("lost", client="dev", conn="d9", how="dropped")
    run.rec("fault", kind="server_kill")
    run.tick(30)
    run.rec("fault", kind="server_up")
    run.tick(120)

    # When the history is checked
    report = run.check()

    # Then MQTT lets a failed server publish it later or not: nothing to say
    assert report.ok, report.render()
    assert report.counts["wills_disturbed"] == 1


def test_a_will_due_before_a_kill_is_still_owed_after_the_restart() -> None:
    # Given a connection dropped, the server killed 10 s later (after it saw the close) and up
    # again 30 s after that, and no will seen for two minutes more
    run = will_run()
    run.rec("lost", client="dev", conn="d9", how="dropped")
    run.tick(10)
    run.rec("fault", kind="server_kill")
    run.tick(30)
    run.rec("fault", kind="server_up")
    run.tick(120)

    # When the history is checked
    report = run.check()

    # Then the will was owed all the same: a failed server may defer it, not drop it
    assert len(violations(report, "will")) == 1
    assert report.counts["wills_required"] == 1


# -- push subscriptions -----------------------------------------------------------------------


def test_a_push_message_neither_delivered_nor_dead_lettered_is_caught() -> None:
    # Given a message to the push subscription's filter that its endpoint never took and its
    # DLQ does not hold
    run = clean_run()
    run.publish("h3", "hooks/3", key="pk3")

    # When the history is checked
    report = run.check()

    # Then DLQ + delivered != published
    assert violations(report, "push") == [
        "h3 (hooks/3) was neither delivered to hooks's endpoint nor dead-lettered"
    ]


def test_a_push_message_both_delivered_and_dead_lettered_is_caught() -> None:
    # Given the final DLQ also holding h1, which the endpoint took
    run = clean_run()
    final = run.history.records[-1]
    final["dlq"].append({"message_id": "m-h1", "mk": "h1", "reason": "http_503", "attempts": 5})

    # When the history is checked
    report = run.check()

    # Then it is in both
    assert "h1 was both delivered to hooks's endpoint and dead-lettered" in violations(
        report, "push"
    )


def test_push_deliveries_of_a_key_out_of_publish_order_are_caught() -> None:
    # Given two messages of one key reaching the endpoint in the reverse of publish order
    run = clean_run()
    run.publish("h5", "hooks/5", key="pk5")
    run.publish("h6", "hooks/6", key="pk5")
    run.rec("push_hit", name="hooks", mk="h6", attempt=1, key="pk5", status=200, fate="ok")
    run.rec("push_hit", name="hooks", mk="h5", attempt=1, key="pk5", status=200, fate="ok")

    # When the history is checked
    report = run.check()

    # Then push order is broken
    assert violations(report, "push") == [
        "hooks's endpoint got h6 before h5, published before it (key pk5)"
    ]


# -- reading --------------------------------------------------------------------------------------


def test_a_history_folder_is_read_whole_and_a_torn_last_line_is_skipped(tmp_path: Path) -> None:
    # Given a clean history split over two writers' files, one ending in a torn line
    run = clean_run()
    records = run.history.records
    half = len(records) // 2
    for n, part in enumerate((records[:half], records[half:])):
        path = history_file(tmp_path, f"worker-{n}", 0)
        path.write_text("".join(json.dumps(r) + "\n" for r in part))
    with history_file(tmp_path, "worker-1", 0).open("a") as handle:
        handle.write('{"t": 1, "op": "deli')

    # When the folder is read and checked
    read, torn = read_history(tmp_path)
    report = check_path(tmp_path)

    # Then every whole record is there, the torn one counted, and the verdict is the same
    assert len(read) == len(records) and torn == 1
    assert report.ok, report.render()
    assert any("torn" in note for note in report.notes)


def test_the_history_writer_appends_lines_a_reader_takes_back(tmp_path: Path) -> None:
    # Given a history file written by two lives of one writer
    for life in (0, 1):
        history = History(history_file(tmp_path, "w", life), writer="w", life=life)
        history.record("fault", kind="client_restart", t=T0 + life)
        history.close()

    # When it is read
    read, torn = read_history(tmp_path)

    # Then both records come back in time order with their writer's life
    assert [(r["life"], r["kind"]) for r in read] == [(0, "client_restart"), (1, "client_restart")]
    assert torn == 0


@pytest.mark.parametrize(
    ("topic_filter", "topic", "expected"),
    [
        ("soak/#", "soak/a/b", True),
        ("soak/#", "soak", True),
        ("soak/+/x", "soak/a/x", True),
        ("soak/+/x", "soak/a/y", False),
        ("$share/g/jobs/#", "jobs/1", True),
        ("#", "$SYS/x", False),
        ("+/x", "$SYS/x", False),
        ("a/b", "a/b/c", False),
    ],
)
def test_the_checkers_own_matcher_follows_mqtt(
    topic_filter: str, topic: str, expected: bool
) -> None:
    # Given a filter and a topic / When matched / Then as MQTT 5 §4.7 says
    assert matches(topic_filter, topic) is expected


def slow_http_connect(answered_after_s: float, will_after_s: float) -> Report:
    """``dev`` connects over HTTP (keepalive 4 s, will w-9 without delay), its answer
    ``answered_after_s`` after it sent it (retried meanwhile), then disconnects normally; the
    will is published ``will_after_s`` after the connect was sent. The history checked."""
    run = Run()
    start = run.now
    run.connect("watcher", "w1")
    run.subscribe("watcher", "wills/#")
    will = {"wid": "w-9", "topic": "wills/dev", "delay_s": 0}
    common = {"client": "dev", "conn": "d9", "transport": "http"}
    run.rec(
        "connect",
        phase="invoke",
        clean_start=False,
        session_expiry_s=3600,
        keepalive_s=4,
        will=will,
        **common,
    )
    run.tick(answered_after_s)
    run.rec("connect", phase="ok", channel="ch-d9", session_present=True, **common)
    run.tick(2)
    run.rec("disconnect", phase="invoke", client="dev", conn="d9")
    run.tick()
    run.rec("disconnect", phase="ok", client="dev", conn="d9")
    published_at = int((start + will_after_s) * 1000)
    run.consume(
        "watcher",
        "",
        sub="wills/#",
        conn="w1",
        wid="w-9",
        delivery_id="d-1",
        published_at=published_at,
    )
    return run.check()


NORMAL_DISCONNECT = (
    "dev's will w-9 was published though it ended with a normal DISCONNECT [MQTT-3.1.2-8]"
)


def test_a_will_of_a_channel_an_unanswered_connect_try_registered_is_allowed() -> None:
    # Given an HTTP connect answered 20 s after it was sent (an earlier try may have registered
    # a channel whose answer was lost, silent from then on), ended with a normal DISCONNECT,
    # and its will published 12 s after the connect was sent: when the history is checked
    report = slow_http_connect(answered_after_s=20, will_after_s=12)

    # Then the will is that unseen channel's, lost after its keepalive: allowed, and counted
    assert report.ok, report.render()
    assert report.counts["wills_of_unseen_channels"] == 1


def test_a_will_sooner_than_any_unseen_channel_could_lose_it_is_still_caught() -> None:
    # Given the same slow connect, its will published 2 s after the connect was sent (no
    # channel can have gone silent for its keepalive by then): it broke [MQTT-3.1.2-8]
    report = slow_http_connect(answered_after_s=20, will_after_s=2)
    assert violations(report, "will") == [NORMAL_DISCONNECT]


def test_a_connect_answered_in_time_has_no_unseen_channel() -> None:
    # Given an HTTP connect answered within its keepalive, a normal DISCONNECT, and a will
    report = slow_http_connect(answered_after_s=1, will_after_s=12)
    # Then it broke [MQTT-3.1.2-8]
    assert violations(report, "will") == [NORMAL_DISCONNECT]
