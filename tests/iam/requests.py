"""A recorded call (``shoal.local.calls``) as the IAM requests AWS authorizes it by.

Most calls are one request: ``<service>:<operation>`` on the resource the parameters name. The
exceptions are where IAM's actions are not the API's operations: S3 (``HeadObject`` is
``s3:GetObject``, listing is ``s3:ListBucket`` on the bucket, multipart uploads are
``s3:PutObject``), DynamoDB's transactions (one ``PutItem``/``UpdateItem``/``DeleteItem``/
``ConditionCheckItem``/``GetItem`` per table of the transaction) and batches (the batch action
on each table), SQS's batches (the single action), and API Gateway's management API
(``execute-api:ManageConnections``), and CloudWatch (signed as ``monitoring``, authorized as
``cloudwatch:``). Actions that name no resource (``kinesis:ListStreams``,
``lambda:CreateEventSourceMapping``) are requests on ``*``. From the AWS Service
Authorization Reference of each service.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from shoal.declarations import DEPLOYMENT
from shoal.local.calls import KEY_ELIDED
from shoal.local.provision import ACCOUNT_ID

from tests.iam.policy import Request

PARTITION = "aws"

#: operations on no resource: IAM evaluates them against ``*``
UNNAMED = {
    "kinesis": {"ListStreams", "DescribeLimits", "EnableEnhancedMonitoring"},
    "lambda": {"CreateEventSourceMapping", "ListEventSourceMappings", "ListFunctions"},
    "dynamodb": {"ListTables", "DescribeLimits", "DescribeEndpoints"},
    "s3": {"ListBuckets"},
    "sts": {"GetCallerIdentity"},
    "cloudwatch": {"PutMetricData", "GetMetricData"},
}
S3_OBJECT_ACTIONS = {
    "HeadObject": "GetObject",
    "GetObject": "GetObject",
    "PutObject": "PutObject",
    "CreateMultipartUpload": "PutObject",
    "UploadPart": "PutObject",
    "CompleteMultipartUpload": "PutObject",
    "CopyObject": "PutObject",
    "DeleteObject": "DeleteObject",
    "DeleteObjects": "DeleteObject",
    "AbortMultipartUpload": "AbortMultipartUpload",
    "GetObjectTagging": "GetObjectTagging",
    "PutObjectTagging": "PutObjectTagging",
}
S3_BUCKET_ACTIONS = {
    "ListObjectsV2": "ListBucket",
    "ListObjects": "ListBucket",
    "HeadBucket": "ListBucket",
    "ListMultipartUploads": "ListBucketMultipartUploads",
}
TRANSACT_ACTIONS = {
    "Put": "PutItem",
    "Update": "UpdateItem",
    "Delete": "DeleteItem",
    "ConditionCheck": "ConditionCheckItem",
    "Get": "GetItem",
}


@dataclass(frozen=True)
class Call:
    """One recorded line: which function called which operation on what."""

    function: str
    service: str
    operation: str
    region: str
    params: Mapping[str, Any]
    endpoint: str = ""
    path: str = ""
    method: str = ""
    #: the test running when a process first saw the call (``shoal.local.calls``)
    seen_in: str = field(default="", compare=False)

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Call:
        return cls(
            function=raw["function"],
            service=raw["service"],
            operation=raw["operation"],
            region=raw.get("region") or "us-east-1",
            params=raw.get("params") or {},
            endpoint=raw.get("endpoint", ""),
            path=raw.get("path", ""),
            method=raw.get("method", ""),
            seen_in=raw.get("seen_in", ""),
        )

    def requests(self) -> list[Request]:
        """The IAM requests of this call (empty: nothing IAM authorizes by the role)."""
        mapper = _MAPPERS.get(self.service, _generic)
        return mapper(self)

    def arn(self, service: str, resource: str, *, region: bool = True) -> str:
        where = f"{self.region}:{ACCOUNT_ID}" if region else ":"
        return f"arn:{PARTITION}:{service}:{where}:{resource}"


def _generic(call: Call) -> list[Request]:
    # a service not modelled here: the action on ``*`` (a statement naming a resource will
    # not match it, and the check names the call: model the service then)
    return [Request(f"{call.service}:{call.operation}", "*")]


def _dynamodb(call: Call) -> list[Request]:
    p = call.params

    def table(name: str) -> str:
        return name if name.startswith("arn:") else call.arn("dynamodb", f"table/{name}")

    if call.operation in UNNAMED["dynamodb"]:
        return [Request(f"dynamodb:{call.operation}", "*")]
    if "TransactItems" in p:
        return [
            Request(f"dynamodb:{TRANSACT_ACTIONS.get(kind, kind)}", table(name))
            for kind, name in p["TransactItems"]
        ]
    if "RequestItems" in p:
        return [Request(f"dynamodb:{call.operation}", table(n)) for n in p["RequestItems"]]
    resource = table(str(p.get("TableName", "*")))
    if p.get("IndexName"):
        resource = f"{resource}/index/{p['IndexName']}"
    return [Request(f"dynamodb:{call.operation}", resource)]


def _kinesis(call: Call) -> list[Request]:
    p = call.params
    action = f"kinesis:{call.operation}"
    if call.operation in UNNAMED["kinesis"]:
        return [Request(action, "*")]
    if p.get("ConsumerARN"):
        return [Request(action, str(p["ConsumerARN"]))]
    if p.get("StreamARN"):
        return [Request(action, str(p["StreamARN"]))]
    if p.get("StreamName"):
        return [Request(action, call.arn("kinesis", f"stream/{p['StreamName']}"))]
    # ListShards with a NextToken only, or GetRecords of an iterator made before recording:
    # the stream is in the token, IAM checks it there; so must a reader of the record
    return [Request(action, call.arn("kinesis", "stream/<unnamed>"))]


def _s3(call: Call) -> list[Request]:
    p = call.params
    bucket = f"arn:{PARTITION}:s3:::{p.get('Bucket', '*')}"
    if call.operation in S3_OBJECT_ACTIONS:
        key = p.get("Key") or KEY_ELIDED
        return [Request(f"s3:{S3_OBJECT_ACTIONS[call.operation]}", f"{bucket}/{key}")]
    if call.operation in S3_BUCKET_ACTIONS:
        keys = {"s3:prefix": str(p["Prefix"])} if "Prefix" in p else {}
        return [Request(f"s3:{S3_BUCKET_ACTIONS[call.operation]}", bucket, keys)]
    if call.operation in UNNAMED["s3"]:
        return [Request(f"s3:{call.operation}", "*")]
    return [Request(f"s3:{call.operation}", bucket)]


def _lambda(call: Call) -> list[Request]:
    p = call.params
    action = f"lambda:{call.operation}"
    keys: dict[str, str] = {}
    if p.get("FunctionName"):
        name = str(p["FunctionName"])
        keys["lambda:FunctionArn"] = (
            name if name.startswith("arn:") else call.arn("lambda", f"function:{name}")
        )
    if call.operation in UNNAMED["lambda"]:
        return [Request(action, "*", keys)]
    if p.get("UUID"):
        return [Request(action, call.arn("lambda", f"event-source-mapping:{p['UUID']}"), keys)]
    if "lambda:FunctionArn" in keys:
        return [Request(action, keys["lambda:FunctionArn"])]
    return [Request(action, "*", keys)]


def _cloudformation(call: Call) -> list[Request]:
    name = str(call.params.get("StackName", "*"))
    if not name.startswith("arn:"):
        # by name: IAM checks the stack's ARN, whose id part the caller does not give
        name = call.arn("cloudformation", f"stack/{name}/*")
    return [Request(f"cloudformation:{call.operation}", name)]


def _execute_api(call: Call) -> list[Request]:
    # https://<api>.execute-api.<region>.amazonaws.com/<stage>/@connections/<id>; locally the
    # endpoint has no API id ("local" stands for it) and no stage: the stage is the declared
    # one, which the deployed endpoint carries
    api = call.endpoint.split(".", 1)[0] if ".execute-api." in call.endpoint else "local"
    before, _, _ = call.path.partition("/@connections")
    stage = before.strip("/") or DEPLOYMENT.websocket.stage
    connection = call.params.get("ConnectionId", "*")
    method = call.method or "POST"
    return [
        Request(
            "execute-api:ManageConnections",
            call.arn("execute-api", f"{api}/{stage}/{method}/@connections/{connection}"),
        )
    ]


#: SQS's batch calls are authorized as their single calls (the Service Authorization Reference
#: lists no action of their own)
SQS_BATCH_ACTIONS = {
    "SendMessageBatch": "SendMessage",
    "DeleteMessageBatch": "DeleteMessage",
    "ChangeMessageVisibilityBatch": "ChangeMessageVisibility",
}


def _sqs(call: Call) -> list[Request]:
    # a queue is named by its URL, https://sqs.<region>.amazonaws.com/<account>/<name>; IAM
    # checks the queue's ARN
    action = f"sqs:{SQS_BATCH_ACTIONS.get(call.operation, call.operation)}"
    url = str(call.params.get("QueueUrl", ""))
    if not url:
        return [Request(action, "*")]
    name = url.rstrip("/").rsplit("/", 1)[-1]
    return [Request(action, call.arn("sqs", name))]


def _cloudwatch(call: Call) -> list[Request]:
    # CloudWatch signs as ``monitoring`` but its IAM actions are ``cloudwatch:``; the metric
    # calls name no resource (GetMetricData, PutMetricData: the Service Authorization Reference)
    action = f"cloudwatch:{call.operation}"
    if call.operation in UNNAMED["cloudwatch"]:
        return [Request(action, "*")]
    return [Request(action, call.arn("cloudwatch", "*"))]


_MAPPERS = {
    "monitoring": _cloudwatch,
    "sqs": _sqs,
    "dynamodb": _dynamodb,
    "kinesis": _kinesis,
    "s3": _s3,
    "lambda": _lambda,
    "cloudformation": _cloudformation,
    "execute-api": _execute_api,
}
