"""The router: consumes storage streams through event source mappings and archives each batch.

Fan-out to subscribers comes with a later issue; archiving is already its real job. Records
are parsed by Powertools' BatchProcessor; the archive takes the records before the first
failure (Lambda hands the batch back from there), and an archive error fails the invocation
so that Lambda retries the batch: object keys are deterministic, so a retry overwrites.
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
from shoal.observability import logger
from shoal.streams import PerConfig

service = PerConfig(ArchiveWriter.from_config)


@logger.inject_lambda_context(clear_state=True)
def handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    writer = service()
    batch = writer.batch()
    # one processor per invocation: the local runtime invokes concurrently in one process
    processor = BatchProcessor(
        event_type=EventType.KinesisDataStreams, model=KinesisDataStreamRecord
    )
    response = process_partial_response(
        event=event, record_handler=batch.add, processor=processor, context=context
    )
    failed = [int(str(f["itemIdentifier"])) for f in response.get("batchItemFailures", [])]
    writer.write(batch.objects(min(failed) if failed else None))
    return dict(response)
