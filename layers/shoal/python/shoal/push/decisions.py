"""What a consumer does with a message, decided from the key state alone (pure): the MQ
consumer's ``decide_main``, the RQ consumer's ``decide_retry``, and ``judge`` of an attempt."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from shoal.push.endpoint import DeliveryResult
from shoal.push.entries import REPLAYED, Entry
from shoal.push.model import RetryPolicy
from shoal.push.state import KeyState


class MainAction(Enum):
    #: routed before (a retried batch, or a record read twice): nothing to do
    SKIP = "skip"
    #: routed before, and its put may not have landed: put the reserved entry again
    REPUT = "reput"
    #: the key is blocked: behind the pending ones
    FOLLOW_RQ = "follow_rq"
    FOLLOW_DLQ = "follow_dlq"
    DELIVER = "deliver"


def decide_main(
    state: KeyState,
    *,
    main: str,
    message_id: str,
    generation: int,
    skip_before_ms: int,
    ordered: bool,
) -> MainAction:
    """What the MQ consumer does with a matching message of a key in ``state``."""
    if state.generation == generation:
        mine = state.reserved("mq")
        if mine and mine[-1].message_id == message_id and mine[-1].main == main:
            return MainAction.REPUT
    # positions compare within one storage topic only: the taps of a topic's storage topics
    # run side by side, so a key's later storage topic may route before its earlier one
    if state.finished(main, generation):
        return MainAction.SKIP
    if ordered:
        # RQ first: while RQ holds the key, DLQ entries of it are older than anything in RQ
        # only until RQ drains into them, so a new message must queue behind RQ's entries.
        if state.rq.blocks(skip_before_ms):
            return MainAction.FOLLOW_RQ
        if state.dlq.blocks(skip_before_ms):
            return MainAction.FOLLOW_DLQ
    return MainAction.DELIVER


class RetryAction(Enum):
    #: consumed before (a duplicate record, or a retried batch)
    STALE = "stale"
    #: consumed by a move to DLQ whose put may not have landed: put the DLQ entry again
    REPUT = "reput"
    #: an earlier offset of the key is missing from the stream: repair it first
    GAP = "gap"
    #: published before the subscription's seek time: consumed without delivery
    SKIP = "skip"
    #: an older message of the key is dead-lettered: behind it in DLQ
    FOLLOW_DLQ = "follow_dlq"
    #: attempts used up (the policy allows fewer than were made): to DLQ
    EXHAUSTED = "exhausted"
    WAIT = "wait"
    DELIVER = "deliver"


@dataclass(frozen=True)
class RetryDecision:
    action: RetryAction
    #: attempts made so far, and when the next is due
    attempts: int = 0
    due_ms: int = 0


def decide_retry(
    state: KeyState,
    entry: Entry,
    *,
    policy: RetryPolicy,
    skip_before_ms: int,
    ordered: bool,
    now_ms: int,
) -> RetryDecision:
    """What the RQ consumer does with ``entry`` of a key in ``state``."""
    consumed = state.rq.c.n
    if entry.n <= consumed or entry.n > state.rq.p.n:
        moved = state.reserved("rq")
        if (
            moved
            and moved[-1].origin_n == entry.n
            and moved[-1].message_id == entry.message.message_id
        ):
            return RetryDecision(RetryAction.REPUT)
        return RetryDecision(RetryAction.STALE)
    if entry.n > consumed + 1:
        return RetryDecision(RetryAction.GAP)
    # a replayed entry counts as published when it was replayed: a seek before the replay
    # must not skip what the replay was asked for
    published = entry.at_ms if entry.reason == REPLAYED else entry.message.published_at_ms
    if published < skip_before_ms:
        return RetryDecision(RetryAction.SKIP)
    if ordered and state.dlq.blocks(skip_before_ms) and entry.main > state.dlq.c.m:
        # DLQ holds an older message of the key (entries reach DLQ in key order, so one newer
        # than DLQ's consumed mark is newer than DLQ's head): never overtake it.
        return RetryDecision(RetryAction.FOLLOW_DLQ, attempts=entry.attempts)
    head = state.head
    attempts, due = (
        (head.attempts, head.due_ms)
        if head is not None and head.n == entry.n
        else (entry.attempts, entry.due_ms)
    )
    if attempts >= policy.max_attempts:
        return RetryDecision(RetryAction.EXHAUSTED, attempts=attempts)
    if now_ms < due:
        return RetryDecision(RetryAction.WAIT, attempts=attempts, due_ms=due)
    return RetryDecision(RetryAction.DELIVER, attempts=attempts, due_ms=due)


class Outcome(Enum):
    DONE = "done"
    RETRY = "retry"
    DEAD = "dead"


def judge(result: DeliveryResult, policy: RetryPolicy, attempt: int) -> Outcome:
    """What attempt ``attempt`` (1-based) of a delivery with ``result`` leads to."""
    if result.ok:
        return Outcome.DONE
    if policy.retries(result) and attempt < policy.max_attempts:
        return Outcome.RETRY
    return Outcome.DEAD
