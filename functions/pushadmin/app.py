"""Push subscriptions (admin): create, list, get, change, delete, seek, DLQ list and redrive."""

from typing import Any

from aws_lambda_powertools.event_handler import Response
from shoal.http.body import parse_body
from shoal.http.caller import admin_only
from shoal.http.resolver import json_response, lambda_handler, make_resolver, query_values
from shoal.push.admin import PushAdmin
from shoal.push.api import CreateRequest, RedriveRequest, SeekRequest, UpdateRequest
from shoal.wiring import PerConfig

app = make_resolver()
# every route needs the shoal:admin claim, checked before the request is looked at
app.use(middlewares=[admin_only])
service = PerConfig(PushAdmin.from_config)


@app.post("/v1/subscriptions")
def create_subscription() -> Response[str]:
    return json_response(201, service().create(parse_body(app, CreateRequest)))


@app.get("/v1/subscriptions")
def list_subscriptions() -> dict[str, Any]:
    return service().list_page(*query_values(app, "limit", "page_token"))


@app.get("/v1/subscriptions/<name>")
def get_subscription(name: str) -> dict[str, Any]:
    return service().describe(name)


@app.patch("/v1/subscriptions/<name>")
def update_subscription(name: str) -> dict[str, Any]:
    return service().update(name, parse_body(app, UpdateRequest))


@app.delete("/v1/subscriptions/<name>")
def delete_subscription(name: str) -> Response[str]:
    service().delete(name)
    return Response(status_code=204, body="")


@app.post("/v1/subscriptions/<name>/seek")
def seek(name: str) -> dict[str, Any]:
    return service().seek(name, parse_body(app, SeekRequest))


@app.get("/v1/subscriptions/<name>/dlq")
def dead_letters(name: str) -> dict[str, Any]:
    return service().dead_letters(name, *query_values(app, "limit", "after"))


@app.post("/v1/subscriptions/<name>/dlq/redrive")
def redrive(name: str) -> dict[str, Any]:
    return service().redrive(name, parse_body(app, RedriveRequest))


handler = lambda_handler(app)
