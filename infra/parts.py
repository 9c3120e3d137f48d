"""What the stack's later parts read of the stack built so far, and its construct naming.

``infra.lifecycle`` and ``infra.observability`` are built by ``infra.stack`` from the
functions, tables and API it has made. They read those through the ``StackParts`` protocol
rather than ``ShoalStack`` itself, so that neither imports the module that imports them (an
import circle, even one for types only, is what house-check forbids); the library broke its own
the same way (the batch publisher reads a protocol of the client).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Protocol

from aws_cdk import aws_apigatewayv2 as apigw
from aws_cdk import aws_dynamodb as dynamodb
from aws_cdk import aws_kinesis as kinesis
from aws_cdk import aws_lambda as lambda_
from constructs import Node
from shoal.declarations import Deployment


def pascal(name: str) -> str:
    """A declared name (``push-admin``, ``topics``) as a construct id's stem (``PushAdmin``)."""
    return "".join(part[:1].upper() + part[1:] for part in re.split(r"[^A-Za-z0-9]+", name))


class RetainSetting(Protocol):
    @property
    def retain_streams(self) -> bool: ...


class StackParts(Protocol):
    """A Shoal stack as its lifecycle and observability see it. It is a construct (``node``):
    ``cdk.Stack.of(parts)`` is the stack to build in."""

    @property
    def node(self) -> Node: ...

    @property
    def stack_name(self) -> str: ...

    @property
    def stack_id(self) -> str: ...

    @property
    def deployment(self) -> Deployment: ...

    @property
    def settings(self) -> RetainSetting: ...

    @property
    def stream_prefix(self) -> str: ...

    @property
    def functions(self) -> Mapping[str, lambda_.Function]: ...

    @property
    def tables(self) -> Mapping[str, dynamodb.CfnTable]: ...

    @property
    def streams(self) -> Mapping[str, kinesis.CfnStream]: ...

    @property
    def api(self) -> apigw.HttpApi: ...
