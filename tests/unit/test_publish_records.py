"""The publish path's pure parts: the record format, packing, request schema, sequence routes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError
from shoal.aws.kinesis import MAX_PUT_RECORDS, MAX_PUT_RECORDS_BYTES, put_chunks
from shoal.publish.request import MAX_BATCH, BatchRequest, PublishRequest
from shoal.publish.sequences import (
    PublisherState,
    Reservation,
    consecutive_runs,
    publisher_key,
    sequenced_message_id,
)
from shoal.records import MalformedRecord, Message, decode_record, encode_record, record_size

text = st.text(st.characters(codec="utf-8"), min_size=1, max_size=20)
publishers = st.just((None, None)) | st.tuples(text, st.integers(1, 2**63 - 1))
messages = st.builds(
    lambda publisher, **fields: Message(
        publisher_id=publisher[0], publisher_seq=publisher[1], **fields
    ),
    publisher=publishers,
    message_id=st.text("0123456789abcdef", min_size=32, max_size=32),
    topic=text,
    payload=st.binary(max_size=64),
    qos=st.integers(0, 2),
    retain=st.booleans(),
    ordering_key=text,
    published_at_ms=st.integers(0, 2**45),
    sub=text,
    properties=st.just({})
    | st.just({"content_type": "text/plain", "user_properties": {"k": "v\n"}}),
)


@given(st.lists(messages, min_size=1, max_size=5))
def test_records_round_trip(batch: list[Message]) -> None:
    # Given messages whose payloads and strings may hold newlines and any bytes
    data = encode_record(batch)
    # Then decoding gives them back, in order
    assert decode_record(data) == batch


@given(st.lists(messages, min_size=1, max_size=5), st.text(min_size=1, max_size=40))
def test_record_size_is_what_kinesis_counts(batch: list[Message], partition_key: str) -> None:
    size = record_size(
        [m.header() for m in batch], sum(len(m.payload) for m in batch), partition_key
    )
    assert size == len(encode_record(batch)) + len(partition_key.encode())


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"no newline",
        b"not json\npayload",
        b'{"v":2,"m":[]}\n',
        b'{"v":1,"m":[{"id":"x"}]}\n',
        b'{"v":1,"m":[]}\nextra bytes',
        b"[1]\n",
    ],
)
def test_foreign_records_are_malformed(data: bytes) -> None:
    with pytest.raises(MalformedRecord):
        decode_record(data)


def test_chunks_keep_within_put_records_limits() -> None:
    # Given 1,200 records of 10 KiB (12 MiB in all)
    sizes = [10 * 1024] * 1200
    chunks = put_chunks(list(range(1200)), sizes)
    # Then every call holds at most 500 records and 5 MiB, and order is kept
    assert [n for chunk in chunks for n in chunk] == list(range(1200))
    assert all(len(c) <= MAX_PUT_RECORDS for c in chunks)
    assert all(sum(sizes[n] for n in c) <= MAX_PUT_RECORDS_BYTES for c in chunks)
    assert len(chunks) == 3


def test_ranges_are_maximal_runs() -> None:
    assert consecutive_runs([5, 3, 4, 8, 10, 9, 12]) == [(3, 5), (8, 10), (12, 12)]
    assert consecutive_runs([]) == []


def test_sequenced_ids_depend_on_principal_publisher_and_seq() -> None:
    a = sequenced_message_id(publisher_key("alice", "p"), 1)
    assert a == sequenced_message_id(publisher_key("alice", "p"), 1)
    assert a != sequenced_message_id(publisher_key("bob", "p"), 1)
    assert a != sequenced_message_id(publisher_key("alice", "p"), 2)
    # the length prefix keeps ("a:b", "c") and ("a", "b:c") apart
    assert publisher_key("a:b", "c") != publisher_key("a", "b:c")


def test_route_for_picks_the_last_storage_topic_at_or_before_the_seq() -> None:
    # Given a publisher that sent to default/0 from seq 1, orders/0 from 5, orders/1 from 9,
    # and seq 7 was recovered into orders/1
    state = PublisherState(
        last_seq=12,
        pending={},
        routes={"default/0": 1, "orders/0": 5, "orders/1": 9},
        overrides={7: "orders/1"},
    )
    assert state.route_for(2, "orders/x") == ("default", 0)  # before `orders` existed
    assert state.route_for(6, "orders/x") == ("orders", 0)
    assert state.route_for(7, "orders/x") == ("orders", 1)
    assert state.route_for(10, "orders/x") == ("orders", 1)
    assert state.route_for(10, "sensors/1") == ("default", 0)


def test_reservation_for_finds_the_run_holding_a_seq() -> None:
    run = Reservation(lo=3, hi=6, reserved_at=0, held_until=1, attempt=1, targets=("t/0",))
    state = PublisherState(6, {3: run}, {}, {})
    assert state.reservation_for(5) == run
    assert state.reservation_for(7) is None
    assert Reservation.from_item(3, run.item()) == run


@pytest.mark.parametrize(
    "body",
    [
        {"topic": "a", "qos": 3},
        {"topic": "a", "qos": True},
        {"topic": "a", "qos": "1"},
        {"topic": "a", "retain": "yes"},
        {"topic": "a", "publisher_id": "p"},
        {"topic": "a", "publisher_seq": 1},
        {"topic": "a", "publisher_id": "p", "publisher_seq": 0},
        {"topic": "a", "publisher_id": "", "publisher_seq": 1},
        {"topic": "a", "publisher_id": "p\n", "publisher_seq": 1},
        {"topic": "a", "publisher_id": "p", "publisher_seq": 1.5},
        {"topic": "a", "ordering_key": ""},
        {"topic": "a", "properties": {"other": 1}},
        {"topic": "a", "properties": {"message_expiry_s": -1}},
        {"topic": "a", "properties": {"user_properties": {"k": 1}}},
        {"topic": 5},
        {"payload": "aGk="},
        {"topic": "a", "extra": 1},
    ],
)
def test_publish_schema_refuses(body: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        PublishRequest.model_validate(body)


def test_batch_schema_bounds_the_message_count() -> None:
    with pytest.raises(ValidationError):
        BatchRequest.model_validate({"messages": []})
    with pytest.raises(ValidationError):
        BatchRequest.model_validate({"messages": [{}] * (MAX_BATCH + 1)})
    assert len(BatchRequest.model_validate({"messages": [{}] * MAX_BATCH}).messages) == MAX_BATCH
