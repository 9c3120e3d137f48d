"""Synthesizing the stack for tests, and a test-only deployment that uses every feature.

``VARIANT`` exercises what the real declarations may not declare yet: every grant kind, a
schedule, the bootstrap and teardown custom resources, a TTL table, an expiring bucket, a
stream of its own with a mapping given only some arguments.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pynamodb.attributes import NumberAttribute, UnicodeAttribute
from pynamodb.models import Model
from shoal.aws.tables import TABLES, TableDef
from shoal.declarations import (
    DEFAULT_ROUTE,
    BucketDef,
    Deployment,
    EventSource,
    FunctionDef,
    Grant,
    Route,
    StreamDef,
)

if TYPE_CHECKING:
    from aws_cdk.assertions import Template

    from infra.stack import ShoalStack

ROOT = Path(__file__).resolve().parents[2]

ISSUER = "https://issuer.example.com/"
AUDIENCES = ("shoal-api", "shoal-cli")


def context(**overrides: Any) -> dict[str, Any]:
    """cdk.json's context, as `cdk deploy` sees it, with the JWT settings and no bundling."""
    base = json.loads((ROOT / "cdk.json").read_text())["context"]
    return {
        **base,
        "jwtIssuer": ISSUER,
        "jwtAudience": ",".join(AUDIENCES),
        # no stack is bundled, so no pip runs: the layer asset is its source folder
        "aws:cdk:bundling-stacks": [],
        **overrides,
    }


@dataclass(frozen=True)
class Synth:
    stack: ShoalStack
    template: Template
    deployment: Deployment

    @cached_property
    def template_json(self) -> dict[str, Any]:
        """The template, read from jsii once (each ``to_json`` call crosses to Node)."""
        return dict(self.template.to_json())

    @property
    def resources(self) -> dict[str, dict[str, Any]]:
        return dict(self.template_json["Resources"])

    def of_type(self, kind: str) -> dict[str, dict[str, Any]]:
        return {k: v for k, v in self.resources.items() if v["Type"] == kind}

    def function(self, name: str) -> dict[str, Any]:
        wanted = self.stack.function_names[name]
        [fn] = [
            v
            for v in self.of_type("AWS::Lambda::Function").values()
            if v["Properties"].get("FunctionName") == wanted
        ]
        return fn

    def statements(self, name: str) -> list[dict[str, Any]]:
        """Every IAM statement attached to the function's role."""
        role = self.function(name)["Properties"]["Role"]["Fn::GetAtt"][0]
        out: list[dict[str, Any]] = []
        for policy in self.of_type("AWS::IAM::Policy").values():
            if {"Ref": role} in policy["Properties"]["Roles"]:
                out += policy["Properties"]["PolicyDocument"]["Statement"]
        return out

    def actions(self, name: str, service: str) -> set[str]:
        return {
            action
            for statement in self.statements(name)
            for action in as_list(statement["Action"])
            if action.startswith(f"{service}:")
        }


def as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def synth(
    deployment: Deployment,
    ctx: Mapping[str, Any],
    functions_dir: Path = ROOT / "functions",
) -> Synth:
    # Imported here, after the banner is silenced: the jsii runtime starts with aws_cdk.
    os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "20")
    import aws_cdk as cdk
    from aws_cdk.assertions import Template

    from infra.stack import ShoalStack

    app = cdk.App(context=dict(ctx))
    stack = ShoalStack(
        app,
        "shoal-test",
        stack_name="shoal-test",
        deployment=deployment,
        functions_dir=functions_dir,
    )
    return Synth(stack, Template.from_stack(stack), deployment)


class LeaseModel(Model):
    """A test-only table with a range key and a TTL attribute."""

    class Meta:
        table_name = "leases"
        region = "us-east-1"

    group = UnicodeAttribute(hash_key=True)
    stream = UnicodeAttribute(range_key=True)
    expires_at = NumberAttribute()


def _fn(name: str, *grants: Grant, routes: tuple[Route, ...] = (), **kw: Any) -> FunctionDef:
    return FunctionDef(name=name, routes=routes, grants=grants, **kw)


VARIANT = Deployment(
    tables=(*TABLES, TableDef("leases", LeaseModel, ttl_attribute="expires_at")),
    buckets=(BucketDef("archive", expire_days=30, expire_prefixes=(("tmp/", 2),)),),
    functions=(
        _fn(
            "front",
            Grant("table", "topics", "read_write"),
            routes=(
                Route("GET", "/v1/health", authorized=False),
                Route("GET", "/v1/topics/{name}"),
                Route("POST", "/v1/messages:batch"),
                Route("ANY", DEFAULT_ROUTE, authorized=False),
            ),
        ),
        _fn("plain"),
        _fn("reader", Grant("table", "leases", "read")),
        _fn(
            "router",
            Grant("streams", "shoal", "read"),
            Grant("bucket", "archive", "write"),
            Grant("table", "topics", "read"),
        ),
        _fn("publisher", Grant("streams", "shoal", "write"), Grant("stream", "log", "write")),
        # a stream the stack owns, read through a mapping the stack declares with only some
        # of the arguments (Lambda's defaults for the rest)
        _fn(
            "tailer",
            Grant("stream", "log", "read"),
            sources=(EventSource("log", {"StartingPosition": "LATEST", "BatchSize": 50}),),
        ),
        _fn(
            "admin",
            Grant("streams", "shoal", "read_write"),
            Grant("event_source_mappings", "router", "read_write"),
        ),
        _fn("reaper", Grant("table", "leases", "read_write"), schedule_s=30),
        # the runtime resources' custom resource (retainStreams=true in the variant's context)
        _fn(
            "teardown",
            Grant("table", "topics", "read"),
            Grant("streams", "shoal", "read_write"),
            Grant("event_source_mappings", "router", "read_write"),
        ),
        _fn(
            "bootstrap",
            Grant("table", "topics", "read_write"),
            Grant("streams", "shoal", "read_write"),
            Grant("event_source_mappings", "router", "read_write"),
        ),
    ),
    streams=(StreamDef("log", shards=2, retention_hours=48),),
)
