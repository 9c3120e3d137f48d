"""One router invocation: a batch of one storage shard, archived, then fanned out.

Records are parsed by Powertools' BatchProcessor. Only the records before the first failure
are archived and routed (Lambda hands the batch back from there). The archive goes first, then
the fan-out: session inboxes name their messages' archive lines instead of copying them
(``shoal.delivery.codec``), so no inbox item may exist before the lines it names. An error in
either fails the invocation so that Lambda retries the batch: archive object keys are
deterministic (a retry rewrites the same objects, the same lines at the same offsets), inbox
writes skip what an earlier attempt wrote (the shard's ledger). A retry cut differently
(bisected, or from a reported record) archives under other keys, and its items name those:
every item names lines that were written before it.

Delivery events: the ``routed`` events of the batch are written as one object after the inbox
writes (``shoal.delivery.events``), keyed by stream, shard and the batch's sequence range, so
a retried batch rewrites the same object. ``SHOAL_FAULTS=router=<p>`` fails invocations at a
random step on purpose (``shoal.core.faults``; tests only).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from aws_lambda_powertools.utilities.batch import (
    BatchProcessor,
    EventType,
    process_partial_response,
)
from aws_lambda_powertools.utilities.parser.models import KinesisDataStreamRecord
from aws_lambda_powertools.utilities.typing import LambdaContext

from shoal.core import metrics
from shoal.core.faults import ROUTER_STEPS, Faults
from shoal.core.observability import count, lag
from shoal.delivery.events import Recording
from shoal.delivery.inbox import Given, InboxMessage, LineCache
from shoal.delivery.model import ArchiveLine, source_id
from shoal.edge.connections import Connection, ConnectionStore
from shoal.edge.pushwork import PushQueue
from shoal.router.archive import ArchiveWriter
from shoal.router.fanout import Fanout, WrittenPart

#: a batch reaching at most this many sessions reads which are connected (one batch read)
TARGETS_READ_INLINE = 100


class Router:
    """Routes one event source mapping batch: archive, fan-out, delivery events, in that order."""

    def __init__(
        self,
        fanout: Fanout,
        archive: ArchiveWriter,
        recording: Recording,
        faults: Faults,
        *,
        queue: PushQueue | None = None,
        connections: ConnectionStore | None = None,
    ) -> None:
        self.fanout = fanout
        self.archive = archive
        self.recording = recording
        self.faults = faults
        #: where the pushes of the sessions a batch wrote to go (None: no WebSocket API)
        self.queue = queue
        #: which of them are connected (read for a small batch only: ``_hand_off``)
        self.connections = connections

    def handle(self, event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
        self._lag(event)
        batch = self.archive.batch()
        records: list[tuple[str, bytes]] = []
        #: each record's arrival at Kinesis, ms: the subscriptions' cuts compare with it
        arrivals: dict[str, int] = {}

        def handle(record: KinesisDataStreamRecord) -> None:
            batch.add(record)
            data = record.kinesis.data
            assert isinstance(data, bytes)
            records.append((record.kinesis.sequenceNumber, data))
            arrivals[record.kinesis.sequenceNumber] = round(
                record.kinesis.approximateArrivalTimestamp * 1000
            )

        # one processor per invocation: the local runtime invokes concurrently in one process
        processor = BatchProcessor(
            event_type=EventType.KinesisDataStreams, model=KinesisDataStreamRecord
        )
        response = process_partial_response(
            event=event, record_handler=handle, processor=processor, context=context
        )
        failed = [int(str(f["itemIdentifier"])) for f in response.get("batchItemFailures", [])]
        cut = min(failed) if failed else None
        routed = [(seq, data) for seq, data in records if cut is None or int(seq) < cut]
        fault = self.faults.plan(ROUTER_STEPS)
        objects, lines = batch.layout(cut)
        fault.at("before_archive")
        # before any inbox item: the items name these objects' lines
        self.archive.write(objects)
        fault.at("after_archive")
        fault.at("before_inbox")
        if routed:
            events = self.recording.new()
            source = source_id(batch.stream, batch.shard)
            key = f"{batch.stream}/{batch.shard}/{routed[0][0]}-{routed[-1][0]}"
            carried = _read(objects, lines) if self.queue is not None else {}
            report = self.fanout.route_records(
                batch.stream,
                batch.shard,
                routed,
                events,
                lines,
                arrivals=arrivals,
                connected=self._connected if self.queue is not None else None,
                # a large fan-out's pushes go part by part, as each part is written
                written_part=self._part_handed(source, carried, key),
            )
            # per batch: the fan-out counted them already
            count(metrics.ROUTED, report.messages)
            count(metrics.DELIVERIES, report.deliveries)
            fault.at("after_inbox")
            fault.at("before_events")
            events.flush(f"router/{batch.stream}/{batch.shard}/{routed[0][0]}-{routed[-1][0]}")
            fault.at("after_events")
            if self.queue is not None and report.sessions and not report.handed_parts:
                # after every write of the batch: a hand-off that fails fails the batch (its
                # retry writes nothing twice and hands off again); a crash here loses nothing
                # (the deliveries wait in the inboxes for the next push or a reconnect)
                self._hand_off(
                    report.sessions,
                    source=source,
                    # what the batch wrote, which the pushes need not read back
                    lines=carried,
                    key=key,
                    direct=report.direct,
                    named=report.lines,
                    given=report.given,
                    # the drain's label: the pusher posts QoS 0 frames once its gate is
                    # open, and not after the session has passed their storage topic
                    stream=(
                        self.fanout.drain.push_label(batch.stream) if self.fanout.drain else None
                    ),
                )
        return dict(response)

    def _part_handed(self, source: str, lines: LineCache, key: str) -> WrittenPart | None:
        """Hands a written part's pushes over (``Fanout.route``'s ``written_part``)."""
        queue = self.queue
        if queue is None:
            return None

        def hand_off(part: int, targets: set[str], given: Mapping[str, Given]) -> None:
            queue.hand_off(targets, source=source, lines=lines, key=f"{key}#{part}", given=given)

        return hand_off

    def _connected(self, sessions: set[str]) -> set[str] | None:
        """Which of ``sessions`` (given QoS 0 deliveries) are connected: read for a few
        (one batch read), None for more (their QoS 0 deliveries are then written, as any)."""
        if self.connections is None or len(sessions) > TARGETS_READ_INLINE:
            return None
        return {c.session_id for c in self.connections.targets(sessions)}

    def _hand_off(
        self,
        sessions: set[str],
        *,
        source: str,
        lines: LineCache,
        key: str,
        direct: Mapping[str, list[InboxMessage]],
        named: Mapping[str, set[ArchiveLine]],
        given: Mapping[str, Given],
        stream: str | None = None,
    ) -> None:
        """The sessions' pushes to the push queue. Of a few sessions (one batch read), only
        the connected ones: most deliveries of an HTTP subscriber's would otherwise cost a
        queue message and an invocation for nothing. Of more, every one, the pusher reading
        which are connected: the router's work then does not grow with the fan-out (a
        queue message per lane, ``PushSettings.lanes``), and a shard never waits on a
        thousand reads."""
        assert self.queue is not None
        targets: dict[str, str | None] = dict.fromkeys(sessions)
        read: dict[str, Connection] = {}
        if self.connections is not None and len(sessions) <= TARGETS_READ_INLINE:
            read = {c.session_id: c for c in self.connections.targets(sessions)}
            targets = {s: c.client_id for s, c in read.items()}
        if targets:
            self.queue.hand_off(
                targets,
                source=source,
                lines=lines,
                key=key,
                direct={s: m for s, m in direct.items() if s in targets},
                now_ms=self.fanout.clock.now_ms(),
                named=named,
                given=given,
                # read after the writes, as the pusher's own read would be: not read again
                connections={s: c for s, c in read.items() if c.ready},
                stream=stream,
            )

    def _lag(self, event: dict[str, Any]) -> None:
        """The age of the batch's first record: one shard's records come in order, so the
        first is the oldest (the mapping's IteratorAge, per invocation)."""
        records = event.get("Records") or ()
        if records:
            arrived = records[0].get("kinesis", {}).get("approximateArrivalTimestamp")
            if arrived is not None:
                lag(metrics.ROUTER_LAG, self.fanout.clock.now_ms() - int(float(arrived) * 1000))


def _read(objects: Mapping[str, bytes], lines: Mapping[tuple[int, int], ArchiveLine]) -> LineCache:
    """The batch's archive lines as a get would read them back (``PayloadStore.fill``): the
    router holds what it just wrote, so its pushes need not read the archive."""
    return {line: json.loads(objects[line.key][line.offset : line.end]) for line in lines.values()}
