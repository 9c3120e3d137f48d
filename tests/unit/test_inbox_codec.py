"""The compact encoding of inbox items (``shoal.delivery.codec``): what goes in comes out, the
version byte decides, and items written before the encoding still read; deliveries by
reference (version 2) keep what is per delivery and the line that holds the message."""

from __future__ import annotations

import math
import uuid
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st
from shoal.aws.dynamo import from_item, to_item
from shoal.core.errors import UnknownEncoding
from shoal.delivery import codec
from shoal.delivery.inbox import InboxItem, pack
from shoal.delivery.model import (
    MAX_REF_ITEM_BYTES,
    ArchiveLine,
    InboxMessage,
    position,
    record_end,
)

from bench.account import item_size

SEQUENCE = 49_650_000_000_000_000_000_000_000_000_000_000_000_000_000_001  # Kinesis-sized


def delivery(n: int, **changes: object) -> InboxMessage:
    fields: dict[str, object] = {
        "position": position(SEQUENCE + 7 * n, n % 3),
        "message_id": uuid.UUID(int=n).hex,
        "topic": f"sensors/{n % 4}/temp",
        "payload": bytes([n % 256]) * 64,
        "qos": 1,
        "subscription": "sensors/+/temp",
        "sid": "s1",
        "published_at_ms": 1_790_000_000_000 + n * 5,
    }
    fields.update(changes)
    return InboxMessage(**fields)  # type: ignore[arg-type]


texts = st.text(max_size=12)
messages = st.builds(
    InboxMessage,
    position=st.one_of(
        st.builds(
            position,
            st.integers(min_value=0, max_value=10**60),
            st.integers(min_value=0, max_value=99_999),
        ),
        texts,  # not a canonical position: kept as text
    ),
    message_id=st.one_of(st.uuids().map(lambda u: u.hex), texts, st.just("ABCDEF" * 5 + "AB")),
    topic=texts,
    payload=st.binary(max_size=100),
    qos=st.integers(min_value=0, max_value=2),
    subscription=texts,
    sid=texts,
    published_at_ms=st.integers(min_value=0, max_value=2**45),
    expires_at_ms=st.one_of(st.none(), st.integers(min_value=0, max_value=2**45)),
    properties=st.dictionaries(texts, texts, max_size=3),
    retain=st.booleans(),
    payload_ref=st.one_of(st.none(), texts),
    key_hash=st.one_of(st.none(), st.integers(min_value=0, max_value=2**32 - 1)),
)


@given(st.lists(messages, max_size=8))
def test_any_deliveries_round_trip(batch: list[InboxMessage]) -> None:
    # Given any deliveries (positions in or out of order, canonical or not, any ids)
    # When encoded and decoded
    data = codec.encode(batch)
    # Then the first byte is the version, and every field comes back as it went in
    assert data[0] == codec.VERSION == 1
    assert codec.decode(data) == batch


def test_an_item_round_trips_through_dynamodb_wire_form() -> None:
    # Given an item of three deliveries, one with every optional field
    messages = (
        delivery(0),
        delivery(1, expires_at_ms=1_790_000_060_000, retain=True, key_hash=2**31 + 5),
        delivery(2, properties={"content_type": "json"}, payload=b"", payload_ref="payloads/x"),
    )
    item = InboxItem("s1", f"src#{messages[0].position}", messages, record_end(SEQUENCE + 14), 99)
    # When it is written in its wire form and read back as a query answers it
    stored = from_item(item.wire())
    # Then it is the same item, and its deliveries are one binary value beside the keys
    assert InboxItem.from_record(stored) == item
    assert sorted(stored) == ["b", "expires_at", "inbox", "l", "position"]
    # And the general serializer gives the same wire form (transactions use record())
    assert to_item(item.record()) == item.wire()


def test_an_item_written_before_the_encoding_still_reads() -> None:
    # Given an item as the router wrote it before the compact encoding: a list of maps
    old = {
        "inbox": "s1",
        "position": "src#5800001.00000",
        "l": "5800001.99999",
        "expires_at": 99,
        "m": [
            {
                "o": "5800001.00000",
                "i": "m-1",
                "t": "orders/eu",
                "p": b"hello",
                "q": 1,
                "s": "orders/#",
                "g": "sid-1",
                "a": 1_790_000_000_000,
                "x": 1_790_000_060_000,
                "pr": {"k": "v"},
                "r": True,
                "k": 7,
            }
        ],
    }
    # When it is read
    item = InboxItem.from_record(from_item(to_item(old)))
    # Then its delivery is whole
    (message,) = item.messages
    assert message == InboxMessage(
        position="5800001.00000",
        message_id="m-1",
        topic="orders/eu",
        payload=b"hello",
        qos=1,
        subscription="orders/#",
        sid="sid-1",
        published_at_ms=1_790_000_000_000,
        expires_at_ms=1_790_000_060_000,
        properties={"k": "v"},
        retain=True,
        key_hash=7,
    )
    assert (item.covered, item.expires_at) == ("5800001.99999", 99)


@pytest.mark.parametrize("data", [b"", b"\x00", b"\x03\x00\x00", b"\x7f"])
def test_an_unknown_version_is_refused_not_misread(data: bytes) -> None:
    # Given bytes of no version, or of a version this release does not know
    # Then decoding refuses them with a coded error
    with pytest.raises(UnknownEncoding):
        codec.decode(data)


@pytest.mark.parametrize(("count", "units"), [(6, 1), (30, 3)])
def test_small_deliveries_take_a_tenth_of_a_write_unit_each(count: int, units: int) -> None:
    # Given one session's deliveries of 64-byte payloads from one batch: 6, as a batch of 100
    # records gives each of the bench's 200 sessions at 12 deliveries a message, and 30, as a
    # batch of 500 does
    messages = [delivery(n) for n in range(count)]
    end = record_end(SEQUENCE + 7 * count)
    (item,) = pack("bench-17", "0a1b2c3d4e5f", messages, end, 1_800_000_000)
    # Then the item costs that many write units (DynamoDB bills per started KB): one for six,
    # and 0.1 a delivery for thirty
    assert math.ceil(item_size(item.wire()) / 1024) == units


# --- version 2: deliveries by reference to their archive lines

OBJECTS = ("messages/topic=default/date=2026-11-25/hour=06/a.1-9.jsonl", "messages/x/b.jsonl")


def by_reference(message: InboxMessage, n: int) -> InboxMessage:
    """``message`` as the router writes it when its line is archived (no payload reference:
    the line holds the payload)."""
    line = ArchiveLine(OBJECTS[n % 3 // 2], 600 * n + (n % 2), 500 + n)
    return replace(message, line=line, payload_ref=None)


def as_read(message: InboxMessage) -> InboxMessage:
    """What reading a by-reference delivery back gives: per-delivery fields, the line, and no
    content until it is filled from the archive."""
    return replace(message, message_id="", topic="", payload=b"", published_at_ms=0, properties={})


@given(st.lists(messages, max_size=8))
def test_any_deliveries_by_reference_round_trip_without_their_content(
    batch: list[InboxMessage],
) -> None:
    # Given any deliveries naming lines of one or two archive objects, in any order
    refs = [by_reference(m, n) for n, m in enumerate(batch)]
    # When encoded and decoded
    data = codec.encode(refs)
    decoded = codec.decode(data)
    # Then the version is 2, and what is per delivery comes back, the content does not
    if refs:
        assert data[0] == codec.REF_VERSION == 2
    assert decoded == [as_read(m) for m in refs]
    assert all(m.pending for m in decoded)


def test_a_delivery_by_reference_is_filled_from_its_archive_line() -> None:
    # Given a delivery read back by reference, and its line as the archive holds it
    stored = as_read(by_reference(delivery(1, expires_at_ms=1_790_000_060_000), 1))
    line = {
        "message_id": "m-1",
        "topic": "orders/eu",
        "published_at": 1_790_000_000_000,
        "properties": {"content_type": "json", "message_expiry_s": 60},
        "payload": "aGVsbG8=",
        "qos": 2,
    }
    # When filled
    message = stored.filled(line)
    # Then it has the message's content, and keeps what is per delivery (granted QoS, expiry)
    assert (message.message_id, message.topic, message.payload) == ("m-1", "orders/eu", b"hello")
    assert message.properties == {"content_type": "json"}
    assert (message.qos, message.expires_at_ms) == (1, 1_790_000_060_000)
    assert not message.pending


def test_deliveries_by_reference_take_a_hundredth_of_a_write_unit_each() -> None:
    # Given one session's deliveries of a batch of 1,000 messages (the bench's 256-byte
    # messages: their size no longer matters), consecutive lines of one archive object
    line = ArchiveLine(OBJECTS[0], 0, 620)
    messages = [
        replace(delivery(n, payload=b"x" * 256), line=replace(line, offset=620 * n))
        for n in range(1000)
    ]
    end = record_end(SEQUENCE + 7 * 1000)
    # When packed
    items = pack("4c5593f0c78844e79def0defe500ba86", "0a1b2c3d4e5f", messages, end, 1_800_000_000)
    # Then each item is one write unit at most, and a delivery costs about a hundredth of one
    # (issue 18's target: 0.04; the payload inline made it 0.28)
    sizes = [item_size(i.wire()) for i in items]
    assert max(sizes) <= MAX_REF_ITEM_BYTES
    assert sum(math.ceil(s / 1024) for s in sizes) / len(messages) <= 0.015
    # And the items read back as what went in, in order, the last accounting for the batch
    assert [m for i in items for m in codec.decode(i.wire()["b"]["B"])] == [
        as_read(m) for m in messages
    ]
    assert items[-1].covered == end
    assert [i.covered for i in items[:-1]] == [i.messages[-1].position for i in items[:-1]]


def test_an_item_mixing_inline_and_by_reference_deliveries_is_refused() -> None:
    with pytest.raises(ValueError, match="by reference"):
        codec.encode([by_reference(delivery(0), 0), delivery(1)])
