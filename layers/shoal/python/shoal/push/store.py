"""Where push subscriptions live in DynamoDB: subscription items, push tap items and key states.

With ``shoal.push.queues`` (Kinesis and Lambda), the only push module that speaks to AWS.

Push taps
---------
Lambda refuses a second Kinesis mapping of one function on one stream, and a Kinesis event
does not say which mapping sent it, so one mapping per (subscription, storage stream) cannot
work. Each storage stream that push subscriptions read has one *push tap*: one mapping of the
push function, whose invocations serve every member subscription. Each member keeps its own
*cursor* per shard (the last sequence number it processed, and its arrival time) in its
subscription item, plus a ``from`` time; a record at or before the cursor, or older than
``from``, is not for it. A seek moves one member's cursor; a rewind also replaces the tap's
mapping by one that starts no later than every member's position, and the other members skip
what they processed already. A tap also reads each shard once for all its members, where a
mapping per subscription would share Kinesis' five reads per second per shard among them.

A tap's mapping runs ``lanes`` lanes per shard (its ParallelizationFactor): the largest
``parallelism`` of its members, or one behind the produce pointer (only a single-lane tap
passes the ordered drain's seals: ``shoal.push.admin.tap_lanes``). Lanes split a shard by
partition key, which is the ordering key (``shoal.publish``), so each key stays in order in
its lane, but one lane may run ahead of another: a shard cursor moved by one lane would pass
records another lane still holds. So while ``lanes`` > 1 the cursors stay where they are and
each key's progress is marked in its key state instead (``KeyState.marks``). ``lanes`` is
raised before the mapping runs more lanes and lowered only after it runs fewer, so it never
says fewer lanes than may be running.

Retry queues have a mapping each (the stream names its subscription).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from shoal.aws import tables
from shoal.aws.dynamo import MAX_BATCH_WRITE, Dynamo, Expression, from_item, to_item
from shoal.aws.kinesis import Streams
from shoal.core.clock import Clock
from shoal.core.config import Config
from shoal.core.errors import ServerBusy, SubscriptionNotFound
from shoal.core.observability import logger
from shoal.push.entries import ordering_digest
from shoal.push.model import CREATING, DELETING, PushSubscription, ShardCursor, Spec, Tap
from shoal.push.queues import Queues
from shoal.push.state import KeyState

TAP_PREFIX = "tap#"
#: a new member starts this long before its creation: Kinesis stamps arrivals by its own clock
SKEW_MS = 5_000
#: tap mapping changes are serialized by a lock held this long (its stored attributes keep
#: their first names, lease_until_ms and lease_token; "lease" in the code is the groups' word)
TAP_LOCK_MS = 30_000
#: what the push function and the admin treat as "AWS did not answer": retry later
INFRASTRUCTURE_ERRORS = (ServerBusy, ClientError, BotoCoreError)
_TAP_NOT_CHANGED = "the push tap could not be changed; retry"


@contextmanager
def _busy(what: str) -> Iterator[None]:
    """Any failure of a call (throttled, refused, unreachable) as ``ServerBusy``: the admin
    answers 503 and the push function gives the record back, both to be tried again."""
    try:
        yield
    except INFRASTRUCTURE_ERRORS as exc:
        raise ServerBusy(what) from exc


def _alias(expr: Expression, name: str) -> str:
    """An alias of a map key that may hold any character (a stream, shard or subscription
    name: ``Expression.n`` would split it at a dot, and an alias holds no dash)."""
    alias = f"#k{len(expr.names)}"
    expr.names[alias] = name
    return alias


def _entry(expr: Expression, attribute: str, key: str) -> str:
    """The path of one entry of a map attribute (``cursors.<stream>``, ``members.<name>``)."""
    return f"{expr.n(attribute)}.{_alias(expr, key)}"


def _set(expr: Expression, path: str, value: Any) -> None:
    """SET a path aliased already (``Expression.set`` aliases the path it is given)."""
    expr.sets.append(f"{path} = {expr.v(value)}")


# -- subscriptions and taps -----------------------------------------------------------------


class PushSubscriptionStore:
    """Subscription items and tap items (``shoal.aws.tables.PushSubscriptionModel``)."""

    def __init__(self, dynamo: Dynamo, table: str, clock: Clock) -> None:
        self.dynamo = dynamo
        self.table = table
        self.clock = clock

    @classmethod
    def from_config(cls, config: Config, clock: Clock) -> PushSubscriptionStore:
        return cls(Dynamo.from_config(config), config.table(tables.PUSH_SUBSCRIPTIONS), clock)

    def load(self, name: str) -> PushSubscription | None:
        with _busy("the subscription could not be read; retry"):
            record = self.dynamo.get(self.table, {"name": name})
        return PushSubscription.from_record(record) if record and record.get("spec") else None

    def require(self, name: str) -> PushSubscription:
        """The subscription named ``name``; SubscriptionNotFound when there is none."""
        sub = self.load(name) if isinstance(name, str) else None
        if sub is None:
            raise SubscriptionNotFound(f"no push subscription named {name}")
        return sub

    def load_many(self, names: Iterable[str]) -> dict[str, PushSubscription]:
        wanted = sorted(set(names))
        with _busy("subscriptions could not be read; retry"):
            records = self.dynamo.batch_get(self.table, [{"name": n} for n in wanted])
        return {str(r["name"]): PushSubscription.from_record(r) for r in records if r.get("spec")}

    def page(
        self, limit: int, after: str | None = None, *, max_calls: int = 10
    ) -> tuple[list[PushSubscription], str | None]:
        """Up to ``limit`` subscriptions, in the table's (hash) order, from after the name
        ``after``; and the name to continue after, None at the end of the table.

        A paginated Scan: the table's only key is ``name`` (subscriptions and ``tap#`` items
        share it) and no index lists the subscriptions, so a Query cannot. Each call asks for
        at most the items still missing (``Limit`` counts items *evaluated*, before the filter
        drops tap items and items without a spec), so nothing is read past the last item
        returned and the continuation is exact. Read units: a Scan is charged for every item
        it evaluates, tap items included, at 0.5 RCU per 4 KB summed over the items of a
        call (eventually consistent): a page of 100 subscriptions of ~1 KB (their cursors
        grow with the shards of their topic) costs ~13 RCU, plus the taps it passes; a
        subscription is one item whatever its queues hold. A run of tap items longer than
        ``max_calls`` calls can end a page short, with a continuation (Pub/Sub may also
        answer fewer than ``page_size``).
        """
        expr = Expression()
        name = expr.n("name")
        request: dict[str, Any] = {
            "TableName": self.table,
            "FilterExpression": (
                f"attribute_exists({expr.n('spec')})"
                f" AND attribute_exists({expr.n('state')})"
                f" AND NOT begins_with({name}, {expr.v(TAP_PREFIX)})"
            ),
            "ExpressionAttributeNames": expr.names,
            "ExpressionAttributeValues": expr.values,
        }
        if after is not None:
            request["ExclusiveStartKey"] = self._key(after)
        out: list[PushSubscription] = []
        last: str | None = None
        for _ in range(max_calls):
            request["Limit"] = limit - len(out)
            with _busy("subscriptions could not be listed; retry"):
                answer = self.dynamo.call("scan", **request)
            out += [PushSubscription.from_record(from_item(i)) for i in answer.get("Items", [])]
            if "LastEvaluatedKey" not in answer:
                return out, None
            last = str(from_item(answer["LastEvaluatedKey"])["name"])
            if len(out) >= limit:
                break
            request["ExclusiveStartKey"] = answer["LastEvaluatedKey"]
        return out, last

    def create(
        self,
        name: str,
        spec: Spec,
        parallelism: int,
        created_at_ms: int,
        streams: Sequence[str],
    ) -> bool:
        """Record a new subscription as ``creating``; False when the name is taken."""
        record = {
            "name": name,
            "version": 1,
            "state": CREATING,
            "spec": spec.to_json(),
            "parallelism": parallelism,
            "generation": 0,
            "skip_before_ms": 0,
            "created_at_ms": created_at_ms,
            "cursors": {s: {"from": created_at_ms - SKEW_MS, "shards": {}} for s in streams},
        }
        return self._put_new(record, "the subscription could not be recorded; retry")

    def _put_new(self, record: Mapping[str, Any], what: str) -> bool:
        """Put an item whose name is not taken yet; False when it is."""
        expr = Expression()
        with _busy(what):
            return self.dynamo.conditional(
                "put_item",
                TableName=self.table,
                Item=to_item(record),
                **expr.params(f"attribute_not_exists({expr.n('name')})"),
            )

    @staticmethod
    def _key(name: str) -> dict[str, Any]:
        return to_item({"name": name})

    def _change(self, name: str, expr: Expression, condition: str, what: str) -> bool:
        """One conditional update of the item ``name``; False when the condition failed."""
        with _busy(what):
            return self.dynamo.conditional(
                "update_item", TableName=self.table, Key=self._key(name), **expr.params(condition)
            )

    def _update(self, sub: PushSubscription, expr: Expression) -> bool:
        expr.set("version", sub.version + 1)
        condition = f"{expr.n('version')} = {expr.v(sub.version)}"
        return self._change(
            sub.name, expr, condition, "the subscription could not be changed; retry"
        )

    def set_state(self, sub: PushSubscription, state: str) -> bool:
        return self._update(sub, Expression().set("state", state))

    def set_parallelism(self, sub: PushSubscription, parallelism: int) -> bool:
        return self._update(sub, Expression().set("parallelism", parallelism))

    def add_streams(self, sub: PushSubscription, streams: Mapping[str, int]) -> bool:
        """Start reading more storage streams (a topic grew), each from the given time."""
        expr = Expression()
        for s, from_ms in streams.items():
            _set(expr, _entry(expr, "cursors", s), {"from": from_ms, "shards": {}})
        return self._update(sub, expr)

    def seek(self, sub: PushSubscription, to_ms: int, skip_before_ms: int) -> bool:
        """Every cursor to ``to_ms``, a new generation (in-flight cursor moves fail)."""
        expr = Expression()
        for s in sub.cursors:
            _set(expr, _entry(expr, "cursors", s), {"from": to_ms, "shards": {}})
        expr.set("generation", sub.generation + 1).set("skip_before_ms", skip_before_ms)
        return self._update(sub, expr)

    def advance(
        self, name: str, generation: int, stream: str, shard: str, cursor: ShardCursor
    ) -> bool:
        """Move one shard's cursor (of the generation that read the batch)."""
        expr = Expression()
        of_stream = _entry(expr, "cursors", stream)
        shards = f"{of_stream}.{expr.n('shards')}.{_alias(expr, shard)}"
        _set(expr, shards, {"s": cursor.sequence_number, "t": cursor.arrival_ms})
        condition = (
            f"{expr.n('generation')} = {expr.v(generation)} AND attribute_exists({of_stream})"
        )
        return self._change(name, expr, condition, "the cursor could not be moved; retry")

    def delete(self, name: str) -> None:
        """Delete a ``deleting`` subscription's item (gone already counts as done; in any
        other state the delete fails, as ``ServerBusy``)."""
        expr = Expression()
        condition = (
            f"attribute_not_exists({expr.n('name')}) OR {expr.n('state')} = {expr.v(DELETING)}"
        )
        with _busy("the subscription could not be deleted; retry"):
            self.dynamo.call(
                "delete_item", TableName=self.table, Key=self._key(name), **expr.params(condition)
            )

    # -- taps --

    def tap(self, stream: str) -> Tap | None:
        with _busy("the push tap could not be read; retry"):
            record = self.dynamo.get(self.table, {"name": TAP_PREFIX + stream})
        return None if record is None else Tap.from_record(stream, record)

    def join_tap(self, stream: str, topic: str, storage_index: int, name: str) -> None:
        info = json.dumps({"topic": topic, "index": storage_index}, separators=(",", ":"))
        expr = Expression().set("spec", info)
        _set(expr, _entry(expr, "members", name), self.clock.now_ms())
        expr.add("version", 1)
        condition = f"attribute_exists({expr.n('members')})"
        if self._change(TAP_PREFIX + stream, expr, condition, _TAP_NOT_CHANGED):
            return
        # the first member: the members map does not exist yet
        record = {
            "name": TAP_PREFIX + stream,
            "version": 1,
            "spec": info,
            "members": {name: self.clock.now_ms()},
            # as every item of the table has them (``PushSubscriptionModel``'s defaults)
            "generation": 0,
            "skip_before_ms": 0,
            "cursors": {},
        }
        if not self._put_new(record, _TAP_NOT_CHANGED):
            self.join_tap(stream, topic, storage_index, name)

    def set_tap_lanes(self, stream: str, lanes: int) -> None:
        expr = Expression().set("parallelism", lanes)
        condition = f"attribute_exists({expr.n('name')})"
        self._change(TAP_PREFIX + stream, expr, condition, _TAP_NOT_CHANGED)

    def leave_tap(self, stream: str, name: str) -> None:
        expr = Expression()
        expr.removes.append(_entry(expr, "members", name))
        expr.add("version", 1)
        condition = f"attribute_exists({expr.n('members')})"
        self._change(TAP_PREFIX + stream, expr, condition, _TAP_NOT_CHANGED)

    def acquire_tap_lock(self, stream: str, wait_s: float = 10.0) -> str | None:
        """A lock on the tap's mapping (one changer at a time); None if not had in time."""
        token = f"{self.clock.now_ms()}-{id(self)}-{time.monotonic_ns()}"
        deadline = self.clock.now_ms() + int(wait_s * 1000)
        while True:
            now = self.clock.now_ms()
            expr = Expression().set("lease_until_ms", now + TAP_LOCK_MS).set("lease_token", token)
            until = expr.n("lease_until_ms")
            condition = (
                f"attribute_exists({expr.n('name')})"
                f" AND (attribute_not_exists({until}) OR {until} < {expr.v(now)})"
            )
            if self._change(
                TAP_PREFIX + stream, expr, condition, "the push tap is being changed; retry"
            ):
                return token
            if now >= deadline:
                return None
            self.clock.sleep(0.2)

    def release_tap_lock(self, stream: str, token: str) -> None:
        expr = Expression().remove("lease_until_ms", "lease_token")
        condition = f"{expr.n('lease_token')} = {expr.v(token)}"
        try:
            self._change(TAP_PREFIX + stream, expr, condition, "the tap lease was not released")
        except ServerBusy:
            logger.warning("tap lease not released", extra={"stream": stream})


# -- key states -----------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockedKey:
    ordering_key: str
    rq_depth: int
    dlq_depth: int


class KeyStore:
    """Key states (``shoal.aws.tables.PushGroupModel``): consistent reads, conditional writes."""

    def __init__(self, dynamo: Dynamo, table: str) -> None:
        self.dynamo = dynamo
        self.table = table

    @classmethod
    def from_config(cls, config: Config) -> KeyStore:
        return cls(Dynamo.from_config(config), config.table(tables.PUSH_GROUPS))

    def get(self, name: str, ordering_key: str) -> KeyState:
        key = {"name": name, "ordering_digest": ordering_digest(ordering_key)}
        with _busy("the group state could not be read; retry"):
            record = self.dynamo.get(self.table, key)
        if record is None:
            return KeyState()
        return KeyState.from_json(record["state"], int(record["version"]))

    def get_many(self, name: str, ordering_keys: Iterable[str]) -> dict[str, KeyState]:
        keys = {ordering_digest(k): k for k in ordering_keys}
        out = {k: KeyState() for k in keys.values()}
        if not keys:
            return out
        wanted = [{"name": name, "ordering_digest": digest} for digest in keys]
        with _busy("group states could not be read; retry"):
            records = self.dynamo.batch_get(self.table, wanted)
        for record in records:
            state = KeyState.from_json(record["state"], int(record["version"]))
            out[keys[record["ordering_digest"]]] = state
        return out

    def save(self, name: str, ordering_key: str, state: KeyState) -> KeyState | None:
        """Write ``state`` if the item is still at ``state.version``; None when it moved."""
        version = state.version + 1
        text = state.to_json()
        record: dict[str, Any] = {
            "name": name,
            "ordering_digest": ordering_digest(ordering_key),
            "ordering_key": ordering_key,
            "version": version,
            "state": text,
            "rq_depth": state.rq.depth,
            "dlq_depth": state.dlq.depth,
        }
        if state.rq.depth > 0 or state.dlq.depth > 0:
            record["blocked"] = name
        expr = Expression()
        condition = (
            f"{expr.n('version')} = {expr.v(state.version)}"
            if state.version
            else f"attribute_not_exists({expr.n('name')})"
        )
        with _busy("the group state could not be written; retry"):
            saved = self.dynamo.conditional(
                "put_item", TableName=self.table, Item=to_item(record), **expr.params(condition)
            )
        return KeyState.from_json(text, version) if saved else None

    def blocked(self, name: str, limit: int = 10_000) -> Iterator[BlockedKey]:
        """The subscription's blocked keys (the sparse ``blocked`` index), at most ``limit``."""
        expr = Expression()
        pages = self._pages(
            IndexName="blocked",
            KeyConditionExpression=f"{expr.n('blocked')} = {expr.v(name)}",
            Limit=limit,
            ExpressionAttributeNames=expr.names,
            ExpressionAttributeValues=expr.values,
        )
        left = limit
        while left > 0:
            with _busy("blocked keys could not be read; retry"):
                page = next(pages, None)
            if page is None:
                return
            for record in page[:left]:
                rq, dlq = int(record.get("rq_depth") or 0), int(record.get("dlq_depth") or 0)
                yield BlockedKey(str(record["ordering_key"]), rq, dlq)
            left -= min(len(page), left)

    def delete_all(self, name: str) -> int:
        """Delete every key state of the subscription, as the pages of its keys come (a delete
        that stopped part of the way deletes the rest when repeated)."""
        expr = Expression()
        pages = self._pages(
            KeyConditionExpression=f"{expr.n('name')} = {expr.v(name)}",
            ProjectionExpression=f"{expr.n('name')}, {expr.n('ordering_digest')}",
            ExpressionAttributeNames=expr.names,
            ExpressionAttributeValues=expr.values,
        )
        count = 0
        pending: list[dict[str, Any]] = []
        with _busy("group states could not be deleted; retry"):
            for page in pages:
                count += len(page)
                pending += page
                # full batches as they fill: no more batch calls than one list of all keys
                full = len(pending) - len(pending) % MAX_BATCH_WRITE
                self.dynamo.batch_delete(self.table, pending[:full])
                del pending[:full]
            self.dynamo.batch_delete(self.table, pending)
        return count

    def _pages(self, **request: Any) -> Iterator[list[dict[str, Any]]]:
        """A query's pages, each read when the one before is taken."""
        while True:
            page = self.dynamo.call("query", TableName=self.table, **request)
            yield [from_item(i) for i in page.get("Items", [])]
            if "LastEvaluatedKey" not in page:
                return
            request["ExclusiveStartKey"] = page["LastEvaluatedKey"]


# -- the parts ------------------------------------------------------------------------------


def push_parts(config: Config, clock: Clock) -> tuple[PushSubscriptionStore, KeyStore, Queues]:
    """The stores every push service works on (admin, delivery, replay), bound to ``config``."""
    return (
        PushSubscriptionStore.from_config(config, clock),
        KeyStore.from_config(config),
        Queues(Streams.from_config(config, clock), clock),
    )
