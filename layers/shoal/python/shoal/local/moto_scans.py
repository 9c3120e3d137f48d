"""moto's Scan made to count without copying (``shoal.local.aws.adapt_moto`` applies it,
process-wide and idempotent), with moto's answers.

The reaper's census counts the connections, the connected sessions and the shared groups
once a minute with ``Select=COUNT`` scans (``shoal.census``). moto answers a scan by sorting
the whole table (comparing ``DynamoType`` objects), walking again from the table's first item
to the page's start key, deep-copying every item of the page and measuring each item's size
twice, and only then applies the filter; for a count, every copy is thrown away. Under
``shoal dev`` with 10,000 connected WebSocket sessions a census took 2.0 s of CPU (cProfile:
copies 39 %, sizes 35 %, the walk to the start key 11 %), once a minute, in the one process
that also runs every function.

A ``Select=COUNT`` scan of a table (not an index; no legacy ``ScanFilter``, no segments) now
takes its page from the same order (the items sorted by their keys' values, as moto's
comparisons order them: a table's keys are all of one type), finds its start key by
bisection, measures each item once and keeps the stored items themselves: nothing of them
leaves the emulator, and the answer is built under the emulator's lock. The page ends where
moto's ends (``Limit``, or 1 MB of items read), the filter runs on the page as moto's does,
and ``ScannedCount``, ``Count`` and ``LastEvaluatedKey`` are moto's (the tests compare them).
Any other scan is moto's own.
"""

from __future__ import annotations

import bisect
import contextvars
import inspect
from typing import Any

#: set while moto's handler answers a ``Select=COUNT`` scan (its items are never answered)
_COUNTING: contextvars.ContextVar[bool] = contextvars.ContextVar("shoal_counting", default=False)


def count_scans_without_copies() -> None:
    from moto.dynamodb.models.dynamo_type import DynamoType
    from moto.dynamodb.models.table import RESULT_SIZE_LIMIT, Table
    from moto.dynamodb.responses import DynamoHandler

    if getattr(Table.scan, "_counts_without_copies", False):
        return
    moto_scan = Table.scan
    moto_handler_scan = DynamoHandler.scan

    def handler_scan(self: Any) -> Any:
        if self.body.get("Select") != "COUNT":
            return moto_handler_scan(self)
        token = _COUNTING.set(True)
        try:
            return moto_handler_scan(self)
        finally:
            _COUNTING.reset(token)

    # moto's scan takes its arguments by position: read by name through its own signature
    arguments = inspect.signature(moto_scan)

    def scan(self: Any, *args: Any, **kwargs: Any) -> Any:
        call = arguments.bind(self, *args, **kwargs)
        call.apply_defaults()
        given = call.arguments
        counting = _COUNTING.get() and not (
            given["index_name"]
            or given["filters"]
            or given["projection_expression"]
            or given["segments"] != (None, None)
        )
        start = _start_key(self, given["exclusive_start_key"], DynamoType) if counting else None
        if not counting or start is _UNREADABLE:
            return moto_scan(self, *args, **kwargs)
        limit, filter_expression = given["limit"], given["filter_expression"]
        keyed = sorted((_key_of(item), n, item) for n, item in enumerate(_items(self)))
        first = 0 if start is None else bisect.bisect_right(keyed, (start, len(keyed)))
        page: list[Any] = []
        size = 0
        last_evaluated_key = None
        for _, _, item in keyed[first:]:
            # moto's page: ``Limit`` items, or as many as fit 1 MB (each measured once here)
            item_size = item.size()
            if len(page) == limit or size + item_size > RESULT_SIZE_LIMIT:
                last_evaluated_key = self._get_last_evaluated_key(page[-1], None)
                break
            page.append(item)
            size += item_size
        scanned = len(page)
        if filter_expression is not None:
            page = [item for item in page if filter_expression.expr(item)]
        return page, scanned, last_evaluated_key

    scan._counts_without_copies = True  # type: ignore[attr-defined]
    scan._moto = moto_scan  # type: ignore[attr-defined]  # the tests compare answers
    Table.scan = scan
    DynamoHandler.scan = handler_scan


#: a start key this cannot place (a key attribute missing): moto's scan answers it
_UNREADABLE = object()


def _items(table: Any) -> list[Any]:
    """The table's items, in no order (moto's ``all_items`` before its sort)."""
    if table.range_key_attr:
        return [item for partition in table.items.values() for item in partition.values()]
    return list(table.items.values())


def _key_of(item: Any) -> Any:
    """The item's place in moto's order: its keys' values, as ``DynamoType`` compares them."""
    if item.range_key:
        return (item.hash_key.cast_value, item.range_key.cast_value)
    return item.hash_key.cast_value


def _start_key(table: Any, key: dict[str, Any] | None, dynamo_type: Any) -> Any:
    """``ExclusiveStartKey``'s place in the order ``_key_of`` gives (None: no start key)."""
    if key is None:
        return None
    try:
        hash_value = dynamo_type(key[table.hash_key_attr]).cast_value
        if table.range_key_attr:
            return (hash_value, dynamo_type(key[table.range_key_attr]).cast_value)
    except (KeyError, TypeError, IndexError, AttributeError):
        return _UNREADABLE
    return hash_value
