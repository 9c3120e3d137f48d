"""Session inboxes: inbox items, the delivery state (cursors, ordinals, runs), the inbox store and
the payload store.

Inboxes
-------
One DynamoDB partition per session id (a discarded or expired session's inbox is simply never
read again; TTL removes it). The router writes, per session and per batch of one storage shard,
one item holding all the session's deliveries from that batch, keyed ``<source>#<position>``
(source: a digest of stream and shard; position: Kinesis sequence number and the message's
index in its record), so small messages share a write unit. A retried batch writes nothing
twice: the router's per-shard ledger says whether a batch may have been written before, and
then it first reads, per session, how far the session's items already cover
(``shoal.router.fanout``).

A session's items name their messages' lines in the archive rather than copying them
(``shoal.delivery.codec``, version 2; the router archives a batch before it writes its items),
and a get reads the lines its page needs back through ``PayloadStore.fill``. A shared group's
items, and those of a router without an archive, hold their messages.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from shoal.aws import clients, tables
from shoal.aws.dynamo import Dynamo, from_item, to_item
from shoal.core.config import Config
from shoal.core.observability import logger
from shoal.delivery import codec
from shoal.delivery.model import (
    LEDGER,
    MAX_ITEM_BYTES,
    MAX_REF_ITEM_BYTES,
    MAX_RETAINED_MARKS,
    PAYLOADS_PREFIX,
    STATE,
    ArchiveLine,
    InboxMessage,
    item_key,
    split_key,
)
from shoal.sessions.model import Channel


@dataclass(frozen=True)
class InboxItem:
    session_id: str
    key: str
    messages: tuple[InboxMessage, ...]
    #: the last position this item accounts for (the batch's end: a retry skips up to it)
    covered: str
    expires_at: int
    #: the storage stream, for a storage topic after a topic's first: readers hold it until the
    #: earlier ones are drained (``shoal.drain``); None (not stored) otherwise
    stream: str | None = None
    #: the deliveries' bytes as stored (``pack`` encodes by-reference items as it sizes them)
    encoded: bytes | None = field(default=None, compare=False, repr=False)
    #: about what DynamoDB bills for the item as read (0: not read back); a get sizes its
    #: queries by it (``DeliveryService._scan``)
    stored_bytes: int = field(default=0, compare=False)

    @property
    def source(self) -> str:
        return split_key(self.key)[0]

    def record(self) -> dict[str, Any]:
        """The stored item as plain values (what ``from_record`` reads back)."""
        return from_item(self.wire())

    def wire(self) -> dict[str, Any]:
        """The stored item in DynamoDB's wire form, built directly: the router's hot path writes
        hundreds of these an invocation, and five plain values need no general serializer."""
        out: dict[str, Any] = {
            "inbox": {"S": self.session_id},
            "position": {"S": self.key},
            "l": {"S": self.covered},
            "b": {"B": self.encoded if self.encoded is not None else codec.encode(self.messages)},
            "expires_at": {"N": str(int(self.expires_at))},
        }
        if self.stream is not None:
            out["st"] = {"S": self.stream}
        return out

    def bytes(self) -> bytes:
        """The deliveries as stored (``b``)."""
        return self.encoded if self.encoded is not None else codec.encode(self.messages)

    @classmethod
    def from_record(cls, raw: Mapping[str, Any]) -> InboxItem:
        packed = raw.get("b")
        if packed is not None:
            messages = tuple(codec.decode(bytes(packed)))
            size = len(packed) + _OVERHEAD
        else:
            # written before the compact encoding: a list of maps (sized generously: they were
            # at least their payloads, and reading them is what the first releases did)
            messages = tuple(InboxMessage.from_data(m) for m in raw.get("m") or [])
            size = sum(m.size() for m in messages) + _OVERHEAD
        return cls(
            session_id=str(raw["inbox"]),
            key=str(raw["position"]),
            messages=messages,
            covered=str(raw.get("l", "")),
            expires_at=int(raw.get("expires_at") or 0),
            stream=str(raw["st"]) if raw.get("st") else None,
            stored_bytes=size
            + sum(len(str(raw.get(k) or "")) for k in ("inbox", "position", "l", "st")),
        )


@dataclass(frozen=True)
class Given:
    """Items of one source the router just wrote for a session, and the position of the
    session's delivery before them (its last in that source, as the router wrote it): a get
    whose cursor stands exactly there, between items, has nothing else in the source to hand
    out first, and takes these without reading them back (``DeliveryService.get``)."""

    source: str
    after: str
    items: tuple[InboxItem, ...]

    def data(self) -> list[Any]:
        return [
            self.after,
            [
                [i.key, i.covered, i.expires_at, i.stream, base64.b64encode(i.bytes()).decode()]
                for i in self.items
            ],
        ]

    @classmethod
    def from_data(cls, session_id: str, source: str, data: Sequence[Any]) -> Given:
        after, items = data
        return cls(
            source,
            str(after),
            tuple(
                InboxItem.from_record(
                    {
                        "inbox": session_id,
                        "position": key,
                        "l": covered,
                        "b": base64.b64decode(encoded),
                        "expires_at": expires,
                        **({"st": stream} if stream else {}),
                    }
                )
                for key, covered, expires, stream, encoded in items
            ),
        )


#: an item's attribute names and its TTL number, in DynamoDB's item size
_OVERHEAD = len("inbox") + len("position") + len("l") + len("b") + len("expires_at") + 7 + 2


def _ref_overhead(
    session_id: str, key: str, covered: str, last_position: str, stream: str | None
) -> int:
    """The bytes of an item besides its deliveries' (what DynamoDB bills: names and values)."""
    return (
        _OVERHEAD
        + len(session_id.encode("utf-8", "surrogatepass"))
        + len(key)
        + max(len(covered), len(last_position))
        + (len(stream) if stream is not None else 0)
    )


def pack(
    session_id: str,
    source: str,
    messages: Sequence[InboxMessage],
    covered: str,
    expires_at: int,
    *,
    stream: str | None = None,
) -> list[InboxItem]:
    """Deliveries of one session from one source, in order, as few items as fit.

    The last item accounts for everything up to ``covered``; an earlier one up to its own last
    message (the router writes them in this order, one after the other). Deliveries by
    reference (``InboxMessage.line``: all of them or none) go into items of at most
    ``MAX_REF_ITEM_BYTES`` (one write unit each); others into items of ``MAX_ITEM_BYTES``.
    """
    if messages and messages[0].line is not None:
        return _pack_refs(session_id, source, messages, covered, expires_at, stream=stream)
    groups: list[list[InboxMessage]] = [[]]
    size = 0
    for message in messages:
        grow = message.size()
        if groups[-1] and size + grow > MAX_ITEM_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(message)
        size += grow
    items: list[InboxItem] = []
    for n, group in enumerate(groups):
        if not group:
            continue
        last = n == len(groups) - 1
        items.append(
            _item(
                session_id,
                source,
                group,
                covered if last else None,
                expires_at=expires_at,
                stream=stream,
            )
        )
    return items


def _item(
    session_id: str,
    source: str,
    group: Sequence[InboxMessage],
    covered: str | None,
    *,
    expires_at: int,
    stream: str | None,
    encoded: bytes | None = None,
) -> InboxItem:
    """One item of ``group``: it covers up to ``covered`` (the batch's end, for its last
    item) or else up to its own last message."""
    return InboxItem(
        session_id=session_id,
        key=item_key(source, group[0].position),
        messages=tuple(group),
        covered=covered if covered is not None else group[-1].position,
        expires_at=expires_at,
        stream=stream,
        encoded=encoded,
    )


def _pack_refs(
    session_id: str,
    source: str,
    messages: Sequence[InboxMessage],
    covered: str,
    expires_at: int,
    *,
    stream: str | None,
) -> list[InboxItem]:
    items: list[InboxItem] = []
    group: list[InboxMessage] = []
    encoder = codec.RefEncoder()
    overhead = 0

    def close(last: bool) -> None:
        items.append(
            _item(
                session_id,
                source,
                group,
                covered if last else None,
                expires_at=expires_at,
                stream=stream,
                encoded=encoder.bytes(),
            )
        )

    for message in messages:
        if not group:
            overhead = _ref_overhead(
                session_id, item_key(source, message.position), covered, message.position, stream
            )
        mark = encoder.mark()
        encoder.add(message)
        if group and overhead + encoder.size() > MAX_REF_ITEM_BYTES:
            # the item is full without this one: it starts the next
            encoder.undo(mark)
            close(last=False)
            group, encoder = [], codec.RefEncoder()
            overhead = _ref_overhead(
                session_id, item_key(source, message.position), covered, message.position, stream
            )
            encoder.add(message)
        group.append(message)
    if group:
        close(last=True)
    return items


class OrdinalRun(Protocol):
    """Ordinals ``first .. end - 1`` handed out together (a session's or a group stream's run)."""

    @property
    def first(self) -> int: ...

    @property
    def end(self) -> int: ...


R = TypeVar("R", bound=OrdinalRun)


def settle(
    runs: list[R], floor: int, next_ordinal: int, done: set[int]
) -> tuple[int, set[int], list[R]]:
    """Move the floor over done ordinals: the new floor (the first ordinal not done, or
    ``next_ordinal``), the done ordinals above it, and the runs that still hold one not done.
    ``runs`` is sorted in place by first ordinal."""
    runs.sort(key=lambda r: r.first)
    new_floor = next_ordinal
    for run in runs:
        pending = next((o for o in range(max(run.first, floor), run.end) if o not in done), None)
        if pending is not None:
            new_floor = pending
            break
    floor = max(floor, new_floor)
    done = {o for o in done if o >= floor}
    kept = [r for r in runs if any(o not in done for o in range(max(r.first, floor), r.end))]
    return floor, done, kept


@dataclass
class SessionRun:
    """Positions ``(after, upto]`` of one source, handed out by one get as ordinals
    ``first .. first + count - 1`` (every message in that range, delivered or skipped)."""

    first: int
    count: int
    source: str
    after: str
    upto: str
    #: the key of the item holding the run's first message
    start_item: str
    sent_at_ms: int
    channel: Channel

    @property
    def end(self) -> int:
        return self.first + self.count

    def data(self) -> dict[str, Any]:
        return {
            "o": self.first,
            "c": self.count,
            "s": self.source,
            "f": self.after,
            "t": self.upto,
            "i": self.start_item,
            "a": self.sent_at_ms,
            "h": self.channel,
        }

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> SessionRun:
        return cls(
            first=int(data["o"]),
            count=int(data["c"]),
            source=str(data["s"]),
            after=str(data["f"]),
            upto=str(data["t"]),
            start_item=str(data["i"]),
            sent_at_ms=int(data["a"]),
            channel=str(data["h"]),
        )


def ordinal_ranges(numbers: Iterable[int]) -> list[list[int]]:
    """Ordinals as ``[first, last]`` ranges (how progress items store done ordinals)."""
    out: list[list[int]] = []
    for n in sorted(numbers):
        if out and out[-1][1] == n - 1:
            out[-1][1] = n
        else:
            out.append([n, n])
    return out


def from_ranges(ranges: Iterable[Sequence[Any]]) -> set[int]:
    """The ordinals of ``ordinal_ranges``' answer."""
    out: set[int] = set()
    for lo, hi in ranges:
        out.update(range(int(lo), int(hi) + 1))
    return out


@dataclass
class DeliveryState:
    """One session's delivery state (the ``#state`` item), changed in memory then written."""

    version: int = 0
    next_ordinal: int = 0
    #: every ordinal below is done (acked, QoS 0, or skipped)
    floor: int = 0
    #: done ordinals at or above the floor
    acked: set[int] = field(default_factory=set)
    #: source -> the last position handed out
    cursors: dict[str, str] = field(default_factory=dict)
    #: source -> the key of the item the cursor sits inside of (more messages follow in it)
    partial: dict[str, str] = field(default_factory=dict)
    runs: list[SessionRun] = field(default_factory=list)
    #: composite topic -> how many of its storage topics the session has passed (drained and
    #: handed out: ``shoal.drain``); the later ones' items go out only after those
    drained: dict[str, int] = field(default_factory=dict)
    #: retained messages a subscribe sent that the router may still route here
    #: (``retained_mark`` -> until, epoch s): get consumes a routed copy of one instead of
    #: handing it out (``shoal.delivery.service``)
    marks: dict[str, int] = field(default_factory=dict)
    #: an ack opened a full window and owes the session a push (``ack_opening``): kept until
    #: the next get's write, so an ack sent again after its hand-off failed pushes again
    push_owed: bool = False

    def remember(self, marks: Mapping[str, int]) -> None:
        """Add marks (a mark sent again keeps the later end); at most ``MAX_RETAINED_MARKS``,
        those ending last (dropping one risks a duplicate, never a loss)."""
        for mark, until in marks.items():
            self.marks[mark] = max(until, self.marks.get(mark, 0))
        if len(self.marks) > MAX_RETAINED_MARKS:
            kept = sorted(self.marks.items(), key=lambda kv: (kv[1], kv[0]))[-MAX_RETAINED_MARKS:]
            self.marks = dict(kept)

    def forget(self, now_ms: int, sids: Iterable[str]) -> bool:
        """Drop the marks that ended or whose subscription is gone; whether any went."""
        live = set(sids)
        kept = {
            mark: until
            for mark, until in self.marks.items()
            if until * 1000 > now_ms and mark.partition(".")[0] in live
        }
        changed = len(kept) != len(self.marks)
        self.marks = kept
        return changed

    def done(self, ordinal: int) -> bool:
        return ordinal < self.floor or ordinal in self.acked

    def in_flight(self) -> int:
        """Handed-out ordinals not done (QoS 1/2 deliveries waiting for their ack)."""
        return sum(1 for run in self.runs for o in range(run.first, run.end) if not self.done(o))

    def normalize(self) -> None:
        """Move the floor over done ordinals; forget runs and acks below it."""
        self.floor, self.acked, self.runs = settle(
            self.runs, self.floor, self.next_ordinal, self.acked
        )

    def record(self, session_id: str, expires_at: int) -> dict[str, Any]:
        return {
            **({"po": True} if self.push_owed else {}),
            "inbox": session_id,
            "position": STATE,
            "v": self.version,
            "n": self.next_ordinal,
            "fl": self.floor,
            "ak": ordinal_ranges(self.acked),
            "cu": dict(self.cursors),
            "pa": dict(self.partial),
            "ru": [r.data() for r in self.runs],
            "dr": dict(self.drained),
            "rm": dict(self.marks),
            "expires_at": expires_at,
        }

    @classmethod
    def from_record(cls, raw: Mapping[str, Any]) -> DeliveryState:
        acked = from_ranges(raw.get("ak") or [])
        return cls(
            version=int(raw.get("v", 0)),
            next_ordinal=int(raw.get("n", 0)),
            floor=int(raw.get("fl", 0)),
            acked=acked,
            cursors={str(k): str(v) for k, v in (raw.get("cu") or {}).items()},
            partial={str(k): str(v) for k, v in (raw.get("pa") or {}).items()},
            runs=[SessionRun.from_data(r) for r in raw.get("ru") or []],
            drained={str(k): int(v) for k, v in (raw.get("dr") or {}).items()},
            marks={str(k): int(v) for k, v in (raw.get("rm") or {}).items()},
            push_owed=bool(raw.get("po")),
        )


def delivery_id(session_id: str, ordinal: int) -> str:
    return f"{session_id}.{ordinal}"


def ordinal_of(session_id: str, delivery: str) -> int | None:
    prefix, _, number = delivery.rpartition(".")
    if prefix != session_id or not number.isdigit():
        return None
    return int(number)


def ledger_partition(source: str) -> str:
    return f"router#{source}"


class InboxStore:
    """The inboxes table: deliveries, each session's delivery state, the router's ledgers."""

    def __init__(self, dynamo: Dynamo, table: str, *, write_concurrency: int = 1) -> None:
        self.dynamo = dynamo
        self.table = table
        #: batch writes ``put`` sends at once (``DeliverySettings.write_concurrency``)
        self.write_concurrency = write_concurrency

    @classmethod
    def from_config(cls, config: Config) -> InboxStore:
        return cls(Dynamo.from_config(config), config.table(tables.INBOXES))

    @classmethod
    def writer(cls, config: Config) -> InboxStore:
        """The router's store: the hot client (no client-side parameter validation) and
        concurrent batch writes."""
        return cls(
            Dynamo.from_config(config, profile="hot_writer"),
            config.table(tables.INBOXES),
            write_concurrency=config.delivery.write_concurrency,
        )

    # -- deliveries

    def put(self, items: Sequence[InboxItem]) -> None:
        """Write items; a session's later items of one source only after its earlier ones, so a
        get never sees a later delivery before an earlier one.

        Items go in rounds: each (session, source) pair's first item in the first round, its
        second in the second, and so on (an item holds up to 64 KB of deliveries, so a batch is
        mostly one round). Rounds go one after the other; the calls of one round go out at
        once, because their order cannot matter: a round holds at most one item per pair, a
        get reads each pair's items in key order and hands out only what it finds, and the
        router's retry check (``covered``) reads one pair at a time. A crash in the middle of
        a round leaves some pairs written and others not, which a retried batch completes
        exactly as it would after calls made one by one (``docs/design.md``).
        """
        rounds: list[list[InboxItem]] = []
        seen: dict[tuple[str, str], int] = {}
        for item in items:
            n = seen.get((item.session_id, item.source), -1) + 1
            seen[(item.session_id, item.source)] = n
            while len(rounds) <= n:
                rounds.append([])
            rounds[n].append(item)
        for batch in rounds:
            self.dynamo.batch_write(
                self.table,
                [{"PutRequest": {"Item": i.wire()}} for i in batch],
                concurrency=self.write_concurrency,
            )

    def put_transaction_part(self, item: InboxItem) -> dict[str, Any]:
        return {"Put": {"TableName": self.table, "Item": item.wire()}}

    def after(
        self, session_id: str, key: str, *, inclusive: bool, limit: int, consistent: bool = True
    ) -> list[InboxItem]:
        """Up to ``limit`` items of the session from ``key`` on, in key order. ``consistent``
        False: an eventually consistent read, at half the read units (a long poll's look,
        ``shoal.delivery.service``)."""
        operator = ">=" if inclusive else ">"
        rows = self.dynamo.query(
            self.table,
            KeyConditionExpression=f"#p = :p AND #k {operator} :k",
            ExpressionAttributeNames={"#p": "inbox", "#k": "position"},
            ExpressionAttributeValues=to_item({":p": session_id, ":k": key}),
            ConsistentRead=consistent,
            Limit=limit,
        )
        return [InboxItem.from_record(r) for r in rows]

    def first_before(self, session_id: str, key: str, *, consistent: bool = True) -> str | None:
        """The key of the session's first item if it sorts before ``key`` (None: there is
        none). Only the key is returned; the read is billed by the item's size all the same."""
        rows = self.dynamo.query(
            self.table,
            KeyConditionExpression="#p = :p AND #k BETWEEN :a AND :b",
            ExpressionAttributeNames={"#p": "inbox", "#k": "position"},
            # after the state item (``#state`` sorts before every item key)
            ExpressionAttributeValues=to_item({":p": session_id, ":a": STATE + "\x00", ":b": key}),
            ProjectionExpression="#k",
            ConsistentRead=consistent,
            Limit=1,
        )
        return str(rows[0]["position"]) if rows else None

    def delete_source(self, session_id: str, source: str) -> int:
        """Deletes the session's items of ``source``; how many there were. Only for a source
        nothing comes to again and nothing in flight reads back (``InboxScan``): consumed
        items otherwise wait for their TTL."""
        rows = self.dynamo.query(
            self.table,
            KeyConditionExpression="#p = :p AND begins_with(#k, :s)",
            ExpressionAttributeNames={"#p": "inbox", "#k": "position"},
            ExpressionAttributeValues=to_item({":p": session_id, ":s": f"{source}#"}),
            ProjectionExpression="#k",
        )
        keys = [{"inbox": session_id, "position": str(r["position"])} for r in rows]
        self.dynamo.batch_delete(self.table, keys)
        return len(keys)

    def between(self, session_id: str, first: str, last: str) -> list[InboxItem]:
        """The session's items with keys from ``first`` to ``last``, inclusive."""
        rows = self.dynamo.query(
            self.table,
            KeyConditionExpression="#p = :p AND #k BETWEEN :a AND :b",
            ExpressionAttributeNames={"#p": "inbox", "#k": "position"},
            ExpressionAttributeValues=to_item({":p": session_id, ":a": first, ":b": last}),
            ConsistentRead=True,
        )
        return [InboxItem.from_record(r) for r in rows]

    def covered(self, session_id: str, source: str, upto: str) -> str:
        """How far the session's items of ``source`` at or before ``upto`` account for ("" for
        nothing): the router's check before it writes a batch that may have been written."""
        rows = self.dynamo.query(
            self.table,
            KeyConditionExpression="#p = :p AND #k BETWEEN :a AND :b",
            ExpressionAttributeNames={"#p": "inbox", "#k": "position", "#l": "l"},
            ExpressionAttributeValues=to_item(
                {":p": session_id, ":a": f"{source}#", ":b": item_key(source, upto)}
            ),
            ProjectionExpression="#l",
            ConsistentRead=True,
            ScanIndexForward=False,
            Limit=1,
        )
        return str(rows[0].get("l", "")) if rows else ""

    # -- the router's ledger

    def ledger(self, source: str) -> str:
        """The last record position (``seq_key``) the router may have written deliveries for."""
        raw = self.dynamo.get(self.table, {"inbox": ledger_partition(source), "position": LEDGER})
        return str(raw.get("a", "")) if raw else ""

    def advance_ledger(self, source: str, through: str) -> None:
        """Record that deliveries up to ``through`` may exist (only ever forward)."""
        # a failed condition: the ledger is already at or past ``through``
        self.dynamo.conditional(
            "update_item",
            TableName=self.table,
            Key=to_item({"inbox": ledger_partition(source), "position": LEDGER}),
            UpdateExpression="SET #a = :a",
            ConditionExpression="attribute_not_exists(#a) OR #a < :a",
            ExpressionAttributeNames={"#a": "a"},
            ExpressionAttributeValues=to_item({":a": through}),
        )

    # -- the delivery state

    @staticmethod
    def state_key(session_id: str) -> dict[str, str]:
        return {"inbox": session_id, "position": STATE}

    def state(self, session_id: str) -> DeliveryState:
        raw = self.dynamo.get(self.table, self.state_key(session_id))
        return DeliveryState.from_record(raw) if raw else DeliveryState()

    def states(self, session_ids: Iterable[str]) -> dict[str, DeliveryState]:
        """The sessions' delivery states in batch reads (100 a call), by session id; a
        session without one has none here."""
        keys = [self.state_key(s) for s in sorted(set(session_ids))]
        rows = self.dynamo.batch_get(self.table, keys) if keys else []
        return {str(r["inbox"]): DeliveryState.from_record(r) for r in rows}

    def in_flight(self, session_id: str) -> int:
        """QoS 1/2 deliveries handed out and not acknowledged (``GET /v1/sessions/{id}``)."""
        return self.state(session_id).in_flight()

    def state_part(
        self, session_id: str, state: DeliveryState, expected: int, expires_at: int
    ) -> dict[str, Any]:
        """A put of ``state`` on condition that the stored one is still version ``expected``."""
        condition = "attribute_not_exists(#v) OR #v = :old" if expected == 0 else "#v = :old"
        return {
            "TableName": self.table,
            "Item": to_item(state.record(session_id, expires_at)),
            "ConditionExpression": condition,
            "ExpressionAttributeNames": {"#v": "v"},
            "ExpressionAttributeValues": to_item({":old": expected}),
        }

    def write_state(
        self, session_id: str, state: DeliveryState, expected: int, expires_at: int
    ) -> bool:
        return self.dynamo.conditional(
            "put_item", **self.state_part(session_id, state, expected, expires_at)
        )


#: archive lines read for one get, by line (None: its object is gone): a get that plans again
#: (a conflicting write of its state) reads none twice
LineCache = dict[ArchiveLine, Mapping[str, Any] | None]


class PayloadStore:
    """The archive bucket, as delivery reads it: large payloads, once per message
    (``payloads/<message id>``), and the archive's lines that deliveries by reference name."""

    def __init__(self, s3: Any, bucket: str) -> None:
        self.s3 = s3
        self.bucket = bucket

    @classmethod
    def from_config(cls, config: Config) -> PayloadStore:
        return cls(clients.client("s3", config.region), config.buckets["archive"])

    @staticmethod
    def key(message_id: str) -> str:
        return f"{PAYLOADS_PREFIX}/{message_id}"

    def put(self, message_id: str, payload: bytes) -> str:
        key = self.key(message_id)
        self.s3.put_object(Bucket=self.bucket, Key=key, Body=payload)
        return key

    def get(self, key: str) -> bytes:
        body: bytes = self.s3.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        return body

    def fill(
        self, messages: Sequence[InboxMessage], cache: LineCache | None = None
    ) -> list[InboxMessage | None]:
        """``messages`` with the content of their archive lines, in order; a delivery not by
        reference as it is, and None for one whose line is gone (its object expired or was
        deleted: the lifecycle keeps the archive longer than the inbox, so only by hand).

        One ranged GET per archive object, covering the lines wanted from it: a page of a
        batch's messages is one request ($0.0004 per 1,000), whatever its size."""
        cache = {} if cache is None else cache
        wanted: dict[str, list[ArchiveLine]] = {}
        for m in messages:
            if m.pending and m.line is not None and m.line not in cache:
                wanted.setdefault(m.line.key, []).append(m.line)
        for key, lines in wanted.items():
            start = min(line.offset for line in lines)
            stop = max(line.end for line in lines)
            try:
                answer = self.s3.get_object(
                    Bucket=self.bucket, Key=key, Range=f"bytes={start}-{stop - 1}"
                )
            except self.s3.exceptions.NoSuchKey:
                logger.error("an archive object that inbox items name is gone", extra={"key": key})
                cache.update(dict.fromkeys(lines))
                continue
            body: bytes = answer["Body"].read()
            for line in lines:
                cache[line] = json.loads(body[line.offset - start : line.end - start])
        out: list[InboxMessage | None] = []
        for m in messages:
            if not m.pending or m.line is None:
                out.append(m)
                continue
            content = cache.get(m.line)
            out.append(None if content is None else m.filled(content))
        return out
