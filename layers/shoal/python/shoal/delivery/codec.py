"""The compact encoding of an inbox item's deliveries: one binary attribute, ``b``.

Why: the router writes, per batch, one item per matching session (``shoal.delivery.inbox``).
When each delivery was a map of 8 or 9 attributes, one invocation of 100 records at 12
deliveries a message made the SDK validate, serialize and size about 10,000 attribute values,
and DynamoDB bill every attribute name again: 0.33 write units a delivery. Packed into one
binary value, a delivery of a 64-byte payload takes about 100 bytes, and the SDK handles five
values an item whatever it holds. The keys, ``l`` (how far the item accounts for, which the
router's retry check reads by projection) and the TTL stay plain attributes: everything that
makes the router's writes idempotent and ordered is unchanged.

Layout, version 1. Every integer is an unsigned LEB128 varint unless said otherwise:

* the version byte, ``0x01``;
* the string table: a count, then each string as a length and its UTF-8 bytes. An item's
  topics, filters, subscription ids and payload references are written once each (a session's
  deliveries of one batch share a few filters and one sid);
* a count of deliveries, then each:

  - flags: the granted QoS (2 bits), then ``RETAIN``, ``EXPIRES``, ``PROPERTIES``, ``REF``,
    ``KEY``, ``HEX_ID``, ``TEXT_POSITION``;
  - the position as integers: the Kinesis sequence number as a delta from the previous
    delivery's (the first's from 0), then the message's index in its record. A position not
    in ``shoal.delivery.model.position``'s form (``TEXT_POSITION``) is a string index instead;
  - the message id: 16 bytes when it is 32 lowercase hex digits (``HEX_ID``: what publish
    makes), else a string index;
  - the topic, the filter and the sid: string indexes;
  - the publish time in ms, zig-zag, as a delta from the previous delivery's (the first's from
    0); then, with ``EXPIRES``, the expiry's distance from the publish time, zig-zag;
  - the payload: a length and its bytes;
  - with ``PROPERTIES``, the user properties as compact JSON (a length and its bytes); with
    ``REF``, the payload reference's string index; with ``KEY``, the ordering key's digest.

Layout, version 2: deliveries *by reference*. The router archives every batch before it
writes an inbox item (``shoal.router.batch``), so an item need not copy the message: a delivery
names its line in the archive instead (``ArchiveLine``), and holds only what is per delivery.
About 10 bytes a delivery where version 1 took the payload and its metadata (a 256-byte message
made 290): the payload bytes were 90% of what the router wrote and a get read. Get reads the
page's lines back with one ranged S3 GET per archive object (``PayloadStore.fill``).

* the version byte, ``0x02``;
* the string table, as in version 1: archive object keys, filters, sids, text positions;
* a count of deliveries, then each:

  - flags: the granted QoS (2 bits), then ``RETAIN``, ``EXPIRES``, ``REF_TEXT_POSITION``,
    ``OBJECT``, ``REF_KEY``;
  - the position, as in version 1;
  - with ``OBJECT`` (always on the first delivery), the archive object's string index: the
    deliveries after it are lines of that object until the next ``OBJECT``;
  - the line's byte offset, zig-zag, as a distance from the previous line's end in the same
    object (0 for the line right after it), then its length;
  - the filter and the sid: string indexes;
  - with ``EXPIRES``, the expiry in ms since the epoch; with ``REF_KEY``, the ordering key's
    digest.

Items written before the encoding (a list of maps under ``m``) are read as before
(``InboxItem.from_record``); ``docs/design.md`` says how a deployed stack would move over.
Every version stays readable: items live until TTL, written by any release before.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from shoal.core.errors import UnknownEncoding
from shoal.delivery.model import ArchiveLine, InboxMessage

VERSION = 1
#: deliveries by reference to their archive lines
REF_VERSION = 2

QOS_MASK = 0x03
RETAIN = 0x04
EXPIRES = 0x08
PROPERTIES = 0x10
REF = 0x20
KEY = 0x40
HEX_ID = 0x80
TEXT_POSITION = 0x100

#: version 2's flags (the QoS, ``RETAIN`` and ``EXPIRES`` as in version 1)
REF_TEXT_POSITION = 0x10
OBJECT = 0x20
REF_KEY = 0x40

_HEX = frozenset("0123456789abcdef")


def _varint(out: bytearray, n: int) -> None:
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)


def _zigzag(n: int) -> int:
    # Python ints are unbounded: map ..., -2, -1, 0, 1, ... to ..., 3, 1, 0, 2, ...
    return n * 2 if n >= 0 else -n * 2 - 1


def _split_position(position: str) -> tuple[int, int] | None:
    """``position``'s (sequence number, index), or None when it is not in the canonical form
    (two digits of length, the digits, a dot, five digits of index)."""
    dot = position.find(".", 2)
    if dot < 3 or len(position) != dot + 6:
        return None
    digits, index = position[2:dot], position[dot + 1 :]
    if (
        not digits.isdigit()
        or not index.isdigit()
        or position[:2] != f"{len(digits):02d}"
        or (digits[0] == "0" and len(digits) > 1)
    ):
        return None
    return int(digits), int(index)


def _position(sequence: int, index: int) -> str:
    digits = str(sequence)
    return f"{len(digits):02d}{digits}.{index:05d}"


def _varint_size(n: int) -> int:
    return max(1, (n.bit_length() + 6) // 7)


def encode(messages: Sequence[InboxMessage]) -> bytes:
    """The deliveries of one item, in order: version 2 bytes when they are by reference (all of
    them), else version 1."""
    if messages and messages[0].line is not None:
        encoder = RefEncoder()
        for m in messages:
            encoder.add(m)
        return encoder.bytes()
    return _encode_inline(messages)


class RefEncoder:
    """Version 2 bytes, built one delivery at a time, with their size known as they grow:
    ``pack`` fills an item up to a size and takes back the delivery that went over."""

    def __init__(self) -> None:
        self.strings: dict[str, int] = {}
        self.table = bytearray()
        self.body = bytearray()
        self.count = 0
        self._sequence = 0
        self._object: str | None = None
        self._end = 0

    def size(self) -> int:
        """The bytes ``bytes()`` would answer now."""
        return (
            1
            + _varint_size(len(self.strings))
            + len(self.table)
            + _varint_size(self.count)
            + len(self.body)
        )

    def mark(self) -> tuple[int, int, int, int, int, str | None, int]:
        return (
            len(self.table),
            len(self.body),
            self.count,
            len(self.strings),
            self._sequence,
            self._object,
            self._end,
        )

    def undo(self, mark: tuple[int, int, int, int, int, str | None, int]) -> None:
        """Back to how it was at ``mark``: the deliveries added since are gone."""
        table, body, self.count, strings, self._sequence, self._object, self._end = mark
        del self.table[table:]
        del self.body[body:]
        while len(self.strings) > strings:
            self.strings.pop(next(reversed(self.strings)))

    def _ref(self, text: str) -> None:
        found = self.strings.get(text)
        if found is None:
            found = self.strings[text] = len(self.strings)
            raw = text.encode("utf-8", "surrogatepass")
            _varint(self.table, len(raw))
            self.table += raw
        _varint(self.body, found)

    def add(self, m: InboxMessage) -> None:
        line = m.line
        if line is None or m.payload_ref is not None:
            raise ValueError("a delivery by reference names its archive line and nothing else")
        body = self.body
        flags = m.qos & QOS_MASK
        if m.retain:
            flags |= RETAIN
        if m.expires_at_ms is not None:
            flags |= EXPIRES
        if m.key_hash is not None:
            flags |= REF_KEY
        if line.key != self._object:
            flags |= OBJECT
        split = _split_position(m.position)
        if split is None or split[0] < self._sequence:
            flags |= REF_TEXT_POSITION
        _varint(body, flags)
        if flags & REF_TEXT_POSITION:
            self._ref(m.position)
        else:
            assert split is not None
            _varint(body, split[0] - self._sequence)
            _varint(body, split[1])
            self._sequence = split[0]
        if flags & OBJECT:
            self._ref(line.key)
            self._object, self._end = line.key, 0
        _varint(body, _zigzag(line.offset - self._end))
        _varint(body, line.length)
        self._end = line.end
        self._ref(m.subscription)
        self._ref(m.sid)
        if m.expires_at_ms is not None:
            _varint(body, m.expires_at_ms)
        if m.key_hash is not None:
            _varint(body, m.key_hash)
        self.count += 1

    def bytes(self) -> bytes:
        out = bytearray((REF_VERSION,))
        _varint(out, len(self.strings))
        out += self.table
        _varint(out, self.count)
        out += self.body
        return bytes(out)


def _encode_inline(messages: Sequence[InboxMessage]) -> bytes:
    """The deliveries of one item, in order, as version 1 bytes."""
    # the router encodes an item per session and batch: plain locals and a one-byte fast path
    # for the small integers most fields are keep this a few microseconds a delivery
    strings: dict[str, int] = {}
    body = bytearray()
    put = body.append

    def varint(n: int) -> None:
        if n < 0x80:
            put(n)
        else:
            _varint(body, n)

    def ref(text: str) -> None:
        found = strings.get(text)
        if found is None:
            found = strings[text] = len(strings)
        varint(found)

    varint(len(messages))
    previous_sequence = 0
    previous_at = 0
    for m in messages:
        flags = m.qos & QOS_MASK
        if m.retain:
            flags |= RETAIN
        if m.expires_at_ms is not None:
            flags |= EXPIRES
        if m.properties:
            flags |= PROPERTIES
        if m.payload_ref is not None:
            flags |= REF
        if m.key_hash is not None:
            flags |= KEY
        mid = m.message_id
        hex_id = len(mid) == 32 and _HEX.issuperset(mid)
        if hex_id:
            flags |= HEX_ID
        split = _split_position(m.position)
        # positions go in order within an item; a canonical one behind the previous (never
        # made by pack) is kept as text rather than as a negative delta
        if split is None or split[0] < previous_sequence:
            flags |= TEXT_POSITION
        varint(flags)
        if flags & TEXT_POSITION:
            ref(m.position)
        else:
            assert split is not None
            varint(split[0] - previous_sequence)
            varint(split[1])
            previous_sequence = split[0]
        if hex_id:
            body += bytes.fromhex(mid)
        else:
            ref(mid)
        ref(m.topic)
        ref(m.subscription)
        ref(m.sid)
        varint(_zigzag(m.published_at_ms - previous_at))
        previous_at = m.published_at_ms
        if m.expires_at_ms is not None:
            varint(_zigzag(m.expires_at_ms - m.published_at_ms))
        varint(len(m.payload))
        body += m.payload
        if m.properties:
            props = json.dumps(dict(m.properties), separators=(",", ":")).encode()
            varint(len(props))
            body += props
        if m.payload_ref is not None:
            ref(m.payload_ref)
        if m.key_hash is not None:
            varint(m.key_hash)
    out = bytearray((VERSION,))
    _varint(out, len(strings))
    for text in strings:
        raw = text.encode("utf-8", "surrogatepass")
        _varint(out, len(raw))
        out += raw
    out += body
    return bytes(out)


class _Reader:
    """The cursor over an encoded item."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 1

    def varint(self) -> int:
        data = self.data
        shift = result = 0
        while True:
            byte = data[self.at]
            self.at += 1
            result |= (byte & 0x7F) << shift
            if byte < 0x80:
                return result
            shift += 7

    def zigzag(self) -> int:
        n = self.varint()
        return n >> 1 if not n & 1 else -((n + 1) >> 1)

    def chunk(self) -> bytes:
        size = self.varint()
        start = self.at
        self.at += size
        return self.data[start : self.at]


def decode(data: bytes) -> list[InboxMessage]:
    """``encode``'s answer back as deliveries; ``UnknownEncoding`` for another version. Version
    2's deliveries come back ``pending``: their content is in the archive."""
    if data and data[0] == REF_VERSION:
        return _decode_refs(data)
    if not data or data[0] != VERSION:
        raise UnknownEncoding(
            f"inbox item encoding {data[0] if data else None!r} is not known to this release"
        )
    at = 1

    def varint() -> int:
        nonlocal at
        shift = result = 0
        while True:
            byte = data[at]
            at += 1
            result |= (byte & 0x7F) << shift
            if byte < 0x80:
                return result
            shift += 7

    def zigzag() -> int:
        n = varint()
        return n >> 1 if not n & 1 else -((n + 1) >> 1)

    def chunk() -> bytes:
        nonlocal at
        size = varint()
        start = at
        at += size
        return data[start:at]

    strings = [chunk().decode("utf-8", "surrogatepass") for _ in range(varint())]
    out: list[InboxMessage] = []
    sequence = 0
    published = 0
    for _ in range(varint()):
        flags = varint()
        if flags & TEXT_POSITION:
            position = strings[varint()]
        else:
            sequence += varint()
            position = _position(sequence, varint())
        if flags & HEX_ID:
            message_id = data[at : at + 16].hex()
            at += 16
        else:
            message_id = strings[varint()]
        topic = strings[varint()]
        subscription = strings[varint()]
        sid = strings[varint()]
        published += zigzag()
        expires = published + zigzag() if flags & EXPIRES else None
        payload = chunk()
        properties = json.loads(chunk()) if flags & PROPERTIES else {}
        payload_ref = strings[varint()] if flags & REF else None
        key_hash = varint() if flags & KEY else None
        out.append(
            InboxMessage(
                position=position,
                message_id=message_id,
                topic=topic,
                payload=payload,
                qos=flags & QOS_MASK,
                subscription=subscription,
                sid=sid,
                published_at_ms=published,
                expires_at_ms=expires,
                properties=properties,
                retain=bool(flags & RETAIN),
                payload_ref=payload_ref,
                key_hash=key_hash,
            )
        )
    return out


def _decode_refs(data: bytes) -> list[InboxMessage]:
    read = _Reader(data)
    varint = read.varint
    strings = [read.chunk().decode("utf-8", "surrogatepass") for _ in range(varint())]
    out: list[InboxMessage] = []
    sequence = 0
    key = ""
    end = 0
    for _ in range(varint()):
        flags = varint()
        if flags & REF_TEXT_POSITION:
            position = strings[varint()]
        else:
            sequence += varint()
            position = _position(sequence, varint())
        if flags & OBJECT:
            key, end = strings[varint()], 0
        offset = end + read.zigzag()
        line = ArchiveLine(key, offset, varint())
        end = line.end
        subscription = strings[varint()]
        sid = strings[varint()]
        expires = varint() if flags & EXPIRES else None
        key_hash = varint() if flags & REF_KEY else None
        out.append(
            InboxMessage(
                position=position,
                message_id="",
                topic="",
                payload=b"",
                qos=flags & QOS_MASK,
                subscription=subscription,
                sid=sid,
                published_at_ms=0,
                expires_at_ms=expires,
                retain=bool(flags & RETAIN),
                key_hash=key_hash,
                line=line,
            )
        )
    return out
