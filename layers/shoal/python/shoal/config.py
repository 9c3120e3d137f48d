"""Typed configuration, parsed from the environment once per cold start.

The CDK stack and ``shoal dev`` set the same variables (see ``shoal.declarations.environment``),
so a handler cannot tell which of the two it runs in.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from functools import cache

from pydantic import BaseModel, ConfigDict, Field

TABLE_ENV_PREFIX = "SHOAL_TABLE_"
BUCKET_ENV_PREFIX = "SHOAL_BUCKET_"
FUNCTION_ENV_PREFIX = "SHOAL_FUNCTION_"


class Config(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    region: str = "us-east-1"
    #: logical table name -> physical table name
    tables: dict[str, str] = Field(default_factory=dict)
    #: logical bucket name -> physical bucket name
    buckets: dict[str, str] = Field(default_factory=dict)
    #: logical function name -> deployed function name (for event source mappings)
    functions: dict[str, str] = Field(default_factory=dict)
    #: Kinesis stream names of storage topics are "<stream_prefix>-<topic>-<index>"
    stream_prefix: str = "shoal"
    default_partitions: int = 1
    #: Requests with a larger body are refused before parsing (API Gateway allows 10 MB,
    #: a synchronous Lambda invocation 6 MB).
    max_body_bytes: int = 6 * 1024 * 1024

    def table(self, logical: str) -> str:
        return self.tables[logical]

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Config:
        def section(prefix: str) -> dict[str, str]:
            return {k[len(prefix) :].lower(): v for k, v in env.items() if k.startswith(prefix)}

        return cls(
            region=env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1",
            tables=section(TABLE_ENV_PREFIX),
            buckets=section(BUCKET_ENV_PREFIX),
            functions=section(FUNCTION_ENV_PREFIX),
            stream_prefix=env.get("SHOAL_STREAM_PREFIX", "shoal"),
            default_partitions=int(env.get("SHOAL_DEFAULT_PARTITIONS", "1")),
            max_body_bytes=int(env.get("SHOAL_MAX_BODY_BYTES", str(6 * 1024 * 1024))),
        )


@cache
def get_config() -> Config:
    """The process's configuration; tests that change the environment call ``cache_clear``."""
    return Config.from_env(os.environ)
