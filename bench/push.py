"""Push subscriptions: delivery throughput, retry latency against the backoff, AWS calls.

Everything runs against in-process moto and a real HTTP endpoint on loopback (a threaded
``http.server`` answering 204, or 503 on demand), through the requests-based deliverer.

- **Throughput**: one push tap invocation (a batch of 100 storage records of one shard, one
  message each, over 50 ordering keys), timed around ``PushConsumer.handle``, for several
  ``parallelism`` values: messages per second per shard invocation.
- **Retry latency**: the endpoint fails the first three attempts of every message; the event
  source mapping emulator runs in background threads with the real clock and ``shoal dev``'s
  0.5 s poll. For each retry stage, the gap between a failed attempt and the next one against
  the backoff the policy drew for it (initial 0.5 s, multiplier 2): what the RQ machinery adds.
- **AWS calls per delivered message** made by the push function (DynamoDB, Kinesis), for 1,000
  messages over 50 keys published in batches, with 0% and 10% of endpoint calls failing; the
  pipeline runs synchronously on a manual clock, so backoffs cost no time.
"""

from __future__ import annotations

import itertools
import random
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from unittest import mock

import boto3
from shoal.aws import tables
from shoal.aws.dynamo import Dynamo
from shoal.aws.kinesis import Streams
from shoal.composite.directory import TopicDirectory
from shoal.composite.service import TopicService, ensure_default_topic
from shoal.composite.store import TopicStore
from shoal.core.auth import Principal
from shoal.core.clock import Clock, ManualClock, SystemClock
from shoal.core.config import get_config
from shoal.local.esm.invocation import StreamRecord, kinesis_event
from shoal.local.esm.mappings import EventSourceMappings
from shoal.publish.request import PublishRequest
from shoal.publish.retained import RetainedStore
from shoal.publish.sequences import Sequences
from shoal.publish.service import PublishService
from shoal.push.admin import PushAdmin
from shoal.push.api import CreateRequest
from shoal.push.delivery import PushConsumer
from shoal.push.endpoint import EndpointPolicy, HttpDeliverer
from shoal.push.model import RetryPolicy
from shoal.push.queues import Queues
from shoal.push.store import KeyStore, PushSubscriptionStore

from bench.account import CallMeter, emulated_account

PUBLISHER = Principal.from_claims({"sub": "bench", "shoal:publish": "[#]"})
KEYS = [f"key-{n}" for n in range(50)]
PARALLELISM = (1, 4, 10)
LATENCY_POLICY: dict[str, Any] = {"initial_backoff_s": 0.5, "max_backoff_s": 4, "multiplier": 2}
FAILED_ATTEMPTS = 3


class Endpoint:
    """Answers 204; 503 for a share of calls, or for the first attempts of each message."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.failure_rate = 0.0
        self.fail_first = 0
        self.rng = random.Random(11)
        #: message id -> [(attempt, monotonic arrival)]
        self.arrivals: dict[str, list[tuple[int, float]]] = defaultdict(list)
        self.calls = 0
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                message_id = self.headers["Shoal-Message-Id"]
                attempt = int(self.headers["Shoal-Attempt"])
                with endpoint.lock:
                    endpoint.calls += 1
                    endpoint.arrivals[message_id].append((attempt, time.monotonic()))
                    fail = attempt <= endpoint.fail_first or (
                        endpoint.rng.random() < endpoint.failure_rate
                    )
                self.send_response(503 if fail else 204)
                self.end_headers()

            def log_message(self, *_: Any) -> None:
                return

        class Server(ThreadingHTTPServer):
            # the default listen backlog (5) drops connections of ten parallel deliverers
            request_queue_size = 128

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/push"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class Pipeline:
    """Topic, publisher, push admin and consumer over the emulated account."""

    def __init__(self, session: boto3.Session, clock: Clock, endpoint: Endpoint) -> None:
        self.session = session
        self.clock = clock
        self.config = get_config()
        self.streams = Streams(session.client("kinesis"), session.client("lambda"), clock)
        store = TopicStore.from_config(self.config)
        ensure_default_topic(TopicService(self.config, store, self.streams, clock), 1)
        self.publisher = PublishService(
            self.streams,
            TopicDirectory(store, clock),
            Sequences.from_config(self.config),
            RetainedStore.from_config(self.config),
            clock,
        )
        self.queues = Queues(self.streams, clock)
        #: the push stores' own client: the meter counts their calls only
        self.dynamo = Dynamo(session.client("dynamodb"))
        local = EndpointPolicy(allow_loopback_http=True)
        self.admin = PushAdmin(
            self.config,
            PushSubscriptionStore(self.dynamo, self.config.table(tables.PUSH_SUBSCRIPTIONS), clock),
            KeyStore(self.dynamo, self.config.table(tables.PUSH_GROUPS)),
            self.queues,
            clock=clock,
            endpoints=local,
        )
        self.consumer = PushConsumer(
            self.config,
            PushSubscriptionStore(self.dynamo, self.config.table(tables.PUSH_SUBSCRIPTIONS), clock),
            KeyStore(self.dynamo, self.config.table(tables.PUSH_GROUPS)),
            self.queues,
            HttpDeliverer(local),
            clock=clock,
        )
        self.endpoint = endpoint

    def subscribe(self, name: str, **fields: Any) -> None:
        body = {"name": name, "filter": "bench/#", "endpoint": self.endpoint.url} | fields
        self.admin.create(CreateRequest.model_validate(body))

    def publish_singles(self, count: int) -> None:
        for n in range(count):
            self.publisher.publish(
                PUBLISHER,
                PublishRequest(topic="bench/x", text="x" * 256, ordering_key=KEYS[n % 50]),
            )

    def publish_batches(self, count: int) -> None:
        for start in range(0, count, 100):
            self.publisher.publish_batch(
                PUBLISHER,
                [
                    {"topic": "bench/x", "text": "x" * 256, "ordering_key": KEYS[n % 50]}
                    for n in range(start, min(start + 100, count))
                ],
            )

    def tap_events(self, per_batch: int = 100) -> list[dict[str, Any]]:
        """The events Lambda would send for the default topic's shard, ``per_batch`` each."""
        kinesis = self.session.client("kinesis")
        stream = "shoal-default-0"
        shard = kinesis.list_shards(StreamName=stream)["Shards"][0]["ShardId"]
        iterator = kinesis.get_shard_iterator(
            StreamName=stream, ShardId=shard, ShardIteratorType="TRIM_HORIZON"
        )["ShardIterator"]
        raw = kinesis.get_records(ShardIterator=iterator, Limit=10_000)["Records"]
        return stream_events(kinesis, stream, shard, raw, per_batch)

    def meter(self) -> CallMeter:
        meter = CallMeter()
        for client in (self.streams.kinesis, self.streams.writer, self.streams.awslambda):
            meter.attach(client)
        meter.attach(self.dynamo.client)
        return meter


@contextmanager
def _moto_time(clock: Clock) -> Iterator[None]:
    """moto stamps Kinesis arrivals by the given clock (a manual one moves with the test)."""

    def now() -> datetime:
        return datetime.fromtimestamp(clock.now_ms() / 1000, UTC).replace(tzinfo=None)

    with mock.patch("moto.kinesis.models.utcnow", now):
        yield


# -- throughput -----------------------------------------------------------------------------


def _throughput(parallelism: int, endpoint: Endpoint) -> dict[str, Any]:
    with emulated_account(default_partitions=1) as session:
        clock = SystemClock()
        pipeline = Pipeline(session, clock, endpoint)
        pipeline.subscribe("bench", parallelism=parallelism)
        pipeline.publish_singles(500)
        events = pipeline.tap_events(100)
        pipeline.consumer.handle(events[0], 120_000)  # warm-up: clients, connections
        delivered = endpoint.calls
        started = time.perf_counter()
        for event in events[1:]:
            assert pipeline.consumer.handle(event, 120_000) == {"batchItemFailures": []}
        elapsed = time.perf_counter() - started
        messages = endpoint.calls - delivered
    return {
        "parallelism": parallelism,
        "invocations": len(events) - 1,
        "messages": messages,
        "messages_per_s": round(messages / elapsed, 1),
        "ms_per_invocation": round(elapsed * 1000 / (len(events) - 1), 1),
    }


# -- retry latency --------------------------------------------------------------------------


def _retry_latency(endpoint: Endpoint) -> dict[str, Any]:
    endpoint.fail_first = FAILED_ATTEMPTS
    policy = RetryPolicy(max_attempts=10, **LATENCY_POLICY)
    try:
        with emulated_account(default_partitions=1) as session:
            clock = SystemClock()
            pipeline = Pipeline(session, clock, endpoint)
            pipeline.subscribe(
                "latency", parallelism=4, retry={"max_attempts": 10, **LATENCY_POLICY}
            )

            def invoke(name: str, event: dict[str, Any]) -> Any:
                if name != pipeline.config.functions["push"]:
                    return None
                return pipeline.consumer.handle(event, 120_000)

            mappings = EventSourceMappings(session, invoke, clock, poll_interval_s=0.5)
            mappings.start()
            try:
                before = set(endpoint.arrivals)
                pipeline.publish_singles(20)
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    with endpoint.lock:
                        done = [
                            a
                            for m, a in endpoint.arrivals.items()
                            if m not in before and len(a) > FAILED_ATTEMPTS
                        ]
                    if len(done) >= 20:
                        break
                    time.sleep(0.2)
            finally:
                mappings.stop()
    finally:
        endpoint.fail_first = 0
    stages: dict[int, list[tuple[float, float]]] = defaultdict(list)
    with endpoint.lock:
        for message_id, arrivals in endpoint.arrivals.items():
            if message_id in before:
                continue
            ordered = sorted(arrivals)
            for (attempt, at), (_, following) in itertools.pairwise(ordered):
                backoff = policy.backoff_ms(attempt, message_id) / 1000
                stages[attempt].append((following - at, backoff))
    return {
        str(stage): {
            "samples": len(pairs),
            "mean_backoff_s": round(statistics.mean(b for _, b in pairs), 3),
            "mean_gap_s": round(statistics.mean(g for g, _ in pairs), 3),
            "mean_added_s": round(statistics.mean(g - b for g, b in pairs), 3),
            "max_added_s": round(max(g - b for g, b in pairs), 3),
        }
        for stage, pairs in sorted(stages.items())
    }


# -- AWS calls per delivered message --------------------------------------------------------


def _calls(failure_rate: float, endpoint: Endpoint) -> dict[str, Any]:
    endpoint.failure_rate = failure_rate
    try:
        with emulated_account(default_partitions=1) as session:
            clock = ManualClock(SystemClock().now_ms())
            with _moto_time(clock):
                pipeline = Pipeline(session, clock, endpoint)
                pipeline.subscribe(
                    "calls",
                    parallelism=4,
                    retry={"max_attempts": 100, "initial_backoff_s": 1, "max_backoff_s": 5},
                )

                def invoke(name: str, event: dict[str, Any]) -> Any:
                    if name != pipeline.config.functions["push"]:
                        return None
                    return pipeline.consumer.handle(event, 120_000)

                mappings = EventSourceMappings(session, invoke, clock)
                pipeline.publish_batches(1000)
                meter = pipeline.meter()
                start_calls = endpoint.calls
                for _ in range(500):
                    mappings.sync()
                    if not mappings.drain(max_rounds=50):
                        break
                http_calls = endpoint.calls - start_calls
    finally:
        endpoint.failure_rate = 0.0
    total = sum(meter.calls.values())
    return {
        "failure_rate": failure_rate,
        "messages": 1000,
        "http_calls": http_calls,
        "aws_calls_per_message": round(total / 1000, 3),
        "calls_per_message": {k: round(v / 1000, 3) for k, v in sorted(meter.calls.items())},
        "kinesis_records_per_message": round(meter.records / 1000, 3),
    }


def run() -> dict[str, Any]:
    endpoint = Endpoint()
    try:
        return {
            "throughput": [_throughput(p, endpoint) for p in PARALLELISM],
            "retry_latency": _retry_latency(endpoint),
            "calls": [_calls(rate, endpoint) for rate in (0.0, 0.1)],
        }
    finally:
        endpoint.close()


def report(figures: dict[str, Any]) -> str:
    lines = [
        "## Push subscriptions",
        "",
        "In-process moto, a real HTTP endpoint on loopback (requests-based deliverer). See",
        "`bench/push.py` for the set-up.",
        "",
        "Throughput of one push tap invocation (100 storage records of one shard, one message",
        "each, 50 ordering keys):",
        "",
        "| parallelism | invocations | msg/s per invocation | ms/invocation |",
        "|---|---|---|---|",
    ]
    for t in figures["throughput"]:
        lines.append(
            f"| {t['parallelism']} | {t['invocations']} | {t['messages_per_s']} "
            f"| {t['ms_per_invocation']} |"
        )
    lines += [
        "",
        f"Retry stages (every message fails {FAILED_ATTEMPTS} times; backoff initial 0.5 s, "
        "x2, jitter to [b/2, b]; emulator poll 0.5 s):",
        "",
        "| after attempt | samples | mean backoff s | mean gap s | mean added s | max added s |",
        "|---|---|---|---|---|---|",
    ]
    for stage, s in figures["retry_latency"].items():
        lines.append(
            f"| {stage} | {s['samples']} | {s['mean_backoff_s']} | {s['mean_gap_s']} "
            f"| {s['mean_added_s']} | {s['max_added_s']} |"
        )
    lines += [
        "",
        "AWS calls the push function makes per delivered message (1,000 messages, 50 keys,",
        "published in batches of 100):",
        "",
        "| endpoint failures | HTTP calls | AWS calls/msg | Kinesis records/msg | by operation |",
        "|---|---|---|---|---|",
    ]
    for c in figures["calls"]:
        ops = ", ".join(f"{k} {v}" for k, v in c["calls_per_message"].items())
        lines.append(
            f"| {round(c['failure_rate'] * 100)}% | {c['http_calls']} "
            f"| {c['aws_calls_per_message']} | {c['kinesis_records_per_message']} | {ops} |"
        )
    lines += [
        "",
        "The first retry stage pays the retry queue's poll (the entry must be read from RQ);",
        "later stages wait inside the invocation that holds the key, so they add only the",
        "write and the call. At 0% failures the function reads the tap's members, their group",
        "states (one BatchGetItem per 100 keys) and moves each member's cursor once per batch;",
        "a failure adds a conditional write and a PutRecord per message routed to RQ, and a",
        "write per retry.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(run()))


def stream_events(
    kinesis: Any, stream: str, shard: str, raw: list[Any], per_batch: int
) -> list[dict[str, Any]]:
    """The events Lambda would send for ``raw`` (GetRecords' records of one shard),
    ``per_batch`` records each."""
    records = [StreamRecord.from_get_records(dict(r)) for r in raw]
    arn = kinesis.describe_stream_summary(StreamName=stream)["StreamDescriptionSummary"][
        "StreamARN"
    ]
    return [
        kinesis_event(
            records[i : i + per_batch],
            shard_id=shard,
            stream_arn=arn,
            region="us-east-1",
            role_arn="arn:aws:iam::123456789012:role/bench",
        )
        for i in range(0, len(records), per_batch)
    ]
