"""DynamoDB tables, defined once as pynamodb models.

The CDK stack, the local runtime and the tests all build their tables from these models
(``schema``), so key schemas and indexes cannot drift. ``Meta.table_name`` holds the logical
name until ``bind`` points each model at the physical table named by the configuration.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pynamodb.attributes import (
    ListAttribute,
    MapAttribute,
    NumberAttribute,
    UnicodeAttribute,
)
from pynamodb.models import Model

from shoal.config import Config


class StorageTopicAttr(MapAttribute[str, Any]):
    index = NumberAttribute()
    stream = UnicodeAttribute()
    partitions = NumberAttribute()
    k = NumberAttribute()


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
                out[name] = [
                    {k: v for k, v in index.items() if k != "ProvisionedThroughput"}
                    for index in raw[key]
                ]
        return out


TABLES: tuple[TableDef, ...] = (TableDef("topics", TopicModel),)


def bind(config: Config) -> None:
    """Point every model at its physical table; called once per cold start."""
    for table in TABLES:
        meta: Any = table.model.Meta
        meta.table_name = config.table(table.logical)
        meta.region = config.region
        # a model caches its connection; drop it so the new name and region take effect
        table.model._connection = None
