"""The event log's appends (``shoal.aws.kinesis.EventLog``): records Kinesis refuses are put
again, alone, and still-refused records fail the caller, as a failed PutObject did."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber
from shoal.aws.kinesis import EventLog
from shoal.core.clock import ManualClock
from shoal.core.errors import ServerBusy

STREAM = "events.shoal"


@pytest.fixture
def kinesis() -> Iterator[tuple[Any, Stubber]]:
    client = boto3.client(
        "kinesis", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x"
    )
    with Stubber(client) as stubber:
        yield client, stubber


def answer(*errors: str | None) -> dict[str, Any]:
    failed = sum(1 for e in errors if e)
    # (the model's minimum is 1: a call without failures leaves the count out)
    return ({"FailedRecordCount": failed} if failed else {}) | {
        "Records": [
            {"ErrorCode": e, "ErrorMessage": "slow down"}
            if e
            else {"SequenceNumber": "1", "ShardId": "shardId-000000000000"}
            for e in errors
        ],
    }


def put(*records: tuple[str, bytes]) -> dict[str, Any]:
    return {
        "StreamName": STREAM,
        "Records": [{"PartitionKey": k, "Data": d} for k, d in records],
    }


def test_a_refused_record_is_put_again_alone(kinesis: tuple[Any, Stubber]) -> None:
    client, stubber = kinesis
    # Given Kinesis refuses the second of two records once
    throttled = "ProvisionedThroughputExceededException"
    stubber.add_response("put_records", answer(None, throttled), put(("a", b"1"), ("b", b"2")))
    stubber.add_response("put_records", answer(None), put(("b", b"2")))
    clock = ManualClock(0)
    # When appended
    EventLog(client, STREAM, clock).append([("a", b"1"), ("b", b"2")])
    # Then the second call put only the refused one, after a short wait
    stubber.assert_no_pending_responses()
    assert clock.now_ms() == 50


def test_records_refused_every_time_fail_the_call(kinesis: tuple[Any, Stubber]) -> None:
    client, stubber = kinesis
    # Given Kinesis refuses the record at every attempt
    for _ in range(EventLog.ATTEMPTS):
        stubber.add_response("put_records", answer("InternalFailure"), put(("a", b"1")))
    # Then the append fails with a retryable error once the attempts are spent
    with pytest.raises(ServerBusy):
        EventLog(client, STREAM, ManualClock(0)).append([("a", b"1")])
    stubber.assert_no_pending_responses()


def test_more_than_one_call_holds_is_cut_into_calls_in_order(
    kinesis: tuple[Any, Stubber],
) -> None:
    client, stubber = kinesis
    # Given 501 records (PutRecords takes 500)
    records = [(f"k{n}", b"x") for n in range(501)]
    stubber.add_response("put_records", answer(*[None] * 500), put(*records[:500]))
    stubber.add_response("put_records", answer(None), put(records[500]))
    # When appended, Then two calls put them in order
    EventLog(client, STREAM, ManualClock(0)).append(records)
    stubber.assert_no_pending_responses()
