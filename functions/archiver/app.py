"""The archiver: consumes the delivery-event log and writes it to the archive bucket as the
pipeline reads it (``shoal.delivery.archiver``).

Invoked by the event source mapping the stack declares on the log (``ARCHIVER_MAPPING``).
"""

from typing import Any

from aws_lambda_powertools.utilities.typing import LambdaContext
from shoal.core.observability import observed
from shoal.delivery.archiver import EventArchiver
from shoal.wiring import PerConfig

archiver = PerConfig(EventArchiver.from_config)


@observed
def handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    return archiver().handle(event)
