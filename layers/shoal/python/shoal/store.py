"""DynamoDB tables, defined once as pynamodb models.

The CDK stack, the local runtime and the tests all build their tables from these models
(``schema``), so key schemas and indexes cannot drift. ``Meta.table_name`` holds the logical
name until ``bind`` points each model at the physical table named by the configuration.
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
from pynamodb.indexes import GlobalSecondaryIndex, KeysOnlyProjection
from pynamodb.models import Model

from shoal.config import Config


class StorageTopicAttr(MapAttribute[str, Any]):
    index = NumberAttribute()
    stream = UnicodeAttribute()
    partitions = NumberAttribute()
    k = NumberAttribute()
    #: the shards' starting hash keys (decimal), only when the stream's split differs from
    #: ``shoal.streams.even_starting_keys`` (absent: the even split, as Kinesis creates it)
    hash_keys = ListAttribute(of=UnicodeAttribute, null=True)


class TopicModel(Model):
    """A composite topic: its storage topics in order and the produce pointer."""

    class Meta:
        table_name = "topics"
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
    seq to "<composite>/<index>" when a recovery re-put it elsewhere (see shoal.publishing).
    """

    class Meta:
        table_name = "publishers"
        region = "us-east-1"

    key = UnicodeAttribute(hash_key=True)
    last_seq = NumberAttribute()
    pending = MapAttribute[str, Any](default=dict)
    routes = MapAttribute[str, Any](default=dict)
    overrides = MapAttribute[str, Any](default=dict)


class RetainedModel(Model):
    """The retained message of one MQTT topic name (absent when none is retained).

    Topic names reach 65,535 bytes and a partition key 2,048, so the key is a digest of the name.
    """

    class Meta:
        table_name = "retained"
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
    publisher = UnicodeAttribute(null=True)


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
    TableDef("topics", TopicModel),
    TableDef("publishers", PublisherModel),
    TableDef("retained", RetainedModel),
)


def bind(config: Config) -> None:
    """Point every model at its physical table; called once per cold start."""
    for table in TABLES:
        meta: Any = table.model.Meta
        meta.table_name = config.table(table.logical)
        meta.region = config.region
        # a model caches its connection; drop it so the new name and region take effect
        table.model._connection = None


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
        table_name = "sessions"
        region = "us-east-1"

    client_id = UnicodeAttribute(hash_key=True)
    item = UnicodeAttribute(range_key=True)
    due_shard = UnicodeAttribute(null=True)
    due_at_ms = NumberAttribute(null=True)
    #: epoch seconds; DynamoDB TTL removes an ended session's head the reaper missed
    expires_at = NumberAttribute(null=True)
    due = DueIndex()


TABLES += (TableDef("sessions", SessionItemModel, ttl_attribute="expires_at"),)
