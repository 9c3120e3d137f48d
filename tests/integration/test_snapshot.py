"""The embedded AWS's snapshot (issue 47): a restart loads moto's state as of the snapshot's last
journal record and replays only the records after it, with the state a whole replay gives; a
snapshot it cannot trust is set aside and the journal replayed whole."""

from __future__ import annotations

import gc
import os
import pickle
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from shoal.local import snapshot
from shoal.local.aws import EmbeddedAws
from shoal.local.journal import JOURNAL_FILE
from shoal.local.provision import LocalNames, provision
from shoal.local.snapshot import SNAPSHOT_FILE

from tests.integration.test_local_aws import (
    TABLE,
    Start,
    client,
    journal_length,
    read_records,
    start,
    state_dir,
    write_state,
)

__all__ = ["start", "state_dir"]  # fixtures


@pytest.fixture
def often(monkeypatch: pytest.MonkeyPatch) -> None:
    """A snapshot after every few records (the default waits for thousands)."""
    monkeypatch.setattr(snapshot, "SNAPSHOT_AFTER", 3)


def _state(aws: EmbeddedAws, told: dict[str, Any]) -> dict[str, Any]:
    """What a restart must bring back: items, an object, stream records with their arrival
    times, a mapping's drawn UUID, a queue."""
    ddb = client(aws, "dynamodb")
    items = ddb.scan(TableName=TABLE, ConsistentRead=True)["Items"]
    obj = client(aws, "s3").get_object(Bucket="archive", Key="a/b c.json")
    mappings = client(aws, "lambda").list_event_source_mappings()["EventSourceMappings"]
    return {
        "items": sorted(i["pk"]["S"] for i in items),
        "object": (obj["Body"].read(), obj["Metadata"]),
        "records": read_records(aws, told["puts"][0]["ShardId"]),
        "mappings": sorted(m["UUID"] for m in mappings),
        "queues": [u.rsplit("/", 1)[-1] for u in client(aws, "sqs").list_queues()["QueueUrls"]],
    }


def _fill(aws: EmbeddedAws) -> dict[str, Any]:
    told = write_state(aws)
    provision(aws.session(), LocalNames.for_deployment())
    arn = client(aws, "kinesis").describe_stream_summary(StreamName="orders")[
        "StreamDescriptionSummary"
    ]["StreamARN"]
    client(aws, "lambda").create_event_source_mapping(
        EventSourceArn=arn, FunctionName="shoal-health", StartingPosition="TRIM_HORIZON"
    )
    return told


@pytest.mark.usefixtures("often")
def test_a_restart_loads_the_snapshot_and_replays_only_the_records_after_it(
    start: Start, state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given state written through the emulator, and a clean stop (which writes a snapshot)
    aws = start()
    told = _fill(aws)
    before = _state(aws, told)
    journaled = journal_length(state_dir)
    aws = start()
    # Then the restart loaded it and replayed nothing, and everything is as it was
    assert aws.snapshot is not None and aws.snapshot.seq == journaled - 1
    assert aws.replay_stats.records == 0
    assert _state(aws, told) == before
    # When one more write comes, and the emulator then dies without a clean stop's snapshot
    client(aws, "dynamodb").put_item(TableName=TABLE, Item={"pk": {"S": "later"}})
    monkeypatch.setattr(snapshot, "SNAPSHOT_AFTER", 10**9)
    aws = start()
    # Then the snapshot and that one record bring back both
    assert aws.replay_stats.records == 1 and aws.replay_stats.failures == 0
    assert _state(aws, told) == {**before, "items": sorted([*before["items"], "later"])}
    # And the whole journal, replayed without the snapshot, gives the same state
    (state_dir / SNAPSHOT_FILE).unlink()
    aws = start()
    assert aws.snapshot is None and aws.replay_stats.records == journaled + 1
    assert _state(aws, told) == {**before, "items": sorted([*before["items"], "later"])}


@pytest.mark.usefixtures("often")
def test_a_bucket_created_again_after_a_start_from_a_snapshot_keeps_its_objects(
    start: Start,
) -> None:
    """The 30-minute soak lost its archive at every restart from a snapshot: moto finds an
    existing bucket by a registry beside its backends, which the snapshot did not hold, so
    the provisioning's CreateBucket at each start made every bucket anew, empty."""
    # Given an object in a bucket, and a restart from the snapshot a clean stop wrote
    aws = start()
    told = _fill(aws)
    before = _state(aws, told)
    aws = start()
    assert aws.snapshot is not None and aws.replay_stats.records == 0
    # When the buckets are created again, as shoal dev's provisioning does at every start
    client(aws, "s3").create_bucket(Bucket="archive")
    provision(aws.session(), LocalNames.for_deployment())
    # Then the objects are all still there
    assert _state(aws, told) == before


def _flip_last_byte(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 0xFF])


@pytest.mark.usefixtures("often")
@pytest.mark.parametrize(
    "spoil",
    [
        pytest.param(lambda path: path.write_bytes(_flip_last_byte(path.read_bytes())), id="bit"),
        pytest.param(lambda path: path.write_bytes(path.read_bytes()[:100]), id="torn"),
        pytest.param(lambda path: path.write_bytes(b"not a snapshot"), id="garbage"),
        # the permissive mask is the case under test
        pytest.param(lambda path: os.chmod(path, 0o666), id="others-may-write"),  # noqa: S103
    ],
)
def test_a_snapshot_it_cannot_trust_is_set_aside_and_the_journal_replayed_whole(
    start: Start, state_dir: Path, spoil: Callable[[Path], None]
) -> None:
    aws = start()
    told = _fill(aws)
    before = _state(aws, told)
    aws.stop()
    spoil(state_dir / SNAPSHOT_FILE)
    aws = start()
    assert aws.snapshot is None
    assert aws.replay_stats.records == journal_length(state_dir)
    assert _state(aws, told) == before


@pytest.mark.usefixtures("often")
def test_a_snapshot_of_another_moto_is_set_aside(
    start: Start, state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a journal holds API requests, which another moto can replay; a pickle of moto's objects
    # holds its classes, which it need not have
    aws = start()
    told = _fill(aws)
    before = _state(aws, told)
    aws.stop()
    identity = snapshot._identity()
    monkeypatch.setattr(snapshot, "_identity", lambda: {**identity, "moto": "0.0.1"})
    aws = start()
    assert aws.snapshot is None and aws.replay_stats.records > 0
    assert _state(aws, told) == before


@pytest.mark.usefixtures("often")
def test_records_after_a_snapshot_are_numbered_past_it_whatever_the_journal_holds(
    start: Start, state_dir: Path
) -> None:
    # Given a snapshot, and a journal that ends before it (as when it was cut short)
    aws = start()
    told = _fill(aws)
    aws.stop()
    kept = (state_dir / JOURNAL_FILE).read_bytes()
    (state_dir / JOURNAL_FILE).write_bytes(kept[: len(b"SHOALJ1\n")])
    aws = start()
    assert aws.snapshot is not None
    # When a write follows, and the emulator restarts
    client(aws, "dynamodb").put_item(TableName=TABLE, Item={"pk": {"S": "after"}})
    assert aws.journal is not None and aws.journal.staged_seq > aws.snapshot.seq
    aws = start()
    # Then the write is not skipped as one the snapshot already holds
    assert "after" in _state(aws, told)["items"]


def test_a_snapshot_is_written_while_serving_by_a_child_and_the_next_start_uses_it(
    start: Start, state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past ``SNAPSHOT_WHILE_SERVING`` records a forked child writes a snapshot while the
    emulator goes on serving; a start after a kill (no clean stop's snapshot) loads it and
    replays only the records after it."""
    monkeypatch.setattr(snapshot, "SNAPSHOT_AFTER", 10**9)
    monkeypatch.setattr(snapshot, "SNAPSHOT_WHILE_SERVING", 5)
    aws = start()
    told = _fill(aws)
    snapshots = aws._snapshots
    assert snapshots is not None
    deadline = time.monotonic() + 30
    while snapshots.last_seq < 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    taken = snapshots.last_seq
    assert taken >= 4
    # serving went on meanwhile, and goes on
    client(aws, "dynamodb").put_item(TableName=TABLE, Item={"pk": {"S": "after"}})
    snapshots.wait()
    before = _state(aws, told)
    journaled = journal_length(state_dir)
    aws = start()
    assert aws.snapshot is not None and aws.snapshot.seq >= taken
    assert aws.replay_stats.records == journaled - 1 - aws.snapshot.seq
    assert aws.replay_stats.records < journaled and aws.replay_stats.failures == 0
    assert _state(aws, told) == before


@pytest.mark.usefixtures("often")
def test_queues_start_empty_after_a_snapshot_as_after_a_replay(start: Start) -> None:
    """The journal keeps no queue's messages, and neither does a start from a snapshot: a push
    received and never deleted by the process that died would hold its FIFO lane's later
    pushes until its visibility ran out (the soak saw sessions get nothing more)."""
    aws = start()
    _fill(aws)
    sqs = client(aws, "sqs")
    url = sqs.create_queue(
        QueueName="lanes.fifo",
        Attributes={"FifoQueue": "true", "ContentBasedDeduplication": "true"},
    )["QueueUrl"]
    for body in ("held", "behind"):
        sqs.send_message(QueueUrl=url, MessageBody=body, MessageGroupId="lane-1")
    received = sqs.receive_message(QueueUrl=url, VisibilityTimeout=900)["Messages"]
    assert [m["Body"] for m in received] == ["held"]
    assert "Messages" not in sqs.receive_message(QueueUrl=url)  # the lane waits on "held"
    aws = start()
    assert aws.snapshot is not None
    sqs = client(aws, "sqs")
    url = sqs.get_queue_url(QueueName="lanes.fifo")["QueueUrl"]
    sqs.send_message(QueueUrl=url, MessageBody="next", MessageGroupId="lane-1")
    again = sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10)["Messages"]
    assert [m["Body"] for m in again] == ["next"]


@pytest.mark.usefixtures("often")
def test_a_snapshots_items_load_whole_without_the_per_attribute_size_check(
    start: Start, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An item's attributes are moto's ``LimitedSizeDict``, whose ``__setitem__`` sums the size
    of every attribute set before each one: unpickled as a dict subclass, a large snapshot's
    load was mostly that (the 2-hour soak's 317 MB: 18.5 s to load, 2.7 s now). They come back
    whole, still checked on later writes, with the collector off while the load makes them."""
    from moto.dynamodb.models.dynamo_type import LimitedSizeDict

    aws = start()
    ddb = client(aws, "dynamodb")
    write_state(aws)
    attributes = {f"a{i}": {"S": f"value {i}"} for i in range(12)}
    ddb.put_item(TableName=TABLE, Item={"pk": {"S": "wide"}, **attributes})
    sets: list[str] = []
    checked = LimitedSizeDict.__setitem__

    def counted(self: Any, key: str, value: Any) -> None:
        sets.append(key)
        checked(self, key, value)

    monkeypatch.setattr(LimitedSizeDict, "__setitem__", counted)
    collecting: list[bool] = []
    loads = pickle.loads

    def watched(payload: Any) -> Any:
        collecting.append(gc.isenabled())
        return loads(payload)

    monkeypatch.setattr(pickle, "loads", watched)
    # When the emulator restarts from the snapshot its clean stop wrote
    aws = start()
    assert aws.snapshot is not None and aws.replay_stats.records == 0
    # Then no attribute went through the check, the collector was off and is on again
    assert sets == []
    assert collecting == [False] and gc.isenabled()
    # And the items are whole, and their attributes still refuse an item past 400 KB
    ddb = client(aws, "dynamodb")
    wide = ddb.get_item(TableName=TABLE, Key={"pk": {"S": "wide"}}, ConsistentRead=True)["Item"]
    assert wide == {"pk": {"S": "wide"}, **attributes}
    too_large = ddb.exceptions.ClientError
    with pytest.raises(too_large, match="maximum allowed size"):
        ddb.update_item(
            TableName=TABLE,
            Key={"pk": {"S": "wide"}},
            UpdateExpression="SET big = :b",
            ExpressionAttributeValues={":b": {"S": "x" * 410_000}},
        )
