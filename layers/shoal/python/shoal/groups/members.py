"""A group's member items (``m#<member>``): renewals and agent views, the keep a WebSocket
connection holds on a member and its release, and the fenced-off mark. Part of the group store
(``GroupStore``), on its table: each write touches its own attributes only, so that writers of
different attributes (a heartbeat, a connection's end) never undo each other."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from shoal.aws.dynamo import Dynamo, to_item
from shoal.core.config import GroupSettings
from shoal.core.errors import ServerBusy
from shoal.groups.records import Keep, Loaded, member_item

#: optimistic-concurrency attempts on a group's leader or a stream's progress
ATTEMPTS = 12


class MemberItems:
    """The member items' writes; the group store's ``dynamo`` and ``table``."""

    dynamo: Dynamo
    table: str
    settings: GroupSettings

    def renew_members(
        self, records: Sequence[Mapping[str, Any]], lost: Mapping[str, Any] | None = None
    ) -> None:
        """Members' renewals and agent views (``member_record``s): one update of each item,
        of those alone. A batch of whole items (a call for up to 25) put back the keep and
        release the heartbeat had read: a connection's end written in between was undone, and
        the gone member was kept live, holding its lanes, up to the keep's bound (two hours).
        The cost: a call per group the session is in, where the batch made one per 25; the
        same write units. Each write stands alone, as the batch's did.

        ``lost``: by record's group, the fenced-off mark (``lost``) the caller read on the
        member's item (``Loaded.lost``), the only one its write clears."""
        for record in records:
            self._renew_member(record, (lost or {}).get(str(record["group"])))

    def _renew_member(self, record: Mapping[str, Any], seen: Any) -> None:
        """One member item's renewal and view. Two races of the heartbeat's read and its
        write are settled by conditions on the update, which cost no call unless they refuse:

        - a fenced write's mark (``lost``) written after the read stays. The view was
          computed from the read, so it knows nothing of that fence: removing the mark left
          the agent sure of a lease it had lost. The update removes a mark only when the
          read found one, and only that one (``lost`` writes a new token each time); a
          refusal for a newer mark writes again without the removal (the view goes: what
          the agent is told now; the mark makes it start over at the next heartbeat).
        - the renewal ``r`` never goes back: a write of an older time (another heartbeat, or
          a get's ``renew``, of a later time landed first) would make the member look lapsed
          early, as the lease timeout counts from ``r``. A refusal for a newer ``r`` writes
          again without it: the view is the heartbeat's to write (a get's renewal writes no
          view).

        The view itself is not ordered: of two heartbeats in flight the last to land writes
        it, as before (each adopted the leader as it read it).
        """
        key = to_item({"group": record["group"], "item": record["item"]})
        renewing = True
        clearing = seen is not None
        for _ in range(ATTEMPTS):
            names = {"#vw": "vw", "#inc": "inc"}
            values: dict[str, Any] = {":vw": record["vw"], ":inc": record["inc"]}
            sets = ["#vw = :vw", "#inc = :inc"]
            # the keep and release attributes stay as they are now
            conditions = ["(attribute_not_exists(#inc) OR #inc = :inc)"]
            if renewing:
                names["#r"], values[":r"] = "r", record["r"]
                sets.append("#r = :r")
                conditions.append("(attribute_not_exists(#r) OR #r <= :r)")
            expression = "SET " + ", ".join(sets)
            if clearing:
                # the view is in sync with the leader as read after that mark: it goes (gone
                # already, by another heartbeat, is fine too)
                names["#lost"], values[":lost"] = "lost", seen
                expression += " REMOVE #lost"
                conditions.append("(attribute_not_exists(#lost) OR #lost = :lost)")
            found = self.dynamo.conditional_old(
                "update_item",
                TableName=self.table,
                Key=key,
                UpdateExpression=expression,
                ConditionExpression=" AND ".join(conditions),
                ExpressionAttributeNames=names,
                ExpressionAttributeValues=to_item(values),
            )
            if found is None:
                return
            if found.get("inc") is not None and found["inc"] != record["inc"]:
                # an earlier incarnation's item (one more call, once): its keep, release,
                # renewal and mark were no membership's of this incarnation, so the whole
                # record replaces it
                if self.dynamo.conditional(
                    "put_item",
                    TableName=self.table,
                    Item=to_item(record),
                    ConditionExpression="#inc <> :inc",
                    ExpressionAttributeNames={"#inc": "inc"},
                    ExpressionAttributeValues=to_item({":inc": record["inc"]}),
                ):
                    return
                continue
            if renewing and int(found.get("r", 0)) > int(record["r"]):
                renewing = False  # a newer renewal landed first: it stays
            if clearing and found.get("lost") not in (None, seen):
                clearing = False  # marked again since the read: that mark stays
        raise ServerBusy("this group member's item is contended; retry")

    def renew_if_due(self, loaded: Loaded, member_id: str, now: int) -> None:
        """A member that gets is alive: its renewal is written once a third of the lease
        timeout passed since the last (a client that long-polls keeps its streams between
        heartbeats, and a get costs no write for it most of the time)."""
        member = loaded.state.members.get(member_id)
        if member is None or member.kept_until_ms > now + self.settings.lease_timeout_ms:
            # a member its connection keeps live needs no renewal
            return
        stored = loaded.renewed.get(member_id, 0)
        if now - stored >= self.settings.lease_timeout_ms // 3:
            self.renew(loaded.key, loaded.state.incarnation, member_id, now)

    def renew(self, key: str, incarnation: str, member_id: str, now_ms: int) -> None:
        """A member's renewal alone (its view stays as it is): no condition a racing member
        can fail, and no write of the leader. Refused (no error) when the item holds a newer
        renewal already: a renewal never goes back (``_renew_member``)."""
        self.dynamo.conditional(
            "update_item",
            TableName=self.table,
            Key=to_item({"group": key, "item": member_item(member_id)}),
            UpdateExpression="SET #r = :r, #inc = :inc",
            # an item an earlier incarnation left behind is the heartbeat's to replace
            ConditionExpression=(
                "(attribute_not_exists(#inc) OR #inc = :inc)"
                " AND (attribute_not_exists(#r) OR #r < :r)"
            ),
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
        """A member's write was fenced off: its agent goes back to connecting. The mark is a
        new token each time (items of older versions hold ``true``), so that a heartbeat
        that read one mark clears that one only, never a mark written after its read."""
        self.dynamo.conditional(
            "update_item",
            TableName=self.table,
            Key=to_item({"group": key, "item": member_item(member_id)}),
            UpdateExpression="SET #lost = :mark",
            ConditionExpression="attribute_exists(#vw)",
            ExpressionAttributeNames={"#vw": "vw", "#lost": "lost"},
            ExpressionAttributeValues=to_item({":mark": os.urandom(8).hex()}),
        )
