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
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from pipeline.common import (
    Output,
    Progress,
    in_range,
    iso,
    matching_topics,
    parse_time,
    read_events,
    read_messages,
    read_subscriptions,
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
STATUSES = ("acked", "late", "pending", "lost", "dead_lettered", "dropped", "qos0")


@dataclass(frozen=True)
class AuditWindow:
    since: int | None = None
    until: int | None = None
    horizon_ms: int = DEFAULT_HORIZON_S * 1000
    #: the data is complete up to here (None: the latest time in the input)
    as_of: int | None = None


@dataclass
class AuditResult:
    """The audit's DataFrames; ``report`` collects them into report.json's shape."""

    window: AuditWindow
    as_of: int
    messages: DataFrame
    pairs: DataFrame
    consumers: DataFrame
    reorderings: DataFrame
    unresolved_acks: DataFrame
    matched_by: str


# -- transforms -----------------------------------------------------------------------------------


def published(messages: DataFrame) -> DataFrame:
    """One row per archived message, with its rank in publish order within its ordering key."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    order = Window.partitionBy("composite_topic", "ordering_key").orderBy(
        "storage_topic", "seq_key", "position", "published_at", "message_id"
    )
    return unique_messages(messages).select(
        "message_id",
        "topic",
        "composite_topic",
        "ordering_key",
        # archives from before the flag have none: their order was kept, count them keyed
        F.coalesce(F.col("keyed"), F.lit(True)).alias("keyed"),
        "qos",
        "published_at",
        F.row_number().over(order).alias("publish_rank"),
    )


def resolved_events(events: DataFrame) -> DataFrame:
    """Events without the copies a re-cut batch wrote twice, and acks that name only a delivery
    id given the message id of the delivery with that id."""
    from pyspark.sql import functions as F

    unique = events.dropDuplicates(
        ["event", "consumer_kind", "consumer", "message_id", "delivery_id", "attempt", "at"]
    )
    ids = (
        unique.where(
            F.col("event").isin(*DELIVERIES, "routed")
            & F.col("delivery_id").isNotNull()
            & (F.coalesce(F.col("message_id"), F.lit("")) != "")
        )
        .select(*CONSUMER, "delivery_id", F.col("message_id").alias("_delivered_id"))
        .dropDuplicates([*CONSUMER, "delivery_id"])
    )
    return (
        unique.join(ids, [*CONSUMER, "delivery_id"], "left")
        .withColumn(
            "message_id",
            F.coalesce(F.nullif(F.col("message_id"), F.lit("")), F.col("_delivered_id")),
        )
        .drop("_delivered_id")
    )


def events_in_range(events: DataFrame, messages: DataFrame, window: AuditWindow) -> DataFrame:
    """Resolved events of the messages published in the window; the archive's publish time and
    QoS win over the event's own. ``archived`` says whether the archive has the message."""
    from pyspark.sql import functions as F

    archive = messages.select(
        "message_id",
        F.col("published_at").alias("_m_published_at"),
        F.col("qos").alias("message_qos"),
        F.lit(True).alias("archived"),
    )
    joined = (
        events.where(F.col("message_id").isNotNull())
        .join(archive, "message_id", "left")
        .withColumn("published_at", F.coalesce("_m_published_at", "published_at"))
        .withColumn("archived", F.coalesce("archived", F.lit(False)))
        .drop("_m_published_at")
    )
    return in_range(
        joined.where(F.col("published_at").isNotNull()), "published_at", window.since, window.until
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
        .groupBy(*PAIR)
        .agg(
            F.max(F.least(F.coalesce("qos", F.lit(2)), F.col("message_qos"))).alias(
                "subscribed_qos"
            ),
            F.first("published_at").alias("sub_published_at"),
        )
    )


def pair_outcomes(
    events: DataFrame, window: AuditWindow, as_of: int, subscribed: DataFrame | None = None
) -> DataFrame:
    """One row per matched (consumer, message) pair with what happened to it and its status."""
    from pyspark.sql import functions as F

    def when_event(*kinds: str, value: Column | str | int = 1) -> Column:
        picked = value if not isinstance(value, str) else F.col(value)
        return F.when(F.col("event").isin(*kinds), picked)

    per_pair = events.groupBy(*PAIR).agg(
        F.first("published_at", ignorenulls=True).alias("published_at"),
        F.first("message_qos", ignorenulls=True).alias("message_qos"),
        F.max(F.col("archived").cast("int")).alias("archived"),
        F.min("qos").alias("event_qos"),
        F.first("label", ignorenulls=True).alias("label"),
        F.min(when_event("acked", value="at")).alias("acked_at"),
        # a set, not countDistinct: a distinct aggregate next to others makes Spark expand
        # every row once per distinct column
        F.size(
            F.collect_set(when_event("acked", value=F.coalesce("delivery_id", "message_id")))
        ).alias("acks"),
        F.max(when_event(*DELIVERIES, value="at")).alias("last_delivered_at"),
        F.count(when_event("redelivered")).alias("redeliveries"),
        F.count(when_event("dead_lettered")).alias("dead_letters"),
        F.count(when_event("dropped")).alias("drops"),
    )
    if subscribed is not None:
        per_pair = (
            per_pair.join(subscribed, PAIR, "full_outer")
            .withColumn("published_at", F.coalesce("published_at", "sub_published_at"))
            .withColumn("archived", F.coalesce("archived", F.lit(1)))
            .drop("sub_published_at")
        )
    else:
        per_pair = per_pair.withColumn("subscribed_qos", F.lit(None).cast("int"))
    qos = F.coalesce("event_qos", "subscribed_qos", "message_qos", F.lit(1))
    latency = F.col("acked_at") - F.col("published_at")
    status = (
        F.when(F.col("qos") == 0, "qos0")
        .when(F.col("acked_at").isNotNull() & (F.col("latency_ms") > window.horizon_ms), "late")
        .when(F.col("acked_at").isNotNull(), "acked")
        .when(F.col("dead_letters") > 0, "dead_lettered")
        .when(F.col("drops") > 0, "dropped")
        .when(F.col("published_at") + window.horizon_ms > as_of, "pending")
        .otherwise("lost")
    )
    counts = ["acks", "redeliveries", "dead_letters", "drops"]
    return (
        per_pair.fillna(0, subset=counts)
        .withColumn("qos", qos)
        .withColumn("latency_ms", latency)
        .withColumn("status", status)
        .withColumn(
            "delivered_after_ack",
            F.coalesce(F.col("last_delivered_at") > F.col("acked_at"), F.lit(False)),
        )
    )


def reorderings(events: DataFrame, messages: DataFrame) -> DataFrame:
    """Acks that came after the ack of a message published later with the same ordering key;
    ``behind`` is the highest publish rank acked before it."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    first = Window.partitionBy(*PAIR).orderBy("at", "seq")
    acks = (
        events.where((F.col("event") == "acked") & F.col("message_id").isNotNull())
        .withColumn("_n", F.row_number().over(first))
        .where("_n = 1")
        .select(*PAIR, "at", "seq")
    )
    ranked = acks.join(
        messages.select("message_id", "composite_topic", "ordering_key", "keyed", "publish_rank"),
        "message_id",
    ).where((F.col("consumer_kind") != "group") | F.col("keyed"))
    before = (
        Window.partitionBy(*CONSUMER, "composite_topic", "ordering_key")
        .orderBy("at", "seq", "publish_rank")
        .rowsBetween(Window.unboundedPreceding, -1)
    )
    return (
        ranked.withColumn("behind", F.max("publish_rank").over(before))
        .where(F.col("publish_rank") < F.col("behind"))
        .select(*CONSUMER, "ordering_key", "message_id", "publish_rank", "behind", "at")
    )


def consumer_summary(pairs: DataFrame, reordered: DataFrame) -> DataFrame:
    from pyspark.sql import functions as F

    def count_status(name: str) -> Column:
        return F.count(F.when(F.col("status") == name, 1)).alias(name)

    judged = F.col("status") != "qos0"
    summary = pairs.groupBy(*CONSUMER).agg(
        F.first("label", ignorenulls=True).alias("label"),
        F.count(F.lit(1)).alias("matched"),
        F.count(F.when(judged, 1)).alias("judged"),
        *(count_status(s) for s in STATUSES),
        F.count(F.when(F.col("acks") > 1, 1)).alias("duplicated"),
        F.count(F.when(F.col("delivered_after_ack"), 1)).alias("delivered_after_ack"),
        F.sum("redeliveries").alias("redeliveries"),
        F.count(F.when(F.col("redeliveries") > 0, 1)).alias("redelivered_messages"),
        F.count(F.when(F.col("archived") == 0, 1)).alias("unarchived"),
        F.percentile(F.col("latency_ms"), [0.5, 0.9, 0.99]).alias("latency"),
        F.max("latency_ms").alias("latency_max"),
    )
    per_consumer = reordered.groupBy(*CONSUMER).agg(F.count(F.lit(1)).alias("reordered"))
    return summary.join(per_consumer, CONSUMER, "left").fillna(0, subset=["reordered"])


def data_end(messages: DataFrame, events: DataFrame) -> int:
    """The latest publish or event time in the input: the data is complete up to there."""
    from pyspark.sql import functions as F

    last_event = events.agg(F.max("at")).first()
    last_publish = messages.agg(F.max("published_at")).first()
    times = [r[0] for r in (last_event, last_publish) if r is not None and r[0] is not None]
    return max(times) if times else 0


def audit(
    messages: DataFrame,
    events: DataFrame,
    window: AuditWindow,
    subscriptions: DataFrame | None = None,
) -> AuditResult:
    """The audit as DataFrames, from raw archive rows and raw events."""
    from pyspark.sql import functions as F

    spark = messages.sparkSession
    archive = published(messages).cache()
    resolved = resolved_events(events).cache()
    as_of = window.as_of if window.as_of is not None else data_end(archive, resolved)
    window_messages = in_range(archive, "published_at", window.since, window.until)
    scoped = events_in_range(resolved, archive, window).cache()
    subscribed = None
    if subscriptions is not None:
        subscribed = subscription_pairs(
            window_messages.withColumnRenamed("qos", "message_qos"), subscriptions, spark
        )
    pairs = pair_outcomes(scoped, window, as_of, subscribed).cache()
    reordered = reorderings(scoped, window_messages).cache()
    unresolved = resolved.where((F.col("event") == "acked") & F.col("message_id").isNull()).select(
        *CONSUMER, "delivery_id", "at"
    )
    return AuditResult(
        window=window,
        as_of=as_of,
        messages=window_messages,
        pairs=pairs,
        consumers=consumer_summary(pairs, reordered),
        reorderings=reordered,
        unresolved_acks=unresolved,
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
    """report.json: totals, per-consumer findings and latency, examples, chart series."""
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
            "unarchived",
        )
    }
    totals["messages"] = result.messages.count()
    totals["consumers"] = len(consumers)
    totals["unresolved_acks"] = result.unresolved_acks.count()
    overall = result.pairs.agg(
        F.percentile(F.col("latency_ms"), [0.5, 0.9, 0.99]).alias("p"), F.max("latency_ms")
    ).first()
    p = (overall[0] if overall is not None else None) or [None, None, None]
    totals["latency_ms"] = {
        "p50": p[0],
        "p90": p[1],
        "p99": p[2],
        "max": overall[1] if overall is not None else None,
    }

    pairs = result.pairs
    example_columns = [*CONSUMER, "label", "message_id", "published_at"]
    examples = {
        "lost": [
            _row(r)
            for r in pairs.where(F.col("status") == "lost")
            .select(*example_columns)
            .orderBy("published_at")
            .limit(EXAMPLES)
            .collect()
        ],
        "duplicated": [
            _row(r)
            for r in pairs.where(F.col("acks") > 1)
            .select(*example_columns, "acks")
            .orderBy("published_at")
            .limit(EXAMPLES)
            .collect()
        ],
        "reordered": [_row(r) for r in result.reorderings.orderBy("at").limit(EXAMPLES).collect()],
        "delivered_after_ack": [
            _row(r)
            for r in pairs.where(F.col("delivered_after_ack"))
            .select(*example_columns, "acked_at", "last_delivered_at")
            .limit(EXAMPLES)
            .collect()
        ],
    }

    span = pairs.agg(F.min("published_at"), F.max("published_at")).first()
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
    result = audit(messages, events, window, subscriptions)
    progress("judging every (consumer, message) pair")
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
    parser = argparse.ArgumentParser(prog="shoal pipeline audit", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    doc = run(args)
    return 1 if args.fail_on_findings and not doc["clean"] else 0
