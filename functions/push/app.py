"""Push subscriptions' delivery: push tap batches (storage streams) and retry queue batches.

Invoked by event source mappings made at run time by the push admin (``shoal.push.admin``,
``shoal.push.queues``): one per storage stream that push subscriptions read, one per retry
queue.
"""

from typing import Any

from aws_lambda_powertools.utilities.typing import LambdaContext
from shoal.core.observability import observed
from shoal.push.delivery import PushConsumer
from shoal.wiring import PerConfig

service = PerConfig(PushConsumer.from_config)


@observed
def handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    return service().handle(event, context.get_remaining_time_in_millis())
