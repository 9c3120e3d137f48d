"""A process killed in the middle of an exactly-once publish: the retry is answered in seconds.

``SHOAL_CRASH_AT=publish:<step>`` makes ``shoal dev`` exit as under kill -9 at that step: right
after the reservation is written (nothing in the stream yet), or right after the put (the
message in the stream, the reservation not confirmed). The publisher's retry after the restart
must be answered once the reservation's hold runs out (``RESERVATION_HOLD_MS``), not a minute
later, and the message must be in the stream exactly once.
"""

from __future__ import annotations

import time
import urllib.error
from typing import Any

import pytest
from shoal.core.faults import KILLED, PUBLISH_STEPS
from shoal.publish.sequences import RESERVATION_HOLD_MS, publisher_key, sequenced_message_id

from tests.e2e.conftest import DevFactory, DevServer

pytestmark = pytest.mark.e2e

#: what the issue allows from a crash to the answered retry (the hold must fit in it)
BOUND_S = 15.0
MESSAGE = {"topic": "crash/a", "text": "once", "publisher_id": "p1", "publisher_seq": 1}


def publish(dev: DevServer, token: str) -> tuple[int, Any, float | None]:
    """One attempt as a client makes it: the answer, or 0 when the connection failed."""
    try:
        status, body = dev.request("POST", "/v1/messages", token=token, json=MESSAGE, timeout=30)
    except (urllib.error.URLError, ConnectionError) as exc:
        return 0, type(exc).__name__, None
    retry_after = body["error"].get("retry_after_s") if status == 503 else None
    return status, body, retry_after


def copies_in_stream(dev: DevServer, message_id: str) -> int:
    kinesis = dev.aws().client("kinesis")
    count = 0
    for stream in kinesis.list_streams()["StreamNames"]:
        for shard in kinesis.list_shards(StreamName=stream)["Shards"]:
            iterator = kinesis.get_shard_iterator(
                StreamName=stream, ShardId=shard["ShardId"], ShardIteratorType="TRIM_HORIZON"
            )["ShardIterator"]
            records = kinesis.get_records(ShardIterator=iterator, Limit=10_000)["Records"]
            count += sum(r["Data"].count(message_id.encode()) for r in records)
    return count


@pytest.mark.parametrize("step", PUBLISH_STEPS)
def test_a_retry_after_a_crash_is_answered_within_the_bound_exactly_once(
    dev_factory: DevFactory, step: str
) -> None:
    # Given shoal dev set to die at the step, and a publisher numbering its messages
    dev = dev_factory(env={"SHOAL_CRASH_AT": f"publish:{step}"})
    token = dev.token("crasher", publish=["crash/#"])
    # When the publish kills the process at the step
    status, _, _ = publish(dev, token)
    crashed_at = time.monotonic()
    assert status == 0
    assert dev.process is not None and dev.process.wait(30) == KILLED
    # and shoal dev starts again on the same state, as it was
    dev.env = {}
    dev.start()
    # and the publisher retries, coming back when the server says
    hold_end = crashed_at + RESERVATION_HOLD_MS / 1000
    attempts: list[tuple[float, int, float | None]] = []
    while True:
        sent_at = time.monotonic()
        status, body, retry_after = publish(dev, token)
        attempts.append((sent_at, status, retry_after))
        if status in (200, 201) or sent_at - crashed_at > 60:
            break
        assert status in (0, 503), body
        time.sleep(retry_after or 0.2)
    # Then the retry is answered with the message's one id
    assert status in (200, 201), attempts
    expected_id = sequenced_message_id(publisher_key("crasher", "p1"), 1)
    assert body["message_id"] == expected_id
    # and within the bound: the reservation outlives the crash by the hold, no longer (the
    # hold began before the crash, so a retry sent after ``hold_end`` finds it expired)
    assert RESERVATION_HOLD_MS / 1000 + 2.0 < BOUND_S
    assert all(status in (200, 201) for sent_at, status, _ in attempts if sent_at >= hold_end)
    # and each "in flight" answer said when to come back, never past the hold's end
    for sent_at, status, retry_after in attempts:
        if status == 503:
            assert retry_after is not None
            assert sent_at + retry_after <= hold_end + 1.5, attempts
    # and the message is in the stream exactly once, whichever step the crash hit
    assert copies_in_stream(dev, expected_id) == 1
    # and one more retry is a duplicate of the same message
    status, again, _ = publish(dev, token)
    assert (status, again["message_id"], again["duplicate"]) == (200, expected_id, True)
