"""MQTT 5 topic names and filters: validation, matching, $share."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from shoal.core import errors
from shoal.core.errors import InvalidFilter
from shoal.topics.filters import (
    MAX_TOPIC_BYTES,
    filter_problem,
    is_publishable_topic,
    is_valid_filter,
    is_valid_topic,
    matches,
    parse_shared,
)


@pytest.mark.parametrize(
    "name",
    ["a", "a/b", "/", "a//b", "/a", "a/", "$SYS/x", "sport/tennis/player1", "é/ü", " ", "a b"],
)
def test_valid_topic_names(name: str) -> None:
    assert is_valid_topic(name)


@pytest.mark.parametrize(
    "name",
    ["", "a/+", "+", "#", "a/#", "a+b", "a#", "a\x00b", "x" * (MAX_TOPIC_BYTES + 1), "\ud800"],
)
def test_invalid_topic_names(name: str) -> None:
    assert not is_valid_topic(name)


def test_topic_length_counts_utf8_bytes_not_characters() -> None:
    # Given a name of 65,535 bytes, and one of 65,534 characters that is longer in UTF-8
    assert is_valid_topic("x" * MAX_TOPIC_BYTES)
    assert not is_valid_topic("é" * (MAX_TOPIC_BYTES // 2 + 1))


def test_dollar_topics_are_valid_but_not_publishable() -> None:
    assert is_valid_topic("$SYS/broker")
    assert not is_publishable_topic("$SYS/broker")
    assert is_publishable_topic("SYS/$broker")


@pytest.mark.parametrize(
    "topic_filter",
    [
        "#", "+", "a/#", "a/+", "+/+", "/+", "+/", "a/+/b/#", "a//b", "$share", "+/#",
        # MQTT 5 section 4.7.1
        "sport/tennis/player1/#", "sport/#", "sport/tennis/#", "+/tennis/#", "sport/+/player1",
        "/", "//", "$SYS/#", "$SYS/+/x", "a/$/b", "Accounts payable", "é/+/ü",
    ],
)  # fmt: skip
def test_valid_filters(topic_filter: str) -> None:
    assert is_valid_filter(topic_filter)


@pytest.mark.parametrize(
    "topic_filter",
    [
        "", "a#", "a/#/b", "#/a", "a+", "a/b+/c", "++", "##", "a\x00", "a/#b",
        # MQTT 5 section 4.7.1
        "sport/tennis#", "sport/tennis/#/ranking", "sport+", "+a", "a/+b", "#/", "+#", "#+",
        "x" * (MAX_TOPIC_BYTES + 1), "\ud800",
    ],
)  # fmt: skip
def test_invalid_filters(topic_filter: str) -> None:
    assert not is_valid_filter(topic_filter)


@pytest.mark.parametrize(
    ("topic_filter", "topic", "expected"),
    [
        ("sport/tennis/player1/#", "sport/tennis/player1", True),
        ("sport/tennis/player1/#", "sport/tennis/player1/ranking", True),
        ("sport/tennis/player1/#", "sport/tennis/player1/score/wimbledon", True),
        ("sport/#", "sport", True),
        ("#", "sport", True),
        ("#", "/", True),
        ("sport/tennis/+", "sport/tennis/player1", True),
        ("sport/tennis/+", "sport/tennis/player1/ranking", False),
        ("sport/+", "sport", False),
        ("sport/+", "sport/", True),
        ("+/+", "/finance", True),
        ("/+", "/finance", True),
        ("+", "/finance", False),
        ("a/+/c", "a//c", True),
        ("a//c", "a//c", True),
        ("a/b", "a/b/c", False),
        ("a/b/c", "a/b", False),
        ("A", "a", False),
        ("#", "$SYS/x", False),
        ("+/monitor/Clients", "$SYS/monitor/Clients", False),
        ("$SYS/#", "$SYS/monitor/Clients", True),
        ("$SYS/monitor/+", "$SYS/monitor/Clients", True),
        ("a/#", "a/$x", True),
        ("a/#/b", "a/x/b", False),
        ("a/#", "a/+", False),
        # MQTT 5 section 4.7: case, spaces, leading and trailing separators
        ("ACCOUNTS", "Accounts", False),
        ("Accounts payable", "Accounts payable", True),
        ("Accounts", "Accounts payable", False),
        ("/finance", "finance", False),
        ("finance", "/finance", False),
        ("finance/", "finance", False),
        ("finance/#", "finance/", True),
        ("sport/tennis/#", "sport/tennis", True),
        ("sport/tennis/#", "sport/tennisplayer1", False),
        ("sport/+/player1", "sport/tennis/player1", True),
        ("sport/+/player1", "sport/player1", False),
        ("+/tennis/#", "sport/tennis/player1/ranking", True),
        ("+/tennis/#", "tennis", False),
        # empty levels are levels
        ("+/+", "/", True),
        ("+", "/", False),
        ("/#", "/", True),
        ("/#", "/a/b", True),
        ("/#", "a/b", False),
        ("+/#", "a", True),
        ("+/#", "/", True),
        ("a/+/#", "a/b", True),
        ("a/+/#", "a", False),
        ("a//#", "a/", True),
        ("a/+", "a//", False),
        ("+/+/+", "a//", True),
        # '$'-topics: only a first level that is not a wildcard can match them
        ("$SYS/#", "$SYS", True),
        ("+", "$SYS", False),
        ("+/#", "$SYS/x", False),
        ("+/+", "$x/y", False),
        ("$x/+", "$x/y", True),
        ("a/+", "a/$b", True),
        ("+", "$", False),
        ("$", "$", True),
        ("#", "$", False),
        ("$share/g/#", "$share/g/x", True),
        ("+/g/x", "$share/g/x", False),
        # wildcard characters are whole levels only, never literal in a filter
        ("a/+", "a/b+", False),
        ("é/+", "é/ü", True),
        ("a\x00", "a\x00", False),
    ],
)
def test_matching_follows_mqtt_5(topic_filter: str, topic: str, expected: bool) -> None:
    assert matches(topic_filter, topic) is expected


levels = st.lists(st.text(alphabet="ab$é ", max_size=3), min_size=1, max_size=5).filter(
    lambda parts: "/".join(parts) != ""
)


@given(levels)
def test_a_topic_matches_itself_and_hash(parts: list[str]) -> None:
    topic = "/".join(parts)
    assert matches(topic, topic)
    assert matches("#", topic) is not topic.startswith("$")


@given(levels, st.data())
def test_plus_matches_any_one_level(parts: list[str], data: st.DataObject) -> None:
    # Given a topic and a filter with one level replaced by '+'
    topic = "/".join(parts)
    position = data.draw(st.integers(0, len(parts) - 1))
    topic_filter = "/".join("+" if n == position else p for n, p in enumerate(parts))
    # Then it matches, unless '+' is first and the topic is a $-topic
    assert matches(topic_filter, topic) is not (position == 0 and topic.startswith("$"))


@given(levels, st.data())
def test_hash_matches_every_descendant_and_the_parent(
    parts: list[str], data: st.DataObject
) -> None:
    cut = data.draw(st.integers(1, len(parts)))
    prefix = "/".join(parts[:cut])
    assert matches(f"{prefix}/#", "/".join(parts))
    # the parent itself, when it is a topic name ('' is not)
    assert matches(f"{prefix}/#", prefix) is (prefix != "")


def test_invalid_filters_and_names_match_nothing() -> None:
    assert not matches("a/#/b", "a/x/b")
    assert not matches("#", "a/+")
    assert not matches("#", "")


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("$share/group1/sport/#", ("group1", "sport/#")),
        ("$share/g/+", ("g", "+")),
        ("$share/g//", ("g", "/")),
        # MQTT 5 section 4.8.2
        ("$share/consumer1/sport/tennis/+", ("consumer1", "sport/tennis/+")),
        ("$share/consumer2/sport/tennis/+", ("consumer2", "sport/tennis/+")),
        ("$share/consumer1//finance", ("consumer1", "/finance")),
        ("$share/consumer1/+/+", ("consumer1", "+/+")),
        ("$share/g/#", ("g", "#")),
        ("$share/g/$SYS/#", ("g", "$SYS/#")),
        ("$share/$g/a", ("$g", "a")),
        ("$share/é ü/a", ("é ü", "a")),
    ],
)
def test_parse_shared_splits_share_and_filter(text: str, parsed: tuple[str, str]) -> None:
    assert parse_shared(text) == parsed


@pytest.mark.parametrize("text", ["sport/#", "$SYS/#", "$share", "$sharex/a/b", "share/a/b"])
def test_non_shared_filters_parse_to_none(text: str) -> None:
    assert parse_shared(text) is None


@pytest.mark.parametrize(
    "text",
    [
        "$share/", "$share//a", "$share/g", "$share/g/", "$share/g+/a", "$share/#/a",
        "$share/g/a#", "$share/+/a", "$share/a+b/x", "$share/a#b/x", "$share/g/a/#/b",
        "$share/g/a+", "$share/g/a\x00", "$share/g/" + "x" * MAX_TOPIC_BYTES,
    ],
)  # fmt: skip
def test_malformed_shared_filters_raise(text: str) -> None:
    with pytest.raises(InvalidFilter) as raised:
        parse_shared(text)
    assert raised.value.code == "invalid_filter"


def test_invalid_filter_is_the_documented_bad_request() -> None:
    # the error embedders catch is the one the API maps to 400 invalid_filter
    with pytest.raises(errors.InvalidFilter) as raised:
        parse_shared("$share//x")
    assert (raised.value.status, raised.value.code) == (400, "invalid_filter")


@given(levels)
def test_shared_filters_wrap_any_valid_filter(parts: list[str]) -> None:
    topic_filter = "/".join(parts)
    assert parse_shared(f"$share/g/{topic_filter}") == ("g", topic_filter)


@pytest.mark.parametrize(
    ("topic_filter", "rule"),
    [
        (
            "jobs/#/x",
            "'#' must be the last level of a filter, on its own (as in 'a/#') [MQTT-4.7.1-1]",
        ),
        ("jobs/a#", "'#' must be the last level"),
        ("jobs/a+/x", "'+' must fill a whole level of a filter (as in 'a/+/c') [MQTT-4.7.1-2]"),
        ("", "at least one character long [MQTT-4.7.3-1]"),
        ("a\x00b", "no null character (U+0000) [MQTT-4.7.3-2]"),
        ("$share//x", "ShareName is at least one character without '/', '+' or '#'"),
        ("$share/g", "$share/{ShareName}/{filter}"),
        ("$share/g/a/#/b", "'$share/g/a/#/b': 'a/#/b': '#' must be the last level"),
    ],
)
def test_an_invalid_filter_names_the_rule_it_breaks(topic_filter: str, rule: str) -> None:
    problem = filter_problem(topic_filter)
    assert problem is not None and rule in problem
    assert not is_valid_filter(topic_filter) or topic_filter.startswith("$share/")


def test_a_valid_filter_has_no_problem() -> None:
    for topic_filter in ("a/#", "#", "+/b/+", "$share/g/a/+", "a//b"):
        assert filter_problem(topic_filter) is None
