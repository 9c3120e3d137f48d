"""The columnar archive: Parquet copies of the JSON lines, and the readers that merge both.

``shoal pipeline compact`` turns the archive's JSON lines into Parquet, one folder per source
hour, partitioned by date and hour::

    parquet/messages/date=<YYYY-MM-DD>/hour=<HH>/part-....parquet   (every composite topic)
    parquet/messages/date=<YYYY-MM-DD>/hour=<HH>/_manifest.json
    parquet/events/date=<YYYY-MM-DD>/hour=<HH>/part-....parquet
    parquet/events/date=<YYYY-MM-DD>/hour=<HH>/_manifest.json
    parquet/names/date=<YYYY-MM-DD>/hour=<HH>/part-....parquet      (the events' consumer names)

The manifest says which JSON objects (key and size) the hour's Parquet files hold, and which
Parquet files those are. It is written last, in one put (an S3 PUT and a local rename are
atomic), so a reader sees either the old manifest or the new one, never a half-written hour:
Parquet files no manifest names (a compaction that died, or one superseded) are never read.
An events manifest also names the hour's consumer names (``common.consumer_rows``: a few rows
per consumer), written from the hour's new Parquet: the audit reads them instead of the events'
four name columns (about 9% of a first audit at 5M events), and takes names from the events
themselves for JSON lines no manifest covers and for hours compacted before names were written.
A reader takes, per hour, the manifest's Parquet files plus every JSON object the manifest
does not name (arrived after the compaction, or rewritten since with another size): nothing is
lost and nothing is read twice. Compacting an hour whose manifest already covers its objects
does nothing; an hour with new objects is compacted again from all of them, so compacting
twice gives the same data.

Storage is a local folder, or any URI Hadoop's file system reads (``s3://`` on EMR,
``file://`` in tests), through the JVM Spark already runs: the job needs no boto3.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.common import (
    EVENTS,
    MESSAGES,
    UTC,
    consumer_rows,
    delivery_events,
    event_schema,
    is_uri,
    message_schema,
    name_schema,
)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

PARQUET = "parquet"
#: the events' consumer names, per hour (``parquet/names/``)
NAMES = "names"
MANIFEST = "_manifest.json"
#: rows per Parquet file: ~50 MB of events at this schema, big enough for S3 and small enough
#: that one hour spreads over executors
ROWS_PER_FILE = 4_000_000
#: Parquet row groups of 8 MB (not 128): a reader splits a file by row groups, so even one
#: hour's file feeds every core (a 13 MB file of 1M events reads as two tasks, not one)
ROW_GROUP_BYTES = 8 * 2**20
_HOUR = re.compile(r"(?:^|/)date=(\d{4}-\d{2}-\d{2})/hour=(\d{2})/[^/]+$")

Hour = tuple[str, str]


# -- storage --------------------------------------------------------------------------------------


class Store:
    """Files under the archive root, by key relative to it: a local folder or a Hadoop URI."""

    def __init__(self, root: str, spark: SparkSession | None = None) -> None:
        self.root = root.rstrip("/")
        self.spark = spark
        self._fs: Any = None
        if is_uri(root):
            if spark is None:
                raise ValueError(f"reading {root} needs the Spark session")
            jvm: Any = spark.sparkContext._jvm
            conf = spark.sparkContext._jsc.hadoopConfiguration()
            self._jvm = jvm
            self._fs = jvm.org.apache.hadoop.fs.Path(self.root + "/").getFileSystem(conf)

    def uri(self, key: str) -> str:
        return f"{self.root}/{key}"

    def _path(self, key: str) -> Any:
        return self._jvm.org.apache.hadoop.fs.Path(self.uri(key))

    def list(self, prefix: str) -> dict[str, int]:
        """key -> size of every file under ``prefix``."""
        found: dict[str, int] = {}
        if self._fs is None:
            base = Path(self.root)
            folder = base / prefix
            if folder.is_dir():
                for path in folder.rglob("*"):
                    if path.is_file():
                        found[path.relative_to(base).as_posix()] = path.stat().st_size
            return found
        path = self._path(prefix)
        if not self._fs.exists(path):
            return found
        files = self._fs.listFiles(path, True)
        root = str(self._fs.makeQualified(self._path("")).toString()).rstrip("/") + "/"
        while files.hasNext():
            status = files.next()
            name = str(status.getPath().toString())
            if name.startswith(root):
                found[name[len(root) :]] = int(status.getLen())
        return found

    def read_text(self, key: str) -> str | None:
        if self._fs is None:
            path = Path(self.root) / key
            return path.read_text() if path.is_file() else None
        path = self._path(key)
        if not self._fs.exists(path):
            return None
        stream = self._fs.open(path)
        try:
            reader = self._jvm.java.io.BufferedReader(
                self._jvm.java.io.InputStreamReader(stream, "UTF-8")
            )
            lines = []
            line = reader.readLine()
            while line is not None:
                lines.append(str(line))
                line = reader.readLine()
            return "\n".join(lines)
        finally:
            stream.close()

    def write_text(self, key: str, text: str) -> None:
        """One atomic write: a local rename, or one object PUT (a Hadoop create that S3 makes
        visible whole on close)."""
        if self._fs is None:
            path = Path(self.root) / key
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(path.name + ".part")
            partial.write_text(text)
            partial.replace(path)
            return
        stream = self._fs.create(self._path(key), True)
        try:
            stream.write(bytearray(text.encode()))
        finally:
            stream.close()

    def delete(self, key: str) -> None:
        if self._fs is None:
            (Path(self.root) / key).unlink(missing_ok=True)
        else:
            self._fs.delete(self._path(key), False)


# -- what to read ---------------------------------------------------------------------------------


def hour_of(key: str) -> Hour | None:
    match = _HOUR.search(key)
    return (match[1], match[2]) if match else None


def hour_start_ms(hour: Hour) -> int:
    moment = datetime.strptime(f"{hour[0]} {hour[1]}", "%Y-%m-%d %H").replace(tzinfo=UTC)
    return int(moment.timestamp() * 1000)


def hour_folder(kind: str, hour: Hour) -> str:
    return f"{PARQUET}/{kind}/date={hour[0]}/hour={hour[1]}"


@dataclass
class Manifest:
    #: JSON object key -> its size when compacted
    sources: dict[str, int] = field(default_factory=dict)
    #: the Parquet files (keys) holding exactly those objects' lines
    files: list[str] = field(default_factory=list)
    #: events only: the Parquet files of those lines' consumer names (None: a manifest from
    #: before names were written, whose readers take the names from the events)
    names: list[str] | None = None

    @classmethod
    def parse(cls, text: str | None) -> Manifest | None:
        if not text:
            return None
        doc = json.loads(text)
        names = doc.get("names")
        return cls(
            sources=dict(doc["sources"]),
            files=list(doc["files"]),
            names=None if names is None else list(names),
        )

    def dump(self) -> str:
        doc: dict[str, Any] = {"sources": self.sources, "files": self.files}
        if self.names is not None:
            doc["names"] = self.names
        return json.dumps(doc, indent=0, sort_keys=True)

    def covers(self, key: str, size: int) -> bool:
        return self.sources.get(key) == size


@dataclass
class Plan:
    """One kind's inputs: Parquet files and the JSON objects no manifest covers, by hour."""

    kind: str
    parquet: dict[Hour, list[str]] = field(default_factory=dict)
    json: dict[Hour, dict[str, int]] = field(default_factory=dict)
    manifests: dict[Hour, Manifest] = field(default_factory=dict)
    #: every JSON object of the hour, covered or not (what a compaction of it reads)
    sources: dict[Hour, dict[str, int]] = field(default_factory=dict)

    def parquet_keys(self) -> list[str]:
        return [k for hour in sorted(self.parquet) for k in self.parquet[hour]]

    def json_keys(self) -> list[str]:
        return [k for hour in sorted(self.json) for k in sorted(self.json[hour])]


def _wanted(hour: Hour, since: int | None, until: int | None) -> bool:
    start = hour_start_ms(hour)
    low = None if since is None else since - since % 3_600_000
    return (low is None or start >= low) and (until is None or start < until)


def plan(store: Store, kind: str, since: int | None = None, until: int | None = None) -> Plan:
    """What a reader of ``kind`` (messages or events) reads for hours that can hold times in
    [since, until): per hour, the manifest's Parquet files and the JSON objects it does not
    cover."""
    result = Plan(kind)
    for key, size in store.list(kind + "/").items():
        if not key.endswith(".jsonl"):
            continue
        hour = hour_of(key)
        if hour is None or not _wanted(hour, since, until):
            continue
        result.sources.setdefault(hour, {})[key] = size
    manifests: dict[Hour, Manifest] = {}
    for key in store.list(f"{PARQUET}/{kind}/"):
        if key.endswith("/" + MANIFEST):
            hour = hour_of(key)
            if hour is not None and _wanted(hour, since, until):
                found = Manifest.parse(store.read_text(key))
                if found is not None:
                    manifests[hour] = found
    result.manifests = manifests
    for hour, found in manifests.items():
        result.parquet[hour] = list(found.files)
    for hour, objects in result.sources.items():
        held = manifests.get(hour)
        pending = {k: s for k, s in objects.items() if held is None or not held.covers(k, s)}
        if pending:
            result.json[hour] = pending
    return result


def read(
    spark: SparkSession,
    root: str,
    kind: str,
    since: int | None = None,
    until: int | None = None,
) -> DataFrame:
    """``kind``'s rows under ``root``: Parquet where compacted, JSON lines for the rest."""
    store = Store(root, spark)
    chosen = plan(store, kind, since, until)
    return _rows(spark, store, chosen, _json(spark, store, _schema(kind), chosen.json_keys()))


def read_messages(
    spark: SparkSession, root: str, since: int | None = None, until: int | None = None
) -> DataFrame:
    """The archived messages under ``root``: Parquet where compacted, JSON lines for the rest;
    hours outside [since, until) unread."""
    from pyspark.sql import functions as F

    frame = read(spark, root, MESSAGES, since, until)
    return frame.where(F.col("message_id").isNotNull())


def read_events(spark: SparkSession, root: str) -> DataFrame:
    """Every delivery event under ``root``: events of a message come at any time after its
    publish, so no time range prunes them."""
    return delivery_events(read(spark, root, EVENTS))


def read_names(spark: SparkSession, root: str) -> DataFrame:
    """``consumer_rows`` of every event under ``root``: from the names ``compact`` wrote beside
    an hour's events, and from the events themselves where it did not."""
    return read_events_and_names(spark, root)[1]


def read_events_and_names(spark: SparkSession, root: str) -> tuple[DataFrame, DataFrame]:
    """``read_events`` and ``read_names`` from one listing of the archive and one read of each
    manifest (on S3 a GET each, one after another). The names: ``consumer_rows`` from the names
    files of the hours whose manifest names them, and from the events of the rest (Parquet of
    older manifests, JSON lines no manifest covers). A consumer named by both shows twice: the
    audit reduces its rows to one name each."""
    store = Store(root, spark)
    chosen = plan(store, EVENTS)
    schema = event_schema()
    pending = _json(spark, store, schema, chosen.json_keys())
    named = [k for hour in sorted(chosen.manifests) for k in chosen.manifests[hour].names or []]
    unnamed = [
        k
        for hour in sorted(chosen.manifests)
        if chosen.manifests[hour].names is None
        for k in chosen.manifests[hour].files
    ]
    from_events = _union(spark, schema, [_parquet(spark, store, schema, unnamed), pending])
    names = _union(
        spark,
        name_schema(),
        [
            _parquet(spark, store, name_schema(), named),
            consumer_rows(delivery_events(from_events)),
        ],
    )
    return delivery_events(_rows(spark, store, chosen, pending)), names


def _rows(spark: SparkSession, store: Store, chosen: Plan, pending: DataFrame | None) -> DataFrame:
    """The plan's rows: its Parquet files, and ``pending`` (its JSON lines)."""
    schema = _schema(chosen.kind)
    return _union(spark, schema, [_parquet(spark, store, schema, chosen.parquet_keys()), pending])


def _schema(kind: str) -> Any:
    return message_schema() if kind == MESSAGES else event_schema()


def _files(
    spark: SparkSession, store: Store, schema: Any, keys: list[str], source: str
) -> DataFrame | None:
    """These files (``source``: "parquet" or "json") read with ``schema``; None for none."""
    if not keys:
        return None
    return (
        spark.read.schema(schema)
        # file paths, and no partition discovery: no date=/hour= columns, and a JSON line's own
        # topic (the MQTT one) is kept, not replaced by its folder's topic= (the composite one)
        .option("recursiveFileLookup", "true")
        .format(source)
        .load([store.uri(k) for k in keys])
    )


def _parquet(spark: SparkSession, store: Store, schema: Any, keys: list[str]) -> DataFrame | None:
    return _files(spark, store, schema, keys, "parquet")


def _json(spark: SparkSession, store: Store, schema: Any, keys: list[str]) -> DataFrame | None:
    return _files(spark, store, schema, keys, "json")


def _union(spark: SparkSession, schema: Any, frames: list[DataFrame | None]) -> DataFrame:
    present = [f for f in frames if f is not None]
    if not present:
        return _empty(spark, schema)
    frame = present[0]
    for other in present[1:]:
        frame = frame.unionByName(other)
    return frame


def _empty(spark: SparkSession, schema: Any) -> DataFrame:
    """No rows of ``schema``, as a relation the optimizer knows is empty: a filter that is
    always false becomes an empty local relation, which a union drops from the plan.
    ``createDataFrame([], schema)`` took 1.3 s in a fresh JVM (a Python RDD sent to it), and its
    scan stayed in every plan that read it (the audit's names, at 5M events)."""
    columns = ", ".join(
        f"CAST(NULL AS {f.dataType.simpleString()}) AS `{f.name}`" for f in schema.fields
    )
    return spark.sql(f"SELECT {columns} WHERE false")


# -- compaction -----------------------------------------------------------------------------------


@dataclass
class Compacted:
    kind: str
    hours: int = 0
    skipped: int = 0
    objects: int = 0
    files: int = 0
    #: events hours compacted before names were written, given their names
    named: int = 0


def compact(
    spark: SparkSession,
    root: str,
    *,
    kinds: Sequence[str] = (MESSAGES, EVENTS),
    since: int | None = None,
    until: int | None = None,
    rows_per_file: int = ROWS_PER_FILE,
    progress: Any = None,
) -> list[Compacted]:
    """Compact every hour of ``kinds`` whose manifest does not cover all its JSON objects."""
    store = Store(root, spark)
    return [
        _compact_kind(
            spark, store, kind, window=(since, until), per_file=rows_per_file, progress=progress
        )
        for kind in kinds
    ]


def _compact_kind(
    spark: SparkSession,
    store: Store,
    kind: str,
    *,
    window: tuple[int | None, int | None],
    per_file: int,
    progress: Any,
) -> Compacted:
    result = Compacted(kind)
    chosen = plan(store, kind, *window)
    stale = sorted(h for h in chosen.sources if h in chosen.json)
    result.skipped = len(chosen.sources) - len(stale)
    if kind == EVENTS:
        result.named = _name_hours(spark, store, chosen, stale)
    if not stale:
        return result
    schema = _schema(kind)
    keys = [k for hour in stale for k in sorted(chosen.sources[hour])]
    if progress:
        progress(f"{kind}: {len(stale)} hours, {len(keys)} objects to compact")
    source = _json(spark, store, schema, keys)
    assert source is not None  # stale hours have JSON objects: that is what makes them stale
    rows = with_hour(source)
    written = _write(store, rows, kind, per_file=per_file)
    names = _write_names(spark, store, written) if kind == EVENTS else None
    for hour in stale:
        folder = hour_folder(kind, hour) + "/"
        files = _of_hour(written, kind, hour)
        old = chosen.manifests.get(hour)
        manifest = Manifest(
            sources=dict(chosen.sources[hour]),
            files=files,
            names=None if names is None else _of_hour(names, NAMES, hour),
        )
        store.write_text(folder + MANIFEST, manifest.dump())
        # the superseded files: no manifest names them any more
        superseded = [*old.files, *(old.names or [])] if old is not None else []
        for key in superseded:
            if key not in files and key not in (manifest.names or []):
                store.delete(key)
        result.hours += 1
        result.objects += len(manifest.sources)
        result.files += len(files)
    return result


def _name_hours(spark: SparkSession, store: Store, chosen: Plan, stale: list[Hour]) -> int:
    """Names for the events hours a compaction from before names covered (and that this one
    does not compact again): from their Parquet, the manifest rewritten with them last."""
    unnamed = sorted(h for h, m in chosen.manifests.items() if m.names is None and h not in stale)
    if not unnamed:
        return 0
    names = _write_names(
        spark, store, [k for hour in unnamed for k in chosen.manifests[hour].files]
    )
    for hour in unnamed:
        manifest = replace(chosen.manifests[hour], names=_of_hour(names, NAMES, hour))
        store.write_text(hour_folder(EVENTS, hour) + "/" + MANIFEST, manifest.dump())
    return len(unnamed)


def with_hour(rows: DataFrame) -> DataFrame:
    """``rows`` with the date and hour of the folder each was read from: the source object's
    folder (the router's and the recorder's choice), so an hour's Parquet holds exactly its
    objects' lines whatever the rows' own times."""
    from pyspark.sql import functions as F

    path = F.regexp_extract(F.input_file_name(), r"date=(\d{4}-\d{2}-\d{2})/hour=(\d{2})/", 0)
    return rows.select(
        "*",
        F.regexp_extract(path, r"date=([0-9-]+)", 1).alias("date"),
        F.regexp_extract(path, r"hour=(\d+)", 1).alias("hour"),
    )


def _write(store: Store, rows: DataFrame, kind: str, *, per_file: int = ROWS_PER_FILE) -> list[str]:
    """``rows`` appended as Parquet under ``parquet/<kind>/``, by date and hour: the keys of
    the files written (the folder may hold older ones, which only manifests tell apart)."""
    before = set(store.list(f"{PARQUET}/{kind}/"))
    (
        rows.repartition("date", "hour")
        .write.mode("append")
        .option("maxRecordsPerFile", per_file)
        .option("compression", "snappy")
        .option("parquet.block.size", ROW_GROUP_BYTES)
        .partitionBy("date", "hour")
        .parquet(store.uri(f"{PARQUET}/{kind}"))
    )
    return sorted(
        k for k in store.list(f"{PARQUET}/{kind}/") if k not in before and k.endswith(".parquet")
    )


def _write_names(spark: SparkSession, store: Store, events: list[str]) -> list[str]:
    """The consumer names of these events files per hour (``consumer_rows``), as Parquet under
    ``parquet/names/``: read from the Parquet just written (four dictionary-encoded columns),
    not from the JSON lines again."""
    frame = _parquet(spark, store, event_schema(), events)
    if frame is None:
        return []
    return _write(store, consumer_rows(delivery_events(with_hour(frame)), "date", "hour"), NAMES)


def _of_hour(keys: list[str], kind: str, hour: Hour) -> list[str]:
    folder = hour_folder(kind, hour) + "/"
    return [k for k in keys if k.startswith(folder)]


def covered_objects(store: Store, kind: str) -> Iterable[str]:
    """Every JSON object of ``kind`` a manifest covers (for tests and ``--dry-run``)."""
    chosen = plan(store, kind)
    for hour, manifest in chosen.manifests.items():
        for key, size in manifest.sources.items():
            if chosen.sources.get(hour, {}).get(key) == size:
                yield key


def manifest_of(store: Store, kind: str, hour: Hour) -> Manifest | None:
    return Manifest.parse(store.read_text(hour_folder(kind, hour) + "/" + MANIFEST))
