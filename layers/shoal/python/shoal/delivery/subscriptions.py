"""Subscribe and unsubscribe: the subscription store the router reads, the service that writes a
session's subscriptions, and the retirer of an ended session's subscriptions.

Subscriptions
-------------
A subscription lives twice, written by one transaction: in the session (``session.subscriptions``
on the registry's head item, conditional on the channel being live) and in the subscription
store the router reads (``shoal.aws.tables.SubscriptionItemModel``). The store is cut into *buckets*
by the filter's first level (``L:<level>``, or ``W`` when it is a wildcard), so the router reads
only the buckets a batch's topics can touch: ``W`` and the first levels of its topics. Each
bucket has a version item bumped by every change and one change record per version (kept a
day), so a router refreshes a bucket incrementally and detects a gap (then reloads it). The
router reads the versions strongly consistent once per batch: a subscription whose subscribe
returned before a publish is in the router's view of every batch holding that message.

A subscription has a *sid* (kept when the same filter is subscribed again); deliveries carry it,
and get drops a delivery whose subscription is gone or was replaced: unsubscribing drops the
subscription's undelivered messages without a write per message. A ``$share/{ShareName}/...``
subscription joins its shared group in the subscribe transaction, and leaves it in the
unsubscribe's (or the ended session's) one; get and ack take in the group streams the session
leases (``shoal.groups``).

Permissions: a requested filter must be *covered* by one of the principal's ``shoal:subscribe``
filters: every topic name the requested filter matches must be matched by the allowed one
(``covers``), with the ``$`` rule (``#`` does not cover ``$SYS/#``).


Retained messages
-----------------
A subscribe finds the retained messages of a filter through the retained table's
``by_composite`` index: the composite topic the filter's first level names and ``default`` (a
topic published before its composite topic existed), or every composite topic for a wildcard
first level; it matches the topic names in memory, reading at most ``MAX_RETAINED_SCAN`` index
entries per filter, then reads the matching messages strongly consistent. They are written to
the session's inbox in the subscribe's own transaction (source ``ret``, positioned by the
delivery state's version it bumps): at most ``MAX_RETAINED_PER_CALL`` messages and
``MAX_RETAINED_BYTES`` per call, once per topic however many new subscriptions match it.

The same transaction marks them in the delivery state (``retained_mark``), under every
subscription of the call they matched, with those a new subscription of retain handling 2
matches (sent to none): the router may be behind on one and route it to the new subscription
too, and get consumes such a routed copy (MQTT 5 §3.8.3.1, §4.1; ``docs/design.md``, "A
retained message reaches a new subscription once").


Ended sessions
--------------
A connect that discards a session, and the reaper when a session expires, remove its
subscriptions from the store (``SubscriptionRetirer``, a ``shoal.sessions.SessionEndHook``). A
connect that dies between its commit and that clean-up leaves them behind: the router then
keeps writing to an inbox no session reads (TTL removes it), which costs writes, never a wrong
delivery.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from shoal.aws import tables
from shoal.aws.dynamo import Dynamo, to_item
from shoal.core.auth import Principal
from shoal.core.clock import Clock, SystemClock
from shoal.core.config import Config, DeliverySettings
from shoal.core.errors import InvalidFilter, ServerBusy
from shoal.core.observability import logger
from shoal.core.retry import backoff_s
from shoal.delivery.events import SESSION_ENDED, Recording, record_ended
from shoal.delivery.inbox import InboxMessage, InboxStore, pack
from shoal.delivery.model import (
    ATTEMPTS,
    CHANGE_TTL_S,
    MAX_RETAINED_BYTES,
    MAX_RETAINED_PER_CALL,
    MAX_SUBSCRIPTIONS_PER_SESSION,
    RETAINED_GUARD_S,
    RETAINED_SOURCE,
    VERSION_ITEM,
    Change,
    SubscribeRequest,
    Subscription,
    SubscriptionRequest,
    UnsubscribeRequest,
    bucket_of,
    may_subscribe,
    position,
    record_end,
    retained_mark,
    subscription_item,
)
from shoal.delivery.ports import MembershipPlan, SharedGroups
from shoal.delivery.retained import RetainedReader
from shoal.records import Retained
from shoal.sessions.model import Channel, Head
from shoal.sessions.ports import ConnectionKeeps, KeptBy
from shoal.sessions.registry import SessionRegistry
from shoal.topics.filters import (
    MULTI_LEVEL,
    SINGLE_LEVEL,
    filter_problem,
    first_level,
    is_valid_filter,
    parse_shared,
)


def change_item(version: int) -> str:
    return f"c#{version:012d}"


class SubscriptionStore:
    """The subscriptions table: bucket versions, change records, subscriptions."""

    def __init__(self, dynamo: Dynamo, table: str) -> None:
        self.dynamo = dynamo
        self.table = table

    @classmethod
    def from_config(cls, config: Config) -> SubscriptionStore:
        return cls(Dynamo.from_config(config), config.table(tables.SUBSCRIPTIONS))

    def versions(self, buckets: Iterable[str]) -> dict[str, int]:
        """Each bucket's version (0: never written), strongly consistent, in one call per 100."""
        wanted = sorted(set(buckets))
        found = {b: 0 for b in wanted}
        keys = [{"bucket": b, "item": VERSION_ITEM} for b in wanted]
        for raw in self.dynamo.batch_get(self.table, keys):
            found[str(raw["bucket"])] = int(raw.get("v", 0))
        return found

    def load(self, bucket: str) -> list[Subscription]:
        """Every subscription of a bucket, strongly consistent."""
        rows = self.dynamo.query(
            self.table,
            KeyConditionExpression="#b = :b AND begins_with(#i, :s)",
            ExpressionAttributeNames={"#b": "bucket", "#i": "item"},
            ExpressionAttributeValues=to_item({":b": bucket, ":s": "s#"}),
            ConsistentRead=True,
        )
        return [Subscription.from_data(str(r["item"]), r) for r in rows]

    def changes(self, bucket: str, after: int, upto: int) -> list[Change] | None:
        """The changes that made versions ``after+1 .. upto``; None when one is missing."""
        rows = self.dynamo.query(
            self.table,
            KeyConditionExpression="#b = :b AND #i BETWEEN :lo AND :hi",
            ExpressionAttributeNames={"#b": "bucket", "#i": "item"},
            ExpressionAttributeValues=to_item(
                {":b": bucket, ":lo": change_item(after + 1), ":hi": change_item(upto)}
            ),
            ConsistentRead=True,
        )
        if [int(r["v"]) for r in rows] != list(range(after + 1, upto + 1)):
            return None
        return [Change.from_data(c) for r in rows for c in r.get("changes") or []]

    def parts(
        self, changes: Mapping[str, list[Change]], versions: Mapping[str, int], now_s: int
    ) -> list[dict[str, Any]]:
        """Transaction parts writing ``changes`` as the next version of each bucket."""
        out: list[dict[str, Any]] = []
        for bucket, bucket_changes in sorted(changes.items()):
            old = versions.get(bucket, 0)
            new = old + 1
            if old == 0:
                condition = "attribute_not_exists(#i)"
                values: dict[str, Any] = {":new": new}
            else:
                condition = "#v = :old"
                values = {":new": new, ":old": old}
            out.append(
                {
                    "Update": {
                        "TableName": self.table,
                        "Key": to_item({"bucket": bucket, "item": VERSION_ITEM}),
                        "UpdateExpression": "SET #v = :new",
                        "ConditionExpression": condition,
                        "ExpressionAttributeNames": {"#v": "v", "#i": "item"}
                        if old == 0
                        else {"#v": "v"},
                        "ExpressionAttributeValues": to_item(values),
                    }
                }
            )
            out.append(
                {
                    "Put": {
                        "TableName": self.table,
                        "Item": to_item(
                            {
                                "bucket": bucket,
                                "item": change_item(new),
                                "v": new,
                                "changes": [c.data() for c in bucket_changes],
                                "expires_at": now_s + CHANGE_TTL_S,
                            }
                        ),
                    }
                }
            )
            for change in bucket_changes:
                key = to_item({"bucket": bucket, "item": change.key})
                if change.subscription is None:
                    out.append({"Delete": {"TableName": self.table, "Key": key}})
                else:
                    record = {"bucket": bucket, "item": change.key, "v": new}
                    record |= change.subscription.data()
                    out.append({"Put": {"TableName": self.table, "Item": to_item(record)}})
        return out


@dataclass(frozen=True)
class _Accepted:
    request: SubscriptionRequest
    topic_filter: str
    share: str | None
    sid: str
    new: bool
    #: the subscription's cut: a new one's is this call's, a held one keeps its own (None: a
    #: subscription made before cuts existed); a shared one's is its group's (``plan.cuts``)
    cut_ms: int | None


@dataclass(frozen=True)
class _Sent:
    """A retained message a subscribe sends: under ``accepted``'s subscription (the highest
    QoS), and every subscription of the call it matched (``sids``)."""

    #: None: sent to none (only new subscriptions of retain handling 2 matched it)
    accepted: _Accepted | None
    retained: Retained
    sids: tuple[str, ...]


@dataclass
class SubscribeSent:
    """What a subscribe gave its session to be delivered."""

    #: retained messages written to the session's inbox
    retained: int = 0
    #: shared groups joined (a member may be granted streams with deliveries waiting)
    shared: bool = False

    @property
    def any(self) -> bool:
        return self.retained > 0 or self.shared


class SubscriptionService:
    """Subscribe and unsubscribe for a live channel, and retained messages on subscribe."""

    def __init__(
        self,
        registry: SessionRegistry,
        subscriptions: SubscriptionStore,
        inbox: InboxStore,
        settings: DeliverySettings,
        retained: RetainedReader,
        *,
        clock: Clock | None = None,
        groups: SharedGroups | None = None,
        connections: ConnectionKeeps | None = None,
    ) -> None:
        self.registry = registry
        self.subscriptions = subscriptions
        self.inbox = inbox
        self.settings = settings
        self.retained = retained
        self.clock = clock or SystemClock()
        #: shared subscriptions join and leave their groups (``shoal.groups``)
        self.groups = groups
        #: the WebSocket connection that holds a channel, if one does: it keeps the members a
        #: subscribe over HTTP joins as it keeps those a subscribe over it joins
        self.connections = connections

    # -- subscribe

    def subscribe(
        self,
        who: Principal,
        client_id: str,
        channel: Channel | None,
        request: SubscribeRequest,
        *,
        kept_by: KeptBy | None = None,
        sent: SubscribeSent | None = None,
    ) -> dict[str, Any]:
        """``kept_by``: the connection over the WebSocket API the subscribe came on, which
        keeps the session's members of the groups it joins live (``shoal.groups``).
        ``sent``: told what the subscribe gave the session to be delivered (retained
        messages written to its inbox, shared groups joined): a WebSocket subscribe pushes
        only then."""
        # read before anything else: any publish that returned before this call was made
        # arrived at Kinesis before this instant (give or take the clocks' skew)
        began = self.clock.now_ms()
        cut = began + self.settings.stream_skew_ms
        head = self.registry.require_live(who, client_id, channel)
        granted: list[int | str] = []
        accepted: dict[str, _Accepted] = {}
        held = set(head.subscriptions)
        for wanted in request.subscriptions:
            code = self._check(who, wanted)
            if (
                code is None
                and wanted.filter not in held
                and wanted.filter not in accepted
                and len(held) + len(accepted) >= MAX_SUBSCRIPTIONS_PER_SESSION
            ):
                code = "quota_exceeded"
            if code is not None:
                granted.append(code)
                continue
            shared = parse_shared(wanted.filter)
            existing = head.subscriptions.get(wanted.filter)
            sid = str(existing["sid"]) if existing and existing.get("sid") else _new_sid()
            if existing is None:
                kept: int | None = cut
            else:
                # subscribing again replaces the options, never the start: nothing the held
                # subscription was due is taken back (MQTT 5 §3.8.4: the flow goes on)
                kept = None if existing.get("cut") is None else int(existing["cut"])
            accepted[wanted.filter] = _Accepted(
                wanted,
                shared[1] if shared else wanted.filter,
                shared[0] if shared else None,
                sid,
                new=existing is None,
                cut_ms=kept,
            )
            granted.append(wanted.qos)
        if not accepted:
            if granted and all(g == "invalid_filter" for g in granted):
                # the first filter's broken rule, named (MQTT 5 §4.7, §4.8.2)
                why = filter_problem(request.subscriptions[0].filter)
                raise InvalidFilter(why or "no filter of the request is a valid topic filter")
            return {"granted": granted}
        made = self._commit_subscribe(
            who, client_id, head, accepted, cut, kept_by=kept_by, sent=sent
        )
        if cut in made:
            self._wait_out(cut)
        return {"granted": granted}

    def _wait_out(self, cut: int) -> None:
        """Return only once this clock is past ``cut`` + the skew: a publish called after the
        subscribe returned then arrives at Kinesis after the cut, however the clocks differ
        within the bound (``docs/design.md``, "A subscription starts where it was made")."""
        until = cut + self.settings.stream_skew_ms + 1
        while (left := until - self.clock.now_ms()) > 0:
            self.clock.sleep(left / 1000)

    def _check(self, who: Principal, wanted: SubscriptionRequest) -> str | None:
        try:
            shared = parse_shared(wanted.filter)
        except InvalidFilter:
            return "invalid_filter"
        topic_filter = shared[1] if shared else wanted.filter
        if not is_valid_filter(topic_filter):
            return "invalid_filter"
        if not may_subscribe(who, topic_filter):
            return "not_authorized"
        if shared and wanted.no_local:
            # [MQTT-3.8.3-4]: No Local on a shared subscription is a protocol error; the
            # HTTP API refuses that filter alone, as it does an unauthorized one
            return "no_local_on_shared"
        if not shared and wanted.lanes is not None:
            # lanes split a shared group's work; a filter of one session has nothing to split
            return "lanes_not_shared"
        return None

    def _commit_subscribe(
        self,
        who: Principal,
        client_id: str,
        head: Head,
        accepted: Mapping[str, _Accepted],
        cut: int,
        *,
        kept_by: KeptBy | None = None,
        sent: SubscribeSent | None = None,
    ) -> set[int | None]:
        """Commits the subscriptions; answers the cuts they were written with."""
        session_id = head.session_id or ""
        shared = [text for text, a in accepted.items() if a.share is not None]
        lanes = {
            text: a.request.lanes
            for text, a in accepted.items()
            if a.share is not None and a.request.lanes is not None
        }
        # the join of a shared subscription's group is read again on every attempt
        joining = self.groups if shared else None
        if joining is not None and kept_by is None and self.connections is not None:
            # over HTTP, on a channel a WebSocket connection may hold: an idle connection runs
            # nothing that would renew the member's lease, so the connection keeps it live
            kept_by = self.connections.kept_by(session_id, channel_of(head))
        incarnations: Mapping[str, str] = {}
        retained = self._retained(accepted)
        for attempt in range(ATTEMPTS):
            plan = None
            if joining is not None:
                plan = joining.membership(
                    client_id, session_id, joins=shared, lanes=lanes, cut_ms=cut, kept_by=kept_by
                )
                incarnations = plan.incarnations
                # a shared subscription starts where its group did
                accepted = {
                    text: replace(a, cut_ms=plan.cuts.get(text)) if a.share is not None else a
                    for text, a in accepted.items()
                }
            reasons = self._try_subscribe(
                client_id, head, accepted, retained=retained, incarnations=incarnations, plan=plan
            )
            if reasons is None:
                if joining is not None and plan is not None:
                    # a member that joined is granted its streams now, not at its next call
                    joining.after(plan)
                if sent is not None:
                    sent.retained = len(retained)
                    sent.shared = bool(shared)
                return {a.cut_ms for a in accepted.values()}
            self._after_conflict(who, client_id, channel_of(head), reasons, attempt)
        raise ServerBusy("subscriptions of this session are contended; retry")

    def _try_subscribe(
        self,
        client_id: str,
        head: Head,
        accepted: Mapping[str, _Accepted],
        *,
        retained: list[_Sent],
        incarnations: Mapping[str, str],
        plan: MembershipPlan | None,
    ) -> list[str] | None:
        """One attempt at the subscribe transaction: None when it committed, else the reasons."""
        session_id = head.session_id or ""
        changes: dict[str, list[Change]] = {}
        options: dict[str, dict[str, Any]] = {}
        for text, a in accepted.items():
            subscription = Subscription(
                key=subscription_item(client_id, text),
                client_id=client_id,
                session_id=session_id,
                filter=text,
                qos=a.request.qos,
                sid=a.sid,
                owner=head.sub,
                no_local=a.request.no_local,
                share=a.share,
                group=incarnations.get(text),
                cut_ms=a.cut_ms,
            )
            changes.setdefault(bucket_of(a.topic_filter), []).append(
                Change(subscription.key, subscription)
            )
            option: dict[str, Any] = {
                "qos": a.request.qos,
                "no_local": a.request.no_local,
                "retain_handling": a.request.retain_handling,
                "sid": a.sid,
            }
            if a.share is not None:
                option["share"] = a.share
            if text in incarnations:
                option["group"] = incarnations[text]
            if a.cut_ms is not None:
                option["cut"] = a.cut_ms
            options[text] = option
        now = self.clock.now_ms()
        versions = self.subscriptions.versions(changes)
        parts = [self.registry.repository.subscriptions_part(client_id, head, now, put=options)]
        parts += self.subscriptions.parts(changes, versions, now // 1000)
        if plan is not None:
            parts += plan.parts
        if retained:
            # every subscription the session holds once this commits: marks of others go
            sids = [str(o["sid"]) for o in head.subscriptions.values() if o.get("sid")]
            sids += [o["sid"] for o in options.values()]
            parts += self._retained_parts(
                session_id, retained, now, room=100 - len(parts), sids=sids
            )
        return self.subscriptions.dynamo.transact(parts)

    def _after_conflict(
        self, who: Principal, client_id: str, channel: Channel, reasons: list[str], attempt: int
    ) -> None:
        if reasons and reasons[0] == "ConditionalCheckFailed":
            # the head's condition: the channel is no longer live (this raises)
            self.registry.require_live(who, client_id, channel)
        self.clock.sleep(backoff_s(attempt, 0.01, 0.2))

    # -- retained messages

    def _retained(self, accepted: Mapping[str, _Accepted]) -> list[_Sent]:
        """Retained messages the new subscriptions get, per retain_handling, in topic order;
        and those a new subscription of retain handling 2 matches, sent to none (marked only:
        ``_retained_parts``)."""
        looked_up = [
            a
            for a in accepted.values()
            # shared subscriptions get no retained messages (MQTT 5 §3.8.3.1, Retain Handling)
            if a.share is None and (a.request.retain_handling == 0 or a.new)
        ]
        if not looked_up:
            return []
        chosen: dict[str, tuple[_Accepted, Retained]] = {}
        found: dict[str, Retained] = {}
        matched: dict[str, list[str]] = {}
        composites: list[str] | None = None
        for a in looked_up:
            if first_level(a.topic_filter) in (SINGLE_LEVEL, MULTI_LEVEL) and composites is None:
                composites = sorted(set(self.retained.topic_names()))
            for r in self.retained.matching(a.topic_filter, composites):
                found[r.topic] = r
                matched.setdefault(r.topic, []).append(a.sid)
                if a.request.retain_handling == 2:
                    continue
                # one delivery per retained message, as for published ones: several new
                # subscriptions of the call matching it send it once, with the highest QoS
                qos = min(a.request.qos, r.qos)
                held = chosen.get(r.topic)
                if held is None or qos > min(held[0].request.qos, held[1].qos):
                    chosen[r.topic] = (a, r)
        return [
            _Sent(chosen[t][0] if t in chosen else None, found[t], tuple(matched[t]))
            for t in sorted(found)
        ]

    def _retained_parts(
        self,
        session_id: str,
        retained: list[_Sent],
        now_ms: int,
        room: int,
        sids: list[str],
    ) -> list[dict[str, Any]]:
        """The state's version bump and the inbox items holding the retained deliveries.

        The state remembers the ones the router may still be behind on (``retained_mark``),
        in this same transaction: a crash leaves either both or neither."""
        state = self.inbox.state(session_id)
        expected = state.version
        state.version += 1
        messages: list[InboxMessage] = []
        total = 0
        by_id = {sent.retained.message_id: sent.sids for sent in retained}
        sending = [(sent.accepted, sent.retained) for sent in retained if sent.accepted]
        for n, (a, r) in enumerate(sending):
            properties = json.loads(r.properties) if r.properties else {}
            expiry = properties.get("message_expiry_s")
            expires_at = None if expiry is None else int(r.published_at_ms) + int(expiry) * 1000
            if expires_at is not None and expires_at <= now_ms:
                continue
            payload = bytes(r.payload or b"")
            if n >= MAX_RETAINED_PER_CALL or total + len(payload) > MAX_RETAINED_BYTES:
                logger.warning("retained messages beyond the per-subscribe bound were not sent")
                break
            total += len(payload)
            messages.append(
                InboxMessage(
                    position=position(state.version, len(messages)),
                    message_id=str(r.message_id),
                    topic=str(r.topic),
                    payload=payload,
                    qos=min(a.request.qos, int(r.qos)),
                    subscription=a.request.filter,
                    sid=a.sid,
                    published_at_ms=int(r.published_at_ms),
                    expires_at_ms=expires_at,
                    properties=properties,
                    retain=True,
                )
            )
        # new subscriptions of retain handling 2 get none, and no routed copy either
        silent = [sent for sent in retained if sent.accepted is None]
        if not messages and not silent:
            return []
        expires = now_ms // 1000 + self.settings.retention_s
        items = pack(session_id, RETAINED_SOURCE, messages, record_end(state.version), expires)[
            : max(0, room - 1)
        ]
        # MQTT 5 §3.8.3.1 (Retain Handling), §4.1: a message published before the SUBSCRIBE
        # reaches the new subscriptions as a retained message only; a router behind on it would
        # route it there too, once it sees them. Marked under each subscription of this call
        # it matched (the router names the one of highest QoS, so perhaps not the one the
        # retained copy names), for the messages published within RETAINED_GUARD_S (an older
        # one the router passed long ago); get consumes their routed copies
        guard_ms = RETAINED_GUARD_S * 1000
        state.forget(now_ms, sids)
        state.remember(
            {
                retained_mark(sid, m.message_id): (m.published_at_ms + guard_ms) // 1000 + 1
                for item in items
                for m in item.messages
                if m.published_at_ms + guard_ms > now_ms
                for sid in by_id[m.message_id]
            }
            | {
                retained_mark(sid, s.retained.message_id): (
                    (s.retained.published_at_ms + guard_ms) // 1000 + 1
                )
                for s in silent
                if s.retained.published_at_ms + guard_ms > now_ms
                for sid in s.sids
            }
        )
        parts: list[dict[str, Any]] = [
            {"Put": self.inbox.state_part(session_id, state, expected, expires)}
        ]
        parts += [self.inbox.put_transaction_part(i) for i in items]
        return parts

    # -- unsubscribe

    def unsubscribe(
        self, who: Principal, client_id: str, channel: Channel | None, request: UnsubscribeRequest
    ) -> dict[str, Any]:
        head = self.registry.require_live(who, client_id, channel)
        results: list[str] = []
        dropping: dict[str, None] = {}
        for text in request.filters:
            if text in head.subscriptions:
                dropping[text] = None
                results.append("success")
            else:
                results.append("no_subscription_existed")
        if dropping:
            changes: dict[str, list[Change]] = {}
            for text in dropping:
                shared = _shared_or_none(text)
                topic_filter = shared[1] if shared else text
                changes.setdefault(bucket_of(topic_filter), []).append(
                    Change(subscription_item(client_id, text), None)
                )
            leaving = {t: head.subscriptions[t] for t in dropping if _shared_or_none(t)}
            for attempt in range(ATTEMPTS):
                now = self.clock.now_ms()
                versions = self.subscriptions.versions(changes)
                parts = [
                    self.registry.repository.subscriptions_part(
                        client_id, head, now, remove=list(dropping)
                    )
                ]
                parts += self.subscriptions.parts(changes, versions, now // 1000)
                plan = None
                if leaving and self.groups is not None:
                    # leaving a group (the last member removes it) rides in the same transaction
                    plan = self.groups.membership(client_id, head.session_id or "", leaves=leaving)
                    parts += plan.parts
                reasons = self.subscriptions.dynamo.transact(parts)
                if reasons is None:
                    if plan is not None and self.groups is not None:
                        self.groups.after(plan)
                    break
                self._after_conflict(who, client_id, channel_of(head), reasons, attempt)
            else:
                raise ServerBusy("subscriptions of this session are contended; retry")
        return {"unsubscribed": results}


class SubscriptionRetirer:
    """Removes an ended session's subscriptions from the store (``SessionEndHook``).

    Only the store: the head is gone or holds the new session. Idempotent; a subscription the
    new session made since (same key, another session id) stays.
    """

    def __init__(
        self,
        subscriptions: SubscriptionStore,
        clock: Clock | None = None,
        groups: SharedGroups | None = None,
        *,
        events: Recording | None = None,
    ) -> None:
        self.subscriptions = subscriptions
        self.clock = clock or SystemClock()
        #: the ended session leaves its shared groups (the last member removes a group)
        self.groups = groups
        #: where the session's ``ended`` event goes (None: recorded nowhere)
        self.events = events

    def __call__(self, client_id: str, head: Head) -> int:
        """How many subscriptions it removed."""
        removed = 0
        for text in head.subscriptions:
            shared = _shared_or_none(text)
            bucket = bucket_of(shared[1] if shared else text)
            key = subscription_item(client_id, text)
            for attempt in range(ATTEMPTS):
                now = self.clock.now_ms()
                versions = self.subscriptions.versions([bucket])
                parts = self.subscriptions.parts(
                    {bucket: [Change(key, None)]}, versions, now // 1000
                )
                # the delete only while the item still belongs to the ended session
                delete = parts[-1]["Delete"]
                delete["ConditionExpression"] = "#sid = :sid"
                delete["ExpressionAttributeNames"] = {"#sid": "session_id"}
                delete["ExpressionAttributeValues"] = to_item({":sid": head.session_id})
                plan = None
                if shared is not None and self.groups is not None:
                    plan = self.groups.membership(
                        client_id, head.session_id or "", leaves={text: head.subscriptions[text]}
                    )
                    # first: the subscription's delete stays the last part (checked below)
                    parts = plan.parts + parts
                reasons = self.subscriptions.dynamo.transact(parts)
                if reasons is None:
                    if plan is not None and self.groups is not None:
                        self.groups.after(plan)
                    removed += 1
                    break
                if len(reasons) == len(parts) and reasons[-1] == "ConditionalCheckFailed":
                    break  # gone already, or the new session's own
                self.clock.sleep(backoff_s(attempt, 0.01, 0.2))
        self._record_end(head)
        return removed

    def _record_end(self, head: Head) -> None:
        """The session's ``ended`` event: what its inbox still holds unacked goes with it, and
        the audit counts it dropped, not lost. After the subscriptions went, so an end retried
        after a crash records it again (one record: the same key hint)."""
        if head.session_id:
            record_ended(
                self.events, "session", head.session_id, SESSION_ENDED, f"ended/{head.session_id}"
            )


def channel_of(head: Head) -> str:
    return head.newest.channel


def _shared_or_none(text: str) -> tuple[str, str] | None:
    try:
        return parse_shared(text)
    except InvalidFilter:
        return None


def _new_sid() -> str:
    return os.urandom(4).hex()
