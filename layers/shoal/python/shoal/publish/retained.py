"""The retained store: the latest retained message of each MQTT topic name.

Topic names reach 65,535 bytes and a partition key 2,048, so an item's key is a digest of the
name. A retained message replaces the stored one only if it was published at or after it (in one
millisecond: at or after its publisher seq), so a late publish never overwrites a newer one; an
empty payload clears the topic's message, leaving a tombstone (``CLEARED``) with its time, so
that a late retry of an older publish never brings a cleared message back.
Subscribers read these items through the ``by_composite`` index (``shoal.delivery``).
"""

from __future__ import annotations

import json
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from shoal.aws import tables
from shoal.aws.dynamo import Dynamo, Expression, to_item
from shoal.core.config import Config
from shoal.core.errors import ServerBusy
from shoal.records import CLEARED, Message, Retained, retained_key

#: a retained message lives in one DynamoDB item (400 KB); leave room for its attributes
MAX_RETAINED_BYTES = 350_000


class RetainedStore:
    """The latest retained message per topic name; older publishes never overwrite newer."""

    def __init__(self, dynamo: Dynamo, table: str) -> None:
        self.dynamo = dynamo
        self.table = table

    @classmethod
    def from_config(cls, config: Config) -> RetainedStore:
        return cls(Dynamo.from_config(config), config.table(tables.RETAINED))

    def apply(self, message: Message, composite: str) -> None:
        key = retained_key(message.topic)
        expr = Expression()
        # Publishes of one millisecond are ordered by their publisher seq, so a late retry of
        # a publisher's earlier seq never replaces its later one of the same instant.
        seq = message.publisher_seq or 0
        at = expr.v(message.published_at_ms)
        newer_or_absent = (
            f"attribute_not_exists({expr.n('key')})"
            f" OR {expr.n('published_at_ms')} < {at}"
            f" OR ({expr.n('published_at_ms')} = {at}"
            f" AND (attribute_not_exists({expr.n('seq')}) OR {expr.n('seq')} <= {expr.v(seq)}))"
        )
        request: dict[str, Any]
        if message.payload:
            item: dict[str, Any] = {
                "key": key,
                "topic": message.topic,
                "composite_topic": composite,
                "message_id": message.message_id,
                "payload": message.payload,
                "qos": message.qos,
                "published_at_ms": message.published_at_ms,
                "seq": seq,
                "publisher": message.sub,
            }
            if message.properties:
                item["properties"] = json.dumps(message.properties)
            operation, request = "put_item", {"Item": to_item(item)}
        else:
            # cleared: a tombstone, not a delete, so that a late retry of an older retained
            # publish still finds a newer message here and stays out. Without a composite
            # topic it is out of the ``by_composite`` index; readers skip it (``CLEARED``)
            operation = "put_item"
            request = {
                "Item": to_item(
                    {
                        "key": key,
                        "topic": message.topic,
                        "published_at_ms": message.published_at_ms,
                        "seq": seq,
                        CLEARED: True,
                    }
                )
            }
        try:
            # False: a newer message is retained already, which stays
            self.dynamo.conditional(
                operation, TableName=self.table, **request, **expr.params(newer_or_absent)
            )
        except (ClientError, BotoCoreError, ServerBusy) as exc:
            raise ServerBusy("the retained message could not be stored; retry") from exc

    def get(self, topic: str) -> Retained | None:
        record = self.dynamo.get(self.table, {"key": retained_key(topic)})
        return None if record is None or record.get(CLEARED) else Retained.from_record(record)
