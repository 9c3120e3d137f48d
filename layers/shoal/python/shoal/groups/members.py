"""A group's member items (``m#<member>``): renewals and agent views, the keep a WebSocket
connection holds on a member and its release, and the fenced-off mark. Part of the group store
(``GroupStore``), on its table: each write touches its own attributes only, so that writers of
different attributes (a heartbeat, a connection's end) never undo each other."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from shoal.aws.dynamo import Dynamo, to_item
from shoal.core.errors import ServerBusy
from shoal.groups.records import Keep, Loaded, member_item

#: optimistic-concurrency attempts on a group's leader or a stream's progress
ATTEMPTS = 12


class MemberItems:
    """The member items' writes; the group store's ``dynamo`` and ``table``."""

    dynamo: Dynamo
    table: str

    def renew_members(self, records: Sequence[Mapping[str, Any]]) -> None:
        """Members' renewals and agent views (``member_record``s): one update of each item,
        of those alone. A batch of whole items (a call for up to 25) put back the keep and
        release the heartbeat had read: a connection's end written in between was undone, and
        the gone member was kept live, holding its lanes, up to the keep's bound (two hours).
        The cost: a call per group the session is in, where the batch made one per 25; the
        same write units. Each write stands alone, as the batch's did."""
        for record in records:
            self._renew_member(record)

    def _renew_member(self, record: Mapping[str, Any]) -> None:
        key = to_item({"group": record["group"], "item": record["item"]})
        names = {"#r": "r", "#vw": "vw", "#inc": "inc", "#lost": "lost"}
        for _ in range(ATTEMPTS):
            if self.dynamo.conditional(
                "update_item",
                TableName=self.table,
                Key=key,
                # the keep and release attributes stay as they are now; the view is in sync
                # with the leader, so a fenced write's mark goes (as the batch's put did)
                UpdateExpression="SET #r = :r, #vw = :vw, #inc = :inc REMOVE #lost",
                ConditionExpression="attribute_not_exists(#inc) OR #inc = :inc",
                ExpressionAttributeNames=names,
                ExpressionAttributeValues=to_item(
                    {":r": record["r"], ":vw": record["vw"], ":inc": record["inc"]}
                ),
            ):
                return
            # an earlier incarnation's item (one more call, once): its keep and release were
            # no membership's of this incarnation, so the whole record replaces it
            if self.dynamo.conditional(
                "put_item",
                TableName=self.table,
                Item=to_item(record),
                ConditionExpression="#inc <> :inc",
                ExpressionAttributeNames={"#inc": "inc"},
                ExpressionAttributeValues=to_item({":inc": record["inc"]}),
            ):
                return
        raise ServerBusy("this group member's item is contended; retry")

    def renew(self, key: str, incarnation: str, member_id: str, now_ms: int) -> None:
        """A member's renewal alone (its view stays as it is): no condition a racing member
        can fail, and no write of the leader."""
        self.dynamo.conditional(
            "update_item",
            TableName=self.table,
            Key=to_item({"group": key, "item": member_item(member_id)}),
            UpdateExpression="SET #r = :r, #inc = :inc",
            # an item an earlier incarnation left behind is the heartbeat's to replace
            ConditionExpression="attribute_not_exists(#inc) OR #inc = :inc",
            ExpressionAttributeNames={"#r": "r", "#inc": "inc"},
            ExpressionAttributeValues=to_item({":r": now_ms, ":inc": incarnation}),
        )

    def keep(self, key: str, incarnation: str, member_id: str, keep: Keep) -> bool:
        """A connection keeps the member live: one update of its item, on condition that the
        item is this incarnation's (or new). False when it is an earlier incarnation's."""
        return self.dynamo.conditional(
            "update_item",
            TableName=self.table,
            Key=to_item({"group": key, "item": member_item(member_id)}),
            UpdateExpression="SET #kc = :kc, #kch = :kch, #ku = :ku, #ka = :ka, #inc = :inc",
            ConditionExpression="attribute_not_exists(#inc) OR #inc = :inc",
            ExpressionAttributeNames={
                "#kc": "kc",
                "#kch": "kch",
                "#ku": "ku",
                "#ka": "ka",
                "#inc": "inc",
            },
            ExpressionAttributeValues=to_item(
                {
                    ":kc": keep.connection_id,
                    ":kch": keep.channel,
                    ":ku": keep.until_ms,
                    ":ka": keep.at_ms,
                    ":inc": incarnation,
                }
            ),
        )

    def release(self, loaded: Loaded, member_id: str, now_ms: int) -> bool:
        """The keep ``loaded`` read for the member ends now (renewals before count no more):
        one update, on condition that the same connection still keeps it. False when another
        keeps it now (or none does)."""
        keep = loaded.kept[member_id]
        return self.dynamo.conditional(
            "update_item",
            TableName=self.table,
            Key=to_item({"group": loaded.key, "item": member_item(member_id)}),
            UpdateExpression="REMOVE #kc, #kch, #ku, #ka SET #ke = :ke",
            ConditionExpression="#kc = :kc AND #ka = :ka",
            ExpressionAttributeNames={
                "#kc": "kc",
                "#kch": "kch",
                "#ku": "ku",
                "#ka": "ka",
                "#ke": "ke",
            },
            ExpressionAttributeValues=to_item(
                {":kc": keep.connection_id, ":ka": keep.at_ms, ":ke": now_ms}
            ),
        )

    def lost(self, key: str, member_id: str) -> None:
        """A member's write was fenced off: its agent goes back to connecting."""
        self.dynamo.conditional(
            "update_item",
            TableName=self.table,
            Key=to_item({"group": key, "item": member_item(member_id)}),
            UpdateExpression="SET #lost = :true",
            ConditionExpression="attribute_exists(#vw)",
            ExpressionAttributeNames={"#vw": "vw", "#lost": "lost"},
            ExpressionAttributeValues=to_item({":true": True}),
        )
