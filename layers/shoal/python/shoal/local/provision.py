"""Create a deployment's resources in an emulated account, from ``shoal.declarations``.

``shoal dev`` and the integration tests both call ``provision``; the CDK stack reads the same
declarations, so the emulated account has exactly the tables, buckets, streams and functions a
deployed stack has. The declared event source mappings (``provision_mappings``) are made by
``shoal dev`` only: tests that drive the functions themselves decide what runs when.
"""

from __future__ import annotations

import io
import json
import zipfile
from dataclasses import dataclass, field
from typing import Any

import boto3
from botocore.exceptions import ClientError

from shoal.declarations import DEPLOYMENT, Deployment, QueueDef, environment

ACCOUNT_ID = "123456789012"
REGION = "us-east-1"
LAMBDA_ROLE = "shoal-local-lambda"


@dataclass(frozen=True)
class LocalNames:
    """Physical names of the emulated resources (CloudFormation picks them when deployed)."""

    prefix: str = "shoal"
    default_partitions: int = 1
    tables: dict[str, str] = field(default_factory=dict)
    buckets: dict[str, str] = field(default_factory=dict)
    functions: dict[str, str] = field(default_factory=dict)
    #: streams the stack owns: "<logical>.<prefix>", a name outside every storage stream's
    #: "<prefix>-<topic>-<index>" (as the stack names them "<logical>.<stack name>")
    streams: dict[str, str] = field(default_factory=dict)
    #: queues the stack owns (and their dead-letter queues): "<prefix>-<logical>", ".fifo" for
    #: a FIFO queue, as SQS requires
    queues: dict[str, str] = field(default_factory=dict)

    @classmethod
    def for_deployment(
        cls, deployment: Deployment = DEPLOYMENT, prefix: str = "shoal", default_partitions: int = 1
    ) -> LocalNames:
        return cls(
            prefix=prefix,
            default_partitions=default_partitions,
            tables={t.logical: f"{prefix}-{t.logical}" for t in deployment.tables},
            buckets={b.logical: f"{prefix}-{b.logical}-{ACCOUNT_ID}" for b in deployment.buckets},
            functions={f.name: f"{prefix}-{f.name}" for f in deployment.functions},
            streams={s.logical: f"{s.logical}.{prefix}" for s in deployment.streams},
            queues={
                name: f"{prefix}-{name}{'.fifo' if q.fifo else ''}"
                for q in deployment.queues
                for name in (q.logical, q.dead_letter)
            },
        )

    def queue_url(self, logical: str) -> str:
        """A queue's URL as SQS gives it (moto finds a queue by the URL's last two parts, so
        the same URL serves every endpoint the emulator listens on)."""
        return f"https://sqs.{REGION}.amazonaws.com/{ACCOUNT_ID}/{self.queues[logical]}"

    def queue_arn(self, logical: str) -> str:
        return f"arn:aws:sqs:{REGION}:{ACCOUNT_ID}:{self.queues[logical]}"

    def environment(self) -> dict[str, str]:
        env = environment(
            self.tables,
            self.buckets,
            self.functions,
            stream_prefix=self.prefix,
            default_partitions=self.default_partitions,
            streams=self.streams,
            # the queues consumed by code (not their dead-letter queues, which only alarms read)
            queues={q: self.queue_url(q) for q in self.queues if not q.endswith("-dead")},
        )
        env["SHOAL_STREAM_CLOCK_SKEW_MS"] = str(LOCAL_STREAM_SKEW_MS)
        return env


#: the emulated Kinesis stamps arrivals with the clock of the process the functions run in
#: (``shoal dev``, the tests' account): the skew is the stamps' rounding (under a millisecond
#: each way), not two clocks' drift, so a subscribe waits 5 ms instead of the deployed 201
LOCAL_STREAM_SKEW_MS = 2


def _placeholder_zip() -> bytes:
    # The emulated Lambda service only needs code to exist: the local runtime invokes the
    # handlers in-process, because invoking through moto needs Docker.
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("app.py", "def handler(event, context):\n    return None\n")
    return buf.getvalue()


def _exists(error: ClientError) -> bool:
    code = error.response.get("Error", {}).get("Code", "")
    return code in {
        "ResourceInUseException",
        "ResourceConflictException",
        "BucketAlreadyOwnedByYou",
        "BucketAlreadyExists",
        "EntityAlreadyExists",
    }


def provision(
    session: boto3.Session,
    names: LocalNames,
    deployment: Deployment = DEPLOYMENT,
) -> None:
    """Create every declared table, bucket and function; resources that exist are kept."""
    dynamodb = session.client("dynamodb")
    for table in deployment.tables:
        physical = names.tables[table.logical]
        try:
            dynamodb.create_table(
                TableName=physical, BillingMode="PAY_PER_REQUEST", **table.schema()
            )
        except ClientError as exc:
            if not _exists(exc):
                raise
        if table.ttl_attribute:
            dynamodb.update_time_to_live(
                TableName=physical,
                TimeToLiveSpecification={"Enabled": True, "AttributeName": table.ttl_attribute},
            )

    s3 = session.client("s3")
    for bucket in deployment.buckets:
        try:
            s3.create_bucket(Bucket=names.buckets[bucket.logical])
        except ClientError as exc:
            if not _exists(exc):
                raise

    kinesis = session.client("kinesis")
    for stream in deployment.streams:
        try:
            kinesis.create_stream(
                StreamName=names.streams[stream.logical],
                ShardCount=stream.shards,
                StreamModeDetails={"StreamMode": "PROVISIONED"},
            )
        except ClientError as exc:
            if not _exists(exc):
                raise

    provision_queues(session, names, deployment)

    iam = session.client("iam")
    trust = (
        '{"Version":"2012-10-17","Statement":[{"Effect":"Allow",'
        '"Principal":{"Service":"lambda.amazonaws.com"},"Action":"sts:AssumeRole"}]}'
    )
    try:
        role_arn = iam.create_role(RoleName=LAMBDA_ROLE, AssumeRolePolicyDocument=trust)["Role"][
            "Arn"
        ]
    except ClientError as exc:
        if not _exists(exc):
            raise
        role_arn = iam.get_role(RoleName=LAMBDA_ROLE)["Role"]["Arn"]

    awslambda = session.client("lambda")
    code = _placeholder_zip()
    env = names.environment()
    for fn in deployment.functions:
        spec: dict[str, Any] = {
            "FunctionName": names.functions[fn.name],
            "Runtime": "python3.12",
            "Role": role_arn,
            "Handler": fn.handler,
            "Code": {"ZipFile": code},
            "Timeout": fn.timeout_s,
            "MemorySize": fn.memory_mb,
            "Environment": {"Variables": env},
        }
        try:
            awslambda.create_function(**spec)
        except ClientError as exc:
            if not _exists(exc):
                raise


def provision_queues(
    session: boto3.Session, names: LocalNames, deployment: Deployment = DEPLOYMENT
) -> None:
    """Create every declared queue and its dead-letter queue (kept when they exist)."""
    sqs = session.client("sqs")
    for queue in deployment.queues:
        # the dead-letter queue first: the queue's redrive policy names it
        dead = _queue(sqs, names.queues[queue.dead_letter], queue, retention_s=14 * 24 * 3600)
        _queue(
            sqs,
            names.queues[queue.logical],
            queue,
            RedrivePolicy=json.dumps(
                {"deadLetterTargetArn": dead, "maxReceiveCount": str(queue.max_receive_count)}
            ),
        )


def _queue(
    sqs: Any, name: str, queue: QueueDef, *, retention_s: int | None = None, **more: str
) -> str:
    """Creates the queue unless it exists (with the same attributes: SQS answers a create of
    an existing queue with its URL); its ARN."""
    attributes = {
        "VisibilityTimeout": str(queue.visibility_timeout_s),
        "MessageRetentionPeriod": str(retention_s or queue.retention_s),
        **more,
    }
    if queue.fifo:
        # a retried hand-off sends the same deduplication ids: SQS keeps one of each for 5 min
        attributes |= {
            "FifoQueue": "true",
            "ContentBasedDeduplication": "false",
            "DeduplicationScope": "messageGroup",
            "FifoThroughputLimit": "perMessageGroupId",
        }
    url = sqs.create_queue(QueueName=name, Attributes=attributes)["QueueUrl"]
    arn: str = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"][
        "QueueArn"
    ]
    return arn


def provision_mappings(
    session: boto3.Session,
    names: LocalNames,
    deployment: Deployment = DEPLOYMENT,
    *,
    batching_window_s: int | None = None,
) -> list[str]:
    """Create the declared event source mappings (``FunctionDef.sources``) unless they exist;
    their UUIDs. ``batching_window_s`` replaces the declared window: ``shoal dev`` archives
    delivery events within a second or two, where a deployed stack waits up to a minute to
    fill a batch (a developer reading the archive should not wait for a cost saving)."""
    kinesis = session.client("kinesis")
    awslambda = session.client("lambda")
    uuids: list[str] = []
    for fn in deployment.functions:
        for source in fn.sources:
            if source.queue:
                arn = names.queue_arn(source.queue)
            else:
                arn = kinesis.describe_stream_summary(StreamName=names.streams[source.stream])[
                    "StreamDescriptionSummary"
                ]["StreamARN"]
            function = names.functions[fn.name]
            found = awslambda.list_event_source_mappings(EventSourceArn=arn, FunctionName=function)
            existing = [m["UUID"] for m in found.get("EventSourceMappings", [])]
            if existing:
                uuids.extend(existing)
                continue
            spec: dict[str, Any] = dict(source.mapping)
            if batching_window_s is not None and not source.queue:
                spec["MaximumBatchingWindowInSeconds"] = batching_window_s
            made = awslambda.create_event_source_mapping(
                EventSourceArn=arn, FunctionName=function, **spec
            )
            uuids.append(made["UUID"])
    return uuids
