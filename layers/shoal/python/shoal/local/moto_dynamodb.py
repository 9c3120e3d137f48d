"""moto's DynamoDB made to cost what DynamoDB's own calls cost (``shoal.local.aws.adapt_moto``
applies these, process-wide and idempotent): a query reads its partition, not the table; a
response's attribute values are written without a walk of their shape; a failed transaction
undoes only the items it names. Each keeps moto's answers (the tests compare them)."""

from __future__ import annotations

import base64
import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any

from shoal.local.moto_partitions import (
    Run,
    StaleKeys,
    candidates,
    forget_sorted_keys,
    keep_sorted_keys,
)


def query_one_partition() -> None:
    """Make a Query on a table (not an index) read only the items its key condition names.

    moto starts every Query from ``all_items()``: every item of the table, sorted by key, of
    which it keeps the queried hash key's; then it measures the size of each of those before
    it checks the sort key condition. So each query costs time in proportion to the whole
    table and to the whole partition, under the emulator's one lock, and under ``shoal dev``
    both only grow (consumed deliveries stay in a session's inbox partition until TTL). An
    empty query of a 10-item partition took 4.6 ms in a table of 500 items and 16 ms in one of
    2,000 (2.1 and 2.7 ms with this); the get's inbox query spent 60% of its time sizing items
    it then skipped. This hands moto the partition's items that meet the sort key condition;
    moto sorts and checks them as before, so the answer is the same (``DynamoType`` hashes and
    compares by type and value alike, so the dict lookup finds exactly the items moto's filter
    kept), except that moto no longer ends a page early for the size of an item outside the
    key condition, which DynamoDB never reads either. Queries with a legacy ``QueryFilter``
    only get the partition. The items a sort key condition may name are found by bisection
    of the partition's sorted keys (``shoal.local.moto_partitions``), not by a walk of the
    partition, which under ``shoal dev`` grows all run.

    An index query is handed the items in its index partition that meet its key conditions,
    unsorted: moto's own ``all_items`` sorts the whole table first, and ``shoal dev``'s timers
    query sharded "due" indexes every few seconds (the reaper, the push sweep). With 1,000
    WebSocket sessions those queries were 30 % of the process's GIL time (py-spy ``--gil``),
    most of it in that sort.
    """
    from moto.dynamodb.models.table import Table

    if getattr(Table.query, "_one_partition", False):
        return
    keep_sorted_keys()
    original = Table.query
    signature = inspect.signature(original)

    class _OnePartition:
        """The table as the query sees it: ``all_items`` is the one partition's items that
        meet ``wanted`` (for a limited query: the first page of them, and the item after)."""

        def __init__(
            self,
            table: Any,
            hash_key: Any,
            wanted: Callable[[Any], bool],
            arguments: dict[str, Any],
        ) -> None:
            self._table = table
            self._hash_key = hash_key
            self._wanted = wanted
            self._arguments = arguments

        def __getattr__(self, name: str) -> Any:
            return getattr(self._table, name)

        def all_items(self) -> list[Any]:
            table = self._table
            partition = table.items.get(self._hash_key)
            if partition is None:
                return []
            if not table.range_key_attr:
                return [partition]
            run = self._by_bisection()
            if run is None:
                return self._walk(partition.values())
            try:
                return self._page(run)
            except StaleKeys:
                forget_sorted_keys(table)
                return self._walk(partition.values())

        def _walk(self, items: Iterable[Any]) -> list[Any]:
            """Those of ``items`` the sort key condition names (moto's own check)."""
            return [item for item in items if self._wanted(item)]

        def _page(self, run: Run) -> list[Any]:
            arguments = self._arguments
            limit = arguments.get("limit")
            if not limit or limit < 1 or arguments.get("exclusive_start_key"):
                return self._walk(run.items())
            # in key order: the page's items and the one after them, which moto looks at to
            # end the page (LastEvaluatedKey), and no more (a scan's first query asks for one
            # item past the state item: every item of the partition would be checked)
            page: list[Any] = []
            for item in run.items(reverse=arguments.get("scan_index_forward") is False):
                if self._wanted(item):
                    page.append(item)
                    if len(page) > limit:
                        break
            return page

        def _by_bisection(self) -> Run | None:
            """The items the sort key condition may name, from the partition's sorted keys
            (``shoal.local.moto_partitions``); None: walk the partition."""
            arguments = self._arguments
            conditions = arguments.get("range_key_conditions") or []
            if arguments.get("filter_kwargs") or len(conditions) > 1:
                return None
            if conditions and conditions[-1][0] != self._table.range_key_attr:
                return None
            comparison = arguments.get("range_comparison")
            if not comparison:
                return None  # the whole partition: nothing to bisect
            operands = list(arguments.get("range_objs") or [])
            return candidates(self._table, self._hash_key, comparison, operands)

    def sort_key_condition(arguments: dict[str, Any]) -> Callable[[Any], bool]:
        """moto's own check of the sort key condition, for a table query (``Table.query``)."""
        comparison = arguments.get("range_comparison")
        if not comparison or arguments.get("filter_kwargs"):
            return lambda _: True
        values = arguments.get("range_objs") or []
        conditions = arguments.get("range_key_conditions")
        name = conditions[-1][0] if conditions else None

        def wanted(item: Any) -> bool:
            value = item.attrs.get(name) if name else None
            if value:
                return bool(value.compare(comparison, values))
            return bool(item.range_key.compare(comparison, values))

        return wanted

    class _IndexPartition:
        """The table as an index query sees it: ``all_items`` is the items in the queried
        index partition that meet ``wanted``, unsorted (moto sorts an index query's results
        in the index's order itself)."""

        def __init__(self, table: Any, wanted: Callable[[Any], bool]) -> None:
            self._table = table
            self._wanted = wanted

        def __getattr__(self, name: str) -> Any:
            return getattr(self._table, name)

        def all_items(self) -> list[Any]:
            table = self._table
            if table.range_key_attr:
                return [i for p in table.items.values() for i in p.values() if self._wanted(i)]
            return [item for item in table.items.values() if self._wanted(item)]

    def index_condition(arguments: dict[str, Any]) -> Callable[[Any], bool] | None:
        """moto's own checks of an index query's key conditions, for ``Table.query`` with an
        index: every hash key attribute equal, and the sort key condition, on an item that has
        the attribute (an item without it is not in the index)."""
        hashes = arguments.get("hash_key_conditions") or []
        if not hashes:
            return None
        comparison = arguments.get("range_comparison")
        conditions = arguments.get("range_key_conditions")
        name = conditions[-1][0] if conditions else None
        values = arguments.get("range_objs") or []
        compared = bool(comparison and name and not arguments.get("filter_kwargs"))

        def wanted(item: Any) -> bool:
            attrs = item.attrs
            for attr, expected in hashes:
                value = attrs.get(attr)
                if not value or value != expected:
                    return False
            if not compared:
                return True
            value = attrs.get(name)
            return bool(value and value.compare(comparison, values))

        return wanted

    def query(self: Any, *args: Any, **kwargs: Any) -> Any:
        arguments = signature.bind(self, *args, **kwargs).arguments
        hash_key = arguments.get("hash_key")
        if arguments.get("index_name"):
            wanted = index_condition(arguments)
            if wanted is None:
                return original(self, *args, **kwargs)
            return original(_IndexPartition(self, wanted), *args, **kwargs)
        if hash_key is None:
            return original(self, *args, **kwargs)
        view = _OnePartition(self, hash_key, sort_key_condition(arguments), arguments)
        return original(view, *args, **kwargs)

    query._one_partition = True  # type: ignore[attr-defined]
    query.__wrapped__ = original  # type: ignore[attr-defined]  # the tests compare answers
    Table.query = query


_ATTRIBUTE_VALUE_KINDS = frozenset({"S", "N", "B", "SS", "NS", "BS", "M", "L", "NULL", "BOOL"})


class _NotAnAttributeValue(ValueError):
    pass


def _attribute_value_json(value: Any) -> dict[str, Any]:
    """An attribute value (``{"S": "x"}``, nested ``M`` and ``L`` included) as its JSON, the
    way moto's serializer writes it: binaries base64-encoded, everything else as it is."""
    if not isinstance(value, dict) or len(value) != 1:
        raise _NotAnAttributeValue(value)
    ((kind, inner),) = value.items()
    if kind == "M":
        return {"M": {str(k): _attribute_value_json(v) for k, v in inner.items()}}
    if kind == "L":
        return {"L": [_attribute_value_json(v) for v in inner]}
    if kind == "B":
        return {"B": _base64(inner)}
    if kind == "BS":
        return {"BS": [_base64(v) for v in inner]}
    if kind in ("S", "N"):
        return {kind: str(inner)}
    if kind in ("SS", "NS"):
        return {kind: [str(v) for v in inner]}
    if kind in _ATTRIBUTE_VALUE_KINDS:
        return {kind: inner}
    raise _NotAnAttributeValue(value)


def _base64(value: str | bytes) -> str:
    raw = value.encode() if isinstance(value, str) else value
    return base64.b64encode(raw).strip().decode()


def serialize_attribute_values_directly() -> None:
    """Write DynamoDB attribute values into moto's JSON responses without its shape walk.

    moto serializes a response by walking the operation's output shape member by member,
    looking each member up under several spellings; an ``AttributeValue`` is a structure of
    ten members, so every attribute of every item costs dozens of lookups. Measured under
    ``shoal dev`` (10 sessions long-polling): the get's inbox query spent 15 of its 19 ms
    there, for 5.5 KB of items, under the emulator's one lock, and every AWS call of the
    process waited ~100 ms for that lock. An attribute value's JSON is the value itself with
    binaries base64-encoded, so this writes it directly (the same JSON, checked against moto's
    serializer in the tests); anything that is not a well-formed attribute value goes the
    generic way.
    """
    from moto.core.serialize import BaseJSONSerializer

    if getattr(BaseJSONSerializer._serialize, "_attribute_values", False):
        return
    original = BaseJSONSerializer._serialize

    @functools.wraps(original)
    def _serialize(self: Any, serialized: Any, value: Any, shape: Any, key: str) -> None:
        if (
            shape.name == "AttributeValue"
            and self.operation_model.service_model.service_name == "dynamodb"
        ):
            try:
                written = _attribute_value_json(value)
            except (_NotAnAttributeValue, AttributeError, TypeError):
                pass
            else:
                self._default_serialize(serialized, written, shape, key)
                return
        original(self, serialized, value, shape, key)

    _serialize._attribute_values = True  # type: ignore[attr-defined]
    BaseJSONSerializer._serialize = _serialize


def roll_back_transactions_by_item() -> None:
    """Make a failed TransactWriteItems undo only the items it names.

    moto deep-copies every table a transaction names before applying it, to restore the copy if
    the transaction fails, so each transaction costs time in proportion to the whole table:
    under ``shoal dev`` with a few hundred sessions a connect took seconds, and most of the
    emulator's CPU went into ``copy.deepcopy`` (measured with py-spy, 128 clients). Copying the
    partitions (hash keys) a transaction touches instead still grew with a partition: with
    1,000 WebSocket sessions subscribing, 42 % of the process's GIL time was that copy (py-spy
    ``--gil``) and each hundred sessions took longer than the last. A transaction writes only
    the items its parts name (at most 100, each by its full key), so saving those items, or
    their absence, and putting them back keeps the same all-or-nothing outcome at a cost that
    does not grow with the table. Requests run one at a time under ``BACKEND_LOCK``, so
    nothing else can see the partial writes before they are undone.
    """
    import copy

    from moto.dynamodb import models
    from moto.dynamodb.models.dynamo_type import DynamoType

    backend_class = models.DynamoDBBackend
    if getattr(backend_class.transact_write_items, "_by_item", False):
        return
    original = backend_class.transact_write_items

    class _NoTableCopies:
        """``copy`` as moto's transaction sees it: tables are not copied, the rest is."""

        @staticmethod
        def deepcopy(value: Any, memo: Any = None) -> Any:
            return value if isinstance(value, models.Table) else copy.deepcopy(value, memo)

    #: (table name, hash key, range key or None) -> (the partition existed, the item or None)
    Saved = dict[tuple[str, Any, Any], tuple[bool, Any]]

    def save(saved: Saved, table: Any, name: str, key: dict[str, Any]) -> None:
        if table.hash_key_attr not in key:
            return  # moto refuses the part before it writes anything
        hash_value = DynamoType(key[table.hash_key_attr])
        range_value = None
        if table.range_key_attr is not None:
            if table.range_key_attr not in key:
                return
            range_value = DynamoType(key[table.range_key_attr])
        if (name, hash_value, range_value) in saved:
            return
        # .get, not [...]: the table's items are a defaultdict, and a lookup must not add
        partition = table.items.get(hash_value)
        if range_value is None:
            item = partition
        else:
            item = partition.get(range_value) if partition is not None else None
        saved[(name, hash_value, range_value)] = (partition is not None, copy.deepcopy(item))

    def restore(saved: Saved, tables: dict[str, Any]) -> None:
        for (name, hash_value, range_value), (existed, item) in saved.items():
            table = tables[name]
            # put back behind ``Table.put_item``'s and ``delete_item``'s backs
            forget_sorted_keys(table)
            if range_value is None:
                if item is None:
                    table.items.pop(hash_value, None)
                else:
                    table.items[hash_value] = item
                continue
            if item is not None:
                table.items[hash_value][range_value] = item
                continue
            partition = table.items.get(hash_value)
            if partition is not None:
                partition.pop(range_value, None)
                if not partition and not existed:
                    table.items.pop(hash_value, None)

    def transact_write_items(self: Any, transact_items: list[dict[str, Any]]) -> None:
        saved: Saved = {}
        for entry in transact_items:
            op: dict[str, Any] = next(iter(entry.values()), {})
            name = str(op.get("TableName"))
            table = self.tables.get(name)
            if table is not None:
                save(saved, table, name, op.get("Key") or op.get("Item") or {})
        models.copy = _NoTableCopies
        try:
            original(self, transact_items)
        except Exception:
            restore(saved, self.tables)
            raise
        finally:
            models.copy = copy

    transact_write_items._by_item = True  # type: ignore[attr-defined]
    backend_class.transact_write_items = transact_write_items


def cache_action_names() -> None:
    """Compute each moto response class's method names once, not on every request.

    moto finds the method that answers an action by listing the response class's functions
    with ``inspect.getmembers`` on every call (``BaseResponse.call_action``): hundreds of
    attributes walked per request, 2.3 % of ``shoal dev``'s GIL time under
    ``python -m bench wspush`` at 10 sessions (py-spy ``--gil``, 2026-11-30), every AWS call
    paying it under the emulator's one lock. A class's functions do not change while the
    process runs, so the list is kept per class (moto only asks whether the action is in it).
    """
    from moto.core import responses

    if getattr(responses.method_names_from_class, "_cached", False):
        return
    cached = functools.lru_cache(maxsize=None)(responses.method_names_from_class)
    cached._cached = True  # type: ignore[attr-defined]
    responses.method_names_from_class = cached


def parse_update_expressions_once() -> None:
    """Parse each distinct ``UpdateExpression`` once, not twice on every UpdateItem.

    moto parses an update's expression in the response layer (to check its placeholders) and
    again in the backend, each time tokenizing and parsing it from text: 20 % of an UpdateItem,
    which was the emulator's dearest call (10 ms against a Query's 0.7, cProfile of the edge's
    integration tests, 2026-11-30). The services send a handful of expression texts, each with
    its own values. The parsed tree is kept per text: the response layer only reads it, and
    the backend's validator works on a deep copy of it (``Validator.node_to_validate``), so
    the kept tree is never changed. An expression that does not parse raises as before (an
    error is not kept).
    """
    from moto.dynamodb.parsing import expressions

    parser = expressions.UpdateExpressionParser
    if getattr(parser.make, "_once", False):
        return
    make = parser.make

    @functools.lru_cache(maxsize=1024)
    def parsed(expression: str) -> Any:
        return make(expression)

    def once(cls: Any, expression: str) -> Any:
        return parsed(expression)

    once._once = True  # type: ignore[attr-defined]
    parser.make = classmethod(once)


def lex_conditions_once() -> None:
    """Tokenize each distinct ``ConditionExpression`` text once.

    moto lexes a condition from its text by trying six regular expressions at every token,
    twice an UpdateItem (the response layer's check, then the backend's): profiled on the push
    lease's update, a ninth of the call. The tokens depend on the text alone and are tuples
    that no later step changes (each step makes new nodes), so every parse gets a fresh deque
    of the same tokens; names and values are resolved afterwards, per call, as before. A text
    that does not lex raises as before (an error is not kept).
    """
    from collections import deque

    from moto.dynamodb.comparisons import ConditionExpressionParser

    if getattr(ConditionExpressionParser._lex_condition_expression, "_once", False):
        return
    lex = ConditionExpressionParser._lex_condition_expression

    @functools.lru_cache(maxsize=1024)
    def tokens(expression: str) -> tuple[Any, ...]:
        parser = ConditionExpressionParser(expression, None, None)
        return tuple(lex(parser))

    def once(self: Any) -> Any:
        return deque(tokens(self.condition_expression))

    once._once = True  # type: ignore[attr-defined]
    ConditionExpressionParser._lex_condition_expression = once


def traverse_with_fixed_maps() -> None:
    """Build each validator's map of node types to processors once, not at every node.

    moto's update validators walk the expression's tree about ten times an UpdateItem
    (``DepthFirstTraverser``), and at every node each walk builds its processor's map again
    (``_processing_map``, twice: to test the node's type and to pick the function), and the
    action-count check looks for every clause again at every nested expression node: together
    half of an UpdateItem's time. A processor's map holds its own bound methods by node class,
    the same for its whole life, so it is kept on the processor; the action count is checked
    once, at the root, whose clauses include every nested node's: an expression that repeats a
    clause is refused as before (one that repeats two kinds may be told about the other one).
    """
    from moto.dynamodb.parsing.ast_nodes import DepthFirstTraverser, Node, UpdateExpression
    from moto.dynamodb.parsing.validators import ActionCountValidator

    if getattr(DepthFirstTraverser.process, "_fixed", False):
        return

    def processing_map(self: Any) -> dict[type, Callable[[Any], Any]]:
        kept: dict[type, Callable[[Any], Any]] | None = self.__dict__.get("_shoal_map")
        if kept is None:
            kept = self.__dict__["_shoal_map"] = type(self)._processing_map(self)
        return kept

    def nodes_to_be_processed(self: Any) -> tuple[type, ...]:
        kept: tuple[type, ...] | None = self.__dict__.get("_shoal_types")
        if kept is None:
            kept = self.__dict__["_shoal_types"] = tuple(processing_map(self))
        return kept

    def process(self: Any, node: Any) -> Any:
        for class_key, processor in processing_map(self).items():
            if isinstance(node, class_key):
                return processor(node)
        return None

    #: per node class: whether it is a ``Node`` (moto's classes are ABCs: ``isinstance`` on
    #: them is a Python-level check, a million of them in 400 UpdateItems)
    node_classes: dict[type, bool] = {}

    def processor_for(self: Any, cls: type) -> Callable[[Any], Any] | None:
        # the first processor whose node class ``cls`` is, as ``process`` picks it
        kept: dict[type, Callable[[Any], Any] | None] | None = self.__dict__.get("_shoal_by_class")
        if kept is None:
            kept = self.__dict__["_shoal_by_class"] = {}
        if cls not in kept:
            kept[cls] = next(
                (f for k, f in processing_map(self).items() if issubclass(cls, k)), None
            )
        return kept[cls]

    def traverse_node_recursively(self: Any, node: Any, child_id: int = -1) -> Any:
        # moto's walk (children first, then the node; a processed node takes its place in
        # its parent), with each class's answers looked up instead of tested at every node
        cls = type(node)
        is_node = node_classes.get(cls)
        if is_node is None:
            is_node = node_classes[cls] = issubclass(cls, Node)
        if not is_node:
            return node
        parent_node = node.parent
        if node.children is not None:
            for i, child_node in enumerate(node.children):
                self.pre_processing_of_child(node, i)
                self.traverse_node_recursively(child_node, i)
        processor = processor_for(self, cls)
        if processor is not None:
            node = processor(node)
            node.parent = parent_node
            if parent_node:
                parent_node.children[child_id] = node
        return node

    def count_actions_at_the_root(self: Any, node: Any) -> Any:
        if isinstance(node, UpdateExpression):
            self.verify_action_counts(node)
        return node

    process._fixed = True  # type: ignore[attr-defined]
    DepthFirstTraverser.nodes_to_be_processed = nodes_to_be_processed
    DepthFirstTraverser.process = process
    DepthFirstTraverser.traverse_node_recursively = traverse_node_recursively
    ActionCountValidator.traverse = count_actions_at_the_root


def project_from_one_conversion() -> None:
    """Convert an item to plain values once per projection, not once per projected path.

    moto's ``Item.project`` converts the whole item to plain values (``to_regular_json``) for
    each path of a ``ProjectionExpression``, then picks the path out of that conversion. A
    group's load (``shoal.groups.store``) projects 24 attributes of every item of the group:
    24 conversions of each item, 11 % of the emulator's GIL time in a soak (py-spy ``--gil``,
    2026-12-05), which every shared-group member's get and idle poll pays. The paths are read
    from one conversion; what each picks, and how the picks are merged and turned back into
    attribute values, is moto's own code as before (the pick reads the plain values and never
    changes them; a merge into an earlier pick only sets what that pick already holds).
    """
    from moto.dynamodb.models import dynamo_type
    from moto.dynamodb.models.dynamo_type import Item

    if getattr(Item.project, "_one_conversion", False):
        return
    original = Item.project

    def project(self: Any, projection_expressions: list[list[str]]) -> Any:
        plain = self.to_regular_json()
        result: dict[str, Any] = {}
        for expression in projection_expressions:
            dynamo_type.merge_dicts(result, dynamo_type.find_nested_key(expression, plain))
        return Item(
            hash_key=self.hash_key,
            range_key=self.range_key,
            attrs=dynamo_type.serializer.serialize(result)["M"],
        )

    project._one_conversion = True  # type: ignore[attr-defined]
    project._moto = original  # type: ignore[attr-defined]  # the tests compare answers
    Item.project = project


def size_items_once() -> None:
    """Check a new item against DynamoDB's 400 KB limit once, not once per attribute.

    moto builds an item's attributes one by one into a ``LimitedSizeDict``, whose every
    assignment sums the sizes of all the attributes assigned before it: a put's cost grows
    with the square of its attributes. A session's delivery state has a dozen, some of them
    nested, and its conditional put spent a quarter of moto's time in those sums (1,000 puts
    of a state-like item, cProfile, 2026-12-07): the write every push makes. The attributes
    are assigned without the check, then their total is checked once; sizes are never
    negative, so the total passes the limit exactly when one of moto's partial sums would
    have, and the same ``ItemSizeTooLarge`` is raised (the tests compare). Later assignments
    (an update's) go through moto's own check as before.
    """
    from moto.dynamodb.exceptions import ItemSizeTooLarge
    from moto.dynamodb.models.dynamo_type import DynamoType, Item, LimitedSizeDict
    from moto.dynamodb.models.utilities import bytesize

    if getattr(Item.__init__, "_sized_once", False):
        return
    original = Item.__init__

    def __init__(self: Any, hash_key: Any, range_key: Any, attrs: dict[str, Any]) -> None:
        self.hash_key = hash_key
        self.range_key = range_key
        values = {key: DynamoType(value) for key, value in attrs.items()}
        if sum(bytesize(key) + value.size() for key, value in values.items()) > ITEM_LIMIT:
            raise ItemSizeTooLarge
        self.attrs = LimitedSizeDict()
        dict.update(self.attrs, values)

    __init__._sized_once = True  # type: ignore[attr-defined]
    __init__._moto = original  # type: ignore[attr-defined]  # the tests compare answers
    Item.__init__ = __init__


#: moto's own item limit (``LimitedSizeDict``): between DynamoDB's documented 400 KB and the
#: 409-410 KB it measured
ITEM_LIMIT = 405_000


def parse_conditions_once() -> None:
    """Keep what a ``ConditionExpression`` (or a ``FilterExpression``) parses to, for the same
    text, names and values, instead of parsing it again on every call.

    A conditional write's condition is parsed twice a call, by moto's response layer (for the
    names and values it uses, which must be all those given) and by its backend (to evaluate
    it); the lexing is kept already (``lex_conditions_once``), but moto then builds the paths,
    functions, comparisons and their operation objects anew each time. A session's
    delivery-state put (``#v = :old``, the write every push and every ack makes) spent an
    eighth of its CPU there (cProfile, 2026-12-07). The parse is a tree of moto's operation
    objects whose evaluation reads the item and changes nothing (each evaluation builds new
    values), and the names and values it found: one parse serves every call with the same
    text, names and values. The key is the text and the ``repr`` of the names and values as the
    request gave them (equal keys, equal parses; an order that differs only misses). A
    condition that does not parse raises as before and is not kept. At most
    ``KEPT_CONDITIONS`` are kept; past that the kept ones are forgotten (a version condition
    has a value per version).
    """
    from moto.dynamodb.comparisons import ConditionExpressionParser

    if getattr(ConditionExpressionParser.parse, "_kept", False):
        return
    original = ConditionExpressionParser.parse
    kept: dict[tuple[Any, str, str], tuple[Any, tuple[Any, ...], tuple[Any, ...]]] = {}

    def parse(self: Any) -> Any:
        key = (
            self.condition_expression,
            repr(self.expression_attribute_names),
            repr(self.expression_attribute_values),
        )
        found = kept.get(key)
        if found is None:
            names_before = len(self.expr_attr_names_found)
            values_before = len(self.expr_attr_values_found)
            condition = original(self)
            found = (
                condition,
                tuple(self.expr_attr_names_found[names_before:]),
                tuple(self.expr_attr_values_found[values_before:]),
            )
            if len(kept) >= KEPT_CONDITIONS:
                kept.clear()
            kept[key] = found
            return condition
        condition, names, values = found
        self.expr_attr_names_found.extend(names)
        self.expr_attr_values_found.extend(values)
        return condition

    parse._kept = True  # type: ignore[attr-defined]
    parse._moto = original  # type: ignore[attr-defined]  # the tests compare
    ConditionExpressionParser.parse = parse


#: parses kept by ``parse_conditions_once`` at most
KEPT_CONDITIONS = 4096
