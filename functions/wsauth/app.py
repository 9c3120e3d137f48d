"""The WebSocket API's $connect authorizer: the HTTP API's JWT rules (``shoal.edge.authorizer``)."""

from __future__ import annotations

from functools import cache
from typing import Any

from aws_lambda_powertools.utilities.typing import LambdaContext
from shoal.core.config import get_config
from shoal.core.jwt import AuthorizationFailed
from shoal.core.observability import logger, observed
from shoal.edge.authorizer import WebSocketAuthorizer


@cache
def authorizer() -> WebSocketAuthorizer:
    # one per container: the issuer's keys are fetched once and kept (CachedKeySet)
    return WebSocketAuthorizer.from_config(get_config())


@observed
def handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    try:
        return authorizer().authorize(event)
    except AuthorizationFailed as refused:
        # the reason is the authorizer's own text, never the token
        logger.info("handshake refused", extra={"reason": refused.reason})
        # API Gateway answers exactly this message with 401; the cause stays out of the error
        raise Exception("Unauthorized") from None
