"""Create a deployment's resources in an emulated account, from ``shoal.declarations``.

``shoal dev`` and the integration tests both call ``provision``; the CDK stack reads the same
declarations, so the emulated account has exactly the tables, buckets and functions a deployed
stack has.
"""

from __future__ import annotations

import io
import zipfile
from dataclasses import dataclass, field
from typing import Any

import boto3
from botocore.exceptions import ClientError

from shoal.declarations import DEPLOYMENT, Deployment, environment

ACCOUNT_ID = "123456789012"
LAMBDA_ROLE = "shoal-local-lambda"


@dataclass(frozen=True)
class LocalNames:
    """Physical names of the emulated resources (CloudFormation picks them when deployed)."""

    prefix: str = "shoal"
    default_partitions: int = 1
    tables: dict[str, str] = field(default_factory=dict)
    buckets: dict[str, str] = field(default_factory=dict)
    functions: dict[str, str] = field(default_factory=dict)

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
        )

    def environment(self) -> dict[str, str]:
        return environment(
            self.tables,
            self.buckets,
            self.functions,
            stream_prefix=self.prefix,
            default_partitions=self.default_partitions,
        )


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
