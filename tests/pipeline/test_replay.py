"""Replay selects by topic filter and publish time, in per-key order, with deterministic ids,
and re-injects into a session's inbox idempotently."""

from __future__ import annotations

import base64
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from pyspark.sql import DataFrame, SparkSession
from shoal.core.clock import ManualClock

from pipeline import replay
from pipeline.common import Output
from pipeline.replay import (
    PlanTarget,
    ReplayMessage,
    Selection,
    SessionInboxTarget,
    TargetUnavailable,
    inject,
    replay_message_id,
    select,
)
from tests.pipeline.data import SECOND, T0, message, messages_df

pytestmark = pytest.mark.pipeline


@pytest.fixture(scope="module")
def archive(spark: SparkSession) -> DataFrame:
    rows = [
        # key k: m1 in storage topic 0 (seq 20), m2 in storage topic 1 (seq 5), m0 seq 10
        message(0, topic="orders/eu", key="k", sequence=10, message_id="m0"),
        message(1, topic="orders/eu", key="k", sequence=20, message_id="m1"),
        message(2, topic="orders/us", key="k", storage_topic=1, sequence=5, message_id="m2"),
        message(3, topic="billing/eu", key="b", sequence=30, message_id="m3"),
        message(4, topic="$SYS/x", key="s", sequence=40, message_id="m4"),
        message(9, topic="orders/eu", key="k", sequence=99, message_id="m9"),
        message(1, topic="orders/eu", key="k", sequence=20, message_id="m1"),  # twice archived
    ]
    return messages_df(spark, rows)


@pytest.fixture(scope="module")
def plan(archive: DataFrame) -> list[dict[str, Any]]:
    selection = Selection("orders/#", since=T0, until=T0 + 5 * SECOND)
    return [r.asDict() for r in select(archive, selection, "r1").collect()]


def test_selects_by_filter_and_time_once_per_message(plan: list[dict[str, Any]]) -> None:
    # Given orders/# over [T0, T0 + 5 s): m9 is later, billing and $SYS do not match
    # Then m0, m1 (archived twice, selected once) and m2 are selected
    assert sorted(r["message_id"] for r in plan) == ["m0", "m1", "m2"]


def test_plan_is_in_per_key_publish_order(plan: list[dict[str, Any]]) -> None:
    # Then key k comes in storage topic, then sequence order: m0 (0/10), m1 (0/20), m2 (1/5)
    assert [r["message_id"] for r in plan] == ["m0", "m1", "m2"]
    assert [r["replay_position"] for r in plan] == sorted(r["replay_position"] for r in plan)


def test_replay_ids_are_deterministic_and_new(plan: list[dict[str, Any]]) -> None:
    # Then each id is the digest of replay name and original id (the same on every run)
    for row in plan:
        assert row["replay_message_id"] == replay_message_id("r1", row["message_id"])
        assert row["replay_message_id"] != row["message_id"]


def test_a_filter_matching_nothing_selects_nothing(archive: DataFrame) -> None:
    assert select(archive, Selection("nothing/+"), "r1").count() == 0


class FakeInbox:
    def __init__(self) -> None:
        self.items: dict[tuple[str, str], Any] = {}

    def put(self, items: list[Any]) -> None:
        for item in items:
            self.items[(item.session_id, item.key)] = item


class FakeSessions:
    def __init__(self, head: Any) -> None:
        self._head = head

    def head(self, client_id: str) -> Any:
        return self._head


class FakeHead:
    session_id = "sess-1"
    subscriptions = {
        "orders/#": {"qos": 1, "sid": "sid-a"},
        "orders/us": {"qos": 2, "sid": "sid-b"},
        "$share/g/orders/#": {"qos": 1, "sid": "sid-g"},
    }

    def session_alive(self, now_ms: int) -> bool:
        return True


def replayed(n: int, topic: str = "orders/eu", qos: int = 2) -> ReplayMessage:
    return ReplayMessage(
        replay_message_id=f"r-{n}",
        message_id=f"m{n}",
        topic=topic,
        ordering_key="k",
        qos=qos,
        published_at=T0 + n,
        payload=b"hello",
        replay_position=f"p{n:03d}",
    )


def session_target(inbox: FakeInbox, head: Any = None) -> SessionInboxTarget:
    return SessionInboxTarget(
        "client-1",
        "r1",
        sessions=FakeSessions(head or FakeHead()),
        inbox=inbox,
        payloads=None,
        retention_s=3600,
        clock=ManualClock(T0),
    )


def test_session_target_writes_in_order_with_the_matching_subscription() -> None:
    # Given a session holding orders/# (QoS 1) and orders/us (QoS 2)
    inbox = FakeInbox()
    # When three messages are injected
    written = session_target(inbox).inject(
        [replayed(0), replayed(1, "orders/us"), replayed(2, "billing/x")]
    )
    # Then the two matching ones are in the session's inbox, in order, each with the
    # subscription granting the highest QoS; billing/x matches nothing and is left out
    assert written == 2
    [item] = inbox.items.values()
    assert item.session_id == "sess-1"
    assert [(m.message_id, m.subscription, m.qos) for m in item.messages] == [
        ("r-0", "orders/#", 1),
        ("r-1", "orders/us", 2),
    ]


def test_session_target_is_idempotent() -> None:
    # Given a replay injected once
    inbox = FakeInbox()
    session_target(inbox).inject([replayed(0), replayed(1)])
    before = dict(inbox.items)
    # When the same replay runs again
    session_target(inbox).inject([replayed(0), replayed(1)])
    # Then it wrote the same items under the same keys: nothing new
    assert inbox.items == before


def test_session_target_without_a_session_is_unavailable() -> None:
    target = session_target(FakeInbox(), head=None)
    target.sessions = FakeSessions(None)
    with pytest.raises(TargetUnavailable):
        target.inject([replayed(0)])


class FakePushReplay:
    """``shoal.push.replay.PushReplay``: records calls; defers the first call's last message."""

    def __init__(self, defer: int = 0, missing: bool = False) -> None:
        self.calls: list[list[Any]] = []
        self.defer = defer
        self.missing = missing

    def replay(self, name: str, replay_id: str, messages: list[Any]) -> Any:
        from shoal.core.errors import SubscriptionNotFound
        from shoal.push.replay import ReplayReport

        if self.missing:
            raise SubscriptionNotFound(f"no push subscription named {name}")
        self.calls.append(list(messages))
        deferred = messages[len(messages) - self.defer :] if self.defer else []
        self.defer = 0
        return ReplayReport(injected=len(messages) - len(deferred), deferred=list(deferred))


def push_target(service: FakePushReplay, clock: ManualClock | None = None) -> Any:
    from pipeline.replay import PushSubscriptionTarget

    return PushSubscriptionTarget("hook", "r1", service=service, clock=clock or ManualClock(T0))


def test_push_target_hands_the_original_messages_with_their_main_positions(
    plan: list[dict[str, Any]],
) -> None:
    from shoal.push.entries import main_position

    # Given the plan m0 (0/10), m1 (0/20), m2 (storage topic 1, sequence 5)
    service = FakePushReplay()
    # When it is injected into a push subscription
    written = push_target(service).inject([ReplayMessage.from_row(r) for r in plan])
    # Then the service got the original messages (the endpoint dedups by their ids), in plan
    # order, each with its replay position and the main position it names
    assert written == 3
    [call] = service.calls
    assert [a.message.message_id for a in call] == ["m0", "m1", "m2"]
    assert [a.position for a in call] == [r["replay_position"] for r in plan]
    assert [a.main for a in call] == [
        main_position(0, "10", 0),
        main_position(0, "20", 0),
        main_position(1, "5", 0),
    ]


def test_push_target_passes_deferred_messages_again_before_going_on() -> None:
    # Given a subscription that defers the last message (its key has too many pending)
    service, clock = FakePushReplay(defer=1), ManualClock(T0)
    # When three messages are injected
    written = push_target(service, clock).inject([replayed(n) for n in range(3)])
    # Then the deferred one was passed again after a pause, and everything was written
    assert written == 3
    assert [[a.message.message_id for a in c] for c in service.calls] == [
        ["m0", "m1", "m2"],
        ["m2"],
    ]
    assert clock.now_ms() > T0


def test_push_target_without_a_subscription_is_unavailable() -> None:
    with pytest.raises(TargetUnavailable, match="no push subscription"):
        push_target(FakePushReplay(missing=True)).inject([replayed(0)])


class FakeGroups:
    def __init__(self, incarnation: str | None) -> None:
        self.incarnation = incarnation
        self.streams: list[tuple[str, str, str]] = []

    def load(self, key: str) -> Any:
        if self.incarnation is None:
            return None
        return SimpleNamespace(state=SimpleNamespace(incarnation=self.incarnation))

    def ensure_stream(self, key: str, incarnation: str, source: str) -> bool:
        self.streams.append((key, incarnation, source))
        return True


def group_target(inbox: FakeInbox, groups: FakeGroups, text: str = "g/orders/#") -> Any:
    from pipeline.replay import GroupStreamTarget

    return GroupStreamTarget(
        text,
        "r1",
        groups=groups,
        inbox=inbox,
        payloads=None,
        retention_s=3600,
        clock=ManualClock(T0),
    )


def test_group_target_writes_a_stream_of_its_own_the_leader_knows() -> None:
    # Given a shared group $share/g/orders/# (incarnation inc-1)
    inbox, groups = FakeInbox(), FakeGroups("inc-1")
    target = group_target(inbox, groups)
    # When three messages are injected, one outside the group's filter
    written = target.inject([replayed(0), replayed(1), replayed(2, "billing/x")])
    # Then the two matching ones are in the group's partition, in order, under the replay's
    # source, and the leader was told of that stream before
    from shoal.groups.records import group_key
    from shoal.groups.streams import group_partition

    assert (written, target.unmatched) == (2, 1)
    [item] = inbox.items.values()
    assert item.session_id == group_partition("inc-1")
    assert item.key.startswith(target.source + "#")
    assert [(m.message_id, m.sid, m.subscription) for m in item.messages] == [
        ("r-0", "inc-1", "$share/g/orders/#"),
        ("r-1", "inc-1", "$share/g/orders/#"),
    ]
    assert groups.streams == [(group_key("g", "orders/#"), "inc-1", target.source)]


def test_group_target_is_idempotent_and_takes_the_share_prefix_too() -> None:
    # Given a replay injected once
    inbox = FakeInbox()
    group_target(inbox, FakeGroups("inc-1")).inject([replayed(0), replayed(1)])
    before = dict(inbox.items)
    # When the same replay runs again, the target named with its $share prefix
    group_target(inbox, FakeGroups("inc-1"), "$share/g/orders/#").inject([replayed(0), replayed(1)])
    # Then it wrote the same items under the same keys
    assert inbox.items == before


def test_group_target_without_a_group_is_unavailable() -> None:
    with pytest.raises(TargetUnavailable, match="no shared group"):
        group_target(FakeInbox(), FakeGroups(None)).inject([replayed(0)])


def test_inject_streams_the_plan_into_a_plan_file(archive: DataFrame, tmp_path: Path) -> None:
    # Given the plan of orders/eu
    plan = select(archive, Selection("orders/eu"), "r2")
    # When injected into a plan target
    written = inject(plan, PlanTarget(Output(str(tmp_path))))
    # Then the file holds the messages in order with their payloads
    lines = (tmp_path / "plan.jsonl").read_text().splitlines()
    assert written == len(lines) == 3
    assert base64.b64decode(__import__("json").loads(lines[0])["payload"]) == b"hello"


def test_a_written_plan_is_injected_without_spark_in_order(
    archive: DataFrame, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a plan an EMR job wrote (a plan: target), and a session target that records
    plan = select(archive, Selection("orders/#"), "r3")
    inject(plan, PlanTarget(Output(str(tmp_path))))
    expected = [row["replay_message_id"] for row in plan.collect()]
    taken: list[list[str]] = []

    class Recorder:
        description = "recorder"

        def inject(self, messages: Any) -> int:
            taken.append([m.replay_message_id for m in messages])
            return len(messages)

        def close(self) -> None:
            taken.append(["closed"])

    made: list[tuple[str, str]] = []

    def make(spec: str, replay_id: str, *_: Any, **__: Any) -> Recorder:
        made.append((spec, replay_id))
        return Recorder()

    monkeypatch.setattr(replay, "make_target", make)
    monkeypatch.setattr(replay, "spark_session", lambda *_: pytest.fail("no Spark for a plan"))
    # When `shoal pipeline replay --plan <folder> --target session:c1` runs, twice
    argv = ["--plan", str(tmp_path), "--target", "session:c1", "--quiet"]
    assert replay.main(argv) == 0
    assert replay.main(argv) == 0
    # Then the target took the plan's messages in plan order, under one replay id both times
    assert taken[0] == expected and taken[1] == ["closed"]
    assert made[0] == made[1] and made[0][0] == "session:c1"


@pytest.mark.parametrize(
    "argv",
    [
        ["--plan", "p", "--input", "a", "--target", "session:c1"],
        ["--input", "a", "--target", "session:c1"],
        ["--plan", "p", "--target", "plan:out"],
    ],
)
def test_replay_refuses_mixed_or_missing_sources(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        replay.main(argv)
    assert exited.value.code == 2
