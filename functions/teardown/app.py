"""Custom resource, run by CloudFormation through CDK's Provider framework (on_event): when the
stack is deleted, removes the Kinesis streams and event source mappings that topics and push
subscriptions made at run time, unless the ``Retain`` property says to keep them
(``shoal.teardown``)."""

from typing import Any

from aws_lambda_powertools.utilities.typing import LambdaContext
from shoal.aws import clients
from shoal.core.config import get_config
from shoal.core.observability import logger
from shoal.teardown import on_event, stack_status
from shoal.wiring import teardown


@logger.inject_lambda_context(clear_state=True)
def handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    config = get_config()
    cloudformation = clients.client("cloudformation", config.region)
    return on_event(
        event,
        lambda: teardown(config),
        lambda stack_id: stack_status(cloudformation, stack_id),
    )
