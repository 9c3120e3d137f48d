"""The Shoal stack, built only from ``shoal.declarations``.

Every table, bucket, function, route, grant and schedule comes from a ``Deployment``; this
module loops over it and knows no resource by name, so a function, route, table or grant added
to the declarations reaches the stack with no edit here. The one name it knows is
``bootstrap``: a function of that name is run as a CloudFormation custom resource so the
default composite topic exists once the stack is deployed.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import aws_cdk as cdk
from aws_cdk import aws_apigatewayv2 as apigw
from aws_cdk import aws_apigatewayv2_authorizers as authorizers
from aws_cdk import aws_apigatewayv2_integrations as integrations
from aws_cdk import aws_cloudwatch as cloudwatch
from aws_cdk import aws_cloudwatch_actions as cloudwatch_actions
from aws_cdk import aws_dynamodb as dynamodb
from aws_cdk import aws_events as events
from aws_cdk import aws_events_targets as targets
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kinesis as kinesis
from aws_cdk import aws_lambda as lambda_
from aws_cdk import aws_logs as logs
from aws_cdk import aws_s3 as s3
from aws_cdk import aws_sns as sns
from aws_cdk import aws_sns_subscriptions as sns_subscriptions
from aws_cdk import aws_sqs as sqs
from aws_cdk import custom_resources
from constructs import Construct, Node
from shoal.aws.kinesis import ROUTER_CONSUMER
from shoal.aws.tables import TableDef
from shoal.core.config import DEFAULT_RETENTION_S, FAN_OUT_ENV, FAN_OUT_MAPPINGS, parse_fan_out
from shoal.declarations import (
    DEFAULT_ROUTE,
    DEPLOYMENT,
    BucketDef,
    Deployment,
    EventSource,
    FunctionDef,
    Grant,
    QueueDef,
    StreamDef,
    check_archive_lifetime,
    environment,
    function_environment,
)

from infra.bundling import PipLayerBundling
from infra.lifecycle import runtime_resources
from infra.nag import (
    acknowledge,
    acknowledge_function,
    acknowledge_provider,
    acknowledge_wildcards,
)
from infra.observability import Observability
from infra.parts import pascal
from infra.pipeline import PipelineJobs
from infra.websocket import WebSocketEdge

ROOT = Path(__file__).resolve().parent.parent
LAYER_DIR = ROOT / "layers" / "shoal"
FUNCTIONS_DIR = ROOT / "functions"

#: the declared function that CloudFormation runs on deploy to create the default topic
BOOTSTRAP = "bootstrap"
LOG_RETENTION = logs.RetentionDays.ONE_MONTH
ALARM_PERIOD = cdk.Duration.minutes(5)
#: API Gateway HTTP API's integration timeout is 30 s; a routed function should end first
API_TIMEOUT_S = 29
#: the HTTP API stage's steady rate and burst (requests/s): half the account's default quota
#: per region (10,000/s, burst 5,000), so a flood on Shoal's API leaves the account's other
#: APIs their share; raise both with the quota (docs/operations.md)
API_RATE_LIMIT = 5_000
API_BURST_LIMIT = 2_500
#: why the storage streams' grants name a prefix (cdk-nag's AwsSolutions-IAM5)
RUNTIME_STREAMS = (
    "the storage streams are made at run time (<prefix>-<topic>-<index>, shoal.topics), so "
    "the grant names the stack's prefix; their enhanced fan-out consumers under them"
)
ASSET_EXCLUDE = ["**/__pycache__", "**/*.pyc", "*.egg-info"]

TABLE_READ = (
    "dynamodb:BatchGetItem",
    "dynamodb:ConditionCheckItem",
    "dynamodb:DescribeTable",
    "dynamodb:GetItem",
    "dynamodb:Query",
    "dynamodb:Scan",
)
# ConditionCheckItem is here too: a TransactWriteItems with a condition check is how a
# function writes under a condition on another item, and needs no read of its own.
TABLE_WRITE = (
    "dynamodb:BatchWriteItem",
    "dynamodb:ConditionCheckItem",
    "dynamodb:DeleteItem",
    "dynamodb:DescribeTable",
    "dynamodb:PutItem",
    "dynamodb:UpdateItem",
)
STREAM_READ = (
    "kinesis:DescribeStream",
    "kinesis:DescribeStreamConsumer",
    "kinesis:DescribeStreamSummary",
    "kinesis:GetRecords",
    "kinesis:GetShardIterator",
    "kinesis:ListShards",
    "kinesis:ListStreamConsumers",
    "kinesis:SubscribeToShard",
)
STREAM_WRITE = ("kinesis:PutRecord", "kinesis:PutRecords")
# Managing storage topics: creating and deleting the streams themselves. Not tagging or
# resizing: no code of Shoal's does either (topics grow by storage topics), and the IAM check's
# unused-grant report named both (tests/iam/allowlist.py).
STREAM_MANAGE = ("kinesis:CreateStream", "kinesis:DeleteStream")


#: CreateEventSourceMapping's arguments (``EventSource.mapping``) as CfnEventSourceMapping's
MAPPING_PROPERTIES = {
    "StartingPosition": "starting_position",
    "BatchSize": "batch_size",
    "MaximumBatchingWindowInSeconds": "maximum_batching_window_in_seconds",
    "ParallelizationFactor": "parallelization_factor",
    "FunctionResponseTypes": "function_response_types",
    "BisectBatchOnFunctionError": "bisect_batch_on_function_error",
    "MaximumRetryAttempts": "maximum_retry_attempts",
    "MaximumRecordAgeInSeconds": "maximum_record_age_in_seconds",
}


#: the pusher's workers at most, by default (context ``pushConcurrency``): a worker of 1 GB
#: posts a few hundred frames a second (docs/operations.md, "Fan-out"), so 50 of them reach the
#: account's default API Gateway rate of 10,000 requests a second, shared by every API of the
#: region: more would only meet throttling, and take from the account's 1,000 concurrent
#: executions what the other functions need
DEFAULT_PUSH_CONCURRENCY = 50


class MissingContextError(ValueError):
    """A CDK context value the stack cannot be built without."""


@dataclass(frozen=True)
class Settings:
    """What differs between deployments of the same declarations; read from CDK context."""

    jwt_issuer: str
    jwt_audience: tuple[str, ...]
    default_partitions: int = 1
    #: keep tables (deletion protection, RETAIN) and the archive bucket when the stack goes
    retain_data: bool = True
    #: storage streams are "<stream_prefix>-<topic>-<index>"; None: the declarations' prefix
    stream_prefix: str | None = None
    alarm_email: str | None = None
    #: keep the Kinesis streams and event source mappings made at run time when the stack is
    #: deleted (infra/lifecycle.py); by default they go with it, every shard being billed
    retain_streams: bool = False
    #: the push queue mapping's maximum concurrency: the pusher's workers at most
    push_concurrency: int = DEFAULT_PUSH_CONCURRENCY
    #: the mappings made at run time that read through an enhanced fan-out consumer
    #: (``-c enhancedFanOut=router``; docs/operations.md, "Latency"): off by default
    enhanced_fan_out: frozenset[str] = frozenset()

    @classmethod
    def from_context(cls, node: Node) -> Settings:
        def get(key: str) -> Any:
            value = node.try_get_context(key)
            return None if value in (None, "") else value

        issuer, audience = get("jwtIssuer"), get("jwtAudience")
        if issuer is None or audience is None:
            raise MissingContextError(
                "the JWT authorizer needs CDK context jwtIssuer and jwtAudience, e.g. "
                "npx aws-cdk@2 deploy -c jwtIssuer=https://issuer.example.com/ "
                "-c jwtAudience=shoal"
            )
        if not str(issuer).startswith("https://"):
            raise MissingContextError(f"jwtIssuer must be an https URL, got {issuer!r}")
        audiences = (
            tuple(audience)
            if isinstance(audience, list)
            else tuple(a.strip() for a in str(audience).split(",") if a.strip())
        )
        return cls(
            jwt_issuer=str(issuer),
            jwt_audience=audiences,
            default_partitions=int(get("defaultPartitions") or 1),
            retain_data=_flag(get("retainData"), default=True),
            stream_prefix=get("streamPrefix"),
            alarm_email=get("alarmEmail"),
            retain_streams=_flag(get("retainStreams"), default=False),
            push_concurrency=_push_concurrency(get("pushConcurrency")),
            enhanced_fan_out=_fan_out(get("enhancedFanOut")),
        )


def _push_concurrency(value: Any) -> int:
    # Lambda's SQS mappings take a maximum concurrency of 2 to 1,000
    if value is None:
        return DEFAULT_PUSH_CONCURRENCY
    number = int(value)
    if not 2 <= number <= 1000:
        raise MissingContextError(f"pushConcurrency must be 2 to 1000, got {number}")
    return number


def _fan_out(value: Any) -> frozenset[str]:
    # `-c enhancedFanOut=router` (a string; a list in cdk.json); "none" or "false": off
    names = value if isinstance(value, list) else str(value or "").split(",")
    listed = {str(n).strip() for n in names} - {"", "none", "false", "off"}
    try:
        return parse_fan_out(",".join(sorted(listed)))
    except ValueError as exc:
        raise MissingContextError(f"enhancedFanOut: {exc}") from None


def _fan_out_environment(mappings: frozenset[str]) -> dict[str, str]:
    """What the functions read the enhanced fan-out option from (``shoal.core.config``)."""
    return {FAN_OUT_ENV: ",".join(sorted(mappings))} if mappings else {}


def _flag(value: Any, *, default: bool) -> bool:
    # `-c retainData=false` arrives as a string, cdk.json gives a boolean
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    return str(value).strip().lower() in {"1", "true", "yes"}


class ShoalStack(cdk.Stack):
    """One Shoal deployment: API, functions, layer, tables, bucket, event log, schedules,
    alarms."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        deployment: Deployment = DEPLOYMENT,
        settings: Settings | None = None,
        functions_dir: Path = FUNCTIONS_DIR,
        **kwargs: Any,
    ) -> None:
        # Stack tags (CloudFormation puts them on every resource it creates): with the
        # @aws-cdk/core:explicitStackTags flag (cdk.json), Tags.of(self) below tags only the
        # resources in the template, so the stack's own tag is given here
        kwargs["tags"] = {"app": "shoal", **(kwargs.get("tags") or {})}
        super().__init__(scope, construct_id, **kwargs)
        self.deployment = deployment
        self.settings = settings or Settings.from_context(self.node)
        self.stream_prefix = self.settings.stream_prefix or deployment.stream_prefix
        self.removal = (
            cdk.RemovalPolicy.RETAIN if self.settings.retain_data else cdk.RemovalPolicy.DESTROY
        )
        cdk.Tags.of(self).add("app", "shoal")

        self.table_defs = {t.logical: t for t in deployment.tables}
        self.tables = {t.logical: self._table(t) for t in deployment.tables}
        # inbox items name archive lines and payloads: those must outlive the items
        check_archive_lifetime(
            deployment.buckets,
            int(deployment.extra_env.get("SHOAL_INBOX_RETENTION_S", DEFAULT_RETENTION_S)),
        )
        self.buckets = {b.logical: self._bucket(b) for b in deployment.buckets}
        self.streams = {s.logical: self._stream(s) for s in deployment.streams}
        self.dead_letter_queues: dict[str, sqs.Queue] = {}
        self.queues = {q.logical: self._queue(q) for q in deployment.queues}
        # Explicit names, known before anything is created: a function's environment names
        # every function (itself included), which with generated names would be a cycle.
        self.function_names = {f.name: self._function_name(f) for f in deployment.functions}
        layer = self._layer()
        # the WebSocket API (infra/websocket.py): made first, every function's environment names it
        self.websocket = WebSocketEdge(
            self,
            "WebSocket",
            deployment=deployment,
            jwt_issuer=self.settings.jwt_issuer,
            jwt_audiences=self.settings.jwt_audience,
        )
        env = {
            **environment(
                {logical: table.ref for logical, table in self.tables.items()},
                {logical: bucket.bucket_name for logical, bucket in self.buckets.items()},
                self.function_names,
                stream_prefix=self.stream_prefix,
                default_partitions=self.settings.default_partitions,
                streams={logical: stream.ref for logical, stream in self.streams.items()},
                queues={logical: queue.queue_url for logical, queue in self.queues.items()},
            ),
            **self.websocket.environment(),
            **_fan_out_environment(self.settings.enhanced_fan_out),
            **deployment.extra_env,
        }
        self.functions = {
            f.name: self._function(f, layer, env, functions_dir) for f in deployment.functions
        }
        for fdef in deployment.functions:
            if fdef.routes and fdef.timeout_s > API_TIMEOUT_S:
                cdk.Annotations.of(self.functions[fdef.name]).add_warning_v2(
                    "shoal:timeout-beyond-api",
                    f"{fdef.name}: timeout {fdef.timeout_s}s exceeds the HTTP API's "
                    f"{API_TIMEOUT_S}s; the gateway will cut calls Lambda still runs",
                )
            for grant in fdef.grants:
                self._grant(fdef, grant)
            if fdef.schedule_s is not None:
                self._schedule(fdef)
            for source in fdef.sources:
                self._event_source(fdef, source)

        self.api = self._api()
        self.websocket.connect(self.functions)
        if BOOTSTRAP in self.functions:
            self._bootstrap()
        self._alarms()
        self._outputs()
        # the PySpark jobs over the archive (infra/pipeline.py)
        if "archive" in self.buckets:
            self.pipeline = PipelineJobs(self, "Pipeline", archive=self.buckets["archive"])
        # the dashboard, and alarms on lag, dead letters and table throttling
        self.observability = Observability(self, self.alarm_topic)
        self.websocket.observe(
            self.alarm_topic,
            self.observability.dashboard,
            push_queue=self.queues.get("push"),
            push_dead_letters=self.dead_letter_queues.get("push"),
        )
        # the runtime-made streams and mappings go with the stack (unless retainStreams)
        self.runtime_resources = runtime_resources(self)

    # -- data ------------------------------------------------------------------------------

    def _table(self, table: TableDef) -> dynamodb.CfnTable:
        schema = table.schema()
        cfn = dynamodb.CfnTable(
            self,
            f"{pascal(table.logical)}Table",
            billing_mode="PAY_PER_REQUEST",
            attribute_definitions=[
                dynamodb.CfnTable.AttributeDefinitionProperty(
                    attribute_name=a["AttributeName"], attribute_type=a["AttributeType"]
                )
                for a in schema["AttributeDefinitions"]
            ],
            key_schema=_key_schema(schema["KeySchema"]),
            global_secondary_indexes=[
                dynamodb.CfnTable.GlobalSecondaryIndexProperty(**_index(table, i))
                for i in schema.get("GlobalSecondaryIndexes", [])
            ]
            or None,
            local_secondary_indexes=[
                dynamodb.CfnTable.LocalSecondaryIndexProperty(**_index(table, i))
                for i in schema.get("LocalSecondaryIndexes", [])
            ]
            or None,
            point_in_time_recovery_specification=(
                dynamodb.CfnTable.PointInTimeRecoverySpecificationProperty(
                    point_in_time_recovery_enabled=True
                )
            ),
            time_to_live_specification=(
                dynamodb.CfnTable.TimeToLiveSpecificationProperty(
                    attribute_name=table.ttl_attribute, enabled=True
                )
                if table.ttl_attribute
                else None
            ),
            deletion_protection_enabled=self.settings.retain_data,
        )
        cfn.apply_removal_policy(self.removal)
        return cfn

    def _bucket(self, bucket: BucketDef) -> s3.Bucket:
        lifecycle = [
            s3.LifecycleRule(
                id="abort-incomplete-uploads",
                abort_incomplete_multipart_upload_after=cdk.Duration.days(7),
            )
        ]
        if bucket.expire_days is not None:
            lifecycle.append(
                s3.LifecycleRule(id="expire", expiration=cdk.Duration.days(bucket.expire_days))
            )
        lifecycle += [
            s3.LifecycleRule(
                id=f"expire-{prefix.strip('/')}", prefix=prefix, expiration=cdk.Duration.days(days)
            )
            for prefix, days in bucket.expire_prefixes
        ]
        made = s3.Bucket(
            self,
            f"{pascal(bucket.logical)}Bucket",
            encryption=s3.BucketEncryption.S3_MANAGED,
            block_public_access=s3.BlockPublicAccess.BLOCK_ALL,
            enforce_ssl=True,
            versioned=False,
            lifecycle_rules=lifecycle,
            removal_policy=self.removal,
        )
        acknowledge(
            made,
            "AwsSolutions-S1",
            "server access logs need a bucket of their own (itself unlogged); only the stack's "
            "roles read and write this one, and CloudTrail's S3 data events audit it if needed",
        )
        return made

    def _stream(self, stream: StreamDef) -> kinesis.CfnStream:
        # Provisioned, not on-demand: docs/operations.md ("Cost") has the arithmetic. Named
        # "<logical>.<stack>": outside the storage streams' "<prefix>-*" (a stack named
        # "shoal-prod" would be inside it as a prefix), so neither their grants nor the
        # teardown's inventory reach it; and
        # CloudFormation owns it, so `cdk destroy` deletes it whatever retainData says (it
        # holds a day of events at most, all of them on their way to the archive bucket).
        cfn = kinesis.CfnStream(
            self,
            f"{pascal(stream.logical)}Stream",
            name=f"{stream.logical}.{self.stack_name}",
            shard_count=stream.shards,
            retention_period_hours=stream.retention_hours,
            stream_mode_details=kinesis.CfnStream.StreamModeDetailsProperty(
                stream_mode="PROVISIONED"
            ),
            # the AWS managed key: its use through Kinesis needs no grant of the functions'
            stream_encryption=kinesis.CfnStream.StreamEncryptionProperty(
                encryption_type="KMS", key_id="alias/aws/kinesis"
            ),
        )
        cfn.apply_removal_policy(cdk.RemovalPolicy.DESTROY)
        return cfn

    def _queue(self, queue: QueueDef) -> sqs.Queue:
        """A declared queue and its dead-letter queue; encrypted by SQS, TLS only. CloudFormation
        names them (a FIFO queue's name ends in ``.fifo``, which CDK adds)."""
        cid = pascal(queue.logical)
        dead = sqs.Queue(
            self,
            f"{cid}DeadLetterQueue",
            fifo=queue.fifo or None,
            retention_period=cdk.Duration.days(14),
            encryption=sqs.QueueEncryption.SQS_MANAGED,
            enforce_ssl=True,
            removal_policy=cdk.RemovalPolicy.DESTROY,
        )
        for rule in ("AwsSolutions-SQS3", "Serverless-SQSRedrivePolicy"):
            acknowledge(
                dead,
                rule,
                "this is the dead-letter queue itself: what reaches it is looked at, not retried",
            )
        made = sqs.Queue(
            self,
            f"{cid}Queue",
            fifo=queue.fifo or None,
            # a retried hand-off sends the same deduplication ids (shoal.edge.pushwork): one
            # copy a group and 5 minutes; high throughput (per group) for many lanes
            content_based_deduplication=False if queue.fifo else None,
            deduplication_scope=sqs.DeduplicationScope.MESSAGE_GROUP if queue.fifo else None,
            fifo_throughput_limit=sqs.FifoThroughputLimit.PER_MESSAGE_GROUP_ID
            if queue.fifo
            else None,
            visibility_timeout=cdk.Duration.seconds(queue.visibility_timeout_s),
            retention_period=cdk.Duration.seconds(queue.retention_s),
            encryption=sqs.QueueEncryption.SQS_MANAGED,
            enforce_ssl=True,
            dead_letter_queue=sqs.DeadLetterQueue(
                queue=dead, max_receive_count=queue.max_receive_count
            ),
            removal_policy=cdk.RemovalPolicy.DESTROY,
        )
        self.dead_letter_queues[queue.logical] = dead
        return made

    # -- compute ---------------------------------------------------------------------------

    def _function_name(self, fdef: FunctionDef) -> str:
        name = f"{self.stack_name}-{fdef.name}"
        if len(name) > 64 or not re.fullmatch(r"[A-Za-z0-9_-]+", name):
            raise ValueError(
                f"function name {name!r} (stack name + declared name) must be at most 64 "
                "letters, digits, '-' or '_'; choose a shorter stack name"
            )
        return name

    def _layer(self) -> lambda_.LayerVersion:
        return lambda_.LayerVersion(
            self,
            "SharedLayer",
            description="the shoal library and its dependencies",
            code=lambda_.Code.from_asset(
                str(LAYER_DIR),
                exclude=ASSET_EXCLUDE,
                bundling=cdk.BundlingOptions(
                    # required by the type, never pulled: local bundling always succeeds
                    image=lambda_.Runtime.PYTHON_3_12.bundling_image,
                    local=PipLayerBundling(LAYER_DIR),
                ),
            ),
            compatible_runtimes=[lambda_.Runtime.PYTHON_3_12],
            compatible_architectures=[lambda_.Architecture.ARM_64],
        )

    def _function(
        self,
        fdef: FunctionDef,
        layer: lambda_.ILayerVersion,
        env: Mapping[str, str],
        functions_dir: Path,
    ) -> lambda_.Function:
        cid = pascal(fdef.name)
        name = self.function_names[fdef.name]
        log_group = logs.LogGroup(
            self,
            f"{cid}Logs",
            log_group_name=f"/aws/lambda/{name}",
            retention=LOG_RETENTION,
            removal_policy=cdk.RemovalPolicy.DESTROY,
        )
        fn = lambda_.Function(
            self,
            f"{cid}Function",
            function_name=name,
            description=fdef.description[:256] or None,
            runtime=lambda_.Runtime.PYTHON_3_12,
            architecture=lambda_.Architecture.ARM_64,
            handler=fdef.handler,
            code=lambda_.Code.from_asset(str(functions_dir / fdef.name), exclude=ASSET_EXCLUDE),
            layers=[layer],
            memory_size=fdef.memory_mb,
            timeout=cdk.Duration.seconds(fdef.timeout_s),
            # no X-Ray: its cost and per-call overhead buy little here (docs/design.md)
            tracing=lambda_.Tracing.DISABLED,
            log_group=log_group,
            environment={**env, **function_environment(fdef)},
        )
        acknowledge_function(fn)
        return fn

    def _grant(self, fdef: FunctionDef, grant: Grant) -> None:
        fn = self.functions[fdef.name]
        reads = grant.access in ("read", "read_write")
        writes = grant.access in ("write", "read_write")

        def allow(
            actions: Sequence[str], resources: Sequence[str], why: str = "", **condition: Any
        ) -> None:
            statement = iam.PolicyStatement(
                actions=sorted(set(actions)),
                resources=list(resources),
                conditions=condition or None,
            )
            fn.add_to_role_policy(statement)
            # a wildcard the statement holds (cdk-nag's AwsSolutions-IAM5) is kept for ``why``
            acknowledge_wildcards(fn, [statement], why)

        if grant.kind == "table":
            table = self._declared(self.tables, fdef, grant)
            schema = self.table_defs[grant.name].schema()
            resources = [table.attr_arn]
            if "GlobalSecondaryIndexes" in schema or "LocalSecondaryIndexes" in schema:
                resources.append(f"{table.attr_arn}/index/*")
            actions = (TABLE_READ if reads else ()) + (TABLE_WRITE if writes else ())
            allow(
                actions,
                resources,
                "a query names one of the table's indexes (shoal.aws.tables): the grant covers "
                "the indexes the table declares, and only those",
            )
        elif grant.kind == "bucket":
            bucket = self._declared(self.buckets, fdef, grant)
            if reads and writes:
                given = bucket.grant_read_write(fn)
            elif reads:
                given = bucket.grant_read(fn)
            else:
                given = bucket.grant_write(fn)
            acknowledge_wildcards(
                fn,
                given.principal_statements,
                "CDK's bucket grant: object keys are made at run time (messages/, payloads/, "
                "events/), and its action groups (s3:GetObject*, ...) are CDK's own",
            )
        elif grant.kind == "stream":
            stream = self._declared(self.streams, fdef, grant)
            if reads:
                allow(STREAM_READ, [stream.attr_arn])
                # ListStreams names no stream; Lambda's own Kinesis pollers ask for it too
                allow(["kinesis:ListStreams"], ["*"], "ListStreams names no stream")
            if writes:
                allow(STREAM_WRITE, [stream.attr_arn])
        elif grant.kind == "streams":
            stream = self.format_arn(
                service="kinesis", resource="stream", resource_name=f"{self.stream_prefix}-*"
            )
            if reads:
                allow(STREAM_READ, [stream, f"{stream}/consumer/*"], RUNTIME_STREAMS)
                # ListStreams names no stream; Lambda's own Kinesis pollers ask for it too
                allow(["kinesis:ListStreams"], ["*"], "ListStreams names no stream")
            if writes:
                allow(STREAM_WRITE, [stream], RUNTIME_STREAMS)
            if reads and writes:
                allow(STREAM_MANAGE, [stream], RUNTIME_STREAMS)
        elif grant.kind == "event_source_mappings":
            # grant.name is the function the mappings invoke. Mappings have generated ids, so
            # create (which names no mapping) and update/delete are scoped by the condition on
            # the function they invoke; get and list cannot be scoped by function.
            target = self._declared(self.function_names, fdef, grant)
            function_arn = self.format_arn(
                service="lambda",
                resource="function",
                resource_name=target,
                arn_format=cdk.ArnFormat.COLON_RESOURCE_NAME,
            )
            mapping = self.format_arn(
                service="lambda",
                resource="event-source-mapping",
                resource_name="*",
                arn_format=cdk.ArnFormat.COLON_RESOURCE_NAME,
            )
            invokes_target = {"lambda:FunctionArn": [function_arn, f"{function_arn}:*"]}
            why = (
                "mappings are made at run time with generated ids, and listing and creating "
                "name none: create, update and delete hold to mappings that invoke "
                f"{grant.name} (the lambda:FunctionArn condition)"
            )
            if reads:
                allow(["lambda:GetEventSourceMapping"], [mapping], why)
                allow(["lambda:ListEventSourceMappings"], ["*"], why)
            if writes:
                allow(["lambda:CreateEventSourceMapping"], ["*"], why, StringLike=invokes_target)
                allow(
                    ["lambda:DeleteEventSourceMapping", "lambda:UpdateEventSourceMapping"],
                    [mapping],
                    why,
                    StringLike=invokes_target,
                )
        elif grant.kind == "stream_consumers":
            self._grant_consumers(fdef, grant, allow)
        elif grant.kind == "connections":
            self.websocket.grant_connections(fdef, fn, grant)
        elif grant.kind == "queue":
            queue = self._declared(self.queues, fdef, grant)
            if reads:
                # its mapping's function: receive, delete, change visibility, attributes
                queue.grant_consume_messages(fn)
            if writes:
                queue.grant_send_messages(fn)
        elif grant.kind == "metrics":
            if writes:
                raise ValueError(f"function {fdef.name}: metrics are granted read only")
            # GetMetricData names no resource (the Service Authorization Reference: no
            # resource types, no condition keys), so the statement is this one action on "*"
            allow(
                ["cloudwatch:GetMetricData"],
                ["*"],
                "cloudwatch:GetMetricData supports no resource-level permissions",
            )
        else:  # pragma: no cover - the Literal type names every kind
            raise ValueError(f"function {fdef.name}: unknown grant kind {grant.kind!r}")

    def _grant_consumers(self, fdef: FunctionDef, grant: Grant, allow: Any) -> None:
        """The enhanced fan-out consumers of mapping ``grant.name`` (``router``) on the storage
        streams: only while the stack's option names that mapping. Listing and registering act
        on the stream (a consumer is found by name in the listing); deregistering on the
        consumer, whose ARN ends in its name and creation time (``consumer/router:1700000000``).
        Lambda's pollers of a consumer use the reading function's stream read set."""
        if grant.name not in FAN_OUT_MAPPINGS:
            raise ValueError(
                f"function {fdef.name} is granted stream_consumers {grant.name!r}, which no "
                f"option makes (known: {sorted(FAN_OUT_MAPPINGS)})"
            )
        if grant.name not in self.settings.enhanced_fan_out:
            return
        stream = self.format_arn(
            service="kinesis", resource="stream", resource_name=f"{self.stream_prefix}-*"
        )
        consumer = f"{stream}/consumer/{ROUTER_CONSUMER}:*"
        why = (
            f"{RUNTIME_STREAMS}: the {grant.name} consumer of each (enhanced fan-out option), "
            "by its name; its ARN ends in its creation time"
        )
        if grant.access in ("read", "read_write"):
            allow(["kinesis:ListStreamConsumers"], [stream], why)
        if grant.access in ("write", "read_write"):
            allow(["kinesis:RegisterStreamConsumer"], [stream], why)
            allow(["kinesis:DeregisterStreamConsumer"], [consumer], why)

    @staticmethod
    def _declared(resources: Mapping[str, Any], fdef: FunctionDef, grant: Grant) -> Any:
        if grant.name not in resources:
            raise ValueError(
                f"function {fdef.name} is granted {grant.kind} {grant.name!r}, "
                f"which the deployment does not declare (declared: {sorted(resources)})"
            )
        return resources[grant.name]

    def _schedule(self, fdef: FunctionDef) -> None:
        assert fdef.schedule_s is not None
        # EventBridge rates are whole minutes, one at least.
        minutes = max(1, math.ceil(fdef.schedule_s / 60))
        if minutes * 60 != fdef.schedule_s:
            cdk.Annotations.of(self.functions[fdef.name]).add_warning_v2(
                "shoal:schedule-rounded",
                f"{fdef.name}: schedule of {fdef.schedule_s}s runs every {minutes} min",
            )
        rate = cdk.Duration.minutes(minutes)
        rule = events.Rule(
            self,
            f"{pascal(fdef.name)}Schedule",
            description=f"runs {fdef.name} every {minutes} min",
            schedule=events.Schedule.rate(rate),
            # a run that could not start within one period is superseded by the next one
            targets=[
                targets.LambdaFunction(
                    self.functions[fdef.name], max_event_age=rate, retry_attempts=2
                )
            ],
        )
        acknowledge(
            rule,
            "Serverless-EventBusDLQ",
            "a run that could not be delivered is superseded by the next one, a period later",
        )

    def _event_source(self, fdef: FunctionDef, source: EventSource) -> None:
        """A declared stream's mapping to the function (``FunctionDef.sources``), with the
        arguments the declarations give (``ARCHIVER_MAPPING``), as the local runtime makes it."""
        if source.queue:
            self._queue_source(fdef, source)
            return
        spec = dict(source.mapping)
        stream = self.streams[source.stream]
        mapping = lambda_.CfnEventSourceMapping(
            self,
            f"{pascal(fdef.name)}{pascal(source.stream)}Mapping",
            function_name=self.functions[fdef.name].function_name,
            event_source_arn=stream.attr_arn,
            # an argument the declaration leaves out is Lambda's default
            **{prop: spec.pop(arg) for arg, prop in MAPPING_PROPERTIES.items() if arg in spec},
        )
        if spec:
            raise ValueError(f"{fdef.name}: mapping arguments the stack does not map: {spec}")
        # the mapping is checked against the function's role when it is created
        mapping.node.add_dependency(self.functions[fdef.name])
        acknowledge(
            mapping,
            "Serverless-LambdaEventSourceMappingDestination",
            "Shoal's mappings never skip a batch (shoal.aws.kinesis.NEVER_SKIP): an on-failure "
            "destination would never be sent anything; a stuck shard raises the IteratorAge alarm",
        )

    def _queue_source(self, fdef: FunctionDef, source: EventSource) -> None:
        """A declared queue's mapping to the function, its workers at most the declared
        ``ScalingConfig``'s, else the stack's push concurrency (``pushConcurrency``)."""
        spec = dict(source.mapping)
        scaling = dict(spec.pop("ScalingConfig", None) or {})
        mapping = lambda_.CfnEventSourceMapping(
            self,
            f"{pascal(fdef.name)}{pascal(source.queue)}Mapping",
            function_name=self.functions[fdef.name].function_name,
            event_source_arn=self.queues[source.queue].queue_arn,
            batch_size=spec.pop("BatchSize", None),
            function_response_types=spec.pop("FunctionResponseTypes", None),
            scaling_config=lambda_.CfnEventSourceMapping.ScalingConfigProperty(
                maximum_concurrency=scaling.pop(
                    "MaximumConcurrency", self.settings.push_concurrency
                )
            ),
        )
        if scaling:
            raise ValueError(f"{fdef.name}: scaling arguments the stack does not map: {scaling}")
        if spec:
            raise ValueError(f"{fdef.name}: mapping arguments the stack does not map: {spec}")
        mapping.node.add_dependency(self.functions[fdef.name])
        acknowledge(
            mapping,
            "Serverless-LambdaEventSourceMappingDestination",
            "a queue's failed messages go to its dead-letter queue (the redrive policy), which "
            "an alarm watches: an on-failure destination would be a second one",
        )

    # -- API -------------------------------------------------------------------------------

    def _api(self) -> apigw.HttpApi:
        api = apigw.HttpApi(self, "HttpApi", api_name=self.stack_name, description="Shoal")
        jwt = authorizers.HttpJwtAuthorizer(
            "JwtAuthorizer",
            self.settings.jwt_issuer,
            jwt_audience=list(self.settings.jwt_audience),
        )
        integration_of: dict[str, integrations.HttpLambdaIntegration] = {}
        for route, fdef in self.deployment.routes():
            if fdef.name not in integration_of:
                integration_of[fdef.name] = integrations.HttpLambdaIntegration(
                    f"{pascal(fdef.name)}Integration", self.functions[fdef.name]
                )
            key = (
                apigw.HttpRouteKey.DEFAULT
                if route.path == DEFAULT_ROUTE
                else apigw.HttpRouteKey.with_(route.path, apigw.HttpMethod[route.method])
            )
            made = apigw.HttpRoute(
                self,
                f"Route{pascal(route.key.replace('$', 'Dollar'))}",
                http_api=api,
                route_key=key,
                integration=integration_of[fdef.name],
                authorizer=jwt if route.authorized else None,
            )
            if not route.authorized:
                acknowledge(
                    made,
                    "AwsSolutions-APIG4",
                    "declared unauthorized (Route.authorized): the health check and the coded "
                    "404 of unknown routes, which read nothing",
                )

        access_logs = logs.LogGroup(
            self, "ApiAccessLogs", retention=LOG_RETENTION, removal_policy=cdk.RemovalPolicy.DESTROY
        )
        # One JSON line per request; identity by `sub` only, never the token or the body.
        stage = cast(apigw.CfnStage, api.default_stage.node.default_child)
        stage.default_route_settings = apigw.CfnStage.RouteSettingsProperty(
            throttling_rate_limit=API_RATE_LIMIT, throttling_burst_limit=API_BURST_LIMIT
        )
        stage.access_log_settings = apigw.CfnStage.AccessLogSettingsProperty(
            destination_arn=access_logs.log_group_arn,
            format=json.dumps(
                {
                    "requestId": "$context.requestId",
                    "requestTime": "$context.requestTimeEpoch",
                    "routeKey": "$context.routeKey",
                    "status": "$context.status",
                    "responseLength": "$context.responseLength",
                    "latency": "$context.responseLatency",
                    "integrationLatency": "$context.integrationLatency",
                    "integrationError": "$context.integrationErrorMessage",
                    "authorizerError": "$context.authorizer.error",
                    "sub": "$context.authorizer.claims.sub",
                    "sourceIp": "$context.identity.sourceIp",
                }
            ),
        )
        return api

    # -- deploy-time bootstrap -------------------------------------------------------------

    def _bootstrap(self) -> None:
        provider = custom_resources.Provider(
            self,
            "BootstrapProvider",
            on_event_handler=self.functions[BOOTSTRAP],
            log_group=logs.LogGroup(
                self,
                "BootstrapProviderLogs",
                retention=LOG_RETENTION,
                removal_policy=cdk.RemovalPolicy.DESTROY,
            ),
        )
        acknowledge_provider(provider, self.functions[BOOTSTRAP])
        default_topic = cdk.CustomResource(
            self,
            "DefaultTopic",
            service_token=provider.service_token,
            resource_type="Custom::ShoalDefaultTopic",
            properties={
                "DefaultTopic": self.deployment.default_topic,
                "DefaultPartitions": self.settings.default_partitions,
            },
        )
        # The bootstrap's Delete keeps the topic; its streams and mapping are removed, with
        # every other topic's, by the teardown resource (infra/lifecycle.py).
        default_topic.apply_removal_policy(self.removal)
        # The bootstrap may create event source mappings for other functions, which must
        # exist (with their policies) first.
        for name, fn in self.functions.items():
            if name != BOOTSTRAP:
                default_topic.node.add_dependency(fn)

    # -- operations ------------------------------------------------------------------------

    def _alarms(self) -> None:
        topic = sns.Topic(
            self, "AlarmTopic", display_name=f"{self.stack_name} alarms", enforce_ssl=True
        )
        if self.settings.alarm_email:
            topic.add_subscription(sns_subscriptions.EmailSubscription(self.settings.alarm_email))
        self.alarm_topic = topic
        notify = cloudwatch_actions.SnsAction(topic)

        def alarm(cid: str, name: str, metric: cloudwatch.IMetric, description: str) -> None:
            cloudwatch.Alarm(
                self,
                cid,
                alarm_name=f"{self.stack_name}-{name}",
                alarm_description=description,
                metric=metric,
                threshold=0,
                evaluation_periods=1,
                comparison_operator=cloudwatch.ComparisonOperator.GREATER_THAN_THRESHOLD,
                treat_missing_data=cloudwatch.TreatMissingData.NOT_BREACHING,
            ).add_alarm_action(notify)

        for name, fn in self.functions.items():
            cid = pascal(name)
            alarm(
                f"{cid}ErrorsAlarm",
                f"{name}-errors",
                fn.metric_errors(period=ALARM_PERIOD, statistic="Sum"),
                f"{name} failed an invocation (see docs/operations.md)",
            )
            alarm(
                f"{cid}ThrottlesAlarm",
                f"{name}-throttles",
                fn.metric_throttles(period=ALARM_PERIOD, statistic="Sum"),
                f"{name} was throttled (see docs/operations.md)",
            )
        alarm(
            "Api5xxAlarm",
            "api-5xx",
            self.api.metric_server_error(period=ALARM_PERIOD, statistic="Sum"),
            "the HTTP API answered 5xx (see docs/operations.md)",
        )
        wills = self.dead_letter_queues.get("wills")
        if wills is not None:
            alarm(
                "WillsDeadLettersAlarm",
                "wills-dead-letters",
                wills.metric_approximate_number_of_messages_visible(
                    period=ALARM_PERIOD, statistic="Maximum"
                ),
                "a due timer failed its step five times and went to the wills queue's "
                "dead-letter queue: the scheduled reaper still reaps its item, late (see "
                "docs/operations.md)",
            )
        cdk.CfnOutput(self, "AlarmTopicArn", value=topic.topic_arn)

    def _outputs(self) -> None:
        cdk.CfnOutput(self, "ApiUrl", value=self.api.api_endpoint)
        for logical, table in self.tables.items():
            cdk.CfnOutput(self, f"{pascal(logical)}TableName", value=table.ref)
        for logical, bucket in self.buckets.items():
            cdk.CfnOutput(self, f"{pascal(logical)}BucketName", value=bucket.bucket_name)
        for logical, stream in self.streams.items():
            cdk.CfnOutput(self, f"{pascal(logical)}StreamName", value=stream.ref)


def _key_schema(elements: Sequence[Mapping[str, str]]) -> list[dynamodb.CfnTable.KeySchemaProperty]:
    return [
        dynamodb.CfnTable.KeySchemaProperty(
            attribute_name=e["AttributeName"], key_type=e["KeyType"]
        )
        for e in elements
    ]


def _index(table: TableDef, index: Mapping[str, Any]) -> dict[str, Any]:
    # TableDef.schema() promises DynamoDB's CreateTable shape; say so if it breaks the promise
    if not {"IndexName", "KeySchema", "Projection"} <= index.keys():
        raise ValueError(
            f"table {table.logical}: TableDef.schema() must give indexes as IndexName, "
            f"KeySchema, Projection (CreateTable shape), got {sorted(index)}"
        )
    projection = index["Projection"]
    return {
        "index_name": index["IndexName"],
        "key_schema": _key_schema(index["KeySchema"]),
        "projection": dynamodb.CfnTable.ProjectionProperty(
            projection_type=projection.get("ProjectionType"),
            non_key_attributes=projection.get("NonKeyAttributes"),
        ),
    }
