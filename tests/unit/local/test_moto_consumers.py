"""moto's Kinesis consumers kept as Kinesis and Lambda keep them (``shoal.local.esm.consumers``):
one consumer of a name per stream, ARNs ending in their creation time, mappings on consumers."""

from __future__ import annotations

import io
import zipfile
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError
from moto import mock_aws
from shoal.local.aws import adapt_moto


@pytest.fixture
def account() -> Iterator[tuple[Any, Any, str]]:
    adapt_moto()
    with mock_aws():
        kinesis = boto3.client("kinesis", region_name="us-east-1")
        awslambda = boto3.client("lambda", region_name="us-east-1")
        kinesis.create_stream(StreamName="s", ShardCount=1)
        arn = kinesis.describe_stream_summary(StreamName="s")["StreamDescriptionSummary"]
        role = boto3.client("iam", region_name="us-east-1").create_role(
            RoleName="r", AssumeRolePolicyDocument="{}"
        )["Role"]["Arn"]
        code = io.BytesIO()
        with zipfile.ZipFile(code, "w") as archive:
            archive.writestr("app.py", "def handler(event, context):\n    return None\n")
        awslambda.create_function(
            FunctionName="f",
            Runtime="python3.12",
            Role=role,
            Handler="app.handler",
            Code={"ZipFile": code.getvalue()},
        )
        yield kinesis, awslambda, arn["StreamARN"]


def test_a_name_is_registered_once_per_stream(account: tuple[Any, Any, str]) -> None:
    kinesis, _, stream = account
    # Given a consumer registered on the stream
    first = kinesis.register_stream_consumer(StreamARN=stream, ConsumerName="router")
    # When the same name is registered again, Then Kinesis refuses it, and one consumer is left
    with pytest.raises(ClientError, match="ResourceInUseException"):
        kinesis.register_stream_consumer(StreamARN=stream, ConsumerName="router")
    [only] = kinesis.list_stream_consumers(StreamARN=stream)["Consumers"]
    # And its ARN ends in its name and creation time, as AWS's does
    arn = first["Consumer"]["ConsumerARN"]
    assert only["ConsumerARN"] == arn
    assert arn.startswith(f"{stream}/consumer/router:") and arn.rsplit(":", 1)[1].isdigit()


def test_a_mapping_takes_a_registered_consumer_as_its_source(
    account: tuple[Any, Any, str],
) -> None:
    kinesis, awslambda, stream = account
    consumer = kinesis.register_stream_consumer(StreamARN=stream, ConsumerName="router")[
        "Consumer"
    ]["ConsumerARN"]
    # When a mapping names the consumer, Then Lambda takes it and lists it by that source
    made = awslambda.create_event_source_mapping(
        EventSourceArn=consumer, FunctionName="f", StartingPosition="TRIM_HORIZON"
    )
    found = awslambda.list_event_source_mappings(EventSourceArn=consumer)["EventSourceMappings"]
    assert [m["UUID"] for m in found] == [made["UUID"]]
    # And a consumer that is not registered is refused, as before
    with pytest.raises(ClientError, match="Invalid EventSourceArn"):
        awslambda.create_event_source_mapping(
            EventSourceArn=f"{stream}/consumer/other:1", FunctionName="f"
        )
