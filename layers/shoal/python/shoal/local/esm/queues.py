"""Lambda's SQS event source mappings, emulated: ``shoal dev`` receives a queue's messages and
invokes the mapped function in-process (moto keeps the mapping but cannot run a function).

What it copies from Lambda (AWS docs: "Using Lambda with Amazon SQS", "Handling errors for an
SQS event source", "Configuring scaling behavior for SQS event source mappings"):

- Messages are received in batches of up to ``BatchSize`` and handed to the function as
  Lambda's SQS event (``events/pusher_sqs_batch.json``); a batch the function finished is
  deleted from the queue, one it raised on stays (visible again after the visibility timeout,
  or sooner if the function changed it).
- ``FunctionResponseTypes: ["ReportBatchItemFailures"]``: the messages the answer names in
  ``batchItemFailures`` stay and the others are deleted; an answer naming a message not in the
  batch, or not a list, fails the whole batch; an empty or null list is success.
- Batches run side by side, up to ``ScalingConfig.MaximumConcurrency`` (Lambda's default
  without it: as many as the function's concurrency allows; here ``default_concurrency``).
- A FIFO queue hands out a message group's messages in order and never two batches of one
  group at once (moto's receive keeps a group with messages in flight back, as SQS does).
- A disabled mapping is not polled; a deleted one stops.

Not emulated: long polling's own wait (a poller waits for the emulator's next send to its
queue instead, ``shoal.local.aws.QUEUE_SENDS``, or a second for visibility timeouts to run
out), batching windows, and Lambda's gradual scaling of pollers. The queue's messages are in
memory only: a restart of ``shoal dev`` starts them empty
(``shoal.local.aws.TRANSIENT_QUEUE_ACTIONS``).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import boto3

from shoal.core.observability import logger
from shoal.local.aws import QUEUE_SENDS
from shoal.local.context import REGION
from shoal.local.esm.config import function_name_of
from shoal.local.esm.invocation import Invoke

#: SQS hands out at most ten messages a receive
MAX_RECEIVE = 10


@dataclass(frozen=True)
class QueueMapping:
    """One SQS mapping as ListEventSourceMappings shows it."""

    uuid: str
    function_arn: str
    queue_arn: str
    batch_size: int
    #: batches of the mapping in flight at once
    concurrency: int
    report_item_failures: bool
    enabled: bool

    @property
    def queue_url(self) -> str:
        _, _, _, region, account, name = self.queue_arn.split(":", 5)
        return f"https://sqs.{region}.amazonaws.com/{account}/{name}"

    @property
    def queue_name(self) -> str:
        """What a send to this queue wakes (``shoal.local.aws.sent_queue``)."""
        return self.queue_arn.rsplit(":", 1)[-1]

    @property
    def function_name(self) -> str:
        return function_name_of(self.function_arn)

    @classmethod
    def from_api(cls, raw: dict[str, Any], default_concurrency: int) -> QueueMapping | None:
        """None when the mapping's source is not a queue (``shoal.local.esm.mappings`` has
        the streams')."""
        source = str(raw.get("EventSourceArn", ""))
        if not source.startswith("arn:") or source.split(":")[2] != "sqs":
            return None
        scaling = (raw.get("ScalingConfig") or {}).get("MaximumConcurrency")
        return cls(
            uuid=str(raw["UUID"]),
            function_arn=str(raw["FunctionArn"]),
            queue_arn=source,
            batch_size=max(1, min(int(raw.get("BatchSize") or MAX_RECEIVE), MAX_RECEIVE)),
            concurrency=int(scaling) if scaling else default_concurrency,
            report_item_failures="ReportBatchItemFailures"
            in (raw.get("FunctionResponseTypes") or []),
            enabled=(raw.get("State") or "Enabled") in ("Enabled", "Enabling", "Updating"),
        )


def sqs_event(mapping: QueueMapping, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """Lambda's event for received messages (ReceiveMessage's answer, all attributes)."""
    return {
        "Records": [
            {
                "messageId": m["MessageId"],
                "receiptHandle": m["ReceiptHandle"],
                "body": m["Body"],
                "attributes": dict(m.get("Attributes") or {}),
                "messageAttributes": dict(m.get("MessageAttributes") or {}),
                "md5OfBody": m.get("MD5OfBody", ""),
                "eventSource": "aws:sqs",
                "eventSourceARN": mapping.queue_arn,
                "awsRegion": REGION,
            }
            for m in messages
        ]
    }


def done_messages(response: Any, ids: list[str], report_item_failures: bool) -> set[str]:
    """The ids of a batch that Lambda deletes after the function answered ``response``."""
    if not report_item_failures or response is None:
        return set(ids)
    if not isinstance(response, dict):
        return set()
    failures = response.get("batchItemFailures")
    if failures is None:
        return set(ids)
    if not isinstance(failures, list):
        return set()
    failed: set[str] = set()
    for item in failures:
        identifier = item.get("itemIdentifier") if isinstance(item, dict) else None
        if not isinstance(identifier, str) or identifier not in ids:
            return set()  # a bad answer fails the whole batch
        failed.add(identifier)
    return set(ids) - failed


class QueueMappings:
    """Every SQS mapping of the emulated account, delivered in-process.

    ``sync()`` reads the mappings; ``run_once()`` receives one batch per mapping and invokes
    the function for it, on the calling thread (tests); ``drain()`` repeats until the queues
    hand out nothing. ``start()`` / ``stop()``: a poller thread per mapping, its batches run
    on a pool, up to the mapping's concurrency at once."""

    def __init__(
        self,
        session: boto3.Session,
        invoke: Invoke,
        *,
        endpoint_url: str | None = None,
        default_concurrency: int = 8,
        sync_interval_s: float = 1.0,
        idle_wait_s: float = 1.0,
        join_timeout_s: float = 10.0,
    ) -> None:
        self._invoke = invoke
        # typed loosely: the queue's answers are read as plain dicts, as the events carry them
        self._lambda: Any = session.client("lambda", endpoint_url=endpoint_url)
        self._sqs: Any = session.client("sqs", endpoint_url=endpoint_url)
        self.default_concurrency = default_concurrency
        self.sync_interval_s = sync_interval_s
        self.idle_wait_s = idle_wait_s
        self._join_timeout_s = join_timeout_s
        self._lock = threading.Lock()
        self._mappings: dict[str, QueueMapping] = {}
        self._pollers: dict[str, threading.Thread] = {}
        self._stopping = threading.Event()
        self._sync_thread: threading.Thread | None = None
        #: batches handed to functions so far, and those that raised (tests read them)
        self.invocations = 0
        self.errors = 0

    # -- the mappings ---------------------------------------------------------------------

    def sync(self) -> None:
        found: dict[str, QueueMapping] = {}
        for page in self._lambda.get_paginator("list_event_source_mappings").paginate():
            for raw in page.get("EventSourceMappings", []):
                mapping = QueueMapping.from_api(raw, self.default_concurrency)
                if mapping is not None:
                    found[mapping.uuid] = mapping
        with self._lock:
            self._mappings = found
            running = self._sync_thread is not None and not self._stopping.is_set()
            for uuid in found:
                if running and uuid not in self._pollers:
                    self._start_poller(uuid)

    def mapping(self, uuid: str) -> QueueMapping | None:
        with self._lock:
            return self._mappings.get(uuid)

    # -- one batch ------------------------------------------------------------------------

    def receive(self, mapping: QueueMapping) -> list[dict[str, Any]]:
        answer = self._sqs.receive_message(
            QueueUrl=mapping.queue_url,
            MaxNumberOfMessages=mapping.batch_size,
            WaitTimeSeconds=0,
            AttributeNames=["All"],
            MessageAttributeNames=["All"],
        )
        messages: list[dict[str, Any]] = answer.get("Messages", [])
        return messages

    def deliver(self, mapping: QueueMapping, messages: list[dict[str, Any]]) -> set[str]:
        """Invokes the function for ``messages`` and deletes what it finished; their ids."""
        self.invocations += 1
        ids = [m["MessageId"] for m in messages]
        try:
            response = self._invoke(mapping.function_name, sqs_event(mapping, messages))
        except Exception as exc:
            # a function error: the batch stays, visible again after its visibility timeout
            self.errors += 1
            logger.info(
                "queue batch failed", extra={"mapping": mapping.uuid, "error": type(exc).__name__}
            )
            return set()
        done = done_messages(response, ids, mapping.report_item_failures)
        entries = [
            {"Id": str(n), "ReceiptHandle": m["ReceiptHandle"]}
            for n, m in enumerate(messages)
            if m["MessageId"] in done
        ]
        if entries:
            self._sqs.delete_message_batch(QueueUrl=mapping.queue_url, Entries=entries)
        return done

    def run_once(self) -> int:
        """One batch per enabled mapping, invoked on this thread; the messages finished."""
        self.sync()
        with self._lock:
            mappings = [m for m in self._mappings.values() if m.enabled]
        finished = 0
        for mapping in mappings:
            messages = self.receive(mapping)
            if messages:
                finished += len(self.deliver(mapping, messages))
        return finished

    def drain_mapping(self, mapping: QueueMapping, max_rounds: int = 1000) -> int:
        """Batches of ``mapping`` (not necessarily one the Lambda API lists: a test's) until
        its queue hands out nothing; the messages finished."""
        finished = 0
        for _ in range(max_rounds):
            messages = self.receive(mapping)
            if not messages:
                break
            finished += len(self.deliver(mapping, messages))
        return finished

    def drain(self, max_rounds: int = 1000) -> int:
        """Rounds until no mapping receives anything; the messages finished."""
        finished = 0
        for _ in range(max_rounds):
            self.sync()
            with self._lock:
                mappings = [m for m in self._mappings.values() if m.enabled]
            moved = False
            for mapping in mappings:
                messages = self.receive(mapping)
                if messages:
                    moved = True
                    finished += len(self.deliver(mapping, messages))
            if not moved:
                break
        return finished

    # -- threads --------------------------------------------------------------------------

    def start(self) -> None:
        if self._sync_thread is not None:
            return
        self._stopping.clear()
        self._sync_thread = threading.Thread(
            target=self._sync_loop, name="shoal-sqs-sync", daemon=True
        )
        self._sync_thread.start()
        self.sync()

    def stop(self) -> None:
        if self._sync_thread is None:
            return
        self._stopping.set()
        QUEUE_SENDS.notify()  # wakes the pollers
        self._sync_thread.join(self._join_timeout_s)
        with self._lock:
            pollers = list(self._pollers.values())
            self._pollers.clear()
        for poller in pollers:
            poller.join(self._join_timeout_s)
        self._sync_thread = None

    def __enter__(self) -> QueueMappings:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def _sync_loop(self) -> None:
        while not self._stopping.wait(self.sync_interval_s):
            try:
                self.sync()
            except Exception:
                logger.exception("queue mapping sync failed")

    def _start_poller(self, uuid: str) -> None:
        thread = threading.Thread(
            target=self._poll, args=(uuid,), name=f"shoal-sqs-{uuid[:8]}", daemon=True
        )
        self._pollers[uuid] = thread
        thread.start()

    def _poll(self, uuid: str) -> None:
        """Receives while there is room for a batch, and waits for a send (or a second, for
        visibility timeouts to run out) when the queue hands out nothing."""
        mapping = self.mapping(uuid)
        if mapping is None:
            return
        slots = threading.BoundedSemaphore(mapping.concurrency)
        with ThreadPoolExecutor(mapping.concurrency, thread_name_prefix="shoal-sqs-batch") as pool:
            while not self._stopping.is_set():
                current = self.mapping(uuid)
                if current is None:
                    return
                if not current.enabled:
                    self._stopping.wait(self.idle_wait_s)
                    continue
                queue = current.queue_name
                seen = QUEUE_SENDS.count_of(queue)
                slots.acquire()
                try:
                    messages = self.receive(current)
                except Exception:
                    slots.release()
                    logger.exception("queue receive failed", extra={"mapping": uuid})
                    self._stopping.wait(self.idle_wait_s)
                    continue
                if not messages:
                    slots.release()
                    QUEUE_SENDS.wait(seen, self.idle_wait_s, queue)
                    continue
                pool.submit(self._run, current, messages, slots)

    def _run(
        self, mapping: QueueMapping, messages: list[dict[str, Any]], slots: threading.Semaphore
    ) -> None:
        try:
            self.deliver(mapping, messages)
        except Exception:
            logger.exception("queue batch's delete failed", extra={"mapping": mapping.uuid})
        finally:
            slots.release()
            # a finished batch may free a FIFO group of its queue: look again without waiting
            # for a send
            QUEUE_SENDS.notify(mapping.queue_name)
