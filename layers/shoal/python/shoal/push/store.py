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
partition key, which is the ordering key (``shoal.publishing``), so each key stays in order in
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
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError
from pynamodb.exceptions import DeleteError, PutError, PynamoDBException, UpdateError

from shoal.aws.kinesis import Streams
from shoal.aws.tables import PushGroupModel, PushSubscriptionModel
from shoal.core.clock import Clock
from shoal.core.config import Config
from shoal.core.errors import ServerBusy, SubscriptionNotFound
from shoal.core.observability import logger
from shoal.push.entries import ordering_digest
from shoal.push.model import CREATING, DELETING, Cursor, PushSubscription, ShardCursor, Spec, Tap
from shoal.push.queues import Queues
from shoal.push.state import KeyState

TAP_PREFIX = "tap#"
#: a new member starts this long before its creation: Kinesis stamps arrivals by its own clock
SKEW_MS = 5_000
#: tap mapping changes are serialized by a lease this long
LEASE_MS = 30_000


def _conditional_failed(exc: PynamoDBException) -> bool:
    return exc.cause_response_code == "ConditionalCheckFailedException"


# -- subscriptions and taps -----------------------------------------------------------------


def _subscription(item: PushSubscriptionModel) -> PushSubscription:
    return PushSubscription(
        name=item.name,
        spec=Spec.from_json(item.spec or "{}"),
        parallelism=int(item.parallelism or 1),
        state=item.state or CREATING,
        version=int(item.version),
        generation=int(item.generation or 0),
        skip_before_ms=int(item.skip_before_ms or 0),
        created_at_ms=int(item.created_at_ms or 0),
        cursors={stream: Cursor.from_item(raw) for stream, raw in _plain(item.cursors).items()},
    )


def _plain(attribute: Any) -> dict[str, Any]:
    """A raw MapAttribute's value as plain dicts."""
    if attribute is None:
        return {}
    value = attribute.as_dict() if hasattr(attribute, "as_dict") else attribute
    return dict(value)


class PushSubscriptionStore:
    """Subscription items and tap items (``shoal.aws.tables.PushSubscriptionModel``)."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def load(self, name: str) -> PushSubscription | None:
        try:
            item = PushSubscriptionModel.get(name, consistent_read=True)
        except PushSubscriptionModel.DoesNotExist:
            return None
        except PynamoDBException as exc:
            raise ServerBusy("the subscription could not be read; retry") from exc
        return _subscription(item) if item.spec else None

    def require(self, name: str) -> PushSubscription:
        """The subscription named ``name``; SubscriptionNotFound when there is none."""
        sub = self.load(name) if isinstance(name, str) else None
        if sub is None:
            raise SubscriptionNotFound(f"no push subscription named {name}")
        return sub

    def load_many(self, names: Iterable[str]) -> dict[str, PushSubscription]:
        wanted = sorted(set(names))
        try:
            items = list(PushSubscriptionModel.batch_get(wanted, consistent_read=True))
        except PynamoDBException as exc:
            raise ServerBusy("subscriptions could not be read; retry") from exc
        return {i.name: _subscription(i) for i in items if i.spec}

    def create(
        self,
        name: str,
        spec: Spec,
        parallelism: int,
        created_at_ms: int,
        streams: Sequence[str],
    ) -> bool:
        """Record a new subscription as ``creating``; False when the name is taken."""
        try:
            PushSubscriptionModel(
                name,
                version=1,
                state=CREATING,
                spec=spec.to_json(),
                parallelism=parallelism,
                generation=0,
                skip_before_ms=0,
                created_at_ms=created_at_ms,
                cursors={s: {"from": created_at_ms - SKEW_MS, "shards": {}} for s in streams},
            ).save(condition=PushSubscriptionModel.name.does_not_exist())
        except PutError as exc:
            if _conditional_failed(exc):
                return False
            raise ServerBusy("the subscription could not be recorded; retry") from exc
        return True

    def _update(self, sub: PushSubscription, actions: list[Any]) -> bool:
        try:
            PushSubscriptionModel(sub.name).update(
                actions=[*actions, PushSubscriptionModel.version.set(sub.version + 1)],
                condition=PushSubscriptionModel.version == sub.version,
            )
        except UpdateError as exc:
            if _conditional_failed(exc):
                return False
            raise ServerBusy("the subscription could not be changed; retry") from exc
        return True

    def set_state(self, sub: PushSubscription, state: str) -> bool:
        return self._update(sub, [PushSubscriptionModel.state.set(state)])

    def set_parallelism(self, sub: PushSubscription, parallelism: int) -> bool:
        return self._update(sub, [PushSubscriptionModel.parallelism.set(parallelism)])

    def add_streams(self, sub: PushSubscription, streams: Mapping[str, int]) -> bool:
        """Start reading more storage streams (a topic grew), each from the given time."""
        return self._update(
            sub,
            [
                PushSubscriptionModel.cursors[s].set({"from": from_ms, "shards": {}})
                for s, from_ms in streams.items()
            ],
        )

    def seek(self, sub: PushSubscription, to_ms: int, skip_before_ms: int) -> bool:
        """Every cursor to ``to_ms``, a new generation (in-flight cursor moves fail)."""
        return self._update(
            sub,
            [
                *(
                    PushSubscriptionModel.cursors[s].set({"from": to_ms, "shards": {}})
                    for s in sub.cursors
                ),
                PushSubscriptionModel.generation.set(sub.generation + 1),
                PushSubscriptionModel.skip_before_ms.set(skip_before_ms),
            ],
        )

    def advance(
        self, name: str, generation: int, stream: str, shard: str, cursor: ShardCursor
    ) -> bool:
        """Move one shard's cursor (of the generation that read the batch)."""
        try:
            PushSubscriptionModel(name).update(
                actions=[
                    PushSubscriptionModel.cursors[stream]["shards"][shard].set(
                        {"s": cursor.sequence_number, "t": cursor.arrival_ms}
                    )
                ],
                condition=(PushSubscriptionModel.generation == generation)
                & PushSubscriptionModel.cursors[stream].exists(),
            )
        except UpdateError as exc:
            if _conditional_failed(exc):
                return False
            raise ServerBusy("the cursor could not be moved; retry") from exc
        return True

    def delete(self, name: str) -> None:
        """Delete a ``deleting`` subscription's item (gone already counts as done)."""
        try:
            PushSubscriptionModel(name).delete(
                condition=PushSubscriptionModel.name.does_not_exist()
                | (PushSubscriptionModel.state == DELETING)
            )
        except DeleteError as exc:
            raise ServerBusy("the subscription could not be deleted; retry") from exc

    # -- taps --

    def tap(self, stream: str) -> Tap | None:
        try:
            item = PushSubscriptionModel.get(TAP_PREFIX + stream, consistent_read=True)
        except PushSubscriptionModel.DoesNotExist:
            return None
        except PynamoDBException as exc:
            raise ServerBusy("the push tap could not be read; retry") from exc
        info = json.loads(item.spec or "{}")
        members = _plain(item.members)
        return Tap(
            stream=stream,
            topic=str(info.get("topic", "")),
            storage_index=int(info.get("index", 0)),
            members=frozenset(members),
            version=int(item.version),
            # the tap item keeps its lanes in the subscription items' parallelism attribute
            lanes=int(item.parallelism or 1),
            joined={name: int(at) for name, at in members.items()},
        )

    def join_tap(self, stream: str, topic: str, storage_index: int, name: str) -> None:
        info = json.dumps({"topic": topic, "index": storage_index}, separators=(",", ":"))
        try:
            PushSubscriptionModel(TAP_PREFIX + stream).update(
                actions=[
                    PushSubscriptionModel.spec.set(info),
                    PushSubscriptionModel.members[name].set(self.clock.now_ms()),
                    PushSubscriptionModel.version.add(1),
                ],
                condition=PushSubscriptionModel.members.exists(),
            )
        except UpdateError as exc:
            if not _conditional_failed(exc):
                raise ServerBusy("the push tap could not be changed; retry") from exc
            # the first member: the members map does not exist yet
            try:
                PushSubscriptionModel(
                    TAP_PREFIX + stream,
                    version=1,
                    spec=info,
                    members={name: self.clock.now_ms()},
                ).save(condition=PushSubscriptionModel.name.does_not_exist())
            except PutError as again:
                if not _conditional_failed(again):
                    raise ServerBusy("the push tap could not be changed; retry") from again
                self.join_tap(stream, topic, storage_index, name)

    def set_tap_lanes(self, stream: str, lanes: int) -> None:
        try:
            PushSubscriptionModel(TAP_PREFIX + stream).update(
                actions=[PushSubscriptionModel.parallelism.set(lanes)],
                condition=PushSubscriptionModel.name.exists(),
            )
        except UpdateError as exc:
            if not _conditional_failed(exc):
                raise ServerBusy("the push tap could not be changed; retry") from exc

    def leave_tap(self, stream: str, name: str) -> None:
        try:
            PushSubscriptionModel(TAP_PREFIX + stream).update(
                actions=[
                    PushSubscriptionModel.members[name].remove(),
                    PushSubscriptionModel.version.add(1),
                ],
                condition=PushSubscriptionModel.members.exists(),
            )
        except UpdateError as exc:
            if not _conditional_failed(exc):
                raise ServerBusy("the push tap could not be changed; retry") from exc

    def acquire_tap_lease(self, stream: str, wait_s: float = 10.0) -> str | None:
        """A lease on the tap's mapping (one changer at a time); None if not had in time."""
        token = f"{self.clock.now_ms()}-{id(self)}-{time.monotonic_ns()}"
        deadline = self.clock.now_ms() + int(wait_s * 1000)
        while True:
            now = self.clock.now_ms()
            try:
                PushSubscriptionModel(TAP_PREFIX + stream).update(
                    actions=[
                        PushSubscriptionModel.lease_until_ms.set(now + LEASE_MS),
                        PushSubscriptionModel.lease_token.set(token),
                    ],
                    condition=PushSubscriptionModel.name.exists()
                    & (
                        PushSubscriptionModel.lease_until_ms.does_not_exist()
                        | (PushSubscriptionModel.lease_until_ms < now)
                    ),
                )
                return token
            except UpdateError as exc:
                if not _conditional_failed(exc):
                    raise ServerBusy("the push tap could not be leased; retry") from exc
            if now >= deadline:
                return None
            self.clock.sleep(0.2)

    def release_tap_lease(self, stream: str, token: str) -> None:
        try:
            PushSubscriptionModel(TAP_PREFIX + stream).update(
                actions=[
                    PushSubscriptionModel.lease_until_ms.remove(),
                    PushSubscriptionModel.lease_token.remove(),
                ],
                condition=PushSubscriptionModel.lease_token == token,
            )
        except UpdateError as exc:
            if not _conditional_failed(exc):
                logger.warning("tap lease not released", extra={"stream": stream})


# -- key states -----------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockedKey:
    ordering_key: str
    rq_depth: int
    dlq_depth: int


class KeyStore:
    """Group states (``shoal.aws.tables.PushGroupModel``): consistent reads, conditional writes."""

    def get(self, name: str, ordering_key: str) -> KeyState:
        try:
            item = PushGroupModel.get(name, ordering_digest(ordering_key), consistent_read=True)
        except PushGroupModel.DoesNotExist:
            return KeyState()
        except PynamoDBException as exc:
            raise ServerBusy("the group state could not be read; retry") from exc
        return KeyState.from_json(item.state, int(item.version))

    def get_many(self, name: str, ordering_keys: Iterable[str]) -> dict[str, KeyState]:
        keys = {ordering_digest(k): k for k in ordering_keys}
        out = {k: KeyState() for k in keys.values()}
        if not keys:
            return out
        try:
            for item in PushGroupModel.batch_get(
                [(name, digest) for digest in keys], consistent_read=True
            ):
                out[keys[item.ordering_digest]] = KeyState.from_json(item.state, int(item.version))
        except PynamoDBException as exc:
            raise ServerBusy("group states could not be read; retry") from exc
        return out

    def save(self, name: str, ordering_key: str, state: KeyState) -> KeyState | None:
        """Write ``state`` if the item is still at ``state.version``; None when it moved."""
        version = state.version + 1
        blocked = state.rq.depth > 0 or state.dlq.depth > 0
        item = PushGroupModel(
            name,
            ordering_digest(ordering_key),
            ordering_key=ordering_key,
            version=version,
            state=state.to_json(),
            blocked=name if blocked else None,
            rq_depth=state.rq.depth,
            dlq_depth=state.dlq.depth,
        )
        condition = (
            PushGroupModel.version == state.version
            if state.version
            else PushGroupModel.name.does_not_exist()
        )
        try:
            item.save(condition=condition)
        except PutError as exc:
            if _conditional_failed(exc):
                return None
            raise ServerBusy("the group state could not be written; retry") from exc
        return KeyState.from_json(item.state, version)

    def blocked(self, name: str, limit: int = 10_000) -> Iterator[BlockedKey]:
        try:
            for item in PushGroupModel.blocked_index.query(name, limit=limit):
                yield BlockedKey(
                    item.ordering_key, int(item.rq_depth or 0), int(item.dlq_depth or 0)
                )
        except PynamoDBException as exc:
            raise ServerBusy("blocked keys could not be read; retry") from exc

    def delete_all(self, name: str) -> int:
        count = 0
        try:
            with PushGroupModel.batch_write() as batch:
                for item in PushGroupModel.query(
                    name, attributes_to_get=["name", "ordering_digest"]
                ):
                    batch.delete(item)
                    count += 1
        except PynamoDBException as exc:
            raise ServerBusy("group states could not be deleted; retry") from exc
        return count


# -- the parts ------------------------------------------------------------------------------


def push_parts(config: Config, clock: Clock) -> tuple[PushSubscriptionStore, KeyStore, Queues]:
    """The stores every push service works on (admin, delivery, replay), bound to ``config``."""
    from shoal.aws import tables

    tables.bind(config)
    return (
        PushSubscriptionStore(clock),
        KeyStore(),
        Queues(Streams.from_config(config, clock), clock),
    )


#: what the push function and the admin treat as "AWS did not answer": retry later
INFRASTRUCTURE_ERRORS = (ServerBusy, PynamoDBException, ClientError, BotoCoreError)
