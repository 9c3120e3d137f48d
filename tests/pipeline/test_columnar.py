"""The columnar archive: compaction is idempotent, and a partially compacted hour is read without
loss or double counting (Parquet for what a manifest covers, JSON lines for the rest)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import DataFrame, SparkSession

from pipeline.columnar import (
    MANIFEST,
    NAMES,
    Manifest,
    Store,
    compact,
    hour_folder,
    manifest_of,
    plan,
    read_events,
    read_events_and_names,
    read_messages,
    read_names,
)
from pipeline.common import EVENTS, MESSAGES
from tests.pipeline.data import T0, delivered_and_acked, event, message

pytestmark = pytest.mark.pipeline

HOUR = ("2023-11-14", "22")  # T0's hour
NEXT = ("2023-11-14", "23")


def write_lines(root: Path, key: str, rows: list[dict[str, Any]]) -> None:
    path = root / key
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def messages_key(hour: tuple[str, str], name: str) -> str:
    return f"messages/topic=default/date={hour[0]}/hour={hour[1]}/{name}.jsonl"


def events_key(hour: tuple[str, str], name: str) -> str:
    return f"events/date={hour[0]}/hour={hour[1]}/{name}.jsonl"


def snapshot(spark: SparkSession, root: str) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """Every message and event row under ``root``, sorted (duplicates kept: they would show)."""
    messages = sorted(
        tuple(r) for r in read_messages(spark, root).select("message_id", "published_at").collect()
    )
    events = sorted(
        tuple(r)
        for r in read_events(spark, root).select("event", "consumer", "delivery_id", "at").collect()
    )
    return messages, events


@pytest.fixture
def archive(tmp_path: Path) -> Path:
    """Two hours of messages and events as JSON lines, two objects in the first hour."""
    root = tmp_path / "archive"
    write_lines(root, messages_key(HOUR, "a"), [message(n) for n in range(3)])
    write_lines(root, messages_key(HOUR, "b"), [message(n) for n in range(3, 5)])
    write_lines(root, messages_key(NEXT, "c"), [message(9, at=T0 + 3_600_000)])
    write_lines(
        root, events_key(HOUR, "e1"), delivered_and_acked("s1", 0) + delivered_and_acked("s1", 1)
    )
    write_lines(root, events_key(NEXT, "e2"), delivered_and_acked("s1", 9))
    return root


def test_compacting_twice_gives_the_same_data(spark: SparkSession, archive: Path) -> None:
    # Given an archive of JSON lines only, and what a reader sees of it
    before = snapshot(spark, str(archive))
    assert len(before[0]) == 6 and len(before[1]) == 9
    lines = {p: p.read_bytes() for p in archive.rglob("*.jsonl")}
    # When it is compacted (through Hadoop's file system, as on EMR: a file:// URI)
    first = compact(spark, archive.as_uri())
    # Then the JSON lines stay as they were: inbox items name them (offset and length) until
    # their TTL, so compaction adds Parquet beside them and never rewrites or deletes them
    assert {p: p.read_bytes() for p in archive.rglob("*.jsonl")} == lines
    store = Store(str(archive))
    manifest = manifest_of(store, EVENTS, HOUR)
    # And every hour of both kinds has a manifest naming its objects and Parquet files,
    # and a reader sees the same rows, now from Parquet alone
    assert [(c.kind, c.hours, c.objects) for c in first] == [(MESSAGES, 2, 3), (EVENTS, 2, 2)]
    assert manifest is not None and list(manifest.sources) == [events_key(HOUR, "e1")]
    assert manifest.files and all(f.endswith(".parquet") for f in manifest.files)
    assert plan(store, EVENTS).json == {} and plan(store, MESSAGES).json == {}
    assert snapshot(spark, str(archive)) == before
    # When compacted again
    files = sorted(store.list("parquet/"))
    second = compact(spark, str(archive))
    # Then nothing is rewritten and the data is the same
    assert [(c.hours, c.skipped) for c in second] == [(0, 2), (0, 2)]
    assert sorted(store.list("parquet/")) == files
    assert snapshot(spark, str(archive)) == before


def test_a_partially_compacted_hour_is_read_without_loss_or_double_counting(
    spark: SparkSession, archive: Path
) -> None:
    # Given a compacted archive, then a late object in a compacted hour, an object rewritten
    # with other content, and Parquet a compaction left behind without a manifest
    compact(spark, str(archive))
    store = Store(str(archive))
    write_lines(archive, events_key(HOUR, "late"), delivered_and_acked("s2", 1))
    write_lines(archive, messages_key(HOUR, "b"), [message(n) for n in range(3, 6)])
    stray = archive / manifest_of(store, EVENTS, HOUR).files[0]  # type: ignore[union-attr]
    shutil.copy(stray, stray.with_name("part-99999-crashed.snappy.parquet"))
    # When read
    messages, events = snapshot(spark, str(archive))
    # Then each row is there once: the manifest's Parquet, the objects it does not cover as
    # JSON lines, and no file no manifest names
    assert len(events) == 9 + 3
    assert len(set(events)) == len(events)
    pending = plan(store, EVENTS).json
    assert pending == {
        HOUR: {events_key(HOUR, "late"): (archive / events_key(HOUR, "late")).stat().st_size}
    }
    # the rewritten object is read from its JSON lines (a message copy twice is one message to
    # the jobs: they keep one row per id)
    assert {m for m, _ in messages} == {f"m{n}" for n in (0, 1, 2, 3, 4, 5, 9)}
    # When the hour is compacted again
    again = compact(spark, str(archive), kinds=[EVENTS])
    manifest = manifest_of(store, EVENTS, HOUR)
    # Then it covers both objects, the superseded Parquet is gone, and the rows are the same
    assert (again[0].hours, again[0].skipped) == (1, 1)
    assert manifest is not None and sorted(manifest.sources) == sorted(
        [events_key(HOUR, "e1"), events_key(HOUR, "late")]
    )
    assert not (archive / stray.relative_to(archive)).exists()
    assert (archive / hour_folder(EVENTS, HOUR) / MANIFEST).exists()
    assert snapshot(spark, str(archive))[1] == events


def names_of(spark: SparkSession, root: str) -> tuple[list[tuple[Any, ...]], list[str]]:
    """The consumers' name rows a reader sees (distinct), and the files it reads them from."""
    frame = read_names(spark, root)
    rows = {tuple(r) for r in frame.collect()}
    return sorted(rows, key=lambda r: tuple(v or "" for v in r)), frame.inputFiles()


def rows_of(frame: DataFrame) -> list[tuple[Any, ...]]:
    return sorted((tuple(r) for r in frame.collect()), key=lambda r: tuple(str(v) for v in r))


def under(files: list[str], root: Path, folder: str) -> list[str]:
    """The files (URIs) under ``root / folder``."""
    prefix = f"{root.resolve()}/{folder}/"
    return [f for f in files if f.split(":", 1)[-1].lstrip("/").startswith(prefix.lstrip("/"))]


@pytest.fixture
def named(archive: Path) -> Path:
    """The archive with a shared group's events and a labelled session's in the first hour."""
    write_lines(
        archive,
        events_key(HOUR, "g"),
        [
            event(
                "routed", "grp", "m2", T0 + 10, consumer_kind="group", subscription="$share/g/o/+"
            ),
            event("acked", "grp", "m2", T0 + 20, consumer_kind="group"),
            event("delivered", "s3", "m3", T0 + 30, delivery_id="s3.3", label="client-3"),
            # a session's ack names only its delivery: no name row of its own
            event("acked", "s4", None, T0 + 40, delivery_id="s4.3"),
        ],
    )
    return archive


def test_compaction_writes_each_hours_consumer_names_and_the_audit_reads_only_those(
    spark: SparkSession, named: Path
) -> None:
    # Given the names a reader takes from the JSON lines
    before, _ = names_of(spark, str(named))
    assert ("group", "grp", None, "$share/g/o/+") in before
    assert ("session", "s3", "client-3", None) in before
    assert not any(row[1] == "s4" for row in before)
    # When the archive is compacted
    compact(spark, str(named))
    # Then each events manifest names its hour's names files, and a reader reads those files
    # and nothing else (not the events), with the same rows
    store = Store(str(named))
    for hour in (HOUR, NEXT):
        manifest = manifest_of(store, EVENTS, hour)
        assert manifest is not None and manifest.names
        assert all(k.startswith(hour_folder(NAMES, hour) + "/") for k in manifest.names)
    after, files = names_of(spark, str(named))
    assert after == before
    assert files and under(files, named, f"parquet/{NAMES}") == files
    # and the names from events, none now, are no part of the plan: an empty relation the
    # optimizer drops, not a scan of rows sent from Python (a second of a fresh JVM's time)
    plan = read_names(spark, str(named))._jdf.queryExecution().optimizedPlan().toString()
    assert "LogicalRDD" not in plan and "LocalRelation" not in plan
    # And the audit's one listing for both gives the events read_events gives, and these names
    events, names = read_events_and_names(spark, str(named))
    assert rows_of(events) == rows_of(read_events(spark, str(named)))
    assert rows_of(names) == rows_of(read_names(spark, str(named)))
    # And compacting again writes nothing and reads the same
    written = sorted(store.list("parquet/"))
    compact(spark, str(named))
    assert sorted(store.list("parquet/")) == written
    assert names_of(spark, str(named)) == (after, files)


def test_names_of_a_late_object_are_read_from_it_until_the_hour_is_compacted_again(
    spark: SparkSession, named: Path
) -> None:
    # Given a compacted hour, then a late object in it naming a new consumer
    compact(spark, str(named))
    store = Store(str(named))
    old = manifest_of(store, EVENTS, HOUR)
    assert old is not None and old.names
    write_lines(named, events_key(HOUR, "late"), delivered_and_acked("s2", 1))
    # When read
    rows, files = names_of(spark, str(named))
    # Then the new consumer is there, from the late object's JSON lines, beside the names files
    assert [r for r in rows if r[1] == "s2"] == [("session", "s2", None, None)]
    assert any(f.endswith("late.jsonl") for f in files)
    # When the hour is compacted again
    compact(spark, str(named), kinds=[EVENTS])
    # Then its new names files replace the old ones, and read alone give the same rows
    new = manifest_of(store, EVENTS, HOUR)
    assert new is not None and new.names and not set(new.names) & set(old.names)
    assert not any((named / k).exists() for k in old.names)
    again, files = names_of(spark, str(named))
    assert again == rows
    assert not any(f.endswith(".jsonl") for f in files)


def test_an_hour_compacted_before_names_is_named_from_its_events_then_given_names(
    spark: SparkSession, named: Path
) -> None:
    # Given a compacted archive whose first hour's manifest is from before names were written
    before, _ = names_of(spark, str(named))
    compact(spark, str(named))
    store = Store(str(named))
    manifest = manifest_of(store, EVENTS, HOUR)
    assert manifest is not None and manifest.names
    for key in manifest.names:
        (named / key).unlink()
    store.write_text(
        hour_folder(EVENTS, HOUR) + "/" + MANIFEST,
        Manifest(sources=manifest.sources, files=manifest.files).dump(),
    )
    # When read
    rows, files = names_of(spark, str(named))
    # Then its names come from its events' Parquet
    assert rows == before
    assert under(files, named, hour_folder(EVENTS, HOUR))
    # When compacted again
    done = {c.kind: c for c in compact(spark, str(named))}
    # Then that hour alone is given names, its events untouched, and read from them alone
    assert (done[EVENTS].hours, done[EVENTS].named) == (0, 1)
    renamed = manifest_of(store, EVENTS, HOUR)
    assert renamed is not None and renamed.names and renamed.files == manifest.files
    assert names_of(spark, str(named))[0] == before
    files = names_of(spark, str(named))[1]
    assert under(files, named, f"parquet/{NAMES}") == files
