"""The push admin API's request bodies (their fields are checked by the service, for their own
error codes), and the times a seek or a redrive names."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, StrictBool

#: the latest time a seek or redrive accepts (the year 9999)
_MAX_TIME_MS = 253_402_300_799_999


class CreateRequest(BaseModel):
    """POST /v1/subscriptions. Fields are checked by the service, for their own error codes."""

    model_config = ConfigDict(extra="forbid")

    name: Any = None
    filter: Any = None
    endpoint: Any = None
    ordered: StrictBool = True
    retry: Any = None
    parallelism: Any = 1
    #: the composite topic to read; default: the filter's first level when it names one, else
    #: `default` (an extension of API.md: a filter starting with a wildcard reads `default`)
    topic: Any = None


class SeekRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    to_time: Any = None
    to: Any = None


class RedriveRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ordering_keys: Any = None
    message_ids: Any = None
    failed_after: Any = None


class UpdateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    parallelism: Any = None


def parse_time(value: object) -> int | None:
    """Epoch milliseconds, or an ISO 8601 time (naive means UTC); None if neither."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value if 0 <= value <= _MAX_TIME_MS else None
    if isinstance(value, str):
        try:
            moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return None
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=UTC)
        ms = int(moment.timestamp() * 1000)
        return ms if 0 <= ms <= _MAX_TIME_MS else None
    return None
