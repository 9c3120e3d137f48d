"""An emulated account for benchmarks: in-process moto, provisioned from the declarations.

The same set-up as the test fixture, and the same emulator ``shoal dev`` embeds; figures
measured here are Shoal's own work plus moto's (~0.7 ms a call), not AWS latency.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import boto3
from moto import mock_aws
from shoal.aws import clients
from shoal.core.config import get_config
from shoal.local.aws import adapt_moto
from shoal.local.provision import LocalNames, provision
from shoal.local.serialize import serialized_moto

FAKE_ENV = {
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
    "AWS_ACCESS_KEY_ID": "bench",
    "AWS_SECRET_ACCESS_KEY": "bench",
    "AWS_MAX_ATTEMPTS": "1",
    "AWS_ACCOUNT_ID_ENDPOINT_MODE": "disabled",
    "POWERTOOLS_TRACE_DISABLED": "1",
    "POWERTOOLS_LOG_LEVEL": "ERROR",
    "POWERTOOLS_METRICS_NAMESPACE": "Shoal",
    # the handlers' EMF documents are still built, but go to the log (at DEBUG, below the
    # level above) instead of among the bench's own output
    "POWERTOOLS_METRICS_DISABLED": "true",
}


@contextmanager
def emulated_account(default_partitions: int = 4) -> Iterator[boto3.Session]:
    saved = dict(os.environ)
    names = LocalNames.for_deployment(default_partitions=default_partitions)
    os.environ.pop("AWS_ENDPOINT_URL", None)
    os.environ.update(FAKE_ENV | names.environment())
    get_config.cache_clear()
    adapt_moto()
    try:
        with mock_aws(), serialized_moto():
            clients.reset()
            session = boto3.Session(region_name="us-east-1")
            provision(session, names)
            yield session
    finally:
        os.environ.clear()
        os.environ.update(saved)
        get_config.cache_clear()


@dataclass
class CallMeter:
    """AWS calls by "service.Operation", DynamoDB capacity as reported, Kinesis records."""

    calls: dict[str, int] = field(default_factory=dict)
    capacity: float = 0.0
    records: int = 0
    _clients: list[Any] = field(default_factory=list)

    def attach(self, client: Any) -> None:
        """Count one botocore client's calls (botocore's before-call / after-call events)."""
        if any(c is client for c in self._clients):
            return
        self._clients.append(client)
        client.meta.events.register("before-call.*.*", self._before)
        client.meta.events.register("before-parameter-build.kinesis.*", self._records)
        client.meta.events.register("after-call.dynamodb.*", self._after_dynamodb)

    def reset(self) -> None:
        self.calls.clear()
        self.capacity = 0.0
        self.records = 0

    def _before(self, model: Any, **_: Any) -> None:
        key = f"{model.service_model.service_name}.{model.name}"
        self.calls[key] = self.calls.get(key, 0) + 1

    def _records(self, params: dict[str, Any], model: Any, **_: Any) -> None:
        # the API parameters (before-call only sees the serialized request)
        if model.name == "PutRecords":
            self.records += len(params.get("Records", []))
        elif model.name == "PutRecord":
            self.records += 1

    def _after_dynamodb(self, parsed: dict[str, Any], **_: Any) -> None:
        consumed = parsed.get("ConsumedCapacity")
        for entry in consumed if isinstance(consumed, list) else [consumed] if consumed else []:
            self.capacity += float(entry.get("CapacityUnits", 0))


def item_size(item: dict[str, Any]) -> int:
    """DynamoDB's size of an item in its wire form (names plus values), for capacity units."""

    def value(v: dict[str, Any]) -> int:
        ((kind, raw),) = v.items()
        if kind == "S":
            return len(raw.encode())
        if kind == "B":
            return len(raw)
        if kind == "N":
            return math.ceil(len(raw.lstrip("-").replace(".", "")) / 2) + 1
        if kind in ("BOOL", "NULL"):
            return 1
        if kind == "M":
            return 3 + sum(len(k.encode()) + value(x) + 1 for k, x in raw.items())
        if kind == "L":
            return 3 + sum(value(x) + 1 for x in raw)
        return len(str(raw))

    return sum(len(k.encode()) + value(v) for k, v in item.items())
