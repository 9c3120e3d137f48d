"""One router invocation: a batch of one storage shard, fanned out, then archived.

Records are parsed by Powertools' BatchProcessor. Only the records before the first failure
are routed and archived (Lambda hands the batch back from there). Fan-out goes first, then the
archive; an error in either fails the invocation so that Lambda retries the batch: inbox writes
skip what an earlier attempt wrote (the shard's ledger), archive object keys are deterministic.

Delivery events: the ``routed`` events of the batch are written as one object after the inbox
writes (``shoal.delivery.events``), keyed by stream, shard and the batch's sequence range, so
a retried batch rewrites the same object. ``SHOAL_FAULTS=router=<p>`` fails invocations at a
random step on purpose (``shoal.core.faults``; tests only).
"""

from __future__ import annotations

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
from shoal.router.archive import ArchiveWriter
from shoal.router.fanout import Fanout


class Router:
    """Routes one event source mapping batch: fan-out, delivery events, archive, in that order."""

    def __init__(
        self, fanout: Fanout, archive: ArchiveWriter, recording: Recording, faults: Faults
    ) -> None:
        self.fanout = fanout
        self.archive = archive
        self.recording = recording
        self.faults = faults

    def handle(self, event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
        self._lag(event)
        batch = self.archive.batch()
        records: list[tuple[str, bytes]] = []

        def handle(record: KinesisDataStreamRecord) -> None:
            batch.add(record)
            data = record.kinesis.data
            assert isinstance(data, bytes)
            records.append((record.kinesis.sequenceNumber, data))

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
        fault.at("before_inbox")
        if routed:
            events = self.recording.new()
            report = self.fanout.route_records(batch.stream, batch.shard, routed, events)
            # per batch: the fan-out counted them already
            count(metrics.ROUTED, report.messages)
            count(metrics.DELIVERIES, report.deliveries)
            fault.at("after_inbox")
            fault.at("before_events")
            events.flush(f"router/{batch.stream}/{batch.shard}/{routed[0][0]}-{routed[-1][0]}")
            fault.at("after_events")
        fault.at("before_archive")
        self.archive.write(batch.objects(cut))
        fault.at("after_archive")
        return dict(response)

    def _lag(self, event: dict[str, Any]) -> None:
        """The age of the batch's first record: one shard's records come in order, so the
        first is the oldest (the mapping's IteratorAge, per invocation)."""
        records = event.get("Records") or ()
        if records:
            arrived = records[0].get("kinesis", {}).get("approximateArrivalTimestamp")
            if arrived is not None:
                lag(metrics.ROUTER_LAG, self.fanout.clock.now_ms() - int(float(arrived) * 1000))
