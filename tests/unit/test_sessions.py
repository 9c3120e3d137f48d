"""The session registry's decisions, without AWS: versions, requests, plans, conflicts, reaping."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from pydantic import ValidationError
from shoal.core.errors import BadRequest, Forbidden
from shoal.sessions.model import (
    DUE_SHARDS,
    HELD_WILL_BOUND_MS,
    ConflictStep,
    ConnectPlan,
    ConnectRequest,
    Decision,
    Head,
    ReapAction,
    RegistryView,
    ScheduledWill,
    Version,
    WillMessage,
    after_conflict,
    check_client_id,
    due_shard,
    grace_ms,
    parse_channel,
    plan_connect,
    reap_action,
)

NOW = 1_700_000_000_000


def v(ms: int, nonce: str = "n") -> Version:
    return Version(ms, nonce)


def head(**changes: Any) -> Head:
    base = Head(
        newest=v(NOW - 10_000),
        sub="alice",
        rev=3,
        connected=True,
        keepalive_s=60,
        grace_ms=90_000,
        last_seen_ms=NOW - 10_000,
        will=None,
        session_id="s-1",
        session_expiry_s=300,
        session_expires_at_ms=None,
        subscriptions={"a/+": {"qos": 1}},
        due_at_ms=NOW + 80_000,
    )
    return replace(base, **changes)


def will(due_at_ms: int, claimed_at_ms: int | None = None) -> ScheduledWill:
    return ScheduledWill(v(NOW - 20_000), WillMessage(topic="t"), due_at_ms, claimed_at_ms)


# --- versions


def test_versions_order_by_connect_time_first() -> None:
    assert v(1, "zzz") < v(2, "aaa")


def test_same_millisecond_ties_break_by_nonce_deterministically() -> None:
    # Given two connects in one millisecond, both sides compare them the same way
    assert v(5, "a") < v(5, "b")
    assert max(v(5, "b"), v(5, "a")) == v(5, "b")


def test_version_key_sorts_as_the_version_does() -> None:
    versions = [v(999, "b"), v(1000, "a"), v(10, "c"), v(1000, "Z")]
    assert sorted(versions, key=lambda x: x.key) == sorted(versions)


def test_channel_parses_back_to_its_version() -> None:
    version = Version.new(1_700_000_000_123)
    assert Version.parse(version.channel) == version
    assert Version.parse(version.key) == version


def test_new_channels_are_unguessable() -> None:
    nonces = {Version.new(1).nonce for _ in range(100)}
    assert len(nonces) == 100
    assert all(len(n) >= 20 for n in nonces)


@pytest.mark.parametrize("text", ["", "abc", "12", "-x", "12-", "1²-x", "1-a b", "1" * 16 + "-x"])
def test_malformed_channel_is_a_bad_request(text: str) -> None:
    with pytest.raises(BadRequest):
        parse_channel(text)


def test_missing_channel_header_is_a_bad_request() -> None:
    with pytest.raises(BadRequest):
        parse_channel(None)


@pytest.mark.parametrize("client_id", ["", "a\x00b", "line\nbreak", "x" * 257])
def test_bad_client_ids_are_refused(client_id: str) -> None:
    with pytest.raises(BadRequest):
        check_client_id(client_id)


# --- requests


def test_connect_defaults_follow_the_api() -> None:
    request = ConnectRequest.model_validate({})
    assert (request.clean_start, request.session_expiry_s, request.keepalive_s) == (True, 0, 60)


@pytest.mark.parametrize(
    "body",
    [
        {"unknown": 1},
        {"keepalive_s": -1},
        {"keepalive_s": 65_536},
        {"session_expiry_s": -5},
        {"clean_start": "false"},
        {"clean_start": 0},
        {"keepalive_s": "60"},
        {"keepalive_s": 1.5},
        {"keepalive_s": True},
        {"connected_at_ms": -1},
        {"will": {"text": "no topic"}},
        {"will": {"topic": "t", "payload": "not base64!"}},
        {"will": {"topic": "t", "payload": "aGk=", "text": "hi"}},
        {"will": {"topic": "t", "qos": 3}},
        {"will": {"topic": "t", "qos": True}},
        {"will": {"topic": "t", "delay_s": -1}},
        {"will": {"topic": "t", "extra": 1}},
    ],
)
def test_bad_connect_bodies_fail_validation(body: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        ConnectRequest.model_validate(body)


def test_will_body_is_payload_or_text() -> None:
    assert WillMessage(topic="t", payload="aGk=").body() == b"hi"
    assert WillMessage(topic="t", text="bye").body() == b"bye"
    assert WillMessage(topic="t").body() == b""


# --- step 2: the MQTT 5 decision


def test_no_session_is_a_new_session() -> None:
    plan = plan_connect(RegistryView(), ConnectRequest(clean_start=False), "alice", v(NOW), NOW)
    assert (plan.decision, plan.session_present) == (Decision.NEW, False)
    assert plan.session_id


def test_clean_start_false_resumes_a_live_session() -> None:
    view = RegistryView(head(), (v(NOW - 10_000),))
    plan = plan_connect(view, ConnectRequest(clean_start=False), "alice", v(NOW), NOW)
    assert (plan.decision, plan.session_present, plan.session_id) == (Decision.RESUME, True, "s-1")


def test_taking_over_a_channel_whose_session_ends_with_it_presents_no_session() -> None:
    # Given a live channel whose session expiry is 0 (its session ends with the channel)
    view = RegistryView(head(session_expiry_s=0), (v(NOW - 10_000),))
    # When a persistent connect takes it over
    plan = plan_connect(view, ConnectRequest(clean_start=False), "alice", v(NOW), NOW)
    # Then the old session is discarded and none is present (MQTT 5 §3.1.2.11.2)
    assert (plan.decision, plan.session_present) == (Decision.DISCARD, False)
    assert plan.session_id != "s-1"


def test_clean_start_true_discards_the_session() -> None:
    plan = plan_connect(RegistryView(head()), ConnectRequest(), "alice", v(NOW), NOW)
    assert (plan.decision, plan.session_present) == (Decision.DISCARD, False)
    assert plan.session_id != "s-1"


def test_disconnected_session_before_expiry_is_resumed() -> None:
    stored = head(connected=False, session_expires_at_ms=NOW + 1)
    plan = plan_connect(
        RegistryView(stored), ConnectRequest(clean_start=False), "alice", v(NOW), NOW
    )
    assert (plan.decision, plan.session_present, plan.session_id) == (Decision.RESUME, True, "s-1")


def test_expired_session_is_not_present() -> None:
    stored = head(connected=False, session_expires_at_ms=NOW)
    plan = plan_connect(
        RegistryView(stored), ConnectRequest(clean_start=False), "alice", v(NOW), NOW
    )
    assert (plan.decision, plan.session_present) == (Decision.NEW, False)


def test_another_principals_live_session_is_forbidden() -> None:
    with pytest.raises(Forbidden):
        plan_connect(
            RegistryView(head()), ConnectRequest(clean_start=False), "mallory", v(NOW), NOW
        )


def test_another_principals_expired_session_does_not_block() -> None:
    stored = head(connected=False, session_expires_at_ms=NOW - 1)
    plan = plan_connect(RegistryView(stored), ConnectRequest(), "mallory", v(NOW), NOW)
    assert plan.decision is Decision.NEW


def test_older_registrations_are_cleaned_up_by_the_connect() -> None:
    older = (v(NOW - 3), v(NOW - 2), v(NOW - 1))
    plan = plan_connect(RegistryView(head(), older), ConnectRequest(), "alice", v(NOW), NOW)
    assert plan.stale == older


def test_resume_cancels_waiting_wills_but_not_due_or_claimed_ones() -> None:
    waiting, due, claimed = will(NOW + 5), will(NOW), will(NOW + 9, claimed_at_ms=NOW - 1)
    view = RegistryView(head(connected=False, session_expires_at_ms=NOW + 60_000))
    view = replace(view, wills=(waiting, due, claimed))
    plan = plan_connect(view, ConnectRequest(clean_start=False), "alice", v(NOW), NOW)
    assert (plan.cancel_wills, plan.fire_wills) == ((waiting,), ())


def test_clean_start_ends_the_session_so_waiting_wills_fire_now() -> None:
    waiting = will(NOW + 5)
    view = RegistryView(head(connected=False, session_expires_at_ms=NOW + 60_000), wills=(waiting,))
    plan = plan_connect(view, ConnectRequest(clean_start=True), "alice", v(NOW), NOW)
    assert (plan.cancel_wills, plan.fire_wills) == ((), (waiting,))


# --- the will of a live channel a connect takes over (MQTT 5 §3.1.2.5, §3.1.3.2.2)


def armed(delay_s: int, **changes: Any) -> RegistryView:
    """A live channel with a will of ``delay_s``, as a takeover reads it."""
    stored = head(will=WillMessage(topic="t", text="gone", delay_s=delay_s), **changes)
    return RegistryView(stored, (stored.newest,))


def published_at_once(plan: ConnectPlan, view: RegistryView) -> None:
    assert view.head is not None and view.head.will is not None
    expected = ScheduledWill(view.head.newest, view.head.will, NOW, sub="alice")
    assert plan.takeover_will == expected
    assert plan.takeover_will.item == "will#" + view.head.newest.key


def test_resume_of_a_live_channel_publishes_its_will_without_delay() -> None:
    view = armed(delay_s=0)
    plan = plan_connect(view, ConnectRequest(clean_start=False), "alice", v(NOW), NOW)
    assert plan.decision is Decision.RESUME
    published_at_once(plan, view)


def test_resume_of_a_live_channel_within_the_will_delay_holds_its_will_for_the_close() -> None:
    # the channel may be gone already (its $disconnect not run yet): the will waits for it,
    # never due by itself (its due time is the bound on that wait)
    plan = plan_connect(armed(delay_s=30), ConnectRequest(clean_start=False), "alice", v(NOW), NOW)
    assert plan.decision is Decision.RESUME
    held = plan.takeover_will
    assert held is not None
    assert (held.held_since_ms, held.due_at_ms) == (NOW, NOW + HELD_WILL_BOUND_MS)


def test_a_held_will_is_neither_cancelled_nor_fired_by_a_later_connect() -> None:
    # its channel's close decides it, whoever connects meanwhile
    held = ScheduledWill(
        v(NOW - 5_000),
        WillMessage(topic="t", text="gone", delay_s=30),
        NOW + HELD_WILL_BOUND_MS,
        held_since_ms=NOW - 1_000,
    )
    for clean_start in (False, True):
        plan = plan_connect(
            RegistryView(wills=(held,)),
            ConnectRequest(clean_start=clean_start),
            "alice",
            v(NOW),
            NOW,
        )
        assert (plan.cancel_wills, plan.fire_wills) == ((), ())


@pytest.mark.parametrize("delay_s", [0, 30])
def test_clean_start_over_a_live_channel_publishes_its_will_at_once(delay_s: int) -> None:
    # the old session ends with the takeover, before any delay runs out
    view = armed(delay_s)
    plan = plan_connect(view, ConnectRequest(clean_start=True), "alice", v(NOW), NOW)
    assert plan.decision is Decision.DISCARD
    published_at_once(plan, view)


@pytest.mark.parametrize("delay_s", [0, 30])
def test_taking_over_a_channel_whose_session_ends_with_it_publishes_its_will_at_once(
    delay_s: int,
) -> None:
    view = armed(delay_s, session_expiry_s=0)
    plan = plan_connect(view, ConnectRequest(clean_start=False), "alice", v(NOW), NOW)
    assert plan.decision is Decision.DISCARD
    published_at_once(plan, view)


@pytest.mark.parametrize("clean_start", [False, True])
def test_a_channel_without_a_will_or_no_longer_live_has_none_to_publish(clean_start: bool) -> None:
    request = ConnectRequest(clean_start=clean_start)
    assert plan_connect(RegistryView(head()), request, "alice", v(NOW), NOW).takeover_will is None
    # a disconnected head has no armed will (a disconnect or expiry removed it), even if read
    gone = armed(0, connected=False, session_expires_at_ms=NOW + 60_000)
    assert plan_connect(gone, request, "alice", v(NOW), NOW).takeover_will is None


# --- step 3: after a failed condition


def test_newest_is_the_max_of_head_and_registrations() -> None:
    view = RegistryView(head(newest=v(5)), (v(3), v(7)))
    assert view.newest() == v(7)
    assert RegistryView().newest() is None


def test_a_disconnected_head_is_no_registration() -> None:
    view = RegistryView(head(newest=v(9), connected=False), (v(3),))
    assert view.newest() == v(3)
    assert RegistryView(head(connected=False)).newest() is None


@pytest.mark.parametrize(
    ("ours", "local_max", "real_max", "step"),
    [
        # a newer connect committed meanwhile: the expensive fail
        (v(10), v(5), v(11), ConflictStep.OUTDATED),
        (v(10), None, v(11), ConflictStep.OUTDATED),
        # an older racer won meanwhile: retry against it
        (v(10), v(5), v(8), ConflictStep.RETRY),
        (v(10), None, v(8), ConflictStep.RETRY),
        # same newest, other lifecycle change (disconnect, keepalive expiry): retry
        (v(10), v(5), v(5), ConflictStep.RETRY),
        # our own transaction landed (an SDK retry of it then failed its condition)
        (v(10), v(5), v(10), ConflictStep.COMMITTED),
        # ours newer than RealMax, RealMax older than LocalMax: the very unlikely branch
        (v(10), v(5), v(3), ConflictStep.ABORT),
        (v(10), v(5), None, ConflictStep.ABORT),
    ],
)
def test_after_conflict(
    ours: Version, local_max: Version | None, real_max: Version | None, step: ConflictStep
) -> None:
    assert after_conflict(ours, local_max, real_max) is step


# --- the reaper's decisions


def test_keepalive_expires_at_one_and_a_half_times_keepalive() -> None:
    stored = head(last_seen_ms=NOW - grace_ms(60))
    assert reap_action(stored, NOW) == (ReapAction.EXPIRE_CHANNEL, None)
    assert reap_action(stored, NOW - 1) == (ReapAction.RESCHEDULE, NOW)


def test_zero_keepalive_never_expires_and_leaves_the_index() -> None:
    assert reap_action(head(keepalive_s=0, grace_ms=0, last_seen_ms=0), NOW) == (
        ReapAction.RESCHEDULE,
        None,
    )


def test_disconnected_session_ends_at_its_expiry() -> None:
    stored = head(connected=False, session_expires_at_ms=NOW + 10)
    assert reap_action(stored, NOW) == (ReapAction.RESCHEDULE, NOW + 10)
    assert reap_action(stored, NOW + 10) == (ReapAction.END_SESSION, None)


def test_due_shards_are_stable_and_bounded() -> None:
    shards = {due_shard(f"client-{i}") for i in range(200)}
    assert shards == {str(i) for i in range(DUE_SHARDS)}
    assert due_shard("client-7") == due_shard("client-7")
