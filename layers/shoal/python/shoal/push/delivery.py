"""The push function: a push tap's batch (MQ) or a retry queue's batch (RQ), told apart by
the stream that sent it.

The MQ consumer (``shoal.push.main_queue``) and the RQ consumer (``shoal.push.retry_queue``)
work a batch key by key (``shoal.push.consumer``); the answer names the lowest record at which
any key stopped, from where Lambda hands the batch back.
"""

from __future__ import annotations

import copy
from typing import Any

from aws_lambda_powertools.utilities.data_classes import KinesisStreamEvent

from shoal.core import metrics
from shoal.core.clock import Clock, SystemClock
from shoal.core.config import Config
from shoal.core.observability import lag
from shoal.delivery.events import PerConsumer, Recording
from shoal.push.consumer import Budget, InRecord
from shoal.push.endpoint import EndpointPolicy, HttpDeliverer
from shoal.push.gate import PushGate
from shoal.push.main_queue import MainQueueConsumer
from shoal.push.model import RQ, parse_queue_stream
from shoal.push.retry_queue import RetryQueueConsumer
from shoal.push.store import push_parts

#: an invocation stops starting deliveries this long before Lambda would end it (a delivery
#: takes up to the connect and read timeouts, then two writes)
SAFETY_MS = 12_000


def parse_event(event: dict[str, Any]) -> tuple[str, list[InRecord]]:
    """The stream name and the records of a Kinesis batch (one shard of one stream)."""
    records: list[InRecord] = []
    stream = ""
    for index, record in enumerate(KinesisStreamEvent(event).records):
        stream = record.event_source_arn.split("/", 1)[1]
        records.append(
            InRecord(
                index=index,
                shard=record.event_id.rsplit(":", 1)[0],
                sequence_number=record.kinesis.sequence_number,
                arrival_ms=int(record.kinesis.approximate_arrival_timestamp * 1000),
                data=record.kinesis.data_as_bytes(),
            )
        )
    return stream, records


class PushConsumer(MainQueueConsumer, RetryQueueConsumer):
    """Delivers push tap batches and retry queue batches."""

    @classmethod
    def from_config(cls, config: Config, clock: Clock | None = None) -> PushConsumer:
        clock = clock or SystemClock()
        subscriptions, key_states, queues = push_parts(config, clock)
        return cls(
            config,
            subscriptions,
            key_states,
            queues,
            HttpDeliverer(EndpointPolicy.from_config(config)),
            clock=clock,
            events=Recording.from_config(config, clock),
            gate=PushGate.from_config(config, clock),
        )

    def handle(self, event: dict[str, Any], remaining_ms: int) -> dict[str, Any]:
        if self.events is not None and self.events.enabled and self._recorders is None:
            return self._recorded(event, remaining_ms)
        stream, records = parse_event(event)
        if not records:
            return {"batchItemFailures": []}
        now = self.clock.now_ms()
        deadline = now + max(remaining_ms - SAFETY_MS, 0)
        budget = Budget(deadline, min(now + int(self.max_hold_s * 1000), deadline))
        queue = parse_queue_stream(self.prefix, stream)
        if queue is None:
            # a tap's lag: one shard's records come in order, the first is the oldest (a retry
            # queue's records wait on purpose, so its age is no lag)
            lag(metrics.PUSH_LAG, now - records[0].arrival_ms)
            failed = self.consume_main(stream, records, budget)
        elif queue[2] == RQ:
            failed = self.consume_retry(queue[0], queue[1], stream, records, budget)
        else:
            failed = None  # no mapping reads a DLQ; nothing to do if one did
        if failed is None:
            return {"batchItemFailures": []}
        return {"batchItemFailures": [{"itemIdentifier": records[failed].sequence_number}]}

    def _recorded(self, event: dict[str, Any], remaining_ms: int) -> dict[str, Any]:
        """``handle`` with delivery events: a copy of the consumer holds this invocation's
        recorders (invocations share the consumer); each subscription's events are one object,
        keyed by the batch (stream, shard, sequence range), written once the batch is done."""
        worker = copy.copy(self)
        recorders = worker._recorders = PerConsumer(self.events or Recording(None))
        answer = worker.handle(event, remaining_ms)
        stream, records = parse_event(event)
        if records:
            first, last = records[0], records[-1]
            batch = f"{stream}/{first.shard}/{first.sequence_number}-{last.sequence_number}"
            recorders.flush(lambda name: f"push/{name}/{batch}")
        return answer
