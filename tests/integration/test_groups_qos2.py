"""QoS 2 in a shared group stays with the member it was handed to ([MQTT-4.8.2-4/5]).

A member that got a QoS 2 message and dies without acking: the message is not handed to another
member, ever; it is delivered again to the same session (``dup``) when it reconnects, even when
its lane moved meanwhile; if that session ends first, the message is dropped for the group with
the reason ``session_ended``. QoS 1 keeps today's rule: it moves to a live member.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from shoal import wiring
from shoal.core.config import get_config

from tests.integration.test_events_recording import events, recording_of
from tests.integration.test_groups_support import LEASE_S, GroupWorld

GROUP = "$share/w/jobs/#"


@pytest.fixture
def gworld(aws: boto3.Session, monkeypatch: pytest.MonkeyPatch) -> Iterator[GroupWorld]:
    w = GroupWorld(aws, monkeypatch)
    w.topic("default", 1)
    w.groups.events = recording_of(aws, w.clock)
    yield w


def members(w: GroupWorld) -> dict[str, str]:
    channels = {}
    for client in ("alice-a", "alice-b"):
        channels[client] = w.connect(client, clean_start=False, session_expiry_s=3600)
        w.subscribe(client, channels[client], {"filter": GROUP, "qos": 2})
    for client, channel in channels.items():
        w.heartbeat(client, channel)
    return channels


def handed(w: GroupWorld, qos: int) -> tuple[dict[str, str], str, str, dict[str, Any]]:
    """Two members and one message of ``qos`` handed to one of them: (channels, the holder,
    the other, the delivery)."""
    channels = members(w)
    w.publish("jobs/1", "job", qos=qos)
    w.route()
    got = {c: w.get(c, ch) for c, ch in channels.items()}
    [holder] = [c for c, m in got.items() if m]
    [other] = [c for c in channels if c != holder]
    [delivery] = got[holder]
    assert not delivery["dup"] and delivery["qos"] == qos
    return channels, holder, other, delivery


def outlive_the_holder(w: GroupWorld, other: str, channel: str) -> list[Any]:
    """The holder is dead (no call); the other member heartbeats and gets for the lease
    timeout plus 10 s: what it got."""
    got: list[Any] = []
    for _ in range(int((LEASE_S + 10) / 2)):
        w.clock.advance(2)
        w.heartbeat(other, channel)
        got += w.get(other, channel)
    return got


def test_a_killed_members_qos2_message_reaches_no_other_member(gworld: GroupWorld) -> None:
    w = gworld
    # Given a QoS 2 message handed to one member, which then dies without acking
    channels, holder, other, delivery = handed(w, 2)
    # When the other member lives on past the lease timeout plus 10 s, holding the lane
    got = outlive_the_holder(w, other, channels[other])
    loaded = w.group("w", "jobs/#")
    # Then it got nothing, although it holds the stream by now
    assert got == []
    assert loaded is not None
    assert {x.holder for x in loaded.state.streams.values()} == {w.session_id(other)}
    # When the dead member reconnects (same session) and gets
    channel = w.connect(holder, clean_start=False, session_expiry_s=3600)
    again = w.get(holder, channel)
    # Then the message comes again to it, dup, under the id it had
    assert [(m["id"], m["message_id"], m["dup"]) for m in again] == [
        (delivery["id"], delivery["message_id"], True)
    ]
    # and its ack completes it: nobody gets it again
    status, answer = w.ack(holder, channel, [delivery["id"]])
    assert status == 200 and answer["acked"] == 1, answer
    w.clock.advance(40)
    w.heartbeat(other, channels[other])
    w.heartbeat(holder, channel)
    assert w.get(holder, channel) == [] and w.get(other, channels[other]) == []
    acked = [e for e in events(w.session) if e["event"] == "acked"]
    assert [e["delivery_id"] for e in acked] == [delivery["id"]]


def test_a_qos2_message_of_an_ended_session_is_dropped_with_its_reason(gworld: GroupWorld) -> None:
    w = gworld
    # Given a QoS 2 message handed to a member that died, its lane taken by the other member
    channels, holder, other, delivery = handed(w, 2)
    session = w.session_id(holder)
    assert outlive_the_holder(w, other, channels[other]) == []
    # When the dead member's session ends (a clean start discards it)
    fresh = w.connect(holder, clean_start=True)
    # Then the message is dropped for the group with its reason, and goes to no one
    w.clock.advance(40)
    w.heartbeat(other, channels[other])
    assert w.get(other, channels[other]) == [] and w.get(holder, fresh) == []
    group = [e for e in events(w.session) if e["consumer_kind"] == "group"]
    dropped = [e for e in group if e["event"] == "dropped"]
    assert [(e["message_id"], e["reason"]) for e in dropped] == [
        (delivery["message_id"], "session_ended")
    ]
    # and it was only ever handed to the member it was pinned to
    delivered = [e for e in group if e["event"] in ("delivered", "redelivered")]
    assert {e.get("label") for e in delivered} == {session}


def test_a_qos2_message_pinned_on_the_stream_is_dropped_when_its_session_ends_first(
    gworld: GroupWorld,
) -> None:
    w = gworld
    # Given a QoS 2 message handed to a member that dies, its session ending before anyone
    # served the lane again
    channels, holder, other, delivery = handed(w, 2)
    w.clock.advance(LEASE_S + 1)
    w.connect(holder, clean_start=True)
    # When the other member takes the lane and gets
    w.heartbeat(other, channels[other])
    got = w.get(other, channels[other])
    # Then it does not get the message; it is dropped with its reason
    assert got == []
    dropped = [e for e in events(w.session) if e["event"] == "dropped"]
    assert [(e["message_id"], e["reason"]) for e in dropped] == [
        (delivery["message_id"], "session_ended")
    ]


def test_qos1_still_moves_to_a_live_member(gworld: GroupWorld) -> None:
    w = gworld
    channels, _holder, other, delivery = handed(w, 1)
    got = outlive_the_holder(w, other, channels[other])
    assert [(m["message_id"], m["dup"]) for m in got] == [(delivery["message_id"], True)]


def test_an_unsubscribe_wired_as_deployed_records_the_qos2_deliveries_it_drops(
    gworld: GroupWorld,
) -> None:
    """The soak's lost QoS 2 message: its member unsubscribed while the message was held for it
    and the subscriptions function, whose groups service recorded nothing, dropped it without
    a ``dropped`` event, so the audit could only count it lost."""
    w = gworld
    # Given a QoS 2 message held for a member that died, its lane taken by the other member
    channels, holder, other, delivery = handed(w, 2)
    assert outlive_the_holder(w, other, channels[other]) == []
    # and the subscriptions function's groups service built as its wiring builds it
    w.subscriptions.groups = wiring.group_service(get_config(), w.clock, payloads=False)
    # When the member comes back and unsubscribes before it gets the message again
    channel = w.connect(holder, clean_start=False, session_expiry_s=3600)
    status, answer = w.unsubscribe(holder, channel, GROUP)
    assert status == 200, answer
    # Then the message is dropped with its reason, an event the audit reads
    dropped = [e for e in events(w.session) if e["event"] == "dropped"]
    assert [(e["message_id"], e["reason"], e["label"]) for e in dropped] == [
        (delivery["message_id"], "session_ended", w.session_id(holder))
    ]
    # and nobody gets it
    w.clock.advance(40)
    w.heartbeat(other, channels[other])
    assert w.get(other, channels[other]) == []


def test_a_held_qos2_message_acked_during_a_get_that_resends_it_is_not_held_again(
    gworld: GroupWorld, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A get reads the member's held deliveries, then writes when and where each went again;
    the member's ack of one of them (a call running at once) deletes it in between. A blind
    write of the read record put it back: the acked message came again after the ack
    timeout, and again on every reconnect, until acked once more."""
    w = gworld
    # Given a QoS 2 message held for a member that died, its lane taken by the other member
    channels, holder, other, delivery = handed(w, 2)
    assert outlive_the_holder(w, other, channels[other]) == []
    channel = w.connect(holder, clean_start=False, session_expiry_s=3600)
    acks: list[Any] = []
    store = w.group_store
    mark = store.mark_held_sent

    def acked_meanwhile(*args: Any) -> Any:
        # the member's ack runs between the get's read of its held deliveries and its write
        if not acks:
            acks.append(w.ack(holder, channel, [delivery["id"]]))
        return mark(*args)

    monkeypatch.setattr(store, "mark_held_sent", acked_meanwhile)
    # When the member gets the held message again while its ack of it runs
    again = w.get(holder, channel)
    assert [m["id"] for m in again] in ([delivery["id"]], [])
    [(status, answer)] = acks
    assert status == 200 and answer["acked"] == 1, answer
    # Then the acked message is held no more: nobody gets it again
    w.clock.advance(40)
    w.heartbeat(other, channels[other])
    w.heartbeat(holder, channel)
    assert w.get(holder, channel) == []
    assert w.get(other, channels[other]) == []
    later = w.connect(holder, clean_start=False, session_expiry_s=3600)
    assert w.get(holder, later) == []


def test_a_qos2_message_unpinned_as_its_member_leaves_is_dropped_not_held(
    gworld: GroupWorld, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A get read the group while the QoS 2 message's member was in it, and took the message
    off the stream to hold it for that member; the member's session ended before the get's
    write, so its leave found nothing held to drop. The write then held the message for a
    member gone for good: never sent, never dropped, and the audit counted it lost."""
    w = gworld
    # Given a QoS 2 message handed to a member that died, its lease expired and its lane
    # taken by the other member
    channels, holder, other, delivery = handed(w, 2)
    session = w.session_id(holder)
    w.clock.advance(LEASE_S + 1)
    w.heartbeat(other, channels[other])
    store = w.group_store
    save = store.save_progress_holding
    ended: list[str] = []

    def ended_meanwhile(key: str, progress: Any, expected: int, member: str, held: Any) -> Any:
        # the dead member's session ends between the get's read of the group and its write
        if held and not ended:
            ended.append(w.connect(holder, clean_start=True))
        return save(key, progress, expected, member, held)

    monkeypatch.setattr(store, "save_progress_holding", ended_meanwhile)
    # When the other member gets, its serve taking the message off the stream
    assert w.get(other, channels[other]) == []
    assert ended
    # Then the message is dropped for the ended session with its reason
    dropped = [e for e in events(w.session) if e["event"] == "dropped"]
    assert [(e["message_id"], e["reason"], e["label"]) for e in dropped] == [
        (delivery["message_id"], "session_ended", session)
    ]
    # and held for no one
    loaded = w.group("w", "jobs/#")
    assert loaded is not None and loaded.held == {}
    assert store.held(loaded.key, session) == []


def test_a_full_window_of_qos2_messages_is_held_for_its_dead_member_within_a_transaction(
    gworld: GroupWorld,
) -> None:
    """A member dies with a full page of QoS 2 deliveries in flight on one lane (100, the most
    a get hands out). The member that takes the lane holds them for it: one held item each,
    written with the stream's progress in one transaction, which DynamoDB caps at 100 parts.
    Before, all 100 went in one (102 parts with the progress and the members' check): every
    get of the lane failed, so its messages stopped for every member."""
    w = gworld
    channels = members(w)
    for n in range(100):
        w.publish("jobs/1", f"job-{n}", qos=2, ordering_key="k")
    w.route()
    got = {c: w.get(c, ch, max_messages=100) for c, ch in channels.items()}
    [holder] = [c for c, m in got.items() if m]
    [other] = [c for c in channels if c != holder]
    assert len(got[holder]) == 100
    # When the holder dies and the other member, getting pages of 100, takes the lane; then a
    # later message on it
    got_other: list[dict[str, Any]] = []
    for round in range(2):
        for _ in range(int((LEASE_S + 10) / 2)):
            w.clock.advance(2)
            w.heartbeat(other, channels[other])
            got_other += w.get(other, channels[other], max_messages=100)
        if round == 0:
            w.publish("jobs/1", "later", qos=2, ordering_key="k")
            w.route()
    # Then the other member gets the later message, none of the dead member's
    assert [base64.b64decode(m["payload"]) for m in got_other] == [b"later"]
    # and the dead member, back, gets each of its 100 again, once, with dup
    channel = w.connect(holder, clean_start=False, session_expiry_s=3600)
    again: list[dict[str, Any]] = []
    for _ in range(5):
        again += w.get(holder, channel, max_messages=100)
    assert sorted(m["id"] for m in again) == sorted(m["id"] for m in got[holder])
    assert all(m["dup"] for m in again)


def test_held_qos2_messages_a_leave_failed_to_drop_are_dropped_by_the_next_get(
    gworld: GroupWorld, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The leave commits, then its drop of the leaver's held deliveries fails (or its function
    dies there): nothing would ever send or drop them, and the audit counted them lost. The
    next get of any member, whose read of the group counts them, drops them with the reason."""
    w = gworld
    # Given a QoS 2 message held for a member that died, its lane taken by the other member
    channels, holder, other, delivery = handed(w, 2)
    assert outlive_the_holder(w, other, channels[other]) == []
    # When the member comes back and unsubscribes, and the drop after the commit fails
    channel = w.connect(holder, clean_start=False, session_expiry_s=3600)

    drop = w.groups.drop_held
    failed: list[str] = []

    def fails_once(key: str, member_id: str) -> int:
        if not failed:
            failed.append(member_id)
            raise RuntimeError("killed after the leave's commit")
        return drop(key, member_id)

    monkeypatch.setattr(w.groups, "drop_held", fails_once)
    status, answer = w.unsubscribe(holder, channel, GROUP)
    assert status == 200, answer
    assert failed == [w.session_id(holder)]
    assert [e for e in events(w.session) if e["event"] == "dropped"] == []
    # Then the other member's next get drops it, with its reason, once
    w.heartbeat(other, channels[other])
    assert w.get(other, channels[other]) == []
    assert w.get(other, channels[other]) == []
    dropped = [e for e in events(w.session) if e["event"] == "dropped"]
    assert [(e["message_id"], e["reason"], e["label"]) for e in dropped] == [
        (delivery["message_id"], "session_ended", w.session_id(holder))
    ]
