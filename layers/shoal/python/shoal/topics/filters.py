"""MQTT 5 topic names and topic filters: validation, matching and ``$share`` parsing.

The rules are MQTT 5.0 section 4.7: levels are separated by ``/`` and an empty level is a level
(``a//b`` has three); ``+`` matches exactly one whole level; ``#`` matches the parent level and
any number of child levels, so it must be the last level and stand alone (``a/#`` matches ``a``);
a topic name holds no wildcard; a filter whose first level is a wildcard does not match a topic
name that starts with ``$``. Both are UTF-8 strings of at most 65,535 bytes without U+0000.

Public for embedders and conformance checks: ``matches(filter, topic)``, ``is_valid_filter``,
``is_valid_topic``, ``parse_shared`` (which raises ``InvalidFilter``, importable from here or
``shoal.core.errors``, for a malformed ``$share/{ShareName}/{filter}``).
``shoal.topics.index`` answers ``matches`` for many filters at once.
"""

from __future__ import annotations

from shoal.core.errors import InvalidFilter

#: MQTT's UTF-8 string length prefix is two bytes
MAX_TOPIC_BYTES = 65_535
SEPARATOR = "/"
SINGLE_LEVEL = "+"
MULTI_LEVEL = "#"
SHARE_PREFIX = "$share/"


def _utf8_length(text: str) -> int | None:
    """The UTF-8 length, or None when ``text`` cannot be UTF-8 (lone surrogates)."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError:
        return None


def _is_mqtt_string(text: str) -> bool:
    length = _utf8_length(text)
    return length is not None and 0 < length <= MAX_TOPIC_BYTES and "\x00" not in text


def is_valid_topic(name: str) -> bool:
    """A syntactically valid topic name (``$``-topics included; publishing refuses them)."""
    return (
        isinstance(name, str)
        and _is_mqtt_string(name)
        and SINGLE_LEVEL not in name
        and MULTI_LEVEL not in name
    )


def is_publishable_topic(name: str) -> bool:
    """A topic name a client may publish to: valid and not reserved for the server (``$``)."""
    return is_valid_topic(name) and not name.startswith("$")


def is_valid_filter(text: str) -> bool:
    """A syntactically valid topic filter (a ``$share/...`` string is checked by parse_shared)."""
    if not isinstance(text, str) or not _is_mqtt_string(text):
        return False
    levels = text.split(SEPARATOR)
    for position, level in enumerate(levels):
        if MULTI_LEVEL in level and (level != MULTI_LEVEL or position != len(levels) - 1):
            return False
        if SINGLE_LEVEL in level and level != SINGLE_LEVEL:
            return False
    return True


def filter_problem(text: object) -> str | None:
    """Why ``text`` is not a valid topic filter (``$share/...`` included), naming the rule of
    MQTT 5 it breaks; None when it is valid. The words of an ``invalid_filter`` answer."""
    if not isinstance(text, str):
        return "a topic filter is a string"
    shown = text if len(text) <= 80 else text[:77] + "..."
    if text.startswith(SHARE_PREFIX):
        share, sep, rest = text[len(SHARE_PREFIX) :].partition(SEPARATOR)
        if not share or SINGLE_LEVEL in share or MULTI_LEVEL in share:
            return (
                f"{shown!r}: a shared subscription's ShareName is at least one character "
                "without '/', '+' or '#' [MQTT-4.8.2-1, MQTT-4.8.2-2]"
            )
        if not sep or not rest:
            return (
                f"{shown!r}: a shared subscription is $share/{{ShareName}}/{{filter}}: the "
                "ShareName is followed by '/' and a topic filter [MQTT-4.8.2-2]"
            )
        inner = filter_problem(rest)
        return f"{shown!r}: {inner}" if inner is not None else None
    length = _utf8_length(text)
    if not text:
        return "a topic filter is at least one character long [MQTT-4.7.3-1]"
    if "\x00" in text:
        return f"{shown!r}: a topic filter holds no null character (U+0000) [MQTT-4.7.3-2]"
    if length is None or length > MAX_TOPIC_BYTES:
        return "a topic filter is UTF-8 of at most 65,535 bytes [MQTT-4.7.3-3]"
    levels = text.split(SEPARATOR)
    for position, level in enumerate(levels):
        if MULTI_LEVEL in level and (level != MULTI_LEVEL or position != len(levels) - 1):
            return (
                f"{shown!r}: '#' must be the last level of a filter, on its own "
                "(as in 'a/#') [MQTT-4.7.1-1]"
            )
        if SINGLE_LEVEL in level and level != SINGLE_LEVEL:
            return (
                f"{shown!r}: '+' must fill a whole level of a filter (as in 'a/+/c') [MQTT-4.7.1-2]"
            )
    return None


def matches(topic_filter: str, topic: str) -> bool:
    """Whether ``topic_filter`` matches the topic name ``topic``.

    Both are assumed valid; an invalid filter or name matches nothing rather than raising, so a
    malformed permission claim grants nothing.
    """
    if not is_valid_filter(topic_filter) or not is_valid_topic(topic):
        return False
    filter_levels = topic_filter.split(SEPARATOR)
    topic_levels = topic.split(SEPARATOR)
    if topic.startswith("$") and filter_levels[0] in (SINGLE_LEVEL, MULTI_LEVEL):
        return False
    for position, level in enumerate(filter_levels):
        if level == MULTI_LEVEL:
            # '#' also matches the parent: 'a/#' matches 'a'
            return True
        if position >= len(topic_levels):
            return False
        if level != SINGLE_LEVEL and level != topic_levels[position]:
            return False
    return len(filter_levels) == len(topic_levels)


def any_matches(topic_filters: tuple[str, ...] | list[str], topic: str) -> bool:
    return any(matches(f, topic) for f in topic_filters)


def parse_shared(text: str) -> tuple[str, str] | None:
    """``$share/{ShareName}/{filter}`` as ``(share_name, filter)``; None for a non-shared filter.

    Raises InvalidFilter when ``text`` starts with ``$share/`` but the share name is empty or
    holds ``/``, ``+`` or ``#``, or the filter after it is missing or invalid.
    """
    if not isinstance(text, str) or not text.startswith(SHARE_PREFIX):
        return None
    rest = text[len(SHARE_PREFIX) :]
    share, sep, topic_filter = rest.partition(SEPARATOR)
    if not share or SINGLE_LEVEL in share or MULTI_LEVEL in share:
        raise InvalidFilter("a shared subscription needs a share name without '+' or '#'")
    if not sep or not is_valid_filter(topic_filter) or not _is_mqtt_string(text):
        raise InvalidFilter("a shared subscription is $share/{ShareName}/{filter}")
    return share, topic_filter


def first_level(topic: str) -> str:
    return topic.split(SEPARATOR, 1)[0]
