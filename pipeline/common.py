"""What every job shares: the archive's schemas and readers, the Spark session, outputs, time.

The archive (``shoal.router.archive``, ``shoal.delivery.archiver``) is JSON lines under one
root, a folder locally (``shoal pipeline sync``) or ``s3://bucket`` deployed::

    messages/topic=<composite>/date=<YYYY-MM-DD>/hour=<HH>/<stream>.<shard>.<first>-<last>.jsonl
    events/date=<YYYY-MM-DD>/hour=<HH>/<log stream>.<shard>.<first>-<last>.jsonl

(the jobs read every ``*.jsonl`` of an hour: object names carry no meaning for them)

``shoal pipeline compact`` copies them into Parquet under ``parquet/`` (``pipeline.columnar``);
the readers take Parquet where an hour is compacted and JSON lines for the rest. Partition
discovery is off: the folder name ``topic=`` is the composite topic while each line's ``topic``
is the MQTT topic name, and Spark would let the folder's value win. Schemas are given, never
inferred (no extra pass over the data, and an empty archive still has columns).

This code runs on the EMR release's Python (3.9): ``from __future__ import annotations`` keeps
annotations unevaluated, and nothing 3.10+ runs (ruff's per-file target keeps it so).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

# EMR's Python is 3.9: no ``datetime.UTC`` (3.11), no 3.10+ syntax at run time
UTC = timezone.utc

MESSAGES = "messages"
EVENTS = "events"


#: what each job's ``--help`` says, in the words of someone who runs it (the module docstrings
#: are for the people who change the jobs)
DESCRIPTIONS = {
    "audit": (
        "Check that every archived message reached each of its subscribers exactly once and in "
        "order, and report losses, duplicates and reorders."
    ),
    "compact": (
        "Turn the archive's JSON lines into Parquet files, one folder per date and hour. The "
        "other jobs read both, so it can run at any time, and again: an hour it already covers "
        "is skipped."
    ),
    "replay": (
        "Deliver archived messages that match a topic filter and a time range to a session again."
    ),
    "stats": (
        "Count messages per topic and hour, and report each subscriber's backlog, lag and retry "
        "rates."
    ),
    "sync": (
        "Copy shoal dev's archive (messages and delivery events) out of its emulator into a local "
        "folder, for the other jobs to read."
    ),
}


def job_parser(job: str) -> argparse.ArgumentParser:
    """The argument parser of ``shoal pipeline <job>``."""
    return argparse.ArgumentParser(
        prog=f"shoal pipeline {job}",
        description=DESCRIPTIONS[job],
        epilog="What each job reads, writes and reports: docs/pipeline.md.",
    )


def message_schema() -> Any:
    from pyspark.sql import types as T

    return T.StructType(
        [
            T.StructField("message_id", T.StringType()),
            T.StructField("topic", T.StringType()),
            T.StructField("composite_topic", T.StringType()),
            T.StructField("storage_topic", T.IntegerType()),
            T.StructField("stream", T.StringType()),
            T.StructField("shard_id", T.StringType()),
            T.StructField("sequence_number", T.StringType()),
            T.StructField("position", T.IntegerType()),
            T.StructField("published_at", T.LongType()),
            T.StructField("arrival_ms", T.LongType()),
            T.StructField("qos", T.IntegerType()),
            T.StructField("retain", T.BooleanType()),
            T.StructField("ordering_key", T.StringType()),
            # null in archives written before the flag: counted as keyed
            T.StructField("keyed", T.BooleanType()),
            T.StructField("publisher", T.StringType()),
            T.StructField("publisher_id", T.StringType()),
            T.StructField("publisher_seq", T.LongType()),
            T.StructField("properties", T.MapType(T.StringType(), T.StringType())),
            T.StructField("payload", T.StringType()),
        ]
    )


def event_schema() -> Any:
    from pyspark.sql import types as T

    return T.StructType(
        [
            T.StructField("event", T.StringType()),
            T.StructField("consumer_kind", T.StringType()),
            T.StructField("consumer", T.StringType()),
            T.StructField("message_id", T.StringType()),
            T.StructField("at", T.LongType()),
            T.StructField("delivery_id", T.StringType()),
            T.StructField("topic", T.StringType()),
            T.StructField("ordering_key", T.StringType()),
            T.StructField("published_at", T.LongType()),
            T.StructField("qos", T.IntegerType()),
            T.StructField("attempt", T.IntegerType()),
            T.StructField("subscription", T.StringType()),
            T.StructField("reason", T.StringType()),
            T.StructField("label", T.StringType()),
            # true on a retained message sent because of a new subscription (MQTT 5
            # §3.3.1.3): a delivery of its own kind, not a second copy of the publish
            T.StructField("retain", T.BooleanType()),
            T.StructField("seq", T.IntegerType()),
            T.StructField("batch", T.StringType()),
        ]
    )


#: what names a consumer in the report (``consumer_rows``)
NAME_COLUMNS = ("consumer_kind", "consumer", "label", "subscription")


def name_schema() -> Any:
    """``consumer_rows``' rows, as ``compact`` writes them beside an hour's events."""
    from pyspark.sql import types as T

    return T.StructType([T.StructField(c, T.StringType()) for c in NAME_COLUMNS])


def subscription_schema() -> Any:
    """Subscriptions as the audit can take them (``--subscriptions FILE``): which consumer held
    which filter from when until when. ``until`` null: still held."""
    from pyspark.sql import types as T

    return T.StructType(
        [
            T.StructField("consumer_kind", T.StringType()),
            T.StructField("consumer", T.StringType()),
            T.StructField("filter", T.StringType()),
            T.StructField("qos", T.IntegerType()),
            T.StructField("since", T.LongType()),
            T.StructField("until", T.LongType()),
        ]
    )


# -- the session --------------------------------------------------------------------------------

#: the JVM options of every job's driver and executors, here and on EMR (the stack passes them
#: in its spark-submit parameters), both measured on a first audit at 5M events
#: (docs/pipeline.md, "Engine fidelity"):
#: - the throughput collector, which EMR's own Spark defaults also set
#:   (``spark.driver.defaultJavaOptions``): the jobs are batches that care for throughput, not
#:   pauses; G1's write barriers and concurrent threads cost about 10% of the time;
#: - a smaller inlining budget for C2's hot methods (325 bytes of bytecode by default): a first
#:   audit spends about 40% of its CPU in the JIT, compiling Spark, Janino and the code Spark
#:   generates for each query; at 100 the compiler threads took 15 s of CPU instead of 21, the
#:   tasks no more, a warm audit no more either (at 50 or 70 the tasks slowed)
JVM_OPTIONS = "-XX:+UseParallelGC -XX:FreqInlineSize=100"

#: On this machine only (the JVM started here, not EMR's): the heap in transparent huge pages,
#: where the kernel grants them on request (``madvise``, Debian's default). A VM whose page walks
#: are slow (CI's: a random read over a 128 MB array took 215 us in 4 KB pages, 8.5 us in 2 MB
#: ones) spent most of a collection of the heap in them. Where huge pages are off, the JVM says
#: so once and goes on.
LOCAL_JVM_OPTIONS = "-XX:+UseTransparentHugePages"


def submit_parameters(py_files: str) -> str:
    """spark-submit's parameters for a job run on EMR: the jobs' code and ``JVM_OPTIONS``."""
    return " ".join(
        [
            f"--conf spark.submit.pyFiles={py_files}",
            f"--conf spark.driver.extraJavaOptions={JVM_OPTIONS}",
            f"--conf spark.executor.extraJavaOptions={JVM_OPTIONS}",
        ]
    )


def spark_session(app_name: str = "shoal-pipeline", master: str | None = None) -> SparkSession:
    """The job's session: local[2] on this machine, whatever spark-submit says on a cluster."""
    from pyspark.sql import SparkSession

    # the workers must run this interpreter (with shoal installed), not whatever "python" is
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = (
        SparkSession.builder.appName(app_name)
        .config("spark.sql.session.timeZone", "UTC")
        # the jobs cache a frame they read a few times right after (the audit's pairs): the
        # column compression of the cache cost more CPU than the rest of the audit's last
        # stage (1.6 s of 2.4 s per million events), and the frame lives for seconds
        .config("spark.sql.inMemoryColumnarStorage.compressed", "false")
        # a filter on row_number (the archive's dedupe: a message's earliest copy) would add a
        # sort of every row before the shuffle, to keep the first row of each message early:
        # copies are rare, so it shuffles as many rows, and the sort after it is needed anyway
        .config("spark.sql.optimizer.windowGroupLimitThreshold", "-1")
    )
    # spark-submit (EMR) starts the JVM first and tells Python its port: then the cluster's
    # master and settings stand
    if "PYSPARK_GATEWAY_PORT" not in os.environ:
        # log4j at WARN from the JVM's first line (setLogLevel comes too late for start-up's
        # chatter), and no guessing of the host's address
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        log4j = Path(__file__).resolve().parent / "log4j2.properties"
        builder = (
            builder.master(master or "local[2]")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            # a few tasks per core: the default 200 shuffle partitions cost more in task
            # overhead than they save at this size, and adaptive execution merges small ones
            .config("spark.sql.shuffle.partitions", os.environ.get("SHOAL_SPARK_PARTITIONS", "8"))
            .config("spark.driver.memory", os.environ.get("SHOAL_SPARK_DRIVER_MEMORY", "2g"))
            .config(
                "spark.driver.extraJavaOptions",
                f"{JVM_OPTIONS} {LOCAL_JVM_OPTIONS} -Dlog4j2.configurationFile={log4j.as_uri()}",
            )
        )
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(os.environ.get("SHOAL_SPARK_LOG_LEVEL", "ERROR"))
    return spark


# -- reading --------------------------------------------------------------------------------------


def is_uri(location: str) -> bool:
    return "://" in location


def _join(root: str, *parts: str) -> str:
    return "/".join([root.rstrip("/"), *parts])


def delivery_events(frame: DataFrame) -> DataFrame:
    """The rows of an events frame that are delivery events (an event, of a consumer)."""
    from pyspark.sql import functions as F

    return frame.where(F.col("event").isNotNull() & F.col("consumer").isNotNull())


def consumer_rows(events: DataFrame, *by: str) -> DataFrame:
    """What names the consumers of ``events`` (``NAME_COLUMNS``): a distinct of a few rows per
    consumer (per ``by``), which the audit reduces to one name each. Session acks are left
    out: they name no label, subscription or message (a session's ack names only its delivery
    id), and a consumer whose pairs the report lists has another event (the delivery it acks,
    or a push ack naming its message): a third fewer rows."""
    from pyspark.sql import functions as F

    carries = (F.col("event") != "acked") | blank_as_null(F.col("message_id")).isNotNull()
    return events.where(carries).select(*by, *NAME_COLUMNS).distinct()


def read_subscriptions(spark: SparkSession, location: str | None) -> DataFrame | None:
    if not location:
        return None
    return spark.read.schema(subscription_schema()).json(location)


def blank_as_null(column: Column) -> Column:
    """``nullif(column, '')``; Spark 3.5's ``functions.nullif`` fails on an unresolved column."""
    from pyspark.sql import functions as F

    return F.when(column != "", column)


def sequence_order(column: str = "sequence_number") -> list[Column]:
    """Sort keys that order Kinesis sequence numbers (decimal strings without leading zeros,
    56 digits on AWS, small counters on the emulator) as numbers, at any length: their length,
    then their digits, which compare bytewise as the numbers do when the lengths are equal. No
    parsing (four 18-digit chunks cast to longs before: with a string the audit no longer builds
    per routed event, 3.5% of a first audit's CPU at 5M), no 128-character left-padded string,
    no 38-digit decimals (Java BigDecimals in Spark)."""
    from pyspark.sql import functions as F

    digits = F.coalesce(F.col(column), F.lit(""))
    return [F.length(digits).alias("_seq_len"), digits.alias("_seq")]


SEQUENCE_KEYS = ["_seq_len", "_seq"]


def unique_messages(messages: DataFrame) -> DataFrame:
    """One row per message id: a bisected batch can archive a message twice under two names;
    the copy earliest in its stream wins. One hash aggregate (the minimum of a struct that
    leads with the stream order), not a window: no sort of every row."""
    from pyspark.sql import functions as F

    order = ["storage_topic", *SEQUENCE_KEYS, "position"]
    sequence = sequence_order()
    rest = [c for c in messages.columns if c != "message_id"]
    keyed = messages.select("message_id", *rest, *sequence)
    kept = [*rest, *SEQUENCE_KEYS]
    first = F.min_by(F.struct(*kept), F.struct(*order)).alias("_first")
    return keyed.groupBy("message_id").agg(first).select("message_id", "_first.*")


def in_range(frame: DataFrame, column: str, since: int | None, until: int | None) -> DataFrame:
    from pyspark.sql import functions as F

    if since is not None:
        frame = frame.where(F.col(column) >= since)
    if until is not None:
        frame = frame.where(F.col(column) < until)
    return frame


def matching_topics(topics: Iterable[str], topic_filter: str) -> list[str]:
    """The topic names a filter matches, by ``shoal.topics.matches`` itself: the distinct
    topics of an archive are few next to its messages, so the driver checks each once rather
    than a Python UDF checking every row."""
    from shoal.topics.filters import matches, parse_shared

    shared = parse_shared(topic_filter) if topic_filter.startswith("$share/") else None
    inner = shared[1] if shared else topic_filter
    return sorted(t for t in topics if matches(inner, t))


# -- time -----------------------------------------------------------------------------------------


def parse_time(text: str | None) -> int | None:
    """Milliseconds since the epoch from ``1700000000000``, ``2026-11-21`` or an ISO 8601 time
    (UTC unless it says otherwise)."""
    if text is None or text == "":
        return None
    if text.isdigit():
        return int(text)
    moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return int(moment.timestamp() * 1000)


def iso(ms: int | None) -> str | None:
    if ms is None:
        return None
    return (datetime(1970, 1, 1, tzinfo=UTC) + timedelta(milliseconds=ms)).isoformat(
        timespec="milliseconds"
    )


# -- output ---------------------------------------------------------------------------------------


class Output:
    """Where a job writes its files: a local folder, or a URI through Hadoop's file system
    (``s3://`` on EMR, where boto3 may be missing but Spark's S3 connector is there)."""

    def __init__(self, location: str, spark: SparkSession | None = None) -> None:
        self.location = location
        self.spark = spark
        if not is_uri(location):
            Path(location).mkdir(parents=True, exist_ok=True)

    def path(self, name: str) -> str:
        return _join(self.location, name)

    def write(self, name: str, data: bytes) -> str:
        target = self.path(name)
        if not is_uri(self.location):
            Path(target).write_bytes(data)
            return target
        if self.spark is None:
            raise ValueError(f"writing to {self.location} needs the Spark session")
        jvm: Any = self.spark.sparkContext._jvm
        hadoop_path = jvm.org.apache.hadoop.fs.Path(target)
        fs = hadoop_path.getFileSystem(self.spark.sparkContext._jsc.hadoopConfiguration())
        stream = fs.create(hadoop_path, True)
        try:
            stream.write(bytearray(data))
        finally:
            stream.close()
        return target


class Progress:
    """One line per step on stderr, with the time since the job started."""

    def __init__(self, job: str, quiet: bool = False) -> None:
        self.job = job
        self.quiet = quiet
        self.started = time.monotonic()

    def __call__(self, message: str) -> None:
        if not self.quiet:
            elapsed = time.monotonic() - self.started
            print(f"[{elapsed:6.1f}s] {self.job}: {message}", file=sys.stderr, flush=True)
