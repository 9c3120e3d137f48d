"""The router: consumes storage streams through event source mappings; fans each batch out to
the inboxes of matching sessions (``shoal.fanout``) and archives it (``shoal.archive``).

Records are parsed by Powertools' BatchProcessor. Only the records before the first failure
are routed and archived (Lambda hands the batch back from there). Fan-out goes first, then the
archive; an error in either fails the invocation so that Lambda retries the batch: inbox writes
skip what an earlier attempt wrote (the shard's ledger), archive object keys are deterministic.

Delivery events: the ``routed`` events of the batch are written as one object after the inbox
writes (``shoal.delivery_events``), keyed by stream, shard and the batch's sequence range, so
a retried batch rewrites the same object. ``SHOAL_FAULTS=router=<p>`` fails invocations at a
random step on purpose (``shoal.faults``; tests only).
"""

from typing import Any

from aws_lambda_powertools.utilities.batch import (
    BatchProcessor,
    EventType,
    process_partial_response,
)
from aws_lambda_powertools.utilities.parser.models import KinesisDataStreamRecord
from aws_lambda_powertools.utilities.typing import LambdaContext
from shoal.archive import ArchiveWriter
from shoal.core.faults import ROUTER_STEPS, Faults
from shoal.core.observability import logger
from shoal.delivery.events import Recording
from shoal.fanout import Fanout
from shoal.wiring import PerConfig

service = PerConfig(ArchiveWriter.from_config)
fanout = PerConfig(Fanout.from_config)
recording = PerConfig(Recording.from_config)
faults = PerConfig(lambda config: Faults.from_config(config, "router"))


@logger.inject_lambda_context(clear_state=True)
def handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    writer = service()
    batch = writer.batch()
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
    fault = faults().plan(ROUTER_STEPS)
    fault.at("before_inbox")
    if routed:
        events = recording().new()
        fanout().route_records(batch.stream, batch.shard, routed, events)
        fault.at("after_inbox")
        fault.at("before_events")
        events.flush(f"router/{batch.stream}/{batch.shard}/{routed[0][0]}-{routed[-1][0]}")
        fault.at("after_events")
    fault.at("before_archive")
    writer.write(batch.objects(cut))
    fault.at("after_archive")
    return dict(response)
