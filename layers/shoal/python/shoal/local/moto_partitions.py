"""The sort keys of moto's table partitions, kept in order, so that a query finds the items its
sort key condition names by bisection (``shoal.local.moto_dynamodb.query_one_partition``).

moto keeps a partition as a dict of its items by sort key, in no order, so a query looked at
every item of its partition to keep those its condition names. Under ``shoal dev`` partitions
only grow (nothing expires items by TTL: a session's consumed deliveries stay in its inbox
partition), and every get and every idle long poll queries its inbox: nine minutes into a
soak that walk was 4.7 % of the server's GIL time (py-spy ``--gil``, 2026-12-05), and it grows
with the run. Each partition a query reads gets its keys sorted once, by moto's own order
(``DynamoType.cast_value``); ``Table.put_item`` and ``Table.delete_item`` keep the list in
step, and whatever else changes a partition (a transaction's rollback, a snapshot's new
tables, a partition dict replaced) drops it or fails its check (the same dict, as many keys),
so it is sorted again at its next query. Only string and number sort keys are kept (a binary
key's order in moto is its base64 text's).

A key condition's items are a contiguous run of the sorted keys (moto compares cast values
with Python's operators, a total order on strings and on decimals); the query still applies
moto's own check to that run, so what it answers is what moto's walk answered.
"""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

#: moto's comparison names (the key condition parser's, and the legacy API's) by operator
_OPERATORS = {
    "EQ": "=",
    "=": "=",
    "LT": "<",
    "<": "<",
    "LE": "<=",
    "<=": "<=",
    "GT": ">",
    ">": ">",
    "GE": ">=",
    ">=": ">=",
    "BETWEEN": "between",
    "BEGINS_WITH": "begins_with",
}
#: the sort key types whose cast values sort as moto compares them
_SORTABLE = ("S", "N")


@dataclass
class _SortedKeys:
    #: the partition dict these are the keys of (a replaced dict is sorted anew)
    partition: dict[Any, Any]
    #: its sort keys (``DynamoType``), in order
    keys: list[Any]
    #: their cast values, in the same order (what bisection compares)
    values: list[Any]


#: per table, per partition key: its sorted keys (not pickled: a snapshot makes new tables)
_SORTED: weakref.WeakKeyDictionary[Any, dict[Any, _SortedKeys]] = weakref.WeakKeyDictionary()


def forget_sorted_keys(table: Any) -> None:
    """Drop the table's sorted keys: its partitions were changed behind the hooks' backs."""
    _SORTED.pop(table, None)


def _drop(table: Any, hash_key: Any) -> None:
    """Drop one partition's kept keys: it is sorted anew at its next query."""
    per_table = _SORTED.get(table)
    if per_table is not None:
        per_table.pop(hash_key, None)


def _sorted(table: Any, hash_key: Any, partition: dict[Any, Any]) -> _SortedKeys | None:
    """The partition's keys in order, sorted now if they are not kept or the kept ones no
    longer match it; None when its keys are not all of one sortable type."""
    per_table = _SORTED.get(table)
    if per_table is None:
        per_table = _SORTED[table] = {}
    kept = per_table.get(hash_key)
    if kept is not None and kept.partition is partition and len(kept.keys) == len(partition):
        return kept
    keys = list(partition)
    kinds = {k.type for k in keys}
    if len(kinds) > 1 or (kinds and not kinds <= set(_SORTABLE)):
        per_table.pop(hash_key, None)
        return None
    keys.sort(key=lambda k: k.cast_value)
    kept = per_table[hash_key] = _SortedKeys(partition, keys, [k.cast_value for k in keys])
    return kept


class StaleKeys(LookupError):
    """The kept keys name an item the partition no longer holds: it was changed behind the
    hooks' backs (the caller forgets the keys and walks the partition)."""


@dataclass
class Run:
    """The partition's items whose sort key may meet a condition: a run of its sorted keys."""

    partition: dict[Any, Any]
    keys: list[Any]
    start: int
    end: int

    def items(self, *, reverse: bool = False) -> Iterator[Any]:
        """The run's items in key order (``reverse``: from the last), each looked up as it is
        asked for, so that a page stops reading where it ends."""
        keys = self.keys[self.start : self.end]
        for key in reversed(keys) if reverse else keys:
            item = self.partition.get(key)
            if item is None:
                raise StaleKeys(key)
            yield item


def candidates(
    table: Any, hash_key: Any, comparison: str | None, operands: list[Any]
) -> Run | None:
    """The run of the partition's items whose sort key may meet ``comparison`` with
    ``operands`` (moto's ``DynamoType`` values); None when bisection cannot say (an operator
    or a key type it does not keep), and the caller walks the partition as moto does."""
    operator = _OPERATORS.get(comparison or "")
    partition = table.items.get(hash_key)
    if partition is None:
        return Run({}, [], 0, 0)
    if operator is None or not operands or any(o.type not in _SORTABLE for o in operands):
        return None
    kept = _sorted(table, hash_key, partition)
    if kept is None:
        return None
    if kept.keys and any(o.type != kept.keys[0].type for o in operands):
        return None  # moto's comparison of mixed types decides that, not an order
    values = kept.values
    first = operands[0].cast_value
    if operator == "=":
        start, end = bisect.bisect_left(values, first), bisect.bisect_right(values, first)
    elif operator == "<":
        start, end = 0, bisect.bisect_left(values, first)
    elif operator == "<=":
        start, end = 0, bisect.bisect_right(values, first)
    elif operator == ">":
        start, end = bisect.bisect_right(values, first), len(values)
    elif operator == ">=":
        start, end = bisect.bisect_left(values, first), len(values)
    elif operator == "between":
        if len(operands) < 2:
            return None
        start = bisect.bisect_left(values, first)
        end = bisect.bisect_right(values, operands[1].cast_value)
    else:  # begins_with: the run from the prefix on, while the keys start with it
        if not isinstance(first, str):
            return None
        start = end = bisect.bisect_left(values, first)
        while end < len(values) and values[end].startswith(first):
            end += 1
    return Run(partition, kept.keys, start, end)


def keep_sorted_keys() -> None:
    """Have ``Table.put_item`` and ``Table.delete_item`` keep a partition's sorted keys in
    step, once the partition has them (a put of a new key inserts it, a delete removes it)."""
    from moto.dynamodb.models.table import Table

    if getattr(Table.put_item, "_keeps_sorted", False):
        return
    put_item = Table.put_item
    delete_item = Table.delete_item

    def kept_for(table: Any, hash_key: Any) -> _SortedKeys | None:
        per_table = _SORTED.get(table)
        kept = per_table.get(hash_key) if per_table is not None else None
        if kept is not None and kept.partition is not table.items.get(hash_key):
            _drop(table, hash_key)
            return None
        return kept

    def put(self: Any, *args: Any, **kwargs: Any) -> Any:
        item = put_item(self, *args, **kwargs)
        range_key = getattr(item, "range_key", None)
        if range_key is None:
            return item
        kept = kept_for(self, item.hash_key)
        if kept is None:
            return item
        if range_key.type != (kept.keys[0].type if kept.keys else range_key.type):
            _drop(self, item.hash_key)
            return item
        value = range_key.cast_value
        at = bisect.bisect_left(kept.values, value)
        if at == len(kept.values) or kept.values[at] != value:
            kept.values.insert(at, value)
            kept.keys.insert(at, range_key)
        elif kept.keys[at] != range_key:
            # another key of the same value (moto keeps "1" and "1.0" apart): sort anew
            _drop(self, item.hash_key)
        return item

    def delete(self: Any, hash_key: Any, range_key: Any) -> Any:
        item = delete_item(self, hash_key, range_key)
        if item is None or range_key is None:
            return item
        kept = kept_for(self, hash_key)
        if kept is None:
            return item
        value = range_key.cast_value
        at = bisect.bisect_left(kept.values, value) if range_key.type in _SORTABLE else -1
        if 0 <= at < len(kept.values) and kept.keys[at] == range_key:
            del kept.values[at]
            del kept.keys[at]
        else:
            _drop(self, hash_key)
        return item

    put._keeps_sorted = True  # type: ignore[attr-defined]
    Table.put_item = put
    Table.delete_item = delete
