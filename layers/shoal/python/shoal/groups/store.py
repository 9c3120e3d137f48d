"""The group store: a group's leader and member items in DynamoDB, written with conditional
writes (the state machine in ``shoal.groups.state`` decides, this module persists)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from shoal.aws import tables
from shoal.aws.dynamo import Dynamo, to_item
from shoal.core import metrics
from shoal.core.clock import Clock, SystemClock
from shoal.core.config import Config, GroupSettings
from shoal.core.errors import ServerBusy
from shoal.core.observability import count
from shoal.core.retry import backoff_s
from shoal.groups.held import HeldDeliveries
from shoal.groups.members import ATTEMPTS, MemberItems
from shoal.groups.records import (
    HELD_PREFIX,
    KEEP_ATTRIBUTES,
    LEADER,
    MEMBER_PREFIX,
    Ending,
    GroupRef,
    GroupStats,
    Keep,
    Loaded,
    agent_view,
    default_lanes,
    leader_record,
    new_incarnation,
)
from shoal.groups.state import (
    AgentView,
    GroupState,
    Member,
    StreamLease,
    add_streams,
    advance,
    concerns,
    freed_for,
    granted_to,
    join,
    new_group,
    release,
    renew,
)
from shoal.groups.streams import (
    FENCE_ATTRIBUTES,
    STREAM_PREFIX,
    Fence,
    StreamProgress,
    StreamState,
    group_partition,
    source_of,
    stream_item,
)

#: items of a removed group's backlog deleted at once; TTL removes the rest
MAX_BACKLOG_DELETE = 1000


class GroupStore(HeldDeliveries, MemberItems):
    """The groups table: leaders, members' renewals, streams' progress."""

    def __init__(
        self,
        dynamo: Dynamo,
        table: str,
        inbox_table: str,
        *,
        settings: GroupSettings | None = None,
        clock: Clock | None = None,
        stats: GroupStats | None = None,
        partitions_of: Callable[[str], int | None] | None = None,
    ) -> None:
        #: a filter -> the partitions of the topic it reads (a new group's lane count)
        self.partitions_of = partitions_of
        #: told the members a committed transition granted streams to (but the member whose
        #: call it was): a member connected over the WebSocket API runs no function while it
        #: is idle, so whoever hands it a stream pushes it (``shoal.edge.push``)
        self.on_granted: Callable[[set[str]], None] | None = None
        self.dynamo = dynamo
        self.table = table
        self.inbox_table = inbox_table
        self.settings = settings or GroupSettings()
        self.clock = clock or SystemClock()
        self.stats = stats or GroupStats()

    @classmethod
    def from_config(cls, config: Config, clock: Clock | None = None) -> GroupStore:
        return cls(
            Dynamo.from_config(config),
            config.table(tables.GROUPS),
            config.table(tables.INBOXES),
            settings=config.groups,
            clock=clock,
        )

    # -- reading

    def load(self, key: str) -> Loaded | None:
        """The group's leader with its members' renewals and its streams' progress (one query);
        None when there is no such group."""
        attributes = (
            *FENCE_ATTRIBUTES,
            "v",
            "share",
            "filter",
            "at",
            "mb",
            "st",
            "r",
            "vw",
            "lost",
            "ln",
            "cut",
            "mid",
            *KEEP_ATTRIBUTES,
        )
        names = {f"#a{n}": a for n, a in enumerate(attributes)}
        rows = self.dynamo.query(
            self.table,
            KeyConditionExpression="#g = :g",
            # everything but the streams' progress, which only their holders read
            ProjectionExpression=", ".join(names),
            ExpressionAttributeNames={"#g": "group", **names},
            ExpressionAttributeValues=to_item({":g": key}),
            ConsistentRead=True,
        )
        leader = next((r for r in rows if r["item"] == LEADER), None)
        if leader is None:
            return None
        inc = str(leader["inc"])
        renewals: dict[str, int] = {}
        keeps: dict[str, Keep] = {}
        released: dict[str, int] = {}
        views: dict[str, AgentView] = {}
        marks: dict[str, Any] = {}
        fences: dict[str, Fence] = {}
        held_counts: dict[str, int] = {}
        for row in rows:
            name = str(row["item"])
            if row.get("inc") != inc:
                continue  # left behind by an earlier incarnation
            if name.startswith(HELD_PREFIX):
                member = str(row.get("mid"))
                held_counts[member] = held_counts.get(member, 0) + 1
                continue
            if name.startswith(MEMBER_PREFIX):
                member_id = name[len(MEMBER_PREFIX) :]
                renewals[member_id] = int(row.get("r", 0))
                views[member_id] = agent_view(row)
                if row.get("lost"):
                    marks[member_id] = row["lost"]
                keep = Keep.from_record(row)
                if keep is not None:
                    keeps[member_id] = keep
                if row.get("ke") is not None:
                    released[member_id] = int(row["ke"])
            elif name.startswith(STREAM_PREFIX):
                fence = Fence.from_record(row)
                fences[fence.source] = fence
        members: dict[str, Member] = {}
        for m, x in (leader.get("mb") or {}).items():
            joined = int(x["j"])
            keep = keeps.get(m)
            if keep is not None and keep.at_ms < joined:
                # written for a membership the session left since: not this one's
                del keeps[m]
                keep = None
            members[m] = Member(
                str(x["c"]),
                joined,
                max(joined, renewals.get(m, 0)),
                int(x.get("sv", 0)),
                kept_until_ms=keep.until_ms if keep is not None else 0,
                released_at_ms=released.get(m, 0),
            )
        streams: dict[str, StreamLease] = {}
        for source, x in json.loads(leader.get("st") or "{}").items():
            held = fences.get(source)
            streams[source] = StreamLease(
                holder=x.get("h"),
                lease=int(x["l"]),
                state=StreamState(x["s"]),
                since_ms=int(x.get("t", 0)),
                in_flight=held.in_flight if held is not None else 0,
            )
        state = GroupState(
            share=str(leader["share"]),
            filter=str(leader["filter"]),
            incarnation=inc,
            version=int(leader["v"]),
            created_at_ms=int(leader.get("at", 0)),
            members=members,
            streams=streams,
            # groups created before lanes existed have one
            lanes=int(leader.get("ln", 1)),
            cut_ms=None if leader.get("cut") is None else int(leader["cut"]),
        )
        state = add_streams(state, sorted(fences))
        return Loaded(
            key,
            state,
            fences,
            views,
            {m: x.renewed_at_ms for m, x in members.items()},
            held_counts,
            keeps,
            marks,
        )

    def progress(self, key: str, source: str) -> StreamProgress | None:
        raw = self.dynamo.get(self.table, {"group": key, "item": stream_item(source)})
        return StreamProgress.from_record(raw) if raw else None

    def lane_progress(self, key: str, source: str) -> dict[str, StreamProgress]:
        """The progress of every lane of a shard source that has one, by stream (one query:
        a member holding several lanes of a source reads them at once)."""
        rows = self.dynamo.query(
            self.table,
            KeyConditionExpression="#g = :g AND begins_with(#i, :s)",
            ExpressionAttributeNames={"#g": "group", "#i": "item"},
            ExpressionAttributeValues=to_item({":g": key, ":s": stream_item(source)}),
            ConsistentRead=True,
        )
        out: dict[str, StreamProgress] = {}
        for row in rows:
            progress = StreamProgress.from_record(row)
            if source_of(progress.source) == source:
                out[progress.source] = progress
        return out

    # -- the leader's transitions

    def commit_parts(self, loaded: Loaded, new: GroupState) -> list[dict[str, Any]]:
        """The transaction writing ``new`` over what ``loaded`` read: the leader on condition
        of its version, and the fence of every stream whose holder, lease or state changed, on
        condition of that stream's progress version (a holder's last get races no hand-off)."""
        old = loaded.state
        names = {"#v": "v"}
        parts: list[dict[str, Any]] = [
            {
                "Put": {
                    "TableName": self.table,
                    "Item": to_item(
                        leader_record(loaded.key, replace(new, version=old.version + 1))
                    ),
                    "ConditionExpression": "#v = :v",
                    "ExpressionAttributeNames": names,
                    "ExpressionAttributeValues": to_item({":v": old.version}),
                }
            }
        ]
        for source, lease in sorted(new.streams.items()):
            before = old.streams.get(source, StreamLease())
            if (before.holder, before.lease, before.state) == (
                lease.holder,
                lease.lease,
                lease.state,
            ):
                continue
            parts.append(
                self._fence_part(
                    loaded.key, new.incarnation, source, lease, loaded.fences.get(source)
                )
            )
        return parts

    def _fence_part(
        self,
        key: str,
        incarnation: str,
        source: str,
        lease: StreamLease,
        fence: Fence | None,
    ) -> dict[str, Any]:
        if fence is None:
            fresh = StreamProgress(source, incarnation, lease.lease, lease.holder, lease.state)
            return {
                "Put": {
                    "TableName": self.table,
                    "Item": to_item(fresh.record(key)),
                    "ConditionExpression": "attribute_not_exists(#i) OR #inc <> :inc",
                    "ExpressionAttributeNames": {"#i": "item", "#inc": "inc"},
                    "ExpressionAttributeValues": to_item({":inc": incarnation}),
                }
            }
        names = {"#l": "lease", "#s": "state", "#pv": "pv", "#inc": "inc", "#h": "holder"}
        values: dict[str, Any] = {
            ":l": lease.lease,
            ":s": lease.state.value,
            ":pv": fence.pv,
            ":next": fence.pv + 1,
            ":inc": incarnation,
        }
        expression = "SET #l = :l, #s = :s, #pv = :next"
        if lease.holder is None:
            expression += " REMOVE #h"
        else:
            expression += ", #h = :h"
            values[":h"] = lease.holder
        return {
            "Update": {
                "TableName": self.table,
                "Key": to_item({"group": key, "item": stream_item(source)}),
                "UpdateExpression": expression,
                "ConditionExpression": "#pv = :pv AND #inc = :inc",
                "ExpressionAttributeNames": names,
                "ExpressionAttributeValues": to_item(values),
            }
        }

    def commit(self, loaded: Loaded, new: GroupState, operation: str = "advance") -> bool:
        """Write ``new``; False when another invocation changed the group first."""
        reasons = self.dynamo.transact(self.commit_parts(loaded, new))
        self.stats.count(operation, conflict=reasons is not None)
        return reasons is None

    def advance(
        self,
        key: str,
        now_ms: int,
        *,
        renewing: str | None = None,
        acting: str | None = None,
        ending: Ending | None = None,
        operation: str = "advance",
    ) -> Loaded | None:
        """Load the group and advance its leader (``renewing``: a member known live now); the
        state as written, or None when the group does not exist. ``acting``: the member on
        whose call this runs, which writes only a transition that concerns it (``concerns``).
        ``ending``: a connection that ended; the member it kept is released first, so that
        this advance hands its streams on."""
        timeout = self.settings.lease_timeout_ms
        for attempt in range(ATTEMPTS):
            loaded = self.load(key)
            if loaded is None:
                return None
            state = loaded.state
            if ending is not None and ending.ends(loaded.kept.get(ending.member_id)):
                if not self.release(loaded, ending.member_id, now_ms):
                    continue  # kept anew meanwhile (a renewal's move): read it again
                state = release(state, ending.member_id, now_ms)
                loaded = replace(loaded, state=state, kept=_without(loaded.kept, ending.member_id))
            if renewing is not None:
                state = renew(state, renewing, now_ms)
            new = advance(state, now_ms, timeout)
            if new.same_assignment(loaded.state):
                return replace(loaded, state=new)
            if acting is not None and not concerns(state, new, acting, now_ms, timeout):
                # another member's to write: this call goes on with the leader as it is
                return replace(loaded, state=state)
            if self.commit(loaded, new, operation):
                # the assignment changed (checked above): one rebalance of the group
                count(metrics.REBALANCES)
                granted = (granted_to(loaded.state, new) | freed_for(loaded.state, new)) - {acting}
                if granted and self.on_granted is not None:
                    self.on_granted(granted)
                return self._applied(loaded, new)
            self.clock.sleep(backoff_s(attempt, 0.005, 0.2))
        raise ServerBusy("this shared group is contended; retry")

    def _applied(self, loaded: Loaded, new: GroupState) -> Loaded:
        """``loaded`` after its commit: the new version and the streams' new fences."""
        fences = dict(loaded.fences)
        for source, lease in new.streams.items():
            before = loaded.state.streams.get(source, StreamLease())
            if (before.holder, before.lease, before.state) == (
                lease.holder,
                lease.lease,
                lease.state,
            ):
                continue
            fence = fences.get(source, Fence(source, new.incarnation))
            fences[source] = replace(
                fence,
                lease=lease.lease,
                holder=lease.holder,
                state=lease.state,
                pv=fence.pv + 1 if source in fences else 0,
            )
        # the rest as read: the held QoS 2 deliveries too (the member whose get committed a
        # rebalance, a reconnect's, is sent them in that get)
        return replace(loaded, state=replace(new, version=loaded.state.version + 1), fences=fences)

    # -- progress

    def save_progress(
        self, key: str, progress: StreamProgress, expected_pv: int, member_id: str
    ) -> bool:
        """Write a holder's progress: only while it holds the stream under the same lease."""
        if not self.dynamo.conditional(
            "put_item",
            TableName=self.table,
            Item=to_item(progress.record(key)),
            ConditionExpression=("#pv = :pv AND #l = :l AND #h = :h AND #s = :s AND #inc = :inc"),
            ExpressionAttributeNames={
                "#pv": "pv",
                "#l": "lease",
                "#h": "holder",
                "#s": "state",
                "#inc": "inc",
            },
            ExpressionAttributeValues=to_item(
                {
                    ":pv": expected_pv,
                    ":l": progress.lease,
                    ":h": member_id,
                    ":s": progress.state.value,
                    ":inc": progress.incarnation,
                }
            ),
        ):
            self.stats.count("progress", conflict=True)
            return False
        self.stats.count("progress", conflict=False)
        return True

    def save_progress_holding(
        self,
        key: str,
        progress: StreamProgress,
        expected_pv: int,
        member_id: str,
        held: Sequence[Mapping[str, Any]],
    ) -> bool:
        """``save_progress`` with the QoS 2 deliveries it took off the stream kept for their
        members (``held_record``), in one transaction: a crash keeps both or neither. Refused
        too when one of those members left since the group was read: its leave's drop of its
        held deliveries ran before this write, so nothing would ever send or drop them (the
        caller serves again with the members as they are now: ``member_ids``)."""
        if not held:
            return self.save_progress(key, progress, expected_pv, member_id)
        parts: list[dict[str, Any]] = [
            {
                "Put": {
                    "TableName": self.table,
                    "Item": to_item(progress.record(key)),
                    "ConditionExpression": (
                        "#pv = :pv AND #l = :l AND #h = :h AND #s = :s AND #inc = :inc"
                    ),
                    "ExpressionAttributeNames": {
                        "#pv": "pv",
                        "#l": "lease",
                        "#h": "holder",
                        "#s": "state",
                        "#inc": "inc",
                    },
                    "ExpressionAttributeValues": to_item(
                        {
                            ":pv": expected_pv,
                            ":l": progress.lease,
                            ":h": member_id,
                            ":s": progress.state.value,
                            ":inc": progress.incarnation,
                        }
                    ),
                }
            }
        ]
        parts += [{"Put": {"TableName": self.table, "Item": to_item(h)}} for h in held]
        owners = sorted({str(h["mid"]) for h in held})
        parts.append(
            {
                "ConditionCheck": {
                    "TableName": self.table,
                    "Key": to_item({"group": key, "item": LEADER}),
                    # a leave removes the member from the leader's map (``leave_parts``)
                    "ConditionExpression": " AND ".join(
                        [
                            "#inc = :inc",
                            *(f"attribute_exists(#mb.#m{n})" for n in range(len(owners))),
                        ]
                    ),
                    "ExpressionAttributeNames": {
                        "#inc": "inc",
                        "#mb": "mb",
                        **{f"#m{n}": m for n, m in enumerate(owners)},
                    },
                    "ExpressionAttributeValues": to_item({":inc": progress.incarnation}),
                }
            }
        )
        ok = self.dynamo.transact(parts) is None
        self.stats.count("progress", conflict=not ok)
        return ok

    # -- the router's streams

    def ensure_stream(self, key: str, incarnation: str, source: str) -> bool:
        """Make the stream known to the leader (its progress item); True when it was new."""
        fresh = StreamProgress(source, incarnation)
        return self.dynamo.conditional(
            "put_item",
            TableName=self.table,
            Item=to_item(fresh.record(key)),
            ConditionExpression="attribute_not_exists(#i) OR #inc <> :inc",
            ExpressionAttributeNames={"#i": "item", "#inc": "inc"},
            ExpressionAttributeValues=to_item({":inc": incarnation}),
        )

    # -- membership (parts of the subscribe, unsubscribe and session-end transactions)

    def _default_lanes(self, topic_filter: str) -> int:
        partitions = self.partitions_of(topic_filter) if self.partitions_of else None
        return default_lanes(self.settings.parallelism, partitions)

    def leader_raw(self, key: str) -> dict[str, Any] | None:
        return self.dynamo.get(self.table, {"group": key, "item": LEADER})

    def member_ids(self, key: str, incarnation: str) -> set[str]:
        """The incarnation's members as its leader lists them now (none once it is gone)."""
        raw = self.leader_raw(key)
        if raw is None or str(raw["inc"]) != incarnation:
            return set()
        return set(raw.get("mb") or {})

    def join_parts(
        self,
        ref: GroupRef,
        member_id: str,
        client_id: str,
        now_ms: int,
        cut_ms: int | None = None,
    ) -> tuple[str, int | None, list[dict[str, Any]]]:
        """Join (creating the group when it does not exist): its incarnation, its cut and one
        part. A group this join creates takes ``cut_ms`` (the subscribe's cut); an existing one
        keeps its own: a message published before the group existed reaches none of its
        members, and one published while it existed reaches one of them, whenever it joined.

        Joining an existing group adds the member with one update of the leader (no read of
        its version: racing joins of many members never conflict), which bumps the version
        so that any racing transition re-reads and sees the new member. The member's item
        (renewal, agent view) comes with its first heartbeat; until then it is live from its
        join.
        """
        key = ref.key
        leader = to_item({"group": key, "item": LEADER})
        raw = self.leader_raw(key)
        if raw is None:
            inc = new_incarnation()
            lanes = ref.lanes or self.settings.lanes or self._default_lanes(ref.filter)
            state = join(
                new_group(ref.share, ref.filter, inc, now_ms, lanes, cut_ms=cut_ms),
                member_id,
                client_id,
                now_ms,
            )
            return (
                inc,
                cut_ms,
                [
                    {
                        "Put": {
                            "TableName": self.table,
                            "Item": to_item(leader_record(key, replace(state, version=1))),
                            "ConditionExpression": "attribute_not_exists(#i)",
                            "ExpressionAttributeNames": {"#i": "item"},
                        }
                    }
                ],
            )
        inc = str(raw["inc"])
        cut = None if raw.get("cut") is None else int(raw["cut"])
        if member_id in (raw.get("mb") or {}):
            return (
                inc,
                cut,
                [
                    {
                        "ConditionCheck": {
                            "TableName": self.table,
                            "Key": leader,
                            "ConditionExpression": "#inc = :inc AND attribute_exists(#mb.#m)",
                            "ExpressionAttributeNames": {
                                "#inc": "inc",
                                "#mb": "mb",
                                "#m": member_id,
                            },
                            "ExpressionAttributeValues": to_item({":inc": inc}),
                        }
                    }
                ],
            )
        return (
            inc,
            cut,
            [
                {
                    "Update": {
                        "TableName": self.table,
                        "Key": leader,
                        "UpdateExpression": "SET #mb.#m = :m, #v = #v + :one",
                        "ConditionExpression": "#inc = :inc",
                        "ExpressionAttributeNames": {
                            "#mb": "mb",
                            "#m": member_id,
                            "#v": "v",
                            "#inc": "inc",
                        },
                        "ExpressionAttributeValues": to_item(
                            {":m": {"c": client_id, "j": now_ms, "sv": 0}, ":one": 1, ":inc": inc}
                        ),
                    }
                }
            ],
        )

    def leave_parts(self, ref: GroupRef, member_id: str) -> tuple[list[dict[str, Any]], str | None]:
        """Leave: one part, and the incarnation when the member is the last one (then the
        group goes).

        The membership goes in one update of the leader; the leaver's streams are handed on by
        the next advance (``expire`` takes the streams of holders that are no members), which
        ``GroupService.after`` runs at once. Its acks count nothing from then on: a session
        acks only in the groups it is subscribed to.
        """
        raw = self.leader_raw(ref.key)
        if raw is None or member_id not in (raw.get("mb") or {}):
            return [], None
        inc = str(raw["inc"])
        if ref.incarnation is not None and ref.incarnation != inc:
            return [], None
        leader = to_item({"group": ref.key, "item": LEADER})
        if set(raw.get("mb") or {}) == {member_id}:
            return [
                {
                    "Delete": {
                        "TableName": self.table,
                        "Key": leader,
                        "ConditionExpression": "#v = :v",
                        "ExpressionAttributeNames": {"#v": "v"},
                        "ExpressionAttributeValues": to_item({":v": int(raw["v"])}),
                    }
                }
            ], inc
        return [
            {
                "Update": {
                    "TableName": self.table,
                    "Key": leader,
                    "UpdateExpression": "REMOVE #mb.#m SET #v = #v + :one",
                    # not the last member any more: a racing leave could have made it so
                    "ConditionExpression": (
                        "#inc = :inc AND attribute_exists(#mb.#m) AND size(#mb) > :one"
                    ),
                    "ExpressionAttributeNames": {
                        "#mb": "mb",
                        "#m": member_id,
                        "#v": "v",
                        "#inc": "inc",
                    },
                    "ExpressionAttributeValues": to_item({":one": 1, ":inc": inc}),
                }
            }
        ], None

    def remove_backlog(self, key: str, incarnation: str) -> int:
        """After a group's removal: its members' and streams' items, and (up to a bound) its
        backlog; TTL removes whatever is left. Idempotent; a newer incarnation's items stay."""
        removed = 0
        rows = self.dynamo.query(
            self.table,
            KeyConditionExpression="#g = :g",
            ExpressionAttributeNames={"#g": "group"},
            ExpressionAttributeValues=to_item({":g": key}),
            ConsistentRead=True,
        )
        for row in rows:
            if row["item"] == LEADER or row.get("inc") != incarnation:
                continue
            if self.dynamo.conditional(
                "delete_item",
                TableName=self.table,
                Key=to_item({"group": key, "item": row["item"]}),
                ConditionExpression="#inc = :inc",
                ExpressionAttributeNames={"#inc": "inc"},
                ExpressionAttributeValues=to_item({":inc": incarnation}),
            ):
                removed += 1
        partition = group_partition(incarnation)
        items = self.dynamo.query(
            self.inbox_table,
            KeyConditionExpression="#p = :p",
            ExpressionAttributeNames={"#p": "inbox", "#k": "position"},
            ExpressionAttributeValues=to_item({":p": partition}),
            ProjectionExpression="#p, #k",
            Limit=MAX_BACKLOG_DELETE,
        )
        keys = [{"inbox": partition, "position": row["position"]} for row in items]
        for start in range(0, len(keys), 25):
            requests = [{"DeleteRequest": {"Key": to_item(k)}} for k in keys[start : start + 25]]
            # best effort: what a throttled batch leaves unprocessed, TTL removes
            self.dynamo.call("batch_write_item", RequestItems={self.inbox_table: requests})
        return removed + len(keys)


def _without(kept: Mapping[str, Keep], member_id: str) -> dict[str, Keep]:
    return {m: k for m, k in kept.items() if m != member_id}
