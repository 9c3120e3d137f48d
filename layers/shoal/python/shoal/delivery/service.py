"""Get and ack, exactly once per session.

Get and ack
-----------
The session's delivery state is one small item (``#state``): a cursor per source (the last
position handed out), the next delivery *ordinal*, the ack floor (every ordinal below it is
done) with the acked ordinals above it, and *runs*: the ranges of positions each get handed
out, with their first ordinal, time and channel. A delivery's id is ``<session id>.<ordinal>``.
Ack marks ordinals done and moves the floor: one small write however many ids. A run whose
messages are not all acked after the ack timeout, or that went to another channel (a
reconnect), is read back from the inbox and delivered again with ``dup`` true; the ordinals are
recomputed the same way, so an id never changes. QoS 0 deliveries are done as they are handed
out (at most once). A routed delivery of a message a subscribe sent as retained (the state's
marks, ``shoal.delivery.subscriptions``) is consumed without going out. Deliveries that name
their archive lines (``shoal.delivery.codec``, version 2) are filled from the archive, one
ranged GET per object a page covers, before the state write that hands them out. Consumed deliveries
are never deleted one by one: TTL removes them (``SHOAL_INBOX_RETENTION_S``, 14 days by
default, is also how long an offline session's messages wait).

Every write of the state is conditional on its version, so racing gets and acks of one session
serialize; every call checks first that its channel is the live one. Positions make delivery
idempotent a second time over: a cursor only moves forward, so a delivery written twice (under
another key) is still handed out once. A long poll reads the inbox after 0.1 s, then 1.5 times
later each time (at most every second), so a 20 s wait costs about 25 reads, not 200. Each
re-read looks at every source (``shoal.delivery.scan``), eventually consistent at half the
price, and reads consistently only what it hands out.

Order: within one source (a storage shard) deliveries are written and handed out in position
order, so messages of one ordering key arrive in publish order. Sources are read one after the
other, earlier storage topics first; after SwitchProduce, a later storage topic's items are
held until the earlier ones are drained and handed out (``shoal.drain``), so a key's order
holds across storage topics too.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from shoal.core import metrics
from shoal.core.auth import Principal
from shoal.core.clock import Clock, SystemClock
from shoal.core.config import DeliverySettings
from shoal.core.errors import (
    BadRequest,
    Forbidden,
    ServerBusy,
    SessionNotFound,
    SessionTakenOver,
)
from shoal.core.observability import count, logger
from shoal.core.retry import backoff_s
from shoal.delivery.events import EventBatch, Recording, record_answers
from shoal.delivery.gate import SessionGate
from shoal.delivery.inbox import (
    DeliveryState,
    Given,
    InboxMessage,
    InboxStore,
    LineCache,
    PayloadStore,
    SessionRun,
    delivery_id,
    ordinal_of,
)
from shoal.delivery.model import (
    ATTEMPTS,
    MAX_GET,
    MAX_POLL_INTERVAL_S,
    MAX_SCAN_PER_GET,
    MAX_WAIT_MS,
    POLL_INTERVAL_S,
    RETAINED_SOURCE,
    AckRequest,
    Position,
    retained_mark,
)
from shoal.delivery.ports import SharedGroups
from shoal.delivery.scan import Found, InboxScan, ScanStart
from shoal.delivery.subscriptions import channel_of
from shoal.sessions.model import Channel, Head
from shoal.sessions.registry import SessionRegistry

# --- get and ack ---------------------------------------------------------------------------------


@dataclass
class _Plan:
    state: DeliveryState
    #: the archive lines this get read (kept across its attempts)
    lines: LineCache = field(default_factory=dict)
    out: list[dict[str, Any]] = field(default_factory=list)
    changed: bool = False
    #: new deliveries done without going out, and why (delivery events: ``dropped``)
    dropped: list[tuple[InboxMessage, str]] = field(default_factory=list)
    #: where each delivery of ``out`` is, by id: (source, position, the item's storage stream
    #: when the drain gates it, ``InboxItem.stream``)
    positions: dict[str, Position] = field(default_factory=dict)
    #: the first new message left waiting behind a full window: (source, position)
    waiting: tuple[str, str] | None = None


@dataclass(frozen=True)
class SessionRead:
    """A session's head and delivery state as one batch read found them (``read_sessions``):
    a get that starts from them reads neither again. A stale copy costs what it costs a get
    that keeps its state across idle polls: a failed conditional write, and a read again."""

    head: Head | None
    state: DeliveryState
    #: False: read eventually consistent (an ack's, ``ack_opening``), so either may predate
    #: the session's last writes
    consistent: bool = True


class DeliveryService:
    """Get and ack for a live channel."""

    def __init__(
        self,
        registry: SessionRegistry,
        inbox: InboxStore,
        settings: DeliverySettings,
        clock: Clock | None = None,
        payloads: PayloadStore | None = None,
        *,
        groups: SharedGroups | None = None,
        events: Recording | None = None,
        drain: SessionGate | None = None,
    ) -> None:
        self.registry = registry
        self.inbox = inbox
        self.settings = settings
        self.clock = clock or SystemClock()
        self.payloads = payloads
        #: the group streams the session leases (``shoal.groups``)
        self.groups = groups
        #: delivery events (``shoal.delivery.events``); None records nothing
        self.events = events
        self.scans = InboxScan(inbox, drain)

    @property
    def drain(self) -> SessionGate | None:
        """What holds a later storage topic's items back (``InboxScan.drain``)."""
        return self.scans.drain

    @drain.setter
    def drain(self, gate: SessionGate | None) -> None:
        self.scans.drain = gate

    # -- get

    def read_sessions(
        self, sessions: Iterable[tuple[str, str]], *, consistent: bool = True
    ) -> dict[str, SessionRead]:
        """The heads and delivery states of ``sessions`` (client id, session id), strongly
        consistent unless asked otherwise, in one batch read for up to 50 sessions (not two
        reads each), by session id: what a router's push to the sessions a batch wrote to
        starts from."""
        return self._read_sessions(sorted(set(sessions)), consistent)

    def _read_sessions(
        self, pairs: list[tuple[str, str]], consistent: bool
    ) -> dict[str, SessionRead]:
        if not pairs:
            return {}
        repository = self.registry.repository
        keys: list[tuple[str, Mapping[str, Any]]] = [
            (repository.table, repository.head_key(c)) for c, _ in pairs
        ]
        keys += [(self.inbox.table, self.inbox.state_key(s)) for _, s in pairs]
        heads: dict[str, Head] = {}
        states: dict[str, DeliveryState] = {}
        for table, row in self.inbox.dynamo.batch_get_tables(keys, consistent=consistent):
            if table == self.inbox.table:
                states[str(row["inbox"])] = DeliveryState.from_record(row)
            elif table == repository.table:
                heads[str(row["client_id"])] = repository.head_of(row)
        return {
            s: SessionRead(heads.get(c), states.get(s) or DeliveryState(), consistent)
            for c, s in pairs
        }

    def get(
        self,
        who: Principal,
        client_id: str,
        channel: Channel | None,
        max_messages: int = 10,
        wait_ms: int = 0,
        *,
        window: int | None = None,
        lines: LineCache | None = None,
        source: str | None = None,
        known: SessionRead | None = None,
        events: EventBatch | None = None,
        given: Given | None = None,
        positions: dict[str, Position] | None = None,
        waiting: dict[str, str] | None = None,
        held: set[str] | None = None,
    ) -> dict[str, Any]:
        """``window``: the session's in-flight window when it is not the service's (a
        WebSocket client's Receive Maximum, ``shoal.edge``). ``lines``: archive lines the
        caller holds already (the router's push: the lines its batch just wrote), so that
        deliveries naming them are filled without reading the archive back. ``source``: new
        deliveries are looked for in that source only, from its cursor on (the router's push
        of the batch it wrote: one query, not a walk over every source's consumed items); what
        waits in other sources is left to the next get without it. ``known``: the session's
        head and state as the caller read them (``read_sessions``), not read again. ``events``:
        where the get's delivery events go instead of their own append (the caller appends
        them, before the deliveries go out). ``given``: the items the caller wrote of ``source``
        for this session (the router's, carried by its push), handed out without being read
        back when the session's cursor stands where they follow (``Given``). ``positions``:
        filled with the source, position and gated storage stream of each delivery handed out
        from the inbox, by id (a push orders the QoS 0 frames it carries among them).
        ``waiting``: filled with the position of the first new message the session's full
        window left waiting, by source (a QoS 0 frame carried past it would overtake it).
        ``held``: filled with the sources whose items the drain's gate held back
        (``shoal.drain``): a push has them pushed again once the gate may be open."""
        if max_messages < 1:
            raise BadRequest("max is at least 1", field="max")
        if wait_ms < 0:
            raise BadRequest("wait_ms is not negative", field="wait_ms")
        if known is not None and known.head is not None:
            head = self.registry.live_as_read(who, client_id, channel, known.head)
        else:
            head = self.registry.require_live(who, client_id, channel)
        channel = channel_of(head)
        session_id = head.session_id or ""
        wanted = min(max_messages, MAX_GET)
        deadline = self.clock.now_ms() + min(wait_ms, MAX_WAIT_MS)
        waited = False
        interval = POLL_INTERVAL_S
        # kept across idle polls: a stale copy only costs a failed conditional write
        state: DeliveryState | None = known.state if known is not None else None
        # a copy: the get adds the lines it reads, and callers share theirs between threads
        read: LineCache = dict(lines or {})
        start = ScanStart()
        while True:
            out: list[dict[str, Any]] = []
            for attempt in range(ATTEMPTS):
                if state is None:
                    state = self.inbox.state(session_id)
                expected = state.version
                now = self.clock.now_ms()
                plan = self._plan(
                    session_id=session_id,
                    head=head,
                    state=state,
                    channel=channel,
                    wanted=wanted,
                    now=now,
                    lines=read,
                    window=window or self.settings.window,
                    source=source,
                    start=start,
                    given=given,
                    peek=waiting is not None,
                )
                if waiting is not None and plan.waiting is not None:
                    waiting.setdefault(*plan.waiting)
                if held is not None:
                    held |= start.held
                if not plan.changed:
                    break
                if waited:
                    # time passed: hand nothing to a channel that lost the session meanwhile
                    head = self.registry.require_live(who, client_id, channel)
                plan.state.version = expected + 1
                # this get serves what an ack's opened window owed (``ack_opening``)
                plan.state.push_owed = False
                plan.state.normalize()
                expires = now // 1000 + self.settings.retention_s
                if self.inbox.write_state(session_id, plan.state, expected, expires):
                    out = plan.out
                    if positions is not None:
                        positions.update(plan.positions)
                    self._record_get(session_id, client_id, plan, events)
                    break
                state = None
                self.clock.sleep(backoff_s(attempt, 0.01, 0.2))
            else:
                raise ServerBusy("this session's deliveries are contended; retry")
            if self.groups is not None and len(out) < wanted:
                out += self.groups.get(session_id, head.subscriptions, wanted - len(out), channel)
            if out:
                redelivered = sum(1 for m in out if m.get("dup"))
                count(metrics.DELIVERED, len(out) - redelivered)
                count(metrics.REDELIVERED, redelivered)
                return {"messages": out}
            left_ms = deadline - self.clock.now_ms()
            if left_ms <= 0:
                return {"messages": []}
            # each idle poll reads the inbox: back off, so a long wait costs few reads
            self.clock.sleep(min(interval, left_ms / 1000))
            interval = min(interval * 1.5, MAX_POLL_INTERVAL_S)
            waited = True
            start.idle = True

    def _plan(
        self,
        *,
        session_id: str,
        head: Head,
        state: DeliveryState,
        channel: Channel,
        wanted: int,
        now: int,
        lines: LineCache,
        window: int,
        source: str | None = None,
        start: ScanStart | None = None,
        given: Given | None = None,
        peek: bool = False,
    ) -> _Plan:
        """``peek``: where the window stops new deliveries, the first message it leaves
        waiting is looked for (``_Plan.waiting``)."""
        plan = _Plan(state, lines)
        if state.marks and state.forget(now, _sids(head)):
            plan.changed = True
        self._redeliver(session_id, plan, channel, wanted, now)
        window_left = window - state.in_flight()
        if len(plan.out) < wanted and window_left > 0:
            self._deliver_new(
                session_id=session_id,
                head=head,
                plan=plan,
                channel=channel,
                wanted=wanted,
                window_left=window_left,
                now=now,
                source=source,
                start=start,
                given=given,
                peek=peek,
            )
        elif peek and window_left <= 0:
            plan.waiting = _where(next(self.scans.scan(session_id, state, source, start), None))
        return plan

    def _redeliver(
        self, session_id: str, plan: _Plan, channel: Channel, wanted: int, now: int
    ) -> None:
        state = plan.state
        timeout_ms = int(self.settings.ack_timeout_s * 1000)
        for run in sorted(state.runs, key=lambda r: r.first):
            if len(plan.out) >= wanted:
                return
            due = run.channel != channel or run.sent_at_ms + timeout_ms <= now
            if not due:
                continue
            found = self.scans.read_run(session_id, run)
            if found is None:
                # its deliveries are gone (retention ran out): nothing left to redeliver
                logger.warning("in-flight deliveries expired before their ack")
                state.acked.update(range(run.first, run.end))
                plan.changed = True
                continue
            pending = [(n, f) for n, f in enumerate(found) if not state.done(run.first + n)]
            room = wanted - len(plan.out)
            taken = pending[:room]
            filled = self._fill(plan, [f.message for _, f in taken])
            for (n, _), message in zip(taken, filled, strict=True):
                if message is None:
                    # its archive line is gone: nothing left to send again
                    state.acked.add(run.first + n)
                    continue
                # a run's items are not read for their stream: a delivery sent again is of a
                # storage topic the session has had, which no QoS 0 frame of an earlier one
                # may follow (``PushWorker._gated``)
                self._give(
                    plan, session_id, run.first + n, message, dup=True, now=now, source=run.source
                )
            plan.changed = True
            if len(taken) == len(pending):
                run.sent_at_ms, run.channel = now, channel
                continue
            # split: the part handed out now, and the rest, still due
            cut = taken[-1][0] + 1
            rest_first = found[cut]
            state.runs.remove(run)
            state.runs.append(
                replace(
                    run,
                    count=cut,
                    upto=found[cut - 1].message.position,
                    sent_at_ms=now,
                    channel=channel,
                )
            )
            state.runs.append(
                replace(
                    run,
                    first=run.first + cut,
                    count=run.count - cut,
                    after=found[cut - 1].message.position,
                    start_item=rest_first.item.key,
                )
            )
            return

    def _deliver_new(
        self,
        *,
        session_id: str,
        head: Head,
        plan: _Plan,
        channel: Channel,
        wanted: int,
        window_left: int,
        now: int,
        source: str | None = None,
        start: ScanStart | None = None,
        given: Given | None = None,
        peek: bool = False,
    ) -> None:
        state = plan.state
        new_runs: dict[str, SessionRun] = {}
        scan = self.scans.scan(session_id, state, source, start, given)
        scanned = 0
        recording = self.events is not None and self.events.enabled
        while True:
            # this round's messages to hand out, (ordinal, found): a retained mark may still
            # consume one, which its message id tells once its archive line is read
            chosen: list[tuple[int, Found]] = []
            unwanted: list[tuple[Found, str]] = []
            while (
                len(plan.out) + len(chosen) < wanted
                and window_left > 0
                and scanned < MAX_SCAN_PER_GET
            ):
                found = next(scan, None)
                if found is None:
                    break
                scanned += 1
                ordinal = self._hand_out(state, new_runs, found, channel, now)
                plan.changed = True
                if not self._wanted(head, found, now):
                    # expired, or its subscription is gone: done without being sent
                    state.acked.add(ordinal)
                    unwanted.append((found, _drop_reason(found, now)))
                    continue
                chosen.append((ordinal, found))
                if found.message.qos:
                    window_left -= 1
            # one read of the archive for the round's lines (the dropped ones' only for their
            # delivery events)
            told = unwanted if recording else []
            filled = self._fill(plan, [f.message for _, f in chosen] + [f.message for f, _ in told])
            for (found, why), message in zip(told, filled[len(chosen) :], strict=True):
                plan.dropped.append((message or found.message, why))
            plan.dropped += [(f.message, why) for f, why in unwanted[len(told) :]]
            consumed = False
            for (ordinal, found), message in zip(chosen, filled, strict=False):
                # None: its archive line is gone (dropped as expired)
                reason = None
                if message is not None and found.source != RETAINED_SOURCE and state.marks:
                    mark = retained_mark(message.sid, message.message_id)
                    if state.marks.pop(mark, None) is not None:
                        # the subscription got this message as retained when it was made: the
                        # router was behind on it (MQTT 5 §3.8.3.1, §4.1: a message published
                        # before the SUBSCRIBE reaches it as retained only); the router writes
                        # one copy per session, so the mark has done its work
                        reason = "retained"
                if message is None or reason is not None:
                    state.acked.add(ordinal)
                    plan.dropped.append((message or found.message, reason or "expired"))
                    consumed = True
                    if found.message.qos:
                        window_left += 1
                    continue
                self._give(
                    plan,
                    session_id,
                    ordinal,
                    message,
                    dup=False,
                    now=now,
                    source=found.source,
                    stream=found.item.stream,
                )
                if message.qos == 0:
                    state.acked.add(ordinal)  # at most once: done as it goes out
            if not consumed:
                if peek and window_left <= 0:
                    plan.waiting = _where(next(scan, None))
                return
            # room left by consumed ones: the scan goes on where it stopped

    def _hand_out(
        self,
        state: DeliveryState,
        new_runs: dict[str, SessionRun],
        found: Found,
        channel: Channel,
        now: int,
    ) -> int:
        """The next ordinal for ``found``, in its source's run of this get; the cursor past it."""
        message = found.message
        ordinal = state.next_ordinal
        state.next_ordinal += 1
        run = new_runs.get(found.source)
        if run is None:
            run = SessionRun(
                first=ordinal,
                count=0,
                source=found.source,
                after=state.cursors.get(found.source, ""),
                upto=message.position,
                start_item=found.item.key,
                sent_at_ms=now,
                channel=channel,
            )
            new_runs[found.source] = run
            state.runs.append(run)
        run.count += 1
        run.upto = message.position
        state.cursors[found.source] = message.position
        if found.last_in_item:
            state.partial.pop(found.source, None)
        else:
            state.partial[found.source] = found.item.key
        return ordinal

    def _fill(self, plan: _Plan, messages: list[InboxMessage]) -> list[InboxMessage | None]:
        """``messages`` with their content: deliveries by reference read from the archive (one
        ranged GET per object, ``PayloadStore.fill``), before the state that hands them out is
        written, so a failed read hands nothing out."""
        if not any(m.pending for m in messages):
            return list(messages)
        if self.payloads is None:
            raise RuntimeError("deliveries by reference need the archive bucket")
        return self.payloads.fill(messages, plan.lines)

    def _wanted(self, head: Head, found: Found, now: int) -> bool:
        """Whether a new delivery goes out: not expired, and its subscription still stands."""
        message = found.message
        if message.expires_at_ms is not None and message.expires_at_ms <= now:
            return False
        if found.item.expires_at and found.item.expires_at * 1000 <= now:
            return False
        option = head.subscriptions.get(message.subscription)
        return option is not None and option.get("sid") == message.sid

    def _give(
        self,
        plan: _Plan,
        session_id: str,
        ordinal: int,
        message: InboxMessage,
        *,
        dup: bool,
        now: int,
        source: str,
        stream: str | None = None,
    ) -> None:
        """``message`` handed out as ordinal ``ordinal``: its answer, and where it is."""
        answer = self._answer(session_id, ordinal, message, dup, now)
        plan.out.append(answer)
        plan.positions[answer["id"]] = Position(source, message.position, stream)

    def _answer(
        self, session_id: str, ordinal: int, message: InboxMessage, dup: bool, now: int
    ) -> dict[str, Any]:
        assert not message.pending, "a delivery by reference is filled before it is answered"
        properties = dict(message.properties)
        if message.expires_at_ms is not None:
            # MQTT 5: the expiry a receiver sees is what is left of it
            properties["message_expiry_s"] = max(0, (message.expires_at_ms - now) // 1000)
        payload = message.payload
        if message.payload_ref is not None and self.payloads is not None:
            payload = self.payloads.get(message.payload_ref)
        return {
            "id": delivery_id(session_id, ordinal),
            "message_id": message.message_id,
            "topic": message.topic,
            "payload": base64.b64encode(payload).decode("ascii"),
            "qos": message.qos,
            "retain": message.retain,
            "dup": dup,
            "subscription": message.subscription,
            "properties": properties,
            "published_at": message.published_at_ms,
        }

    def _record_get(
        self, session_id: str, client_id: str, plan: _Plan, batch: EventBatch | None = None
    ) -> None:
        """The delivery events of a get whose state write succeeded: one object, keyed by the
        state version it wrote (a retried get writes another version, so its own object)."""
        if self.events is None or not self.events.enabled:
            return

        events = self.events.new()
        record_answers(events, "session", session_id, plan.out, label=client_id)
        for message, reason in plan.dropped:
            events.add(
                "dropped",
                "session",
                session_id,
                message_id=message.message_id,
                topic=message.topic,
                published_at=message.published_at_ms,
                qos=message.qos,
                reason=reason,
                label=client_id,
            )
        hint = f"get/{session_id}/{plan.state.version}"
        if batch is not None:
            batch.add(events, hint)
        else:
            events.flush(hint)

    def _record_ack(self, session_id: str, state: DeliveryState, ordinals: set[int]) -> None:
        """``acked`` for every requested ordinal that is done now, fresh or acked before (so a
        retried ack repairs a crash between its state write and this flush)."""
        if self.events is None or not self.events.enabled:
            return
        done = sorted(o for o in ordinals if o < state.next_ordinal and state.done(o))
        if not done:
            return
        events = self.events.new()
        for ordinal in done:
            events.add("acked", "session", session_id, delivery_id=delivery_id(session_id, ordinal))
        events.flush(f"ack/{session_id}/{state.version}/{done[0]}")

    def unsend(self, session_id: str, ordinals: set[int]) -> bool:
        """The deliveries ``ordinals`` were handed out and never went (a push whose posts were
        refused as throttled past their tries, or whose delivery events could not be
        appended): they are due again at once, so the next get or push sends them again,
        first and in order, with ``dup``. They are the tail of what one push handed out, so
        of each run they are its last ordinals: a run is cut there (read back, as a
        redelivery reads it) and only its tail made due; what went stays timed. Whether a run
        changed."""
        for attempt in range(ATTEMPTS):
            state = self.inbox.state(session_id)
            expected = state.version
            changed = False
            for run in list(state.runs):
                tail = [o for o in range(run.first, run.end) if o in ordinals]
                if not tail or run.sent_at_ms == 0:
                    continue
                changed = True
                cut = tail[0] - run.first
                if cut == 0:
                    run.sent_at_ms = 0
                    continue
                found = self.scans.read_run(session_id, run)
                if found is None:
                    run.sent_at_ms = 0  # its items are gone: nothing to cut, all due
                    continue
                state.runs.remove(run)
                state.runs.append(replace(run, count=cut, upto=found[cut - 1].message.position))
                state.runs.append(
                    replace(
                        run,
                        first=run.first + cut,
                        count=run.count - cut,
                        after=found[cut - 1].message.position,
                        start_item=found[cut].item.key,
                        sent_at_ms=0,
                    )
                )
            if not changed:
                return False
            state.version = expected + 1
            expires = self.clock.now_ms() // 1000 + self.settings.retention_s
            if self.inbox.write_state(session_id, state, expected, expires):
                return True
            self.clock.sleep(backoff_s(attempt, 0.01, 0.2))
        raise ServerBusy("this session's deliveries are contended; retry")

    # -- ack

    def ack(
        self, who: Principal, client_id: str, channel: Channel | None, request: AckRequest
    ) -> dict[str, Any]:
        return self.ack_opening(who, client_id, channel, request)[0]

    def ack_opening(
        self,
        who: Principal,
        client_id: str,
        channel: Channel | None,
        request: AckRequest,
        window: int | None = None,
        *,
        known: SessionRead | None = None,
    ) -> tuple[dict[str, Any], bool]:
        """The ack, and whether it may have let deliveries that wait go out (a pushed
        session's ack pushes only then, ``shoal.edge``). A get hands out everything it finds
        within the window, so deliveries wait only behind a full window: the ack opened room
        for them only if the state it replaced had ``window`` (the session's in-flight window,
        the service's by default) in flight, or acked group deliveries (their lanes have
        windows of their own). Racing gets and acks write the state by version, so of the acks
        that follow a get that filled the window, the first to write sees it full.

        ``known``: the session's head and state as the caller read them together
        (``read_sessions``: a WebSocket connection knows its session), not read again. Read
        eventually consistent (half the read units), they are read again, consistently, only
        where a stale copy would answer wrong: a head that refuses the channel (it may predate
        the channel's connect) or does not join a group whose deliveries the frame acks (it
        may predate the subscribe), or a state that has not handed out an id the frame acks
        yet (it may predate the push that did). Anything else stale costs a failed conditional
        write and a read again, as a stale state always did: acks only add to a state, so an
        id done in an older copy is done."""
        head = self._acking_head(who, client_id, channel, known, request.ids)
        if head is None:
            known = None
            head = self.registry.require_live(who, client_id, channel)
        session_id = head.session_id or ""
        # the state read with the head, when it is this session's (a stale one fails its write)
        state: DeliveryState | None = known.state if known is not None else None
        if known is not None and known.head is not None and known.head.session_id != session_id:
            state = None
        # group deliveries (``g-...`` ids) are acked on their streams, fenced by their lease
        grouped = self.groups.ack(session_id, head.subscriptions, request.ids) if self.groups else 0
        ordinals = {o for o in (ordinal_of(session_id, i) for i in request.ids) if o is not None}
        count(metrics.ACKED, grouped)
        opened = grouped > 0 or _shares(head)
        if not ordinals:
            return {"acked": grouped}, opened
        stale = known is not None and not known.consistent
        if state is not None and stale and max(ordinals) >= state.next_ordinal:
            # an id handed out after this copy was: done or not, only a fresh read says
            state = None
        for attempt in range(ATTEMPTS):
            if state is None:
                state = self.inbox.state(session_id)
            expected = state.version
            fresh = {o for o in ordinals if o < state.next_ordinal and not state.done(o)}
            if not fresh:
                self._record_ack(session_id, state, ordinals)
                # an earlier try of this ack opened the window and its push may never have
                # been handed over (the frame is sent again after a failure): push again
                return {"acked": grouped}, opened or state.push_owed
            full = state.in_flight() >= (window or self.settings.window)
            state.push_owed = state.push_owed or full
            state.acked |= fresh
            state.version = expected + 1
            state.normalize()
            expires = self.clock.now_ms() // 1000 + self.settings.retention_s
            if self.inbox.write_state(session_id, state, expected, expires):
                self._record_ack(session_id, state, ordinals)
                count(metrics.ACKED, len(fresh))
                return {"acked": len(fresh) + grouped}, opened or full
            state = None
            self.clock.sleep(backoff_s(attempt, 0.01, 0.2))
        raise ServerBusy("this session's deliveries are contended; retry")

    def _acking_head(
        self,
        who: Principal,
        client_id: str,
        channel: Channel | None,
        known: SessionRead | None,
        ids: list[str],
    ) -> Head | None:
        """The head ``known`` holds, when it may answer the ack of ``ids`` (``ack_opening``);
        None when there is none, or when an eventually consistent copy may be older than what
        the ack needs: it refuses the channel, or it does not join a group ``ids`` name."""
        if known is None or known.head is None:
            return None
        try:
            head = self.registry.live_as_read(who, client_id, channel, known.head)
        except (SessionNotFound, Forbidden, SessionTakenOver):
            if known.consistent:
                raise
            return None
        groups = self.groups
        if not known.consistent and groups is not None and groups.foreign(head.subscriptions, ids):
            return None
        return head


def _shares(head: Head) -> bool:
    """Whether the session subscribes to shared groups (``$share/...``)."""
    return any(
        isinstance(o, Mapping) and o.get("share") is not None for o in head.subscriptions.values()
    )


def _sids(head: Head) -> list[str]:
    return [str(o["sid"]) for o in head.subscriptions.values() if o.get("sid")]


def _where(found: Found | None) -> tuple[str, str] | None:
    return None if found is None else (found.source, found.message.position)


def _drop_reason(found: Found, now: int) -> str:
    message = found.message
    expired = message.expires_at_ms is not None and message.expires_at_ms <= now
    if expired or (found.item.expires_at and found.item.expires_at * 1000 <= now):
        return "expired"
    return "unsubscribed"
