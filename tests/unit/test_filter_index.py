"""The filter index: the same answers as shoal.topics.matches, kept up to date incrementally."""

from __future__ import annotations

from collections import Counter
from itertools import chain

import pytest
import shoal.topics.filters as topics
import shoal.topics.index as index_module
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule
from shoal.core.errors import InvalidFilter
from shoal.topics.index import MAX_CACHED_TOPIC, FilterIndex

# Few distinct level names, so that random filters and topics overlap often; '' and '$x' keep
# the empty-level and $-topic rules in play.
TOPIC_LEVEL = st.sampled_from(["a", "b", "", "$x", "c d"])
FILTER_LEVEL = st.one_of(TOPIC_LEVEL, st.just("+"))
topic_names = st.lists(TOPIC_LEVEL, min_size=1, max_size=4).map("/".join).filter(bool)
topic_filters = st.builds(
    lambda levels, hash_ended: "/".join([*levels, "#"] if hash_ended else levels),
    st.lists(FILTER_LEVEL, min_size=0, max_size=4),
    st.booleans(),
).filter(topics.is_valid_filter)
subscriptions = st.lists(st.tuples(topic_filters, st.integers(0, 5)), max_size=30)


def expected(pairs: list[tuple[str, int]] | set[tuple[str, int]], topic: str) -> set[int]:
    return {value for topic_filter, value in pairs if topics.matches(topic_filter, topic)}


def flattened(index: FilterIndex[int], topic: str) -> Counter[int]:
    """The values of the topic's buckets, counted: a value held under two matching filters is
    in two buckets."""
    return Counter(chain.from_iterable(index.buckets(topic)))


def keys_by_name(index: FilterIndex[int]) -> Counter[str]:
    """How many nodes each level name keys, checking that they share one string per name."""
    found: Counter[str] = Counter()
    nodes = [index._root]
    while nodes:
        node = nodes.pop()
        for name, child in node.children.items():
            assert name is index._names[name]
            found[name] += 1
            nodes.append(child)
        if node.plus is not None:
            nodes.append(node.plus)
    return found


def contents(index: FilterIndex[str], topic: str) -> list[list[str]]:
    """The topic's buckets by their contents, in a fixed order (empty buckets included)."""
    return sorted(sorted(bucket) for bucket in index.buckets(topic))


def test_hash_matches_the_parent_level_and_every_descendant() -> None:
    # Given 'a/#'
    index: FilterIndex[str] = FilterIndex()
    index.add("a/#", "s")
    # Then it matches 'a', 'a/' and deeper, not 'ab' or 'b/a'
    assert [index.match(t) for t in ("a", "a/", "a/b/c")] == [{"s"}, {"s"}, {"s"}]
    assert index.match("ab") == set()
    assert index.match("b/a") == set()


def test_empty_levels_are_levels() -> None:
    index: FilterIndex[str] = FilterIndex()
    index.add("+/+", "two")
    index.add("/+", "root-then-one")
    index.add("+", "one")
    # When '/finance' (two levels, the first empty) is looked up
    assert index.match("/finance") == {"two", "root-then-one"}
    assert index.match("/") == {"two", "root-then-one"}
    assert index.match("finance") == {"one"}


def test_leading_wildcards_do_not_match_dollar_topics() -> None:
    # Given wildcards at the root and below it
    index: FilterIndex[str] = FilterIndex()
    for topic_filter in ("#", "+/monitor/Clients", "$SYS/#", "$SYS/monitor/+", "+/#"):
        index.add(topic_filter, topic_filter)
    # Then only the filters that name '$SYS' match the $-topic
    assert index.match("$SYS/monitor/Clients") == {"$SYS/#", "$SYS/monitor/+"}
    assert index.match("$SYS") == {"$SYS/#"}
    # and a '$' below the first level is an ordinary character
    assert index.match("a/$SYS") == {"#", "+/#"}


def test_one_value_under_many_filters_and_many_values_under_one_filter() -> None:
    index: FilterIndex[str] = FilterIndex()
    index.add("a/+", "s1")
    index.add("a/b", "s1")
    index.add("a/b", "s2")
    index.add("a/b", "s2")  # the same pair twice is held once
    assert len(index) == 3
    assert index.match("a/b") == {"s1", "s2"}


def test_invalid_topic_names_match_nothing() -> None:
    index: FilterIndex[str] = FilterIndex()
    index.add("#", "all")
    index.add("a/+", "plus")
    # a lone surrogate is not UTF-8; 65,536 bytes are one too many, in ASCII or not
    for name in ("", "a/+", "a/#", "a\x00", "a/\udc80", "a" * 65_536, "\u00e9" * 32_768):
        assert index.match(name) == set()
        assert index.buckets(name) == ()
    # and the longest names are valid, in ASCII or not
    assert index.match("a" * 65_535) == {"all"}
    assert index.match("\u00e9" * 32_767) == {"all"}
    assert index.match("a/\u00e9") == {"all", "plus"}


@pytest.mark.parametrize("topic_filter", ["", "a/#/b", "a+", "#a", "$share/g/a#"])
def test_add_refuses_an_invalid_filter(topic_filter: str) -> None:
    index: FilterIndex[str] = FilterIndex()
    with pytest.raises(InvalidFilter):
        index.add(topic_filter, "s")
    assert len(index) == 0


def test_remove_reports_whether_the_pair_was_held() -> None:
    index: FilterIndex[str] = FilterIndex()
    index.add("a/+", "s1")
    assert not index.remove("a/+", "s2")
    assert not index.remove("a/#", "s1")
    assert not index.remove("a/+/c", "s1")
    assert not index.remove("a/#/b", "s1")
    assert index.remove("a/+", "s1")
    assert not index.remove("a/+", "s1")
    assert len(index) == 0


def test_the_match_is_a_fresh_set() -> None:
    # Given a match the caller changes
    index: FilterIndex[str] = FilterIndex()
    index.add("#", "s")
    index.match("a").add("intruder")
    # Then the index is unchanged
    assert index.match("a") == {"s"}


def test_remove_prunes_the_nodes_it_empties() -> None:
    # Given filters that share a prefix
    index: FilterIndex[str] = FilterIndex()
    for topic_filter in ("a/b/c", "a/+/#", "#", "a/b"):
        index.add(topic_filter, "s")
    # When all but one are removed
    for topic_filter in ("a/b/c", "a/+/#", "#"):
        assert index.remove(topic_filter, "s")
    # Then only the path of 'a/b' remains
    root = index._root
    assert root.plus is None and not root.hash_values and list(root.children) == ["a"]
    a = root.children["a"]
    assert a.plus is None and list(a.children) == ["b"] and a.children["b"].children == {}
    # and removing the last one leaves an empty root, and no level name kept
    assert index.remove("a/b", "s")
    assert root.is_empty()
    assert index._names == {} and index._name_uses == {}


@given(subscriptions, st.lists(topic_names, min_size=1, max_size=10))
def test_match_equals_a_scan_with_topics_matches(
    pairs: list[tuple[str, int]], names: list[str]
) -> None:
    index: FilterIndex[int] = FilterIndex()
    for topic_filter, value in pairs:
        index.add(topic_filter, value)
    assert len(index) == len(set(pairs))
    for name in names:
        assert index.match(name) == expected(pairs, name)


@given(
    st.lists(st.tuples(topic_filters, st.integers(0, 3)), max_size=30),
    st.lists(topic_names, min_size=1, max_size=10),
)
def test_buckets_flattened_are_the_pairs_a_scan_matches(
    subscribers: list[tuple[str, int]], names: list[str]
) -> None:
    # Given values that name their filter, so a bucket's values say which filter matched
    pairs = [(topic_filter, (topic_filter, n)) for topic_filter, n in subscribers]
    index: FilterIndex[tuple[str, int]] = FilterIndex()
    for topic_filter, value in pairs:
        index.add(topic_filter, value)
    for name in names:
        # Then every held pair whose filter matches is in exactly one bucket, and nothing else is
        found = Counter(chain.from_iterable(index.buckets(name)))
        scanned = Counter(
            value for topic_filter, value in set(pairs) if topics.matches(topic_filter, name)
        )
        assert found == scanned
        assert all(index.buckets(name))  # no empty bucket


def test_a_cached_answer_sees_an_add_that_makes_a_new_node() -> None:
    # Given 'a/b/c' answered (and cached) while only wildcards match it
    index: FilterIndex[str] = FilterIndex()
    index.add("a/+/c", "plus")
    assert contents(index, "a/b/c") == [["plus"]]
    # When filters are added on nodes that did not exist: an exact one, a '#' on an inner node
    index.add("a/b/c", "exact")
    index.add("a/b/#", "hash")
    # Then the next answer has their buckets
    assert contents(index, "a/b/c") == [["exact"], ["hash"], ["plus"]]
    # and a value added to a bucket that existed shows too
    index.add("a/b/c", "exact2")
    assert contents(index, "a/b/c") == [["exact", "exact2"], ["hash"], ["plus"]]


def test_a_cached_answer_sees_a_remove_that_prunes_a_node() -> None:
    # Given 'a/b/c' answered (and cached) with an exact filter and '#'
    index: FilterIndex[str] = FilterIndex()
    index.add("a/b/c", "exact")
    index.add("#", "all")
    assert contents(index, "a/b/c") == [["all"], ["exact"]]
    # When the exact filter goes, and its nodes with it
    assert index.remove("a/b/c", "exact")
    assert list(index._root.children) == []
    # Then the next answer is without its bucket (not with it emptied)
    assert contents(index, "a/b/c") == [["all"]]
    # and a node made again in the same place is found
    index.add("a/b/c", "again")
    assert contents(index, "a/b/c") == [["again"], ["all"]]


def test_changes_that_change_nothing_keep_the_cache() -> None:
    index: FilterIndex[str] = FilterIndex()
    index.add("a/+", "s")
    answer = index.buckets("a/b")
    # a pair held already, and pairs never held
    index.add("a/+", "s")
    assert not index.remove("a/b", "s")
    assert not index.remove("a/+", "t")
    assert index.buckets("a/b") is answer


def test_the_cache_stays_bounded() -> None:
    # Given a cache of 4 answers
    index: FilterIndex[str] = FilterIndex(cache_size=4)
    index.add("t/+", "s")
    # When 10 topics are looked up, twice
    for _ in range(2):
        for n in range(10):
            # Then every answer is right, and the cache never holds more than 4
            assert index.match(f"t/{n}") == {"s"}
            assert len(index._answers) <= 4
    # a hot topic is answered from the cache
    assert index.buckets("t/9") is index.buckets("t/9")


def test_long_topic_names_are_answered_but_not_cached() -> None:
    index: FilterIndex[str] = FilterIndex()
    index.add("#", "all")
    longest_cached = "a" * MAX_CACHED_TOPIC
    assert index.match(longest_cached + "b") == {"all"}
    assert index.match(longest_cached) == {"all"}
    assert list(index._answers) == [longest_cached]


@given(subscriptions, st.data())
def test_match_equals_a_scan_after_random_removes(
    pairs: list[tuple[str, int]], data: st.DataObject
) -> None:
    # Given an index of random subscriptions
    index: FilterIndex[int] = FilterIndex()
    for topic_filter, value in pairs:
        index.add(topic_filter, value)
    held = set(pairs)
    # When a random selection is removed (some of them twice, some never held)
    removals = data.draw(
        st.lists(
            st.one_of(
                st.sampled_from(pairs or [("a", 0)]), st.tuples(topic_filters, st.integers(0, 5))
            )
        )
    )
    for pair in removals:
        assert index.remove(*pair) is (pair in held)
        held.discard(pair)
    # Then it answers as a scan of what is left
    assert len(index) == len(held)
    for name in data.draw(st.lists(topic_names, min_size=1, max_size=10)):
        assert index.match(name) == expected(held, name)
    # and once everything is removed nothing is left of the trie
    for pair in list(held):
        assert index.remove(*pair)
    assert index._root.is_empty()
    assert index._names == {} and index._name_uses == {}


class IndexMachine(RuleBasedStateMachine):
    """Interleaved adds, removes and lookups (cached between changes) against a set of pairs."""

    pairs = Bundle("pairs")

    def __init__(self) -> None:
        super().__init__()
        self.index: FilterIndex[int] = FilterIndex()
        self.model: set[tuple[str, int]] = set()

    @rule(target=pairs, topic_filter=topic_filters, value=st.integers(0, 3))
    def add(self, topic_filter: str, value: int) -> tuple[str, int]:
        self.index.add(topic_filter, value)
        self.model.add((topic_filter, value))
        return topic_filter, value

    @rule(pair=consumes(pairs))
    def remove(self, pair: tuple[str, int]) -> None:
        assert self.index.remove(*pair) is (pair in self.model)
        self.model.discard(pair)

    @rule(name=topic_names)
    def match(self, name: str) -> None:
        assert self.index.match(name) == expected(self.model, name)

    @rule(name=topic_names)
    def buckets(self, name: str) -> None:
        # answers are cached between changes: a stale one would miss or keep a pair
        held = Counter(v for f, v in self.model if topics.matches(f, name))
        assert flattened(self.index, name) == held

    @invariant()
    def size(self) -> None:
        assert len(self.index) == len(self.model)

    @invariant()
    def level_names(self) -> None:
        # one string per level name, counted by the nodes it keys: none kept once unused
        assert keys_by_name(self.index) == self.index._name_uses
        assert set(self.index._names) == set(self.index._name_uses)


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=50, stateful_step_count=40)


def test_the_cache_keeps_few_answers_of_spread_traffic_and_all_of_hot_traffic(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given an index that judges its cache every 64 misses
    monkeypatch.setattr(index_module, "JUDGE_EVERY", 64)
    index: FilterIndex[str] = FilterIndex(cache_size=10_000)
    index.add("t/+", "s1")
    # When traffic spreads over more topics than repeat (every lookup a miss)
    for n in range(640):
        assert index.buckets(f"t/{n}") == ({"s1"},)
    # Then after its first judgement it keeps one miss in SAMPLE_MISSES, not each
    kept = len(index._answers)
    assert 64 <= kept < 64 + 640 // 8
    # And when traffic turns to a few hot topics, they are cached again and answered from it
    hot = [f"h/{n}" for n in range(4)]
    index.add("h/#", "s2")  # (a change empties the cache)
    for _ in range(200):
        for name in hot:
            assert index.buckets(name) == ({"s2"},)
    assert set(index._answers) == set(hot)
    assert index._keep_every == 1
