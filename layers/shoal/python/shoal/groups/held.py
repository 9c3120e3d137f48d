"""The QoS 2 deliveries a shared group holds for a member (``q#<member>#<delivery id>``): an
unacked QoS 2 message stays with the member it went to, never to another (MQTT 5
[MQTT-4.8.2-5]), and goes to it again after the ack timeout or on its reconnect
(``shoal.groups.service``). Part of the group store (``GroupStore``), on its table."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from shoal.aws.dynamo import Dynamo, to_item
from shoal.groups.records import held_item, held_prefix
from shoal.groups.streams import StreamProgress, parse_delivery_id, stream_item


class HeldDeliveries:
    """The held items' reads and writes; the group store's ``dynamo`` and ``table``."""

    dynamo: Dynamo
    table: str

    def held(self, key: str, member_id: str) -> list[dict[str, Any]]:
        """The QoS 2 deliveries held for a member, strongly consistent."""
        return self.dynamo.query(
            self.table,
            KeyConditionExpression="#g = :g AND begins_with(#i, :p)",
            ExpressionAttributeNames={"#g": "group", "#i": "item"},
            ExpressionAttributeValues=to_item({":g": key, ":p": held_prefix(member_id)}),
            ConsistentRead=True,
        )

    def mark_held_sent(
        self, records: Sequence[Mapping[str, Any]], now_ms: int, channel: str
    ) -> list[str]:
        """When and to which channel held deliveries go again: one update each, on condition
        that the delivery is still held (an ack or the session's end may have removed it
        since it was read: a put of the record read would hold it again). The ids of those
        still held."""
        out: list[str] = []
        for record in records:
            if self.dynamo.conditional(
                "update_item",
                TableName=self.table,
                Key=to_item({"group": record["group"], "item": record["item"]}),
                UpdateExpression="SET #sa = :sa, #ch = :ch",
                ConditionExpression="attribute_exists(#i)",
                ExpressionAttributeNames={"#sa": "sa", "#ch": "ch", "#i": "item"},
                ExpressionAttributeValues=to_item({":sa": now_ms, ":ch": channel}),
            ):
                out.append(str(record["d"]))
        return out

    def release_held(self, key: str, member_id: str, delivery_ids: Iterable[str]) -> list[str]:
        """Remove held deliveries (acked, or dropped with the member's session): the ids that
        were still held."""
        out: list[str] = []
        for did in delivery_ids:
            if self.dynamo.conditional(
                "delete_item",
                TableName=self.table,
                Key=to_item({"group": key, "item": held_item(member_id, did)}),
                ConditionExpression="attribute_exists(#i)",
                ExpressionAttributeNames={"#i": "item"},
            ):
                out.append(did)
        return out

    def acked_since(self, member_id: str, delivery_ids: Iterable[str]) -> set[str]:
        """Of group deliveries a get sent ``member_id`` again, those done since: neither held
        for it off the stream nor outstanding on their stream (acked; a held one also when
        dropped with the member's session). A held QoS 2 delivery's ordinal was done on its
        stream when it was held, so the held item alone says it is outstanding. One strongly
        consistent batch read of the held items and the streams' progress."""
        parsed = {d: p for d in delivery_ids if (p := parse_delivery_id(d)) is not None}
        if not parsed:
            return set()
        held = {(p.group_key, held_item(member_id, d)) for d, p in parsed.items()}
        streams = {(p.group_key, stream_item(p.source)) for p in parsed.values()}
        rows = self.dynamo.batch_get(
            self.table, [{"group": g, "item": i} for g, i in sorted(held | streams)]
        )
        found = {(str(r["group"]), str(r["item"])): r for r in rows}
        out: set[str] = set()
        for did, p in parsed.items():
            if (p.group_key, held_item(member_id, did)) in found:
                continue
            raw = found.get((p.group_key, stream_item(p.source)))
            if raw is not None and StreamProgress.from_record(raw).is_done(p.ordinal):
                out.add(did)
        return out
