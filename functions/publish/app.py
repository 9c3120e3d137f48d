"""POST /v1/messages and POST /v1/messages:batch."""

from typing import Any

from aws_lambda_powertools.event_handler import Response
from shoal.http.body import parse_body
from shoal.http.caller import principal
from shoal.http.resolver import json_response, lambda_handler, make_resolver
from shoal.publish.request import BatchRequest, PublishRequest
from shoal.publish.service import PublishService
from shoal.wiring import PerConfig

app = make_resolver()
service = PerConfig(PublishService.from_config)


@app.post("/v1/messages")
def publish() -> Response[str]:
    who = principal(app)
    status, body = service().publish(who, parse_body(app, PublishRequest))
    return json_response(status, body)


@app.post("/v1/messages:batch")
def publish_batch() -> dict[str, Any]:
    who = principal(app)
    return {"results": service().publish_batch(who, parse_body(app, BatchRequest).messages)}


handler = lambda_handler(app)
