"""The filter index: given a topic name, the values of every subscription whose filter matches.

The router asks it once per message, so a lookup must not look at every subscription. It is a
trie over topic levels: each node has its exact-level children, one child for ``+``, the values
of the filters that end at the node, and the values of the filters that end with ``#`` there
(``a/#`` keeps its values on the node of ``a``, which is how ``#`` matches its parent level). A
lookup walks the topic's levels once, following at most the exact and the ``+`` child of each
node it holds, so its cost grows with the topic's depth and the number of matching branches, not
with the number of subscriptions. A filter whose first level is a wildcard does not match a
``$``-topic: the walk skips the root's ``+`` child and ``#`` values for such a topic.

Updates are incremental: ``add`` creates the missing nodes of one filter, ``remove`` prunes the
nodes it leaves empty, so the trie never holds more than the live filters need. It is not
thread-safe; its owner serializes updates and lookups.

Matching follows ``shoal.topics.matches`` exactly (the property tests compare the two): an
invalid topic name matches nothing, and ``add`` refuses an invalid filter. Shared subscriptions
are added by their filter without the ``$share/{ShareName}/`` prefix.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

from shoal.core.errors import InvalidFilter
from shoal.topics.filters import (
    MULTI_LEVEL,
    SEPARATOR,
    SINGLE_LEVEL,
    is_valid_filter,
    is_valid_topic,
)

V = TypeVar("V", bound=Hashable)


class _Node(Generic[V]):
    __slots__ = ("children", "hash_values", "plus", "values")

    def __init__(self) -> None:
        self.children: dict[str, _Node[V]] = {}
        self.plus: _Node[V] | None = None
        # None rather than an empty set: most nodes are inner nodes and 100k sets cost memory
        self.values: set[V] | None = None
        self.hash_values: set[V] | None = None

    def is_empty(self) -> bool:
        return not self.children and self.plus is None and not self.values and not self.hash_values


class FilterIndex(Generic[V]):
    """Topic filters with a value each (a filter may carry many values, a value many filters)."""

    def __init__(self) -> None:
        self._root: _Node[V] = _Node()
        self._size = 0

    def __len__(self) -> int:
        """The number of (filter, value) pairs held."""
        return self._size

    def add(self, filter: str, value: V) -> None:
        """Hold ``value`` under ``filter`` (a no-op when the pair is already held)."""
        if not is_valid_filter(filter):
            raise InvalidFilter("not a valid topic filter")
        levels = filter.split(SEPARATOR)
        hash_ended = levels[-1] == MULTI_LEVEL
        if hash_ended:
            levels.pop()
        node = self._root
        for level in levels:
            if level == SINGLE_LEVEL:
                if node.plus is None:
                    node.plus = _Node()
                node = node.plus
            else:
                child = node.children.get(level)
                if child is None:
                    child = node.children[level] = _Node()
                node = child
        if hash_ended:
            if node.hash_values is None:
                node.hash_values = set()
            bucket = node.hash_values
        else:
            if node.values is None:
                node.values = set()
            bucket = node.values
        if value not in bucket:
            bucket.add(value)
            self._size += 1

    def remove(self, filter: str, value: V) -> bool:
        """Drop the pair; False when it was not held. Nodes left empty are pruned."""
        if not is_valid_filter(filter):
            return False
        levels = filter.split(SEPARATOR)
        hash_ended = levels[-1] == MULTI_LEVEL
        if hash_ended:
            levels.pop()
        path: list[tuple[_Node[V], str]] = []
        node = self._root
        for level in levels:
            child = node.plus if level == SINGLE_LEVEL else node.children.get(level)
            if child is None:
                return False
            path.append((node, level))
            node = child
        bucket = node.hash_values if hash_ended else node.values
        if not bucket or value not in bucket:
            return False
        bucket.remove(value)
        self._size -= 1
        if not bucket:
            if hash_ended:
                node.hash_values = None
            else:
                node.values = None
        # prune from the leaf up while nodes hold nothing
        for parent, level in reversed(path):
            if not node.is_empty():
                break
            if level == SINGLE_LEVEL:
                parent.plus = None
            else:
                del parent.children[level]
            node = parent
        return True

    def match(self, topic: str) -> set[V]:
        """The values of every filter that matches the topic name (a new set, the caller's)."""
        found: set[V] = set()
        if not is_valid_topic(topic):
            return found
        levels = topic.split(SEPARATOR)
        root = self._root
        nodes: list[_Node[V]] = []
        child = root.children.get(levels[0])
        if child is not None:
            nodes.append(child)
        if topic[0] != "$":
            if root.hash_values:
                found.update(root.hash_values)
            if root.plus is not None:
                nodes.append(root.plus)
        for level in levels[1:]:
            if not nodes:
                return found
            following: list[_Node[V]] = []
            for node in nodes:
                # '#' below this node matches this level and everything after it
                if node.hash_values:
                    found.update(node.hash_values)
                child = node.children.get(level)
                if child is not None:
                    following.append(child)
                if node.plus is not None:
                    following.append(node.plus)
            nodes = following
        for node in nodes:
            if node.values:
                found.update(node.values)
            # '#' matches its parent level too: 'a/#' matches 'a'
            if node.hash_values:
                found.update(node.hash_values)
        return found
