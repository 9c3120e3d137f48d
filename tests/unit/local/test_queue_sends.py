"""A send wakes the poller of its own queue only (``shoal.local.aws.QueueSends``), and the
SQS mappings' pollers wait for sends to their queue (``shoal.local.esm.queues``)."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import boto3
import pytest
from botocore.awsrequest import AWSRequest
from shoal.local.aws import QueueSends, sent_queue
from shoal.local.esm.queues import QueueMapping, QueueMappings

ARN = "arn:aws:sqs:us-east-1:123456789012:{}"


def _body(operation: str, **params: Any) -> bytes:
    """The body botocore sends for an SQS call (its serializer, as the functions' clients)."""
    sqs = boto3.session.Session(
        aws_access_key_id="k", aws_secret_access_key="s", region_name="us-east-1"
    ).client("sqs", endpoint_url="http://127.0.0.1:1")
    captured: list[AWSRequest] = []

    def capture(request: AWSRequest, **_: Any) -> None:
        captured.append(request)
        raise _Sent

    sqs.meta.events.register("before-send.sqs.*", capture)
    with pytest.raises(_Sent):
        getattr(sqs, operation)(**params)
    body = captured[0].body
    return body if isinstance(body, bytes) else str(body).encode()


class _Sent(Exception):
    pass


def test_the_queue_a_send_names_is_read_from_botocores_body_whatever_its_messages_hold() -> None:
    url = "http://127.0.0.1:4566/123456789012/shoal-push.fifo"
    # a message body that holds the member's own text: inside a JSON string its quotes are
    # escaped, so it is never taken for the queue
    lure = '{"QueueUrl": "http://127.0.0.1:4566/123456789012/other"}'
    batch = _body(
        "send_message_batch",
        QueueUrl=url,
        Entries=[{"Id": "1", "MessageBody": lure, "MessageGroupId": "lane-1"}],
    )
    assert json.loads(batch)["QueueUrl"] == url
    assert sent_queue(batch) == "shoal-push.fifo"
    assert sent_queue(_body("send_message", QueueUrl=url + "/", MessageBody=lure)) == (
        "shoal-push.fifo"
    )
    # nothing to read: every poller is woken
    assert sent_queue(b"{}") is None
    assert sent_queue(b'{"QueueUrl": ""}') is None


def _waiter(
    sends: QueueSends, queue: str | None, timeout_s: float
) -> tuple[threading.Thread, list[float]]:
    seen = sends.count_of(queue) if queue is not None else sends.count
    woke: list[float] = []

    def wait() -> None:
        started = time.monotonic()
        sends.wait(seen, timeout_s, queue)
        woke.append(time.monotonic() - started)

    thread = threading.Thread(target=wait)
    thread.start()
    return thread, woke


def test_a_send_wakes_the_waiters_of_its_queue_and_not_the_others() -> None:
    sends = QueueSends()
    push, push_woke = _waiter(sends, "push", 30.0)
    wills, wills_woke = _waiter(sends, "wills", 0.5)
    time.sleep(0.05)
    sends.notify("push")
    push.join(5.0)
    assert push_woke and push_woke[0] < 5.0
    wills.join(5.0)
    # the wills queue's waiter slept its whole timeout: the push queue's send is not its
    assert wills_woke and wills_woke[0] >= 0.45
    assert sends.count_of("push") == 1 and sends.count_of("wills") == 0
    # a send to no queue that can be read, and a stop, wake every waiter
    anyone, anyone_woke = _waiter(sends, "wills", 30.0)
    time.sleep(0.05)
    sends.notify()
    anyone.join(5.0)
    assert anyone_woke and anyone_woke[0] < 5.0
    assert sends.count == 2


class _Counting(QueueMappings):
    """Two SQS mappings whose receives are counted and answer nothing (no AWS)."""

    def __init__(self, sends_to: list[str]) -> None:
        super().__init__(
            boto3.session.Session(
                aws_access_key_id="k", aws_secret_access_key="s", region_name="us-east-1"
            ),
            lambda _name, _event: None,
            idle_wait_s=30.0,
        )
        self.receives: dict[str, int] = {}
        self._mappings = {
            name: QueueMapping(
                name, "arn:aws:lambda:us-east-1:1:function:f", ARN.format(name), 10, 1, False, True
            )
            for name in sends_to
        }

    def sync(self) -> None:  # the mappings are fixed
        return None

    def receive(self, mapping: QueueMapping) -> list[dict[str, Any]]:
        with self._lock:
            self.receives[mapping.queue_name] = self.receives.get(mapping.queue_name, 0) + 1
        return []


def test_a_queues_poller_receives_again_on_a_send_to_its_queue_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from shoal.local.esm import queues

    sends = QueueSends()
    monkeypatch.setattr(queues, "QUEUE_SENDS", sends)
    mappings = _Counting(["push", "wills"])
    mappings.start()
    try:
        for name in ("push", "wills"):
            mappings._start_poller(name)
        deadline = time.monotonic() + 5.0
        while len(mappings.receives) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert mappings.receives == {"push": 1, "wills": 1}
        for _ in range(5):
            sends.notify("push")
            time.sleep(0.02)
        deadline = time.monotonic() + 5.0
        while mappings.receives["push"] < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        # the push queue's poller looked again; the wills queue's slept on (its wait is 30 s)
        assert mappings.receives["push"] >= 2
        assert mappings.receives["wills"] == 1
    finally:
        mappings.stop()
