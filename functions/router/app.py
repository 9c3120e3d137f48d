"""The router: consumes storage streams through event source mappings; fans each batch out to
the inboxes of matching sessions and archives it (``shoal.router.batch``)."""

from typing import Any

from aws_lambda_powertools.utilities.typing import LambdaContext
from shoal import wiring
from shoal.core.observability import observed
from shoal.wiring import PerConfig

router = PerConfig(wiring.router)


@observed
def handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    return router().handle(event, context)
