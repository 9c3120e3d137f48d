"""Stats: throughput per topic and hour, per-consumer lag, retry and dead-letter rates.

* **throughput** - archived messages (one per id) per composite topic, MQTT topic and UTC hour
  of publish: messages, payload bytes, distinct publishers.
* **lag** - per consumer (session, shared group, push subscription) at ``as_of`` (the end of
  the data unless given): ``backlog`` is what was routed or delivered to it and is neither
  acked, dead-lettered nor dropped (as the audit counts dropped: also what its consumer, a
  session or a shared group, had not acked when it ended); ``oldest_unacked_ms`` how long
  the oldest of those has waited since its publish; ``delivery_lag_ms`` publish to first
  delivery, p50 and p99.
* **rates** - per consumer: ``retry_rate`` redeliveries per first delivery, ``dlq_rate``
  dead-lettered messages per message delivered or dead-lettered.

The counts it shares with the audit mean what the audit means by them, so both reports agree
on one archive: ``dead_lettered`` is a message whose outcome is the dead-letter queue (not
acked later, as after a redrive; QoS 0 aside), the audit's ``dead_lettered`` status; and each
consumer is named as the audit names it (``label``: a session's client id, a group's share name;
``subscription``: a group's ``$share/...``), beside its id (a digest for sessions and groups).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pipeline.audit import (
    CONSUMER,
    DELIVERIES,
    PAIR,
    consumer_ends,
    consumer_key,
    consumer_names,
    ended_after_publish,
    one_name_each,
    published,
)
from pipeline.columnar import read_events, read_messages
from pipeline.common import (
    Output,
    Progress,
    blank_as_null,
    consumer_rows,
    in_range,
    iso,
    job_parser,
    parse_time,
    spark_session,
    unique_messages,
)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession


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
            & blank_as_null(F.col("message_id")).isNotNull()
        )
        .select(*CONSUMER, "delivery_id", F.col("message_id").alias("_delivered_id"))
        .dropDuplicates([*CONSUMER, "delivery_id"])
    )
    return (
        unique.join(ids, [*CONSUMER, "delivery_id"], "left")
        .withColumn(
            "message_id", F.coalesce(blank_as_null(F.col("message_id")), F.col("_delivered_id"))
        )
        .drop("_delivered_id")
    )


def events_in_range(
    events: DataFrame, archive: DataFrame, since: int | None, until: int | None
) -> DataFrame:
    """Resolved events of the messages published in [since, until); the archive's publish
    time and QoS win over the event's own."""
    from pyspark.sql import functions as F

    joined = (
        events.where(F.col("message_id").isNotNull())
        .join(archive.select("message_id", "archived_at", "message_qos"), "message_id", "left")
        .withColumn("published_at", F.coalesce("archived_at", "published_at"))
        .withColumn("qos", F.coalesce("qos", "message_qos"))
        .drop("archived_at", "message_qos")
    )
    return in_range(joined.where(F.col("published_at").isNotNull()), "published_at", since, until)


def data_end(archive: DataFrame, events: DataFrame) -> int:
    """The latest publish or event time in the input."""
    from pyspark.sql import functions as F

    times = [
        r[0]
        for r in (events.agg(F.max("at")).first(), archive.agg(F.max("archived_at")).first())
        if r is not None and r[0] is not None
    ]
    return int(max(times)) if times else 0


def throughput(
    messages: DataFrame, since: int | None = None, until: int | None = None
) -> DataFrame:
    from pyspark.sql import functions as F

    unique = in_range(unique_messages(messages), "published_at", since, until)
    hour = F.date_format(F.timestamp_millis(F.col("published_at")), "yyyy-MM-dd'T'HH':00Z'").alias(
        "hour"
    )
    return (
        unique.groupBy("composite_topic", "topic", hour)
        .agg(
            F.count(F.lit(1)).alias("messages"),
            F.sum(F.coalesce(F.length(F.unbase64("payload")), F.lit(0))).alias("bytes"),
            F.countDistinct("publisher").alias("publishers"),
        )
        .orderBy("hour", "composite_topic", "topic")
    )


def consumers(events: DataFrame, as_of: int, ends: DataFrame | None = None) -> DataFrame:
    """Lag and rates per consumer, from resolved delivery events and the consumers' ends
    (``consumer_ends``)."""
    from pyspark.sql import functions as F

    def first_at(*kinds: str) -> Any:
        return F.min(F.when(F.col("event").isin(*kinds), F.col("at")))

    per_message = (
        events.where(F.col("message_id").isNotNull())
        .groupBy(*PAIR)
        .agg(
            F.first("published_at", ignorenulls=True).alias("published_at"),
            first_at("delivered").alias("delivered_at"),
            first_at("acked").alias("acked_at"),
            F.count(F.when(F.col("event") == "delivered", 1)).alias("deliveries"),
            F.count(F.when(F.col("event") == "redelivered", 1)).alias("redeliveries"),
            F.max(F.when(F.col("event") == "dead_lettered", 1).otherwise(0)).alias("dead"),
            F.max(F.when(F.col("event") == "dropped", 1).otherwise(0)).alias("dropped"),
            F.min("qos").alias("qos"),
        )
    )
    if ends is not None:
        # the audit's dropped (with_status): an ended session or removed group discarded what
        # it had not acked (MQTT 5 §4.1), so that is no one's backlog; what was published after
        # its last end stays open, as the audit keeps it lost
        per_message = (
            per_message.withColumn("c", consumer_key())
            .join(F.broadcast(ends), "c", "left")
            .withColumn("dropped", F.when(ended_after_publish(), 1).otherwise(F.col("dropped")))
            .drop("c", "ended_at")
        )
    open_ = (
        F.col("acked_at").isNull()
        & (F.col("dead") == 0)
        & (F.col("dropped") == 0)
        & (F.coalesce("qos", F.lit(1)) > 0)
    )
    # the audit's dead_lettered status: acked after all (a redrive) or QoS 0 is not one
    dead_letter = (
        (F.col("dead") == 1) & F.col("acked_at").isNull() & (F.coalesce("qos", F.lit(1)) > 0)
    )
    lag = F.col("delivered_at") - F.col("published_at")
    return (
        per_message.groupBy(*CONSUMER)
        .agg(
            F.count(F.lit(1)).alias("messages"),
            F.sum("deliveries").alias("deliveries"),
            F.sum("redeliveries").alias("redeliveries"),
            F.count(F.when(dead_letter, 1)).alias("dead_lettered"),
            F.count(F.when(open_, 1)).alias("backlog"),
            F.min(F.when(open_, F.col("published_at"))).alias("_oldest"),
            F.percentile(lag, [0.5, 0.99]).alias("_lag"),
            F.count(F.when((F.col("deliveries") > 0) | (F.col("dead") > 0), 1)).alias("_handled"),
        )
        .withColumn("oldest_unacked_ms", F.lit(as_of) - F.col("_oldest"))
        .withColumn("delivery_lag_p50_ms", F.col("_lag")[0])
        .withColumn("delivery_lag_p99_ms", F.col("_lag")[1])
        .withColumn(
            "retry_rate",
            F.when(F.col("deliveries") > 0, F.col("redeliveries") / F.col("deliveries")),
        )
        .withColumn(
            "dlq_rate",
            F.when(F.col("_handled") > 0, F.col("dead_lettered") / F.col("_handled")),
        )
        .drop("_oldest", "_lag", "_handled")
        .orderBy(*CONSUMER)
    )


def stats(
    messages: DataFrame,
    events: DataFrame,
    since: int | None = None,
    until: int | None = None,
    as_of: int | None = None,
) -> dict[str, Any]:
    """stats.json's content (collects: the results are per hour and per consumer)."""
    resolved = resolved_events(events)
    archive = published(messages)
    # publish times (and QoS) come from the archive, as in the audit
    scoped = events_in_range(resolved, archive, since, until)
    end = as_of if as_of is not None else data_end(archive, resolved)
    hourly = [r.asDict() for r in throughput(messages, since, until).collect()]
    per_consumer = [r.asDict() for r in consumers(scoped, end, consumer_ends(events)).collect()]
    names = {
        (r["consumer_kind"], r["consumer"]): r
        for r in one_name_each(consumer_names(consumer_rows(events))).collect()
    }
    for row in per_consumer:
        # named as the audit names it (its ``Name``): the report's reader knows the client id
        name = names.get((row["consumer_kind"], row["consumer"]))
        row["label"] = name["label"] if name is not None else None
        row["subscription"] = name["share"] if name is not None else None
    return {
        "since": since,
        "until": until,
        "as_of": end,
        "as_of_iso": iso(end),
        "totals": {
            "messages": sum(r["messages"] for r in hourly),
            "bytes": sum(r["bytes"] for r in hourly),
            "topics": len({r["topic"] for r in hourly}),
            "consumers": len(per_consumer),
            "backlog": sum(r["backlog"] for r in per_consumer),
            "redeliveries": sum(r["redeliveries"] for r in per_consumer),
            "dead_lettered": sum(r["dead_lettered"] for r in per_consumer),
        },
        "throughput": hourly,
        "consumers": per_consumer,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", required=True, help="archive root: a folder or s3://bucket")
    parser.add_argument("--output", required=True, help="folder (or s3:// prefix) for stats.json")
    parser.add_argument("--since", help="publish time from (ISO 8601 or epoch ms), inclusive")
    parser.add_argument("--until", help="publish time until (ISO 8601 or epoch ms), exclusive")
    parser.add_argument("--as-of", help="measure lag at this time (default: the data's end)")
    parser.add_argument("--quiet", action="store_true")


def run(args: argparse.Namespace, spark: SparkSession | None = None) -> dict[str, Any]:
    progress = Progress("stats", quiet=args.quiet)
    since, until = parse_time(args.since), parse_time(args.until)
    progress("starting Spark")
    spark = spark or spark_session("shoal-stats")
    progress(f"reading {args.input}")
    doc = stats(
        read_messages(spark, args.input, since, until),
        read_events(spark, args.input),
        since,
        until,
        parse_time(args.as_of),
    )
    t = doc["totals"]
    progress(
        f"{t['messages']} messages on {t['topics']} topics, {t['consumers']} consumers, "
        f"backlog {t['backlog']}, {t['redeliveries']} redeliveries, "
        f"{t['dead_lettered']} dead-lettered"
    )
    path = Output(args.output, spark).write("stats.json", json.dumps(doc, indent=2).encode())
    progress(f"wrote {path}")
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    parser = job_parser("stats")
    add_arguments(parser)
    run(parser.parse_args(argv))
    return 0
