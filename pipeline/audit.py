"""The audit: was every published message delivered exactly once, in order, to every consumer?

For a publish time range it pairs archived messages with the consumers they matched and
judges each pair from the delivery events (``shoal.delivery.events``):

* **matched** - a consumer matched a message when the service recorded any event of it for
  that consumer (routed, delivered, redelivered, acked, dead-lettered, dropped), or, given
  ``--subscriptions``, when one of the consumer's filters held at publish time matches its
  topic. Events alone cannot see a message the router failed to match at all; the
  subscriptions file closes that gap for the consumers it lists.
* **lost** - a matched QoS 1/2 pair that was never acked (nor dead-lettered or dropped for a
  stated reason) although ``horizon`` has passed since its publish; inside the horizon it is
  ``pending``. Acked later than the horizon counts as ``late``, not lost.
* **duplicated** - the consumer acked the message under two different delivery ids (it was
  delivered to it twice as new); a redelivery (``dup``) keeps its id and is not a duplicate.
  ``delivered_after_ack`` counts pairs handed out again after their first ack.
* **reordered** - per consumer and ordering key, messages acked after a message published
  later (publish order: storage topic index, then Kinesis sequence number and position). A
  shared group promises order only for explicit ordering keys: it spreads unkeyed messages
  over its lanes (MQTT 5 §4.8.2 gives shared subscriptions no order), so a group's unkeyed
  messages are not judged for order. A session's are, per topic, as MQTT requires (§4.6).
* **latency** - publish to first ack, p50/p90/p99 per consumer.

QoS 0 pairs are at most once and are not judged. The time the data is complete up to
(``as_of``) is the latest event or publish time in the input unless given.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from datetime import datetime
from typing import TYPE_CHECKING, Any

from pipeline.columnar import read_events_and_names, read_messages
from pipeline.common import (
    SEQUENCE_KEYS,
    UTC,
    Output,
    Progress,
    blank_as_null,
    consumer_rows,
    in_range,
    iso,
    job_parser,
    matching_topics,
    parse_time,
    read_subscriptions,
    sequence_order,
    spark_session,
    unique_messages,
)

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

CONSUMER = ["consumer_kind", "consumer"]
PAIR = [*CONSUMER, "message_id"]
DELIVERIES = ("delivered", "redelivered")
#: examples of each finding kept in report.json
EXAMPLES = 20
DEFAULT_HORIZON_S = 300
STATUSES = ("acked", "late", "pending", "lost", "dead_lettered", "dropped", "qos0", "retained")
#: the latency percentiles reported, in percent
PERCENTILES = (50, 90, 99)
#: latency buckets keep this many leading bits of a latency in ms: exact below 2**10 (1,024 ms),
#: above it each bucket is narrower than 2**-9 (0.2%) of the latencies it holds
LATENCY_BITS = 10
#: an ack's (at, seq) as at * ACK_SEQ_SPAN + seq: seq (a line's place in its object) < 2**20
ACK_SEQ_SPAN = 2**20
#: a delivery's and a pair's flags (bits of one int)
RETAINED, DEAD_LETTERED, DROPPED, GROUP, FRESH = 1, 2, 4, 8, 16


@dataclass(frozen=True)
class AuditWindow:
    since: int | None = None
    until: int | None = None
    horizon_ms: int = DEFAULT_HORIZON_S * 1000
    #: the data is complete up to here (None: the latest time in the input)
    as_of: int | None = None


@dataclass(frozen=True)
class Name:
    """How the report names a consumer (``consumer_names``, one row per consumer digest)."""

    consumer_kind: str | None
    consumer: str | None
    #: a session's client id; a shared group's share name (its consumer id is a digest of
    #: share name and filter)
    label: str | None
    #: a shared group's ``$share/<name>/<filter>``
    subscription: str | None


@dataclass
class AuditResult:
    """The audit's frames; ``summarize`` and ``report`` collect them into report.json's shape.

    ``pairs``: every (consumer, message) pair with what happened to it and its status, plus one
    row per archived message no consumer matched (``c`` null): the cached pairs
    (``judged_pairs``, numeric keys) with their status. ``reorderings``: the pairs acked behind
    a later publish, a small cached frame. ``names``: consumer digest -> name, collected, so
    that no string is joined to the pairs. ``span``: the first and last publish time."""

    window: AuditWindow
    as_of: int
    pairs: DataFrame
    reorderings: DataFrame
    names: dict[int, Name]
    span: tuple[int, int] | None
    matched_by: str

    def name(self, c: int | None) -> Name:
        return self.names.get(c, NO_NAME) if c is not None else NO_NAME

    def restricted(self, consumers: Sequence[str]) -> AuditResult:
        """The same audit for only the consumers with these ids."""
        from pyspark.sql import functions as F

        keep = [c for c, n in self.names.items() if n.consumer in consumers]
        return replace(
            self,
            pairs=self.pairs.where(F.col("c").isin(keep)),
            reorderings=self.reorderings.where(F.col("c").isin(keep)),
            names={c: self.names[c] for c in keep},
        )


NO_NAME = Name(None, None, None, None)


# -- transforms -----------------------------------------------------------------------------------
#
# The heavy steps group, join and sort on 64-bit digests of the ids (``digest``): fixed-width
# keys and fixed-width aggregation buffers let Spark hash-aggregate with generated code and sort
# on a long prefix, where strings (a string in an aggregation buffer, a string or struct sort
# key) force sort-based aggregation, which runs interpreted and sorts every row twice. Strings
# come back only where a person reads them: consumer names (a small distinct table) and message
# ids (carried from the archive).


def digest(*columns: Column | str) -> Column:
    """xxhash64 of the columns, null when the first is null. Two of n ids collide with a
    probability of about n**2 / 2**65 (1e-6 for 6 million ids): a collision would merge two
    messages' deliveries, which the audit would show as a duplicate, never hide a loss."""
    from pyspark.sql import functions as F

    first = F.col(columns[0]) if isinstance(columns[0], str) else columns[0]
    return F.when(first.isNotNull(), F.xxhash64(*columns))


def consumer_key() -> Column:
    """A row's consumer as one column (``c``): the digest of its kind and name."""
    from pyspark.sql import functions as F

    return digest(F.coalesce("consumer_kind", F.lit("")), "consumer")


def published(messages: DataFrame) -> DataFrame:
    """One row per archived message with its place in publish order (``publish_order``:
    storage topic, then Kinesis sequence number as numbers, then position in the record, then
    publish time and id), its digest ``m`` and its lane's ``key`` (a digest of composite topic
    and ordering key). A message a bisected batch archived twice keeps its copy earliest in its
    stream (a window over the digest: one sort on a long, where a minimum of a struct would
    aggregate sort-based). Hash-partitioned by ``m``, as the pairs it is joined with."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    # only what the audit uses: Parquet reads just these columns (payloads stay on disk)
    needed = messages.select(
        "message_id",
        "composite_topic",
        "ordering_key",
        "keyed",
        "qos",
        "published_at",
        "storage_topic",
        "position",
        *sequence_order(),
    ).where(F.col("message_id").isNotNull())
    order = F.struct("storage_topic", *SEQUENCE_KEYS, "position", "published_at", "message_id")
    earliest = Window.partitionBy("m").orderBy("publish_order")
    return (
        needed.select(
            digest("message_id").alias("m"),
            "message_id",
            digest(F.coalesce("composite_topic", F.lit("")), "ordering_key").alias("key"),
            "composite_topic",
            "ordering_key",
            # archives from before the flag have none: their order was kept, count them keyed
            F.coalesce(F.col("keyed"), F.lit(True)).alias("keyed"),
            F.col("qos").alias("message_qos"),
            F.col("published_at").alias("archived_at"),
            order.alias("publish_order"),
        )
        .withColumn("_copy", F.row_number().over(earliest))
        .where(F.col("_copy") == 1)
        .drop("_copy")
        .withColumn("_archived", F.lit(True))
    )


def consumer_names(rows: DataFrame) -> DataFrame:
    """Per consumer digest ``c``: its kind and id, its label (a session's client id) and, for a
    shared group, its subscription (``$share/<name>/<filter>``), from ``consumer_rows``: a few
    rows per consumer (``one_name_each`` makes it one). The digest and the share test run on
    those rows, not on every event."""
    from pyspark.sql import functions as F

    share = F.when(F.col("subscription").startswith("$share/"), F.col("subscription"))
    return rows.select(
        consumer_key().alias("c"),
        *CONSUMER,
        "label",
        share.alias("share"),
    )


def one_name_each(names: DataFrame) -> DataFrame:
    """One row per consumer of ``consumer_names``' or ``subscription_names``' rows."""
    from pyspark.sql import functions as F

    return names.groupBy("c", *CONSUMER).agg(
        F.max("label").alias("label"), F.max("share").alias("share")
    )


def deliveries(events: DataFrame) -> DataFrame:
    """One row per delivery: a consumer's events that share a delivery id (delivered, its
    redeliveries, its acks), or, without one, a message id (routed, a push ack, a dead letter).
    An ack that names only the delivery id gets its message (``m``) here, from the delivery
    events of that id: one aggregate, no self-join. Lines a re-cut batch wrote twice change
    nothing but ``redeliveries`` (a count, shown, never judged)."""
    from pyspark.sql import functions as F

    def at_of(*kinds: str) -> Column:
        return F.when(F.col("event").isin(*kinds), F.col("at"))

    named = blank_as_null(F.col("message_id"))
    delivery = blank_as_null(F.col("delivery_id"))
    ack_key = F.col("at") * ACK_SEQ_SPAN + F.least(F.col("seq"), F.lit(ACK_SEQ_SPAN - 1))
    # what a delivery's events say as bits of one int, so one bit_or aggregates them all
    flags = (
        F.when(F.coalesce("retain", F.lit(False)), RETAINED).otherwise(0)
        + F.when(F.col("event") == "dead_lettered", DEAD_LETTERED).otherwise(0)
        + F.when(F.col("event") == "dropped", DROPPED).otherwise(0)
        + F.when(F.col("consumer_kind") == "group", GROUP).otherwise(0)
    )
    return (
        events.select(
            consumer_key().alias("c"),
            # a delivery by its id, else by its message's (a hash seeded apart, not a string
            # built for every routed event)
            F.when(delivery.isNotNull(), F.xxhash64(delivery))
            .when(named.isNotNull(), F.xxhash64(F.lit("#"), named))
            .alias("d"),
            digest(named).alias("m"),
            "event",
            "at",
            F.coalesce("seq", F.lit(0)).alias("seq"),
            "qos",
            "published_at",
            flags.alias("flags"),
        )
        .where(F.col("d").isNotNull())
        .groupBy("c", "d")
        .agg(
            F.max("m").alias("m"),
            # the first ack as one long, (at, seq) in order: a long, not a struct, to compare
            F.min(F.when(F.col("event") == "acked", ack_key)).alias("ack"),
            # when the consumer was first handed this delivery
            F.min(at_of(*DELIVERIES)).alias("handed_at"),
            F.count(at_of("redelivered")).alias("redeliveries"),
            F.bit_or("flags").alias("flags"),
            F.min("qos").alias("event_qos"),
            F.min("published_at").alias("event_published_at"),
            F.max("at").alias("last_at"),
        )
    )


def pair_outcomes(delivered: DataFrame) -> DataFrame:
    """One row per (consumer, message) from its deliveries. Retained re-sends on a new
    subscribe (MQTT 5 §3.3.1.3, §3.8.3.1: the server sends the retained message when the
    subscription is made) are counted apart: they are neither a second copy of the publish
    nor its delivery. A redelivery keeps its delivery id (``dup``, §4.4), so one after a lost
    ack is the same delivery acked once, not a duplicate."""
    from pyspark.sql import functions as F

    retained = (F.col("flags").bitwiseAND(RETAINED)) != 0
    fresh = ~retained
    acked = F.col("ack").isNotNull()
    # a pair's flags: its deliveries' (retained only when every one is), FRESH when one is not
    pair_flags = F.col("flags").bitwiseAND(~RETAINED) + F.when(fresh, FRESH).otherwise(0)

    def has(bit: int) -> Column:
        return F.col("flags").bitwiseAND(bit) != 0

    # acks whose delivery id no delivery event names stay, as one row per consumer with no
    # message (m null): counted as unresolved, never judged
    # hash-partitioned by message alone (that clusters by pair too): the join with the
    # archive, partitioned the same way, then needs no exchange
    return (
        delivered.repartition("m")
        .groupBy("c", "m")
        .agg(
            F.min(F.when(fresh, F.col("ack"))).alias("_ack"),
            F.count(F.when(fresh & acked, 1)).alias("acks"),
            F.max(F.when(fresh, F.col("handed_at"))).alias("last_handed_at"),
            F.count(F.when(retained, 1)).alias("retained_deliveries"),
            F.sum("redeliveries").alias("redeliveries"),
            F.bit_or(pair_flags).alias("flags"),
            F.min("event_qos").alias("event_qos"),
            F.min("event_published_at").alias("event_published_at"),
            F.max("last_at").alias("last_at"),
        )
        .select(
            "*",
            F.floor(F.col("_ack") / ACK_SEQ_SPAN).alias("acked_at"),
            # the ack order as one long, (at, seq): the reorder window sorts on it
            F.col("_ack").alias("ack_order"),
            has(DEAD_LETTERED).alias("dead_lettered"),
            has(DROPPED).alias("dropped"),
            has(GROUP).alias("group"),
            F.when(has(FRESH), 1).otherwise(0).alias("fresh"),
        )
        .drop("_ack", "flags")
    )


def subscription_pairs(
    messages: DataFrame, subscriptions: DataFrame, spark: SparkSession
) -> DataFrame:
    """(consumer, message) for every subscription held when the message was published whose
    filter matches its topic, with the granted QoS min(subscription, message)."""
    from pyspark.sql import functions as F

    topics = [r[0] for r in messages.select("topic").distinct().collect()]
    filters = [r[0] for r in subscriptions.select("filter").distinct().collect()]
    matched = [(f, t) for f in filters for t in matching_topics(topics, f)]
    table = spark.createDataFrame(matched, "filter string, topic string")
    return (
        messages.join(table, "topic")
        .join(subscriptions, "filter")
        .where(
            (F.col("published_at") >= F.coalesce("since", F.lit(0)))
            & (F.col("until").isNull() | (F.col("published_at") < F.col("until")))
        )
        .select(
            consumer_key().alias("c"),
            digest("message_id").alias("m"),
            F.least(F.coalesce("qos", F.lit(2)), F.col("message_qos")).alias("_qos"),
        )
        .groupBy("c", "m")
        .agg(F.max("_qos").alias("subscribed_qos"))
    )


def subscription_names(subscriptions: DataFrame) -> DataFrame:
    """``consumer_names``' rows of the consumers a subscriptions file lists."""
    from pyspark.sql import functions as F

    share = F.when(F.col("filter").startswith("$share/"), F.col("filter"))
    return subscriptions.select(
        consumer_key().alias("c"),
        *CONSUMER,
        F.lit(None).cast("string").alias("label"),
        share.alias("share"),
    )


def judged_pairs(
    archive: DataFrame, outcomes: DataFrame, window: AuditWindow, subscribed: DataFrame | None
) -> DataFrame:
    """Pairs joined to the archive (its publish time and QoS win over the events'), archived
    messages no consumer matched kept as one row each, the window applied, and each judged
    pair's ``lane`` for the reorder window."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    if subscribed is not None:
        outcomes = outcomes.join(subscribed, ["c", "m"], "full_outer")
    else:
        outcomes = outcomes.withColumn("subscribed_qos", F.lit(None).cast("int"))
    # one row per archived message is its first (the messages count without a distinct of its
    # own): marked before the join, on the pairs' own partitioning by message (no exchange; the
    # sort is the one the join needs anyway). A message no pair names is its archive row.
    by_message = Window.partitionBy("m")
    outcomes = outcomes.withColumn("_first", F.col("c") == F.min("c").over(by_message))
    joined = (
        archive.join(outcomes, "m", "full_outer")
        .withColumn("archived", F.coalesce(F.col("_archived"), F.lit(False)))
        .drop("_archived")
    )
    joined = joined.withColumn("published_at", F.coalesce("archived_at", "event_published_at"))
    kept = F.col("published_at").isNotNull()
    if window.since is not None:
        kept = kept & (F.col("published_at") >= window.since)
    if window.until is not None:
        kept = kept & (F.col("published_at") < window.until)
    # unresolved acks (no message) stay whatever the window: reported, never judged
    joined = joined.where(kept | F.col("m").isNull())
    # a shared group promises order only per explicit ordering key (MQTT 5 §4.8.2 gives
    # shared subscriptions no order; its lanes spread unkeyed messages), a session per topic
    judged = (
        F.col("c").isNotNull()
        & F.col("acked_at").isNotNull()
        & F.col("archived")
        & (~F.coalesce(F.col("group"), F.lit(False)) | F.col("keyed"))
    )
    # one long per (consumer, composite topic, ordering key): the reorder window sorts on it
    lane = F.when(judged, F.xxhash64("c", "key"))
    first = F.col("archived") & F.coalesce(F.col("_first"), F.lit(True))
    # what the report reads, and no more: the cache holds every row of this frame
    return joined.select(
        "c",
        "m",
        "message_id",
        "ordering_key",
        "message_qos",
        "published_at",
        "archived",
        "acks",
        "last_handed_at",
        "retained_deliveries",
        "redeliveries",
        "dead_lettered",
        "dropped",
        "event_qos",
        "subscribed_qos",
        "last_at",
        "fresh",
        "acked_at",
        "ack_order",
        "publish_order",
        lane.alias("lane"),
        first.alias("first_of_message"),
    )


def reorderings(pairs: DataFrame) -> DataFrame:
    """The pairs acked out of order, with the message acked before them although published
    after (``acked_after``): per lane (consumer and ordering key), in ack order, the
    latest-published message acked before each ack. A window over the judged pairs' narrow
    columns only (the order struct, longs and the ids): the wide rows are not shuffled for it.
    Findings are few: the report reads them on their own, never joined back to the pairs."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    # sorted on two longs (lane, ack order); the order struct only breaks ties
    ordered = Window.partitionBy("lane").orderBy("ack_order", "publish_order")
    before = ordered.rowsBetween(Window.unboundedPreceding, -1)
    return (
        pairs.where(F.col("lane").isNotNull())
        .select(
            "c",
            "m",
            "lane",
            "acked_at",
            "ack_order",
            "publish_order",
            "published_at",
            "ordering_key",
        )
        .withColumn("behind", F.max("publish_order").over(before))
        .where(F.col("publish_order") < F.col("behind"))
        .select(
            "c",
            "m",
            F.col("publish_order.message_id").alias("message_id"),
            "published_at",
            "ordering_key",
            "acked_at",
            F.col("behind.message_id").alias("acked_after"),
        )
    )


def consumer_ends(events: DataFrame) -> DataFrame:
    """When each consumer ended (``ended`` events: a session's end, a shared group's removal),
    every time it did, by consumer digest: one small row for each that ended."""
    from pyspark.sql import functions as F

    return (
        events.where(F.col("event") == "ended")
        .select(consumer_key().alias("c"), "at")
        .groupBy("c")
        .agg(F.collect_list("at").alias("ended_at"))
    )


def ended_after_publish() -> Column:
    """Whether a row's consumer ended after its message's publish: its ``ended_at`` (joined
    from ``consumer_ends``) holds a time past ``published_at``. False when it never ended."""
    from pyspark.sql import functions as F

    return F.coalesce(F.exists("ended_at", lambda at: at > F.col("published_at")), F.lit(False))


def with_status(
    pairs: DataFrame, window: AuditWindow, as_of: int, ends: DataFrame | None = None
) -> DataFrame:
    """Each pair's status (``STATUSES``), QoS and latency (publish to first ack). A pair whose
    consumer ended after the message was published and never acked it is ``dropped``: its
    session or group discarded it when it ended (``ends``, ``consumer_ends``), as MQTT 5 lets a
    server (§4.1), not lost."""
    from pyspark.sql import functions as F

    if ends is not None:
        # few rows: sent whole to every task, the pairs stay where they are
        pairs = pairs.join(F.broadcast(ends), "c", "left")
        pairs = pairs.withColumn(
            "dropped", F.coalesce(F.col("dropped"), F.lit(False)) | ended_after_publish()
        ).drop("ended_at")
    qos = F.coalesce("event_qos", "subscribed_qos", "message_qos", F.lit(1))
    only_retained = (F.col("fresh") == 0) & (F.col("retained_deliveries") > 0)
    status = (
        F.when(F.col("qos") == 0, "qos0")
        .when(only_retained, "retained")
        .when(F.col("acked_at").isNotNull() & (F.col("latency_ms") > window.horizon_ms), "late")
        .when(F.col("acked_at").isNotNull(), "acked")
        .when(F.col("dead_lettered"), "dead_lettered")
        .when(F.col("dropped"), "dropped")
        .when(F.col("published_at") + window.horizon_ms > as_of, "pending")
        .otherwise("lost")
    )
    counts = ["acks", "redeliveries", "retained_deliveries", "fresh"]
    flags = ["dead_lettered", "dropped"]
    return (
        pairs.fillna(0, subset=counts)
        .fillna(False, subset=flags)
        .withColumn("qos", qos)
        .withColumn("latency_ms", F.col("acked_at") - F.col("published_at"))
        .withColumn(
            "status",
            F.when(F.col("c").isNotNull() & F.col("m").isNotNull(), status),
        )
        .withColumn("duplicated", F.col("acks") > 1)
        # a fresh delivery (a new delivery id) handed out after the first ack; the same
        # delivery handed again (dup) after a lost ack is not one (§4.4)
        .withColumn(
            "delivered_after_ack",
            F.coalesce(F.col("last_handed_at") > F.col("acked_at"), F.lit(False)),
        )
    )


@dataclass
class Summary:
    """Per consumer counts and latency (report.json's ``consumers``), and the totals that are
    not a sum over consumers (``overall``)."""

    consumers: list[dict[str, Any]]
    overall: dict[str, Any]


#: report.json's per-consumer counts, in its order
COUNTS = (
    "matched",
    "judged",
    *STATUSES,
    "duplicated",
    "delivered_after_ack",
    "reordered",
    "redeliveries",
    "redelivered_messages",
    "retained_deliveries",
    "unarchived",
)


def summarize(result: AuditResult) -> Summary:
    """Every consumer's counts and latency percentiles with the overall ones: one aggregate of
    the pairs per latency bucket and consumer and per latency bucket over all consumers (a
    rollup: strings stay out of it, names come from ``result.names``), then the percentiles
    from those histograms (``latency_bucket``); and the reorderings per consumer from their
    small frame. Counts and sums only, so the big aggregate is a hash aggregate with generated
    code; ``percentile_approx`` needed an object aggregate that runs interpreted and cost four
    times as much at 5M events."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    pairs = result.pairs
    status = F.col("status")
    matched = status.isNotNull()

    def count(test: Column) -> Column:
        return F.count(F.when(matched & test, 1))

    latency = F.when(matched, F.col("latency_ms"))
    measures = {
        "matched": F.count(F.when(matched, 1)),
        "judged": count(~status.isin("qos0", "retained")),
        **{s: count(status == s) for s in STATUSES},
        "duplicated": count(F.col("duplicated")),
        "delivered_after_ack": count(F.col("delivered_after_ack")),
        "redeliveries": F.sum(F.when(matched, F.col("redeliveries"))),
        "redelivered_messages": count(F.col("redeliveries") > 0),
        "retained_deliveries": F.sum(F.when(matched, F.col("retained_deliveries"))),
        "unarchived": count(~F.col("archived")),
        # the totals that are not a sum over consumers
        "unmatched": F.count(F.when(F.col("c").isNull(), 1)),
        "messages": F.count(F.when(F.col("first_of_message"), 1)),
        "unresolved": F.sum(F.when(F.col("m").isNull(), F.col("acks"))),
    }
    # rollup (b, c) groups by (b, c), by b (every consumer: _all) and by nothing (dropped)
    histograms = (
        pairs.withColumn("b", latency_bucket(latency))
        .rollup("b", "c")
        .agg(
            *(f.alias(k) for k, f in measures.items()),
            F.count(latency).alias("n"),
            F.max(latency).alias("top"),
            F.grouping("c").alias("_all"),
            F.grouping("b").alias("_none"),
        )
        .where(F.col("_none") == 0)
    )
    # percentile p: the first bucket whose cumulative count reaches rank ceil(p% of n) (the
    # nearest rank), as its largest latency
    histogram = Window.partitionBy("_all", "c")
    upto = histogram.orderBy("b").rowsBetween(Window.unboundedPreceding, Window.currentRow)
    ranked = histograms.withColumn("_upto", F.sum("n").over(upto)).withColumn(
        "_n", F.sum("n").over(histogram)
    )

    def percentile(p: int) -> Column:
        rank = F.floor((F.col("_n") * p + 99) / 100)
        return F.min(F.when(F.col("_upto") >= rank, F.col("top")))

    rows = (
        ranked.groupBy("_all", "c")
        .agg(
            *(F.sum(k).alias(k) for k in measures),
            F.array(*(percentile(p) for p in PERCENTILES)).alias("latency"),
            F.max("top").alias("latency_max"),
        )
        .collect()
    )
    reordered = {r["c"]: int(r["count"]) for r in result.reorderings.groupBy("c").count().collect()}
    consumers: list[dict[str, Any]] = []
    overall: dict[str, Any] = {}
    for row in rows:
        r = _row(row)
        latency_ms = _latency(r.pop("latency"), r.pop("latency_max"))
        if r.pop("_all"):
            overall = {
                "unmatched": int(r["unmatched"]),
                "messages": int(r["messages"]),
                "unresolved": int(r["unresolved"] or 0),
                "latency_ms": latency_ms,
            }
            continue
        # the archived messages no consumer matched are the group of no consumer; a consumer
        # with nothing matched (acks no delivery names) is not one the report lists
        if r["c"] is None or not r["matched"]:
            continue
        name = result.name(r["c"])
        counts = {k: int(r.get(k) or 0) for k in COUNTS}
        counts["reordered"] = reordered.get(r["c"], 0)
        consumers.append(
            {
                "consumer_kind": name.consumer_kind,
                "consumer": name.consumer,
                "label": name.label,
                "subscription": name.subscription,
                **counts,
                "latency_ms": latency_ms,
            }
        )
    consumers.sort(key=lambda c: (c["consumer_kind"] or "", c["consumer"] or ""))
    if not overall:  # a rollup of no rows has no total row either
        overall = {"unmatched": 0, "messages": 0, "unresolved": 0, "latency_ms": _latency()}
    return Summary(consumers, overall)


def latency_bucket(latency: Column) -> Column:
    """A latency's bucket: the latency (ms) with all but its ``LATENCY_BITS`` leading bits
    cleared, so exact below 1,024 ms and narrower than 0.2% of its values above; a negative
    latency (clocks apart) is its own bucket. The percentiles report a bucket's largest latency,
    a value of the input less than 0.2% above the exact one, as HdrHistogram does with its
    significant digits."""
    from pyspark.sql import functions as F

    # log2 in doubles is exact enough: it tells 2**k - 1 from 2**k for every k below 45
    bits = F.floor(F.log2(F.greatest(latency, F.lit(1)))).cast("int") + 1
    cleared = F.greatest(bits - LATENCY_BITS, F.lit(0))
    width = F.pow(F.lit(2.0), cleared).cast("long")
    return (F.floor(latency / width) * width).cast("long")


def _latency(
    quantiles: Sequence[int | None] | None = None, top: int | None = None
) -> dict[str, Any]:
    q = list(quantiles or [None, None, None])
    return {"p50": q[0], "p90": q[1], "p99": q[2], "max": top}


def bounds(pairs: DataFrame) -> tuple[int, tuple[int, int] | None]:
    """The latest publish or event time in the input (the data is complete up to there), and
    the first and last publish time. The job that fills the pairs' cache."""
    from pyspark.sql import functions as F

    row = pairs.agg(
        F.max("last_at").alias("last_at"),
        F.min("published_at").alias("first"),
        F.max("published_at").alias("last"),
    ).first()
    if row is None or row["first"] is None:
        return (int(row["last_at"]) if row and row["last_at"] is not None else 0), None
    end = max(int(row["last"]), int(row["last_at"] or 0))
    return end, (int(row["first"]), int(row["last"]))


def audit(
    messages: DataFrame,
    events: DataFrame,
    window: AuditWindow,
    subscriptions: DataFrame | None = None,
    names: DataFrame | None = None,
) -> AuditResult:
    """The audit as frames, from raw archive rows and raw events: each input read once for
    the pairs. The consumers' names come from ``names`` (``read_names``: what ``compact``
    wrote beside the events), else from the events' four name columns, read once more
    (``consumer_rows``). Two caches: the pairs, and their few reorderings."""
    names = consumer_names(names if names is not None else consumer_rows(events))
    if subscriptions is not None:
        names = names.unionByName(subscription_names(subscriptions))
    # the names' small job runs in a thread of its own while this one plans the pairs (Spark
    # takes jobs from several threads at once): the driver's planning of a first audit leaves
    # the cores idle for seconds, and the names' job after the pairs' was about a second of
    # its own
    with ThreadPoolExecutor(1) as pool:
        named_rows = pool.submit(lambda: one_name_each(names).collect())
        archive = published(messages)
        subscribed = None
        if subscriptions is not None:
            in_window = in_range(
                unique_messages(messages), "published_at", window.since, window.until
            ).withColumnRenamed("qos", "message_qos")
            subscribed = subscription_pairs(in_window, subscriptions, messages.sparkSession)
        pairs = pair_outcomes(deliveries(events))
        core = judged_pairs(archive, pairs, window, subscribed).cache()
        end, span = bounds(core)
        named = {
            int(r["c"]): Name(r["consumer_kind"], r["consumer"], _label(r), r["share"])
            for r in named_rows.result()
        }
    as_of = window.as_of if window.as_of is not None else end
    return AuditResult(
        window=window,
        as_of=as_of,
        pairs=with_status(core, window, as_of, consumer_ends(events)).drop(
            "publish_order", "ack_order", "lane"
        ),
        reorderings=reorderings(core).cache(),
        names=named,
        span=span,
        matched_by="delivery events"
        + (" and subscriptions held at publish time" if subscriptions is not None else ""),
    )


def _label(name: Any) -> str | None:
    """A group by its share name (its consumer id is a digest of share name and filter); a
    session by its client id."""
    if name["consumer_kind"] == "group" and name["share"]:
        found = re.match(r"^\$share/([^/]+)/", name["share"])
        if found:
            return found[1]
    label: str | None = name["label"]
    return label


# -- the report -----------------------------------------------------------------------------------


def _nice_width(span_ms: int, buckets: int = 48) -> int:
    steps = [1, 5, 10, 30, 60, 300, 600, 1800, 3600, 6 * 3600, 86400]
    for step in steps:
        if span_ms / (step * 1000) <= buckets:
            return step * 1000
    return steps[-1] * 1000


def _row(row: Any) -> dict[str, Any]:
    out: dict[str, Any] = row.asDict(recursive=True)
    return out


def examples(result: AuditResult) -> dict[str, list[dict[str, Any]]]:
    """The first ``EXAMPLES`` findings of each kind by publish time: one job over the pairs for
    lost, duplicated and delivered-after-ack, one over the reorderings."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    kinds = {
        "lost": F.col("status") == "lost",
        "duplicated": F.col("duplicated"),
        "delivered_after_ack": F.col("delivered_after_ack"),
    }
    first = Window.partitionBy("kind").orderBy("published_at", "message_id", "c")
    picked: list[Any] = (
        result.pairs.where(F.col("status").isNotNull())
        .withColumn(
            "kind",
            F.explode(F.array(*(F.when(test, F.lit(name)) for name, test in kinds.items()))),
        )
        .where(F.col("kind").isNotNull())
        .withColumn("_n", F.row_number().over(first))
        .where(F.col("_n") <= EXAMPLES)
        .select("kind", "c", "message_id", "published_at", "acks", "acked_at", "last_handed_at")
        .collect()
    )
    picked += [
        {**_row(r), "kind": "reordered"}
        for r in result.reorderings.orderBy("published_at", "message_id", "c")
        .limit(EXAMPLES)
        .collect()
    ]
    fields = {
        "lost": [],
        "duplicated": ["acks"],
        "reordered": ["ordering_key", "acked_after", "acked_at"],
        "delivered_after_ack": ["acked_at", "last_handed_at"],
    }
    found: dict[str, list[dict[str, Any]]] = {kind: [] for kind in fields}
    for row in sorted(picked, key=lambda r: (r["published_at"], r["message_id"] or "", r["c"])):
        name = result.name(row["c"])
        found[row["kind"]].append(
            {
                "consumer_kind": name.consumer_kind,
                "consumer": name.consumer,
                "label": name.label,
                "message_id": row["message_id"],
                "published_at": row["published_at"],
                **{k: row[k] for k in fields[row["kind"]]},
            }
        )
    return found


def charts(result: AuditResult) -> dict[str, Any]:
    """The timeline (pairs by publish time and status) and the latency histogram (publish to
    first ack on a log scale, eight buckets per decade): one aggregate for both."""
    from pyspark.sql import functions as F

    timeline: dict[str, Any] = {"bucket_ms": None, "start": None, "series": {}}
    histogram: dict[int, int] = {}
    if result.span is not None:
        first, last = result.span
        width = _nice_width(last - first)
        start = first - first % width
        latency = F.greatest(F.col("latency_ms"), F.lit(1)).cast("double")
        rows = (
            result.pairs.where(F.col("status").isNotNull())
            .groupBy(
                F.floor((F.col("published_at") - start) / width).alias("b"),
                "status",
                F.floor(F.log10(latency) * 8).alias("h"),
            )
            .count()
            .collect()
        )
        series: dict[str, dict[int, int]] = {}
        for bucket in rows:
            n = int(bucket["count"])
            by_time = series.setdefault(bucket["status"], {})
            by_time[int(bucket["b"])] = by_time.get(int(bucket["b"]), 0) + n
            if bucket["h"] is not None:
                histogram[int(bucket["h"])] = histogram.get(int(bucket["h"]), 0) + n
        timeline = {"bucket_ms": width, "start": start, "series": series}
    return {
        "timeline": timeline,
        "latency_histogram": {"per_decade": 8, "buckets": dict(sorted(histogram.items()))},
    }


def report(result: AuditResult) -> dict[str, Any]:
    """report.json: totals, per-consumer findings and latency, examples, chart series. Five
    small jobs over the cached pairs and reorderings, from three threads."""
    window = result.window
    # three independent readers of the cached frames, run side by side: each job's driver work
    # and single-task stages leave a core idle that another's tasks take
    with ThreadPoolExecutor(3) as pool:
        summarized = pool.submit(summarize, result)
        found = pool.submit(examples, result)
        drawn = pool.submit(charts, result)
        summary = summarized.result()
    consumers = summary.consumers
    totals: dict[str, Any] = {key: sum(c[key] for c in consumers) for key in COUNTS}
    overall = summary.overall
    totals["messages"] = overall["messages"]
    # archived messages in the window that no consumer matched (no event, no subscription)
    totals["unmatched_messages"] = overall["unmatched"]
    totals["consumers"] = len(consumers)
    totals["unresolved_acks"] = overall["unresolved"]
    totals["latency_ms"] = overall["latency_ms"]
    return {
        "generated_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "window": {
            "since": window.since,
            "until": window.until,
            "since_iso": iso(window.since),
            "until_iso": iso(window.until),
            "horizon_ms": window.horizon_ms,
            "as_of": result.as_of,
            "as_of_iso": iso(result.as_of),
        },
        "matched_by": result.matched_by,
        "clean": totals["lost"] == 0
        and totals["duplicated"] == 0
        and totals["reordered"] == 0
        and totals["delivered_after_ack"] == 0,
        "totals": totals,
        "consumers": consumers,
        "examples": found.result(),
        "charts": drawn.result(),
    }


def write_report(doc: dict[str, Any], output: Output) -> list[str]:
    """report.json, and the charts with a one-page HTML around them (if matplotlib is here)."""
    from pipeline import charts

    written = [output.write("report.json", json.dumps(doc, indent=2).encode() + b"\n")]
    written += charts.write_audit(doc, output)
    return written


# -- the job --------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", required=True, help="archive root: a folder or s3://bucket")
    parser.add_argument("--output", required=True, help="folder (or s3:// prefix) for results")
    parser.add_argument("--since", help="publish time from (ISO 8601 or epoch ms), inclusive")
    parser.add_argument("--until", help="publish time until (ISO 8601 or epoch ms), exclusive")
    parser.add_argument(
        "--horizon-s",
        type=float,
        default=DEFAULT_HORIZON_S,
        help="unacked this long after publish: lost (default %(default)s)",
    )
    parser.add_argument("--as-of", help="the data is complete up to here (default: its end)")
    parser.add_argument(
        "--subscriptions",
        help="JSON lines of consumer_kind, consumer, filter, qos, since, until: consumers "
        "matched by subscription too, not only by their delivery events",
    )
    parser.add_argument(
        "--fail-on-findings",
        action="store_true",
        help="exit 1 when anything is lost, duplicated or reordered",
    )
    parser.add_argument("--quiet", action="store_true")


def window_of(args: argparse.Namespace) -> AuditWindow:
    return AuditWindow(
        since=parse_time(args.since),
        until=parse_time(args.until),
        horizon_ms=math.ceil(args.horizon_s * 1000),
        as_of=parse_time(args.as_of),
    )


def run(args: argparse.Namespace, spark: SparkSession | None = None) -> dict[str, Any]:
    progress = Progress("audit", quiet=args.quiet)
    window = window_of(args)
    progress("starting Spark")
    spark = spark or spark_session("shoal-audit")
    progress(f"reading {args.input}")
    messages = read_messages(spark, args.input, window.since, window.until)
    events, names = read_events_and_names(spark, args.input)
    subscriptions = read_subscriptions(spark, args.subscriptions)
    progress("pairing deliveries with the archive (the one pass over the input)")
    result = audit(messages, events, window, subscriptions, names)
    progress("judging every (consumer, message) pair and reporting")
    doc = report(result)
    t = doc["totals"]
    progress(
        f"{t['messages']} messages, {t['consumers']} consumers, {t['judged']} judged pairs: "
        f"{t['lost']} lost, {t['duplicated']} duplicated, {t['reordered']} reordered, "
        f"{t['pending']} pending"
    )
    output = Output(args.output, spark)
    for path in write_report(doc, output):
        progress(f"wrote {path}")
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    parser = job_parser("audit")
    add_arguments(parser)
    args = parser.parse_args(argv)
    doc = run(args)
    return 1 if args.fail_on_findings and not doc["clean"] else 0
