"""DynamoDB: the one adapter every store of Shoal goes through.

It turns Python values into DynamoDB's wire form and back (whole numbers come back as ``int``,
binary as ``bytes``), builds update and condition expressions with every attribute name
aliased (many of Shoal's names are reserved words), and maps the SDK's errors: throttling
becomes ``ServerBusy`` (a 503 the client retries), a failed condition becomes ``False``, a
cancelled transaction the reason of each of its parts. Stores hold the domain's knowledge of
keys and conditions; this module holds none.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from decimal import Decimal
from typing import Any

from boto3.dynamodb.types import Binary, TypeDeserializer, TypeSerializer
from botocore.exceptions import ClientError

from shoal.aws import clients
from shoal.aws.clients import error_code
from shoal.core.clock import Clock, SystemClock
from shoal.core.config import Config
from shoal.core.errors import ServerBusy
from shoal.core.retry import backoff_s

#: error codes that mean "too much at once, come back": answered 503 ``server_busy``
THROTTLED = frozenset(
    {
        "ProvisionedThroughputExceededException",
        "ThrottlingException",
        "RequestLimitExceeded",
        "InternalServerError",
        # DynamoDB's 503 ("currently unavailable"; temporary), also what `shoal dev`'s
        # emulator answers a call that waited past its bound for its turn
        "ServiceUnavailable",
    }
)
CONDITION_FAILED = "ConditionalCheckFailedException"
#: a batch call's unprocessed part is sent again this many times before ``ServerBusy``
BATCH_ATTEMPTS = 5
#: DynamoDB's limits per call
MAX_BATCH_GET = 100
MAX_BATCH_WRITE = 25
MAX_TRANSACTION = 100

_serializer = TypeSerializer()
_deserializer = TypeDeserializer()

#: threads that send a container's concurrent batch writes (``Dynamo.batch_write``)
MAX_WRITE_THREADS = 16
_pool: list[ThreadPoolExecutor] = []
_pool_lock = threading.Lock()


def _writer_pool() -> ThreadPoolExecutor:
    """The process's threads for concurrent batch writes, made on first use (a container that
    never writes concurrently starts none)."""
    if not _pool:
        with _pool_lock:
            if not _pool:
                _pool.append(
                    ThreadPoolExecutor(MAX_WRITE_THREADS, thread_name_prefix="shoal-writes")
                )
    return _pool[0]


def plain(value: Any) -> Any:
    """A deserialized value as Shoal uses it: Decimals as ints (Shoal stores whole numbers
    only), Binary as bytes, recursively."""
    if isinstance(value, Decimal):
        return int(value)
    if isinstance(value, Binary):
        return value.__bytes__()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, set):
        return {plain(v) for v in value}
    return value


def attribute(value: Any) -> dict[str, Any]:
    """One value in DynamoDB's wire form (``{"S": ...}``, ``{"N": ...}``, ...)."""
    return dict(_serializer.serialize(value))


def to_item(record: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _serializer.serialize(v) for k, v in record.items()}


def from_item(raw: Mapping[str, Any]) -> dict[str, Any]:
    return {k: plain(_deserializer.deserialize(v)) for k, v in raw.items()}


class Expression:
    """One request's expressions, with every attribute name aliased."""

    def __init__(self) -> None:
        self.sets: list[str] = []
        self.removes: list[str] = []
        self.adds: list[str] = []
        self.names: dict[str, str] = {}
        self.values: dict[str, Any] = {}

    def n(self, path: str) -> str:
        """``a.b`` becomes ``#a.#b``."""
        aliases = []
        for part in path.split("."):
            self.names[f"#{part}"] = part
            aliases.append(f"#{part}")
        return ".".join(aliases)

    def v(self, value: Any) -> str:
        alias = f":v{len(self.values)}"
        self.values[alias] = attribute(value)
        return alias

    def set(self, path: str, value: Any) -> Expression:
        return self.set_raw(path, self.v(value))

    def set_raw(self, path: str, expression: str) -> Expression:
        self.sets.append(f"{self.n(path)} = {expression}")
        return self

    def remove(self, *paths: str) -> Expression:
        self.removes.extend(self.n(p) for p in paths)
        return self

    def add(self, path: str, value: Any) -> Expression:
        self.adds.append(f"{self.n(path)} {self.v(value)}")
        return self

    def params(self, condition: str | None = None) -> dict[str, Any]:
        """The request's ``UpdateExpression``, ``ConditionExpression`` and their aliases."""
        out: dict[str, Any] = {}
        parts = []
        if self.sets:
            parts.append("SET " + ", ".join(self.sets))
        if self.removes:
            parts.append("REMOVE " + ", ".join(self.removes))
        if self.adds:
            parts.append("ADD " + ", ".join(self.adds))
        if parts:
            out["UpdateExpression"] = " ".join(parts)
        if condition:
            out["ConditionExpression"] = condition
        if self.names:
            out["ExpressionAttributeNames"] = self.names
        if self.values:
            out["ExpressionAttributeValues"] = self.values
        return out


class Dynamo:
    """DynamoDB calls with the SDK's errors mapped; thread-safe, one per container."""

    def __init__(self, client: Any, clock: Clock | None = None) -> None:
        self.client = client
        self.clock = clock or SystemClock()

    @classmethod
    def from_config(
        cls, config: Config, clock: Clock | None = None, *, profile: str = "default"
    ) -> Dynamo:
        """``profile``: a client profile of ``shoal.aws.clients.PROFILES`` (``hot_writer`` for
        the router's inbox writes)."""
        return cls(clients.client("dynamodb", config.region, profile), clock)

    def call(self, operation: str, **request: Any) -> dict[str, Any]:
        """One call; throttling is ``ServerBusy``, any other error the SDK's own."""
        try:
            response: dict[str, Any] = getattr(self.client, operation)(**request)
        except ClientError as exc:
            if error_code(exc) in THROTTLED:
                raise ServerBusy("the store is busy; retry") from exc
            raise
        return response

    def conditional(self, operation: str, **request: Any) -> bool:
        """One conditional write: False when its condition did not hold."""
        try:
            self.call(operation, **request)
        except ClientError as exc:
            if error_code(exc) == CONDITION_FAILED:
                return False
            raise
        return True

    def conditional_old(self, operation: str, **request: Any) -> dict[str, Any] | None:
        """One conditional write that says what it failed on: None when written, else the
        item its condition found (``{}``: none). The item comes with the refusal, for the
        price of the write."""
        try:
            self.call(operation, ReturnValuesOnConditionCheckFailure="ALL_OLD", **request)
        except ClientError as exc:
            if error_code(exc) == CONDITION_FAILED:
                found = exc.response.get("Item")
                return from_item(found) if isinstance(found, Mapping) else {}
            raise
        return None

    def transact(self, parts: list[dict[str, Any]]) -> list[str] | None:
        """All or nothing: None when committed, else the cancellation reason of each part
        (``ConditionalCheckFailed``, ``TransactionConflict``, ``None`` for a part that was
        fine)."""
        try:
            # the token turns the SDK's own retry of a committed transaction into a success
            self.call(
                "transact_write_items", TransactItems=parts, ClientRequestToken=uuid.uuid4().hex
            )
        except ClientError as exc:
            if error_code(exc) == "TransactionCanceledException":
                reasons = exc.response.get("CancellationReasons") or []
                return [str(r.get("Code") or "None") for r in reasons] or ["Unknown"]
            if error_code(exc) == "TransactionConflictException":
                return ["TransactionConflict"]
            raise
        return None

    def get(
        self, table: str, key: Mapping[str, Any], *, consistent: bool = True, **request: Any
    ) -> dict[str, Any] | None:
        raw = self.call(
            "get_item", TableName=table, Key=to_item(key), ConsistentRead=consistent, **request
        )
        return from_item(raw["Item"]) if "Item" in raw else None

    def query(self, table: str, **request: Any) -> list[dict[str, Any]]:
        """Every page (bounded by ``Limit`` when given: then one page)."""
        out: list[dict[str, Any]] = []
        while True:
            page = self.call("query", TableName=table, **request)
            out += [from_item(i) for i in page.get("Items", [])]
            if "Limit" in request or "LastEvaluatedKey" not in page:
                return out
            request["ExclusiveStartKey"] = page["LastEvaluatedKey"]

    def scan(self, table: str, **request: Any) -> list[dict[str, Any]]:
        """Every page of a scan (for the few small tables that are read whole)."""
        out: list[dict[str, Any]] = []
        while True:
            page = self.call("scan", TableName=table, **request)
            out += [from_item(i) for i in page.get("Items", [])]
            if "LastEvaluatedKey" not in page:
                return out
            request["ExclusiveStartKey"] = page["LastEvaluatedKey"]

    def count(self, table: str, **request: Any) -> int:
        """The items a scan's filter keeps, counted over every page (``Select=COUNT``: no item
        comes back, but each one read is charged, filter or not)."""
        total = 0
        while True:
            page = self.call("scan", TableName=table, Select="COUNT", **request)
            total += int(page.get("Count", 0))
            if "LastEvaluatedKey" not in page:
                return total
            request["ExclusiveStartKey"] = page["LastEvaluatedKey"]

    def batch_get(
        self, table: str, keys: Sequence[Mapping[str, Any]], *, consistent: bool = True
    ) -> list[dict[str, Any]]:
        """Every item of ``keys`` that exists, 100 keys a call, unprocessed keys asked again."""
        rows = self.batch_get_tables([(table, k) for k in keys], consistent=consistent)
        return [row for _, row in rows]

    def batch_get_tables(
        self, keys: Sequence[tuple[str, Mapping[str, Any]]], *, consistent: bool = True
    ) -> list[tuple[str, dict[str, Any]]]:
        """Every item of ``keys`` (table, key) that exists, with its table: items of several
        tables in one call (100 keys a call, unprocessed keys asked again)."""
        out: list[tuple[str, dict[str, Any]]] = []
        for start in range(0, len(keys), MAX_BATCH_GET):
            request: dict[str, Any] = {}
            for table, key in keys[start : start + MAX_BATCH_GET]:
                part = request.setdefault(table, {"Keys": [], "ConsistentRead": consistent})
                part["Keys"].append(to_item(key))
            for attempt in range(BATCH_ATTEMPTS):
                response = self.call("batch_get_item", RequestItems=request)
                for table, items in response.get("Responses", {}).items():
                    out += [(table, from_item(i)) for i in items]
                request = response.get("UnprocessedKeys") or {}
                if not request:
                    break
                self.clock.sleep(backoff_s(attempt, 0.02, 1.0))
            else:
                raise ServerBusy("the store did not answer every read; retry")
        return out

    def batch_put(self, table: str, records: Sequence[Mapping[str, Any]]) -> None:
        """Put every record (25 a call); unprocessed ones again, then ``ServerBusy``."""
        self.batch_write(table, [{"PutRequest": {"Item": to_item(r)}} for r in records])

    def batch_delete(self, table: str, keys: Sequence[Mapping[str, Any]]) -> None:
        self.batch_write(table, [{"DeleteRequest": {"Key": to_item(k)}} for k in keys])

    def batch_write(
        self, table: str, requests: Sequence[Mapping[str, Any]], *, concurrency: int = 1
    ) -> None:
        """Every request, 25 a call. ``concurrency`` > 1 sends up to that many calls at once,
        for callers whose writes may land in any order; it returns (or raises the first
        failure) only once every call has ended, so no write is still in flight after it."""
        chunks = [
            list(requests[start : start + MAX_BATCH_WRITE])
            for start in range(0, len(requests), MAX_BATCH_WRITE)
        ]
        if concurrency <= 1 or len(chunks) <= 1:
            for chunk in chunks:
                self._write_chunk(table, chunk)
            return
        pool = _writer_pool()
        failure: BaseException | None = None
        for start in range(0, len(chunks), concurrency):
            calls: list[Future[None]] = [
                pool.submit(self._write_chunk, table, chunk)
                for chunk in chunks[start : start + concurrency]
            ]
            for call in calls:
                error = call.exception()
                failure = failure or error
            if failure is not None:
                raise failure

    def _write_chunk(self, table: str, chunk: list[Mapping[str, Any]]) -> None:
        pending: dict[str, Any] = {table: chunk}
        for attempt in range(BATCH_ATTEMPTS):
            response = self.call("batch_write_item", RequestItems=pending)
            pending = response.get("UnprocessedItems") or {}
            if not pending:
                return
            # throttled: back off (DynamoDB's own advice for unprocessed items)
            self.clock.sleep(backoff_s(attempt, 0.02, 1.0))
        raise ServerBusy("the store did not take every write; retry")
