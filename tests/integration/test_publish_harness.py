"""Shared helpers of the topic, publish and router tests (no tests here).

A ``Harness`` wires the services to the emulated account of the ``aws`` fixture with one
ManualClock that starts at the real time (Kinesis stamps arrivals with the real clock, and a
recovery reads the stream back by time), and installs them into the handler modules.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from typing import Any

import boto3
import pytest
from shoal.aws.dynamo import Dynamo
from shoal.aws.kinesis import Streams
from shoal.aws.tables import TABLES
from shoal.composite.directory import TopicDirectory
from shoal.composite.model import CompositeTopic
from shoal.composite.service import TopicService, ensure_default_topic
from shoal.composite.store import TopicStore
from shoal.core.clock import ManualClock, SystemClock
from shoal.core.config import get_config
from shoal.publish.retained import RetainedStore
from shoal.publish.sequences import Sequences
from shoal.publish.service import PublishService
from shoal.push.admin import TapHooks
from shoal.records import Message, decode_record

from tests.helpers import FakeContext, http_event, response_json

ADMIN = {"sub": "ops", "shoal:admin": "true"}
ALICE = {"sub": "alice", "shoal:publish": "[orders/# sensors/+/temp other/# #]"}


class Crash(BaseException):
    """A process dying mid-request: nothing after the injection point runs (not even
    ``except Exception`` handlers), as when Lambda kills an invocation."""


class Harness:
    def __init__(self, session: boto3.Session) -> None:
        self.session = session
        self.clock = ManualClock(SystemClock().now_ms())
        self.config = get_config()
        self.streams = Streams(session.client("kinesis"), session.client("lambda"), self.clock)
        self.dynamo = Dynamo(session.client("dynamodb"))
        self.store = TopicStore(self.dynamo, self.config.table("topics"))
        self.topics = TopicService(
            self.config,
            self.store,
            self.streams,
            self.clock,
            hooks=TapHooks(self.config, self.streams, self.clock),
        )
        self.publish = self.publisher()
        self._readers: dict[str, Any] = {}

    def catch_up(self) -> None:
        """Move the clock up to the real time, if it fell behind while the account was set up.

        Kinesis stamps a record's arrival with the real clock, and a crashed publish is read
        back in a window of the clock's time: on CI's slow machine the setup took longer than
        a reservation's hold, and the read-back window then ended before the record arrived.
        """
        behind_ms = SystemClock().now_ms() - self.clock.now_ms()
        if behind_ms > 0:
            self.clock.advance(behind_ms / 1000)

    def publisher(
        self, streams: Streams | None = None, dynamo: Dynamo | None = None
    ) -> PublishService:
        """A publish service as a fresh container has it (empty caches)."""
        directory = TopicDirectory(self.store, self.clock)
        return PublishService(
            streams or self.streams,
            directory,
            self.sequences(dynamo),
            self.retained(dynamo),
            self.clock,
        )

    def sequences(self, dynamo: Dynamo | None = None) -> Sequences:
        return Sequences(dynamo or self.dynamo, self.config.table("publishers"))

    def retained(self, dynamo: Dynamo | None = None) -> RetainedStore:
        return RetainedStore(dynamo or self.dynamo, self.config.table("retained"))

    def topic(self, name: str) -> CompositeTopic:
        """The topic as stored (it must exist)."""
        topic = self.store.load(name)
        assert topic is not None, name
        return topic

    def default(self, partitions: int = 1) -> CompositeTopic:
        return ensure_default_topic(self.topics, partitions)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Make the admin and publish handlers use these services."""
        import functions.admin.app as admin_app
        import functions.publish.app as publish_app

        monkeypatch.setattr(admin_app, "service", lambda: self.topics)
        monkeypatch.setattr(publish_app, "service", lambda: self.publish)

    # -- reading the account back -------------------------------------------------------

    def reader(self, service: str) -> Any:
        """One client per service for reading the account back: making a client copies the
        session's event hooks, and a snapshot reads every stream (profiled: most of a test)."""
        if service not in self._readers:
            self._readers[service] = self.session.client(service)  # type: ignore[call-overload]
        return self._readers[service]

    def shards(self, stream: str) -> list[Any]:
        shards = self.reader("kinesis").list_shards(StreamName=stream)["Shards"]
        return sorted(shards, key=lambda s: int(s["HashKeyRange"]["StartingHashKey"]))

    def records(self, stream: str) -> list[tuple[int, Any]]:
        """Every record of the stream as (partition, record), partitions in hash-key order."""
        kinesis = self.reader("kinesis")
        out: list[tuple[int, Any]] = []
        for partition, shard in enumerate(self.shards(stream)):
            iterator = kinesis.get_shard_iterator(
                StreamName=stream, ShardId=shard["ShardId"], ShardIteratorType="TRIM_HORIZON"
            )["ShardIterator"]
            while True:
                response = kinesis.get_records(ShardIterator=iterator, Limit=10_000)
                out += [(partition, r) for r in response["Records"]]
                if not response["Records"]:
                    break
                iterator = response["NextShardIterator"]
        return out

    def messages(self, stream: str) -> list[tuple[int, Message]]:
        """Every message of the stream as (partition, message), in each partition's order."""
        return [(p, m) for p, r in self.records(stream) for m in decode_record(r["Data"])]

    def snapshot(self) -> dict[str, Any]:
        """Everything a request could change: tables, streams, records, mappings, objects."""
        dynamodb = self.reader("dynamodb")
        kinesis = self.reader("kinesis")
        tables = {
            t.logical: sorted(
                json.dumps(i, sort_keys=True)
                for i in dynamodb.scan(TableName=self.config.table(t.logical), ConsistentRead=True)[
                    "Items"
                ]
            )
            for t in TABLES
            if t.logical in self.config.tables
        }
        streams = sorted(kinesis.list_streams()["StreamNames"])
        records = {
            s: [base64.b64encode(r["Data"]).decode() for _, r in self.records(s)] for s in streams
        }
        mappings = sorted(
            m["UUID"]
            for m in self.reader("lambda").list_event_source_mappings()["EventSourceMappings"]
        )
        s3 = self.reader("s3")
        objects = {
            b: sorted(o["Key"] for o in s3.list_objects_v2(Bucket=b).get("Contents", []))
            for b in self.config.buckets.values()
        }
        return {
            "tables": tables,
            "streams": streams,
            "records": records,
            "mappings": mappings,
            "objects": objects,
        }

    def count_calls(self) -> dict[str, int]:
        """Count AWS calls by "service.Operation" from now on (botocore before-call events)."""
        counts: dict[str, int] = {}

        def count(model: Any, **_: Any) -> None:
            key = f"{model.service_model.service_name}.{model.name}"
            counts[key] = counts.get(key, 0) + 1

        for client in (self.streams.kinesis, self.streams.awslambda, self.dynamo.client):
            client.meta.events.register("before-call.*.*", count)
        return counts


def call(handler: Callable[..., dict[str, Any]], event: dict[str, Any]) -> tuple[int, Any]:
    response = handler(event, FakeContext())
    return response["statusCode"], response_json(response)


def admin_call(
    method: str,
    path: str,
    body: Any = None,
    *,
    claims: dict[str, Any] | None = ADMIN,
    raw_body: str | None = None,
) -> tuple[int, Any]:
    from functions.admin.app import handler

    return call(handler, _event(method, path, body, claims, raw_body))


def publish_call(
    body: Any,
    *,
    batch: bool = False,
    claims: dict[str, Any] | None = ALICE,
    raw_body: str | None = None,
) -> tuple[int, Any]:
    from functions.publish.app import handler

    path = "/v1/messages:batch" if batch else "/v1/messages"
    return call(handler, _event("POST", path, body, claims, raw_body))


def _event(
    method: str, path: str, body: Any, claims: dict[str, Any] | None, raw_body: str | None
) -> dict[str, Any]:
    parts = path.strip("/").split("/")
    route, parameters = path, None
    if len(parts) >= 3 and parts[1] == "topics":
        parameters = {"name": parts[2]}
        route = "/".join(["", *parts[:2], "{name}", *parts[3:]])
    return http_event(
        method,
        path,
        body=body,
        raw_body=raw_body,
        claims=claims,
        route_key=f"{method} {route}",
        path_parameters=parameters,
    )
