"""The subscribe side of retained messages: which are stored for a filter, read strongly
consistent (``shoal.publish.retained`` writes them).

A filter's candidates come from the retained table's ``by_composite`` index (topic names by
composite topic): the composite topic the filter's first level names and ``default`` (a topic
published before its composite topic existed), or every composite topic for a wildcard first
level. Names are matched in memory, reading at most ``MAX_RETAINED_SCAN`` index entries per
filter; the matching messages are then read by key, strongly consistent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from shoal.aws.dynamo import Dynamo, to_item
from shoal.composite.model import DEFAULT_TOPIC, is_valid_topic_name
from shoal.core.observability import logger
from shoal.delivery.model import MAX_RETAINED_SCAN
from shoal.records import CLEARED, Retained
from shoal.topics.filters import MULTI_LEVEL, SINGLE_LEVEL, first_level, matches

#: the retained table's index of topic names by composite topic (``shoal.aws.tables``)
BY_COMPOSITE = "by_composite"


class RetainedReader:
    """Retained messages matching a filter; one instance per container."""

    def __init__(self, dynamo: Dynamo, table: str, topic_names: Callable[[], list[str]]) -> None:
        self.dynamo = dynamo
        self.table = table
        #: every composite topic's name (read only for a filter with a wildcard first level)
        self.topic_names = topic_names

    def matching(self, topic_filter: str, composites: list[str] | None = None) -> list[Retained]:
        """The stored retained messages whose topic ``topic_filter`` matches.

        ``composites``: every composite topic's name, when the caller already read them (a
        call with several wildcard filters reads them once)."""
        level = first_level(topic_filter)
        if level in (SINGLE_LEVEL, MULTI_LEVEL):
            names = [*(composites if composites is not None else self.topic_names()), DEFAULT_TOPIC]
        elif is_valid_topic_name(level):
            # the topic's own composite topic, or `default` (it may have been published
            # before its composite topic existed)
            names = [level, DEFAULT_TOPIC]
        else:
            # no composite topic has this name ("" of "/a", over 64 characters): `default`
            names = [DEFAULT_TOPIC]
        keys: list[str] = []
        scanned = 0
        for composite in dict.fromkeys(names):
            for key, topic in self._entries(composite, MAX_RETAINED_SCAN - scanned):
                scanned += 1
                if matches(topic_filter, topic):
                    keys.append(key)
            if scanned >= MAX_RETAINED_SCAN:
                logger.warning("retained lookup stopped at its bound")
                break
        rows = self.dynamo.batch_get(self.table, [{"key": k} for k in keys], consistent=True)
        # the index is eventually consistent: a topic cleared since is a tombstone now
        return [Retained.from_record(r) for r in rows if not r.get(CLEARED)]

    def _entries(self, composite: str, at_most: int) -> Iterator[tuple[str, str]]:
        """(key, topic) of the composite topic's retained messages, page by page, at most
        ``at_most`` of them (the index is eventually consistent, as the lookup always was)."""
        request = {
            "IndexName": BY_COMPOSITE,
            "KeyConditionExpression": "#c = :c",
            "ExpressionAttributeNames": {"#c": "composite_topic"},
            "ExpressionAttributeValues": to_item({":c": composite}),
        }
        left = at_most
        while left > 0:
            page = self.dynamo.call("query", TableName=self.table, Limit=left, **request)
            for item in page.get("Items", []):
                left -= 1
                yield str(item["key"]["S"]), str(item["topic"]["S"])
            if "LastEvaluatedKey" not in page:
                return
            request["ExclusiveStartKey"] = page["LastEvaluatedKey"]
