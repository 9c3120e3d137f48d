"""What a million delivered messages cost: counted AWS usage times public list prices.

Each scenario runs the real handlers (publish, router, push, messages) in-process over moto,
as Lambda would invoke them, and counts with the bench's call counter (``bench.account``) and
two hooks on the same botocore clients: every AWS call, DynamoDB write and read units from the
items' sizes (DynamoDB's rules: writes per 1 KB, reads per 4 KB), Kinesis records and their PUT
payload units (25 KB each), S3 requests, HTTP API requests, Lambda invocations and their
GB-seconds (each invocation's wall time in-process times its function's declared memory).
Only the traffic is counted: the sessions' connects and subscribes, and the warm-up round that
makes the clients, come before the meters start.

The counts are then priced (``PRICES``, us-east-1 list prices, each with its page) and divided
by the deliveries: dollars per million delivered messages, per line, next to what the same
traffic costs on AWS IoT Core and on SNS+SQS (``alternatives``).

Steady load: every get returns a full page (no empty long polls), publishers batch 100
messages over ``KEYS`` ordering keys, and Kinesis shards run at ``SHARD_UTILIZATION`` of their
write limit (shard-hours per message follow from the records' counted sizes), the storage
streams' and the delivery-event log's each from their own records (the log is a provisioned
stream too: docs/operations.md, "Cost"). The archiver is invoked over the log's records of
each round as its mapping would (up to 10,000 records a batch), as the router is over the
storage stream's, and counted the same way.

Not counted: storage (DynamoDB items until acked or expired, S3 archive objects: per GB-month,
not per message), session heartbeats (per session and keepalive, not per message), CloudWatch
Logs ingestion of the functions' log lines, data transfer out, and free tiers.
"""

from __future__ import annotations

import copy
import json
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import boto3
from shoal.aws import clients
from shoal.aws.kinesis import ARCHIVER_MAPPING, PUSH_MAPPING, ROUTER_MAPPING
from shoal.client.acks import DEFAULT_ACK_DELAY_S
from shoal.client.wslink import WsSettings
from shoal.core.config import get_config
from shoal.declarations import DEPLOYMENT
from shoal.delivery.events import EVENT_LOG
from shoal.local.context import LambdaContext

from bench.account import CallMeter, emulated_account, item_size
from bench.delivery import CLAIMS, EVENT, WriteUnits
from bench.push import Endpoint, stream_events

PAYLOAD = "x" * 256
#: ordering keys over which a batched publisher spreads its 100 messages (a gateway batching
#: the readings of 10 devices): Kinesis records per message fall with messages per key
KEYS = 10
#: share of a shard's write limit used at steady load (headroom for bursts)
SHARD_UTILIZATION = 0.5
SHARD_RECORDS_PER_S = 1000
SHARD_BYTES_PER_S = 1024 * 1024


# --- prices ----------------------------------------------------------------------------------

#: region and date the prices were read for
REGION = "us-east-1"
PRICED_ON = "2026-11-25"


@dataclass(frozen=True)
class Price:
    dollars: float
    per: float
    unit: str
    source: str

    def cost(self, quantity: float) -> float:
        return quantity * self.dollars / self.per


#: Each price's ``source``: the AWS pricing page, then where the figure was read for us-east-1
#: on ``PRICED_ON`` (stored copies of pages found with the search tool); "not in the stored
#: copies" marks a figure taken from the AWS page as remembered, to be checked before quoting.
PRICES: dict[str, Price] = {
    "api_requests": Price(
        1.00,
        1e6,
        "HTTP API request (first 300M a month, 512 KB increments)",
        "https://aws.amazon.com/api-gateway/pricing/; figure: AWS whitepaper "
        "docs.aws.amazon.com/whitepapers/latest/best-practices-api-gateway-private-apis-"
        "integration/cost-optimization.html (Table 4, us-east-1)",
    ),
    "lambda_requests": Price(
        0.20,
        1e6,
        "Lambda request",
        "https://aws.amazon.com/lambda/pricing/; figure: cloudchipr.com/blog/aws-lambda-pricing "
        "(US East)",
    ),
    "lambda_gb_s": Price(
        0.0000133334,
        1,
        "Lambda GB-second, arm64 (first 7.5 billion GB-s a month)",
        "https://aws.amazon.com/lambda/pricing/; figure: cloudchipr.com/blog/aws-lambda-pricing "
        "(US East, ARM, first tier)",
    ),
    "dynamodb_wru": Price(
        0.625,
        1e6,
        "DynamoDB on-demand write request unit (1 KB; a transactional write counts 2)",
        "https://aws.amazon.com/dynamodb/pricing/on-demand/; figure: airbyte.com/data-"
        "engineering-resources/dynamodb-pricing (US East, after the reduction of Nov 2024)",
    ),
    "dynamodb_rru": Price(
        0.125,
        1e6,
        "DynamoDB on-demand read request unit (4 KB strongly consistent; an eventually "
        "consistent read counts half)",
        "https://aws.amazon.com/dynamodb/pricing/on-demand/; figure: as for write units",
    ),
    "kinesis_put_units": Price(
        0.014,
        1e6,
        "Kinesis PUT payload unit (25 KB of a record), provisioned mode",
        "https://aws.amazon.com/kinesis/data-streams/pricing/ (provisioned tab; the unit's "
        "definition is in the stored copy); figure: github.com/EveryMundo/aws-kinesis-client "
        "docs/why-we-created-this-package.md ($0.014/M, the lowest regional rate)",
    ),
    "kinesis_shard_hours": Price(
        0.015,
        1,
        "Kinesis shard-hour, provisioned mode",
        "https://aws.amazon.com/kinesis/data-streams/pricing/ (provisioned tab); figure: "
        "awsnegotiations.com/kinesis-pricing-optimization.html (its pricing table) and "
        "kindatechnical.com/aws-kinesis/lesson-29-understanding-kinesis-pricing.html",
    ),
    "s3_puts": Price(
        0.005,
        1000,
        "S3 Standard PUT, COPY, POST, LIST request",
        "https://aws.amazon.com/s3/pricing/ (requests tab); figure: cloudkaramchari.com/blog/"
        "understanding-per-1000-put-copy-post-or-list-requests-in-amazon-s3-pricing",
    ),
    "s3_gets": Price(
        0.0004,
        1000,
        "S3 Standard GET request",
        "https://aws.amazon.com/s3/pricing/ (requests tab); figure: c3x.dev/blog/s3-request-"
        "fees-explained and awsi.click/en/articles/s3-request-pricing-get-put-difference "
        "(us-east-1)",
    ),
    "sqs_requests": Price(
        0.50,
        1e6,
        "SQS FIFO request (64 KB chunks): a send of up to 10 messages, a receive, a delete",
        "https://aws.amazon.com/sqs/pricing/ (FIFO queues, first 100 billion a month); figure: "
        "cloudburn.io/blog/amazon-sqs-pricing (us-east-1, March 2026)",
    ),
}

#: the alternatives' prices (same region and date)
IOT_MESSAGE = Price(
    1.00,
    1e6,
    "IoT Core message (5 KB increments; first billion a month): a PUBLISH in, each PUBLISH "
    "out, and each PUBACK a QoS 1 subscriber sends",
    "https://aws.amazon.com/iot-core/pricing/ (metering rules: its additional-details page, "
    "in the stored copies); figure not in the stored copies",
)
IOT_RULE = Price(
    0.15,
    1e6,
    "IoT Core rule triggered, plus $0.15/M actions (an HTTP action for push)",
    "https://aws.amazon.com/iot-core/pricing/ (rules engine); figure not in the stored copies",
)
SNS_PUBLISH = Price(
    0.50,
    1e6,
    "SNS standard topic publish request (64 KB chunks; PublishBatch of 10 is one request)",
    "https://aws.amazon.com/sns/pricing/; figure: factualminds.com/blog/amazon-sns-pricing-"
    "publishes-fanout-protocols",
)
SNS_HTTP = Price(
    0.60,
    1e6,
    "SNS HTTP/S delivery",
    "https://aws.amazon.com/sns/pricing/; figure: as for publishes",
)
SQS_REQUEST = Price(
    0.40,
    1e6,
    "SQS standard request (64 KB chunks): SNS's send into a queue, a receive or delete of up to 10",
    "https://aws.amazon.com/sqs/pricing/; figure: cloudburn.io/blog/amazon-sqs-pricing "
    "(us-east-1, March 2026)",
)


# --- what is counted -------------------------------------------------------------------------


class ReadUnits:
    """DynamoDB read units of one client's calls, from the items they return: per 4 KB,
    rounded up per item (GetItem, BatchGetItem) or per call (Query, Scan), at least one a
    call; an eventually consistent read (``ConsistentRead`` false or absent) costs half."""

    def __init__(self) -> None:
        self.units = 0.0
        self.by_operation: dict[str, float] = {}

    def attach(self, client: Any) -> None:
        client.meta.events.register("before-parameter-build.dynamodb.*", self._note)
        client.meta.events.register("after-call.dynamodb.*", self._record)

    @staticmethod
    def _note(params: dict[str, Any], model: Any, context: dict[str, Any], **_: Any) -> None:
        # the request's consistency, for the after-call event (both get the call's context)
        consistent = params.get("ConsistentRead")
        if model.name == "BatchGetItem":
            consistent = all(t.get("ConsistentRead") for t in params["RequestItems"].values())
        context["shoal_consistent"] = bool(consistent)

    def _record(
        self, parsed: dict[str, Any], model: Any, context: dict[str, Any] | None = None, **_: Any
    ) -> None:
        name = model.name
        transactional = name == "TransactGetItems"
        half = not transactional and not (context or {}).get("shoal_consistent", True)
        units = 0.0
        if name == "GetItem":
            item = parsed.get("Item")
            units = max(1, math.ceil(item_size(item) / 4096)) if item else 1
        elif name == "BatchGetItem":
            for items in parsed.get("Responses", {}).values():
                units += sum(max(1, math.ceil(item_size(i) / 4096)) for i in items)
        elif name in ("Query", "Scan"):
            size = sum(item_size(i) for i in parsed.get("Items", []))
            units = max(1, math.ceil(size / 4096))
        elif name == "TransactGetItems":
            for response in parsed.get("Responses", []):
                item = response.get("Item")
                units += 2 * (max(1, math.ceil(item_size(item) / 4096)) if item else 1)
        if half:
            units /= 2
        if units:
            self.units += units
            self.by_operation[name] = self.by_operation.get(name, 0.0) + units


class PutUnits:
    """Kinesis PUT payload units (25 KB each, per record) and bytes of one client's puts; the
    records and bytes that went to the delivery-event log, apart (its shards are its own)."""

    def __init__(self, event_log: str = "") -> None:
        self.units = 0
        self.bytes = 0
        self.event_log = event_log
        self.log_records = 0
        self.log_bytes = 0

    def attach(self, client: Any) -> None:
        client.meta.events.register("before-parameter-build.kinesis.*", self._record)

    def _record(self, params: dict[str, Any], model: Any, **_: Any) -> None:
        if model.name == "PutRecords":
            records = params.get("Records", [])
        elif model.name == "PutRecord":
            records = [params]
        else:
            return
        to_log = bool(self.event_log) and params.get("StreamName") == self.event_log
        for record in records:
            size = len(record.get("Data", b"")) + len(record.get("PartitionKey", "").encode())
            self.units += max(1, math.ceil(size / (25 * 1024)))
            if to_log:
                self.log_records += 1
                self.log_bytes += size
            else:
                self.bytes += size


@dataclass
class Counts:
    """What one scenario's traffic used, counted; ``delivered`` is what clients received."""

    scenario: str
    published: int = 0
    delivered: int = 0
    api_requests: int = 0
    lambda_requests: int = 0
    lambda_gb_s: float = 0.0
    #: the invocations' billed seconds (what concurrency follows)
    lambda_s: float = 0.0
    dynamodb_wru: float = 0.0
    dynamodb_rru: float = 0.0
    #: records and bytes put into storage streams
    kinesis_records: int = 0
    kinesis_put_units: int = 0
    kinesis_bytes: int = 0
    #: records and bytes appended to the delivery-event log (their PUT units are in
    #: ``kinesis_put_units``)
    event_log_records: int = 0
    event_log_bytes: int = 0
    s3_puts: int = 0
    s3_gets: int = 0
    calls: dict[str, int] = field(default_factory=dict)
    #: DynamoDB write and read units by operation (``BatchWriteItem``: the router's inbox
    #: items; ``Query``: mostly the gets' inbox reads)
    wru_by_operation: dict[str, float] = field(default_factory=dict)
    rru_by_operation: dict[str, float] = field(default_factory=dict)
    invocations: dict[str, int] = field(default_factory=dict)

    @property
    def kinesis_shard_hours(self) -> float:
        """Shard-hours at steady load: each stream's shards sized to ``SHARD_UTILIZATION`` of
        the write limit its counted records reach first (records or bytes a second)."""
        return shard_hours(self.kinesis_records, self.kinesis_bytes) + shard_hours(
            self.event_log_records, self.event_log_bytes
        )


def shard_hours(records: int, size: int) -> float:
    if not records:
        return 0.0
    per_record = size / records
    records_per_s = min(SHARD_RECORDS_PER_S, SHARD_BYTES_PER_S / max(per_record, 1))
    seconds = records / (records_per_s * SHARD_UTILIZATION)
    return seconds / 3600


class TableCalls:
    """DynamoDB calls by the function that made them, operation and table (``"reaper:
    BatchGetItem groups"``): which function's batch read asked which table, where the call
    counter has only the operation. Tables by their logical names (``Config.tables``); a
    batch call counts once for each table it names. ``function``: the one being invoked
    (``Run.invoke``)."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.function = ""
        self._config: Any = None
        self._logical: dict[str, str] = {}

    def attach(self, client: Any) -> None:
        client.meta.events.register("before-parameter-build.dynamodb.*", self._record)

    def _record(self, params: dict[str, Any], model: Any, **_: Any) -> None:
        config = get_config()
        if config is not self._config:
            self._config, self._logical = config, {v: k for k, v in config.tables.items()}
        named = params.get("RequestItems") or params.get("TableName") or ()
        for table in [named] if isinstance(named, str) else list(named):
            key = f"{self.function or 'outside'}: {model.name} {self._logical.get(table, table)}"
            self.calls[key] = self.calls.get(key, 0) + 1


class Meters:
    """The meters on every client the functions made (one per service and profile)."""

    def __init__(self, event_log: str = "") -> None:
        self.calls = CallMeter()
        self.writes = WriteUnits()
        self.reads = ReadUnits()
        self.puts = PutUnits(event_log)
        self.tables = TableCalls()
        self._attached: list[Any] = []

    def attach_all(self) -> None:
        # clients.client makes one client per (service, region, profile) per process
        for client in list(clients._clients.values()):
            if any(c is client for c in self._attached):
                continue
            self._attached.append(client)
            self.calls.attach(client)
            service = client.meta.service_model.service_name
            if service == "dynamodb":
                self.writes.attach(client)
                self.reads.attach(client)
                self.tables.attach(client)
            elif service == "kinesis":
                self.puts.attach(client)

    def reset(self) -> None:
        self.calls.reset()
        self.writes.units = 0.0
        self.writes.by_operation.clear()
        self.reads.units = 0.0
        self.reads.by_operation.clear()
        self.puts.units = self.puts.bytes = 0
        self.puts.log_records = self.puts.log_bytes = 0
        self.tables.calls.clear()


# --- one scenario ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    name: str
    #: messages per publish request (1: POST /v1/messages; else :batch)
    batch: int = 100
    #: sessions with a plain subscription to every message
    subscribers: int = 1
    #: members of one shared group ($share/g/...) instead of plain subscribers
    group: int = 0
    #: one push subscription instead of sessions
    push: bool = False
    #: a get's max
    get_max: int = 100
    messages: int = 1000
    lever: str = ""


SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "single publish",
        batch=1,
        messages=500,
        lever="batching: one API request, one Lambda request and one Kinesis record per "
        "message, where a batch of 100 shares them",
    ),
    Scenario(
        "batched publish (100), 1 subscriber",
        lever="the get/ack requests per page, and the Lambda time of each (their delivery "
        "events are one Kinesis record a call, archived in batches)",
    ),
    Scenario(
        "10 subscribers per message",
        subscribers=10,
        messages=500,
        lever="the publish side is shared by 10 deliveries; the inbox writes and the "
        "subscribers' own gets and acks are not",
    ),
    Scenario(
        "shared group (4 members)",
        subscribers=0,
        group=4,
        lever="members' gets that find their lanes empty, and lane progress writes",
    ),
    Scenario(
        "push subscription",
        subscribers=0,
        push=True,
        lever="no client requests and one cursor write per batch; Lambda time per POST, "
        "so the endpoint's latency (the bench's answers at once)",
    ),
    Scenario(
        "long-poll with max=10",
        get_max=10,
        lever="max: 10 messages a get make ten times the gets and acks of max=100",
    ),
)


def _http(
    method: str,
    path: str,
    *,
    route: str | None = None,
    body: Any = None,
    query: dict[str, str] | None = None,
    parameters: dict[str, str] | None = None,
    headers: dict[str, str] | None = None,
) -> dict[str, Any]:
    event: dict[str, Any] = copy.deepcopy(json.loads(EVENT.read_text()))
    event["routeKey"] = event["requestContext"]["routeKey"] = f"{method} {route or path}"
    event["rawPath"] = event["requestContext"]["http"]["path"] = path
    event["requestContext"]["http"]["method"] = method
    event["requestContext"]["authorizer"]["jwt"]["claims"] = CLAIMS
    event["requestContext"]["timeEpoch"] = int(time.time() * 1000)
    event["queryStringParameters"] = query
    event["rawQueryString"] = "&".join(f"{k}={v}" for k, v in (query or {}).items())
    event["pathParameters"] = parameters
    event["headers"].update({k.lower(): v for k, v in (headers or {}).items()})
    event["body"] = json.dumps(body) if body is not None else None
    return event


class AwsSideTime:
    """CPU time in-process moto spent answering calls: on AWS that work is the service's, and
    the function only waits for it (``CALL_RTT_S`` a call, priced separately). Measured on the
    answering thread, so a call made from a handler's worker thread is counted too."""

    def __init__(self) -> None:
        self.total_s = 0.0
        self._lock = threading.Lock()
        self._installed = False

    def install(self) -> None:
        if self._installed:
            return
        from moto.core.botocore_stubber import BotocoreStubber

        original = BotocoreStubber.process_request
        meter = self

        def timed(stubber: Any, request: Any) -> Any:
            started = time.thread_time()
            try:
                return original(stubber, request)
            finally:
                spent = time.thread_time() - started
                with meter._lock:
                    meter.total_s += spent

        BotocoreStubber.process_request = timed
        self._installed = True


AWS_SIDE = AwsSideTime()


class Run:
    """One scenario's account, its handlers, and what they used."""

    def __init__(self, session: boto3.Session, scenario: Scenario) -> None:
        import functions.archiver.app as archiver_app
        import functions.edge.app as edge_app
        import functions.messages.app as messages_app
        import functions.publish.app as publish_app
        import functions.push.app as push_app
        import functions.pusher.app as pusher_app
        import functions.reaper.app as reaper_app
        import functions.router.app as router_app
        import functions.sessions.app as sessions_app
        import functions.subscriptions.app as subscriptions_app
        import functions.wsauth.app as wsauth_app

        self.session = session
        self.scenario = scenario
        self.handlers: dict[str, Callable[[dict[str, Any], Any], Any]] = {
            "publish": publish_app.handler,
            "router": router_app.handler,
            "archiver": archiver_app.handler,
            "push": push_app.handler,
            "pusher": pusher_app.handler,
            "reaper": reaper_app.handler,
            "messages": messages_app.handler,
            "sessions": sessions_app.handler,
            "subscriptions": subscriptions_app.handler,
            "edge": edge_app.handler,
            "wsauth": wsauth_app.handler,
        }
        self.push_app: Any = push_app
        self.event_log = get_config().streams[EVENT_LOG]
        self.meters = Meters(self.event_log)
        self.counts = Counts(scenario.name)
        self.metering = False
        #: an invocation's time as the process's CPU time (without the waits of a loaded
        #: machine), less in-process moto's (``AWS_SIDE``), instead of its wall time
        self.cpu_time = False
        #: that CPU time stretched by the function's share of a vCPU (``FULL_VCPU_MB``), as
        #: Lambda would run it (the fleet's pricing; the fan-out model divides by it itself)
        self.vcpu_share = False
        AWS_SIDE.install()
        self.kinesis = session.client("kinesis")  # the bench's own reads: not metered
        #: stream -> the last sequence number handed to a function
        self.positions: dict[str, str] = {}
        self.sent = 0

    # -- invoking, as Lambda and API Gateway would

    def invoke(self, function: str, event: dict[str, Any], *, http: bool = True) -> Any:
        fdef = DEPLOYMENT.function(function)
        context = LambdaContext(
            f"shoal-{function}", memory_mb=fdef.memory_mb, timeout_s=fdef.timeout_s
        )
        clock = time.process_time if self.cpu_time else time.perf_counter
        started, aws_side = clock(), AWS_SIDE.total_s
        self.meters.tables.function = function
        try:
            answer = self.handlers[function](event, context)
        finally:
            self.meters.tables.function = ""
        elapsed = clock() - started
        if self.cpu_time:
            elapsed = max(elapsed - (AWS_SIDE.total_s - aws_side), 0.0)
            if self.vcpu_share:
                # Lambda gives a function a share of a vCPU in proportion to its memory (a
                # whole one at FULL_VCPU_MB): measured on a whole core here, longer there
                elapsed *= max(1.0, FULL_VCPU_MB / fdef.memory_mb)
        if self.metering:
            c = self.counts
            c.lambda_requests += 1
            c.api_requests += int(http)
            # billed per started millisecond
            c.lambda_gb_s += fdef.memory_mb / 1024 * math.ceil(elapsed * 1000) / 1000
            c.lambda_s += math.ceil(elapsed * 1000) / 1000
            c.invocations[function] = c.invocations.get(function, 0) + 1
        if http and answer["statusCode"] >= 300:
            raise RuntimeError(f"{function}: {answer['statusCode']} {answer['body'][:200]}")
        return json.loads(answer["body"]) if http and answer.get("body") else answer

    def session_call(
        self, function: str, method: str, client: str, suffix: str = "", **kw: Any
    ) -> Any:
        return self.invoke(
            function,
            _http(
                method,
                f"/v1/sessions/{client}{suffix}",
                route=f"/v1/sessions/{{client_id}}{suffix}",
                parameters={"client_id": client},
                **kw,
            ),
        )

    # -- the traffic

    def publish(self, count: int) -> None:
        batch = self.scenario.batch
        for start in range(0, count, batch):
            messages = [
                {
                    "topic": f"bench/{(self.sent + n) % 16}",
                    "text": PAYLOAD,
                    "qos": 1,
                    "ordering_key": f"device-{(self.sent + n) % KEYS}",
                }
                for n in range(min(batch, count - start))
            ]
            self.sent += len(messages)
            if batch == 1:
                self.invoke("publish", _http("POST", "/v1/messages", body=messages[0]))
            else:
                self.invoke(
                    "publish", _http("POST", "/v1/messages:batch", body={"messages": messages})
                )

    def _events(self, per_batch: int, stream: str = "shoal-default-0") -> list[dict[str, Any]]:
        """The events of the mapping on ``stream`` (the router's or push tap's on the storage
        stream, the archiver's on the event log) for what was put since the last call."""
        shard = self.kinesis.list_shards(StreamName=stream)["Shards"][0]["ShardId"]
        position = self.positions.get(stream)
        if position is None:
            kind: dict[str, Any] = {"ShardIteratorType": "TRIM_HORIZON"}
        else:
            kind = {
                "ShardIteratorType": "AFTER_SEQUENCE_NUMBER",
                "StartingSequenceNumber": position,
            }
        iterator = self.kinesis.get_shard_iterator(StreamName=stream, ShardId=shard, **kind)[
            "ShardIterator"
        ]
        raw = self.kinesis.get_records(ShardIterator=iterator, Limit=10_000)["Records"]
        if not raw:
            return []
        self.positions[stream] = raw[-1]["SequenceNumber"]
        return stream_events(self.kinesis, stream, shard, raw, per_batch)

    def consume(self, sessions: list[tuple[str, str]], wanted: int) -> int:
        """Every session gets and acks, page by page, until ``wanted`` messages came; a page
        shorter than max ends a plain subscriber's turn (at steady load the next get finds
        new messages: no empty long poll is counted)."""
        got = 0
        active = list(sessions)
        idle_rounds = 0
        while active and got < wanted:
            progressed = False
            for client, channel in list(active):
                page = self.session_call(
                    "messages",
                    "GET",
                    client,
                    "/messages",
                    query={"max": str(self.scenario.get_max)},
                    headers={"Shoal-Channel": channel},
                )["messages"]
                if page:
                    progressed = True
                    got += len(page)
                    self.session_call(
                        "messages",
                        "POST",
                        client,
                        "/acks",
                        body={"ids": [m["id"] for m in page]},
                        headers={"Shoal-Channel": channel},
                    )
                if not self.scenario.group and len(page) < self.scenario.get_max:
                    active.remove((client, channel))
            idle_rounds = 0 if progressed else idle_rounds + 1
            if idle_rounds > 3:
                raise RuntimeError(f"{self.scenario.name}: {got} of {wanted} messages came")
        return got

    def route(self) -> None:
        for event in self._events(int(ROUTER_MAPPING["BatchSize"])):
            self.invoke("router", event, http=False)

    def pushes(self) -> int:
        """The pusher over what the push queue holds (Lambda's mapping: ten messages a batch,
        received and deleted by Lambda, not by the function: their requests are modeled in
        ``Unit.sqs_requests``); the batches."""
        from shoal.local.esm.queues import QueueMapping, QueueMappings
        from shoal.local.provision import LocalNames

        names = LocalNames.for_deployment()
        mapping = QueueMapping(
            uuid="bench",
            function_arn=names.functions["pusher"],
            queue_arn=names.queue_arn("push"),
            batch_size=10,
            concurrency=1,
            report_item_failures=True,
            enabled=True,
        )
        taker = QueueMappings(
            self.session, lambda _fn, event: self.invoke("pusher", event, http=False)
        )
        return taker.drain_mapping(mapping)

    def archive(self) -> None:
        """The archiver over the delivery-event log's new records (its mapping's batches)."""
        for event in self._events(int(ARCHIVER_MAPPING["BatchSize"]), self.event_log):
            answer = self.invoke("archiver", event, http=False)
            assert answer == {"batchItemFailures": []}, answer

    def push(self, endpoint: Any) -> int:
        before = endpoint.calls
        for event in self._events(int(PUSH_MAPPING["BatchSize"])):
            answer = self.invoke("push", event, http=False)
            assert answer == {"batchItemFailures": []}, answer
        return int(endpoint.calls - before)


def counted_run(scenario: Scenario) -> Counts:
    """Run ``scenario`` in a fresh emulated account and count what its traffic used."""
    with emulated_account(default_partitions=1) as session:
        from shoal.composite.service import ensure_default_topic
        from shoal.wiring import topic_service

        config = get_config()
        ensure_default_topic(topic_service(config, stream_wait_s=30.0), 1)
        run = Run(session, scenario)
        endpoint = None
        sessions: list[tuple[str, str]] = []
        try:
            if scenario.push:
                # the subscriber's endpoint on loopback, answering 204 (bench.push's)
                endpoint = Endpoint()
                _push_subscription(run, endpoint.url)
            members = scenario.group or scenario.subscribers
            for n in range(members):
                client = f"bench-{n}"
                channel = run.session_call(
                    "sessions",
                    "PUT",
                    client,
                    body={"clean_start": False, "session_expiry_s": 3600, "keepalive_s": 600},
                )["channel"]
                wanted = "$share/g/bench/#" if scenario.group else "bench/#"
                run.session_call(
                    "subscriptions",
                    "POST",
                    client,
                    "/subscriptions",
                    body={"subscriptions": [{"filter": wanted, "qos": 1}]},
                    headers={"Shoal-Channel": channel},
                )
                sessions.append((client, channel))
            per_round = 1 if scenario.group else members

            def traffic(messages: int) -> int:
                run.publish(messages)
                if endpoint is not None:
                    delivered = run.push(endpoint)
                else:
                    run.route()
                    delivered = run.consume(sessions, messages * per_round)
                run.archive()
                return delivered

            # warm-up: every client made, caches filled; then only the traffic is metered
            traffic(scenario.batch)
            run.meters.attach_all()
            run.meters.reset()
            run.metering = True
            delivered = traffic(scenario.messages)
            run.metering = False
            run.meters.attach_all()  # a client made during the run was counted by nobody
        finally:
            if endpoint is not None:
                endpoint.close()
    counts = run.counts
    meters = run.meters
    counts.published = scenario.messages
    counts.delivered = delivered
    counts.calls = dict(sorted(meters.calls.calls.items()))
    counts.dynamodb_wru = meters.writes.units
    counts.dynamodb_rru = meters.reads.units
    counts.event_log_records = meters.puts.log_records
    counts.event_log_bytes = meters.puts.log_bytes
    counts.wru_by_operation = dict(sorted(meters.writes.by_operation.items()))
    counts.rru_by_operation = dict(sorted(meters.reads.by_operation.items()))
    counts.kinesis_records = meters.calls.records - meters.puts.log_records
    counts.kinesis_put_units = meters.puts.units
    counts.kinesis_bytes = meters.puts.bytes
    counts.s3_puts = sum(v for k, v in counts.calls.items() if k in _S3_PUTS)
    counts.s3_gets = sum(v for k, v in counts.calls.items() if k in _S3_GETS)
    return counts


_S3_PUTS = frozenset({"s3.PutObject", "s3.CopyObject", "s3.ListObjectsV2", "s3.ListObjects"})
_S3_GETS = frozenset({"s3.GetObject", "s3.HeadObject"})


def _push_subscription(run: Run, url: str) -> None:
    """A push subscription to every message, whose endpoint on loopback the consumer may
    reach (``shoal dev`` allows loopback; the in-process emulator has no endpoint URL)."""
    from shoal.push.admin import PushAdmin
    from shoal.push.api import CreateRequest
    from shoal.push.delivery import PushConsumer

    config = get_config().model_copy(update={"push_loopback_http": True})
    PushAdmin.from_config(config).create(
        CreateRequest.model_validate({"name": "bench", "filter": "bench/#", "endpoint": url})
    )
    consumer = PushConsumer.from_config(config)
    run.push_app.service = lambda: consumer


# --- the model -------------------------------------------------------------------------------


def price(counts: Counts) -> dict[str, float]:
    """Dollars per million delivered messages, per priced quantity of ``PRICES``."""
    per = 1e6 / counts.delivered
    quantities = {
        "api_requests": counts.api_requests,
        "lambda_requests": counts.lambda_requests,
        "lambda_gb_s": counts.lambda_gb_s,
        "dynamodb_wru": counts.dynamodb_wru,
        "dynamodb_rru": counts.dynamodb_rru,
        "kinesis_put_units": counts.kinesis_put_units,
        "kinesis_shard_hours": counts.kinesis_shard_hours,
        "s3_puts": counts.s3_puts,
        "s3_gets": counts.s3_gets,
        # the scenarios' subscribers are HTTP ones: nothing goes through the push queue
        "sqs_requests": 0,
    }
    return {k: PRICES[k].cost(q) * per for k, q in quantities.items()}


def alternatives(scenario: Scenario, payload_bytes: int = len(PAYLOAD)) -> dict[str, float]:
    """What the scenario's traffic costs per million delivered messages on AWS IoT Core
    (MQTT, QoS 1) and on SNS+SQS (a queue per subscriber; a shared group is one queue with
    competing consumers; push is SNS's HTTP delivery)."""
    fanout = scenario.subscribers if not (scenario.group or scenario.push) else 1
    iot_units = math.ceil(payload_bytes / 5120)
    # IoT: the publish in (shared by the fan-out), the PUBLISH out and the subscriber's PUBACK
    # (metered as a message, QoS 1); push is a rule with an HTTP action instead of a device
    if scenario.push:
        iot = IOT_MESSAGE.cost(iot_units) + 2 * IOT_RULE.cost(1)
    else:
        iot = IOT_MESSAGE.cost(iot_units * (1 / fanout + 2))
    iot *= 1e6
    publishes = 1 / fanout / (10 if scenario.batch >= 10 else 1)  # PublishBatch of 10
    if scenario.push:
        sns_sqs = SNS_PUBLISH.cost(publishes) + SNS_HTTP.cost(1)
    else:
        page = min(scenario.get_max, 10)  # SQS hands out at most 10 messages a receive
        sns_sqs = SNS_PUBLISH.cost(publishes) + SQS_REQUEST.cost(1 + 2 / page)
    return {"iot_core": iot, "sns_sqs": sns_sqs * 1e6}


LINES = {
    "api_requests": "API Gateway",
    "lambda_requests": "Lambda requests",
    "lambda_gb_s": "Lambda GB-s",
    "dynamodb_wru": "DynamoDB writes",
    "dynamodb_rru": "DynamoDB reads",
    "sqs_requests": "SQS requests (push queue)",
    "kinesis_put_units": "Kinesis PUT units",
    "kinesis_shard_hours": "Kinesis shard-hours",
    "s3_puts": "S3 PUTs",
    "s3_gets": "S3 GETs",
}

#: the goal for batched clients at steady load (dollars per million delivered messages)
GOAL = 0.10


def run(scenarios: tuple[Scenario, ...] = SCENARIOS) -> dict[str, Any]:
    out: dict[str, Any] = {
        "region": REGION,
        "priced_on": PRICED_ON,
        "prices": {k: asdict(p) for k, p in PRICES.items()},
        "scenarios": {},
    }
    for scenario in scenarios:
        counts = counted_run(scenario)
        lines = price(counts)
        total = sum(lines.values())
        out["scenarios"][scenario.name] = {
            "lever": scenario.lever,
            "counts": asdict(counts) | {"kinesis_shard_hours": counts.kinesis_shard_hours},
            "per_million_delivered": {k: round(v, 5) for k, v in lines.items()},
            "total": round(total, 4),
            "dominant": max(lines, key=lambda k: lines[k]),
            "alternatives": {k: round(v, 3) for k, v in alternatives(scenario).items()},
        }
    return out


def report(figures: dict[str, Any]) -> str:
    lines = [
        "## What a million delivered messages cost",
        "",
        f"List prices of {figures['region']} read on {figures['priced_on']} (the sources are in "
        "`bench/cost.py`), times what each scenario's traffic used, counted on the real handlers "
        "over moto: 256-byte messages at QoS 1, batches of 100 over 10 ordering keys, shards at "
        "half their write limit, every get a full page. Dollars per million delivered messages:",
        "",
        "| scenario | " + " | ".join(LINES.values()) + " | total | IoT Core | SNS+SQS |",
        "|---|" + "---|" * (len(LINES) + 3),
    ]
    for name, f in figures["scenarios"].items():
        cells = " | ".join(f"{f['per_million_delivered'].get(k, 0.0):.4f}" for k in LINES)
        alt = f["alternatives"]
        lines.append(
            f"| {name} | {cells} | **{f['total']:.3f}** | {alt['iot_core']:.2f} "
            f"| {alt['sns_sqs']:.2f} |"
        )
    lines += ["", "What moves each line:", ""]
    for name, f in figures["scenarios"].items():
        lines.append(f"- {name}: dominated by {LINES[f['dominant']]}; {f['lever']}.")
    batched = figures["scenarios"].get("batched publish (100), 1 subscriber")
    if batched is not None:
        total = batched["total"]
        verdict = (
            f"reached (${total:.3f})"
            if total <= GOAL
            else f"missed by ${total - GOAL:.3f} (${total:.3f}, {total / GOAL:.1f}x), "
            f"mostly {LINES[batched['dominant']]}"
        )
        counts = batched["counts"]
        per = 1000 / counts["delivered"]

        def units(by: dict[str, float]) -> str:
            return ", ".join(f"{k} {v * per:.1f}" for k, v in by.items())

        lines += [
            "",
            f"Goal of ${GOAL:.2f} per million for batched clients at steady load: {verdict}.",
            "",
            "Its DynamoDB units per 1,000 deliveries by operation (BatchWriteItem: the inbox "
            "items; Query: the gets' inbox reads): writes "
            f"{units(counts['wru_by_operation'])}; reads {units(counts['rru_by_operation'])}.",
        ]
    lines.append("")
    return "\n".join(lines)


# --- enhanced fan-out: the router's consumer option (issue 48) ------------------------------

#: the option's two meters, provisioned mode, us-east-1, as issue 48 quotes the pricing page
#: (not in the stored copies: check before quoting); this date is when they were written here
FAN_OUT_PRICED_ON = "2026-12-04"
FAN_OUT_SHARD_HOUR = Price(
    0.015,
    1,
    "Kinesis enhanced fan-out consumer-shard-hour (each registered consumer, each shard)",
    "https://aws.amazon.com/kinesis/data-streams/pricing/ (provisioned tab, enhanced "
    "fan-out); figure as issue 48 gives it, not in the stored copies",
)
FAN_OUT_GB = Price(
    0.013,
    1,
    "Kinesis enhanced fan-out data retrieval, per GB read through a consumer (GB = 2^30 bytes)",
    "https://aws.amazon.com/kinesis/data-streams/pricing/ (provisioned tab, enhanced "
    "fan-out); figure as issue 48 gives it, not in the stored copies",
)
#: a message's bytes in its storage stream (what the router's consumer reads): the batched
#: scenario's count, 256-byte payloads batched 100 a call over 10 ordering keys (399.6 bytes
#: a message, bench/results.json "cost")
FAN_OUT_MESSAGE_BYTES = 400
#: messages a second per shard the price table shows
FAN_OUT_RATES = (1, 10, 100, 1_000)
#: what a tenth of the batched goal is (``GOAL``): where the option's price stops mattering
FAN_OUT_PAYS_PER_MILLION = GOAL / 10


def fan_out_month(
    messages_per_s: float, shards: int = 1, message_bytes: int = FAN_OUT_MESSAGE_BYTES
) -> dict[str, float]:
    """The option's price for one storage stream a month (30 days): the router's consumer on
    each shard, and every byte it reads; per million messages published to the stream."""
    hours = shards * MONTH_S / 3600
    read_gb = messages_per_s * MONTH_S * message_bytes / 2**30
    consumer = FAN_OUT_SHARD_HOUR.cost(hours)
    data = FAN_OUT_GB.cost(read_gb)
    millions = messages_per_s * MONTH_S / 1e6
    return {
        "consumer_shard_hours": consumer,
        "data_retrieval": data,
        "total": consumer + data,
        "per_million_messages": (consumer + data) / millions if millions else math.inf,
    }


def fan_out_pays_from_per_s(message_bytes: int = FAN_OUT_MESSAGE_BYTES) -> int:
    """Messages a second per shard from which the option adds at most
    ``FAN_OUT_PAYS_PER_MILLION`` per million messages (its shard-hours spread thin enough)."""
    data = FAN_OUT_GB.cost(1e6 * message_bytes / 2**30)
    hourly = FAN_OUT_SHARD_HOUR.cost(1)
    # hourly / (rate * 3600 / 1e6) + data <= target
    return math.ceil(hourly * 1e6 / 3600 / (FAN_OUT_PAYS_PER_MILLION - data))


def fan_out_report() -> str:
    """The option's price: per shard, per rate, and from which rate it costs little."""
    rows = []
    for rate in FAN_OUT_RATES:
        month = fan_out_month(rate)
        rows.append(
            f"| {rate:,} | {month['consumer_shard_hours']:.2f} | {month['data_retrieval']:.2f} "
            f"| {month['total']:.2f} | {month['per_million_messages']:.4f} |"
        )
    per_shard = fan_out_month(0)["consumer_shard_hours"]
    return "\n".join(
        [
            "### The enhanced fan-out option's price",
            "",
            f"{FAN_OUT_SHARD_HOUR.unit}: ${FAN_OUT_SHARD_HOUR.dollars}; {FAN_OUT_GB.unit}: "
            f"${FAN_OUT_GB.dollars} ({REGION}, written {FAN_OUT_PRICED_ON}; sources in "
            f"`bench/cost.py`). One consumer per storage stream (the router's), on each of its "
            f"shards: **${per_shard:.2f} a shard a month** (30 days), read or idle, plus the "
            f"bytes read, about {FAN_OUT_MESSAGE_BYTES} a 256-byte message (the batched "
            "scenario's records). A month of one shard:",
            "",
            "| messages/s on the shard | consumer-shard-hours $ | data read $ | total $ "
            "| $ per million messages |",
            "|---|---|---|---|---|",
            *rows,
            "",
            "1,000 messages a second fit one shard at half its write limit (batched: about 100 "
            f"records and 400 KB a second), so they cost the last row: "
            f"${fan_out_month(1_000)['total']:.2f} a month. Per message the option costs "
            f"${FAN_OUT_PAYS_PER_MILLION:.2f} per million (a tenth of the batched goal) or less "
            f"from {fan_out_pays_from_per_s():,} messages a second per shard; below that its "
            "shard-hours dominate, and on a quiet shard they are the whole price. It pays "
            "where the half second a message waits for Lambda's poll matters (a broker's "
            "users expect tens of milliseconds), and where a shard has more readers than its "
            "shared 2 MB/s serves (the router and push subscriptions' taps share it; a consumer "
            "has 2 MB/s of its own).",
            "",
        ]
    )


@dataclass(frozen=True)
class LatencyStep:
    """One step of a published message's way to a client deployed, with the AWS figure it
    uses (None: AWS documents none) and where the figure is from."""

    step: str
    standard: str
    fan_out: str
    figure: str
    source: str


#: publish to client deployed, step by step; ms as AWS documents them (a step without an AWS
#: figure says so: the stack's metrics measure it)
DEPLOYED_LATENCY: tuple[LatencyStep, ...] = (
    LatencyStep(
        "the put: HTTP API, publish function, PutRecord",
        "-",
        "-",
        "no AWS figure; a record is readable as soon as it is written",
        "Kinesis Developer Guide, Improve low-latency processing",
    ),
    LatencyStep(
        "the mapping's wait for the record, then Lambda invokes the router",
        "500 mean, 1,000 max",
        "70 mean",
        "Lambda polls each shard at a base rate of once per second (standard iterator); "
        "records reach an enhanced fan-out consumer in typically an average of 70 ms",
        "Lambda Developer Guide, How Lambda processes records from Kinesis; Kinesis "
        "Developer Guide, consumers with enhanced fan-out",
    ),
    LatencyStep(
        "the router's writes: the batch's archive object, then the inbox items",
        "tens + single digits",
        "tens + single digits",
        "S3: median latencies of small requests (under 512 KB) often in the tens of ms; "
        "DynamoDB: single-digit ms a call (BatchWriteItem, 4 in flight)",
        "S3 whitepaper, Optimizing Amazon S3 performance (timeouts and retries); DynamoDB "
        "Developer Guide, What is DynamoDB",
    ),
    LatencyStep(
        "push: heads and states (one BatchGetItem), lease, inbox query, state write",
        "4 x single digits",
        "4 x single digits",
        "DynamoDB: single-digit ms a call",
        "DynamoDB Developer Guide, What is DynamoDB",
    ),
    LatencyStep(
        "push: the wave's delivery events (PutRecords), then the post (@connections)",
        "-",
        "-",
        "no AWS figure for either",
        "-",
    ),
    LatencyStep(
        "long poll instead of push: the waiting get's re-read, then its answer",
        "500 mean, 1,000 max",
        "500 mean, 1,000 max",
        "Shoal's schedule (0.1 s, then 1.5 times longer, at most 1 s; after 3 s of waiting a "
        "second apart); its look is eventually consistent, which AWS bounds by no figure "
        "(a read repeated after a short time sees the write)",
        "shoal.delivery.service; DynamoDB Developer Guide, read consistency",
    ),
)


def latency_report() -> str:
    """The deployed publish-to-client latency, step by step, for both mapping kinds."""
    rows = [
        f"| {s.step} | {s.standard} | {s.fan_out} | {s.figure} | {s.source} |"
        for s in DEPLOYED_LATENCY
    ]
    return "\n".join(
        [
            "### Publish to client deployed, step by step",
            "",
            "Milliseconds as AWS documents them (`bench/cost.py`, `DEPLOYED_LATENCY`); a step "
            "without an AWS figure is marked -, and the stack's metrics measure it (the "
            "functions' Duration, RouterLag). Push is every step but the last; the long poll "
            "replaces the push steps by the last.",
            "",
            "| step | standard mapping (ms) | enhanced fan-out (ms) | figure used | source |",
            "|---|---|---|---|---|",
            *rows,
            "",
            "From the documented figures, push takes about 0.5 s on average (1 s at worst) with "
            "a standard mapping and about 0.1 s with enhanced fan-out, plus the steps AWS gives "
            "no figure for (the put, Lambda's invocations, the event log, the post: the "
            "functions' Duration and the dashboard's RouterLag measure them on a stack). The "
            "long poll adds its re-read: about 0.5 s on average once it has waited a few "
            "seconds, at most 1 s plus the eventually consistent look's lag.",
            "",
        ]
    )


# --- the fleet: clients held for a month, long-poll against WebSocket push against IoT Core ---

WS_MESSAGE = Price(
    1.00,
    1e6,
    "API Gateway WebSocket message (32 KB units; received and sent both count, a mock "
    "route's answer too)",
    "https://aws.amazon.com/api-gateway/pricing/ (WebSocket APIs); figure: "
    "awsforengineers.com/blog/aws-api-gateway-pricing-explained (US East, first billion)",
)
WS_CONNECTION_MINUTE = Price(
    0.25,
    1e6,
    "API Gateway WebSocket connection minute",
    "https://aws.amazon.com/api-gateway/pricing/ (WebSocket APIs); figure not in the stored "
    "copies (awsnegotiations.com/api-gateway-websocket-cost names the meter, not the rate)",
)
IOT_CONNECTION_MINUTE = Price(
    0.08,
    1e6,
    "IoT Core connection minute (MQTT PINGREQ/PINGRESP are not metered)",
    "https://aws.amazon.com/iot-core/pricing/; metering rules (pings, CONNACK, SUBACK and the "
    "service's PUBACK free; a device's PUBACK one 5 KB message): its additional-details page, "
    "in the stored copies; figure not in the stored copies",
)

FLEET = 100_000
#: messages a second delivered to each client (each its own message, QoS 1, 256 bytes)
FLEET_RATES: tuple[tuple[str, float], ...] = (
    ("idle", 0.0),
    ("1 a minute", 1 / 60),
    ("1 a second", 1.0),
)
MONTH_S = 30 * 86_400
#: the client's default settings, which the fleet's keep-alive figures follow
CLIENT_SETTINGS = WsSettings()
#: the client's ack delay (``shoal.client.ws``): processed ids held this long share one frame
ACK_DELAY_S = DEFAULT_ACK_DELAY_S
#: a longer delay a client may choose (the fleet is priced with it too, beside the default)
LONG_ACK_DELAY_S = 2.0


def acks_per_delivery(rate: float, delay_s: float) -> float:
    """Ack frames per delivery for messages every ``1/rate`` seconds and an ack held
    ``delay_s`` after the first id it holds: one frame takes the ids that come within the
    delay (measured over ``shoal dev``: 1.00 at 1 a second and 300 ms, 0.47 at 2 s)."""
    if rate <= 0:
        return 1.0
    return 1.0 / (math.floor(rate * delay_s) + 1)


#: API Gateway closes a connection idle 10 minutes: the client (``shoal.client.ws``) sends a
#: keep-alive after this long of its own silence
KEEPALIVE_S = int(CLIENT_SETTINGS.ping_every_s)
#: billed messages a keep-alive: one in ``check_every`` is a ping and its pong, the others a
#: one-way ``keepalive`` frame
KEEPALIVE_MESSAGES = 1 + 1 / CLIENT_SETTINGS.check_every


def keepalives_a_month(rate: float, delay_s: float) -> float:
    """Keep-alives a client sends a month: one after each ``KEEPALIVE_S`` of its own silence
    (``shoal.client.wslink``: any frame it sends starts the silence again). Its ack frames,
    one every ``1 / (rate * acks_per_delivery)`` seconds, break the silence: a client acking
    more often than every ``KEEPALIVE_S`` sends none (a renewal's frames are left out: they
    would only save a few)."""
    if rate <= 0:
        return MONTH_S / KEEPALIVE_S
    frames = rate * MONTH_S * acks_per_delivery(rate, delay_s)
    return frames * math.floor(MONTH_S / frames / KEEPALIVE_S)


#: API Gateway closes every connection after 2 hours: the client renews its connection
#: ``renew_before_s`` to twice that (uniformly jittered) before, so once every
MAX_CONNECTION_S = int(CLIENT_SETTINGS.max_connection_s)
RENEW_EVERY_S = MAX_CONNECTION_S - 1.5 * CLIENT_SETTINGS.renew_before_s
#: a long poll waits at most this long (``MAX_WAIT_MS``), then the client polls again
LONG_POLL_S = 20
#: the counted runs: clients, and measured rounds of one message to each
FLEET_CLIENTS = 100
FLEET_ROUNDS = 3
#: the ack timeout of the counted WebSocket scenarios (``SHOAL_ACK_TIMEOUT_S``; 30 s deployed
#: by default): short, so that the sweep's counts wait it out on the system clock the
#: functions read (nothing in their time is moved or armed by hand). No other count depends
#: on it: a push arms its due list at its time plus the timeout, one write whatever the
#: timeout, and the metered rounds ack every delivery before anything pushes its session again.
#: Not shorter: a round's pushes of 100 sessions take over a second in process (the first,
#: cold, most), and a session pushed again past its timeout is sent its delivery again (dup)
SWEEP_ACK_TIMEOUT_S = 5.0
#: the reaper's schedule deployed: each run looks once at every session whose pushes armed a
#: due list that came due since the last, so a session pays a look per delivery up to one a
#: run (``sweep_looks``)
SWEEP_PERIOD_S = DEPLOYMENT.function("reaper").schedule_s or 60
#: past a deadline by this much more (the functions' clocks are the bench's)
SWEEP_MARGIN_S = 0.05
#: ``SHOAL_CENSUS_EVERY_S`` of the counted WebSocket scenarios: the census (the reaper's count
#: of the tables, once a minute deployed whatever the traffic) is no sweep's work, and would
#: fall in a counted run or not depending on how long the run took
NO_CENSUS = "0"
#: members counted by ``count_group_sweep``: each of a shared group of its own, one delivery
#: each, swept together
GROUP_SWEEP_MEMBERS = 10
#: a deployed AWS call's round trip (in-process moto answers in about a millisecond): added to
#: the counted Lambda time per call for the concurrency estimate, which in-process time alone
#: would understate
CALL_RTT_S = 0.008
#: the memory at which a Lambda function has the equivalent of one vCPU (Lambda's
#: documentation, "Configuring function memory"); below it, CPU time stretches
FULL_VCPU_MB = 1769
#: an account's default Lambda concurrency quota (all functions together)
DEFAULT_CONCURRENCY = 1000
#: SQS requests of one due timer (``shoal.sessions.timers``): its send to the standard wills
#: queue, and the reaper mapping's receive and delete of its batch (counted whole, though a
#: batch takes up to ten). A connection lost without a renewal arms one (its head's), two when
#: its will has a delay; the fleet renews and loses none, so the model has no timer
WILL_TIMER_REQUESTS = 3


def will_timer_dollars(timers: int = 1) -> float:
    """What ``timers`` due timers cost in SQS requests (the reaper's invocation aside)."""
    return SQS_REQUEST.cost(WILL_TIMER_REQUESTS * timers)


def sweep_looks(rate: float) -> float:
    """The sweep's looks at one session in a month of deliveries every ``1/rate`` seconds:
    one a delivery (each push arms a due list) up to one a sweep run."""
    return min(rate * MONTH_S, MONTH_S / SWEEP_PERIOD_S)


def due_lists(look: Unit) -> Unit:
    """Of a sweep's look (``sweep look, acked in time``, counted over one round: a delivery
    a session), what the due lists taken cost: their deletes and the write units (a look at
    sessions acked in time writes nothing else), with the Lambda time apportioned by calls.
    Every push arms its batch's list, so these come once a delivery whatever the rate, where
    the state's read comes once a look."""
    deletes = look.calls.get("dynamodb.DeleteItem", 0.0)
    share = deletes / look.aws_calls if look.aws_calls else 0.0
    return Unit(
        "due lists taken",
        look.units,
        lambda_gb_s=look.lambda_gb_s * share,
        lambda_s=look.lambda_s * share,
        aws_calls=deletes,
        dynamodb_wru=look.dynamodb_wru,
        calls={"dynamodb.DeleteItem": deletes} if deletes else {},
    )


#: an HTTP channel that leaves a will keeps its keepalive's timer (``Reaper._chain``), and the
#: client's default keepalive
HTTP_KEEPALIVE_S = 60


def keepalive_timers_dollars(keepalive_s: int = HTTP_KEEPALIVE_S) -> float:
    """What an HTTP channel with a will pays a month for its keepalive's timer: at most one
    timer a keepalive (a request moves its last-seen time once half a keepalive passed, so each
    deadline is at least a keepalive after the one before), each its SQS requests, a reaper
    invocation of its own (a batch may take ten), the head's consistent read and the write
    that moves its due time."""
    timers = MONTH_S / keepalive_s
    each = (
        will_timer_dollars()
        + PRICES["lambda_requests"].cost(1)
        + PRICES["dynamodb_rru"].cost(1)
        + PRICES["dynamodb_wru"].cost(1)
    )
    return timers * each


class Posts:
    """Frames the functions post to ``@connections`` (moto answers them): per connection,
    and their 32 KB message units."""

    def __init__(self) -> None:
        self.frames: dict[str, list[dict[str, Any]]] = {}
        self.units = 0
        self.closed: list[str] = []
        self._attached: list[Any] = []

    def attach(self, client: Any) -> None:
        if any(c is client for c in self._attached):
            return
        self._attached.append(client)
        client.meta.events.register(
            "before-parameter-build.apigatewaymanagementapi.*", self._record
        )

    def _record(self, params: dict[str, Any], model: Any, **_: Any) -> None:
        if model.name == "PostToConnection":
            data = params["Data"]
            self.units += max(1, math.ceil(len(data) / (32 * 1024)))
            frame = json.loads(data)
            self.frames.setdefault(params["ConnectionId"], []).append(frame)
        elif model.name == "DeleteConnection":
            self.closed.append(params["ConnectionId"])

    def take(self, connection_id: str) -> list[dict[str, Any]]:
        return self.frames.pop(connection_id, [])


@dataclass
class Unit:
    """One unit of fleet work (a delivery, a reconnect, an empty poll): what it used, per
    unit, from a counted run of ``units`` of them."""

    name: str
    units: int
    api_requests: float = 0.0
    lambda_requests: float = 0.0
    lambda_gb_s: float = 0.0
    lambda_s: float = 0.0
    aws_calls: float = 0.0
    dynamodb_wru: float = 0.0
    dynamodb_rru: float = 0.0
    kinesis_put_units: float = 0.0
    kinesis_shard_hours: float = 0.0
    s3_puts: float = 0.0
    s3_gets: float = 0.0
    #: the push queue's requests: the senders' SendMessageBatch calls (counted), and Lambda's
    #: receive and delete of each batch the pusher takes (modeled: two a pusher invocation)
    sqs_requests: float = 0.0
    #: API Gateway WebSocket messages (32 KB units), client to service and back
    ws_in: float = 0.0
    ws_out: float = 0.0
    invocations: dict[str, float] = field(default_factory=dict)
    calls: dict[str, float] = field(default_factory=dict)
    #: DynamoDB calls by function, operation and table (``TableCalls``), for the units that
    #: say which table a call asked (``by_table``); empty for the others
    tables: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        name: str,
        units: int,
        run: Run,
        ws_in: int = 0,
        ws_out: int = 0,
        *,
        by_table: bool = False,
    ) -> Unit:
        c, m = run.counts, run.meters
        calls = dict(sorted(m.calls.calls.items()))
        log = m.puts.log_records
        shard = shard_hours(m.calls.records - log, m.puts.bytes) + shard_hours(
            log, m.puts.log_bytes
        )
        u = cls(
            name,
            units,
            api_requests=c.api_requests,
            lambda_requests=c.lambda_requests,
            lambda_gb_s=c.lambda_gb_s,
            lambda_s=c.lambda_s,
            aws_calls=sum(calls.values()),
            dynamodb_wru=m.writes.units,
            dynamodb_rru=m.reads.units,
            kinesis_put_units=m.puts.units,
            kinesis_shard_hours=shard,
            s3_puts=sum(v for k, v in calls.items() if k in _S3_PUTS),
            s3_gets=sum(v for k, v in calls.items() if k in _S3_GETS),
            sqs_requests=sum(v for k, v in calls.items() if k.startswith("sqs."))
            + 2 * c.invocations.get("pusher", 0),
            ws_in=ws_in,
            ws_out=ws_out,
            invocations=dict(c.invocations),
            calls={k: float(v) for k, v in calls.items()},
            tables={k: float(v) for k, v in sorted(m.tables.calls.items())} if by_table else {},
        )
        for name_ in (*LINES, "lambda_s", "aws_calls", "ws_in", "ws_out"):
            setattr(u, name_, getattr(u, name_) / units)
        u.invocations = {k: v / units for k, v in u.invocations.items()}
        u.calls = {k: v / units for k, v in u.calls.items()}
        u.tables = {k: v / units for k, v in u.tables.items()}
        return u

    def dollars(self) -> dict[str, float]:
        """Per unit, by line (``LINES`` plus the WebSocket messages)."""
        lines = {k: PRICES[k].cost(getattr(self, k)) for k in LINES}
        lines["lambda_gb_s"] = PRICES["lambda_gb_s"].cost(self.billed_gb_s())
        lines["ws_messages"] = WS_MESSAGE.cost(self.ws_in + self.ws_out)
        return lines

    def billed_gb_s(self) -> float:
        """GB-s deployed: the counted (CPU) time's, plus a round trip a call at the invoked
        functions' mean memory."""
        memory_gb = self.lambda_gb_s / self.lambda_s if self.lambda_s else 0.5
        return self.lambda_gb_s + memory_gb * self.aws_calls * CALL_RTT_S

    def concurrency_s(self) -> float:
        """Lambda seconds per unit deployed: the counted time plus a round trip a call."""
        return self.lambda_s + self.aws_calls * CALL_RTT_S


def _meter_state(run: Run) -> Any:
    """What the meters and counts hold now (numbers only: the clients they watch stay)."""
    m = run.meters
    return copy.deepcopy(
        (
            dict(vars(run.counts)),
            (dict(m.calls.calls), m.calls.capacity, m.calls.records),
            (m.writes.units, dict(m.writes.by_operation)),
            (m.reads.units, dict(m.reads.by_operation)),
            (m.puts.units, m.puts.bytes, m.puts.log_records, m.puts.log_bytes),
            dict(m.tables.calls),
        )
    )


def _restore_meters(run: Run, state: Any) -> None:
    """Back to ``_meter_state``'s figures: what ran in between is not counted."""
    counts, calls, writes, reads, puts, tables = copy.deepcopy(state)
    m = run.meters
    vars(run.counts).update(counts)
    m.calls.calls.clear()
    m.calls.calls.update(calls[0])
    m.calls.capacity, m.calls.records = calls[1], calls[2]
    m.writes.units = writes[0]
    m.writes.by_operation.clear()
    m.writes.by_operation.update(writes[1])
    m.reads.units = reads[0]
    m.reads.by_operation.clear()
    m.reads.by_operation.update(reads[1])
    m.puts.units, m.puts.bytes, m.puts.log_records, m.puts.log_bytes = puts
    m.tables.calls.clear()
    m.tables.calls.update(tables)


def _start_metering(run: Run) -> None:
    run.meters.attach_all()
    run.meters.reset()
    run.counts = Counts(run.scenario.name)
    run.metering = True


def _stop_metering(run: Run) -> None:
    run.metering = False
    run.meters.attach_all()


def _fleet_publish(run: Run, clients: list[str], round_: int) -> None:
    """One message to each client's own topic, in one batch (a backend publishing its devices'
    commands), each client its own ordering key."""
    del round_  # every round the same messages: the count is per delivery
    messages = [
        {"topic": f"fleet/{c}", "text": PAYLOAD, "qos": 1, "ordering_key": c} for c in clients
    ]
    run.invoke("publish", _http("POST", "/v1/messages:batch", body={"messages": messages}))


def count_long_poll() -> dict[str, Unit]:
    """Long-poll: per delivery (publish, route, a get that returns it, its ack, archive) and
    per empty poll (a get that waits ``LONG_POLL_S`` and finds nothing)."""
    scenario = Scenario("fleet long-poll", batch=FLEET_CLIENTS, subscribers=FLEET_CLIENTS)
    with emulated_account(default_partitions=1) as session:
        from shoal.composite.service import ensure_default_topic
        from shoal.wiring import topic_service

        ensure_default_topic(topic_service(get_config(), stream_wait_s=30.0), 1)
        run = Run(session, scenario)
        run.cpu_time = True
        run.vcpu_share = True
        clients = [f"bench-{n}" for n in range(FLEET_CLIENTS)]
        sessions = []
        for client in clients:
            channel = run.session_call(
                "sessions",
                "PUT",
                client,
                body={"clean_start": False, "session_expiry_s": 86400, "keepalive_s": 60},
            )["channel"]
            run.session_call(
                "subscriptions",
                "POST",
                client,
                "/subscriptions",
                body={"subscriptions": [{"filter": f"fleet/{client}", "qos": 1}]},
                headers={"Shoal-Channel": channel},
            )
            sessions.append((client, channel))

        def round_(n: int) -> int:
            _fleet_publish(run, clients, n)
            run.route()
            got = run.consume(sessions, len(clients))
            run.archive()
            return got

        round_(-1)
        _start_metering(run)
        delivered = sum(round_(n) for n in range(FLEET_ROUNDS))
        _stop_metering(run)
        delivery = Unit.of("long-poll delivery", delivered, run)
        # an empty poll: the full wait, re-reading the inbox on the poll schedule
        client, channel = sessions[0]
        _start_metering(run)
        page = run.session_call(
            "messages",
            "GET",
            client,
            "/messages",
            query={"max": "100", "wait_ms": str(LONG_POLL_S * 1000)},
            headers={"Shoal-Channel": channel},
        )["messages"]
        _stop_metering(run)
        assert page == [], page
        empty = Unit.of("empty long poll", 1, run)
    return {"delivery": delivery, "empty_poll": empty}


class _Edge:
    """WebSocket clients as API Gateway would present them to ``wsauth`` and ``edge``."""

    def __init__(self, run: Run, token: str, posts: Posts) -> None:
        self.run = run
        self.token = token
        self.posts = posts
        self.ws_in = 0
        self.ws_out = 0
        self.authorizer: dict[str, Any] = {}
        self.serial = 0

    def _event(self, name: str, connection: str) -> dict[str, Any]:
        event: dict[str, Any] = json.loads((EVENTS / name).read_text())
        context = event["requestContext"]
        context["connectionId"] = connection
        context["requestTimeEpoch"] = int(time.time() * 1000)
        if "authorizer" in context:
            context["authorizer"] = dict(self.authorizer)
        return event

    def handshake(self) -> str:
        """The authorizer, then ``$connect``: a new connection's id."""
        self.serial += 1
        connection = f"bench{self.serial:06d}="
        event = self._event("wsauth_connect.json", connection)
        for headers in (event["headers"], event["multiValueHeaders"]):
            for key, value in headers.items():
                if key == "Authorization":
                    headers[key] = (
                        [f"Bearer {self.token}"]
                        if isinstance(value, list)
                        else f"Bearer {self.token}"
                    )
        policy = self.run.invoke("wsauth", event, http=False)
        assert policy["policyDocument"]["Statement"][0]["Effect"] == "Allow", policy
        self.authorizer = {**policy["context"], "principalId": policy["principalId"]}
        answer = self.run.invoke("edge", self._event("edge_connect.json", connection), http=False)
        assert answer["statusCode"] == 200, answer
        return connection

    def send(self, connection: str, frame: dict[str, Any]) -> list[dict[str, Any]]:
        """One client frame (a message in); the frames it brought back (posted, or the route
        response), each a message out."""
        event = self._event("edge_frame.json", connection)
        event["requestContext"]["routeKey"] = frame["action"]
        event["body"] = json.dumps(frame)
        self.ws_in += 1
        answer = self.run.invoke("edge", event, http=False)
        back = self.posts.take(connection)
        if answer.get("body"):
            back.append(json.loads(answer["body"]))
        self.ws_out += len(back)
        return back

    def disconnected(self, connection: str) -> None:
        event = self._event("edge_disconnect.json", connection)
        self.run.invoke("edge", event, http=False)

    def pushed(self, connection: str) -> list[dict[str, Any]]:
        """Frames posted without a client frame (the router's pushes): messages out."""
        back = self.posts.take(connection)
        self.ws_out += len(back)
        return back


EVENTS = Path(__file__).resolve().parent.parent / "events"


@contextmanager
def _issuer() -> Iterator[tuple[str, str]]:
    """A JWT issuer on loopback (its JWKS served over HTTP, as ``shoal dev`` serves its own)
    and a token for every bench client: (issuer URL, token)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from shoal.local.authorizer import SigningKey, mint_token

    key = SigningKey.generate()
    document = json.dumps(key.jwks()).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(document)))
            self.end_headers()
            self.wfile.write(document)

        def log_message(self, *_: Any) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    issuer = f"http://127.0.0.1:{server.server_address[1]}"
    token = mint_token(
        key,
        issuer=issuer,
        sub="bench",
        clients=["bench-*"],
        publish=["#"],
        subscribe=["#"],
        ttl_s=3600,
    )
    try:
        yield issuer, token
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def _edge_account(scenario: Scenario) -> Iterator[tuple[Run, _Edge]]:
    """An emulated account configured for the WebSocket API's functions (the ``@connections``
    endpoint, the JWT issuer), its default topic, a counting Run over it and the WebSocket
    clients' edge (``_Edge``). The ack timeout is ``SWEEP_ACK_TIMEOUT_S``, the reaper's
    census off (``NO_CENSUS``)."""
    with emulated_account(default_partitions=1) as session, _issuer() as (issuer, token):
        from shoal.composite.service import ensure_default_topic
        from shoal.wiring import topic_service

        os.environ["SHOAL_CONNECTIONS_ENDPOINT"] = (
            "https://bench.execute-api.us-east-1.amazonaws.com/v1"
        )
        os.environ["SHOAL_JWT_ISSUER"] = issuer
        os.environ["SHOAL_JWT_AUDIENCE"] = "shoal"
        os.environ["SHOAL_JWKS_URL"] = f"{issuer}/.well-known/jwks.json"
        os.environ["SHOAL_ACK_TIMEOUT_S"] = str(SWEEP_ACK_TIMEOUT_S)
        os.environ["SHOAL_CENSUS_EVERY_S"] = NO_CENSUS
        get_config.cache_clear()
        config = get_config()
        # a new account is a new deployment, its containers fresh: the objects a function
        # keeps for its container's life (not per configuration) are made again
        import functions.reaper.app as reaper_app
        import functions.wsauth.app as wsauth_app

        for kept in (wsauth_app.authorizer, reaper_app.reaper, reaper_app.hand_offs):
            kept.cache_clear()
        ensure_default_topic(topic_service(config, stream_wait_s=30.0), 1)
        run = Run(session, scenario)
        run.cpu_time = True
        run.vcpu_share = True
        posts = Posts()
        posts.attach(
            clients.client(
                "apigatewaymanagementapi",
                config.region,
                "connections",
                endpoint_url=config.connections_endpoint,
            )
        )
        yield run, _Edge(run, token, posts)


def _ws_clients(edge: _Edge, filters: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """Each client connected (a session that outlives its connection) and subscribed to its
    filter at QoS 1: (client -> connection, client -> channel)."""
    held: dict[str, str] = {}
    channels: dict[str, str] = {}
    for client, wanted in filters.items():
        connection = edge.handshake()
        back = edge.send(
            connection,
            {
                "action": "connect",
                "client_id": client,
                "ref": "c",
                "clean_start": False,
                "session_expiry_s": 86400,
            },
        )
        assert back and back[0]["action"] == "connected", back
        channels[client] = back[0]["channel"]
        back = edge.send(
            connection,
            {"action": "subscribe", "ref": "s", "subscriptions": [{"filter": wanted, "qos": 1}]},
        )
        assert back and back[0]["action"] == "subscribed", back
        held[client] = connection
    return held, channels


def _scheduled_reaper(run: Run) -> dict[str, Any]:
    """The reaper invoked as its schedule invokes it (EventBridge's event, once a minute
    deployed): its report. The real handler: the sweep of pushed deliveries, and in the same
    invocation the reaper's other scheduled work (the sessions' due index: keepalives, wills,
    expiry; the sealer), which finds nothing due here but still queries."""
    event = json.loads((EVENTS / "reaper_schedule.json").read_text())
    report: dict[str, Any] = run.invoke("reaper", event, http=False)
    return report


def _past_ack_timeout(pushed_at: float) -> None:
    """Waits until the ack timeout has passed since ``pushed_at`` (``time.time()`` after the
    pushes): every due list they armed is due, and every delivery they sent."""
    time.sleep(max(0.0, pushed_at + SWEEP_ACK_TIMEOUT_S + SWEEP_MARGIN_S - time.time()))


def _unacked_round(
    run: Run, edge: _Edge, held: dict[str, str], publish: Callable[[], None]
) -> tuple[dict[str, str], float]:
    """``publish`` (one message to each client), routed and pushed, and not acked (not
    counted): (client -> the delivery's id, the time the pushes ended)."""
    publish()
    run.route()
    run.pushes()
    pushed_at = time.time()
    sent: dict[str, str] = {}
    for client, connection in held.items():
        frames = edge.pushed(connection)
        assert [(f["action"], f["dup"]) for f in frames] == [("message", False)], frames
        sent[client] = frames[0]["id"]
    run.archive()
    return sent, pushed_at


def _sweep_redelivery(
    run: Run,
    edge: _Edge,
    held: dict[str, str],
    sent: dict[str, str],
    pushed_at: float,
    *,
    name: str,
) -> Unit:
    """Past the ack timeout of ``sent`` (client -> a delivery not acked): the reaper's
    scheduled run and the pushes it handed over, counted per redelivered message: the run
    (its due-index queries, each due list taken, the sessions' states, for shared groups'
    deliveries the groups' read of what is still out, the connections, the hand-off, the
    next deadline armed), the
    pusher's batches and their ``message`` frames (``dup``), the archiver over their
    delivery events. Each client got its delivery again, with ``dup``, once."""
    _past_ack_timeout(pushed_at)
    edge.ws_in = edge.ws_out = 0
    _start_metering(run)
    report = _scheduled_reaper(run)
    run.pushes()
    frames = {client: edge.pushed(held[client]) for client in sent}
    run.archive()
    _stop_metering(run)
    assert report.get("push_again") == len(sent), report
    for client, delivery in sent.items():
        again = [(f["action"], f["id"], f["dup"]) for f in frames[client]]
        assert again == [("message", delivery, True)], frames[client]
    return Unit.of(name, len(sent), run, edge.ws_in, edge.ws_out, by_table=True)


def count_push() -> dict[str, Unit]:
    """WebSocket push: per delivery (publish, route and its push, the client's ``ack`` frame
    without a ``ref``, so unanswered, archive) and per reconnect (the client's renewal,
    make-before-break: the authorizer and ``$connect`` of the new connection, a ``renew``
    frame moving the session's live channel to it, the old connection's ``$disconnect``),
    counted on the real ``wsauth`` and ``edge`` handlers; ``@connections`` is
    moto's (the posts are counted as messages out).

    Then the ack-timeout sweep, on the real ``reaper`` handler invoked with its schedule's
    event, then the pusher: per session whose deliveries were acked in time, the scheduled
    run that takes one round's due lists off the index and finds them acked (``sweep look,
    acked in time``: every push arms one, the sweep's look at it comes once its timeout
    passed; a session's state is read once however many of its lists came due; the run's
    fixed queries shared by the 100 sessions, fewer than a fleet's sweep shares them by),
    which the model counts once per sweep period a session had deliveries in; and per
    message not acked within its timeout (``sweep
    redelivery``): one more round not acked, then, past the timeout, the scheduled run that
    finds it due and hands the session to the push queue, the pusher's batches that send it
    again with ``dup``, and the archiver (``_sweep_redelivery``), which the model leaves
    out (its clients ack every delivery in time)."""
    scenario = Scenario("fleet push", batch=FLEET_CLIENTS, subscribers=FLEET_CLIENTS)
    with _edge_account(scenario) as (run, edge):
        names = [f"bench-{n}" for n in range(FLEET_CLIENTS)]
        held, channels = _ws_clients(edge, {c: f"fleet/{c}" for c in names})
        # the reaper's first run (its clients and services made), nothing due yet
        report = _scheduled_reaper(run)
        assert report.get("push_swept") == 0, report

        def round_(n: int, *, acks_metered: bool = False) -> int:
            _fleet_publish(run, names, n)
            run.route()
            run.pushes()
            got = 0
            pending: dict[str, list[str]] = {}
            for client in names:
                frames = edge.pushed(held[client])
                ids = [f["id"] for f in frames if f["action"] == "message"]
                assert len(ids) == 1, frames
                got += len(ids)
                pending[client] = ids
            run.archive()
            # the acks: counted as a unit of their own (an ack frame), which the model scales
            # by the client's ack batching at each rate; not in a delivery's count
            saved, ws = _meter_state(run), (edge.ws_in, edge.ws_out)
            if acks_metered:
                _start_metering(run)
                edge.ws_in = edge.ws_out = 0
            for client, ids in pending.items():
                # as the client acks: no ref, so no answer frame
                back = edge.send(held[client], {"action": "ack", "ids": ids})
                assert back == [], back
            run.archive()
            if acks_metered:
                _stop_metering(run)
            else:
                _restore_meters(run, saved)
                edge.ws_in, edge.ws_out = ws
            return got

        round_(-1)
        edge.ws_in = edge.ws_out = 0
        _start_metering(run)
        delivered = sum(round_(n) for n in range(FLEET_ROUNDS))
        _stop_metering(run)
        delivery = Unit.of("push delivery", delivered, run, edge.ws_in, edge.ws_out)
        acked = round_(FLEET_ROUNDS, acks_metered=True)
        ack = Unit.of("ack frame", acked, run, edge.ws_in, edge.ws_out)

        def reconnect(client: str) -> None:
            # before API Gateway's 2 hours the client renews its connection make-before-break
            # (``shoal.client.ws``): a new handshake and a ``renew`` frame that moves the
            # session's live channel to it (the old connection is told nothing: the client
            # closes it), then the old connection's $disconnect
            old = held[client]
            connection = edge.handshake()
            back = edge.send(
                connection,
                {"action": "renew", "client_id": client, "ref": "r", "channel": channels[client]},
            )
            assert back and back[0]["action"] == "connected", back
            assert back[0]["session_present"] is True, back
            assert back[0]["channel"] == channels[client], back
            told = edge.posts.take(old)
            assert told == [], told
            edge.disconnected(old)
            held[client] = connection

        reconnect(names[0])  # warm: the disconnect path's first run
        edge.ws_in = edge.ws_out = 0
        _start_metering(run)
        for client in names:
            reconnect(client)
        _stop_metering(run)
        again = Unit.of("reconnect", len(names), run, edge.ws_in, edge.ws_out)

        # the sweep. The renewals' pushes first (not counted: all acked, nothing to send)
        run.pushes()
        assert all(edge.pushed(c) == [] for c in held.values())
        _past_ack_timeout(time.time())
        # every round's due lists so far at once (not counted), then one round more, acked in
        # time, whose due lists the next scheduled run takes: a look at each session finding
        # it acked, as deployed at 1 a minute each run finds a delivery's (a session's state
        # is read once however many of its lists a run takes)
        report = _scheduled_reaper(run)
        assert report.get("push_swept") == len(names) and report.get("push_again") == 0, report
        round_(FLEET_ROUNDS + 1)
        _past_ack_timeout(time.time())
        _start_metering(run)
        report = _scheduled_reaper(run)
        _stop_metering(run)
        assert report.get("push_swept") == len(names) and report.get("push_again") == 0, report
        look = Unit.of("sweep look, acked in time", len(names), run, by_table=True)
        # one round more, not acked: past its timeout the sweep sends each message again
        sent, pushed_at = _unacked_round(
            run, edge, held, lambda: _fleet_publish(run, names, FLEET_ROUNDS + 2)
        )
        redelivery = _sweep_redelivery(run, edge, held, sent, pushed_at, name="sweep redelivery")
    return {
        "delivery": delivery,
        "ack": ack,
        "reconnect": again,
        "sweep_acked": look,
        "sweep_redelivery": redelivery,
    }


def count_group_sweep(members: int = GROUP_SWEEP_MEMBERS) -> dict[str, Unit]:
    """The ack-timeout sweep of shared groups' deliveries over WebSocket: ``members``
    clients, each the one member of a shared group of its own (``$share/g<n>/team/<n>``),
    one delivery each not acked; past the timeout the scheduled reaper run and the pushes
    it hands over, counted per redelivered message as ``count_push``'s ``sweep
    redelivery`` (``_sweep_redelivery``). A group's delivery is done on its stream, which
    the session's state does not show: the sweep asks the groups what is still out, one
    batch read of the groups table for all the swept sessions
    (``SharedGroups.acked_since_by_member``; the unit's ``tables`` shows it). Not in the
    per-client-month model."""
    scenario = Scenario("fleet push, shared groups", batch=members, subscribers=0)
    with _edge_account(scenario) as (run, edge):
        names = [f"bench-g{n}" for n in range(members)]
        held, _ = _ws_clients(edge, {c: f"$share/g{n}/team/{n}" for n, c in enumerate(names)})

        def publish() -> None:
            # one message to each group (a backend's batch), each its own ordering key
            messages = [
                {"topic": f"team/{n}", "text": PAYLOAD, "qos": 1, "ordering_key": f"k{n}"}
                for n in range(members)
            ]
            run.invoke("publish", _http("POST", "/v1/messages:batch", body={"messages": messages}))

        # warm (not counted): a round delivered and acked, then the reaper's first run past
        # its timeout (its clients and services made; it finds the deliveries acked)
        sent, pushed_at = _unacked_round(run, edge, held, publish)
        for client, delivery in sent.items():
            assert edge.send(held[client], {"action": "ack", "ids": [delivery]}) == []
        run.archive()
        _past_ack_timeout(pushed_at)
        report = _scheduled_reaper(run)
        assert report.get("push_again") == 0, report
        sent, pushed_at = _unacked_round(run, edge, held, publish)
        redelivery = _sweep_redelivery(
            run, edge, held, sent, pushed_at, name="sweep redelivery, shared group"
        )
    return {"sweep_group_redelivery": redelivery}


def fleet_model(counted: dict[str, dict[str, Unit]]) -> dict[str, Any]:
    """Dollars per client-month and Lambda concurrency for ``FLEET`` clients at each of
    ``FLEET_RATES``, for long-poll, WebSocket push and IoT Core."""
    minutes = MONTH_S / 60
    poll, push = counted["long_poll"], counted["push"]
    messages_fn = DEPLOYMENT.function("messages")
    iot_units = math.ceil(len(PAYLOAD) / 5120)
    out: dict[str, Any] = {}
    for label, rate in FLEET_RATES:
        deliveries = rate * MONTH_S
        rows: dict[str, Any] = {}
        # long-poll: a poll always waiting (one messages Lambda held per client all month);
        # the polls that end empty after LONG_POLL_S; the counted work of each delivery
        interval = 1 / rate if rate else math.inf
        empty = (
            MONTH_S / LONG_POLL_S
            if not rate
            else deliveries * max(math.ceil(interval / LONG_POLL_S) - 1, 0)
        )
        held_gb_s = messages_fn.memory_mb / 1024 * MONTH_S
        lines = {k: v * empty for k, v in poll["empty_poll"].dollars().items()}
        # the empty polls' Lambda time is the holding time: priced once, below
        lines["lambda_gb_s"] = 0.0
        for k, v in poll["delivery"].dollars().items():
            lines[k] = lines.get(k, 0.0) + v * deliveries
        lines["lambda_gb_s"] += PRICES["lambda_gb_s"].cost(held_gb_s)
        rows["long-poll"] = _row(
            lines,
            concurrency=FLEET * (1 + deliveries / MONTH_S * poll["delivery"].concurrency_s()),
        )
        # WebSocket push: connection minutes, the keep-alives its silences need
        # (KEEPALIVE_MESSAGES each), a renewal every RENEW_EVERY_S, the counted work of each
        # delivery
        reconnects = MONTH_S / RENEW_EVERY_S
        for label_, delay in (
            ("WebSocket push", ACK_DELAY_S),
            ("WebSocket push, acks held 2 s", LONG_ACK_DELAY_S),
        ):
            acks = deliveries * acks_per_delivery(rate, delay)
            looks = sweep_looks(rate)
            lines = {
                "ws_connection_minutes": WS_CONNECTION_MINUTE.cost(minutes),
                "ws_keepalive": WS_MESSAGE.cost(
                    KEEPALIVE_MESSAGES * keepalives_a_month(rate, delay)
                ),
            }
            counted_ = [
                (push["reconnect"], reconnects),
                (push["delivery"], deliveries),
                (push["ack"], acks),
            ]
            # a results file from before the look was counted per session has none
            if "sweep_acked" in push and looks:
                look = push["sweep_acked"]
                counted_.append((look, looks))
                # the due lists come with the deliveries, not with the looks: past one a
                # run, each delivery's share of its push's list is still taken
                counted_.append((due_lists(look), max(deliveries - looks, 0.0)))
            for unit, count in counted_:
                for k, v in unit.dollars().items():
                    lines[k] = lines.get(k, 0.0) + v * count
            rows[label_] = _row(
                lines,
                concurrency=FLEET * sum(u.concurrency_s() * n for u, n in counted_) / MONTH_S,
            )
        # IoT Core: connection minutes (pings free); a delivery is the backend's PUBLISH in,
        # the PUBLISH out and the device's PUBACK, 5 KB units each
        rows["IoT Core"] = _row(
            {
                "iot_connection_minutes": IOT_CONNECTION_MINUTE.cost(minutes),
                "iot_messages": IOT_MESSAGE.cost(3 * iot_units * deliveries),
            },
            concurrency=0.0,
        )
        out[label] = {
            "messages_per_s_each": rate,
            "deliveries_per_client_month": deliveries,
            "empty_polls_per_client_month": empty,
            "rows": rows,
        }
    return out


def _row(lines: dict[str, float], concurrency: float) -> dict[str, Any]:
    total = sum(lines.values())
    return {
        "per_client_month": total,
        "fleet_per_month": total * FLEET,
        "lines": {k: v for k, v in sorted(lines.items(), key=lambda kv: -kv[1]) if v},
        "dominant": max(lines, key=lambda k: lines[k]),
        "lambda_concurrency": concurrency,
    }


#: goals of issue 31, and issue 46's at 1 message a minute
IDLE_GOAL = 0.02
MINUTE_GOAL = 0.17
FLEET_LINES = {
    **LINES,
    "ws_messages": "WebSocket messages",
    "ws_connection_minutes": "WebSocket connection minutes",
    "ws_keepalive": "WebSocket keep-alive (keepalive, and ping + pong)",
    "iot_connection_minutes": "IoT connection minutes",
    "iot_messages": "IoT messages",
}


def fleet_run() -> dict[str, Any]:
    counted = {"long_poll": count_long_poll(), "push": {**count_push(), **count_group_sweep()}}
    return {
        "region": REGION,
        "priced_on": PRICED_ON,
        "fleet": FLEET,
        "keepalive_s": KEEPALIVE_S,
        "check_every": CLIENT_SETTINGS.check_every,
        "max_connection_s": MAX_CONNECTION_S,
        "renew_every_s": RENEW_EVERY_S,
        "long_poll_s": LONG_POLL_S,
        "call_rtt_s": CALL_RTT_S,
        "clients_counted": FLEET_CLIENTS,
        "rounds_counted": FLEET_ROUNDS,
        "sweep_ack_timeout_s": SWEEP_ACK_TIMEOUT_S,
        "sweep_period_s": SWEEP_PERIOD_S,
        "prices": {
            "ws_message": asdict(WS_MESSAGE),
            "ws_connection_minute": asdict(WS_CONNECTION_MINUTE),
            "iot_connection_minute": asdict(IOT_CONNECTION_MINUTE),
            "iot_message": asdict(IOT_MESSAGE),
        },
        "counted": {t: {k: asdict(u) for k, u in units.items()} for t, units in counted.items()},
        "model": fleet_model(counted),
    }


def fleet_report(figures: dict[str, Any]) -> str:
    fleet = figures["fleet"]
    model = figures["model"]
    lines = [
        f"## A fleet of {fleet:,} clients: long-poll, WebSocket push and IoT Core (fleet)",
        "",
        f"`python -m bench fleet`. List prices of {figures['region']} read on "
        f"{figures['priced_on']} (`bench/cost.py`: API Gateway WebSocket "
        f"${figures['prices']['ws_message']['dollars']:.2f} per million messages in 32 KB "
        f"units, both directions, and ${figures['prices']['ws_connection_minute']['dollars']:.2f} "
        "per million connection-minutes; IoT Core "
        f"${figures['prices']['iot_connection_minute']['dollars']:.2f} per million "
        f"connection-minutes and ${figures['prices']['iot_message']['dollars']:.2f} per million "
        "messages in 5 KB units, pings free). Each client receives its own 256-byte QoS 1 "
        "messages (a backend publishes one to each client's topic in batches) and acks each. "
        "Shoal's work is counted on the real handlers over moto "
        f"({figures['clients_counted']} clients, {figures['rounds_counted']} rounds): per "
        "delivery, per empty long poll, per reconnect; a month is 30 days.",
        "",
        *(
            [
                f"Measured by `{figures['run_command']}` at {figures['run_at']} (load average "
                f"{figures['run_load']}).",
                "",
            ]
            if figures.get("run_command")
            else []
        ),
        f"- Long-poll: a poll always waiting ({figures['long_poll_s']} s at most, then the "
        "next), so one `messages` Lambda (512 MB) held per client all month; the polls that "
        "end empty; each delivery's counted work (publish, router, a get, an ack, archiver).",
        "- WebSocket push: the connection-minutes; a keep-alive after each "
        f"{figures['keepalive_s'] / 60:g} minutes of the client's silence (none where its ack "
        "frames come more often), taken by a mock route (no function): one in "
        f"{figures.get('check_every', 1)} a `ping` and its `pong` (two messages), the others a "
        "one-way `keepalive` (one message); the connection renewed every "
        f"{figures['renew_every_s'] / 60:.0f} minutes (before API Gateway's "
        f"{figures['max_connection_s'] // 3600} hours, jittered), make-before-break as the "
        "client does it: the authorizer, `$connect`, a `renew` frame and its answer (the "
        "live channel moved, no takeover), the old connection's `$disconnect`; each "
        "delivery's counted "
        "work (publish, the router and its hand-off to the push queue, the pusher's batch, "
        "the `message` frame out, archiver); the `ack` frames in (no `ref`, so no answer), "
        "each counted as a unit of its own, and as many a delivery as the client's ack "
        "batching makes at that rate: one frame takes the ids processed within the delay "
        f"(the default {ACK_DELAY_S:g} s, and a chosen {LONG_ACK_DELAY_S:g} s beside it); "
        "the push queue's requests (the senders' batches counted, Lambda's receive and "
        "delete of each pusher batch modeled: two a batch), at SQS FIFO's price.",
        "- IoT Core: connection-minutes; a delivery is three metered messages (the backend's "
        "PUBLISH in, the PUBLISH out, the device's PUBACK).",
        "- Not in the model: a connection lost without a renewal arms a will's due timer "
        f"(one, two when its will has a delay): {WILL_TIMER_REQUESTS} SQS standard requests "
        f"at ${SQS_REQUEST.dollars:.2f} per million, ${will_timer_dollars() * 1e6:.2f} per "
        "million timers, and a share of a reaper invocation (ten timers a batch). An HTTP "
        "channel that leaves a will keeps its keepalive's timer, at most one a keepalive: "
        f"${keepalive_timers_dollars():.4f} a client-month at a {HTTP_KEEPALIVE_S} s "
        "keepalive (its requests, a reaper invocation each, a read and a write unit).",
        "- Lambda time: an invocation's CPU time in-process (Shoal's work, without the waits "
        "of the loaded shared machine and without in-process moto's answering, which is AWS's "
        "side of a call), stretched by the function's share of a vCPU (Lambda gives one vCPU "
        f"at {FULL_VCPU_MB:,} MB, in proportion below: 3.5x at 512 MB), plus "
        f"{figures['call_rtt_s'] * 1000:.0f} ms for each AWS call (the round trip deployed, "
        "which in-process moto does not have); priced as GB-s at the invoked functions' "
        "memory, and as concurrency: Lambda-seconds a second over the fleet (Little's law). "
        "An account's default quota is "
        f"{DEFAULT_CONCURRENCY:,}, all functions together.",
        "",
        "| traffic each | transport | $ per client-month | fleet $ per month | Lambda "
        "concurrency | dominant line |",
        "|---|---|---|---|---|---|",
    ]
    for label, m in model.items():
        for transport, row in m["rows"].items():
            lines.append(
                f"| {label} | {transport} | {row['per_client_month']:.4f} "
                f"| {row['fleet_per_month']:,.0f} | {row['lambda_concurrency']:,.1f} "
                f"| {FLEET_LINES[row['dominant']]} |"
            )
    lines += ["", "Lines per client-month (dollars):", ""]
    for label, m in model.items():
        for transport, row in m["rows"].items():
            parts = ", ".join(f"{FLEET_LINES[k]} {v:.4f}" for k, v in row["lines"].items())
            lines.append(f"- {label}, {transport}: {parts}")
    counted = figures["counted"]
    lines += ["", "Counted per unit (the model's inputs):", ""]
    for units in counted.values():
        for u in units.values():
            calls = ", ".join(f"{k} {v:.2f}" for k, v in u["calls"].items())
            invoked = ", ".join(f"{k} {v:.2f}" for k, v in u["invocations"].items())
            # the DynamoDB calls by function and table, of the units counted with them (a
            # results file from before has none)
            tables = ", ".join(f"{k} {v:.2f}" for k, v in u.get("tables", {}).items())
            lines.append(
                f"- {u['name']}: invocations {invoked}; {u['lambda_s'] * 1000:.1f} ms of Lambda "
                "CPU; "
                f"AWS calls {u['aws_calls']:.2f} ({calls}); DynamoDB WRU {u['dynamodb_wru']:.2f}, "
                f"RRU {u['dynamodb_rru']:.2f}; WebSocket messages in {u['ws_in']:.2f}, out "
                f"{u['ws_out']:.2f}; HTTP API requests {u['api_requests']:.2f}"
                + (f"; DynamoDB calls by function and table: {tables}." if tables else ".")
            )
    swept = [u for units in counted.values() for k, u in units.items() if k.startswith("sweep")]
    if swept:
        lines += [
            "",
            "Of the sweep's lines, the model has the look at a session acked in time (sweep "
            "look, acked in time): once a delivery, at most once a sweep run (every "
            f"{figures.get('sweep_period_s', SWEEP_PERIOD_S):g} s), as each push arms a due "
            "list, and the lists it takes (its deletes) once a delivery whatever the rate; "
            "its redeliveries are not in it, as its clients ack every delivery within "
            "its ack timeout. Each line is one scheduled run of the reaper (the "
            "real handler, invoked with its schedule's event, after an ack timeout of "
            f"{figures.get('sweep_ack_timeout_s', SWEEP_ACK_TIMEOUT_S):g} s waited out) and "
            "the pushes it handed over, divided by the sessions or deliveries it swept ("
            + "; ".join(f"{u['name']}: {u['units']}" for u in swept)
            + "): the run's fixed queries (the sessions' and the connections' due indexes, "
            "the sealer's scan of the topics; the census off) are shared by all it swept, so "
            "a larger sweep costs less a message.",
        ]
    idle = model["idle"]["rows"]["WebSocket push"]
    minute = model["1 a minute"]["rows"]
    second = model["1 a second"]["rows"]
    push_minute = minute["WebSocket push"]["per_client_month"]
    iot_second = second["IoT Core"]["per_client_month"]
    idle_cost = idle["per_client_month"]

    def verdict(cost: float, goal: float) -> str:
        return "met." if cost <= goal else f"missed by ${cost - goal:.4f} ({cost / goal:.2f}x)."

    lines += [
        "",
        f"Goal, idle at most ${IDLE_GOAL:.2f} per client-month: WebSocket push "
        f"${idle_cost:.4f}, " + verdict(idle_cost, IDLE_GOAL),
        f"Goal, at 1 message a minute at most ${MINUTE_GOAL:.2f} (issue 46): WebSocket push "
        f"${push_minute:.4f}, " + verdict(push_minute, MINUTE_GOAL),
    ]
    for transport in ("WebSocket push", "WebSocket push, acks held 2 s"):
        cost = second[transport]["per_client_month"]
        lines.append(
            f"Goal, at 1 message a second under IoT Core's ${iot_second:.4f}: {transport} "
            f"${cost:.4f}, " + verdict(cost, iot_second)
        )
    lines.append("")
    return "\n".join(lines)
