"""The topics table: every read and conditional write of composite topics' metadata.

Every change is conditional on the topic's ``version``, so two admins racing on one topic
cannot both win; a loser reads again and decides again.
"""

from __future__ import annotations

from collections.abc import Sequence

from shoal.aws import tables
from shoal.aws.dynamo import Dynamo, Expression, to_item
from shoal.composite.model import CompositeTopic, StorageTopic
from shoal.core.config import Config

#: the logical name of the topics table (``shoal.aws.tables``)


class TopicStore:
    def __init__(self, dynamo: Dynamo, table: str) -> None:
        self.dynamo = dynamo
        self.table = table

    @classmethod
    def from_config(cls, config: Config) -> TopicStore:
        return cls(Dynamo.from_config(config), config.table(tables.TOPICS))

    # -- reads

    def load(self, name: str, *, consistent: bool = True) -> CompositeTopic | None:
        record = self.dynamo.get(self.table, {"name": name}, consistent=consistent)
        return CompositeTopic.from_record(record) if record else None

    def load_many(self, names: Sequence[str]) -> dict[str, CompositeTopic]:
        """The topics of ``names`` that exist, strongly consistent, in one call per 100."""
        found = self.dynamo.batch_get(self.table, [{"name": n} for n in names])
        return {str(r["name"]): CompositeTopic.from_record(r) for r in found}

    def scan(self) -> list[CompositeTopic]:
        """Every topic, created or not (a scan: admin listing and the sealer, never a publish)."""
        return [CompositeTopic.from_record(r) for r in self.dynamo.scan(self.table)]

    def names(self) -> list[str]:
        """Every topic's name (a scan reading the key only)."""
        rows = self.dynamo.scan(
            self.table, ProjectionExpression="#n", ExpressionAttributeNames={"#n": "name"}
        )
        return [str(r["name"]) for r in rows]

    # -- conditional writes: False when another change came first

    def reserve(self, name: str, pending: StorageTopic) -> bool:
        """Record a new topic whose first storage topic is ``pending``; False if it exists."""
        expr = Expression()
        item = {
            "name": name,
            "version": 1,
            "produce_pointer": 0,
            "storage_topics": [],
            "pending": pending.record(),
            "effective_at_ms": 0,
        }
        return self.dynamo.conditional(
            "put_item",
            TableName=self.table,
            Item=to_item(item),
            **expr.params(f"attribute_not_exists({expr.n('name')})"),
        )

    def add_pending(self, topic: CompositeTopic, pending: StorageTopic) -> bool:
        expr = Expression().set("pending", pending.record()).set("version", topic.version + 1)
        return self._update(topic, expr)

    def complete(self, topic: CompositeTopic, done: StorageTopic, effective_at_ms: int) -> bool:
        """Move the pending storage topic, as ``done``, to the end of the storage topics."""
        expr = Expression()
        expr.set("storage_topics", [s.record() for s in (*topic.storage_topics, done)])
        expr.remove("pending")
        expr.set("effective_at_ms", effective_at_ms).set("version", topic.version + 1)
        return self._update(topic, expr)

    def switch_produce(self, topic: CompositeTopic, effective_at_ms: int) -> bool:
        expr = Expression().set("produce_pointer", topic.produce_pointer + 1)
        expr.set("effective_at_ms", effective_at_ms).set("version", topic.version + 1)
        return self._update(topic, expr)

    def _update(self, topic: CompositeTopic, expr: Expression) -> bool:
        condition = f"{expr.n('version')} = {expr.v(topic.version)}"
        return self.dynamo.conditional(
            "update_item",
            TableName=self.table,
            Key={"name": {"S": topic.name}},
            **expr.params(condition),
        )
