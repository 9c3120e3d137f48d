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

    def acked_since_by_member(
        self, delivery_ids: Mapping[str, Iterable[str]]
    ) -> dict[str, set[str]]:
        """Of group deliveries sent each member (a push's copies sent again, the sweep's
        sessions), those done since: neither held for it off the stream nor outstanding on
        their stream (acked; a held one also when dropped with the member's session). A held
        QoS 2 delivery's ordinal was done on its stream when it was held, so the held item
        alone says it is outstanding. One strongly consistent batch read of the held items and
        the streams' progress (100 keys a call), a stream's item once for all its members."""
        parsed = {
            member: {d: p for d in ids if (p := parse_delivery_id(d)) is not None}
            for member, ids in delivery_ids.items()
        }
        keys: set[tuple[str, str]] = set()
        for member, mine in parsed.items():
            keys |= {(p.group_key, held_item(member, d)) for d, p in mine.items()}
            keys |= {(p.group_key, stream_item(p.source)) for p in mine.values()}
        if not keys:
            return {member: set() for member in parsed}
        rows = self.dynamo.batch_get(self.table, [{"group": g, "item": i} for g, i in sorted(keys)])
        found = {(str(r["group"]), str(r["item"])): r for r in rows}
        progress: dict[tuple[str, str], StreamProgress] = {}
        out: dict[str, set[str]] = {}
        for member, mine in parsed.items():
            done = out[member] = set()
            for did, p in mine.items():
                if (p.group_key, held_item(member, did)) in found:
                    continue
                where = (p.group_key, stream_item(p.source))
                raw = found.get(where)
                if raw is None:
                    continue
                if where not in progress:
                    progress[where] = StreamProgress.from_record(raw)
                if progress[where].is_done(p.ordinal):
                    done.add(did)
        return out
