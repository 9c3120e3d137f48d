"""Sessions over ``shoal dev``: connect, resume, a stale channel, and a will on keepalive expiry."""

from __future__ import annotations

import time
from typing import Any

import pytest
from shoal.records import decode_record

from tests.e2e.conftest import DevFactory, DevServer

pytestmark = pytest.mark.e2e

#: the reaper runs every second here (``--schedule reaper=1``), not its deployed minute
WILL_WAIT_S = 30.0


def session_call(
    dev: DevServer, method: str, path: str, token: str, channel: str | None = None, **kw: Any
) -> tuple[int, Any]:
    headers = {"Shoal-Channel": channel} if channel else None
    return dev.request(method, f"/v1/sessions/{path}", token=token, headers=headers, **kw)


def test_connect_resume_and_stale_channel(shared_dev: DevServer) -> None:
    token = shared_dev.token("dana", clients=["dana-*"])
    body = {"clean_start": False, "session_expiry_s": 300, "keepalive_s": 60}
    # Given a first connect
    status, first = session_call(shared_dev, "PUT", "dana-1", token, json=body)
    assert (status, first["session_present"]) == (200, False)
    # When the client reconnects without a clean start
    status, second = session_call(shared_dev, "PUT", "dana-1", token, json=body)
    # Then the session is present, and only the new channel is live
    assert (status, second["session_present"]) == (200, True)
    status, answer = session_call(
        shared_dev, "POST", "dana-1/heartbeat", token, channel=first["channel"]
    )
    assert (status, answer["error"]["code"]) == (409, "session_taken_over")
    status, answer = session_call(
        shared_dev, "POST", "dana-1/heartbeat", token, channel=second["channel"]
    )
    assert (status, answer) == (200, {"leases": []})
    status, session = session_call(shared_dev, "GET", "dana-1", token, channel=second["channel"])
    assert (status, session["channel"], session["connected"]) == (200, second["channel"], True)
    # and another principal can do nothing with it
    other = shared_dev.token("mallory", clients=["dana-*"])
    status, answer = session_call(shared_dev, "GET", "dana-1", other, channel=second["channel"])
    assert (status, answer["error"]["code"]) == (403, "forbidden")
    assert session_call(shared_dev, "DELETE", "dana-1", token, channel=second["channel"])[0] == 204


def test_keepalive_expiry_publishes_the_will_to_the_stream(dev_factory: DevFactory) -> None:
    shared_dev = dev_factory(extra_args=["--schedule", "reaper=1"])
    token = shared_dev.token("erin", clients=["erin-*"], publish=["devices/#"])
    will: dict[str, Any] = {"topic": "devices/erin-1/status", "text": "offline", "delay_s": 0}
    body = {"keepalive_s": 1, "session_expiry_s": 60, "will": will}
    status, connected = session_call(shared_dev, "PUT", "erin-1", token, json=body)
    assert status == 200
    admin = shared_dev.token("ops", admin=True)
    _, default = shared_dev.request("GET", "/v1/topics/default", token=admin)
    stream = default["storage_topics"][0]["stream"]
    # When the channel goes silent, the scheduled reaper disconnects it and publishes the will
    messages = wait_for_topic(shared_dev, stream, will["topic"], WILL_WAIT_S)
    assert [(m.payload, m.sub) for m in messages] == [(b"offline", "erin")]
    status, answer = session_call(
        shared_dev, "POST", "erin-1/heartbeat", token, channel=connected["channel"]
    )
    assert (status, answer["error"]["code"]) == (409, "session_taken_over")


def wait_for_topic(dev: DevServer, stream: str, topic: str, timeout_s: float) -> list[Any]:
    kinesis = dev.aws().client("kinesis")
    deadline = time.monotonic() + timeout_s
    while True:
        found = []
        for shard in kinesis.list_shards(StreamName=stream)["Shards"]:
            iterator = kinesis.get_shard_iterator(
                StreamName=stream, ShardId=shard["ShardId"], ShardIteratorType="TRIM_HORIZON"
            )["ShardIterator"]
            records = kinesis.get_records(ShardIterator=iterator, Limit=10_000)["Records"]
            found += [m for r in records for m in decode_record(r["Data"]) if m.topic == topic]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(1)
