"""Push subscriptions over moto, end to end in-process (no tests here).

A ``PushHarness`` wires the topic, publish, push admin and push delivery services to the
emulated account of the ``aws`` fixture, with one ManualClock that moto's Kinesis also stamps
arrivals by, a scripted endpoint (``FakeEndpoint``), and the event source mapping emulator
driving the push function synchronously (``drain``). Waiting for an attempt time advances the
manual clock, so retries with backoff run without sleeping.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import boto3
import pytest
from shoal.aws.dynamo import Dynamo
from shoal.aws.kinesis import Streams
from shoal.composite.directory import TopicDirectory
from shoal.composite.service import TopicService, ensure_default_topic
from shoal.composite.store import TopicStore
from shoal.core.clock import ManualClock, SystemClock
from shoal.core.config import get_config
from shoal.local.esm.invocation import StreamRecord, kinesis_event
from shoal.local.esm.mappings import EventSourceMappings
from shoal.publish.request import PublishRequest
from shoal.publish.retained import RetainedStore
from shoal.publish.sequences import Sequences
from shoal.publish.service import PublishService
from shoal.push.admin import PushAdmin, TapHooks
from shoal.push.api import CreateRequest
from shoal.push.delivery import PushConsumer
from shoal.push.endpoint import EndpointPolicy
from shoal.push.entries import Entry, decode_entry
from shoal.push.queues import Queues
from shoal.push.store import KeyStore, PushSubscriptionStore

from tests.unit.test_push_support import FakeEndpoint

ALICE = {"sub": "alice", "shoal:publish": "[#]"}


class StrictClock(ManualClock):
    """A manual clock that refuses to sleep a negative time, as ``time.sleep`` does."""

    def sleep(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("sleep length must be non-negative")
        super().sleep(seconds)


class PushHarness:
    def __init__(
        self,
        session: boto3.Session,
        monkeypatch: pytest.MonkeyPatch,
        *,
        partitions: int = 1,
    ) -> None:
        self.session = session
        self.clock = StrictClock(SystemClock().now_ms())

        def moto_now() -> datetime:
            return datetime.fromtimestamp(self.clock.now_ms() / 1000, UTC).replace(tzinfo=None)

        monkeypatch.setattr("moto.kinesis.models.utcnow", moto_now)
        self.config = get_config()
        self.streams = Streams(session.client("kinesis"), session.client("lambda"), self.clock)
        self.store = TopicStore(Dynamo(session.client("dynamodb")), self.config.table("topics"))
        self.topics = TopicService(
            self.config,
            self.store,
            self.streams,
            self.clock,
            hooks=TapHooks(self.config, self.streams, self.clock),
            effective_delay_ms=0,
        )
        ensure_default_topic(self.topics, partitions)
        self.publisher = PublishService(
            self.streams,
            TopicDirectory(self.store, self.clock),
            Sequences.from_config(self.config),
            RetainedStore.from_config(self.config),
            self.clock,
        )
        self.endpoint = FakeEndpoint()
        self.queues = Queues(self.streams, self.clock)
        self.admin = PushAdmin(
            self.config,
            PushSubscriptionStore.from_config(self.config, self.clock),
            KeyStore.from_config(self.config),
            self.queues,
            clock=self.clock,
            endpoints=EndpointPolicy(allow_loopback_http=True),
        )
        self.consumer = PushConsumer(
            self.config,
            PushSubscriptionStore.from_config(self.config, self.clock),
            KeyStore.from_config(self.config),
            self.queues,
            self.endpoint,
            clock=self.clock,
        )
        self.invocations: list[tuple[str, dict[str, Any]]] = []
        self.errors: list[Exception] = []
        self.mappings = EventSourceMappings(session, self.invoke, self.clock)

    def invoke(self, function_name: str, event: dict[str, Any]) -> Any:
        if function_name != self.config.functions["push"]:
            return None  # the router: not under test here
        self.invocations.append((function_name, event))
        try:
            return self.consumer.handle(event, 60_000)
        except Exception as exc:
            # the emulator would retry the batch; a test wants to know it happened at all
            self.errors.append(exc)
            raise

    def subscribe(self, name: str = "orders", **fields: Any) -> dict[str, Any]:
        body = {"name": name, "filter": "orders/#", "endpoint": "https://example.com/push"}
        body |= fields
        return self.admin.create(CreateRequest.model_validate(body))

    def publish(self, key: str, n: int, topic: str = "orders/1") -> str:
        """Publish one message (text ``n``) with ordering key ``key``; its message id."""
        from shoal.core.auth import Principal

        _, body = self.publisher.publish(
            Principal.from_claims(ALICE),
            PublishRequest(topic=topic, text=str(n), ordering_key=key),
        )
        return str(body["message_id"])

    def drain_for(self, seconds: float) -> None:
        """Run the mappings until the manual clock moved ``seconds`` or nothing moves."""
        start = self.clock.now_ms()
        idle = 0
        while self.clock.now_ms() - start < seconds * 1000 and idle < 2:
            self.mappings.sync()
            idle = 0 if self.mappings.run_once() else idle + 1

    def main_event(self, stream: str = "shoal-default-0") -> dict[str, Any]:
        """The event Lambda would send for every record of the stream's first shard."""
        kinesis = self.session.client("kinesis")
        shard = kinesis.list_shards(StreamName=stream)["Shards"][0]["ShardId"]
        iterator = kinesis.get_shard_iterator(
            StreamName=stream, ShardId=shard, ShardIteratorType="TRIM_HORIZON"
        )["ShardIterator"]
        records = kinesis.get_records(ShardIterator=iterator, Limit=10_000)["Records"]
        arn = kinesis.describe_stream_summary(StreamName=stream)["StreamDescriptionSummary"][
            "StreamARN"
        ]
        return kinesis_event(
            [StreamRecord.from_get_records(dict(r)) for r in records],
            shard_id=shard,
            stream_arn=arn,
            region="us-east-1",
            role_arn="arn:aws:iam::123456789012:role/shoal-local-lambda",
        )

    def rq_entries(self, name: str = "orders") -> list[Entry]:
        doc = self.admin.describe(name)
        stream = doc["retry_queue"]["storage_topics"][0]["stream"]
        out: list[Entry] = []
        for shard in self.queues.shards(stream):
            out += [decode_entry(r.data) for r in self.queues.scan(stream, shard)]
        return out

    def drain(self, rounds: int = 200) -> None:
        """Run the mappings until nothing moves (each round picks up new mappings first)."""
        for _ in range(rounds):
            self.mappings.sync()
            if not self.mappings.drain(max_rounds=50):
                self.mappings.sync()
                if not self.mappings.drain(max_rounds=50):
                    assert self.errors == [], self.errors
                    return
        raise AssertionError("the push pipeline did not settle")
