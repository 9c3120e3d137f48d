"""The columnar archive: compaction is idempotent, and a partially compacted hour is read without
loss or double counting (Parquet for what a manifest covers, JSON lines for the rest)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from pipeline.columnar import MANIFEST, Store, compact, hour_folder, manifest_of, plan
from pipeline.common import EVENTS, MESSAGES, read_events, read_messages
from tests.pipeline.data import T0, delivered_and_acked, message

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
