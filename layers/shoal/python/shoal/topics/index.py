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

Lookups answer with *buckets*: ``buckets(topic)`` gives the value sets of the matching nodes
themselves (a node's values, or its ``#`` values), not a union of them. The router needs no
union: each of its subscriptions sits under exactly one filter, so the buckets never share a
value, and it keeps one delivery per session anyway; merging ~6 buckets of a few hundred
subscribers into a new set was most of a lookup. ``match(topic)`` still gives that union as a new
set, for callers that want one. A bucket is the index's own set: callers must not change it, and
must not hold it across ``add`` or ``remove``, which change it in place (or drop it).

Hot topics are answered from a cache of answers per topic name (a bounded dict, emptied when it
fills). An answer holds the node sets it found, and an ``add`` may create a node set an answer
lacks (or a ``remove`` prune one it holds), so every change of the index empties the whole
cache: its owner applies subscription changes in batches, between lookups, so there is no point
in finding out which answers a change touches.

Matching follows ``shoal.topics.matches`` exactly (the property tests compare the two): an
invalid topic name matches nothing, and ``add`` refuses an invalid filter. Shared subscriptions
are added by their filter without the ``$share/{ShareName}/`` prefix.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

from shoal.core.errors import InvalidFilter
from shoal.topics.filters import (
    MAX_TOPIC_BYTES,
    MULTI_LEVEL,
    SEPARATOR,
    SINGLE_LEVEL,
    is_valid_filter,
    is_valid_topic,
)

V = TypeVar("V", bound=Hashable)

#: topic names whose answers are kept; an answer is a tuple of a few references, so this costs
#: a few MB at most, and holds the hot topics of skewed traffic
CACHE_SIZE = 16_384
#: longer names are not cached: names reach 64 KB, and the cache must stay small whatever the
#: traffic; hot topics are short
MAX_CACHED_TOPIC = 256
#: the cache judges itself every this many misses: when fewer than ``MIN_HIT_SHARE`` of the
#: lookups since were hits (traffic spread over more topics than it holds), it keeps only one
#: miss in ``SAMPLE_MISSES`` until hits come back; storing every answer of such traffic costs
#: the walk about a tenth and buys nothing
JUDGE_EVERY = 4096
MIN_HIT_SHARE = 0.25
SAMPLE_MISSES = 16


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

    def __init__(self, cache_size: int = CACHE_SIZE) -> None:
        """``cache_size``: how many topics' answers are kept (0 keeps the last one only)."""
        self._root: _Node[V] = _Node()
        self._size = 0
        self._cache_size = cache_size
        #: topic name -> its buckets, valid until the next change of the index
        self._answers: dict[str, tuple[set[V], ...]] = {}
        #: lookups answered from the cache, and misses, since the cache last judged itself
        self._hits = 0
        self._misses = 0
        #: keep one miss in this many (1: every one)
        self._keep_every = 1
        #: level name -> the string that keys it in every node, and how many nodes it keys
        self._names: dict[str, str] = {}
        self._name_uses: dict[str, int] = {}

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
                    child = node.children[self._name(level)] = _Node()
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
            # answers hold the node sets they found: this one may be new to them
            self._answers.clear()

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
        self._answers.clear()
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
                self._drop_name(level)
            node = parent
        return True

    def _name(self, level: str) -> str:
        """The one string the trie keys ``level`` by, for a new node. Level names repeat all over
        a trie (every device has its ``temp``); one string each makes the string a lookup
        compares with likely to be in the CPU cache, which at 100k subscriptions makes lookups
        a tenth faster. Not ``sys.intern``: on Python 3.12 an interned string lives forever,
        and subscriptions come and go."""
        name = self._names.setdefault(level, level)
        self._name_uses[name] = self._name_uses.get(name, 0) + 1
        return name

    def _drop_name(self, level: str) -> None:
        """A node keyed by ``level`` was pruned."""
        uses = self._name_uses[level] - 1
        if uses:
            self._name_uses[level] = uses
        else:
            del self._name_uses[level], self._names[level]

    def match(self, topic: str) -> set[V]:
        """The values of every filter that matches the topic name (a new set, the caller's)."""
        return set().union(*self.buckets(topic))

    def buckets(self, topic: str) -> tuple[set[V], ...]:
        """The buckets of the filters that match the topic name: each a non-empty set of the
        values of one matching filter, and no two the same set (a value is in two only when it
        was added under two matching filters). The sets are the index's own: read them, do not
        change them or keep them past the next ``add`` or ``remove``."""
        answer = self._answers.get(topic)
        if answer is not None:
            self._hits += 1
            return answer
        # (the walk is inline rather than a method of its own, to spare a miss a call)
        # is_valid_topic's rule, without its encoding for an ASCII name (one byte a character)
        if not (
            topic.isascii()
            and 0 < len(topic) <= MAX_TOPIC_BYTES
            and "\x00" not in topic
            and SINGLE_LEVEL not in topic
            and MULTI_LEVEL not in topic
        ) and not is_valid_topic(topic):
            return ()
        levels = topic.split(SEPARATOR)
        last = levels.pop()
        found: list[set[V]] = []
        append = found.append
        root = self._root
        nodes: list[_Node[V]] = [root]
        if topic[0] == "$":
            # the root's '+' and '#' do not match a $-topic: start from its exact child
            if levels:
                child = root.children.get(levels.pop(0))
                nodes = [] if child is None else [child]
            else:
                # a one-level $-topic: that child is the last level's node
                nodes = []
                if (child := root.children.get(last)) is not None:
                    if (bucket := child.values) is not None:
                        append(bucket)
                    if (bucket := child.hash_values) is not None:
                        append(bucket)
        # the nodes matching the levels so far: at most the exact and the '+' child of each.
        # (An attribute that is mostly None is read twice rather than bound with ':=', which
        # costs more when it is None.)
        for level in levels:
            following: list[_Node[V]] = []
            push = following.append
            for node in nodes:
                # '#' below this node matches this level and everything after it
                if node.hash_values is not None:
                    append(node.hash_values)
                if (child := node.children.get(level)) is not None:
                    push(child)
                if node.plus is not None:
                    push(node.plus)
            nodes = following
            if not nodes:
                break
        # the last level, without building the nodes that match it: their buckets are the answer
        for node in nodes:
            if node.hash_values is not None:
                append(node.hash_values)
            # unrolled for the exact and the '+' child: a loop over the two costs a tenth more
            if (child := node.children.get(last)) is not None:
                if child.values is not None:
                    append(child.values)
                # '#' matches its parent level too: 'a/#' matches 'a'
                if child.hash_values is not None:
                    append(child.hash_values)
            if (child := node.plus) is not None:
                if child.values is not None:
                    append(child.values)
                if child.hash_values is not None:
                    append(child.hash_values)
        answer = tuple(found)
        misses = self._misses = self._misses + 1
        if misses >= JUDGE_EVERY:
            share = self._hits / (self._hits + misses)
            self._keep_every = 1 if share >= MIN_HIT_SHARE else SAMPLE_MISSES
            self._hits = self._misses = 0
        if len(topic) <= MAX_CACHED_TOPIC and not misses % self._keep_every:
            if len(self._answers) >= self._cache_size:
                # emptied rather than evicted one by one (an LRU would reorder on every hit): the
                # hot topics come back with their next lookups
                self._answers.clear()
            self._answers[topic] = answer
        return answer
