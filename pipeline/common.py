"""What every job shares: the archive's schemas and readers, the Spark session, outputs, time.

The archive (``shoal.router.archive``, ``shoal.delivery.events``) is JSON lines under one root, a
folder locally (``shoal pipeline sync``) or ``s3://bucket`` deployed::

    messages/topic=<composite>/date=<YYYY-MM-DD>/hour=<HH>/<stream>.<shard>.<first>-<last>.jsonl
    events/date=<YYYY-MM-DD>/hour=<HH>/<digest>.jsonl

Partition discovery is off: the folder name ``topic=`` is the composite topic while each line's
``topic`` is the MQTT topic name, and Spark would let the folder's value win. Schemas are given,
never inferred (no extra pass over the data, and an empty archive still has columns).
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

MESSAGES = "messages"
EVENTS = "events"
#: Kinesis sequence numbers are decimal strings of up to 128 digits: padded, they sort as numbers
SEQUENCE_WIDTH = 128

_HOUR_DIR = re.compile(r"date=(\d{4}-\d{2}-\d{2})/hour=(\d{2})$")


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
            T.StructField("seq", T.IntegerType()),
            T.StructField("batch", T.StringType()),
        ]
    )


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


def spark_session(app_name: str = "shoal-pipeline", master: str | None = None) -> SparkSession:
    """The job's session: local[2] on this machine, whatever spark-submit says on a cluster."""
    from pyspark.sql import SparkSession

    # the workers must run this interpreter (with shoal installed), not whatever "python" is
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.appName(app_name).config("spark.sql.session.timeZone", "UTC")
    # spark-submit (EMR) starts the JVM first and tells Python its port: then the cluster's
    # master and settings stand
    if "PYSPARK_GATEWAY_PORT" not in os.environ:
        builder = (
            builder.master(master or "local[2]")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.shuffle.partitions", "8")
            .config("spark.driver.memory", os.environ.get("SHOAL_SPARK_DRIVER_MEMORY", "2g"))
        )
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


# -- reading --------------------------------------------------------------------------------------


def is_uri(location: str) -> bool:
    return "://" in location


def _join(root: str, *parts: str) -> str:
    return "/".join([root.rstrip("/"), *parts])


def _hour_dirs(folder: Path, since: int | None, until: int | None) -> list[str] | None:
    """The ``date=/hour=`` folders under ``folder`` that can hold times in [since, until);
    None when every folder can (no bounds)."""
    if since is None and until is None:
        return None
    low = since - since % 3_600_000 if since is not None else None
    kept: list[str] = []
    for path in folder.rglob("hour=*"):
        match = _HOUR_DIR.search(path.as_posix())
        if match is None or not path.is_dir():
            continue
        start = int(
            datetime.strptime(f"{match[1]} {match[2]}", "%Y-%m-%d %H")
            .replace(tzinfo=UTC)
            .timestamp()
            * 1000
        )
        if (low is None or start >= low) and (until is None or start < until):
            kept.append(str(path))
    return kept


def _read_json(
    spark: SparkSession, schema: Any, location: str, paths: Sequence[str] | None
) -> DataFrame:
    empty = spark.createDataFrame([], schema)
    if not is_uri(location) and not Path(location).is_dir():
        return empty
    targets = [location] if paths is None else list(paths)
    if not targets:
        return empty
    return (
        spark.read.schema(schema)
        .option("recursiveFileLookup", "true")
        .option("pathGlobFilter", "*.jsonl")
        .json(targets)
    )


def read_messages(
    spark: SparkSession, root: str, since: int | None = None, until: int | None = None
) -> DataFrame:
    """The archived messages under ``root`` (local folders outside [since, until) unread)."""
    from pyspark.sql import functions as F

    location = _join(root, MESSAGES)
    paths = None if is_uri(location) else _hour_dirs(Path(location), since, until)
    frame = _read_json(spark, message_schema(), location, paths)
    return frame.where(F.col("message_id").isNotNull())


def read_events(spark: SparkSession, root: str) -> DataFrame:
    """Every delivery event under ``root``: events of a message come at any time after its
    publish, so no time range prunes them."""
    from pyspark.sql import functions as F

    frame = _read_json(spark, event_schema(), _join(root, EVENTS), None)
    return frame.where(F.col("event").isNotNull() & F.col("consumer").isNotNull())


def read_subscriptions(spark: SparkSession, location: str | None) -> DataFrame | None:
    if not location:
        return None
    return spark.read.schema(subscription_schema()).json(location)


def with_sequence_key(messages: DataFrame) -> DataFrame:
    from pyspark.sql import functions as F

    return messages.withColumn(
        "seq_key", F.lpad(F.coalesce(F.col("sequence_number"), F.lit("")), SEQUENCE_WIDTH, "0")
    )


def unique_messages(messages: DataFrame) -> DataFrame:
    """One row per message id: a bisected batch can archive a message twice under two names;
    the copy earliest in its stream wins."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    keyed = with_sequence_key(messages)
    first = Window.partitionBy("message_id").orderBy("storage_topic", "seq_key", "position")
    return keyed.withColumn("_n", F.row_number().over(first)).where("_n = 1").drop("_n")


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
