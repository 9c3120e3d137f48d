"""Inline archive rows for pipeline tests: messages as the router archives them, delivery events
as ``shoal.delivery.events`` records them, and ``Scenario`` to plant one story per consumer.

A Spark job over tiny data costs seconds however small it is, so a test module plants every
story under its own consumer (and message ids and ordering key) into one archive, runs the job
once, and each test asserts on its own consumer's row.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from pipeline.common import event_schema, message_schema, subscription_schema

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

T0 = 1_700_000_000_000
SECOND = 1000


def message(
    n: int,
    *,
    topic: str = "orders/eu",
    key: str | None = None,
    qos: int = 1,
    at: int | None = None,
    storage_topic: int = 0,
    sequence: int | None = None,
    message_id: str | None = None,
    composite: str = "default",
    payload: str = "aGVsbG8=",
    keyed: bool | None = None,
) -> dict[str, Any]:
    """The n-th message: published n seconds after T0, n-th in its shard unless told."""
    return {
        "message_id": message_id or f"m{n}",
        "topic": topic,
        "composite_topic": composite,
        "storage_topic": storage_topic,
        "stream": f"shoal-{composite}-{storage_topic}",
        "shard_id": "shardId-000000000000",
        "sequence_number": str(sequence if sequence is not None else 1000 + n),
        "position": 0,
        "published_at": at if at is not None else T0 + n * SECOND,
        "arrival_ms": at if at is not None else T0 + n * SECOND,
        "qos": qos,
        "retain": False,
        "ordering_key": key or topic,
        # None: an archive written before the flag (counted keyed)
        "keyed": keyed,
        "publisher": "alice",
        "publisher_id": None,
        "publisher_seq": None,
        "properties": {},
        "payload": payload,
    }


def event(
    kind: str,
    consumer: str,
    message_id: str | None,
    at: int,
    *,
    consumer_kind: str = "session",
    delivery_id: str | None = None,
    qos: int | None = 1,
    published_at: int | None = None,
    attempt: int | None = None,
    seq: int = 0,
    batch: str = "b",
    reason: str | None = None,
    subscription: str | None = None,
    label: str | None = None,
    retain: bool | None = None,
) -> dict[str, Any]:
    return {
        "event": kind,
        "consumer_kind": consumer_kind,
        "consumer": consumer,
        "message_id": message_id or "",
        "at": at,
        "delivery_id": delivery_id,
        "topic": None,
        "ordering_key": None,
        "published_at": published_at,
        "qos": qos,
        "attempt": attempt,
        "subscription": subscription,
        "reason": reason,
        "label": label,
        "retain": retain,
        "seq": seq,
        "batch": batch,
    }


class Scenario:
    """One consumer's story: its messages are ``<name>/m<n>`` on ordering key ``<name>/k``."""

    def __init__(self, name: str, consumer_kind: str = "session") -> None:
        self.name = name
        self.consumer_kind = consumer_kind
        self.messages: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []

    def id(self, n: int) -> str:
        return f"{self.name}/m{n}"

    def publish(self, n: int, **kw: Any) -> str:
        kw.setdefault("key", f"{self.name}/k")
        self.messages.append(message(n, message_id=self.id(n), **kw))
        return self.id(n)

    def record(self, kind: str, n: int, after_s: float, **kw: Any) -> None:
        at = T0 + n * SECOND + int(after_s * SECOND)
        self.events.append(
            event(kind, self.name, self.id(n), at, consumer_kind=self.consumer_kind, **kw)
        )

    def end(self, after_s: float, reason: str = "session_ended") -> None:
        """The consumer ended ``after_s`` after T0 (an ``ended`` event, naming no message)."""
        at = T0 + int(after_s * SECOND)
        self.events.append(
            event("ended", self.name, None, at, consumer_kind=self.consumer_kind, reason=reason)
        )

    def delivery(self, n: int, after_s: float, ordinal: int | None = None, **kw: Any) -> str:
        """delivered at ``after_s`` after n's publish; the delivery id"""
        delivery = f"{self.name}.{n if ordinal is None else ordinal}"
        self.record("delivered", n, after_s, delivery_id=delivery, **kw)
        return delivery

    def ack(self, n: int, after_s: float, delivery: str) -> None:
        # acks name only the delivery id, as a session's ack does
        at = T0 + n * SECOND + int(after_s * SECOND)
        self.events.append(
            event("acked", self.name, None, at, consumer_kind=self.consumer_kind,
                  delivery_id=delivery)
        )  # fmt: skip

    def clean(self, n: int, ack_after_s: float = 1, **publish: Any) -> None:
        """n published, routed, delivered and acked once."""
        self.publish(n, **publish)
        self.record("routed", n, 0.01)
        self.ack(n, ack_after_s, self.delivery(n, 0.02))


def delivered_and_acked(consumer: str, n: int, ack_after_s: float = 1) -> list[dict[str, Any]]:
    """Message ``m<n>`` routed, delivered and acked once by ``consumer``."""
    published = T0 + n * SECOND
    delivery = f"{consumer}.{n}"
    return [
        event("routed", consumer, f"m{n}", published + 10),
        event("delivered", consumer, f"m{n}", published + 20, delivery_id=delivery),
        event("acked", consumer, None, published + int(ack_after_s * SECOND), delivery_id=delivery),
    ]


def messages_df(spark: SparkSession, rows: Iterable[dict[str, Any]]) -> DataFrame:
    return spark.createDataFrame(list(rows), message_schema())


def events_df(spark: SparkSession, rows: Iterable[dict[str, Any]]) -> DataFrame:
    return spark.createDataFrame(list(rows), event_schema())


def subscriptions_df(spark: SparkSession, rows: Iterable[dict[str, Any]]) -> DataFrame:
    return spark.createDataFrame(list(rows), subscription_schema())
