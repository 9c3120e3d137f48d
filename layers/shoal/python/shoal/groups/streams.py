"""Group streams: where the router writes a shared group's messages, and how far each is read.

A *group stream* is one source shard of one storage topic, for one shared group. The router
writes each message matching a group once, into the group's partition of the inboxes table
(``grp#<incarnation>``), exactly as it writes a session's inbox (``shoal.router.fanout``):
items keyed
``<source>#<position>``, one per batch, written in position order, and never twice for a
retried batch (the shard's ledger). A group removed and created again is a new incarnation
with a new partition, so its old backlog is never read again; TTL removes what was not deleted.

Each stream's *progress* is one item of the groups table (``s#<source>`` in the group's
partition, see ``shoal.groups``), the only item a holder writes while it reads:

- the fence: ``lease``, ``holder`` and ``state``, copies of the leader's, written in the same
  transaction as the leader whenever the leader changes them. Every progress write is
  conditional on them (and on ``pv``, the progress version), so a member that lost the stream
  can never commit on it, and a hand-off never races a holder's last get;
- ``next`` (the next delivery *ordinal*), ``floor`` (every ordinal below is done: acked, QoS 0,
  or skipped) and ``done`` (done ordinals above it);
- ``cursor`` (the last position handed out) and ``at_item`` (the item holding it);
- ``runs``: ranges of positions handed out together, with their first ordinal, time and the
  lease and session channel they went out to. A run of an older lease is due again at once
  (the previous holder's unacked messages go to the next holder, ``dup`` true), and so is one
  sent to an older channel of the holder (a reconnect); others after the ack timeout.

A delivery's id is ``g-<group key>.<stream>.<lease>.<ordinal>``: an ack names the lease it was
delivered under, and only that lease's holder can ack it.

Lanes
-----
One shard is one stream of messages in order; read by one member at a time, it would put a
group of any size at the pace of one worker. So a group of ``lanes`` > 1 splits each source
into lanes: a message's lane is a digest of its ordering key when its publisher named one
(``key_hash``, written by the router with the group's copy), else of its message id, modulo
the lane count. Each lane is a stream of its own to the leader: leased, fenced, handed off and
progressed as above (its item is ``s#<source>-<lane>``; the router's ``s#<source>`` only makes
the source known). Messages of one ordering key share a lane, so they keep their order within
the group; unkeyed messages spread over all lanes, so over up to ``lanes`` members.

The router writes a group's messages once, as before: a lane is a filter over its source's
items, not a copy. Its holder reads the source and passes over other lanes' messages (its
cursor moves over them: the next read starts after them). Passing over costs reads, which are
cheaper than the writes one copy per lane would cost the router; a get of several lanes of one
source shares its reads (``CachedReader``).
"""

from __future__ import annotations

import base64
import bisect
import json
import zlib
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from shoal.aws.dynamo import Dynamo, to_item
from shoal.delivery.inbox import (
    InboxItem,
    InboxMessage,
    PayloadStore,
    from_ranges,
    ordinal_ranges,
    settle,
)
from shoal.delivery.model import item_key
from shoal.sessions.model import Channel

GROUP_PARTITION_PREFIX = "grp#"
DELIVERY_PREFIX = "g-"
#: sorts after every position of a source (positions are digits and dots)
SOURCE_END = "~"
#: items one query of a stream reads
ITEMS_PER_QUERY = 10
#: queries one serve makes while looking for new messages
MAX_QUERIES = 16
#: a lane stream's name is "<source>-<lane>" (a source is hex: it holds no "-")
LANE_SEPARATOR = "-"
#: the most lanes a group may have (its leases ride in the leader's one item)
MAX_LANES = 64
#: a serve that only passed over other lanes' messages saves its cursor once it passed this
#: many items (fewer are cheaper to read again than to write)
SKIP_SAVE_ITEMS = ITEMS_PER_QUERY


class StreamState(StrEnum):
    """A group stream's state in the leader (``shoal.groups``), mirrored in its progress."""

    GRANTED = "granted"
    REVOKING = "revoking"
    REVOKED = "revoked"


class StaleLease(Exception):
    """A progress write or ack under a lease that is not the stream's current one."""


def key_hash(ordering_key: str) -> int:
    """The digest of an ordering key that picks its lane (stable across processes)."""
    return zlib.crc32(ordering_key.encode("utf-8", "surrogatepass"))


@dataclass(frozen=True)
class Lane:
    """One lane of a source: the messages whose lane digest is ``index`` modulo ``count``."""

    index: int = 0
    count: int = 1

    def holds(self, message: InboxMessage) -> bool:
        if self.count == 1:
            return True
        digest = message.key_hash
        if digest is None:
            # unkeyed: any lane keeps its order, so spread by the message's own id
            digest = zlib.crc32(message.message_id.encode("utf-8", "surrogatepass"))
        return digest % self.count == self.index


def lane_stream(source: str, index: int, lanes: int) -> str:
    """The stream name of a source's lane (the source itself when the group has one lane)."""
    return source if lanes == 1 else f"{source}{LANE_SEPARATOR}{index}"


def lane_streams(source: str, lanes: int) -> list[str]:
    return [lane_stream(source, n, lanes) for n in range(lanes)]


def stream_lane(stream: str, lanes: int) -> tuple[str, Lane]:
    """A stream's source and lane."""
    source, separator, index = stream.partition(LANE_SEPARATOR)
    if not separator:
        return source, Lane()
    return source, Lane(int(index), lanes)


def source_of(stream: str) -> str:
    """The shard source a stream (a lane, or a whole source) reads."""
    return stream.partition(LANE_SEPARATOR)[0]


def is_lane(stream: str) -> bool:
    return LANE_SEPARATOR in stream


def group_partition(incarnation: str) -> str:
    """The inbox-table partition holding a group incarnation's streams."""
    return GROUP_PARTITION_PREFIX + incarnation


def delivery_id(group_key: str, source: str, lease: int, ordinal: int) -> str:
    return f"{DELIVERY_PREFIX}{group_key}.{source}.{lease}.{ordinal}"


@dataclass(frozen=True)
class GroupDelivery:
    group_key: str
    source: str
    lease: int
    ordinal: int


def parse_delivery_id(text: str) -> GroupDelivery | None:
    """The parts of a group delivery's id; None for anything else (an inbox delivery's id)."""
    if not text.startswith(DELIVERY_PREFIX):
        return None
    parts = text[len(DELIVERY_PREFIX) :].split(".")
    if len(parts) != 4 or not parts[2].isdigit() or not parts[3].isdigit():
        return None
    if not parts[0] or not parts[1]:
        return None
    return GroupDelivery(parts[0], parts[1], int(parts[2]), int(parts[3]))


# --- progress (no AWS here) --------------------------------------------------------------------


@dataclass
class StreamRun:
    """Positions ``(after, upto]`` handed out together as ordinals ``first .. first+count-1``."""

    first: int
    count: int
    after: str
    upto: str
    #: the key of the item holding the run's first message
    start_item: str
    sent_at_ms: int
    lease: int
    #: the session channel it went to (a reconnect gets its unacked messages again)
    channel: Channel = ""

    @property
    def end(self) -> int:
        return self.first + self.count

    def data(self) -> list[Any]:
        return [
            self.first,
            self.count,
            self.after,
            self.upto,
            self.start_item,
            self.sent_at_ms,
            self.lease,
            self.channel,
        ]

    @classmethod
    def from_data(cls, raw: list[Any]) -> StreamRun:
        first, count, after, upto, start, sent, lease, channel = raw
        return cls(
            int(first),
            int(count),
            str(after),
            str(upto),
            str(start),
            int(sent),
            int(lease),
            str(channel),
        )


@dataclass
class StreamProgress:
    """One group stream's progress and fence (the ``s#<source>`` item)."""

    source: str
    incarnation: str
    lease: int = 0
    holder: str | None = None
    state: StreamState = StreamState.REVOKED
    #: bumped by every write of the item; every write is conditional on it
    pv: int = 0
    next: int = 0
    floor: int = 0
    done: set[int] = field(default_factory=set)
    cursor: str = ""
    at_item: str = ""
    runs: list[StreamRun] = field(default_factory=list)
    #: QoS 2 ordinals not done, and the member (session id) each went to: they stay with it
    #: ([MQTT-4.8.2-4/5]); another holder of the stream never hands them out
    pins: dict[int, str] = field(default_factory=dict)

    def is_done(self, ordinal: int) -> bool:
        return ordinal < self.floor or ordinal in self.done

    def in_flight(self) -> int:
        """Handed-out ordinals not done yet, under any lease."""
        return sum(1 for r in self.runs for o in range(r.first, r.end) if not self.is_done(o))

    def fence(self, member_id: str, lease: int) -> None:
        """Raises StaleLease unless ``member_id`` holds the stream under ``lease``."""
        if self.holder != member_id or self.lease != lease or self.state is StreamState.REVOKED:
            raise StaleLease(f"lease {lease} of stream {self.source} is not this member's")

    def ack(self, member_id: str, lease: int, ordinals: Iterable[int]) -> int:
        """Mark delivered ordinals done under ``lease``; how many were not done before."""
        self.fence(member_id, lease)
        fresh = {o for o in ordinals if o < self.next and not self.is_done(o)}
        # only what went out under this lease: an id of an older lease was fenced off
        fresh = {
            o for o in fresh if any(r.first <= o < r.end and r.lease == lease for r in self.runs)
        }
        self.done |= fresh
        self.normalize()
        return len(fresh)

    def normalize(self) -> None:
        """Move the floor over done ordinals; forget runs and done ordinals below it."""
        self.floor, self.done, self.runs = settle(self.runs, self.floor, self.next, self.done)
        self.pins = {o: m for o, m in self.pins.items() if not self.is_done(o)}

    def record(self, group_key: str) -> dict[str, Any]:
        """The item: the fence as attributes (conditions name them), the rest as one JSON
        value (a few hundred bytes; one attribute is cheaper to read back than many)."""
        body = {
            "n": self.next,
            "fl": self.floor,
            "dn": ordinal_ranges(self.done),
            "cu": self.cursor,
            "ai": self.at_item,
            "ru": [r.data() for r in self.runs],
        }
        if self.pins:
            body["pn"] = {str(o): m for o, m in sorted(self.pins.items())}
        out: dict[str, Any] = {
            "group": group_key,
            "item": stream_item(self.source),
            "inc": self.incarnation,
            "lease": self.lease,
            "state": self.state.value,
            "pv": self.pv,
            # what the leader reads of the progress (a revoke waits for it to reach 0)
            "f": self.in_flight(),
            "p": json.dumps(body, separators=(",", ":")),
        }
        if self.holder is not None:
            out["holder"] = self.holder
        return out

    @classmethod
    def from_record(cls, raw: Mapping[str, Any]) -> StreamProgress:
        body = json.loads(raw["p"]) if raw.get("p") else {}
        done = from_ranges(body.get("dn") or [])
        return cls(
            source=str(raw["item"])[len(STREAM_PREFIX) :],
            incarnation=str(raw.get("inc", "")),
            lease=int(raw.get("lease", 0)),
            holder=raw.get("holder"),
            state=StreamState(raw.get("state", StreamState.REVOKED.value)),
            pv=int(raw.get("pv", 0)),
            next=int(body.get("n", 0)),
            floor=int(body.get("fl", 0)),
            done=done,
            cursor=str(body.get("cu", "")),
            at_item=str(body.get("ai", "")),
            runs=[StreamRun.from_data(list(r)) for r in body.get("ru") or []],
            pins={int(o): str(m) for o, m in (body.get("pn") or {}).items()},
        )


STREAM_PREFIX = "s#"
#: what the leader's load reads of a progress item (not the progress itself)
FENCE_ATTRIBUTES = ("item", "inc", "lease", "holder", "state", "pv", "f")


@dataclass(frozen=True)
class Fence:
    """A stream's fence and in-flight count: what the leader reads of its progress."""

    source: str
    incarnation: str
    lease: int = 0
    holder: str | None = None
    state: StreamState = StreamState.REVOKED
    pv: int = 0
    in_flight: int = 0

    @classmethod
    def from_record(cls, raw: Mapping[str, Any]) -> Fence:
        return cls(
            source=str(raw["item"])[len(STREAM_PREFIX) :],
            incarnation=str(raw.get("inc", "")),
            lease=int(raw.get("lease", 0)),
            holder=raw.get("holder"),
            state=StreamState(raw.get("state", StreamState.REVOKED.value)),
            pv=int(raw.get("pv", 0)),
            in_flight=int(raw.get("f", 0)),
        )


def stream_item(source: str) -> str:
    return STREAM_PREFIX + source


# --- reading a stream --------------------------------------------------------------------------


@dataclass(frozen=True)
class Found:
    item: InboxItem
    message: InboxMessage


class StreamReader:
    """Reads one source of a group's partition of the inboxes table, in position order."""

    def __init__(self, dynamo: Dynamo, table: str) -> None:
        self.dynamo = dynamo
        self.table = table

    def _query(self, partition: str, lower: str, upper: str, limit: int | None) -> list[InboxItem]:
        request: dict[str, Any] = {
            "KeyConditionExpression": "#p = :p AND #k BETWEEN :a AND :b",
            "ExpressionAttributeNames": {"#p": "inbox", "#k": "position"},
            "ExpressionAttributeValues": to_item({":p": partition, ":a": lower, ":b": upper}),
            "ConsistentRead": True,
        }
        if limit is not None:
            request["Limit"] = limit
        return [InboxItem.from_record(r) for r in self.dynamo.query(self.table, **request)]

    def after(self, partition: str, source: str, progress: StreamProgress) -> Iterator[Found]:
        """The source's messages after the cursor, in order (a bounded number of queries)."""
        lower = progress.at_item or f"{source}#"
        upper = f"{source}#{SOURCE_END}"
        for _ in range(MAX_QUERIES):
            items = self._query(partition, lower, upper, ITEMS_PER_QUERY)
            for item in items:
                for message in item.messages:
                    if message.position > progress.cursor:
                        yield Found(item, message)
            if len(items) < ITEMS_PER_QUERY:
                return
            # the next page starts after the last item read (its key is a position: append a
            # character that sorts after nothing a position holds, so BETWEEN excludes it)
            lower = items[-1].key + "\x00"

    def run(
        self, partition: str, source: str, run: StreamRun, lane: Lane = Lane()
    ) -> list[Found] | None:
        """A run's messages of ``lane`` in order, exactly as many as it has ordinals (else
        None: they expired)."""
        items = self._query(partition, run.start_item, item_key(source, run.upto), None)
        found: dict[str, Found] = {}
        for item in items:
            for message in item.messages:
                if (
                    run.after < message.position <= run.upto
                    and message.position not in found
                    and lane.holds(message)
                ):
                    found[message.position] = Found(item, message)
        ordered = sorted(found.values(), key=lambda f: f.message.position)
        return ordered if len(ordered) == run.count else None

    def cached(self) -> CachedReader:
        """A reader for one call: lanes of one source read the same items once."""
        return CachedReader(self.dynamo, self.table)


@dataclass
class _Segment:
    lower: str
    #: every item from ``lower`` up to this key was read
    complete_to: str
    keys: list[str]
    items: list[InboxItem]


class CachedReader(StreamReader):
    """A ``StreamReader`` that answers a query from what it read before, when that covers the
    range. For one call only: an item is written once (a retried batch writes it the same), so
    the only thing a cache misses is what the router wrote meanwhile, which the next get reads."""

    def __init__(self, dynamo: Dynamo, table: str) -> None:
        super().__init__(dynamo, table)
        self._segments: dict[str, list[_Segment]] = {}
        #: queries answered from the cache (for the benchmark)
        self.hits = 0

    def _query(self, partition: str, lower: str, upper: str, limit: int | None) -> list[InboxItem]:
        for segment in self._segments.get(partition, ()):
            if segment.lower > lower:
                continue
            start = bisect.bisect_left(segment.keys, lower)
            stop = bisect.bisect_right(segment.keys, upper)
            candidate = segment.items[start:stop]
            if segment.complete_to >= upper or (limit is not None and len(candidate) >= limit):
                self.hits += 1
                return candidate[:limit] if limit is not None else candidate
        items = super()._query(partition, lower, upper, limit)
        complete_to = upper if limit is None or len(items) < limit else items[-1].key
        self._segments.setdefault(partition, []).append(
            _Segment(lower, complete_to, [i.key for i in items], items)
        )
        return items


# --- serving a stream --------------------------------------------------------------------------


@dataclass(frozen=True)
class Handed:
    """A message a serve hands out."""

    ordinal: int
    message: InboxMessage
    dup: bool


@dataclass(frozen=True)
class Unpinned:
    """A QoS 2 delivery a serve found pinned to another member ([MQTT-4.8.2-4/5]): done on
    the stream, and held for ``member`` (``ended``: its session is gone, so dropped)."""

    member: str
    #: the delivery's id as the member got it (its lease and ordinal)
    delivery_id_lease: int
    ordinal: int
    message: InboxMessage
    ended: bool


#: QoS 2 deliveries one get takes off a stream for other members at most: each is a held item
#: written in the transaction of the stream's progress (and the members' check), which
#: DynamoDB caps at 100 parts
MAX_UNPINNED = 90


def serve(
    progress: StreamProgress,
    *,
    reader: StreamReader,
    partition: str,
    granted: bool,
    qos: int,
    wanted: int,
    window: int,
    now_ms: int,
    ack_timeout_ms: int,
    channel: Channel = "",
    admit: Callable[[InboxItem], bool] | None = None,
    dropped: list[InboxMessage] | None = None,
    lanes: int = 1,
    member_id: str = "",
    members: Collection[str] | None = None,
    unpinned: list[Unpinned] | None = None,
) -> tuple[list[Handed], bool]:
    """Plan one get on one stream the caller holds: due runs again, then (while the stream is
    granted, not revoking) new messages after the cursor. Changes ``progress`` in place;
    answers what goes out and whether ``progress`` changed. ``admit`` holds back new messages
    of an item it refuses (a later storage topic not drained yet: ``shoal.drain``). New
    messages that expired before going out are done at once and added to ``dropped`` (delivery
    events: the audit must not count them lost). ``lanes``: the group's lane count (the stream
    is one lane of its source when it is more than one).

    QoS 2 ([MQTT-4.8.2-4/5]): a QoS 2 delivery is pinned to ``member_id``, the member it
    goes to. A due run's delivery pinned to another member is never handed out: it is done
    on the stream and added to ``unpinned``, held for that member (the caller keeps it for
    it), or dropped when that member is no longer among ``members`` (its session ended)."""
    source, lane = stream_lane(progress.source, lanes)
    out: list[Handed] = []
    changed = False
    for run in sorted(progress.runs, key=lambda r: r.first):
        if len(out) >= wanted:
            break
        due = (
            run.lease != progress.lease
            or run.channel != channel
            or run.sent_at_ms + ack_timeout_ms <= now_ms
        )
        if not due:
            continue
        found = reader.run(partition, source, run, lane)
        changed = True
        if found is None:
            # its deliveries are gone (retention ran out): nothing left to send again
            progress.done.update(range(run.first, run.end))
            continue
        pending = [(n, f) for n, f in enumerate(found) if not progress.is_done(run.first + n)]
        room = wanted - len(out)
        taken = pending[:room]
        for at, (n, f) in enumerate(taken):
            if unpinned is not None and len(unpinned) >= MAX_UNPINNED:
                # the rest of the run waits for the next get: held in one transaction
                taken = taken[:at]
                break
            if _expired(f, now_ms):
                progress.done.add(run.first + n)
                continue
            owner = progress.pins.get(run.first + n)
            if owner is not None and owner != member_id:
                # another member's QoS 2 delivery: it stays with that member's session
                progress.done.add(run.first + n)
                if unpinned is not None:
                    ended = members is not None and owner not in members
                    unpinned.append(Unpinned(owner, run.lease, run.first + n, f.message, ended))
                continue
            out.append(Handed(run.first + n, f.message, True))
            if min(qos, f.message.qos) == 0:
                progress.done.add(run.first + n)
            elif min(qos, f.message.qos) == 2:
                progress.pins[run.first + n] = member_id
        if len(taken) == len(pending):
            run.sent_at_ms, run.lease, run.channel = now_ms, progress.lease, channel
            continue
        if not taken:
            break
        # split: the part handed out now (under this lease), the rest still due
        cut = taken[-1][0] + 1
        progress.runs.remove(run)
        progress.runs.append(
            StreamRun(
                run.first,
                cut,
                run.after,
                found[cut - 1].message.position,
                run.start_item,
                now_ms,
                progress.lease,
                channel,
            )
        )
        progress.runs.append(
            StreamRun(
                run.first + cut,
                run.count - cut,
                found[cut - 1].message.position,
                run.upto,
                found[cut].item.key,
                run.sent_at_ms,
                run.lease,
                run.channel,
            )
        )
        break
    room = min(wanted - len(out), window - progress.in_flight())
    if granted and room > 0:
        current: StreamRun | None = None
        passed: set[str] = set()
        for f in reader.after(partition, source, progress):
            if room <= 0 or (admit is not None and not admit(f.item)):
                break
            if not lane.holds(f.message):
                # another lane's: the cursor passes over it (saved with this lane's next
                # change, or once it passed enough items to be worth a write)
                progress.cursor = f.message.position
                progress.at_item = f.item.key
                passed.add(f.item.key)
                changed = changed or len(passed) > SKIP_SAVE_ITEMS
                continue
            ordinal = progress.next
            progress.next += 1
            if current is None:
                current = StreamRun(
                    ordinal, 0, progress.cursor, "", f.item.key, now_ms, progress.lease, channel
                )
                progress.runs.append(current)
            current.count += 1
            current.upto = f.message.position
            progress.cursor = f.message.position
            progress.at_item = f.item.key
            changed = True
            if _expired(f, now_ms):
                progress.done.add(ordinal)
                if dropped is not None:
                    dropped.append(f.message)
                continue
            out.append(Handed(ordinal, f.message, False))
            if min(qos, f.message.qos) == 0:
                progress.done.add(ordinal)  # at most once: done as it goes out
            else:
                if min(qos, f.message.qos) == 2:
                    progress.pins[ordinal] = member_id
                room -= 1
    if changed:
        progress.normalize()
    return out, changed


def _expired(found: Found, now_ms: int) -> bool:
    expires = found.message.expires_at_ms
    if expires is not None and expires <= now_ms:
        return True
    return bool(found.item.expires_at) and found.item.expires_at * 1000 <= now_ms


def answer(
    *,
    group_key: str,
    source: str,
    lease: int,
    handed: Handed,
    subscription: str,
    qos: int,
    now_ms: int,
    payloads: PayloadStore | None,
) -> dict[str, Any]:
    """A group delivery as get answers it (the same shape as an inbox delivery)."""
    message = handed.message
    properties = dict(message.properties)
    if message.expires_at_ms is not None:
        # MQTT 5: the expiry a receiver sees is what is left of it
        properties["message_expiry_s"] = max(0, (message.expires_at_ms - now_ms) // 1000)
    payload = message.payload
    if message.payload_ref is not None and payloads is not None:
        payload = payloads.get(message.payload_ref)
    return {
        "id": delivery_id(group_key, source, lease, handed.ordinal),
        "message_id": message.message_id,
        "topic": message.topic,
        "payload": base64.b64encode(payload).decode("ascii"),
        "qos": min(qos, message.qos),
        "retain": False,
        "dup": handed.dup,
        "subscription": subscription,
        "properties": properties,
        "published_at": message.published_at_ms,
    }
