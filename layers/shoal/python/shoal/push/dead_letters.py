"""A push subscription's DLQ (admin): listed page by page, and redriven into its RQ.

Redrive: exactly one selector, capped. For each key, the redriven entries are the longest
run of its oldest pending DLQ entries that the selector names (a selected entry behind an
unselected older one of its key stays, and is reported), moved into RQ in order, ahead of any
newer message of the key (which waits behind them, as the key stays blocked until they are
delivered). A key with entries still in RQ is skipped (``retry_pending``): its RQ entries are
older or newer than the DLQ ones, and only once RQ drains is the order between them known.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass, field
from typing import Any

from shoal.core import metrics
from shoal.core.clock import Clock
from shoal.core.errors import BadRequest, InvalidCursor, InvalidRedrive
from shoal.core.observability import count as count_metric
from shoal.core.observability import logger
from shoal.push.api import RedriveRequest, parse_time
from shoal.push.entries import Entry, Source, decode_entry
from shoal.push.model import DLQ, RQ, PushSubscription
from shoal.push.queues import Queues, ReadBudgetExhausted
from shoal.push.state import EntryReservation, KeyState
from shoal.push.store import KeyStore, PushSubscriptionStore
from shoal.records import MalformedRecord

MAX_REDRIVE_KEYS = 100
MAX_REDRIVE_IDS = 500
#: messages one redrive call moves at most; repeat the call for more
MAX_REDRIVE_MESSAGES = 1_000
MAX_DLQ_PAGE = 100
#: a DLQ read starts this much before the time it looks for (Kinesis stamps by its own clock)
READ_SKEW_MS = 5_000
_MAX_CONFLICTS = 10


@dataclass
class RedriveReport:
    redriven: int = 0
    keys: list[str] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)
    truncated: bool = False

    def document(self) -> dict[str, Any]:
        return {
            "redriven": self.redriven,
            "ordering_keys": self.keys,
            "skipped": self.skipped,
            "truncated": self.truncated,
        }


@dataclass(frozen=True)
class _Found:
    entry: Entry
    source: Source


def _dead(state: KeyState, entry: Entry, skip_before_ms: int) -> bool:
    return (
        state.dlq.c.n < entry.n <= state.dlq.p.n and entry.message.published_at_ms >= skip_before_ms
    )


def _entry_of(data: bytes) -> Entry | None:
    try:
        return decode_entry(data)
    except MalformedRecord:
        return None


def _entry_document(entry: Entry) -> dict[str, Any]:
    message = entry.message
    return {
        "id": message.message_id,
        "topic": message.topic,
        "ordering_key": message.ordering_key,
        "payload": base64.b64encode(message.payload).decode("ascii"),
        "qos": message.qos,
        "retain": message.retain,
        "properties": message.properties,
        "published_at": message.published_at_ms,
        "reason": entry.reason,
        "status": entry.status,
        "attempts": entry.attempts,
        "failed_at": entry.at_ms,
        "offset": entry.n,
    }


def _strings(value: object, cap: int, what: str) -> list[str]:
    if (
        not isinstance(value, list)
        or not 1 <= len(value) <= cap
        or not all(isinstance(v, str) and v for v in value)
    ):
        raise InvalidRedrive(f"{what} is a list of 1-{cap} non-empty strings", maximum=cap)
    return list(dict.fromkeys(value))


def _encode_cursor(shard: str, sequence_number: str) -> str:
    raw = json.dumps({"s": shard, "q": sequence_number}, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_cursor(cursor: object) -> tuple[str, str]:
    try:
        text = str(cursor)
        raw = json.loads(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))
        shard, seq = str(raw["s"]), str(raw["q"])
        int(seq)
    except (binascii.Error, ValueError, KeyError, TypeError):
        raise InvalidCursor("the cursor is not one this service handed out") from None
    return shard, seq


class DeadLetters:
    """A subscription's DLQ: listed, and redriven into its RQ."""

    def __init__(
        self,
        prefix: str,
        subscriptions: PushSubscriptionStore,
        key_states: KeyStore,
        queues: Queues,
        clock: Clock,
    ) -> None:
        self.prefix = prefix
        self.subscriptions = subscriptions
        self.key_states = key_states
        self.queues = queues
        self.clock = clock

    def page(self, name: str, limit: object, after: object) -> dict[str, Any]:
        try:
            count = 20 if limit is None else int(str(limit))
        except ValueError:
            count = 0
        if not 1 <= count <= MAX_DLQ_PAGE:
            raise BadRequest(f"limit is 1-{MAX_DLQ_PAGE}", maximum=MAX_DLQ_PAGE)
        sub = self.subscriptions.require(name)
        dlq = sub.queue(DLQ, self.prefix)
        shards = self.queues.shards(dlq.stream)
        start_shard, after_seq = _decode_cursor(after) if after else (None, None)
        if start_shard is not None and start_shard not in shards:
            raise InvalidCursor("the cursor names no shard of this dead-letter queue")
        if start_shard is not None:
            shards = shards[shards.index(start_shard) :]
        out: list[dict[str, Any]] = []
        seen: set[tuple[str, int]] = set()
        for position, shard in enumerate(shards):
            buffered: list[tuple[str, Entry]] = []
            last_seq: str | None = after_seq if position == 0 else None
            exhausted = True
            try:
                for record in self.queues.scan(dlq.stream, shard, after=last_seq, max_calls=10):
                    try:
                        buffered.append((record.sequence_number, decode_entry(record.data)))
                    except MalformedRecord:
                        continue
            except ReadBudgetExhausted:
                exhausted = False
            states = self.key_states.get_many(name, {e.ordering_key for _, e in buffered})
            for seq, entry in buffered:
                last_seq = seq
                state = states[entry.ordering_key]
                key = (entry.ordering_key, entry.n)
                if key in seen or not _dead(state, entry, sub.skip_before_ms):
                    continue
                seen.add(key)
                out.append(_entry_document(entry))
                if len(out) >= count:
                    return {"messages": out, "next": _encode_cursor(shard, seq)}
            if not exhausted and last_seq is not None:
                return {"messages": out, "next": _encode_cursor(shard, last_seq)}
        return {"messages": out, "next": None}

    def redrive(self, name: str, request: RedriveRequest) -> dict[str, Any]:
        given = [
            k
            for k in ("ordering_keys", "message_ids", "failed_after")
            if getattr(request, k) is not None
        ]
        if len(given) != 1:
            raise InvalidRedrive(
                'give exactly one of "ordering_keys", "message_ids" and "failed_after"'
            )
        sub = self.subscriptions.require(name)
        report = RedriveReport()
        if request.ordering_keys is not None:
            keys = _strings(request.ordering_keys, MAX_REDRIVE_KEYS, "ordering_keys")
            found, selected = self._by_keys(sub, keys, report)
        elif request.message_ids is not None:
            ids = set(_strings(request.message_ids, MAX_REDRIVE_IDS, "message_ids"))
            found, selected = self._scan(sub, lambda e: e.message.message_id in ids, None)
        else:
            after = parse_time(request.failed_after)
            if after is None:
                raise InvalidRedrive("failed_after is epoch milliseconds or an ISO 8601 time")
            found, selected = self._scan(sub, lambda e: e.at_ms > after, after - READ_SKEW_MS)
        for key in sorted(selected):
            if report.redriven >= MAX_REDRIVE_MESSAGES:
                report.truncated = True
                break
            self._redrive_key(sub, key, found.get(key, {}), selected[key], report)
        count_metric(metrics.REDRIVEN, report.redriven)
        logger.info("dead letters redriven", extra={"subscription": name, "count": report.redriven})
        return report.document()

    def _by_keys(
        self, sub: PushSubscription, keys: list[str], report: RedriveReport
    ) -> tuple[dict[str, dict[int, _Found]], dict[str, set[int]]]:
        dlq = sub.queue(DLQ, self.prefix)
        shards = self.queues.shards(dlq.stream)
        states = self.key_states.get_many(sub.name, keys)
        found: dict[str, dict[int, _Found]] = {}
        selected: dict[str, set[int]] = {}
        for key in keys:
            state = states[key]
            if state.dlq.depth == 0:
                report.skipped.append({"ordering_key": key, "reason": "nothing_dead_lettered"})
                continue
            selected[key] = set(range(state.dlq.c.n + 1, state.dlq.p.n + 1))
            shard = shards[dlq.partition_for(key)]
            mine = found.setdefault(key, {})
            try:
                for record in self.queues.scan(
                    dlq.stream, shard, since_ms=state.dlq.since - READ_SKEW_MS, max_calls=50
                ):
                    entry = _entry_of(record.data)
                    if entry is not None and entry.ordering_key == key:
                        source = Source(dlq.stream, shard, record.sequence_number, 0, "queue")
                        mine.setdefault(entry.n, _Found(entry, source))
            except ReadBudgetExhausted:
                report.truncated = True
        return found, selected

    def _scan(
        self, sub: PushSubscription, wanted: Any, since_ms: int | None
    ) -> tuple[dict[str, dict[int, _Found]], dict[str, set[int]]]:
        dlq = sub.queue(DLQ, self.prefix)
        found: dict[str, dict[int, _Found]] = {}
        for shard in self.queues.shards(dlq.stream):
            for record in self.queues.scan(dlq.stream, shard, since_ms=since_ms, max_calls=50):
                entry = _entry_of(record.data)
                if entry is not None and wanted(entry):
                    source = Source(dlq.stream, shard, record.sequence_number, 0, "queue")
                    found.setdefault(entry.ordering_key, {}).setdefault(
                        entry.n, _Found(entry, source)
                    )
        selected = {key: set(entries) for key, entries in found.items()}
        return found, selected

    def _redrive_key(
        self,
        sub: PushSubscription,
        key: str,
        found: dict[int, _Found],
        selected: set[int],
        report: RedriveReport,
    ) -> None:
        rq = sub.queue(RQ, self.prefix)
        for _ in range(_MAX_CONFLICTS):
            state = self.key_states.get(sub.name, key)
            if state.rq.blocks(sub.skip_before_ms):
                self._resume_redrive(sub, state)
                report.skipped.append({"ordering_key": key, "reason": "retry_pending"})
                return
            plan: list[_Found] = []
            n = state.dlq.c.n + 1
            room = MAX_REDRIVE_MESSAGES - report.redriven
            while n <= state.dlq.p.n and n in selected and len(plan) < room:
                item = found.get(n) or self._repair(state, n)
                if item is None:
                    break
                plan.append(item)
                n += 1
            if not plan:
                reason = (
                    "older_dead_letter_pending"
                    if any(m > state.dlq.c.n for m in selected)
                    else "nothing_dead_lettered"
                )
                report.skipped.append({"ordering_key": key, "reason": reason})
                return
            new = state
            reservations: list[EntryReservation] = []
            now = self.clock.now_ms()
            for item in plan:
                entry = item.entry
                new = new.consume(DLQ, entry.n, entry.main)
                if entry.message.published_at_ms < sub.skip_before_ms:
                    continue  # skipped by a seek: consumed, not redelivered
                reservations.append(
                    EntryReservation(
                        queue=RQ,
                        n=state.rq.p.n + 1 + len(reservations),
                        message_id=entry.message.message_id,
                        main=entry.main,
                        source=item.source,
                        attempts=0,
                        due_ms=now,
                        reason=None,
                        status=None,
                        at_ms=now,
                        published_at_ms=entry.message.published_at_ms,
                    )
                )
            saved = self.key_states.save(sub.name, key, new.reserve("rd", reservations))
            if saved is None:
                continue
            by_id = {item.entry.message.message_id: item.entry.message for item in plan}
            for reservation in reservations:
                self.queues.put(rq, reservation.entry(by_id[reservation.message_id]))
            report.redriven += len(reservations)
            report.keys.append(key)
            if any(m >= n for m in selected):
                report.skipped.append({"ordering_key": key, "reason": "older_dead_letter_pending"})
            return
        report.skipped.append({"ordering_key": key, "reason": "busy"})

    def _resume_redrive(self, sub: PushSubscription, state: KeyState) -> None:
        """Put again the entries of an earlier redrive of the key that RQ may lack (it failed
        after its reservation); the consumer drops the ones it has."""
        rq = sub.queue(RQ, self.prefix)
        for reservation in state.reserved("rd"):
            if reservation.n > state.rq.c.n:
                message = self.queues.read_message(reservation.source)
                if message is not None:
                    self.queues.put(rq, reservation.entry(message))

    def _repair(self, state: KeyState, n: int) -> _Found | None:
        """A DLQ entry that was reserved but never put: read from where its message is."""
        reservation = state.reservation_for(DLQ, n)
        if reservation is None:
            return None
        message = self.queues.read_message(reservation.source)
        if message is None:
            return None
        return _Found(reservation.entry(message), reservation.source)
