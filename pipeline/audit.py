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
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from pipeline.common import (
    SEQUENCE_KEYS,
    UTC,
    Output,
    Progress,
    blank_as_null,
    in_range,
    iso,
    job_parser,
    matching_topics,
    parse_time,
    read_events,
    read_messages,
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
#: approx_percentile's accuracy: relative rank error 1/10,000, exact for fewer values
PERCENTILE_ACCURACY = 10_000
QUANTILES = [0.5, 0.9, 0.99]
#: an ack's (at, seq) as at * ACK_SEQ_SPAN + seq: seq (a line's place in its object) < 2**20
ACK_SEQ_SPAN = 2**20


@dataclass(frozen=True)
class AuditWindow:
    since: int | None = None
    until: int | None = None
    horizon_ms: int = DEFAULT_HORIZON_S * 1000
    #: the data is complete up to here (None: the latest time in the input)
    as_of: int | None = None


@dataclass
class AuditResult:
    """The audit's DataFrames; ``report`` collects them into report.json's shape.

    ``pairs``: every (consumer, message) pair with what happened to it and its status, plus one
    row per archived message no consumer matched (consumer null). It is the cached pairs
    (numeric keys, ``judged_pairs``) joined to two small cached frames, the consumers' names
    and the reorderings. Everything the report shows is an aggregate of it."""

    window: AuditWindow
    as_of: int
    pairs: DataFrame
    consumers: DataFrame
    matched_by: str

    @property
    def reorderings(self) -> DataFrame:
        from pyspark.sql import functions as F

        return self.pairs.where(F.col("reordered")).select(
            *CONSUMER,
            "ordering_key",
            "message_id",
            "acked_after",
            "at",
        )


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


def consumer_names(events: DataFrame) -> DataFrame:
    """Per consumer digest ``c``: its kind and id, its label (a session's client id) and, for a
    shared group, its subscription (``$share/<name>/<filter>``). A distinct of four
    dictionary-encoded columns: a few rows per consumer (``one_name_each`` makes it one)."""
    from pyspark.sql import functions as F

    share = F.when(F.col("subscription").startswith("$share/"), F.col("subscription"))
    # the distinct first, on the raw columns: the digest and the share test then run on a few
    # rows per consumer, not on every event
    return (
        events.select(*CONSUMER, "label", "subscription")
        .distinct()
        .select(
            digest(F.coalesce("consumer_kind", F.lit("")), "consumer").alias("c"),
            *CONSUMER,
            "label",
            share.alias("share"),
        )
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
    delivery = F.coalesce(blank_as_null(F.col("delivery_id")), F.concat(F.lit("#"), named))
    ack_key = F.col("at") * ACK_SEQ_SPAN + F.least(F.col("seq"), F.lit(ACK_SEQ_SPAN - 1))
    return (
        events.select(
            digest(F.coalesce("consumer_kind", F.lit("")), "consumer").alias("c"),
            digest(delivery).alias("d"),
            digest(named).alias("m"),
            "event",
            "at",
            F.coalesce("seq", F.lit(0)).alias("seq"),
            "qos",
            "published_at",
            F.coalesce("retain", F.lit(False)).alias("retain"),
            "consumer_kind",
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
            F.max("retain").alias("retained"),
            F.max(F.col("event") == "dead_lettered").alias("dead_lettered"),
            F.max(F.col("event") == "dropped").alias("dropped"),
            F.min("qos").alias("event_qos"),
            F.min("published_at").alias("event_published_at"),
            F.max("at").alias("last_at"),
            F.max(F.col("consumer_kind") == "group").alias("group"),
        )
    )


def pair_outcomes(delivered: DataFrame) -> DataFrame:
    """One row per (consumer, message) from its deliveries. Retained re-sends on a new
    subscribe (MQTT 5 §3.3.1.3, §3.8.3.1: the server sends the retained message when the
    subscription is made) are counted apart: they are neither a second copy of the publish
    nor its delivery. A redelivery keeps its delivery id (``dup``, §4.4), so one after a lost
    ack is the same delivery acked once, not a duplicate."""
    from pyspark.sql import functions as F

    fresh = ~F.col("retained")
    acked = F.col("ack").isNotNull()
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
            F.count(F.when(F.col("retained"), 1)).alias("retained_deliveries"),
            F.sum("redeliveries").alias("redeliveries"),
            F.max("dead_lettered").alias("dead_lettered"),
            F.max("dropped").alias("dropped"),
            F.min("event_qos").alias("event_qos"),
            F.min("event_published_at").alias("event_published_at"),
            F.max("last_at").alias("last_at"),
            F.max(F.when(fresh, 1).otherwise(0)).alias("fresh"),
            F.max("group").alias("group"),
        )
        .withColumn("acked_at", F.floor(F.col("_ack") / ACK_SEQ_SPAN))
        .withColumn("ack_seq", F.col("_ack") % ACK_SEQ_SPAN)
        .drop("_ack")
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
            digest(F.coalesce("consumer_kind", F.lit("")), "consumer").alias("c"),
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
        digest(F.coalesce("consumer_kind", F.lit("")), "consumer").alias("c"),
        *CONSUMER,
        F.lit(None).cast("string").alias("label"),
        share.alias("share"),
    )


def judged_pairs(
    archive: DataFrame, outcomes: DataFrame, window: AuditWindow, subscribed: DataFrame | None
) -> DataFrame:
    """Pairs joined to the archive (its publish time and QoS win over the events'), archived
    messages no consumer matched kept as one row each, the window applied, and per consumer
    and ordering key the latest-published message acked before each ack (``behind``)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    if subscribed is not None:
        outcomes = outcomes.join(subscribed, ["c", "m"], "full_outer")
    else:
        outcomes = outcomes.withColumn("subscribed_qos", F.lit(None).cast("int"))
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
    # one row per archived message is its first (any consumer's row): the messages count
    # without a distinct of its own; a window over the join's own partitioning (no exchange)
    by_message = Window.partitionBy("m")
    first = F.col("m").isNotNull() & F.coalesce(
        F.col("c") == F.min("c").over(by_message), F.col("c").isNull()
    )
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
        F.col("acked_at").alias("at"),
        "ack_seq",
        "publish_order",
        lane.alias("lane"),
        (first & F.col("archived")).alias("first_of_message"),
    )


def reorderings(pairs: DataFrame) -> DataFrame:
    """The pairs acked out of order, with the message acked before them although published
    after (``acked_after``): per lane (consumer and ordering key), in ack order, the
    latest-published message acked before each ack. A window over the judged pairs' narrow
    columns only (the order struct, longs and the id): the wide rows are not shuffled for it.
    Findings are few; the report joins them to the pairs."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    ordered = Window.partitionBy("lane").orderBy("acked_at", "ack_seq", "publish_order")
    before = ordered.rowsBetween(Window.unboundedPreceding, -1)
    return (
        pairs.where(F.col("lane").isNotNull())
        .select("c", "m", "lane", "acked_at", "ack_seq", "publish_order")
        .withColumn("behind", F.max("publish_order").over(before))
        .where(F.col("publish_order") < F.col("behind"))
        .select("c", "m", F.col("behind.message_id").alias("acked_after"))
    )


def with_status(pairs: DataFrame, window: AuditWindow, as_of: int) -> DataFrame:
    """Each pair's status (``STATUSES``), QoS and latency (publish to first ack)."""
    from pyspark.sql import functions as F

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


def consumer_summary(pairs: DataFrame) -> DataFrame:
    from pyspark.sql import functions as F

    def count_status(name: str) -> Column:
        return F.count(F.when(F.col("status") == name, 1)).alias(name)

    judged = ~F.col("status").isin("qos0", "retained")
    # the names are one per consumer: grouping by them too keeps one group per consumer, with
    # strings only as keys (a string in an aggregation buffer would make it sort-based)
    return (
        pairs.where(F.col("status").isNotNull())
        .groupBy("c", *CONSUMER, "label", "share")
        .agg(
            F.count(F.lit(1)).alias("matched"),
            F.count(F.when(judged, 1)).alias("judged"),
            *(count_status(s) for s in STATUSES),
            F.count(F.when(F.col("duplicated"), 1)).alias("duplicated"),
            F.count(F.when(F.col("delivered_after_ack"), 1)).alias("delivered_after_ack"),
            F.count(F.when(F.col("reordered"), 1)).alias("reordered"),
            F.sum("redeliveries").alias("redeliveries"),
            F.count(F.when(F.col("redeliveries") > 0, 1)).alias("redelivered_messages"),
            F.sum("retained_deliveries").alias("retained_deliveries"),
            F.count(F.when(~F.col("archived"), 1)).alias("unarchived"),
            F.percentile_approx("latency_ms", QUANTILES, PERCENTILE_ACCURACY).alias("latency"),
            F.max("latency_ms").alias("latency_max"),
        )
        .withColumn(
            "label",
            # a group is named by its share name (its consumer id is a digest of share name
            # and filter); a session by its client id
            F.when(
                (F.col("consumer_kind") == "group") & F.col("share").isNotNull(),
                F.regexp_extract(F.col("share"), r"^\$share/([^/]+)/", 1),
            ).otherwise(F.col("label")),
        )
        .withColumnRenamed("share", "subscription")
        .drop("c")
    )


def data_end(pairs: DataFrame) -> int:
    """The latest publish or event time in the input: the data is complete up to there."""
    from pyspark.sql import functions as F

    row = pairs.agg(F.greatest(F.max("last_at"), F.max("published_at"))).first()
    return int(row[0]) if row is not None and row[0] is not None else 0


def audit(
    messages: DataFrame,
    events: DataFrame,
    window: AuditWindow,
    subscriptions: DataFrame | None = None,
) -> AuditResult:
    """The audit as DataFrames, from raw archive rows and raw events: each input read once
    for the pairs (the consumers' names come from a distinct of four of the events' columns,
    dictionary-encoded in Parquet). Three caches: the pairs, and two frames of a few rows
    each, the names and the reorderings."""
    from pyspark.sql import functions as F

    spark = messages.sparkSession
    archive = published(messages)
    subscribed = None
    names = consumer_names(events)
    if subscriptions is not None:
        names = names.unionByName(subscription_names(subscriptions))
        in_window = in_range(
            unique_messages(messages), "published_at", window.since, window.until
        ).withColumnRenamed("qos", "message_qos")
        subscribed = subscription_pairs(in_window, subscriptions, spark)
    core = judged_pairs(archive, pair_outcomes(deliveries(events)), window, subscribed).cache()
    as_of = window.as_of if window.as_of is not None else data_end(core)
    reordered = reorderings(core).withColumn("reordered", F.lit(True)).cache()
    # materialized now, so that its size is known: findings are few, and the pairs then meet
    # them in a broadcast join instead of a shuffle of every pair
    reordered.count()
    # one row per consumer, sent to every task instead of shuffling the pairs to meet it
    pairs = (
        core.join(F.broadcast(one_name_each(names).cache()), "c", "left")
        .join(reordered, ["c", "m"], "left")
        .withColumn("reordered", F.coalesce("reordered", F.lit(False)))
        .drop("publish_order", "ack_seq", "lane")
    )
    judged = with_status(pairs, window, as_of)
    return AuditResult(
        window=window,
        as_of=as_of,
        pairs=judged,
        consumers=consumer_summary(judged),
        matched_by="delivery events"
        + (" and subscriptions held at publish time" if subscriptions is not None else ""),
    )


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


def report(result: AuditResult) -> dict[str, Any]:
    """report.json: totals, per-consumer findings and latency, examples, chart series. A few
    jobs, each an aggregate of the cached pairs."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    window = result.window
    consumers = []
    for row in result.consumers.orderBy(*CONSUMER).collect():
        r = _row(row)
        latency = r.pop("latency") or [None, None, None]
        r["latency_ms"] = {
            "p50": latency[0],
            "p90": latency[1],
            "p99": latency[2],
            "max": r.pop("latency_max"),
        }
        consumers.append(r)
    totals = {
        key: sum(c[key] for c in consumers)
        for key in (
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
    }
    pairs = result.pairs
    # one job for every total that is not a sum over consumers
    overall = pairs.agg(
        F.count(F.when(F.col("consumer").isNull(), 1)).alias("unmatched"),
        F.count(F.when(F.col("first_of_message"), 1)).alias("messages"),
        F.sum(F.when(F.col("m").isNull(), F.col("acks"))).alias("unresolved"),
        F.percentile_approx(
            F.when(F.col("status").isNotNull(), F.col("latency_ms")),
            QUANTILES,
            PERCENTILE_ACCURACY,
        ).alias("p"),
        F.max(F.when(F.col("status").isNotNull(), F.col("latency_ms"))).alias("max"),
        F.min("published_at").alias("first"),
        F.max("published_at").alias("last"),
    ).first()
    assert overall is not None  # an aggregate without grouping has one row
    # counted as each message's first row (``judged_pairs``): a distinct aggregate next to
    # percentile_approx would make Spark group by message first and merge a quantile digest
    # per message
    totals["messages"] = int(overall["messages"])
    # archived messages in the window that no consumer matched (no event, no subscription)
    totals["unmatched_messages"] = int(overall["unmatched"])
    totals["consumers"] = len(consumers)
    totals["unresolved_acks"] = int(overall["unresolved"] or 0)
    p = overall["p"] or [None, None, None]
    totals["latency_ms"] = {"p50": p[0], "p90": p[1], "p99": p[2], "max": overall["max"]}

    example_columns = [*CONSUMER, "label", "message_id", "published_at"]
    kinds = {
        "lost": F.col("status") == "lost",
        "duplicated": F.col("duplicated"),
        "reordered": F.col("reordered"),
        "delivered_after_ack": F.col("delivered_after_ack"),
    }
    # the examples of every kind in one job: the first EXAMPLES findings of each by publish time
    first = Window.partitionBy("kind").orderBy("published_at", *PAIR)
    picked = (
        pairs.where(F.col("status").isNotNull())
        .withColumn(
            "kind",
            F.explode(F.array(*(F.when(test, F.lit(name)) for name, test in kinds.items()))),
        )
        .where(F.col("kind").isNotNull())
        .withColumn("_n", F.row_number().over(first))
        .where(F.col("_n") <= EXAMPLES)
        .select(
            "kind",
            *example_columns,
            "acks",
            "acked_at",
            "last_handed_at",
            "acked_after",
            "ordering_key",
        )
        .collect()
    )
    fields = {
        "lost": example_columns,
        "duplicated": [*example_columns, "acks"],
        "reordered": [*example_columns, "ordering_key", "acked_after", "acked_at"],
        "delivered_after_ack": [*example_columns, "acked_at", "last_handed_at"],
    }
    examples: dict[str, list[dict[str, Any]]] = {name: [] for name in kinds}
    for found in picked:
        examples[found["kind"]].append({k: found[k] for k in fields[found["kind"]]})

    pairs = pairs.where(F.col("status").isNotNull())
    span = (overall["first"], overall["last"])
    timeline: dict[str, Any] = {"bucket_ms": None, "start": None, "series": {}}
    if span is not None and span[0] is not None:
        width = _nice_width(int(span[1]) - int(span[0]))
        start = int(span[0]) - int(span[0]) % width
        rows = (
            pairs.groupBy(F.floor((F.col("published_at") - start) / width).alias("b"), "status")
            .count()
            .collect()
        )
        series: dict[str, dict[int, int]] = {}
        for bucket in rows:
            series.setdefault(bucket["status"], {})[int(bucket["b"])] = int(bucket["count"])
        timeline = {"bucket_ms": width, "start": start, "series": series}
    # publish->ack latency on a log scale: eight buckets per decade
    histogram = {
        int(r["b"]): int(r["count"])
        for r in pairs.where(F.col("latency_ms").isNotNull())
        .groupBy(
            F.floor(F.log10(F.greatest(F.col("latency_ms"), F.lit(1)).cast("double")) * 8).alias(
                "b"
            )
        )
        .count()
        .collect()
    }
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
        "examples": examples,
        "charts": {
            "timeline": timeline,
            "latency_histogram": {"per_decade": 8, "buckets": histogram},
        },
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
    events = read_events(spark, args.input)
    subscriptions = read_subscriptions(spark, args.subscriptions)
    progress("pairing deliveries with the archive (the one pass over the input)")
    result = audit(messages, events, window, subscriptions)
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
