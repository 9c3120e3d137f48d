"""The cost model's arithmetic on a small counted run: the counts come from the bench's meters
on the real handlers over moto, the model multiplies them by the list prices."""

from __future__ import annotations

import math

import pytest

from bench import cost


@pytest.fixture(scope="module")
def counted() -> cost.Counts:
    # 2 batches of 100 to 1 subscriber that gets pages of 100 and acks each
    return cost.counted_run(cost.Scenario("small", batch=100, messages=200, get_max=100))


def test_the_meters_count_the_traffic_and_only_the_traffic(counted: cost.Counts) -> None:
    # what the scenario did, as Lambda and API Gateway would have counted it
    assert counted.delivered == counted.published == 200
    # (2 gets, 2 acks; the archiver over the event log as its mapping would, once a round)
    assert counted.invocations == {"publish": 2, "router": 1, "messages": 4, "archiver": 1}
    assert counted.api_requests == 6 and counted.lambda_requests == 8
    assert counted.lambda_gb_s > 0
    # what the meters saw on the functions' clients: 2 puts of 10 keys' records each, and one
    # event-log record from each of the router, the gets and the acks
    assert counted.calls["kinesis.PutRecords"] == 2 + 5
    assert counted.kinesis_records == 20
    assert counted.event_log_records == 5
    assert counted.kinesis_put_units == 25  # each record below 25 KB
    assert 200 * len(cost.PAYLOAD) < counted.kinesis_bytes < 200 * 2 * len(cost.PAYLOAD)
    # the events of a delivery (routed, delivered, acked) are compressed lines: well below
    # what they took as S3 objects (about 250 bytes a line)
    assert 0 < counted.event_log_bytes < 200 * 3 * 100
    # and the S3 writes are the router's message archive and the archiver's one object of
    # delivery events (one hour), where each router, get and ack call wrote one before
    assert counted.calls["s3.PutObject"] == 2
    # inbox items name archive lines: fewer write units than the payloads' KB would take
    assert counted.dynamodb_wru < 200 * len(cost.PAYLOAD) / 1024
    assert counted.dynamodb_rru >= counted.calls.get("dynamodb.Query", 0)
    assert counted.s3_puts == counted.calls["s3.PutObject"]
    # and each get read its page's lines with one ranged GET (one archive object)
    assert counted.s3_gets == counted.calls["s3.GetObject"] == 2
    assert sum(counted.wru_by_operation.values()) == counted.dynamodb_wru
    assert sum(counted.rru_by_operation.values()) == counted.dynamodb_rru


def test_inbox_units_per_delivery_are_under_issue_18s_targets(counted: cost.Counts) -> None:
    # Given 200 deliveries of 256-byte messages, got in pages of 100: the router's inbox
    # items are its only BatchWriteItems, the gets' inbox reads the only Queries
    per = 1 / counted.delivered
    # Then the items cost at most 0.04 write units a delivery (0.28 with payloads inline)
    assert counted.wru_by_operation["BatchWriteItem"] * per <= 0.04
    # and the gets' queries at most 0.02 read units a delivered message (0.51 inline)
    assert counted.rru_by_operation["Query"] * per <= 0.02


def test_each_line_is_its_count_times_its_price_per_million_delivered(
    counted: cost.Counts,
) -> None:
    lines = cost.price(counted)
    per_million = 1e6 / counted.delivered
    assert lines["api_requests"] == pytest.approx(counted.api_requests * 1.00 / 1e6 * per_million)
    assert lines["lambda_requests"] == pytest.approx(
        counted.lambda_requests * 0.20 / 1e6 * per_million
    )
    assert lines["lambda_gb_s"] == pytest.approx(counted.lambda_gb_s * 0.0000133334 * per_million)
    assert lines["dynamodb_wru"] == pytest.approx(counted.dynamodb_wru * 0.625 / 1e6 * per_million)
    assert lines["dynamodb_rru"] == pytest.approx(counted.dynamodb_rru * 0.125 / 1e6 * per_million)
    assert lines["kinesis_put_units"] == pytest.approx(25 * 0.014 / 1e6 * per_million)
    assert lines["s3_puts"] == pytest.approx(counted.s3_puts * 0.005 / 1000 * per_million)
    # 20 records of 10 messages each (~4 KB): a shard's 1 MB/s binds before its 1,000
    # records/s, and it runs half full
    per_record = counted.kinesis_bytes / 20
    assert per_record > cost.SHARD_BYTES_PER_S / cost.SHARD_RECORDS_PER_S
    seconds = 20 / (cost.SHARD_BYTES_PER_S / per_record * cost.SHARD_UTILIZATION)
    # and the event log's shard sized the same way from its own records (a page's 100 lines,
    # compressed, ~3 KB: bytes bind there too)
    log_per_record = counted.event_log_bytes / 5
    assert log_per_record > cost.SHARD_BYTES_PER_S / cost.SHARD_RECORDS_PER_S
    seconds += 5 / (cost.SHARD_BYTES_PER_S / log_per_record * cost.SHARD_UTILIZATION)
    assert lines["kinesis_shard_hours"] == pytest.approx(seconds / 3600 * 0.015 * per_million)
    assert set(lines) == set(cost.LINES) == set(cost.PRICES)
    # doubling the delivered messages for the same usage halves every line
    doubled = cost.Counts(**{**vars(counted), "delivered": 2 * counted.delivered})
    assert all(math.isclose(cost.price(doubled)[k], v / 2) for k, v in lines.items())


def test_the_alternatives_count_messages_in_out_and_acks() -> None:
    one = cost.alternatives(cost.Scenario("a", batch=100, subscribers=1))
    ten = cost.alternatives(cost.Scenario("b", batch=100, subscribers=10))
    # IoT Core at QoS 1: 1 publish in, 1 out and 1 PUBACK per delivery, $1 per million each
    assert one["iot_core"] == pytest.approx(3.00)
    assert ten["iot_core"] == pytest.approx(2.10)
    # SNS+SQS: a PublishBatch of 10 per 10 messages, a send into each queue, receive and
    # delete per 10
    assert one["sns_sqs"] == pytest.approx(0.05 + 0.40 * 1.2)
    assert ten["sns_sqs"] == pytest.approx(0.005 + 0.40 * 1.2)
