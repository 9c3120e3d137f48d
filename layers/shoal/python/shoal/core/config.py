"""Typed configuration, parsed from the environment once per cold start.

The CDK stack and ``shoal dev`` set the same variables (see ``shoal.declarations.environment``),
so a handler cannot tell which of the two it runs in.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from functools import cache
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field

TABLE_ENV_PREFIX = "SHOAL_TABLE_"
BUCKET_ENV_PREFIX = "SHOAL_BUCKET_"
FUNCTION_ENV_PREFIX = "SHOAL_FUNCTION_"
#: the Kinesis streams the stack owns (the delivery-event log), not the topics' storage
#: streams, which are named after SHOAL_STREAM_PREFIX at run time
STREAM_ENV_PREFIX = "SHOAL_KINESIS_"
#: the SQS queues the stack owns, by URL (the push queue: ``shoal.edge.pushwork``; the wills
#: queue: ``shoal.sessions.timers``)
QUEUE_ENV_PREFIX = "SHOAL_QUEUE_"

#: delivery defaults (``shoal.delivery``)
DEFAULT_ACK_TIMEOUT_S = 30
DEFAULT_WINDOW = 100
DEFAULT_RETENTION_S = 14 * 24 * 3600
#: shared groups' default lease timeout (``shoal.groups``): with a heartbeat every third of it,
#: a lost member's streams move within about 8 s (EMQX's tests expect 10 s)
DEFAULT_LEASE_TIMEOUT_S = 6.0
#: on AWS a BatchWriteItem is a round trip of ~10 ms; 16 at once hide a batch's (a few to 16 of
#: them) and make a large fan-out's writes a sixteenth as long (docs/operations.md, "Router
#: throughput", "Fan-out")
DEFAULT_WRITE_CONCURRENCY = 16
#: a shared group's work spreads over at least this many members (``shoal.groups.streams``)
DEFAULT_GROUP_PARALLELISM = 8
#: the mappings that may read their streams through an enhanced fan-out consumer (a stack
#: option, ``SHOAL_ENHANCED_FAN_OUT``: docs/operations.md, "Latency"); only the router's so far
FAN_OUT_ENV = "SHOAL_ENHANCED_FAN_OUT"
FAN_OUT_MAPPINGS = frozenset({"router"})
#: Lambda's and Kinesis' clocks are both kept by the Amazon Time Sync Service (well under a
#: millisecond apart); a hundred times that margin costs a new subscription 200 ms at most
DEFAULT_STREAM_SKEW_MS = 100


class DeliverySettings(BaseModel):
    """Delivery's knobs (the deployment may set them; ``shoal dev`` passes its own environment
    through, so tests can shorten the ack timeout)."""

    model_config = ConfigDict(frozen=True)

    ack_timeout_s: float = Field(default=DEFAULT_ACK_TIMEOUT_S, gt=0)
    #: unacked QoS 1/2 deliveries a session may have (MQTT's receive maximum)
    window: int = Field(default=DEFAULT_WINDOW, ge=1, le=1000)
    retention_s: int = Field(default=DEFAULT_RETENTION_S, ge=60)
    #: the router's inbox batch writes in flight at once (``InboxStore.put``)
    write_concurrency: int = Field(default=DEFAULT_WRITE_CONCURRENCY, ge=1, le=16)
    #: the most the functions' clocks and Kinesis' arrival stamps may differ by: a subscription's
    #: cut stands this far after its subscribe began, and the subscribe returns only once its
    #: clock is this far past the cut (``shoal.delivery.subscriptions``, "The cut")
    stream_skew_ms: int = Field(default=DEFAULT_STREAM_SKEW_MS, ge=0, le=5_000)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> DeliverySettings:
        values: dict[str, Any] = {}
        for name, key in (
            ("ack_timeout_s", "SHOAL_ACK_TIMEOUT_S"),
            ("window", "SHOAL_INFLIGHT_WINDOW"),
            ("retention_s", "SHOAL_INBOX_RETENTION_S"),
            ("write_concurrency", "SHOAL_ROUTER_WRITE_CONCURRENCY"),
            ("stream_skew_ms", "SHOAL_STREAM_CLOCK_SKEW_MS"),
        ):
            if env.get(key):
                values[name] = env[key]
        return cls.model_validate(values)


#: the push queue's message groups (``shoal.edge.pushwork``): a session's pushes go one after
#: the other in its lane, the lanes side by side, so the pushes of one hand-off spread over at
#: most this many workers at once (the stack's push concurrency caps them further)
DEFAULT_PUSH_LANES = 64
#: sessions of a batch one pusher pushes at once: deployed, each push waits on its round trips
#: (about 10 ms a call), not on its CPU, so a worker overlaps 16 of them
DEFAULT_PUSH_PARALLELISM = 16


class PushSettings(BaseModel):
    """The WebSocket pushes' knobs (``shoal.edge.pushwork``)."""

    model_config = ConfigDict(frozen=True)

    lanes: int = Field(default=DEFAULT_PUSH_LANES, ge=1, le=4096)
    parallelism: int = Field(default=DEFAULT_PUSH_PARALLELISM, ge=1, le=64)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> PushSettings:
        knobs = {"lanes": "SHOAL_PUSH_LANES", "parallelism": "SHOAL_PUSH_PARALLELISM"}
        return cls(**{k: int(env[name]) for k, name in knobs.items() if env.get(name)})


class GroupSettings(BaseModel):
    """The shared groups' knobs."""

    model_config = ConfigDict(frozen=True)

    #: a member that has not renewed (heartbeat) for this long loses its streams; a revoke
    #: that is not finished in this long is finished by the leader
    lease_timeout_s: float = Field(default=DEFAULT_LEASE_TIMEOUT_S, gt=0)
    #: how many members a group created without its own lane count spreads over at least:
    #: its lanes per shard are this divided by its topic's partitions, rounded up
    #: (``shoal.groups.streams``; a topic of 8 partitions needs no lanes for 8 members)
    parallelism: int = Field(default=DEFAULT_GROUP_PARALLELISM, ge=1, le=64)
    #: lanes per shard of every group created without its own count (None: from parallelism)
    lanes: int | None = Field(default=None, ge=1, le=64)

    @property
    def lease_timeout_ms(self) -> int:
        return int(self.lease_timeout_s * 1000)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> GroupSettings:
        values: dict[str, Any] = {}
        if raw := env.get("SHOAL_GROUP_LEASE_TIMEOUT_S"):
            values["lease_timeout_s"] = float(raw)
        if raw := env.get("SHOAL_GROUP_LANES"):
            values["lanes"] = int(raw)
        if raw := env.get("SHOAL_GROUP_PARALLELISM"):
            values["parallelism"] = int(raw)
        return cls(**values)


class Config(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    region: str = "us-east-1"
    #: logical table name -> physical table name
    tables: dict[str, str] = Field(default_factory=dict)
    #: logical bucket name -> physical bucket name
    buckets: dict[str, str] = Field(default_factory=dict)
    #: logical function name -> deployed function name (for event source mappings)
    functions: dict[str, str] = Field(default_factory=dict)
    #: logical stream name -> physical name, of the streams the stack owns (``events``: the
    #: delivery-event log, ``shoal.delivery.events``)
    streams: dict[str, str] = Field(default_factory=dict)
    #: logical queue name -> URL, of the queues the stack owns (``push``, ``wills``)
    queues: dict[str, str] = Field(default_factory=dict)
    #: Kinesis stream names of storage topics are "<stream_prefix>-<topic>-<index>"
    stream_prefix: str = "shoal"
    default_partitions: int = 1
    #: Requests with a larger body are refused before parsing (API Gateway allows 10 MB,
    #: a synchronous Lambda invocation 6 MB).
    max_body_bytes: int = 6 * 1024 * 1024
    #: fault injection for tests (``SHOAL_FAULTS=router=0.25[,seed=N]``): function -> the
    #: probability that an invocation fails at a random step (``shoal.core.faults``); empty: never
    faults: dict[str, float] = Field(default_factory=dict)
    #: crash tests (``SHOAL_CRASH_AT=publish:after_reserve``): the process exits at once, as
    #: under kill -9, when the named function reaches the named step (``shoal.core.faults``)
    crash_at: str = ""
    delivery: DeliverySettings = Field(default_factory=DeliverySettings)
    groups: GroupSettings = Field(default_factory=GroupSettings)
    push: PushSettings = Field(default_factory=PushSettings)
    #: ``shoal dev`` and tests shorten the drain's seal grace (``SHOAL_SEAL_GRACE_S``); None:
    #: derived from the deployment's function timeouts (``shoal.drain.seal_grace_ms``)
    seal_grace_s: float | None = None
    #: push subscriptions may name ``http://`` endpoints on loopback, so that a developer's
    #: local server can receive pushes (``shoal.push.endpoint.EndpointPolicy``): under
    #: ``shoal dev``, whose AWS_ENDPOINT_URL names its emulator on loopback (a deployed
    #: function has no AWS_ENDPOINT_URL at all, so that is the signal that we run locally)
    push_loopback_http: bool = False
    #: the WebSocket API's ``@connections`` management endpoint
    #: (``https://{api}.execute-api.{region}.amazonaws.com/{stage}``; under ``shoal dev`` its
    #: loopback URL): where pushed frames go (``shoal.edge``). Empty: no WebSocket API, and
    #: nothing is pushed.
    connections_endpoint: str = ""
    #: the JWT rules the WebSocket API's authorizer applies, the HTTP API's JWT authorizer's
    #: (``SHOAL_JWT_ISSUER``, ``SHOAL_JWT_AUDIENCE``: comma-separated; the keys from
    #: ``SHOAL_JWKS_URL``, by default the issuer's ``/.well-known/jwks.json``)
    jwt_issuer: str = ""
    jwt_audiences: tuple[str, ...] = ()
    jwks_url: str = ""
    #: the mappings made at run time that read through an enhanced fan-out consumer of their
    #: storage stream (``FAN_OUT_MAPPINGS``); empty: every mapping polls its shards
    enhanced_fan_out: frozenset[str] = frozenset()
    #: how often the reaper's census counts connections, sessions, groups and dead letters
    #: (``shoal.census``; ``SHOAL_CENSUS_EVERY_S``): every minute by default (each reaper run
    #: deployed), longer for fewer reads (each census reads the connections, sessions and
    #: groups tables whole: docs/operations.md, "The census"), 0 for none
    census_every_s: int = Field(default=60, ge=0)

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
            streams=section(STREAM_ENV_PREFIX),
            queues=section(QUEUE_ENV_PREFIX),
            stream_prefix=env.get("SHOAL_STREAM_PREFIX", "shoal"),
            default_partitions=int(env.get("SHOAL_DEFAULT_PARTITIONS", "1")),
            max_body_bytes=int(env.get("SHOAL_MAX_BODY_BYTES", str(6 * 1024 * 1024))),
            faults=parse_faults(env.get("SHOAL_FAULTS", "")),
            crash_at=env.get("SHOAL_CRASH_AT", ""),
            delivery=DeliverySettings.from_env(env),
            groups=GroupSettings.from_env(env),
            push=PushSettings.from_env(env),
            seal_grace_s=float(env["SHOAL_SEAL_GRACE_S"])
            if env.get("SHOAL_SEAL_GRACE_S")
            else None,
            push_loopback_http=_on_loopback(env.get("AWS_ENDPOINT_URL", "")),
            connections_endpoint=env.get("SHOAL_CONNECTIONS_ENDPOINT", ""),
            jwt_issuer=env.get("SHOAL_JWT_ISSUER", ""),
            jwt_audiences=tuple(
                a.strip() for a in env.get("SHOAL_JWT_AUDIENCE", "").split(",") if a.strip()
            ),
            jwks_url=env.get("SHOAL_JWKS_URL", ""),
            enhanced_fan_out=parse_fan_out(env.get(FAN_OUT_ENV, "")),
            census_every_s=int(env.get("SHOAL_CENSUS_EVERY_S", "60")),
        )


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` (a URL's host name) is this machine: ``localhost`` or a loopback
    address."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address((host or "").strip("[]")).is_loopback
    except ValueError:
        return False


def _on_loopback(url: str) -> bool:
    return bool(url) and is_loopback(urlsplit(url).hostname)


def parse_faults(raw: str) -> dict[str, float]:
    """``router=0.25,seed=7`` -> {"router": 0.25, "seed": 7.0} (``seed``: the random source's,
    for a reproducible run); a malformed entry is an error at start, not a disabled switch."""
    faults: dict[str, float] = {}
    for part in raw.split(","):
        if not part.strip():
            continue
        name, sep, value = (p.strip() for p in part.partition("="))
        try:
            number = float(value) if sep else -1.0
        except ValueError:
            number = -1.0
        valid = number.is_integer() and number >= 0 if name == "seed" else 0.0 <= number <= 1.0
        if not name or not valid:
            raise ValueError(f"SHOAL_FAULTS: {part!r} is not <function>=<probability 0..1>")
        faults[name] = number
    return faults


def parse_fan_out(raw: str) -> frozenset[str]:
    """``router`` -> {"router"}: the mappings that read through a consumer; an unknown name is
    an error at start, not an option silently off."""
    names = frozenset(n.strip() for n in raw.split(",") if n.strip())
    unknown = sorted(names - FAN_OUT_MAPPINGS)
    if unknown:
        raise ValueError(
            f"{FAN_OUT_ENV}: {', '.join(unknown)} cannot read through a consumer "
            f"(known: {', '.join(sorted(FAN_OUT_MAPPINGS))})"
        )
    return names


@cache
def get_config() -> Config:
    """The process's configuration; tests that change the environment call ``cache_clear``."""
    return Config.from_env(os.environ)
