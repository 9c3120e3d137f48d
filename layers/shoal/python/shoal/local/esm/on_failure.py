"""Discarded batches: the invocation record Lambda sends to a mapping's on-failure destination
(an SQS queue, an SNS topic, or an S3 bucket that also gets the whole event)."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Literal

from shoal.core.clock import Clock
from shoal.core.observability import logger
from shoal.local.esm.invocation import StreamRecord, iso_time, kinesis_event
from shoal.local.esm.shards import Batch, MappingState

Condition = Literal["RetryAttemptsExhausted", "RecordAgeExceeded"]


class OnFailure:
    """Sends discarded batches' invocation records; ``client`` makes an SDK client of a service.

    Its clients have a lock of their own: a shard's step asks for one while it holds its
    mapping's lock, and the mappings' sync takes the mapping locks under the mappings' lock.
    """

    def __init__(self, client: Callable[[str], Any], region: str, clock: Clock) -> None:
        self._client = client
        self.region = region
        self.clock = clock
        self._lock = threading.Lock()
        self._destinations: dict[str, Any] = {}
        self._queue_urls: dict[str, str] = {}

    def send(
        self,
        mapping: MappingState,
        shard_id: str,
        batch: Batch,
        records: list[StreamRecord],
        condition: Condition,
    ) -> None:
        """Send the invocation record of ``records`` (discarded) to the mapping's destination."""
        record = self._record(mapping, shard_id, batch, records, condition)
        self._send(mapping, shard_id, record, records)

    def _record(
        self,
        mapping: MappingState,
        shard_id: str,
        batch: Batch,
        records: list[StreamRecord],
        condition: Condition,
    ) -> dict[str, Any]:
        """The document Lambda sends to an on-failure destination for a discarded batch."""
        config = mapping.config
        response: dict[str, Any] = {"statusCode": 200, "executedVersion": "$LATEST"}
        if batch.function_error:
            response["functionError"] = "Unhandled"
        return {
            "requestContext": {
                "requestId": batch.request_id,
                "functionArn": config.function_arn,
                "condition": condition,
                "approximateInvokeCount": batch.invokes,
            },
            "responseContext": response,
            "version": "1.0",
            "timestamp": iso_time(self.clock.now_ms() / 1000),
            "KinesisBatchInfo": {
                "shardId": shard_id,
                "startSequenceNumber": records[0].sequence_number,
                "endSequenceNumber": records[-1].sequence_number,
                "approximateArrivalOfFirstRecord": iso_time(records[0].arrival),
                "approximateArrivalOfLastRecord": iso_time(records[-1].arrival),
                "batchSize": len(records),
                "streamArn": config.stream_arn,
            },
        }

    def _send(
        self,
        mapping: MappingState,
        shard_id: str,
        record: dict[str, Any],
        records: list[StreamRecord],
    ) -> None:
        destination = mapping.config.on_failure or ""
        service = destination.split(":")[2] if destination.count(":") >= 5 else ""
        if service == "sqs":
            self._destination("sqs").send_message(
                QueueUrl=self._queue_url(destination), MessageBody=json.dumps(record)
            )
        elif service == "sns":
            self._destination("sns").publish(TopicArn=destination, Message=json.dumps(record))
        elif service == "s3":
            bucket = destination.split(":")[5]
            now = datetime.fromtimestamp(self.clock.now_ms() / 1000, UTC)
            key = (
                f"aws/lambda/{mapping.config.uuid}/{shard_id}/{now:%Y/%m/%d}/"
                f"{now:%Y-%m-%dT%H.%M.%S}-{uuid.uuid4()}"
            )
            # Only an S3 destination carries the whole event (the docs: "payload").
            payload = kinesis_event(
                records,
                shard_id=shard_id,
                stream_arn=mapping.config.stream_arn,
                region=self.region,
                role_arn=mapping.role_arn,
            )
            body = {**record, "payload": json.dumps(payload)}
            self._destination("s3").put_object(
                Bucket=bucket, Key=key, Body=json.dumps(body).encode()
            )
        else:
            logger.error(
                "unsupported on-failure destination",
                extra={"mapping": mapping.config.uuid, "destination": destination},
            )

    def _destination(self, service: str) -> Any:
        with self._lock:
            if service not in self._destinations:
                self._destinations[service] = self._client(service)
            return self._destinations[service]

    def _queue_url(self, queue_arn: str) -> str:
        if queue_arn not in self._queue_urls:
            _, _, _, _, account, name = queue_arn.split(":", 5)
            url = self._destination("sqs").get_queue_url(
                QueueName=name, QueueOwnerAWSAccountId=account
            )["QueueUrl"]
            self._queue_urls[queue_arn] = url
        return self._queue_urls[queue_arn]
