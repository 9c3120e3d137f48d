"""Admin: composite topics, a shared group's view, the console's Overview (``shoal.overview``)."""

from urllib.parse import unquote

from aws_lambda_powertools.event_handler import Response
from shoal.composite.model import AddStorageTopic, CreateTopic
from shoal.groups.admin import GroupView
from shoal.http.body import NoBody, parse_body
from shoal.http.caller import admin_only
from shoal.http.resolver import json_response, lambda_handler, make_resolver, query_values
from shoal.overview import Overview
from shoal.wiring import PerConfig, topic_service

app = make_resolver()
# every route needs the shoal:admin claim, checked before the request is looked at
app.use(middlewares=[admin_only])
service = PerConfig(topic_service)
groups = PerConfig(GroupView.from_config)
overview = PerConfig(Overview.from_config)


@app.post("/v1/topics")
def create_topic() -> Response[str]:
    body = parse_body(app, CreateTopic)
    return json_response(201, service().create(body.name, body.partitions).document())


@app.get("/v1/topics")
def list_topics() -> dict[str, object]:
    return {"topics": [t.document() for t in service().list()]}


@app.get("/v1/topics/<name>")
def get_topic(name: str) -> dict[str, object]:
    return service().get(name).document()


@app.post("/v1/topics/<name>/storage-topics")
def add_storage_topic(name: str) -> Response[str]:
    body = parse_body(app, AddStorageTopic)
    return json_response(201, service().add_storage_topic(name, body.partitions).document())


@app.post("/v1/topics/<name>/switch-produce")
def switch_produce(name: str) -> dict[str, object]:
    parse_body(app, NoBody)
    return service().switch_produce(name).document()


@app.get("/v1/groups/<share>")
def get_group(share: str) -> dict[str, object]:
    return groups().describe(unquote(share), *query_values(app, "filter"))  # raw path: %-encoded


@app.get("/v1/metrics")
def get_metrics() -> dict[str, object]:
    return overview().view(*query_values(app, "range"))


handler = lambda_handler(app)
