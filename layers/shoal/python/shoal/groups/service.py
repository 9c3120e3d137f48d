"""Durable shared subscriptions: the group leader (SGL) as a state machine stored in DynamoDB.

A shared group is keyed by (ShareName, filter). It is created by its first member's subscribe,
keeps accumulating while it has members (offline durable members too), and is removed, with its
backlog, when its last member unsubscribes or its last member's session ends. The router writes
every matching message once per group into the group's *stream* for the message's source shard
(``shoal.groups.streams``); the leader leases those streams to members.

This follows the EMQX "durable shared subscriptions" design (a group leader that grants streams
to agents with versioned stream sets, revokes them, and hands them over once the agent reported
its final progress), with one change: no process runs the leader. Its state is one item, and
whichever invocation touches the group (subscribe, unsubscribe, heartbeat, get, ack, the reaper)
*advances* it: it reads the state, applies the pure transitions below, and writes the result on
condition that the group's ``version`` is still the one it read. A loser re-reads and retries.
Nothing holds a lock, so nothing can be left holding one.

The leader's state
------------------
- ``members``: session id -> the member (its client id, when it joined, its last renewal and the
  version of its stream set, bumped by every grant, revoke or loss that touches it). A member
  stays while its session's subscription does, connected or not; only *live* members (renewed
  within the lease timeout, or kept by their connection over the WebSocket API) hold streams.
- ``streams``: source -> the stream's lease: ``holder``, the lease number ``lease`` (the fence:
  bumped by every grant, like the KCL's lease counter on a take), and the state: ``granted``
  (the holder reads it), ``revoking`` (the holder finishes what it has in flight and takes no new
  message from it) or ``revoked`` (nobody holds it: never granted, or its holder's final
  progress is in, or its holder's lease expired; the next rebalance grants it).

Transitions (pure functions of a state, a member and the time; ``advance`` is the one that
invocations run): ``join``, ``leave``, ``renew``, ``add_streams``, ``expire`` (holders whose
renewal missed the lease timeout lose their streams; a revoking stream is revoked once its
holder has nothing in flight, or when its revoke outlasted the lease timeout), ``rebalance``
(balanced: each live member gets the floor or the ceiling of streams / live members; sticky: a
change moves as few streams as possible, and members that hold more keep the ceilings;
deterministic: the same state gives the same answer).

Hand-off: a stream revoked from A goes to B only when A has nothing in flight on it (its acks
are its final progress) or A's lease expired. Every progress write names the lease it was made
under and is refused unless that lease is the stream's current one and its holder is the writer
(``check_lease`` here, a condition on the stream's item in DynamoDB): a member that lost a
stream can never commit on it.

The member's side (the agent) follows the proposal's states: ``connecting`` (it has not yet
adopted the leader's stream set for it, or it lost a lease), ``replaying`` (it reads the streams
it holds) and ``updating`` (it holds new streams while finishing revoked ones). ``agent_sync``
brings a member's view up to the leader's state and says what changed: a heartbeat answers
these lease changes.

In DynamoDB (``GroupStore``), one partition per group (``shoal.aws.tables.GroupItemModel``):

- ``#sgl``, the leader: version, incarnation, members (a map, so that a join is one update
  adding its own entry: racing joins never conflict) and the streams' leases (one JSON value).
  A transition is one transaction: the leader on condition of its version, plus the fence of
  every stream whose holder, lease or state it changed, on condition of that stream's
  progress version (a holder's last get never races a hand-off).
- ``m#<session id>``: the member's last renewal and agent view. A heartbeat renews every group
  of the session, an update of each item's renewal and view (a keep, a release or a fenced
  write's mark written meanwhile stays, and a renewal never goes back); a member is live
  from its join until its first heartbeat. A member whose session is connected over the
  WebSocket API runs no function while idle: its connection *keeps* it live instead
  (``keep``; the connection, its channel and a bound on this item), until the connection
  ends (``connection_ended``, or the reaper's ``channel_expired`` for a ``$disconnect`` that
  never came).
- ``s#<source>``: one stream's fence and progress (``shoal.groups.streams``), created by the
  router the first time it writes to the stream (that is how the leader learns of streams).

Join and leave ride in the subscribe and unsubscribe transactions (one part each, so a call of
20 filters fits DynamoDB's 100 items); a leave only removes the membership, and the advance run
right after it hands the leaver's streams on (``expire`` takes the streams of non-members).
Renewals use the writers' clocks (Lambda's are synchronized); the KCL instead watches a lease
counter with its own clock, which a process-less leader cannot do.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Mapping, Sequence
from functools import partial
from typing import Any

from shoal.core.clock import Clock
from shoal.core.config import DeliverySettings
from shoal.core.errors import ServerBusy
from shoal.core.observability import logger
from shoal.core.retry import backoff_s
from shoal.delivery.events import (
    GROUP_REMOVED,
    SESSION_ENDED,
    Recording,
    record_answers,
    record_ended,
)
from shoal.delivery.inbox import InboxMessage, PayloadStore
from shoal.delivery.ports import MembershipPlan
from shoal.groups.gate import GroupGate
from shoal.groups.records import (
    Ending,
    GroupRef,
    Keep,
    Loaded,
    group_key,
    group_refs,
    held_record,
    member_record,
)
from shoal.groups.state import AgentView, agent_sync
from shoal.groups.store import ATTEMPTS, GroupStore
from shoal.groups.streams import (
    GroupDelivery,
    Handed,
    StaleLease,
    StreamProgress,
    StreamReader,
    StreamState,
    Unpinned,
    answer,
    group_partition,
    parse_delivery_id,
    serve,
    source_of,
)
from shoal.groups.streams import delivery_id as stream_delivery_id
from shoal.sessions.model import Channel
from shoal.sessions.ports import KeptBy
from shoal.topics.filters import parse_shared

# --- the member's side -------------------------------------------------------------------------


# === DynamoDB ==================================================================================

# --- records -----------------------------------------------------------------------------------


# === the session's side ========================================================================


class GroupService:
    """What sessions do with their shared groups: join and leave (inside the subscribe and
    unsubscribe transactions), heartbeat (renewal and lease changes), get and ack."""

    def __init__(
        self,
        store: GroupStore,
        reader: StreamReader,
        delivery: DeliverySettings,
        *,
        clock: Clock | None = None,
        payloads: PayloadStore | None = None,
        events: Recording | None = None,
        drain: GroupGate | None = None,
    ) -> None:
        self.store = store
        self.reader = reader
        self.delivery = delivery
        self.clock = clock or store.clock
        self.payloads = payloads
        #: delivery events (``shoal.delivery.events``) of gets and acks; None records nothing
        self.events = events
        #: streams of a later storage topic wait for the earlier ones' (``shoal.drain``)
        self.drain = drain
        self._turn = 0

    # -- membership

    def membership(
        self,
        client_id: str,
        session_id: str,
        *,
        joins: Iterable[str] = (),
        leaves: Mapping[str, Mapping[str, Any]] | None = None,
        lanes: Mapping[str, int] | None = None,
        cut_ms: int | None = None,
        kept_by: KeptBy | None = None,
    ) -> MembershipPlan:
        """The group parts of a subscribe (``joins``: filter texts; ``lanes``: the lane count
        a filter asks its group to be created with; ``cut_ms``: the cut of a group it
        creates; ``kept_by``: the connection the subscribe came on, which keeps the joining
        member live once it committed), an unsubscribe or a session's end
        (``leaves``: filter text -> the session's option for it). Read fresh on every attempt
        of the caller's transaction."""
        now = self.clock.now_ms()
        plan = MembershipPlan(member=session_id, kept_by=kept_by)
        for text in joins:
            shared = parse_shared(text)
            if shared is None:
                continue
            ref = GroupRef(text, shared[0], shared[1], 1, None, (lanes or {}).get(text))
            inc, cut, parts = self.store.join_parts(ref, session_id, client_id, now, cut_ms)
            plan.incarnations[text] = inc
            plan.cuts[text] = cut
            plan.parts += parts
            if parts and "Update" in parts[0]:
                plan.joined.append(ref.key)
        for ref in group_refs(leaves or {}):
            parts, removed = self.store.leave_parts(ref, session_id)
            plan.parts += parts
            if parts:
                plan.leavers.append((ref.key, session_id))
            if removed is not None:
                plan.removed.append((ref.key, removed))
            elif parts:
                plan.left.append(ref.key)
        return plan

    def after(self, plan: MembershipPlan) -> None:
        """Once the caller's transaction committed: the groups left hand the leaver's streams
        on, and a removed group's items and backlog go. Best effort: the next advance does
        the former, TTL the latter. The joins a connection came on are kept live by it
        (``keep``): after the commit, so that a crash between the two costs a lapse of the
        lease, as without keeps, never a keep of a member that did not join."""
        now = self.clock.now_ms()
        if plan.kept_by is not None:
            for text, incarnation in sorted(plan.incarnations.items()):
                shared = parse_shared(text)
                if shared is None:
                    continue
                try:
                    self._keep(group_key(*shared), incarnation, plan.member, plan.kept_by, now)
                except Exception:
                    # the member renews as any member does, by the functions it runs
                    logger.exception("keeping a joined member live failed")
        for key in plan.joined:
            try:
                self.store.advance(key, now, operation="join")
            except Exception:
                logger.exception("advancing a group after a join failed")
        for key in plan.left:
            try:
                self.store.advance(key, now, operation="leave")
            except Exception:
                logger.exception("advancing a group after a leave failed")
        for key, member_id in plan.leavers:
            try:
                self.drop_held(key, member_id)
            except Exception:
                # held items of a non-member are never served: the next get of any member
                # drops them (its read of the group counts them)
                logger.exception("dropping a leaver's held QoS 2 deliveries failed")
        for key, incarnation in plan.removed:
            self._record_removal(key, incarnation)
            try:
                self.store.remove_backlog(key, incarnation)
            except Exception:
                # nothing reads a removed incarnation again; TTL removes what is left
                logger.exception("removing a group's backlog failed")

    def _record_removal(self, key: str, incarnation: str) -> None:
        """The removed group's ``ended`` event: its backlog goes unserved, and the audit counts
        it dropped, not lost. Best effort, as the removal of the backlog after it."""
        try:
            record_ended(self.events, "group", key, GROUP_REMOVED, f"ended/{key}/{incarnation}")
        except Exception:
            logger.exception("recording a group's removal failed")

    def channel_expired(self, client_id: str, head: Any) -> int:
        """The reaper found a member's channel dead (keepalive): advance its groups, so that
        leases it let expire move to live members even while none of them calls. A keep of
        that channel ends first: its connection's ``$disconnect`` never came (or died before
        it released the member). How many groups it advanced."""
        now = self.clock.now_ms()
        refs = group_refs(getattr(head, "subscriptions", {}) or {})
        newest = getattr(head, "newest", None)
        session_id = getattr(head, "session_id", None)
        ending = None
        if session_id and newest is not None:
            ending = Ending(str(session_id), channel=str(newest.channel))
        for ref in refs:
            self.store.advance(ref.key, now, ending=ending, operation="reaper")
        return len(refs)

    # -- the connection's keep (a member connected over the WebSocket API)

    def keep(self, session_id: str, subscriptions: Mapping[str, Any], by: KeptBy) -> int:
        """The session's members of its groups are live while ``by`` lives, without
        renewals: one write per group (the member's item; the leader is not written). A
        subscription older than incarnations is left to its lease. Best effort: a member not
        kept renews as any member does, by the functions it runs. How many it kept."""
        now = self.clock.now_ms()
        kept = 0
        for ref in group_refs(subscriptions):
            if ref.incarnation is None:
                continue
            try:
                kept += self._keep(ref.key, ref.incarnation, session_id, by, now)
            except Exception:
                logger.exception("keeping a member live failed")
        return kept

    def _keep(self, key: str, incarnation: str, member_id: str, by: KeptBy, now: int) -> bool:
        keep = Keep(by.connection_id, by.channel, by.until_ms, now)
        return self.store.keep(key, incarnation, member_id, keep)

    def connection_ended(
        self, session_id: str, subscriptions: Mapping[str, Any], connection_id: str
    ) -> int:
        """The connection ended: the members it kept are released at once and their groups
        advance, handing their streams to live members (whom the store's ``on_granted``
        pushes). A member another connection keeps now (a takeover's, a renewal's) stays.
        Best effort per group: one that fails is left to the reaper's expiry of the channel,
        or at the latest to the keep's bound. How many groups it advanced."""
        return self._end_keeps(subscriptions, Ending(session_id, connection_id=connection_id))

    def channel_taken_over(
        self, session_id: str, subscriptions: Mapping[str, Any], channel: str
    ) -> int:
        """An HTTP connect took the session over from ``channel``: the members a connection
        kept for that channel are released at once (the connection may stay open for a while,
        refused, and its ``$disconnect`` may come much later), and their groups advance. From
        then the member is live as an HTTP member is, by renewing. A member kept for another
        channel stays. How many groups it advanced."""
        return self._end_keeps(subscriptions, Ending(session_id, channel=channel))

    def _end_keeps(self, subscriptions: Mapping[str, Any], ending: Ending) -> int:
        now = self.clock.now_ms()
        advanced = 0
        for ref in group_refs(subscriptions):
            try:
                self.store.advance(ref.key, now, ending=ending, operation="released")
                advanced += 1
            except Exception:
                logger.exception("releasing a member its connection kept failed")
        return advanced

    # -- heartbeat

    def heartbeat(self, session_id: str, subscriptions: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Renew the session's leases in all its groups (a write each) and answer what
        changed since the member last heard: new, revoking and revoked streams."""
        now = self.clock.now_ms()
        records: list[dict[str, Any]] = []
        # the fenced-off marks read, by group: the write clears these, not one written since
        # (a fenced write after the read, of which the view computed here knows nothing)
        marks: dict[str, Any] = {}
        changes: list[dict[str, Any]] = []
        for ref in group_refs(subscriptions):
            loaded = self.store.advance(
                ref.key, now, renewing=session_id, acting=session_id, operation="heartbeat"
            )
            if loaded is None or not _same(ref, loaded) or session_id not in loaded.state.members:
                continue
            if session_id in loaded.lost:
                marks[ref.key] = loaded.lost[session_id]
            view = loaded.views.get(session_id, AgentView())
            view, delta = agent_sync(view, loaded.state, session_id)
            records.append(
                member_record(
                    ref.key,
                    loaded.state.incarnation,
                    session_id,
                    now,
                    view,
                )
            )
            changes += [
                {"group": ref.text, "stream": c.stream, "lease": c.lease, "state": c.state.value}
                for c in delta
            ]
        self.store.renew_members(records, marks)
        return changes

    # -- get

    def get(
        self,
        session_id: str,
        subscriptions: Mapping[str, Any],
        wanted: int,
        channel: Channel = "",
    ) -> list[dict[str, Any]]:
        """Up to ``wanted`` messages from the streams the session holds, in each stream's order."""
        refs = group_refs(subscriptions)
        out: list[dict[str, Any]] = []
        if not refs or wanted <= 0:
            return out
        now = self.clock.now_ms()
        self._turn += 1
        # lanes of one source read the same items: once per get
        reader = self.reader.cached()
        for ref in _rotated(refs, self._turn):
            if len(out) >= wanted:
                break
            loaded = self.store.advance(ref.key, now, renewing=session_id, acting=session_id)
            if loaded is None or not _same(ref, loaded):
                continue
            for gone in sorted(loaded.held.keys() - loaded.state.members.keys()):
                self.drop_held(ref.key, gone)  # a leave's own drop failed (``after``)
            self.store.renew_if_due(loaded, session_id, now)
            mine = sorted(
                s for s, x in loaded.state.streams.items() if x.holder == session_id and x.held
            )
            if loaded.held.get(session_id):
                out += self._serve_held(ref, session_id, wanted - len(out), now, channel)
            known = self._progresses(ref.key, mine)
            for stream in _rotated(mine, self._turn):
                if len(out) >= wanted:
                    break
                out += self._serve(
                    ref,
                    loaded,
                    stream,
                    session_id,
                    wanted=wanted - len(out),
                    now=now,
                    channel=channel,
                    reader=reader,
                    progress=known.get(stream),
                )
        return out

    def _progresses(self, key: str, streams: Sequence[str]) -> dict[str, StreamProgress]:
        """The progress of the lanes among ``streams`` that share a source with another, one
        query per such source (the others are read as they are served)."""
        by_source: dict[str, list[str]] = {}
        for stream in streams:
            by_source.setdefault(source_of(stream), []).append(stream)
        out: dict[str, StreamProgress] = {}
        for source, held in by_source.items():
            if len(held) > 1:
                found = self.store.lane_progress(key, source)
                out.update({s: found[s] for s in held if s in found})
        return out

    def _serve_held(
        self, ref: GroupRef, member_id: str, wanted: int, now: int, channel: Channel
    ) -> list[dict[str, Any]]:
        """The member's QoS 2 deliveries held off the streams ([MQTT-4.8.2-4]): due again, with
        ``dup`` and their first id, on a new channel (a reconnect) or after the ack timeout."""
        if wanted <= 0:
            return []
        timeout = int(self.delivery.ack_timeout_s * 1000)
        due: list[dict[str, Any]] = []
        for record in self.store.held(ref.key, member_id):
            if len(due) >= wanted:
                break
            if record.get("ch") == channel and int(record.get("sa", 0)) + timeout > now:
                continue
            due.append(record)
        # only what is still held goes out (acked or dropped meanwhile: not again)
        still = set(self.store.mark_held_sent(due, now, channel))
        out = [json.loads(str(r["msg"])) for r in due if str(r["d"]) in still]
        if out and self.events is not None and self.events.enabled:
            events = self.events.new()
            for message in out:
                events.add(
                    "redelivered",
                    "group",
                    ref.key,
                    delivery_id=message["id"],
                    message_id=message["message_id"],
                    topic=message["topic"],
                    published_at=message["published_at"],
                    qos=message["qos"],
                    label=member_id,
                )
            events.flush(f"group-held/{ref.key}/{member_id}/{now}")
        return out

    def acked_since_by_member(
        self, delivery_ids: Mapping[str, Iterable[str]]
    ) -> dict[str, set[str]]:
        """Of group deliveries sent each session, those done since (``HeldDeliveries``)."""
        return self.store.acked_since_by_member(delivery_ids)

    def drop_held(self, key: str, member_id: str) -> int:
        """A member's session ended: its held QoS 2 deliveries go to no one ([MQTT-4.8.2-5]),
        each recorded ``dropped`` with its reason. How many."""
        records = self.store.held(key, member_id)
        gone = set(self.store.release_held(key, member_id, [str(r["d"]) for r in records]))
        if gone and self.events is not None and self.events.enabled:
            events = self.events.new()
            for record in records:
                if str(record["d"]) not in gone:
                    continue
                message = json.loads(str(record["msg"]))
                events.add(
                    "dropped",
                    "group",
                    key,
                    message_id=message["message_id"],
                    topic=message["topic"],
                    published_at=message["published_at"],
                    qos=message["qos"],
                    reason=SESSION_ENDED,
                    label=member_id,
                )
            events.flush(f"group-ended/{key}/{member_id}/{self.clock.now_ms()}")
        return len(gone)

    def _serve(
        self,
        ref: GroupRef,
        loaded: Loaded,
        source: str,
        member_id: str,
        *,
        wanted: int,
        now: int,
        channel: Channel,
        reader: StreamReader | None = None,
        progress: StreamProgress | None = None,
    ) -> list[dict[str, Any]]:
        lease = loaded.state.streams[source]
        if progress is None:
            progress = self.store.progress(ref.key, source)
        partition = group_partition(loaded.state.incarnation)
        lanes = loaded.state.lanes
        gate = self.drain
        members: Collection[str] = loaded.state.members.keys()
        for attempt in range(ATTEMPTS):
            if progress is None:
                return []
            if (progress.holder, progress.lease, progress.state) != (
                member_id,
                lease.lease,
                lease.state,
            ):
                # the fence moved since the leader was read: this lease is lost
                self.store.lost(ref.key, member_id)
                return []
            expected = progress.pv
            work = progress
            dropped: list[InboxMessage] = []
            unpinned: list[Unpinned] = []
            handed, changed = serve(
                work,
                reader=reader or self.reader,
                partition=partition,
                granted=lease.state is StreamState.GRANTED,
                qos=ref.qos,
                wanted=wanted,
                window=self.delivery.window,
                now_ms=now,
                ack_timeout_ms=int(self.delivery.ack_timeout_s * 1000),
                channel=channel,
                admit=None if gate is None else partial(gate.admits, ref.key, partition, lanes),
                dropped=dropped,
                lanes=lanes,
                member_id=member_id,
                members=members,
                unpinned=unpinned,
            )
            if not changed:
                if lease.state is StreamState.REVOKING and work.in_flight() == 0:
                    self.store.advance(ref.key, now, operation="revoked")
                return []
            work.pv = expected + 1
            held = [
                held_record(
                    ref.key,
                    loaded.state.incarnation,
                    u.member,
                    stream_delivery_id(ref.key, source, u.delivery_id_lease, u.ordinal),
                    answer(
                        group_key=ref.key,
                        source=source,
                        lease=u.delivery_id_lease,
                        handed=Handed(u.ordinal, u.message, True),
                        subscription=ref.text,
                        qos=ref.qos,
                        now_ms=now,
                        payloads=self.payloads,
                    ),
                )
                for u in unpinned
                if not u.ended
            ]
            if self.store.save_progress_holding(ref.key, work, expected, member_id, held):
                if lease.state is StreamState.REVOKING and work.in_flight() == 0:
                    # nothing left in flight: that was the final progress, hand it over
                    self.store.advance(ref.key, now, operation="revoked")
                answers = [
                    answer(
                        group_key=ref.key,
                        source=source,
                        lease=lease.lease,
                        handed=h,
                        subscription=ref.text,
                        qos=ref.qos,
                        now_ms=now,
                        payloads=self.payloads,
                    )
                    for h in handed
                ]
                ended = [(u.member, u.message) for u in unpinned if u.ended]
                if (
                    self.events is not None
                    and self.events.enabled
                    and (answers or dropped or ended)
                ):
                    events = self.events.new()
                    record_answers(events, "group", ref.key, answers, label=member_id)
                    reasons = [("expired", member_id, m) for m in dropped]
                    # [MQTT-4.8.2-5]: a QoS 2 message whose member's session ended before it
                    # was acked goes to no other member
                    reasons += [(SESSION_ENDED, owner, m) for owner, m in ended]
                    for reason, label, message in reasons:
                        events.add(
                            "dropped",
                            "group",
                            ref.key,
                            message_id=message.message_id,
                            topic=message.topic,
                            published_at=message.published_at_ms,
                            qos=message.qos,
                            reason=reason,
                            label=label,
                        )
                    events.flush(f"group-get/{ref.key}/{source}/{work.pv}")
                return answers
            if held:
                # refused perhaps because a member it held for left: dropped on the retry
                members = self.store.member_ids(ref.key, loaded.state.incarnation)
            progress = self.store.progress(ref.key, source)
            self.clock.sleep(backoff_s(attempt, 0.005, 0.2))
        raise ServerBusy("this group stream is contended; retry")

    # -- ack

    def foreign(self, subscriptions: Mapping[str, Any], ids: Iterable[str]) -> bool:
        """Whether some of ``ids`` are deliveries of a group ``subscriptions`` do not join,
        which ``ack`` passes over (a group left, or joined after this copy of them was read)."""
        keys = {r.key for r in group_refs(subscriptions)}
        parsed = (parse_delivery_id(text) for text in ids)
        return any(p is not None and p.group_key not in keys for p in parsed)

    def ack(self, session_id: str, subscriptions: Mapping[str, Any], ids: Iterable[str]) -> int:
        """Ack group deliveries; ids of other deliveries are the caller's. How many were new."""
        refs = {r.key: r for r in group_refs(subscriptions)}
        wanted: dict[tuple[str, str], dict[int, set[int]]] = {}
        for text in ids:
            parsed = parse_delivery_id(text)
            if parsed is None or parsed.group_key not in refs:
                continue
            by_lease = wanted.setdefault((parsed.group_key, parsed.source), {})
            by_lease.setdefault(parsed.lease, set()).add(parsed.ordinal)
        total = 0
        known: dict[str, dict[str, StreamProgress]] = {}
        for key in sorted({k for k, _ in wanted}):
            # lanes of one source acked together are read in one query
            known[key] = self._progresses(key, [s for k, s in wanted if k == key])
        for (key, source), by_lease in sorted(wanted.items()):
            total += self._ack_stream(
                refs[key], source, by_lease, session_id, known[key].get(source)
            )
        return total

    def _ack_stream(
        self,
        ref: GroupRef,
        source: str,
        by_lease: Mapping[int, set[int]],
        member_id: str,
        known: StreamProgress | None = None,
    ) -> int:
        released = 0
        for attempt in range(ATTEMPTS):
            progress = known if known is not None and attempt == 0 else None
            if progress is None:
                progress = self.store.progress(ref.key, source)
            if progress is None or (
                ref.incarnation is not None and progress.incarnation != ref.incarnation
            ):
                return released
            if attempt == 0:
                # ids of a lease the member no longer holds may be QoS 2 deliveries held for
                # it off the stream ([MQTT-4.8.2-4]): acked there, and not fenced below
                stale = [
                    stream_delivery_id(ref.key, source, lease, o)
                    for lease, ordinals in sorted(by_lease.items())
                    if lease != progress.lease or progress.holder != member_id
                    for o in sorted(ordinals)
                ]
                if stale:
                    gone = self.store.release_held(ref.key, member_id, stale)
                    released = len(gone)
                    self._record_held_acks(ref, member_id, gone)
                    taken = {parse_delivery_id(d) for d in gone}
                    by_lease = {
                        lease: {
                            o
                            for o in ordinals
                            if GroupDelivery(ref.key, source, lease, o) not in taken
                        }
                        for lease, ordinals in by_lease.items()
                    }
                    by_lease = {lease: o for lease, o in by_lease.items() if o}
                    if not by_lease:
                        return released
            expected = progress.pv
            count = 0
            fenced = False
            for lease, ordinals in sorted(by_lease.items()):
                try:
                    count += progress.ack(member_id, lease, ordinals)
                except StaleLease:
                    fenced = True
            if fenced:
                self.store.lost(ref.key, member_id)
            if count == 0:
                self._record_acks(ref, source, by_lease, progress, member_id)
                return released
            progress.pv = expected + 1
            if self.store.save_progress(ref.key, progress, expected, member_id):
                if progress.state is StreamState.REVOKING and progress.in_flight() == 0:
                    # the holder's final progress: hand the stream over now
                    self.store.advance(ref.key, self.clock.now_ms(), operation="revoked")
                self._record_acks(ref, source, by_lease, progress, member_id)
                return count + released
            self.clock.sleep(backoff_s(attempt, 0.005, 0.2))
        raise ServerBusy("this group stream is contended; retry")

    def _record_held_acks(self, ref: GroupRef, member_id: str, delivery_ids: list[str]) -> None:
        if not delivery_ids or self.events is None or not self.events.enabled:
            return
        events = self.events.new()
        for did in delivery_ids:
            events.add("acked", "group", ref.key, delivery_id=did, label=member_id)
        events.flush(f"group-held-ack/{ref.key}/{member_id}/{delivery_ids[0]}")

    def _record_acks(
        self,
        ref: GroupRef,
        source: str,
        by_lease: Mapping[int, set[int]],
        progress: StreamProgress,
        member_id: str,
    ) -> None:
        """``acked`` for every requested delivery of the current lease that is done now, fresh
        or acked before (a retried ack repairs a crash between its write and this flush)."""
        if self.events is None or not self.events.enabled:
            return
        done = sorted(o for o in by_lease.get(progress.lease, ()) if progress.is_done(o))
        if not done:
            return
        events = self.events.new()
        for ordinal in done:
            events.add(
                "acked",
                "group",
                ref.key,
                delivery_id=stream_delivery_id(ref.key, source, progress.lease, ordinal),
                label=member_id,
            )
        events.flush(f"group-ack/{ref.key}/{source}/{progress.pv}/{progress.lease}/{done[0]}")

    # -- the session document

    def describe(self, session_id: str, subscriptions: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The session's groups with the streams it holds (``GET /v1/sessions/{client_id}``)."""
        out: list[dict[str, Any]] = []
        for ref in group_refs(subscriptions):
            loaded = self.store.load(ref.key)
            if loaded is None or not _same(ref, loaded):
                continue
            out.append(
                {
                    "group": ref.text,
                    "members": len(loaded.state.members),
                    "lanes": loaded.state.lanes,
                    "leases": [
                        {"stream": s, "lease": x.lease, "state": x.state.value}
                        for s, x in sorted(loaded.state.holdings(session_id).items())
                    ],
                }
            )
        return out


def _same(ref: GroupRef, loaded: Loaded) -> bool:
    return ref.incarnation is None or ref.incarnation == loaded.state.incarnation


def _rotated(items: Sequence[Any], turn: int) -> list[Any]:
    if not items:
        return []
    cut = turn % len(items)
    return [*items[cut:], *items[:cut]]


class StreamRegistrar:
    """The router's side: makes each (group, source) it writes to known to the leader once."""

    def __init__(self, store: GroupStore, limit: int = 100_000) -> None:
        self.store = store
        self.limit = limit
        self._known: set[tuple[str, str, str]] = set()

    def ensure(self, key: str, incarnation: str, source: str) -> None:
        marker = (key, incarnation, source)
        if marker in self._known:
            return
        self.store.ensure_stream(key, incarnation, source)
        if len(self._known) >= self.limit:
            self._known.clear()
        self._known.add(marker)
