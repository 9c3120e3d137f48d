"""Inbox items that name their messages' archive lines instead of copying them (codec version 2,
``shoal.router.archive`` lines, ``PayloadStore.fill``), over moto: a get answers exactly as a
get of inline deliveries, one ranged GET per archive object of a page, redelivery reads the
lines again, a router crash between the archive and the inbox loses and doubles nothing, and
items written in the older formats still read."""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pytest
import shoal.router.fanout as fanout_module
from shoal.aws.dynamo import from_item, to_item
from shoal.core.config import get_config
from shoal.core.faults import FaultPlan
from shoal.delivery import codec
from shoal.delivery.inbox import InboxItem, InboxMessage
from shoal.router.archive import MESSAGES_PREFIX

import functions.router.app as router_app
from tests.integration.test_delivery_support import World, world

__all__ = ["world"]  # fixture


def connected(world: World, client_id: str, *filters: str) -> str:
    channel = world.connect(client_id, clean_start=False, session_expiry_s=3600)
    world.subscribe(client_id, channel, *filters)
    return channel


def session_of(world: World, client_id: str) -> str:
    head = world.registry.repository.head(client_id)
    assert head is not None and head.session_id
    return head.session_id


def stored(world: World, session_id: str) -> list[dict[str, Any]]:
    """The session's delivery items as stored (wire form)."""
    dynamo = world.session.client("dynamodb")
    rows = dynamo.query(
        TableName=get_config().table("inboxes"),
        KeyConditionExpression="inbox = :p",
        ExpressionAttributeValues={":p": {"S": session_id}},
        ConsistentRead=True,
    )["Items"]
    return [r for r in rows if "b" in r or "m" in r]


def archive_keys(world: World) -> list[str]:
    s3 = world.session.client("s3")
    listed = s3.list_objects_v2(Bucket=get_config().buckets["archive"], Prefix=MESSAGES_PREFIX)
    return [o["Key"] for o in listed.get("Contents", [])]


class ArchiveReads:
    """The ranged GETs the delivery service's S3 client sends (a botocore event counter)."""

    def __init__(self, world: World) -> None:
        self.calls: list[tuple[str, str]] = []
        world.delivery.payloads.s3.meta.events.register(  # type: ignore[union-attr]
            "provide-client-params.s3.GetObject", self._record
        )

    def _record(self, params: dict[str, Any], **_: Any) -> None:
        self.calls.append((params["Key"], params.get("Range", "")))

    def take(self) -> list[tuple[str, str]]:
        calls, self.calls = self.calls, []
        return calls


def without_ids(answers: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in a.items() if k != "id"} for a in answers]


TRAFFIC: list[dict[str, Any]] = [
    {"topic": "t/ü/1", "payload": base64.b64encode(bytes(range(256))).decode(), "text": None},
    {
        "topic": "t/2",
        "text": 'ünïcode, "quoted"\nand a newline',
        "qos": 2,
        "properties": {
            "content_type": "text/plain",
            "user_properties": {"k": "v", "ключ": "значение"},
            "message_expiry_s": 600,
        },
    },
    {"topic": "t/3", "text": "", "qos": 0},
    {"topic": "t/4", "text": "x" * 3000, "ordering_key": "device-1"},
]


def test_a_get_by_reference_answers_exactly_as_a_get_of_inline_deliveries(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given two sessions on one filter, the router writing one's deliveries inline (as before
    # items named archive lines) and the other's by reference
    by_ref = connected(world, "alice-ref", "t/#")
    inline = connected(world, "alice-inline", "t/#")
    inline_session = session_of(world, "alice-inline")
    original = fanout_module.pack

    def pack(session_id: str, source: str, messages: Any, *args: Any, **kwargs: Any) -> Any:
        if session_id == inline_session:
            messages = [replace(m, line=None) for m in messages]
        return original(session_id, source, messages, *args, **kwargs)

    monkeypatch.setattr(fanout_module, "pack", pack)
    ids = [world.publish(**message) for message in TRAFFIC]
    world.route()
    # Then the by-reference items are version 2 and hold no payload
    (item,) = stored(world, session_of(world, "alice-ref"))
    packed = item["b"]["B"]
    assert packed[0] == codec.REF_VERSION and b"x" * 100 not in packed
    (copied,) = stored(world, inline_session)
    assert copied["b"]["B"][0] == codec.VERSION and b"x" * 3000 in copied["b"]["B"]
    # When both get
    got = world.get("alice-ref", by_ref)
    # Then the answers are the same, byte for byte, but for the delivery ids
    expected = without_ids(world.get("alice-inline", inline))
    assert json.dumps(without_ids(got)) == json.dumps(expected)
    # and they are what was published
    assert [m["message_id"] for m in got] == ids
    assert [m["topic"] for m in got] == [m["topic"] for m in TRAFFIC]
    assert base64.b64decode(got[0]["payload"]) == bytes(range(256))
    assert base64.b64decode(got[1]["payload"]).decode() == TRAFFIC[1]["text"]
    assert got[1]["properties"]["user_properties"] == {"k": "v", "ключ": "значение"}
    assert got[1]["properties"]["message_expiry_s"] == 600
    assert [(m["qos"], m["dup"], m["retain"]) for m in got] == [
        (1, False, False),
        (2, False, False),
        (0, False, False),
        (1, False, False),
    ]


def test_a_page_reads_each_archive_object_once_and_a_redelivery_reads_them_again(
    world: World,
) -> None:
    # Given a session whose inbox holds two routed batches: two archive objects
    channel = connected(world, "alice-1", "p/#")
    ids = [world.publish("p/a", f"m{n}") for n in range(3)]
    world.route()
    ids += [world.publish("p/b", f"m{n}", qos=2) for n in range(3, 6)]
    world.route()
    assert len(archive_keys(world)) == 2
    reads = ArchiveReads(world)
    # When it gets one page of both
    got = world.get("alice-1", channel)
    # Then the page is whole and in order, from one ranged GET per object
    assert [m["message_id"] for m in got] == ids
    calls = reads.take()
    assert sorted(key for key, _ in calls) == sorted(archive_keys(world))
    assert all(r.startswith("bytes=") for _, r in calls)
    # When the ack timeout passes without an ack
    world.clock.advance(31)
    again = world.get("alice-1", channel)
    # Then the same deliveries come again, dup, with the same ids and content, read again
    assert [m["id"] for m in again] == [m["id"] for m in got]
    assert all(m["dup"] for m in again)
    assert [{k: v for k, v in m.items() if k != "dup"} for m in again] == [
        {k: v for k, v in m.items() if k != "dup"} for m in got
    ]
    assert len(reads.take()) == 2
    # And once acked, never again (and nothing read)
    assert world.ack("alice-1", channel, [m["id"] for m in got])[0] == 200
    world.clock.advance(60)
    assert world.get("alice-1", channel) == []
    assert reads.take() == []


class CrashAfterArchive:
    """The router's fault switch: its first invocation dies right after the archive write,
    having noted what was stored then."""

    def __init__(self, world: World, session_id: str) -> None:
        self.world = world
        self.session_id = session_id
        self.armed = True
        self.seen: tuple[int, int] | None = None

    def plan(self, steps: Any) -> FaultPlan:
        if not self.armed:
            return FaultPlan(None)
        self.armed = False
        switch = self

        class Plan(FaultPlan):
            def at(self, step: str) -> None:
                if step == "after_archive":
                    switch.seen = (
                        len(archive_keys(switch.world)),
                        len(stored(switch.world, switch.session_id)),
                    )
                super().at(step)

        return Plan("after_archive")


def test_a_router_crash_between_the_archive_and_the_inbox_delivers_once(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    channel = connected(world, "alice-1", "c/#")
    crash = CrashAfterArchive(world, session_of(world, "alice-1"))
    monkeypatch.setattr(router_app.router(), "faults", crash)
    ids = [world.publish("c/x", f"m{n}") for n in range(4)]
    # When the router dies after archiving the batch, before any inbox write, and the mapping
    # retries it
    world.route()
    # Then the crash left the archive written and the inbox untouched
    assert crash.seen == (1, 0)
    # and the retries (a function error bisects the batch: its halves archive objects of their
    # own) wrote the items, each naming lines that exist: every message once, in order
    assert [m["message_id"] for m in world.drain("alice-1", channel)] == ids
    named = {
        m.line.key
        for raw in stored(world, session_of(world, "alice-1"))
        for m in InboxItem.from_record(from_item(raw)).messages
        if m.line is not None
    }
    assert named and named <= set(archive_keys(world))


def _as_version_1(item: InboxItem, filled: Sequence[InboxMessage]) -> dict[str, Any]:
    return replace(item, messages=tuple(replace(m, line=None) for m in filled), encoded=None).wire()


def _as_maps(item: InboxItem, filled: Sequence[InboxMessage]) -> dict[str, Any]:
    """The item as the first releases wrote it: a list of maps under ``m``."""
    maps = [
        {
            "o": m.position,
            "i": m.message_id,
            "t": m.topic,
            "p": m.payload,
            "q": m.qos,
            "s": m.subscription,
            "g": m.sid,
            "a": m.published_at_ms,
            **({"x": m.expires_at_ms} if m.expires_at_ms is not None else {}),
            **({"pr": dict(m.properties)} if m.properties else {}),
        }
        for m in filled
    ]
    record = {k: v for k, v in from_item(item.wire()).items() if k != "b"}
    return to_item(record | {"m": maps})


@pytest.mark.parametrize("rewrite", [_as_version_1, _as_maps], ids=["version 1", "maps"])
def test_items_in_an_older_format_read_as_the_router_wrote_them(world: World, rewrite: Any) -> None:
    # Given two sessions' deliveries by reference, and one's items rewritten in an older
    # format (what a stack upgraded in place holds until TTL)
    new = connected(world, "alice-new", "o/#")
    old = connected(world, "alice-old", "o/#")
    ids = [world.publish(**message | {"topic": f"o/{n}"}) for n, message in enumerate(TRAFFIC)]
    world.route()
    dynamo = world.session.client("dynamodb")
    for raw in stored(world, session_of(world, "alice-old")):
        item = InboxItem.from_record(from_item(raw))
        filled = world.delivery.payloads.fill(item.messages)  # type: ignore[union-attr]
        assert all(m is not None and not m.pending for m in filled)
        dynamo.put_item(
            TableName=get_config().table("inboxes"),
            Item=rewrite(item, filled),
        )
    assert all(
        "b" not in r or r["b"]["B"][0] == 1 for r in stored(world, session_of(world, "alice-old"))
    )
    # When both get
    got = world.get("alice-old", old)
    # Then the old items answer what the new ones do
    assert [m["message_id"] for m in got] == ids
    assert without_ids(got) == without_ids(world.get("alice-new", new))


def test_a_missing_archive_object_drops_its_deliveries_not_the_get(world: World) -> None:
    # Given a routed message whose archive object was deleted by hand (the lifecycle keeps the
    # archive longer than the inbox), and a later one
    channel = connected(world, "alice-1", "g/#")
    world.publish("g/a", "gone")
    world.route()
    (key,) = archive_keys(world)
    world.session.client("s3").delete_object(Bucket=get_config().buckets["archive"], Key=key)
    kept = world.publish("g/a", "kept")
    world.route()
    # When the session gets
    got = world.get("alice-1", channel)
    # Then it gets what can still be read, and the lost one is done (never asked for again)
    assert [m["message_id"] for m in got] == [kept]
    world.clock.advance(31)
    assert [m["message_id"] for m in world.get("alice-1", channel)] == [kept]
