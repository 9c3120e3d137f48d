"""Publisher sequences: the publishers table, one item per (principal, publisher id).

The item holds ``last_seq`` (the last seq reserved), ``pending`` (the reservations not yet
confirmed, by the first seq of their run), ``routes`` (the first seq each publisher sent to each
"<composite>/<storage topic index>") and ``overrides`` (where a recovery put or found a seq). Every
write is one conditional write: a reservation on ``last_seq``, a take-over or a confirmation on
the reservation's attempt number (``shoal.publish.service`` tells the whole story).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from shoal.aws import tables
from shoal.aws.dynamo import Dynamo, Expression, to_item
from shoal.composite.model import DEFAULT_TOPIC, is_valid_topic_name
from shoal.core.config import Config
from shoal.core.errors import ServerBusy
from shoal.topics.filters import first_level

#: a reservation is held this long: its holder may put only while it holds it, and a retry
#: takes it over after it ("lease" is the shared groups' word, for a stream lease).
#: Sized from the put's bound, not the function's timeout: a publisher whose request died
#: with its process (a crash, a kill, a Lambda timeout) is answered this long after, at most.
RESERVATION_HOLD_MS = 10_000


def publisher_key(sub: str, publisher_id: str) -> str:
    # the length prefix keeps ("a:b", "c") and ("a", "b:c") apart
    return f"{len(sub)}:{sub}:{publisher_id}"


def sequenced_message_id(key: str, seq: int) -> str:
    """The one message id every attempt of (publisher, seq) carries."""
    return hashlib.blake2b(
        f"{key}#{seq}".encode("utf-8", "surrogatepass"), digest_size=16
    ).hexdigest()


def route_key(composite: str, index: int) -> str:
    return f"{composite}/{index}"


@dataclass(frozen=True)
class Reservation:
    """Seqs lo..hi reserved together, not yet confirmed."""

    lo: int
    hi: int
    reserved_at: int
    held_until: int
    attempt: int
    #: route keys ("<composite>/<storage topic index>") the attempts so far routed to
    targets: tuple[str, ...]

    def item(self) -> dict[str, Any]:
        return {
            "h": self.hi,
            "r": self.reserved_at,
            "l": self.held_until,
            "n": self.attempt,
            "t": list(self.targets),
        }

    @classmethod
    def from_item(cls, lo: int, item: dict[str, Any]) -> Reservation:
        return cls(
            lo=lo,
            hi=int(item["h"]),
            reserved_at=int(item["r"]),
            held_until=int(item["l"]),
            attempt=int(item["n"]),
            targets=tuple(str(s) for s in item.get("t") or ()),
        )


@dataclass(frozen=True)
class PublisherState:
    last_seq: int
    pending: dict[int, Reservation]
    routes: dict[str, int]
    overrides: dict[int, str]

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> PublisherState:
        pending = record.get("pending") or {}
        routes = record.get("routes") or {}
        overrides = record.get("overrides") or {}
        return cls(
            last_seq=int(record["last_seq"]),
            pending={int(lo): Reservation.from_item(int(lo), v) for lo, v in pending.items()},
            routes={str(k): int(v) for k, v in routes.items()},
            overrides={int(k): str(v) for k, v in overrides.items()},
        )

    def reservation_for(self, seq: int) -> Reservation | None:
        return next((r for r in self.pending.values() if r.lo <= seq <= r.hi), None)

    def route_for(self, seq: int, topic: str) -> tuple[str, int] | None:
        """(composite, storage topic index) a settled seq of this MQTT topic went to."""
        override = self.overrides.get(seq)
        if override is not None:
            composite, _, index = override.rpartition("/")
            return composite, int(index)
        candidate = first_level(topic)
        for composite in (candidate, DEFAULT_TOPIC):
            indexes = [
                int(k.rpartition("/")[2])
                for k, first in self.routes.items()
                if k.rpartition("/")[0] == composite and first <= seq
            ]
            if indexes and is_valid_topic_name(composite):
                return composite, max(indexes)
        return None


class Sequences:
    """The publishers table: reservations and confirmations, each one conditional write."""

    def __init__(self, dynamo: Dynamo, table: str) -> None:
        self.dynamo = dynamo
        self.table = table

    @classmethod
    def from_config(cls, config: Config) -> Sequences:
        return cls(Dynamo.from_config(config), config.table(tables.PUBLISHERS))

    def read(self, key: str) -> PublisherState | None:
        record = self.dynamo.get(self.table, {"key": key})
        return PublisherState.from_record(record) if record is not None else None

    def reserve(
        self, key: str, expected_last: int, run: Reservation, routes: dict[str, int]
    ) -> bool:
        """Reserve ``run`` if the last seq is still ``expected_last``; False if it moved."""
        expr = Expression()
        if expected_last == 0:
            item = {
                "key": key,
                "last_seq": run.hi,
                "pending": {str(run.lo): run.item()},
                "routes": routes,
                "overrides": {},
            }
            condition = f"attribute_not_exists({expr.n('key')})"
            return self._write("put_item", Item=to_item(item), **expr.params(condition))
        expr.set("last_seq", run.hi)
        expr.sets.append(f"{_entry(expr, 'pending', str(run.lo))} = {expr.v(run.item())}")
        for route, first in routes.items():
            path = _entry(expr, "routes", route)
            expr.sets.append(f"{path} = if_not_exists({path}, {expr.v(first)})")
        condition = f"{expr.n('last_seq')} = {expr.v(expected_last)}"
        return self._write("update_item", Key=to_item({"key": key}), **expr.params(condition))

    def take_over(self, key: str, old: Reservation, new: Reservation) -> bool:
        expr = Expression()
        expr.sets.append(f"{_entry(expr, 'pending', str(old.lo))} = {expr.v(new.item())}")
        return self._update(key, old, expr)

    def settle(
        self,
        key: str,
        run: Reservation,
        remaining: list[Reservation],
        overrides: dict[int, str],
    ) -> bool:
        """Confirm the seqs of ``run`` outside ``remaining``, which stay reserved (released)."""
        expr = Expression()
        for r in remaining:
            expr.sets.append(f"{_entry(expr, 'pending', str(r.lo))} = {expr.v(r.item())}")
        if all(r.lo != run.lo for r in remaining):
            expr.removes.append(_entry(expr, "pending", str(run.lo)))
        for seq, route in overrides.items():
            expr.sets.append(f"{_entry(expr, 'overrides', str(seq))} = {expr.v(route)}")
        return self._update(key, run, expr)

    def _update(self, key: str, run: Reservation, expr: Expression) -> bool:
        """Apply ``expr`` while ``run`` is still held by its attempt."""
        attempt = f"{_entry(expr, 'pending', str(run.lo))}.{expr.n('n')}"
        condition = f"{attempt} = {expr.v(run.attempt)}"
        return self._write("update_item", Key=to_item({"key": key}), **expr.params(condition))

    def _write(self, operation: str, **request: Any) -> bool:
        try:
            return self.dynamo.conditional(operation, TableName=self.table, **request)
        except (ClientError, BotoCoreError, ServerBusy) as exc:
            raise ServerBusy("the publisher's sequence could not be recorded; retry") from exc


def _entry(expr: Expression, attribute: str, key: str) -> str:
    """The path of one entry of a map attribute; its key may hold any character (a topic name).

    A key is aliased once per request however often the request names it.
    """
    alias = next((a for a, name in expr.names.items() if a.startswith("#m") and name == key), None)
    if alias is None:
        alias = f"#m{len(expr.names)}"
        expr.names[alias] = key
    return f"{expr.n(attribute)}.{alias}"


def consecutive_runs(seqs: list[int]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive seqs, in order."""
    out: list[tuple[int, int]] = []
    for s in sorted(seqs):
        if out and out[-1][1] == s - 1:
            out[-1] = (out[-1][0], s)
        else:
            out.append((s, s))
    return out
