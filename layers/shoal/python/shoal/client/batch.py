"""Batching publishes by count, bytes and delay, as Google Pub/Sub's publisher does.

    with client.batch_publisher(BatchSettings(max_messages=100, max_latency_s=0.01)) as pub:
        futures = [pub.publish("sensors/1/temp", text=str(t)) for t in readings]
    results = [f.result() for f in futures]

``publish`` queues the message and returns a ``Future``. One thread of the publisher sends: it
takes what is queued once a batch is full (``max_messages`` or ``max_bytes``) or its first
message has waited ``max_latency_s``, and hands it to ``ShoalClient.publish_many``, which
numbers the messages, writes them to the state file in one write and sends them as
``POST /v1/messages:batch``. One batch is in flight at a time and batches go in queue order, so
every ordering key keeps its publish order and the publisher's sequence stays consecutive (the
server's exactly-once check needs seq = last + 1). ``publish`` blocks while ``max_queued``
messages wait (flow control), so a fast producer cannot fill memory.

When a batch cannot be sent (``Unavailable``), its futures and every later one fail with that
error, and the messages stay in flight in the state file: the next publish on that state sends
them first, with their own seqs.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

from shoal.client.errors import ApiError, ClientError
from shoal.client.support import BatchSettings, PublishResult


class BatchingClient(Protocol):
    """What a ``BatchPublisher`` needs of ``shoal.client.http.ShoalClient`` (a protocol, so
    the client can make publishers without the two modules importing each other)."""

    @property
    def requests_sent(self) -> int: ...

    @property
    def message_body(self) -> Callable[..., dict[str, Any]]:
        """A message's request body from ``publish``'s arguments."""
        ...

    def publish_many(
        self, bodies: Sequence[Mapping[str, Any]], settings: BatchSettings | None = None
    ) -> list[PublishResult | ApiError]: ...


class PublisherClosed(ClientError):
    """``publish`` after ``close``, or after a batch could not be sent."""


class BatchPublisher:
    def __init__(self, client: BatchingClient, settings: BatchSettings) -> None:
        self.client = client
        self.settings = settings
        self._queue: deque[tuple[dict[str, Any], Future[PublishResult], float]] = deque()
        self._bytes = 0
        self._changed = threading.Condition()
        self._closing = False
        self._failed: BaseException | None = None
        #: requests sent and messages settled (for the bench and the CLI's summary)
        self.requests = 0
        self.messages = 0
        self._thread = threading.Thread(target=self._run, name="shoal-publisher", daemon=True)
        self._thread.start()

    def __enter__(self) -> BatchPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def publish(self, topic: str, **message: Any) -> Future[PublishResult]:
        """Queue one message (the arguments of ``ShoalClient.publish``); its future."""
        return self.publish_body(self.client.message_body(topic, **message))

    def publish_body(self, body: Mapping[str, Any]) -> Future[PublishResult]:
        future: Future[PublishResult] = Future()
        weight = len(str(body.get("payload") or body.get("text") or "")) + len(body["topic"])
        with self._changed:
            while len(self._queue) >= self.settings.max_queued and not self._stopped():
                self._changed.wait()
            if self._stopped():
                raise PublisherClosed(
                    "the publisher is closed" if self._failed is None else str(self._failed)
                )
            self._queue.append((dict(body), future, time.monotonic()))
            self._bytes += weight
            self._changed.notify_all()
        return future

    @property
    def failure(self) -> BaseException | None:
        """Why the publisher stopped early (a batch that could not be sent), if it did."""
        return self._failed

    def _stopped(self) -> bool:
        return self._closing or self._failed is not None

    def flush(self) -> None:
        """Wait until everything queued so far is settled."""
        with self._changed:
            last = self._queue[-1][1] if self._queue else None
        if last is not None:
            last.exception()  # waits; the outcome itself is the caller's

    def close(self) -> None:
        """Send what is queued, then stop the thread."""
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        self._thread.join()

    # -- the sending thread --

    def _take(self) -> list[tuple[dict[str, Any], Future[PublishResult], float]] | None:
        """The next batch, once it is full, due or the publisher closes; None at the end."""
        settings = self.settings
        with self._changed:
            while True:
                if self._queue:
                    due = self._queue[0][2] + settings.max_latency_s
                    full = (
                        len(self._queue) >= settings.max_messages
                        or self._bytes >= settings.max_bytes
                    )
                    wait_s = due - time.monotonic()
                    if full or self._closing or wait_s <= 0:
                        break
                    self._changed.wait(wait_s)
                elif self._closing:
                    return None
                else:
                    self._changed.wait()
            batch: list[tuple[dict[str, Any], Future[PublishResult], float]] = []
            size = 0
            while self._queue and len(batch) < settings.max_messages:
                body = self._queue[0][0]
                weight = len(str(body.get("payload") or body.get("text") or "")) + len(
                    body["topic"]
                )
                if batch and size + weight > settings.max_bytes:
                    break
                batch.append(self._queue.popleft())
                size += weight
                self._bytes -= weight
            self._changed.notify_all()
            return batch

    def _run(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            try:
                before = self.client.requests_sent
                outcomes = self.client.publish_many([b for b, _, _ in batch], self.settings)
                self.requests += self.client.requests_sent - before
            except BaseException as exc:  # handed to every waiting future
                self._fail([f for _, f, _ in batch], exc)
                return
            for (_, future, _), outcome in zip(batch, outcomes, strict=True):
                self.messages += 1
                if isinstance(outcome, ApiError):
                    future.set_exception(outcome)
                else:
                    future.set_result(outcome)

    def _fail(self, futures: list[Future[PublishResult]], exc: BaseException) -> None:
        with self._changed:
            self._failed = exc
            rest = [f for _, f, _ in self._queue]
            self._queue.clear()
            self._bytes = 0
            self._changed.notify_all()
        for future in [*futures, *rest]:
            future.set_exception(exc)
