"""Kinesis event source mappings as the Lambda API describes them, with Lambda's defaults."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, cast

from shoal.core.observability import logger
from shoal.local.checkpoints import Position, PositionKind

ACTIVE_STATES = frozenset({"Creating", "Enabling", "Enabled", "Updating"})
#: how long a shard of a mapping on an enhanced fan-out consumer waits for records, idle: Kinesis
#: pushes a consumer's records over SubscribeToShard "typically an average of 70 ms" after
#: they arrive (its developer guide), where Lambda polls a standard mapping's shard about once
#: a second. Read every 70 ms, a record waits at most that (35 ms on average) here
FAN_OUT_FEED_S = 0.07
STARTING_POSITIONS = frozenset({"TRIM_HORIZON", "LATEST", "AT_TIMESTAMP"})


def stream_name_of(stream_arn: str) -> str:
    """``arn:aws:kinesis:r:a:stream/NAME`` -> NAME."""
    return stream_arn.split(":", 5)[5].split("/")[1]


def function_name_of(function_arn: str) -> str:
    """``arn:aws:lambda:r:a:function:NAME[:qualifier]`` -> NAME (a bare name is returned as is)."""
    parts = function_arn.split(":")
    return parts[6] if len(parts) >= 7 and parts[5] == "function" else function_arn


@dataclass(frozen=True)
class MappingConfig:
    """One Kinesis event source mapping, with Lambda's defaults filled in."""

    uuid: str
    function_arn: str
    stream_arn: str
    state: str
    starting_position: Position
    batch_size: int = 100
    batching_window_s: float = 0.0
    report_item_failures: bool = False
    bisect_on_error: bool = False
    max_retry_attempts: int = -1
    max_record_age_s: int = -1
    parallelization_factor: int = 1
    on_failure: str | None = None
    #: the mapping reads through an enhanced fan-out consumer of its stream (its source is
    #: the consumer's ARN): records are pushed to it, not polled (``FAN_OUT_FEED_S``)
    fan_out: bool = False

    @property
    def function_name(self) -> str:
        return function_name_of(self.function_arn)

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES

    @classmethod
    def from_api(cls, raw: dict[str, Any]) -> MappingConfig | None:
        """A mapping from ListEventSourceMappings; None when its source is not a Kinesis stream."""
        source = raw.get("EventSourceArn", "")
        if not source.startswith("arn:") or source.split(":")[2] != "kinesis":
            return None
        # A consumer ARN (enhanced fan-out) reads the same records as its stream, sooner.
        stream_arn, consumer, _ = source.partition("/consumer/")
        position = raw.get("StartingPosition") or "TRIM_HORIZON"
        raw_stamp = raw.get("StartingPositionTimestamp")
        stamp: float | None = None
        if isinstance(raw_stamp, datetime):
            stamp = raw_stamp.timestamp()
        elif isinstance(raw_stamp, int | float | str):
            stamp = float(raw_stamp)
        if position not in STARTING_POSITIONS or (position == "AT_TIMESTAMP" and stamp is None):
            # Lambda refuses such a mapping; one that slipped into moto is left alone.
            logger.error("unusable event source mapping", extra={"mapping": raw.get("UUID")})
            return None
        start = Position(
            cast(PositionKind, position), timestamp=stamp if position == "AT_TIMESTAMP" else None
        )
        destination = (raw.get("DestinationConfig") or {}).get("OnFailure", {}).get("Destination")

        def number(key: str, default: int) -> int:
            value = raw.get(key)
            return default if value is None else int(value)

        return cls(
            uuid=raw["UUID"],
            function_arn=raw["FunctionArn"],
            stream_arn=stream_arn,
            state=raw.get("State") or "Enabled",
            starting_position=start,
            batch_size=max(1, number("BatchSize", 100)),
            batching_window_s=float(raw.get("MaximumBatchingWindowInSeconds") or 0),
            report_item_failures="ReportBatchItemFailures"
            in (raw.get("FunctionResponseTypes") or []),
            bisect_on_error=bool(raw.get("BisectBatchOnFunctionError")),
            max_retry_attempts=number("MaximumRetryAttempts", -1),
            max_record_age_s=number("MaximumRecordAgeInSeconds", -1),
            parallelization_factor=min(10, max(1, number("ParallelizationFactor", 1))),
            on_failure=destination or None,
            fan_out=bool(consumer),
        )


def moto_starting_timestamp(raw: dict[str, Any]) -> float | None:
    """An AT_TIMESTAMP mapping's time, which moto keeps but leaves out of its answers.

    Read from moto's backend in this process (``mock_aws`` and the embedded server both run
    here); None when that backend is not at hand, and the mapping is then left alone.
    """
    # imported here: moto is the emulator of shoal dev, and only such a mapping reads its backend
    try:
        from moto.awslambda.models import lambda_backends
        from moto.awslambda_simple.models import lambda_simple_backends
    except ImportError:  # pragma: no cover - moto is a dependency of the local runtime
        return None
    parts = str(raw.get("EventSourceMappingArn", "")).split(":")
    if len(parts) < 7:
        return None
    region, account = parts[3], parts[4]
    for backends in (lambda_backends, lambda_simple_backends):
        mapping = backends[account][region].get_event_source_mapping(raw["UUID"])
        stamp = getattr(mapping, "starting_position_timestamp", None)
        if isinstance(stamp, datetime):
            return stamp.timestamp()
        if isinstance(stamp, int | float | str):
            return float(stamp)
    return None
