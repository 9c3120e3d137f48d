"""The router's fan-out: each batch of one storage shard into the inboxes of matching sessions.

For a batch the router

1. reads the versions of the subscription buckets the batch's topics can touch (``W`` and each
   topic's first level), strongly consistent, in one call, and brings its cached view of those
   buckets up to date (the changes since its version, or the whole bucket after a gap): a
   subscription whose subscribe returned before a publish is seen by the batch holding it;
2. matches every message against the view (``shoal.topics.index.FilterIndex`` per bucket) and
   makes one delivery per matching session: of a session's overlapping subscriptions the one
   granting the highest QoS (min(subscription, message)) is named; expired messages, and a
   ``no_local`` subscription's own messages, are skipped; a shared group (``$share/...``)
   gets one delivery however many of its members match, into its stream for this shard
   (``shoal.groups.streams``), and the group's leader learns of the stream (``shoal.groups``);
3. writes, per session, inbox items holding its deliveries from the batch (keys:
   ``<source>#<position>``, positions from Kinesis sequence numbers; each delivery names its
   message's line in the archive the handler wrote first, ``shoal.router.batch``, where a
   group's copy holds the message), after moving the
   shard's *ledger* (the last record deliveries may exist for) past the batch. A batch that
   starts at or before the ledger may have been written before (Lambda retries a failed batch,
   possibly cut differently: bisected, or from a reported record), so then the router first asks
   each session's inbox how far its items of this shard already cover, and writes only what
   lies beyond: a retried batch writes nothing twice, and a session's items of one shard are
   always written in position order.

No-local: a publish carries no client id, so a ``no_local`` subscription skips the messages
whose ``publisher_id`` equals the subscriber's client id and whose publishing principal owns the
session (clients that want no-local publish with their client id as publisher id).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain

from shoal.core.clock import Clock, SystemClock
from shoal.core.config import DeliverySettings
from shoal.core.errors import InvalidFilter
from shoal.core.observability import logger
from shoal.delivery.events import DeliveryEvents, record_routed
from shoal.delivery.inbox import Given, InboxItem, InboxMessage, InboxStore, PayloadStore, pack
from shoal.delivery.model import (
    MAX_INLINE_PAYLOAD,
    WILDCARD_BUCKET,
    ArchiveLine,
    Subscription,
    bucket_of,
    position,
    record_end,
    seq_key,
    source_id,
)
from shoal.delivery.subscriptions import SubscriptionStore
from shoal.drain import RouterDrain
from shoal.groups.records import group_key
from shoal.groups.service import StreamRegistrar
from shoal.groups.streams import group_partition, key_hash
from shoal.records import MalformedRecord, Message, decode_record
from shoal.topics.index import FilterIndex

#: a bucket further behind than this many versions is reloaded rather than replayed
MAX_INCREMENTAL = 500


@dataclass
class _Bucket:
    version: int
    subscriptions: dict[str, Subscription] = field(default_factory=dict)
    index: FilterIndex[Subscription] = field(default_factory=FilterIndex)

    def put(self, subscription: Subscription) -> None:
        self.delete(subscription.key)
        try:
            self.index.add(subscription.topic_filter, subscription)
        except InvalidFilter:
            # the subscribe path validates filters; a bad one in the store matches nothing
            logger.error("invalid filter in the subscription store")
            return
        self.subscriptions[subscription.key] = subscription

    def delete(self, key: str) -> None:
        old = self.subscriptions.pop(key, None)
        if old is not None:
            self.index.remove(old.topic_filter, old)


@dataclass
class CacheStats:
    full_loads: int = 0
    incremental: int = 0
    version_reads: int = 0


class SubscriptionCache:
    """One container's view of the subscription store, brought up to date per batch."""

    def __init__(self, subscriptions: SubscriptionStore) -> None:
        self.subscriptions = subscriptions
        self.buckets: dict[str, _Bucket] = {}
        self.stats = CacheStats()

    def refresh(self, buckets: Iterable[str]) -> None:
        versions = self.subscriptions.versions(buckets)
        self.stats.version_reads += 1
        for name, version in versions.items():
            cached = self.buckets.get(name)
            if cached is not None and cached.version == version:
                continue
            if version == 0:
                self.buckets[name] = _Bucket(0)
                continue
            if cached is not None and cached.version < version <= cached.version + MAX_INCREMENTAL:
                changes = self.subscriptions.changes(name, cached.version, version)
                if changes is not None:
                    for change in changes:
                        if change.subscription is None:
                            cached.delete(change.key)
                        else:
                            cached.put(change.subscription)
                    cached.version = version
                    self.stats.incremental += 1
                    continue
            # Loaded after the version was read: it may hold newer changes too, which the next
            # refresh applies again (puts and deletes by key are idempotent).
            bucket = _Bucket(version)
            for subscription in self.subscriptions.load(name):
                bucket.put(subscription)
            self.buckets[name] = bucket
            self.stats.full_loads += 1

    def match(self, topic: str) -> Iterable[Subscription]:
        """The subscriptions whose filters match the topic, in no particular order, each once (it
        sits under one filter of one bucket); to be read before the next refresh."""
        found: list[set[Subscription]] = []
        for name in dict.fromkeys((WILDCARD_BUCKET, bucket_of(topic))):
            bucket = self.buckets.get(name)
            if bucket is not None:
                # the index's own sets, not a union of them: the caller only iterates
                found += bucket.index.buckets(topic)
        return chain.from_iterable(found)

    def __len__(self) -> int:
        return sum(len(b.subscriptions) for b in self.buckets.values())


@dataclass
class RouteReport:
    records: int = 0
    messages: int = 0
    deliveries: int = 0
    items: int = 0
    #: deliveries a retried batch found written already
    already_written: int = 0
    retried: bool = False
    shared_skipped: int = 0
    #: the sessions whose inboxes got deliveries, and the members of the shared groups whose
    #: streams did (a member's get serves its group's streams): those connected over the
    #: WebSocket API are pushed (``shoal.edge.push``)
    sessions: set[str] = field(default_factory=set)
    #: (message, subscription) matches left out because the record arrived before the cut
    before_cut: int = 0
    #: QoS 0 deliveries of sessions connected over the WebSocket API, not written: they are
    #: posted and forgotten (``shoal.edge.pushwork``), by session
    direct: dict[str, list[InboxMessage]] = field(default_factory=dict)
    #: the archive lines each session's written deliveries name (what its push fills them
    #: from, carried with it: ``shoal.edge.pushwork``)
    lines: dict[str, set[ArchiveLine]] = field(default_factory=dict)
    #: for sessions whose previous delivery of this source the router knows (it wrote it, and
    #: wrote everything of the source since: ``_Written``): that delivery's position and the
    #: items just written, so the session's push hands them out without reading them back
    given: dict[str, Given] = field(default_factory=dict)
    #: parts of a large fan-out whose pushes were handed over as each part was written
    #: (``Fanout.route``'s ``written_part``); 0: none, the caller hands them all over
    handed_parts: int = 0


#: a large fan-out's part written: its number, the sessions to push, and the items given them
WrittenPart = Callable[[int, set[str], Mapping[str, Given]], None]
#: sessions whose last position of a source one router container remembers, at most
MAX_REMEMBERED = 200_000


@dataclass
class _Written:
    """What this container wrote of one source: the end of its last batch (the ledger's value
    after it) and each session's last written position. Valid for a batch only while the
    ledger still holds that end: then no other container wrote the source since, and a
    session's last position here is its last item's in the inbox."""

    end: str
    last: dict[str, str] = field(default_factory=dict)
    #: this container has written the source since its ledger was empty, and remembers each
    #: session it wrote: a session it does not name has no item of the source, so its last
    #: position there is "" (the first message of a source goes with its items too)
    complete: bool = False


#: a fan-out is written in parts of at least this many sessions, each part's pushes handed
#: over as it is written (a part is a few hundred ``BatchWriteItem`` calls at most)
PIPELINE_SESSIONS = 2_000
#: and in this many parts at most
MAX_PARTS = 16


def _parts(deliveries: dict[str, list[InboxMessage]]) -> list[dict[str, list[InboxMessage]]]:
    """The deliveries in parts by session (each session's in one part), in a stable order."""
    count = min(MAX_PARTS, len(deliveries) // PIPELINE_SESSIONS)
    if count <= 1:
        return [deliveries]
    parts: list[dict[str, list[InboxMessage]]] = [{} for _ in range(count)]
    for n, session_id in enumerate(sorted(deliveries)):
        parts[n * count // len(deliveries)][session_id] = deliveries[session_id]
    return parts


#: which of some sessions are connected over the WebSocket API (the router's read of the
#: connections table), or None when it does not ask (too many to read: ``shoal.router.batch``)
Connected = Callable[[set[str]], set[str] | None]


def _split_direct(
    deliveries: dict[str, list[InboxMessage]],
    groups: Mapping[str, tuple[str, str]],
    connected: Connected,
) -> dict[str, list[InboxMessage]]:
    """Takes the QoS 0 deliveries of connected sessions out of ``deliveries``; by session."""
    candidates = {
        s
        for s, messages in deliveries.items()
        if s not in groups and any(m.qos == 0 for m in messages)
    }
    live = connected(candidates) if candidates else None
    direct: dict[str, list[InboxMessage]] = {}
    for session_id in live or ():
        messages = deliveries[session_id]
        direct[session_id] = [m for m in messages if m.qos == 0]
        kept = [m for m in messages if m.qos != 0]
        if kept:
            deliveries[session_id] = kept
        else:
            del deliveries[session_id]
    return direct


def message_expiry_ms(message: Message) -> int | None:
    expiry = message.properties.get("message_expiry_s")
    return None if expiry is None else message.published_at_ms + int(expiry) * 1000


class Fanout:
    """Matches a batch against the subscription view and writes the deliveries."""

    def __init__(
        self,
        cache: SubscriptionCache,
        inbox: InboxStore,
        settings: DeliverySettings,
        *,
        payloads: PayloadStore | None = None,
        clock: Clock | None = None,
        groups: StreamRegistrar | None = None,
        drain: RouterDrain | None = None,
    ) -> None:
        self.cache = cache
        self.inbox = inbox
        self.settings = settings
        self.payloads = payloads
        self.clock = clock or SystemClock()
        #: shared groups: their streams are made known to their leaders (``shoal.groups``)
        self.groups = groups
        #: the ordered drain (``shoal.drain``): labels items of later storage topics, marks a
        #: shard drained once its seal is routed; None does neither
        self.drain = drain
        #: by source: what this container wrote of it (``_Written``)
        self._written: dict[str, _Written] = {}

    def route_records(
        self,
        stream: str,
        shard: str,
        records: Sequence[tuple[str, bytes]],
        events: DeliveryEvents | None = None,
        lines: Mapping[tuple[int, int], ArchiveLine] | None = None,
        *,
        arrivals: Mapping[str, int] | None = None,
        connected: Connected | None = None,
        written_part: WrittenPart | None = None,
    ) -> RouteReport:
        """Kinesis records ``(sequence number, data)`` of one shard, in order; records that are
        not Shoal's are skipped here (the archive quarantines them). ``arrivals``: each
        record's ``ApproximateArrivalTimestamp`` in ms, by sequence number. ``connected``:
        see ``route``."""
        decoded: list[tuple[str, list[Message]]] = []
        for sequence_number, data in records:
            try:
                decoded.append((sequence_number, decode_record(data)))
            except MalformedRecord:
                continue
        report = self.route(
            stream,
            shard,
            decoded,
            events,
            lines,
            arrivals=arrivals,
            connected=connected,
            written_part=written_part,
        )
        if self.drain is not None:
            # after the batch's deliveries are written: everything before its seal is routed
            self.drain.after_batch(stream, shard, records)
        return report

    def route(
        self,
        stream: str,
        shard: str,
        records: Sequence[tuple[str, list[Message]]],
        events: DeliveryEvents | None = None,
        lines: Mapping[tuple[int, int], ArchiveLine] | None = None,
        *,
        arrivals: Mapping[str, int] | None = None,
        connected: Connected | None = None,
        written_part: WrittenPart | None = None,
    ) -> RouteReport:
        """``written_part``: called for each part of a large fan-out once its items are
        written (``PIPELINE_SESSIONS`` sessions a part at least), with the push targets of
        the part: their pushes start while the next part is written, instead of after the
        last (``RouteReport.handed_parts``). ``connected``: which of the sessions given
        QoS 0 deliveries are connected over the WebSocket API; their QoS 0 deliveries are not
        written but handed back
        (``RouteReport.direct``), to be posted and forgotten: at most once, no state (a
        connection lost before the post loses them, as MQTT's QoS 0 allows, §4.3.1). An
        offline session's are written, as every QoS, and wait for its next get or connect.
        ``arrivals``: when each record arrived at Kinesis (ms, by sequence number): a
        subscription gets only the records that arrived after its cut (``Subscription.cut_ms``);
        a record of unknown arrival reaches every matching subscription, as before cuts.
        ``events``: the invocation's recorder; gets a ``routed`` event per delivery (the
        caller flushes it once the inbox writes are done). ``lines``: where the batch's
        messages are archived, by (sequence number, index in the record), written before this
        call: a session's deliveries then name their lines instead of copying the messages
        (``shoal.delivery.codec``, version 2). Without them (no archive), and for shared
        groups' streams, deliveries hold their messages."""
        report = RouteReport(records=len(records))
        if not records:
            return report
        now = self.clock.now_ms()
        source = source_id(stream, shard)
        topics = {m.topic for _, messages in records for m in messages}
        self.cache.refresh({WILDCARD_BUCKET, *(bucket_of(t) for t in topics)})
        deliveries: dict[str, list[InboxMessage]] = {}
        #: a group's partition -> (group key, incarnation), for the groups this batch reaches
        streams: dict[str, tuple[str, str]] = {}
        #: a group's partition -> the sessions of its members that matched
        members: dict[str, set[str]] = {}
        for sequence_number, messages in records:
            for index, message in enumerate(messages):
                report.messages += 1
                expires_at = message_expiry_ms(message)
                if expires_at is not None and expires_at <= now:
                    continue
                at = position(sequence_number, index)
                arrived = arrivals.get(sequence_number) if arrivals else None
                chosen = self._choose(
                    message, at, report, streams, arrived=arrived, members=members
                )
                if not chosen:
                    continue
                line = lines.get((int(sequence_number), index)) if lines else None
                # a group's copy of a keyed message names its key's lane; sessions need none
                keyed = key_hash(message.ordering_key) if message.keyed else None
                inline: tuple[bytes, str | None] | None = None
                for session_id, (qos, subscription) in chosen.items():
                    grouped = session_id in streams
                    if line is not None and not grouped:
                        # by reference: the line holds the payload, whatever its size
                        payload, ref, named = message.payload, None, line
                    else:
                        if inline is None:
                            inline = self._inline(message)
                        (payload, ref), named = inline, None
                    deliveries.setdefault(session_id, []).append(
                        InboxMessage(
                            position=at,
                            message_id=message.message_id,
                            topic=message.topic,
                            payload=payload,
                            qos=qos,
                            subscription=subscription.filter,
                            sid=subscription.group or subscription.sid,
                            published_at_ms=message.published_at_ms,
                            expires_at_ms=expires_at,
                            properties={
                                k: v
                                for k, v in message.properties.items()
                                if k != "message_expiry_s"
                            },
                            payload_ref=ref,
                            key_hash=keyed if grouped else None,
                            line=named,
                        )
                    )
        if not deliveries:
            return report
        if events is not None:
            record_routed(events, deliveries, streams)
        if connected is not None and (self.drain is None or self.drain.settled(stream)):
            # (a storage topic whose earlier ones are not drained yet: its items wait at the
            # gates, and a QoS 0 frame posted now would pass them; written as any, it waits too)
            report.direct = _split_direct(deliveries, streams, connected)
        if self.groups is not None:
            for target, (key, incarnation) in sorted(streams.items()):
                if target in deliveries:
                    self.groups.ensure(key, incarnation, source)
        first, last = seq_key(records[0][0]), seq_key(records[-1][0])
        end = record_end(records[-1][0])
        ledger = self.inbox.ledger(source)
        if ledger and ledger >= first:
            # this batch, or part of it, may have been written before
            report.retried = True
            for session_id, written in deliveries.items():
                covered = self.inbox.covered(session_id, source, end)
                kept = [m for m in written if m.position > covered]
                report.already_written += len(written) - len(kept)
                deliveries[session_id] = kept
            if report.direct:
                # an earlier attempt may have handed these QoS 0 frames to the push queue
                # already (it died after its hand-off, or a later call of it failed), and a
                # retry cut differently hands off under other deduplication ids: QoS 0 is at
                # most once (MQTT 5 §4.3.1), so they are not carried again
                logger.info(
                    "qos 0 frames of a retried batch dropped",
                    extra={"n": sum(len(m) for m in report.direct.values())},
                )
                report.direct = {}
        if not ledger or ledger < last:
            self.inbox.advance_ledger(source, last)
        known = self._written.get(source)
        if known is None or report.retried or ledger != known.end:
            # another container wrote the source since, or this batch may have been written
            # before: nothing is known of what the sessions' inboxes hold. Unless the source
            # was never written: the ledger moves before any item is written (and is read
            # strongly consistent), so no inbox holds an item of it.
            known = self._written[source] = _Written(last, complete=not ledger)
            remembered = known.complete
        else:
            remembered = True
        expires = now // 1000 + self.settings.retention_s
        label = self.drain.label(stream) if self.drain is not None else None
        report.sessions = set(report.direct)
        for session_id, written in deliveries.items():
            if written:
                report.sessions |= members.get(session_id, {session_id})
                referenced = {m.line for m in written if m.line is not None}
                if referenced:
                    report.lines[session_id] = referenced
        parts = _parts(deliveries) if written_part is not None else [deliveries]
        for n, part in enumerate(parts):
            items: list[InboxItem] = []
            given: dict[str, Given] = {}
            for session_id, kept in part.items():
                if not kept:
                    continue
                packed = pack(session_id, source, kept, end, expires, stream=label)
                items += packed
                after = None
                if remembered:
                    after = known.last.get(session_id, "" if known.complete else None)
                if after is not None and session_id not in streams:
                    given[session_id] = Given(source, after, tuple(packed))
            self.inbox.put(items)
            report.items += len(items)
            report.given |= given
            if written_part is not None and len(parts) > 1:
                # this part's pushes go while the next part is written
                targets: set[str] = set()
                for session_id, written in part.items():
                    if written:
                        targets |= members.get(session_id, {session_id})
                written_part(n, targets, given)
                report.handed_parts += 1
        # what this container wrote of the source, for its next batch
        if len(known.last) > MAX_REMEMBERED:
            known.last.clear()
            known.complete = False
        known.end = max(known.end, last)
        for session_id, kept in deliveries.items():
            if kept and session_id not in streams:
                known.last[session_id] = kept[-1].position
        report.deliveries = sum(len(m) for m in deliveries.values())
        return report

    def _inline(self, message: Message) -> tuple[bytes, str | None]:
        """The payload a delivery holding its message keeps, and its reference in the payload
        store when it is too large to keep (``MAX_INLINE_PAYLOAD``)."""
        if len(message.payload) > MAX_INLINE_PAYLOAD and self.payloads is not None:
            return b"", self.payloads.put(message.message_id, message.payload)
        return message.payload, None

    def _choose(
        self,
        message: Message,
        at: str,
        report: RouteReport,
        streams: dict[str, tuple[str, str]],
        *,
        arrived: int | None = None,
        members: dict[str, set[str]] | None = None,
    ) -> dict[str, tuple[int, Subscription]]:
        """Per matching session, or shared group: the granted QoS and the subscription that
        grants it (a group gets each message once, however many members match)."""
        chosen: dict[str, tuple[int, Subscription]] = {}
        # in no fixed order: the choice below depends on it only between a group's members of
        # one filter and QoS, whose deliveries are the same
        for subscription in self.cache.match(message.topic):
            if (
                arrived is not None
                and subscription.cut_ms is not None
                and arrived <= subscription.cut_ms
            ):
                # published before the subscription (or its group) was made: MQTT routes at
                # publish time, so it never reaches it (a retained copy is the subscribe's)
                report.before_cut += 1
                continue
            target = subscription.session_id
            if subscription.share is not None and subscription.group is not None and self.groups:
                # the group's stream for this source; MQTT forbids no_local on shared ones
                target = group_partition(subscription.group)
                key = group_key(subscription.share, subscription.topic_filter)
                streams[target] = (key, subscription.group)
                if members is not None:
                    members.setdefault(target, set()).add(subscription.session_id)
            elif subscription.share is not None:
                # a shared subscription without its group's incarnation (the group is being
                # made or removed): no session inbox takes it
                report.shared_skipped += 1
                continue
            elif (
                subscription.no_local
                and message.publisher_id == subscription.client_id
                and message.sub == subscription.owner
            ):
                continue
            qos = min(subscription.qos, message.qos)
            held = chosen.get(target)
            # the highest QoS wins; among equals the smallest filter, so a retry picks the same
            if (
                held is None
                or qos > held[0]
                or (qos == held[0] and subscription.filter < held[1].filter)
            ):
                chosen[target] = (qos, subscription)
        return chosen
