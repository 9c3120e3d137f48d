"""The one declaration of what a Shoal deployment is made of.

The CDK stack (``infra/``) and the local runtime (``shoal.local``) both read this module:
tables (from ``shoal.store``), buckets, functions with their routes, schedules and grants, and
the environment each function gets. Adding a function or a route here adds it to both.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from shoal.config import BUCKET_ENV_PREFIX, FUNCTION_ENV_PREFIX, TABLE_ENV_PREFIX
from shoal.store import TABLES, TableDef

Access = Literal["read", "write", "read_write"]

#: the route API Gateway sends a request to when no other route matches
DEFAULT_ROUTE = "$default"


@dataclass(frozen=True)
class Route:
    method: str
    path: str  # API Gateway syntax: /v1/topics/{name}
    authorized: bool = True

    @property
    def key(self) -> str:
        return DEFAULT_ROUTE if self.path == DEFAULT_ROUTE else f"{self.method} {self.path}"


@dataclass(frozen=True)
class Grant:
    """What a function may do to one resource: a table, a bucket, or the storage streams."""

    kind: Literal["table", "bucket", "streams", "event_source_mappings"]
    name: str
    access: Access


@dataclass(frozen=True)
class FunctionDef:
    name: str
    #: "app.handler" inside functions/<name>/
    handler: str = "app.handler"
    routes: tuple[Route, ...] = ()
    grants: tuple[Grant, ...] = ()
    #: run every this many seconds (EventBridge schedule); None for no schedule
    schedule_s: int | None = None
    memory_mb: int = 512
    timeout_s: int = 29
    description: str = ""

    @property
    def module(self) -> str:
        """The module the local runtime and the tests import: functions.<name>.app."""
        return f"functions.{self.name}.{self.handler.rsplit('.', 1)[0]}"

    @property
    def attribute(self) -> str:
        return self.handler.rsplit(".", 1)[1]


@dataclass(frozen=True)
class BucketDef:
    logical: str
    #: objects under these prefixes expire after this many days (None: kept)
    expire_days: int | None = None


@dataclass(frozen=True)
class Deployment:
    tables: tuple[TableDef, ...]
    buckets: tuple[BucketDef, ...]
    functions: tuple[FunctionDef, ...]
    #: the composite topic every MQTT topic without a topic of its own belongs to
    default_topic: str = "default"
    stream_prefix: str = "shoal"
    extra_env: Mapping[str, str] = field(default_factory=dict)

    def function(self, name: str) -> FunctionDef:
        return next(f for f in self.functions if f.name == name)

    def routes(self) -> list[tuple[Route, FunctionDef]]:
        return [(r, f) for f in self.functions for r in f.routes]


DEPLOYMENT = Deployment(
    tables=TABLES,
    buckets=(BucketDef("archive"),),
    functions=(
        FunctionDef(
            name="health",
            description="GET /v1/health, and the coded 404 for every unknown route",
            routes=(
                Route("GET", "/v1/health", authorized=False),
                Route("ANY", DEFAULT_ROUTE, authorized=False),
            ),
            memory_mb=256,
            timeout_s=5,
        ),
    ),
)


def environment(
    tables: Mapping[str, str],
    buckets: Mapping[str, str],
    functions: Mapping[str, str],
    *,
    stream_prefix: str,
    default_partitions: int,
) -> dict[str, str]:
    """The environment variables every function gets, given physical resource names."""
    env = {f"{TABLE_ENV_PREFIX}{k.upper()}": v for k, v in tables.items()}
    env |= {f"{BUCKET_ENV_PREFIX}{k.upper()}": v for k, v in buckets.items()}
    env |= {f"{FUNCTION_ENV_PREFIX}{k.upper()}": v for k, v in functions.items()}
    env["SHOAL_STREAM_PREFIX"] = stream_prefix
    env["SHOAL_DEFAULT_PARTITIONS"] = str(default_partitions)
    env["POWERTOOLS_SERVICE_NAME"] = "shoal"
    return env
