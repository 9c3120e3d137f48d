"""DynamoDB tables, defined once as pynamodb models.

The CDK stack, the local runtime and the tests all build their tables from these models
(``schema``), so key schemas and indexes cannot drift. ``Meta.table_name`` is the logical name;
``Config.table`` maps it to the physical one. The models are definitions only: every read and
write goes through the one adapter, ``shoal.aws.dynamo``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pynamodb.attributes import (
    BinaryAttribute,
    ListAttribute,
    MapAttribute,
    NumberAttribute,
    UnicodeAttribute,
)
from pynamodb.indexes import GlobalSecondaryIndex, IncludeProjection, KeysOnlyProjection
from pynamodb.models import Model

#: the logical table names (``Config.table`` maps each to its physical name); every context
#: names its tables by these
TOPICS = "topics"
PUBLISHERS = "publishers"
RETAINED = "retained"
SESSIONS = "sessions"
SUBSCRIPTIONS = "subscriptions"
INBOXES = "inboxes"
PUSH_SUBSCRIPTIONS = "push_subscriptions"
PUSH_GROUPS = "push_groups"
GROUPS = "groups"


class StorageTopicAttr(MapAttribute[str, Any]):
    index = NumberAttribute()
    stream = UnicodeAttribute()
    partitions = NumberAttribute()
    k = NumberAttribute()
    #: the shards' starting hash keys (decimal), only when the stream's split differs from
    #: ``shoal.aws.kinesis.even_starting_keys`` (absent: the even split, as Kinesis creates it)
    hash_keys = ListAttribute(of=UnicodeAttribute, null=True)


class TopicModel(Model):
    """A composite topic: its storage topics in order and the produce pointer."""

    class Meta:
        table_name = TOPICS
        region = "us-east-1"

    name = UnicodeAttribute(hash_key=True)
    #: bumped by every metadata change; conditional writes compare it
    version = NumberAttribute(default=0)
    produce_pointer = NumberAttribute(default=0)
    storage_topics = ListAttribute(of=StorageTopicAttr, default=list)
    #: a storage topic being added (its stream and event source mapping may not exist yet);
    #: a topic whose storage_topics are empty is still being created
    pending = StorageTopicAttr(null=True)
    #: the instant (ms) the produce pointer, or a new topic, takes effect for publishers
    effective_at_ms = NumberAttribute(default=0)


class PublisherModel(Model):
    """One publisher's sequence: the last reserved seq, reservations in flight, and routes.

    Keyed by principal and publisher id, so one principal cannot touch another's sequence.
    ``pending`` maps a reserved run's first seq to its reservation; ``routes`` maps
    "<composite topic>/<storage topic index>" to the first seq sent there; ``overrides`` maps a
    seq to "<composite>/<index>" when a recovery re-put it elsewhere (see shoal.publish).
    """

    class Meta:
        table_name = PUBLISHERS
        region = "us-east-1"

    key = UnicodeAttribute(hash_key=True)
    last_seq = NumberAttribute()
    pending = MapAttribute[str, Any](default=dict)
    routes = MapAttribute[str, Any](default=dict)
    overrides = MapAttribute[str, Any](default=dict)


class RetainedByCompositeIndex(GlobalSecondaryIndex["RetainedModel"]):
    """Retained topic names by composite topic: a subscribe matches its filter against these
    (``shoal.delivery``), then reads the matching messages themselves, strongly consistent."""

    class Meta:
        index_name = "by_composite"
        projection = IncludeProjection(["topic"])

    composite_topic = UnicodeAttribute(hash_key=True)
    key = UnicodeAttribute(range_key=True)


class RetainedModel(Model):
    """The retained message of one MQTT topic name (absent when none is retained).

    Topic names reach 65,535 bytes and a partition key 2,048, so the key is a digest of the name.
    """

    class Meta:
        table_name = RETAINED
        region = "us-east-1"

    key = UnicodeAttribute(hash_key=True)
    topic = UnicodeAttribute()
    composite_topic = UnicodeAttribute()
    message_id = UnicodeAttribute()
    payload = BinaryAttribute(legacy_encoding=False)
    qos = NumberAttribute()
    #: the message's properties as JSON text
    properties = UnicodeAttribute(null=True)
    #: a retained message is only replaced by one published at or after it
    published_at_ms = NumberAttribute()
    #: its publisher seq (0: none): orders publishes of one millisecond
    seq = NumberAttribute(null=True)
    publisher = UnicodeAttribute(null=True)
    by_composite = RetainedByCompositeIndex()


@dataclass(frozen=True)
class TableDef:
    """One table: its logical name, model and the attribute DynamoDB TTL reads (if any)."""

    logical: str
    model: type[Model]
    ttl_attribute: str | None = None

    def schema(self) -> dict[str, Any]:
        """Key schema and indexes in the shape of DynamoDB's CreateTable request."""
        raw: dict[str, Any] = dict(self.model._get_schema())
        out: dict[str, Any] = {
            "AttributeDefinitions": raw["attribute_definitions"],
            "KeySchema": raw["key_schema"],
        }
        for key, name in (
            ("global_secondary_indexes", "GlobalSecondaryIndexes"),
            ("local_secondary_indexes", "LocalSecondaryIndexes"),
        ):
            if raw.get(key):
                # pynamodb names an index's parts in snake case and may list RANGE before
                # HASH; CreateTable wants IndexName/KeySchema/Projection, HASH first
                out[name] = [
                    {
                        "IndexName": index["index_name"],
                        "KeySchema": sorted(
                            index["key_schema"], key=lambda part: part["KeyType"] != "HASH"
                        ),
                        "Projection": index["projection"],
                    }
                    for index in raw[key]
                ]
        return out


TABLES: tuple[TableDef, ...] = (
    TableDef(TOPICS, TopicModel),
    TableDef(PUBLISHERS, PublisherModel),
    TableDef(RETAINED, RetainedModel),
)


class DueIndex(GlobalSecondaryIndex["SessionItemModel"]):
    """Sparse: only items with reaper work carry ``due_shard``/``due_at_ms``.

    The reaper asks each shard for ``due_at_ms <= now`` and so never scans the table; the
    shard (a stable hash of the client id) spreads the index's writes over partitions.
    """

    class Meta:
        index_name = "due"
        projection = KeysOnlyProjection()

    due_shard = UnicodeAttribute(hash_key=True)
    due_at_ms = NumberAttribute(range_key=True)


class SessionItemModel(Model):
    """One client id's partition in the session registry (see ``shoal.sessions``).

    ``item`` is ``head`` (the newest registration's version and channel, the owning principal,
    ``rev``, liveness and keepalive, the armed will, and the session state: ``session_id``,
    ``subscriptions``, ``pending``, expiry), ``reg#<version>`` (one registration: a bag entry
    per channel) or ``will#<version>`` (a will waiting for its delay). Only the key, index and
    TTL attributes are declared; ``shoal.sessions`` reads and writes the rest.
    """

    class Meta:
        table_name = SESSIONS
        region = "us-east-1"

    client_id = UnicodeAttribute(hash_key=True)
    item = UnicodeAttribute(range_key=True)
    due_shard = UnicodeAttribute(null=True)
    due_at_ms = NumberAttribute(null=True)
    #: epoch seconds; DynamoDB TTL removes an ended session's head the reaper missed
    expires_at = NumberAttribute(null=True)
    due = DueIndex()


TABLES += (TableDef(SESSIONS, SessionItemModel, ttl_attribute="expires_at"),)


class SubscriptionItemModel(Model):
    """The router-readable subscription store (see ``shoal.delivery``), one partition per bucket.

    A bucket holds the subscriptions whose filter (without ``$share/{ShareName}/``) starts with
    one literal level (``L:<level>``), or with a wildcard (``W``). ``item`` is ``#v`` (the
    bucket's version, bumped by every change), ``s#<digest>`` (one session's subscription) or
    ``c#<version>`` (the change that made that version, kept a day so that routers refresh
    incrementally). Only key and TTL attributes are declared.
    """

    class Meta:
        table_name = SUBSCRIPTIONS
        region = "us-east-1"

    bucket = UnicodeAttribute(hash_key=True)
    item = UnicodeAttribute(range_key=True)
    #: epoch seconds; DynamoDB TTL removes old change records
    expires_at = NumberAttribute(null=True)


class InboxItemModel(Model):
    """Session inboxes (see ``shoal.delivery``): one partition per session id.

    ``position`` is ``#state`` (the session's delivery state: cursors, in-flight runs, acks) or
    ``<source>#<position>`` (deliveries from one storage shard, or ``ret`` for retained
    messages sent on subscribe). The router's per-shard ledger lives in partition
    ``router#<source>``. Only key and TTL attributes are declared.
    """

    class Meta:
        table_name = INBOXES
        region = "us-east-1"

    inbox = UnicodeAttribute(hash_key=True)
    position = UnicodeAttribute(range_key=True)
    #: epoch seconds; consumed deliveries are never deleted one by one, TTL drops them
    expires_at = NumberAttribute(null=True)


TABLES += (
    TableDef(SUBSCRIPTIONS, SubscriptionItemModel, ttl_attribute="expires_at"),
    TableDef(INBOXES, InboxItemModel, ttl_attribute="expires_at"),
)


class PushSubscriptionModel(Model):
    """Push subscriptions (``shoal.push``) and the push taps of storage streams.

    ``name`` is a subscription's name, or ``tap#<stream>`` for the push tap of one storage
    stream (subscription names hold no ``#``). A subscription item holds its spec (JSON), its
    seek ``generation`` and ``skip_before_ms``, and ``cursors``: per storage stream of its
    topic, ``{"from": ms, "shards": {shard id: {"s": sequence number, "t": arrival ms}}}``. A
    tap item holds ``members`` (the subscriptions reading that stream) and a lease that
    serializes changes to the tap's event source mapping; its ``spec`` is the JSON of the
    composite topic and storage topic index the stream belongs to, its ``parallelism`` the
    lanes its mapping may run (``shoal.push.store``).
    """

    class Meta:
        table_name = "push_subscriptions"
        region = "us-east-1"

    name = UnicodeAttribute(hash_key=True)
    #: bumped by every change of the spec, state or seek position; conditions compare it
    version = NumberAttribute(default=0)
    state = UnicodeAttribute(null=True)
    spec = UnicodeAttribute(null=True)
    parallelism = NumberAttribute(null=True)
    generation = NumberAttribute(default=0)
    skip_before_ms = NumberAttribute(default=0)
    created_at_ms = NumberAttribute(null=True)
    cursors = MapAttribute[str, Any](default=dict)
    members = MapAttribute[str, Any](null=True)
    lease_until_ms = NumberAttribute(null=True)
    lease_token = UnicodeAttribute(null=True)


class PushBlockedIndex(GlobalSecondaryIndex["PushGroupModel"]):
    """Sparse: only groups whose ordering key is blocked (messages pending in RQ or DLQ)."""

    class Meta:
        index_name = "blocked"
        projection = IncludeProjection(["ordering_key", "rq_depth", "dlq_depth"])

    blocked = UnicodeAttribute(hash_key=True)
    ordering_digest = UnicodeAttribute(range_key=True)


class PushGroupModel(Model):
    """The key state of one (push subscription, ordering key), see ``shoal.push.state.KeyState``.

    ``name`` is the subscription's, ``ordering_digest`` a digest of the ordering key (a sort key
    holds 1 KB, an ordering key more); ``state`` is the JSON of the produced and consumed
    positions of RQ and DLQ. Every write is conditional on ``version``.
    """

    class Meta:
        table_name = "push_groups"
        region = "us-east-1"

    name = UnicodeAttribute(hash_key=True)
    ordering_digest = UnicodeAttribute(range_key=True)
    ordering_key = UnicodeAttribute()
    version = NumberAttribute()
    state = UnicodeAttribute()
    #: the subscription's name while the key is blocked, else absent (the sparse index)
    blocked = UnicodeAttribute(null=True)
    rq_depth = NumberAttribute(default=0)
    dlq_depth = NumberAttribute(default=0)
    blocked_index = PushBlockedIndex()


TABLES += (
    TableDef("push_subscriptions", PushSubscriptionModel),
    TableDef("push_groups", PushGroupModel),
)


class GroupItemModel(Model):
    """Durable shared groups (see ``shoal.groups``): one partition per group, keyed by a digest
    of (ShareName, filter).

    ``item`` is ``#sgl`` (the group leader: version, incarnation, members, the streams' leases),
    ``m#<session id>`` (a member's last renewal and its agent's view) or ``s#<source>`` (one
    group stream's progress and fence). The messages themselves live in the inboxes table
    (``shoal.groups.streams``). Only the key attributes are declared.
    """

    class Meta:
        table_name = GROUPS
        region = "us-east-1"

    group = UnicodeAttribute(hash_key=True)
    item = UnicodeAttribute(range_key=True)


TABLES += (TableDef(GROUPS, GroupItemModel),)


CONNECTIONS = "connections"


class ConnectionDueIndex(GlobalSecondaryIndex["ConnectionModel"]):
    """Sparse: only a connected session's item whose pushed deliveries may come due again
    (an ack timeout) carries ``due_shard``/``due_at_ms``; the reaper asks each shard for
    ``due_at_ms <= now`` and pushes those sessions again (``shoal.edge.push``)."""

    class Meta:
        index_name = "due"
        projection = KeysOnlyProjection()

    due_shard = UnicodeAttribute(hash_key=True)
    due_at_ms = NumberAttribute(range_key=True)


class ConnectionModel(Model):
    """The WebSocket API's connections (``shoal.edge.connections``). ``key`` is
    ``conn#<connection id>`` (which client id, channel and session the connection holds once
    its ``connect`` frame is answered), ``session#<session id>`` (the connection a session's
    deliveries are pushed to, its in-flight window, and the push lease) or
    ``connecting#<connection id>`` (the channel a ``connect`` frame is about to register,
    for a ``$disconnect`` that finds no ``conn#`` item). Written at the
    ``connect`` frame, removed at ``$disconnect``; TTL removes what a lost ``$disconnect``
    left (API Gateway closes every connection within two hours). Only the key and TTL
    attributes are declared."""

    class Meta:
        table_name = CONNECTIONS
        region = "us-east-1"

    key = UnicodeAttribute(hash_key=True)
    #: epoch seconds
    expires_at = NumberAttribute(null=True)
    due_shard = UnicodeAttribute(null=True)
    due_at_ms = NumberAttribute(null=True)
    due = ConnectionDueIndex()


TABLES += (TableDef(CONNECTIONS, ConnectionModel, ttl_attribute="expires_at"),)
