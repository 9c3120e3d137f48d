"""The groups table over moto: the leader's conditional writes, fenced progress, get and ack.

These drive ``GroupStore`` and ``GroupService`` directly, writing group streams the way the
router does (``shoal.delivery.pack`` into the group's partition); the handler-level tests are
in ``test_groups_api.py`` and ``test_groups_model.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import boto3
import pytest
from shoal.aws.dynamo import Dynamo
from shoal.core.clock import ManualClock
from shoal.core.config import DeliverySettings, GroupSettings, get_config
from shoal.delivery.inbox import InboxMessage, InboxStore, pack
from shoal.delivery.model import position, record_end
from shoal.groups.records import GroupRef, group_key, member_record
from shoal.groups.service import GroupService
from shoal.groups.state import AgentState, AgentView, advance
from shoal.groups.store import GroupStore
from shoal.groups.streams import StreamReader, StreamState, group_partition, parse_delivery_id
from shoal.sessions.ports import KeptBy

LEASE_S = 10.0
FILTER = "$share/g/orders/#"
OPTIONS = {"qos": 1, "share": "g"}


@dataclass
class Groups:
    clock: ManualClock
    store: GroupStore
    service: GroupService
    inbox: InboxStore
    seq: int = 0

    @property
    def key(self) -> str:
        return group_key("g", "orders/#")

    def join(self, member: str) -> str:
        plan = self.service.membership(f"client-{member}", member, joins=[FILTER])
        assert self.store.dynamo.transact(plan.parts) is None
        return plan.incarnations[FILTER]

    def leave(self, member: str) -> list[tuple[str, str]]:
        plan = self.service.membership(f"client-{member}", member, leaves={FILTER: OPTIONS})
        assert self.store.dynamo.transact(plan.parts) is None
        self.service.after(plan)
        return plan.removed

    def publish(self, incarnation: str, source: str, count: int, qos: int = 1) -> list[str]:
        """Write ``count`` messages into one group stream as the router does; their ids."""
        self.seq += 1
        messages = [
            InboxMessage(
                position=position(self.seq, n),
                message_id=f"msg-{self.seq}-{n}",
                topic="orders/1",
                payload=b"x",
                qos=qos,
                subscription=FILTER,
                sid=incarnation,
                published_at_ms=self.clock.now_ms(),
            )
            for n in range(count)
        ]
        partition = group_partition(incarnation)
        self.inbox.put(pack(partition, source, messages, record_end(self.seq), 2_000_000_000))
        self.store.ensure_stream(self.key, incarnation, source)
        return [m.message_id for m in messages]

    def subs(self, incarnation: str | None = None) -> dict[str, Any]:
        return {FILTER: {**OPTIONS, **({"group": incarnation} if incarnation else {})}}


@pytest.fixture
def groups(aws: boto3.Session) -> Groups:
    config = get_config()
    clock = ManualClock()
    dynamo = Dynamo(aws.client("dynamodb"))
    store = GroupStore(
        dynamo,
        config.table("groups"),
        config.table("inboxes"),
        settings=GroupSettings(lease_timeout_s=LEASE_S, lanes=1),
        clock=clock,
    )
    service = GroupService(
        store,
        StreamReader(dynamo, config.table("inboxes")),
        DeliverySettings(ack_timeout_s=30, window=100),
        clock=clock,
    )
    return Groups(clock, store, service, InboxStore(dynamo, config.table("inboxes")))


def source_of(delivery_id: str) -> str:
    parsed = parse_delivery_id(delivery_id)
    assert parsed is not None
    return parsed.source


def test_the_first_join_creates_the_group_and_later_joins_add_members(groups: Groups) -> None:
    # Given no group
    # When two members join
    first = groups.join("a")
    second = groups.join("b")
    # Then one group (one incarnation) holds both, live
    loaded = groups.store.load(groups.key)
    assert loaded is not None and first == second == loaded.state.incarnation
    assert sorted(loaded.state.members) == ["a", "b"]
    assert loaded.state.members["a"].alive(groups.clock.now_ms(), int(LEASE_S * 1000))


def test_a_stream_the_router_writes_to_is_granted_and_fenced(groups: Groups) -> None:
    # Given a member and a stream the router wrote to
    inc = groups.join("a")
    groups.publish(inc, "src1", 3)
    # When the leader advances
    loaded = groups.store.advance(groups.key, groups.clock.now_ms())
    # Then the stream is granted to the member, and its progress item carries the same fence
    assert loaded is not None
    assert (loaded.state.streams["src1"].holder, loaded.state.streams["src1"].lease) == ("a", 1)
    progress = groups.store.progress(groups.key, "src1")
    assert progress is not None
    assert (progress.holder, progress.lease, progress.state) == ("a", 1, StreamState.GRANTED)


def test_a_transition_over_a_stale_version_loses_and_changes_nothing(groups: Groups) -> None:
    # Given two invocations that read the same version
    inc = groups.join("a")
    groups.publish(inc, "src1", 1)
    first = groups.store.load(groups.key)
    second = groups.store.load(groups.key)
    assert first is not None and second is not None
    now = groups.clock.now_ms()
    # When both write their transition
    won = groups.store.commit(first, advance(first.state, now, int(LEASE_S * 1000)))
    lost = groups.store.commit(second, advance(second.state, now, int(LEASE_S * 1000)))
    # Then only the first lands; the leader's version moved once
    assert (won, lost) == (True, False)
    after = groups.store.load(groups.key)
    assert after is not None and after.state.version == first.state.version + 1
    assert groups.store.stats.as_dict()["conflicts"] == {"advance": 1}


def test_get_hands_out_in_order_and_ack_commits_under_the_lease(groups: Groups) -> None:
    # Given a member holding a stream with five messages
    inc = groups.join("a")
    ids = groups.publish(inc, "src1", 5)
    # When it gets three, then the rest
    first = groups.service.get("a", groups.subs(inc), 3)
    second = groups.service.get("a", groups.subs(inc), 10)
    # Then they come in publish order, once each
    assert [m["message_id"] for m in first + second] == ids
    assert all(not m["dup"] for m in first + second)
    # When it acks them all
    acked = groups.service.ack("a", groups.subs(inc), [m["id"] for m in first + second])
    # Then all five count, and acking again counts nothing
    assert acked == 5
    assert groups.service.ack("a", groups.subs(inc), [m["id"] for m in first]) == 0
    progress = groups.store.progress(groups.key, "src1")
    assert progress is not None and progress.in_flight() == 0


def test_a_dead_members_unacked_messages_go_to_the_next_holder_after_the_lease_timeout(
    groups: Groups,
) -> None:
    # Given member a holding the stream with three messages out, one acked
    inc = groups.join("a")
    ids = groups.publish(inc, "src1", 3)
    got = groups.service.get("a", groups.subs(inc), 10)
    assert groups.service.ack("a", groups.subs(inc), [got[0]["id"]]) == 1
    groups.join("b")
    # When a stops renewing and b keeps heartbeating past the lease timeout
    groups.clock.advance(LEASE_S / 2)
    groups.service.heartbeat("b", groups.subs(inc))
    assert groups.service.get("b", groups.subs(inc), 10) == []  # a's lease still holds
    groups.clock.advance(LEASE_S / 2)
    changes = groups.service.heartbeat("b", groups.subs(inc))
    # Then b is granted the stream under a new lease, and gets a's two unacked messages, dup
    assert [(c["stream"], c["lease"], c["state"]) for c in changes] == [("src1", 2, "granted")]
    again = groups.service.get("b", groups.subs(inc), 10)
    assert [m["message_id"] for m in again] == ids[1:]
    assert all(m["dup"] for m in again)
    # and a's late ack of them is fenced off, while b's counts
    assert groups.service.ack("a", groups.subs(inc), [m["id"] for m in got[1:]]) == 0
    assert groups.service.ack("b", groups.subs(inc), [m["id"] for m in again]) == 2


def test_a_join_hands_a_stream_over_only_after_the_holders_final_ack(groups: Groups) -> None:
    # Given a holding two streams, with a message of src2 in flight
    inc = groups.join("a")
    groups.publish(inc, "src1", 1)
    groups.publish(inc, "src2", 1)
    got = groups.service.get("a", groups.subs(inc), 10)
    src1 = [m for m in got if source_of(m["id"]) == "src1"]
    src2 = [m for m in got if source_of(m["id"]) == "src2"]
    assert groups.service.ack("a", groups.subs(inc), [m["id"] for m in src1]) == 1
    # When b joins and the leader advances
    groups.join("b")
    groups.service.heartbeat("b", groups.subs(inc))
    loaded = groups.store.load(groups.key)
    assert loaded is not None
    # Then src2 (the highest source) is revoking from a, not yet b's; more of it is not sent to a
    assert (loaded.state.streams["src2"].holder, loaded.state.streams["src2"].state) == (
        "a",
        StreamState.REVOKING,
    )
    groups.publish(inc, "src2", 1)
    assert groups.service.get("a", groups.subs(inc), 10) == []
    # When a acks its last src2 message (its final progress)
    assert groups.service.ack("a", groups.subs(inc), [m["id"] for m in src2]) == 1
    # Then b holds src2 and gets only the new message
    changes = groups.service.heartbeat("b", groups.subs(inc))
    assert [(c["stream"], c["state"]) for c in changes] == [("src2", "granted")]
    fresh = groups.service.get("b", groups.subs(inc), 10)
    assert len(fresh) == 1 and not fresh[0]["dup"]


def test_a_stale_holder_cannot_write_progress(groups: Groups) -> None:
    # Given a's progress read under lease 1, then the stream taken from a (a left and came back)
    inc = groups.join("a")
    groups.publish(inc, "src1", 1)
    groups.store.advance(groups.key, groups.clock.now_ms())
    stale = groups.store.progress(groups.key, "src1")
    assert stale is not None
    groups.join("b")
    groups.leave("a")
    groups.store.advance(groups.key, groups.clock.now_ms())
    # When a writes progress under its old lease
    stale.next += 1
    # Then the write is refused
    assert not groups.store.save_progress(groups.key, stale, stale.pv, "a")
    progress = groups.store.progress(groups.key, "src1")
    assert progress is not None and (progress.holder, progress.lease) == ("b", 2)


def test_qos0_messages_are_not_redelivered(groups: Groups) -> None:
    # Given a holder that got two QoS 0 messages and then died
    inc = groups.join("a")
    groups.publish(inc, "src1", 2, qos=0)
    assert len(groups.service.get("a", groups.subs(inc), 10)) == 2
    groups.join("b")
    # When its lease expires and b takes the stream
    groups.clock.advance(LEASE_S)
    groups.service.heartbeat("b", groups.subs(inc))
    # Then b gets nothing again
    assert groups.service.get("b", groups.subs(inc), 10) == []


def test_the_last_leave_removes_the_group_with_its_backlog(groups: Groups) -> None:
    # Given a group with a backlog and two members
    inc = groups.join("a")
    groups.join("b")
    groups.publish(inc, "src1", 5)
    groups.store.advance(groups.key, groups.clock.now_ms())
    # When one leaves, the group stays; when the last leaves, it goes
    assert groups.leave("a") == []
    assert groups.store.load(groups.key) is not None
    assert groups.leave("b") == [(groups.key, inc)]
    # Then nothing of it is left: no leader, members, streams or backlog
    assert groups.store.load(groups.key) is None
    rows = groups.store.dynamo.query(
        groups.store.table,
        KeyConditionExpression="#g = :g",
        ExpressionAttributeNames={"#g": "group"},
        ExpressionAttributeValues={":g": {"S": groups.key}},
    )
    assert rows == []
    backlog = groups.store.dynamo.query(
        groups.inbox.table,
        KeyConditionExpression="#p = :p",
        ExpressionAttributeNames={"#p": "inbox"},
        ExpressionAttributeValues={":p": {"S": group_partition(inc)}},
    )
    assert backlog == []
    # and a new first member starts a new incarnation
    assert groups.join("c") != inc


def test_a_removed_incarnations_subscription_reaches_nothing(groups: Groups) -> None:
    # Given a session whose subscription names an incarnation that was removed
    old = groups.join("a")
    groups.leave("a")
    new = groups.join("b")
    groups.publish(new, "src1", 1)
    # When the stale session gets
    # Then it gets nothing from the new incarnation
    assert groups.service.get("a", groups.subs(old), 10) == []
    assert old != new


def test_membership_reads_one_group_ref_per_shared_subscription() -> None:
    # Given a session's subscriptions, shared and not
    subs = {
        "$share/g/orders/#": {"qos": 1, "share": "g", "group": "i1"},
        "orders/#": {"qos": 1},
    }
    from shoal.groups.records import group_refs

    # Then only the shared one is a group, with its incarnation
    assert group_refs(subs) == [GroupRef("$share/g/orders/#", "g", "orders/#", 1, "i1")]


def _live(groups: Groups, member: str) -> bool:
    loaded = groups.store.load(groups.key)
    assert loaded is not None
    return loaded.state.members[member].alive(groups.clock.now_ms(), int(LEASE_S * 1000))


def test_a_keep_outlasts_the_lease_and_a_heartbeat_leaves_it(groups: Groups) -> None:
    # Given a member kept live by its connection for an hour
    incarnation = groups.join("a")
    groups.join("b")
    by = KeptBy("conn-1", "chan-1", groups.clock.now_ms() + 3_600_000)
    assert groups.service.keep("a", groups.subs(incarnation), by) == 1
    # When many lease timeouts pass, and its session heartbeats once over HTTP meanwhile
    groups.clock.advance(3 * LEASE_S)
    groups.service.heartbeat("a", groups.subs(incarnation))
    groups.clock.advance(3 * LEASE_S)
    # Then it is live still (the heartbeat's renewal left the keep on its item)
    assert _live(groups, "a") and not _live(groups, "b")
    # When another connection's end comes: not the one keeping it, so nothing changes
    groups.service.connection_ended("a", groups.subs(incarnation), "conn-0")
    assert _live(groups, "a")
    # When its own connection ends: not live from now, though its lease has not run out
    groups.service.heartbeat("a", groups.subs(incarnation))
    groups.service.connection_ended("a", groups.subs(incarnation), "conn-1")
    assert not _live(groups, "a")


def test_a_keep_of_a_past_membership_counts_not_for_a_new_one(groups: Groups) -> None:
    # Given a member kept by its connection, which leaves the group (it stays connected)
    incarnation = groups.join("a")
    groups.join("b")
    by = KeptBy("conn-1", "chan-1", groups.clock.now_ms() + 3_600_000)
    groups.service.keep("a", groups.subs(incarnation), by)
    groups.leave("a")
    # When it joins again later over HTTP, and its lease runs out
    groups.clock.advance(1)
    groups.join("a")
    groups.clock.advance(LEASE_S + 1)
    # Then the keep written for its earlier membership does not keep it live
    assert not _live(groups, "a")


def _holders(groups: Groups) -> dict[str, str]:
    """The streams' holders after an advance (a stream nobody holds is left out)."""
    loaded = groups.store.advance(groups.key, groups.clock.now_ms())
    assert loaded is not None
    streams = sorted(loaded.state.streams.items())
    return {s: x.holder for s, x in streams if x.held and x.holder is not None}


def test_a_connections_end_between_a_heartbeats_read_and_write_stays_a_release(
    groups: Groups, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a and b holding a stream each, a kept live by its connection for an hour
    incarnation = groups.join("a")
    groups.join("b")
    by = KeptBy("conn-1", "chan-1", groups.clock.now_ms() + 3_600_000)
    assert groups.service.keep("a", groups.subs(incarnation), by) == 1
    groups.publish(incarnation, "src1", 1)
    groups.publish(incarnation, "src2", 1)
    assert sorted(_holders(groups).values()) == ["a", "b"]
    # When a's connection ends after a heartbeat of its session read the group, before the
    # heartbeat writes the member's renewal
    write = groups.store.renew_members

    def ended_meanwhile(*args: Any, **kwargs: Any) -> None:
        groups.service.connection_ended("a", groups.subs(incarnation), "conn-1")
        write(*args, **kwargs)

    monkeypatch.setattr(groups.store, "renew_members", ended_meanwhile)
    groups.service.heartbeat("a", groups.subs(incarnation))
    monkeypatch.undo()
    # Then the release stands: while b alone heartbeats on, both streams stay with b, and a
    # is not live (its renewal came before the end)
    groups.clock.advance(LEASE_S / 2)
    groups.service.heartbeat("b", groups.subs(incarnation))
    assert _holders(groups) == {"src1": "b", "src2": "b"}
    assert not _live(groups, "a")
    loaded = groups.store.load(groups.key)
    assert loaded is not None and "a" not in loaded.kept
    assert loaded.state.members["a"].released_at_ms > 0


def test_a_keep_written_between_a_heartbeats_read_and_write_stays(
    groups: Groups, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a member renewing over HTTP, no connection keeping it
    incarnation = groups.join("a")
    groups.join("b")
    groups.service.heartbeat("a", groups.subs(incarnation))
    # When a connection keeps it after a heartbeat read the group, before the heartbeat
    # writes the member's renewal
    by = KeptBy("conn-1", "chan-1", groups.clock.now_ms() + 3_600_000)
    write = groups.store.renew_members

    def kept_meanwhile(*args: Any, **kwargs: Any) -> None:
        assert groups.service.keep("a", groups.subs(incarnation), by) == 1
        write(*args, **kwargs)

    monkeypatch.setattr(groups.store, "renew_members", kept_meanwhile)
    groups.service.heartbeat("a", groups.subs(incarnation))
    monkeypatch.undo()
    # Then the keep stands: a is live long after its lease would have run out
    groups.clock.advance(3 * LEASE_S)
    assert _live(groups, "a")


def test_a_heartbeat_replaces_a_member_item_an_earlier_incarnation_left(groups: Groups) -> None:
    # Given a member whose item is an earlier incarnation's, with that one's keep and release
    incarnation = groups.join("a")
    groups.store.dynamo.batch_put(
        groups.store.table,
        [
            {
                "group": groups.key,
                "item": "m#a",
                "inc": "earlier",
                "r": 1,
                "kc": "conn-0",
                "kch": "chan-0",
                "ku": groups.clock.now_ms() + 3_600_000,
                "ka": groups.clock.now_ms() + 1,
                "ke": groups.clock.now_ms() + 1,
            }
        ],
    )
    # When it heartbeats
    groups.clock.advance(1)
    groups.service.heartbeat("a", groups.subs(incarnation))
    # Then its item is this incarnation's, renewed, with neither of them
    item = groups.store.dynamo.get(groups.store.table, {"group": groups.key, "item": "m#a"})
    assert item is not None and item["inc"] == incarnation
    assert item["r"] == groups.clock.now_ms() and "vw" in item
    assert not {"kc", "kch", "ku", "ka", "ke"} & set(item)


def _member_item(groups: Groups, member: str) -> dict[str, Any]:
    item = groups.store.dynamo.get(groups.store.table, {"group": groups.key, "item": f"m#{member}"})
    assert item is not None
    return item


def _view(groups: Groups, member: str) -> AgentState:
    loaded = groups.store.load(groups.key)
    assert loaded is not None
    return loaded.views[member].state


def _holding_a(groups: Groups) -> str:
    """a and b joined, a stream each, and a heartbeat of a's that adopted its stream set."""
    incarnation = groups.join("a")
    groups.join("b")
    groups.publish(incarnation, "src1", 1)
    groups.publish(incarnation, "src2", 1)
    assert sorted(_holders(groups).values()) == ["a", "b"]
    groups.service.heartbeat("a", groups.subs(incarnation))
    assert _view(groups, "a") is AgentState.REPLAYING
    return incarnation


def heartbeat_with(
    groups: Groups,
    incarnation: str,
    meanwhile: Callable[[], None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Member a's session heartbeats, ``meanwhile`` written between its read of the group and
    its write of the member's item."""
    write = groups.store.renew_members

    def between(*args: Any, **kwargs: Any) -> None:
        meanwhile()
        write(*args, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(groups.store, "renew_members", between)
        groups.service.heartbeat("a", groups.subs(incarnation))


def test_a_fenced_writes_mark_between_a_heartbeats_read_and_write_stays(
    groups: Groups, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a member whose agent holds its stream set
    incarnation = _holding_a(groups)
    # When a fenced write of it marks it lost after a heartbeat of its session read the group,
    # before the heartbeat writes the member's view
    groups.clock.advance(1)
    heartbeat_with(groups, incarnation, lambda: groups.store.lost(groups.key, "a"), monkeypatch)
    # Then the mark stands (the heartbeat's view came from a read before it): the member's
    # agent starts over, and the heartbeat's renewal is written all the same
    assert _member_item(groups, "a").get("lost")
    assert _view(groups, "a") is AgentState.CONNECTING
    assert _member_item(groups, "a")["r"] == groups.clock.now_ms()


def test_a_heartbeat_that_read_a_mark_clears_it(groups: Groups) -> None:
    # Given a member marked lost by a fenced write
    incarnation = _holding_a(groups)
    groups.store.lost(groups.key, "a")
    assert _view(groups, "a") is AgentState.CONNECTING
    # When its session heartbeats (reading the mark, its view brought up to the leader)
    groups.service.heartbeat("a", groups.subs(incarnation))
    # Then the mark is gone and the agent holds its stream set again
    assert "lost" not in _member_item(groups, "a")
    assert _view(groups, "a") is AgentState.REPLAYING


def test_a_fresh_mark_over_the_one_a_heartbeat_read_stays(
    groups: Groups, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a member marked lost, whose heartbeat reads the mark
    incarnation = _holding_a(groups)
    groups.store.lost(groups.key, "a")
    # When another fenced write marks it again before the heartbeat writes
    heartbeat_with(groups, incarnation, lambda: groups.store.lost(groups.key, "a"), monkeypatch)
    # Then the heartbeat clears the mark it read, not the one written after its read
    assert _member_item(groups, "a").get("lost")
    assert _view(groups, "a") is AgentState.CONNECTING


def test_a_heartbeats_older_renewal_leaves_a_newer_one_and_writes_its_view(
    groups: Groups, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a member whose item holds a view its agent has not adopted yet (lost)
    incarnation = _holding_a(groups)
    groups.store.lost(groups.key, "a")
    read_at = groups.clock.now_ms() + 10
    later = read_at + 1_000
    # When a heartbeat of read_at lands after a get of the session renewed it later
    groups.clock.advance(0.01)
    heartbeat_with(
        groups,
        incarnation,
        lambda: groups.store.renew(groups.key, incarnation, "a", later),
        monkeypatch,
    )
    # Then the newer renewal stays, and the heartbeat's view is written (the mark it read
    # cleared)
    item = _member_item(groups, "a")
    assert item["r"] == later
    assert "lost" not in item and _view(groups, "a") is AgentState.REPLAYING


def test_heartbeats_renewals_landing_out_of_order_leave_the_newest(groups: Groups) -> None:
    # Given two heartbeats' writes of a member, t1 < t2
    incarnation = _holding_a(groups)
    t1 = groups.clock.now_ms() + 1_000
    t2 = t1 + 1_000
    view = AgentView(AgentState.REPLAYING, 1, {})
    # When the newer one lands first, then the older one
    groups.store.renew_members([member_record(groups.key, incarnation, "a", t2, view)])
    groups.store.renew_members([member_record(groups.key, incarnation, "a", t1, view)])
    # Then the newer renewal stays
    assert _member_item(groups, "a")["r"] == t2
    loaded = groups.store.load(groups.key)
    assert loaded is not None and loaded.renewed["a"] == t2


def test_gets_renewals_landing_out_of_order_leave_the_newest(groups: Groups) -> None:
    # Given a member renewed by a heartbeat
    incarnation = _holding_a(groups)
    t1 = groups.clock.now_ms() + 1_000
    t2 = t1 + 1_000
    # When gets' renewals land out of order: newer, older, then one older than the heartbeat's
    groups.store.renew(groups.key, incarnation, "a", t2)
    groups.store.renew(groups.key, incarnation, "a", t1)
    groups.store.renew(groups.key, incarnation, "a", groups.clock.now_ms() - 1)
    # Then the newest stays (none of them is an error)
    assert _member_item(groups, "a")["r"] == t2
    loaded = groups.store.load(groups.key)
    assert loaded is not None and loaded.renewed["a"] == t2


def test_a_heartbeat_replaces_an_earlier_incarnations_item_of_a_later_renewal(
    groups: Groups,
) -> None:
    # Given a member whose item is an earlier incarnation's, renewed later than now (its
    # renewal says nothing of this incarnation's)
    incarnation = groups.join("a")
    now = groups.clock.now_ms()
    groups.store.dynamo.batch_put(
        groups.store.table,
        [{"group": groups.key, "item": "m#a", "inc": "earlier", "r": now + 60_000, "lost": True}],
    )
    # When it heartbeats
    groups.service.heartbeat("a", groups.subs(incarnation))
    # Then its item is this incarnation's, renewed now, without the earlier one's mark
    item = _member_item(groups, "a")
    assert (item["inc"], item["r"]) == (incarnation, now) and "lost" not in item
