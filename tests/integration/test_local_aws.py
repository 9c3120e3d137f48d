"""The embedded AWS: serialized (conditional writes are atomic) and journaled (state survives)."""

from __future__ import annotations

import os
import re
import struct
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import certifi
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError, NoCredentialsError
from shoal.local.aws import EmbeddedAws, share_service_models
from shoal.local.journal import JOURNAL_FILE, Journal, JournalRecord
from shoal.local.provision import LocalNames, provision
from shoal.local.throttle import Throttles

CLIENT_CONFIG = Config(max_pool_connections=32, retries={"max_attempts": 1, "mode": "standard"})
TABLE = "counters"

Start = Callable[[], EmbeddedAws]


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    return tmp_path / "state"


@pytest.fixture
def start(state_dir: Path) -> Iterator[Start]:
    """Starts the embedded AWS on ``state_dir``; calling it again is a restart."""
    running: list[EmbeddedAws] = []

    def _start() -> EmbeddedAws:
        if running:
            running.pop().stop()
        aws = EmbeddedAws(state_dir=state_dir)
        aws.start()
        running.append(aws)
        return aws

    yield _start
    for aws in running:
        aws.stop()


def client(aws: EmbeddedAws, service: str) -> Any:
    return aws.session().client(service, config=CLIENT_CONFIG)


def create_counter_table(aws: EmbeddedAws) -> Any:
    ddb = client(aws, "dynamodb")
    ddb.create_table(
        TableName=TABLE,
        BillingMode="PAY_PER_REQUEST",
        AttributeDefinitions=[{"AttributeName": "pk", "AttributeType": "S"}],
        KeySchema=[{"AttributeName": "pk", "KeyType": "HASH"}],
    )
    return ddb


def journal_length(state_dir: Path) -> int:
    journal = Journal(state_dir / JOURNAL_FILE)
    try:
        return journal.pending_count
    finally:
        journal.close()


@pytest.fixture
def eager_thread_switching() -> Iterator[None]:
    # Python switches threads every 5 ms by default, longer than moto's check-then-write
    # window; switching every 10 us makes a lost update likely when nothing serializes
    # (measured without the lock: 154-157 of 160 increments kept).
    saved = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(saved)


@pytest.mark.usefixtures("eager_thread_switching")
def test_racing_conditional_increments_lose_no_update(start: Start) -> None:
    # Given a counter and 16 threads that each increment it 10 times by read-then-conditional-put
    aws = start()
    ddb = create_counter_table(aws)
    ddb.put_item(TableName=TABLE, Item={"pk": {"S": "c"}, "n": {"N": "0"}})
    threads, increments = 16, 10
    conflicts = [0] * threads

    def increment(worker: int) -> None:
        done = 0
        while done < increments:
            try:
                item = ddb.get_item(TableName=TABLE, Key={"pk": {"S": "c"}}, ConsistentRead=True)
                n = int(item["Item"]["n"]["N"])
                ddb.put_item(
                    TableName=TABLE,
                    Item={"pk": {"S": "c"}, "n": {"N": str(n + 1)}},
                    ConditionExpression="n = :seen",
                    ExpressionAttributeValues={":seen": {"N": str(n)}},
                )
                done += 1
            except ClientError as exc:
                code = exc.response["Error"]["Code"]
                # The emulator sheds a call that waited over LOCK_WAIT_BUDGET_S for its lock
                # (503, before running it), as DynamoDB throttles: the client tries again, as
                # the SDK's retries would (this client makes one attempt). Seen on CI's machine.
                if code == "ServiceUnavailable":
                    continue
                assert code == "ConditionalCheckFailedException"
                conflicts[worker] += 1

    # When they all run at once
    workers = [threading.Thread(target=increment, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    # Then every successful conditional put counted exactly once
    final = ddb.get_item(TableName=TABLE, Key={"pk": {"S": "c"}}, ConsistentRead=True)
    assert int(final["Item"]["n"]["N"]) == threads * increments
    # and the race was real: some writers lost their condition
    assert sum(conflicts) > 0


def scan_all(ddb: Any, table: str) -> list[dict[str, Any]]:
    items = ddb.scan(TableName=table, ConsistentRead=True)["Items"]
    return sorted(items, key=lambda i: (i["pk"]["S"], i.get("sk", {}).get("S", "")))


def test_a_cancelled_transaction_leaves_every_item_it_named_as_it_was(start: Start) -> None:
    # Given a table with a sort key and one without, each with items beside the ones a
    # transaction will name (in the same partition and in others)
    aws = start()
    ddb = create_counter_table(aws)
    ddb.create_table(
        TableName="ranged",
        BillingMode="PAY_PER_REQUEST",
        AttributeDefinitions=[
            {"AttributeName": "pk", "AttributeType": "S"},
            {"AttributeName": "sk", "AttributeType": "S"},
        ],
        KeySchema=[
            {"AttributeName": "pk", "KeyType": "HASH"},
            {"AttributeName": "sk", "KeyType": "RANGE"},
        ],
    )
    for pk, sk, n in [("p", "a", "1"), ("p", "b", "2"), ("p", "c", "3"), ("q", "a", "4")]:
        ddb.put_item(TableName="ranged", Item={"pk": {"S": pk}, "sk": {"S": sk}, "n": {"N": n}})
    for pk, n in [("x", "1"), ("y", "2")]:
        ddb.put_item(TableName=TABLE, Item={"pk": {"S": pk}, "n": {"N": n}})
    before = (scan_all(ddb, "ranged"), scan_all(ddb, TABLE))

    def update(table: str, key: dict[str, Any]) -> dict[str, Any]:
        return {
            "Update": {
                "TableName": table,
                "Key": key,
                "UpdateExpression": "SET n = :n",
                "ExpressionAttributeValues": {":n": {"N": "99"}},
            }
        }

    # When a transaction puts into an existing partition and a new one, updates, deletes, and
    # then fails its last condition (after moto applied the parts before it)
    with pytest.raises(ClientError) as refused:
        ddb.transact_write_items(
            TransactItems=[
                {"Put": {"TableName": "ranged", "Item": {"pk": {"S": "p"}, "sk": {"S": "d"}}}},
                {"Put": {"TableName": "ranged", "Item": {"pk": {"S": "new"}, "sk": {"S": "a"}}}},
                update("ranged", {"pk": {"S": "p"}, "sk": {"S": "a"}}),
                {"Delete": {"TableName": "ranged", "Key": {"pk": {"S": "p"}, "sk": {"S": "b"}}}},
                {"Put": {"TableName": TABLE, "Item": {"pk": {"S": "z"}}}},
                update(TABLE, {"pk": {"S": "x"}}),
                {"Delete": {"TableName": TABLE, "Key": {"pk": {"S": "y"}}}},
                {
                    "ConditionCheck": {
                        "TableName": "ranged",
                        "Key": {"pk": {"S": "q"}, "sk": {"S": "a"}},
                        "ConditionExpression": "n = :other",
                        "ExpressionAttributeValues": {":other": {"N": "5"}},
                    }
                },
            ]
        )
    # Then it is refused and both tables hold exactly what they held before
    assert refused.value.response["Error"]["Code"] == "TransactionCanceledException"
    assert (scan_all(ddb, "ranged"), scan_all(ddb, TABLE)) == before
    # and the partition the put would have made does not exist (a query finds nothing there)
    empty = ddb.query(
        TableName="ranged",
        KeyConditionExpression="pk = :pk",
        ExpressionAttributeValues={":pk": {"S": "new"}},
    )
    assert empty["Items"] == []
    # and the same transaction without the failing condition applies every part
    ddb.transact_write_items(
        TransactItems=[
            {"Put": {"TableName": "ranged", "Item": {"pk": {"S": "new"}, "sk": {"S": "a"}}}},
            update("ranged", {"pk": {"S": "p"}, "sk": {"S": "a"}}),
            {"Delete": {"TableName": TABLE, "Key": {"pk": {"S": "y"}}}},
        ]
    )
    after = scan_all(ddb, "ranged")
    assert {"pk": {"S": "new"}, "sk": {"S": "a"}} in after
    assert {"pk": {"S": "p"}, "sk": {"S": "a"}, "n": {"N": "99"}} in after
    assert [i["pk"]["S"] for i in scan_all(ddb, TABLE)] == ["x"]


def test_queries_answer_as_moto_itself_does(start: Start) -> None:
    # Given a table with a sort key and an index whose keys some items lack, in several
    # partitions of both
    from moto.dynamodb.models.table import Table

    aws = start()
    ddb = client(aws, "dynamodb")
    ddb.create_table(
        TableName="due",
        BillingMode="PAY_PER_REQUEST",
        AttributeDefinitions=[
            {"AttributeName": name, "AttributeType": kind}
            for name, kind in [("pk", "S"), ("sk", "S"), ("shard", "S"), ("at", "N")]
        ],
        KeySchema=[
            {"AttributeName": "pk", "KeyType": "HASH"},
            {"AttributeName": "sk", "KeyType": "RANGE"},
        ],
        GlobalSecondaryIndexes=[
            {
                "IndexName": "by-due",
                "KeySchema": [
                    {"AttributeName": "shard", "KeyType": "HASH"},
                    {"AttributeName": "at", "KeyType": "RANGE"},
                ],
                "Projection": {"ProjectionType": "ALL"},
            }
        ],
    )
    for n in range(120):
        item = {"pk": {"S": f"p{n % 7}"}, "sk": {"S": f"s{n:03d}"}, "v": {"N": str(n)}}
        if n % 5:
            item["shard"] = {"S": f"d{n % 3}"}
        if n % 4:
            item["at"] = {"N": str((n * 37) % 101)}
        ddb.put_item(TableName="due", Item=item)
    queries: list[dict[str, Any]] = [
        {"KeyConditionExpression": "pk = :h", "ExpressionAttributeValues": {":h": {"S": "p3"}}},
        {
            "KeyConditionExpression": "pk = :h AND sk BETWEEN :a AND :b",
            "ExpressionAttributeValues": {
                ":h": {"S": "p2"},
                ":a": {"S": "s010"},
                ":b": {"S": "s090"},
            },
        },
    ]
    for shard in ("d0", "d1", "d2", "none"):
        values = {":h": {"S": shard}, ":t": {"N": "50"}}
        queries += [
            {
                "IndexName": "by-due",
                "KeyConditionExpression": "shard = :h",
                "ExpressionAttributeValues": {":h": {"S": shard}},
            },
            {
                "IndexName": "by-due",
                "KeyConditionExpression": "shard = :h AND #at <= :t",
                "ExpressionAttributeNames": {"#at": "at"},
                "ExpressionAttributeValues": values,
            },
            {
                "IndexName": "by-due",
                "KeyConditionExpression": "shard = :h AND #at > :t",
                "ExpressionAttributeNames": {"#at": "at"},
                "ExpressionAttributeValues": values,
                "ScanIndexForward": False,
            },
        ]

    def answers() -> list[Any]:
        seen = []
        for query in queries:
            for limit in (None, 3):
                pages, start_key = [], None
                while True:
                    extra: dict[str, Any] = {"Limit": limit} if limit else {}
                    if start_key:
                        extra["ExclusiveStartKey"] = start_key
                    page = ddb.query(TableName="due", **query, **extra)
                    pages.append((page["Items"], page.get("LastEvaluatedKey")))
                    start_key = page.get("LastEvaluatedKey")
                    if not start_key:
                        break
                seen.append(pages)
        return seen

    # When each query is answered through the emulator's shortcuts and by moto's own query
    patched = answers()
    shortcut = Table.query
    Table.query = shortcut.__wrapped__
    try:
        plain = answers()
    finally:
        Table.query = shortcut

    # Then the answers are the same, page by page, but for one thing: where the last item
    # that meets the key condition fills a page, moto's own query still answers a
    # LastEvaluatedKey (it saw a next item in the partition, outside the condition) and a
    # client reads one more, empty, page; a client reads every item either way
    def trimmed(pages: list[Any]) -> list[Any]:
        return pages[:-1] if len(pages) > 1 and pages[-1] == ([], None) else pages

    def items_of(pages: list[Any]) -> list[Any]:
        return [item for items, _ in pages for item in items]

    assert [items_of(p) for p in patched] == [items_of(p) for p in plain]
    assert [[items for items, _ in trimmed(p)] for p in patched] == [
        [items for items, _ in trimmed(p)] for p in plain
    ]
    # and the queries found something
    assert sum(len(items) for pages in patched for items, _ in pages) > 100


def write_state(aws: EmbeddedAws) -> dict[str, Any]:
    """One item, one S3 object (with metadata) and two Kinesis records; returns what was told."""
    ddb = create_counter_table(aws)
    ddb.put_item(TableName=TABLE, Item={"pk": {"S": "kept"}, "n": {"N": "42"}})
    s3 = client(aws, "s3")
    s3.create_bucket(Bucket="archive")
    s3.put_object(Bucket="archive", Key="a/b c.json", Body=b'{"x":1}', Metadata={"my_key": "v"})
    kinesis = client(aws, "kinesis")
    kinesis.create_stream(StreamName="orders", ShardCount=2)
    puts = [kinesis.put_record(StreamName="orders", Data=d, PartitionKey="k") for d in (b"1", b"2")]
    return {"puts": puts, "records": read_records(aws, puts[0]["ShardId"])}


def read_records(aws: EmbeddedAws, shard_id: str) -> list[dict[str, Any]]:
    kinesis = client(aws, "kinesis")
    iterator = kinesis.get_shard_iterator(
        StreamName="orders", ShardId=shard_id, ShardIteratorType="TRIM_HORIZON"
    )["ShardIterator"]
    records: list[dict[str, Any]] = kinesis.get_records(ShardIterator=iterator)["Records"]
    return records


def test_restart_replays_tables_objects_and_stream_records(start: Start) -> None:
    # Given state written through the emulator
    told = write_state(start())
    # When it restarts on the same state directory (a fresh backend)
    aws = start()
    # Then the item, the object and the records are back, records byte for byte
    item = client(aws, "dynamodb").get_item(TableName=TABLE, Key={"pk": {"S": "kept"}})
    assert item["Item"]["n"] == {"N": "42"}
    obj = client(aws, "s3").get_object(Bucket="archive", Key="a/b c.json")
    assert (obj["Body"].read(), obj["Metadata"]) == (b'{"x":1}', {"my_key": "v"})
    records = read_records(aws, told["puts"][0]["ShardId"])
    assert [r["SequenceNumber"] for r in records] == [p["SequenceNumber"] for p in told["puts"]]
    # arrival timestamps too: replay runs each request at its original time
    assert records == told["records"]
    assert aws.replay_stats.failures == 0


def test_replay_keeps_generated_ids(start: Start) -> None:
    # Given an event source mapping, whose UUID moto draws at random
    aws = start()
    session = aws.session()
    provision(session, LocalNames.for_deployment())
    kinesis = client(aws, "kinesis")
    kinesis.create_stream(StreamName="orders", ShardCount=1)
    arn = kinesis.describe_stream_summary(StreamName="orders")["StreamDescriptionSummary"][
        "StreamARN"
    ]
    created = client(aws, "lambda").create_event_source_mapping(
        EventSourceArn=arn, FunctionName="shoal-health", StartingPosition="TRIM_HORIZON"
    )
    # When the emulator restarts
    aws = start()
    # Then the mapping has the same UUID (checkpoints are keyed by it)
    listed = client(aws, "lambda").list_event_source_mappings()["EventSourceMappings"]
    assert [m["UUID"] for m in listed] == [created["UUID"]]
    assert aws.replay_stats.failures == 0


def test_request_ids_are_drawn_at_once_not_from_motos_seeded_generator(
    start: Start, monkeypatch: pytest.MonkeyPatch
) -> None:
    """moto drew each of a request id's 52 characters with a call of its own (a twentieth of
    a GetItem's CPU in process); the ids are drawn at once now, still 52 of moto's characters,
    one of their own each answer."""
    from moto.moto_api._internal import mock_random

    aws = start()
    ddb = create_counter_table(aws)

    def refused(*_: Any, **__: Any) -> str:
        raise AssertionError("a request id drawn a character at a time")

    monkeypatch.setattr(mock_random, "get_random_string", refused)
    ids = {
        ddb.get_item(TableName=TABLE, Key={"pk": {"S": "k"}})["ResponseMetadata"]["RequestId"]
        for _ in range(3)
    }
    assert len(ids) == 3
    assert all(len(i) == 52 and i.isalnum() and i == i.upper() for i in ids)


def test_a_replay_runs_with_the_garbage_collector_on(
    start: Start, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each replayed record's answer leaves cyclic garbage: with the collector held off for a
    replay (as it is for a snapshot's load), the 30-minute soak's server restarted 60 to 150 MB
    larger each time, and replaying 41,285 records left 488 MB of RSS against 152 MB."""
    import gc

    from shoal.local import aws as local_aws

    aws = start()
    create_counter_table(aws).put_item(TableName=TABLE, Item={"pk": {"S": "kept"}})
    collecting: list[bool] = []
    replayed = local_aws._call_handler

    def watched(handler: Any, environ: dict[str, Any]) -> Any:
        collecting.append(gc.isenabled())
        return replayed(handler, environ)

    monkeypatch.setattr(local_aws, "_call_handler", watched)
    aws = start()
    assert aws.replay_stats.records == 2 and aws.replay_stats.failures == 0
    assert collecting[:2] == [True, True]


def test_reads_and_failed_writes_are_not_journaled(start: Start, state_dir: Path) -> None:
    # Given a table with one item
    aws = start()
    ddb = create_counter_table(aws)
    ddb.put_item(TableName=TABLE, Item={"pk": {"S": "c"}, "n": {"N": "1"}})
    before = journal_length(state_dir)
    # When only reads and a refused conditional write follow
    ddb.get_item(TableName=TABLE, Key={"pk": {"S": "c"}})
    ddb.scan(TableName=TABLE)
    ddb.query(
        TableName=TABLE,
        KeyConditionExpression="pk = :k",
        ExpressionAttributeValues={":k": {"S": "c"}},
    )
    ddb.describe_table(TableName=TABLE)
    with pytest.raises(ClientError):
        ddb.put_item(
            TableName=TABLE,
            Item={"pk": {"S": "c"}, "n": {"N": "2"}},
            ConditionExpression="attribute_not_exists(pk)",
        )
    # Then the journal did not grow
    assert journal_length(state_dir) == before


def test_torn_tail_is_dropped_and_the_journal_stays_appendable(
    start: Start, state_dir: Path
) -> None:
    # Given a journal whose last record was cut short by a crash mid-append
    aws = start()
    ddb = create_counter_table(aws)
    ddb.put_item(TableName=TABLE, Item={"pk": {"S": "before"}, "n": {"N": "1"}})
    aws.stop()
    path = state_dir / JOURNAL_FILE
    good_size = path.stat().st_size
    torn = JournalRecord(99, 0, {"REQUEST_METHOD": "POST"}, {}, b"x" * 100).encode()
    with open(path, "ab") as f:
        f.write(torn[: len(torn) // 2])
    # When the emulator restarts
    aws = start()
    # Then the complete records are replayed, the torn one is gone from the file
    assert aws.replay_stats.dropped_tail_bytes == len(torn) // 2
    assert path.stat().st_size == good_size
    ddb = client(aws, "dynamodb")
    assert "Item" in ddb.get_item(TableName=TABLE, Key={"pk": {"S": "before"}})
    # And writes after the cut survive the next restart
    ddb.put_item(TableName=TABLE, Item={"pk": {"S": "after"}, "n": {"N": "2"}})
    aws = start()
    ddb = client(aws, "dynamodb")
    assert "Item" in ddb.get_item(TableName=TABLE, Key={"pk": {"S": "after"}})
    assert aws.replay_stats.dropped_tail_bytes == 0


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda data: data[:-1], id="short-payload"),
        pytest.param(lambda data: data[:5], id="short-header"),
        pytest.param(lambda data: data[:-1] + bytes([data[-1] ^ 0xFF]), id="bad-checksum"),
        pytest.param(lambda data: struct.pack(">II", 1 << 31, 0) + data[8:], id="huge-length"),
    ],
)
def test_journal_drops_any_damaged_last_record(
    tmp_path: Path, damage: Callable[[bytes], bytes]
) -> None:
    # Given two appended records, the second one damaged on disk
    journal = Journal(tmp_path / "j")
    first = JournalRecord(0, 1, {"REQUEST_METHOD": "PUT"}, {"k": "v"}, b"one")
    journal.append(first)
    journal.close()
    second = JournalRecord(1, 2, {"REQUEST_METHOD": "PUT"}, {}, b"two").encode()
    with open(tmp_path / "j", "ab") as f:
        f.write(damage(second))
    # When the journal is opened
    reopened = Journal(tmp_path / "j")
    # Then only the intact record is read, and the next sequence number follows it
    assert list(reopened.pending()) == [first]
    assert reopened.next_seq == 1
    reopened.close()


def test_a_journal_is_replayed_one_record_at_a_time(tmp_path: Path) -> None:
    # Given a journal of 100 records of 200 KB each
    journal = Journal(tmp_path / "j")
    for n in range(100):
        body = bytes([n]) * 200_000
        journal.append(JournalRecord(n, n, {"REQUEST_METHOD": "PUT"}, {}, body))
    journal.close()
    # When it is opened again and its records are read through, as a replay reads them
    tracemalloc.start()
    try:
        reopened = Journal(tmp_path / "j")
        read = [(r.seq, r.body[:1], len(r.body)) for r in reopened.pending()]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    reopened.close()
    # Then every record comes back in order, and the 20 MB were never all held at once (a
    # restart after a long run kept the decoded journal's memory for its whole life)
    assert read == [(n, bytes([n]), 200_000) for n in range(100)]
    assert reopened.pending_count == 100
    assert peak < 2_000_000


def test_journal_file_is_private(start: Start, state_dir: Path) -> None:
    start()
    assert os.stat(state_dir / JOURNAL_FILE).st_mode & 0o077 == 0


def test_a_failed_journal_append_stops_all_service(
    start: Start, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a table, and then a disk that refuses the next journal append
    aws = start()
    ddb = create_counter_table(aws)
    assert aws.journal is not None

    def disk_full(chunks: list[bytes]) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(aws.journal, "write_out", disk_full)
    # When a write is applied by moto but cannot be journaled
    with pytest.raises(ClientError):
        ddb.put_item(TableName=TABLE, Item={"pk": {"S": "lost"}, "n": {"N": "1"}})
    # Then nobody can read what a restart would not bring back
    with pytest.raises(ClientError) as refused:
        ddb.get_item(TableName=TABLE, Key={"pk": {"S": "lost"}})
    assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503


def test_this_process_calls_in_process_and_answers_as_over_http(tmp_path: Path) -> None:
    """The functions' calls skip the socket (shoal.local.transport) yet get the answers a call
    over HTTP gets: errors, streamed bodies, journaling."""
    over_http = EmbeddedAws(state_dir=tmp_path / "http", in_process=False)
    over_http.start()
    try:
        answers_http = _same_calls(over_http)
        assert over_http._transport is None
    finally:
        over_http.stop()
    aws = EmbeddedAws(state_dir=tmp_path / "in-process")
    aws.start()
    try:
        answers = _same_calls(aws)
        assert aws._transport is not None and aws._transport.calls >= 6
        # the four DynamoDB calls went to moto's handler without Flask, S3's through the server
        assert aws._transport.handed == 4
    finally:
        aws.stop()
    assert answers == answers_http
    assert journal_length(tmp_path / "in-process") == journal_length(tmp_path / "http") == 4
    # a stopped emulator's clients meet its closed port, as they would over HTTP
    with pytest.raises(Exception, match="Could not connect"):
        client(aws, "s3").list_buckets()


def _same_calls(aws: EmbeddedAws) -> list[Any]:
    ddb = create_counter_table(aws)
    ddb.put_item(TableName=TABLE, Item={"pk": {"S": "a"}, "n": {"N": "1"}})
    with pytest.raises(ClientError) as failed:
        ddb.put_item(
            TableName=TABLE, Item={"pk": {"S": "a"}}, ConditionExpression="attribute_not_exists(pk)"
        )
    s3 = client(aws, "s3")
    s3.create_bucket(Bucket="archive")
    s3.put_object(Bucket="archive", Key="k", Body=b"x" * 100_000, Metadata={"my_key": "v"})
    obj = s3.get_object(Bucket="archive", Key="k")
    return [
        failed.value.response["Error"]["Code"],
        ddb.get_item(TableName=TABLE, Key={"pk": {"S": "a"}})["Item"],
        len(obj["Body"].read()),
        obj["Metadata"],
    ]


def _tls_context(client: Any) -> Any:
    return client._endpoint.http_session._manager.connection_pool_kw["ssl_context"]


def test_clients_share_one_tls_context_unless_a_proxy_has_tls_settings() -> None:
    share_service_models()
    one = boto3.session.Session().client("sqs", region_name="us-east-1")
    other = boto3.session.Session().client("kinesis", region_name="eu-west-1")
    assert _tls_context(one) is _tls_context(other)
    # botocore loads a proxy's CA bundle into the context it gets: that one stays its own
    proxied = boto3.session.Session().client(
        "sqs",
        region_name="us-east-1",
        config=Config(
            proxies={"https": "http://127.0.0.1:9"},
            proxies_config={"proxy_ca_bundle": certifi.where()},
        ),
    )
    assert _tls_context(proxied) is not _tls_context(one)


def test_a_call_handed_over_in_process_is_journaled_and_replayed_through_the_server(
    start: Start, state_dir: Path
) -> None:
    """A DynamoDB or Kinesis call handed to moto's handler without Flask is journaled (only
    when it succeeded) in the form a restart replays through the server's own path."""
    aws = start()
    ddb = create_counter_table(aws)
    kinesis = client(aws, "kinesis")
    kinesis.create_stream(StreamName="s", ShardCount=1)
    handed = aws._transport.handed if aws._transport else 0
    ddb.update_item(
        TableName=TABLE,
        Key={"pk": {"S": "a"}},
        UpdateExpression="ADD n :one",
        ExpressionAttributeValues={":one": {"N": "1"}},
    )
    with pytest.raises(ClientError):
        ddb.update_item(
            TableName=TABLE,
            Key={"pk": {"S": "a"}},
            UpdateExpression="ADD n :one",
            ConditionExpression="n > :one",
            ExpressionAttributeValues={":one": {"N": "1"}},
        )
    sequence = kinesis.put_record(StreamName="s", Data=b"x", PartitionKey="k")["SequenceNumber"]
    assert aws._transport is not None and aws._transport.handed == handed + 3
    assert journal_length(state_dir) == 4  # table, stream, update, record; not the refused one

    again = start()
    item = client(again, "dynamodb").get_item(TableName=TABLE, Key={"pk": {"S": "a"}})["Item"]
    assert item["n"] == {"N": "1"}
    kinesis = client(again, "kinesis")
    shard = kinesis.list_shards(StreamName="s")["Shards"][0]["ShardId"]
    iterator = kinesis.get_shard_iterator(
        StreamName="s", ShardId=shard, ShardIteratorType="TRIM_HORIZON"
    )["ShardIterator"]
    records = kinesis.get_records(ShardIterator=iterator)["Records"]
    assert [(r["SequenceNumber"], r["Data"]) for r in records] == [(sequence, b"x")]


def test_an_sqs_call_is_handed_over_in_process_and_its_messages_are_not_journaled(
    start: Start, state_dir: Path
) -> None:
    """SQS's JSON-protocol calls (the push queue's sends, the mappings' receives and deletes)
    go to moto's handler without Flask, as DynamoDB's and Kinesis' do: the queue is journaled
    and comes back on a restart, its messages are not (``TRANSIENT_QUEUE_ACTIONS``), and a
    send still wakes the queues' pollers."""
    from shoal.local.aws import QUEUE_SENDS

    aws = start()
    sqs = client(aws, "sqs")
    assert aws._transport is not None
    handed, journaled = aws._transport.handed, journal_length(state_dir)
    url = sqs.create_queue(
        QueueName="lanes.fifo",
        Attributes={"FifoQueue": "true", "ContentBasedDeduplication": "true"},
    )["QueueUrl"]
    sends = QUEUE_SENDS.count
    sqs.send_message(QueueUrl=url, MessageBody="push", MessageGroupId="lane-1")
    assert QUEUE_SENDS.count == sends + 1
    (message,) = sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10)["Messages"]
    assert message["Body"] == "push"
    sqs.delete_message(QueueUrl=url, ReceiptHandle=message["ReceiptHandle"])
    with pytest.raises(ClientError, match="NonExistentQueue"):
        sqs.get_queue_url(QueueName="missing")
    assert aws._transport.handed == handed + 5
    assert journal_length(state_dir) == journaled + 1  # the queue, not its message calls

    again = start()
    sqs = client(again, "sqs")
    url = sqs.get_queue_url(QueueName="lanes.fifo")["QueueUrl"]
    attributes = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["All"])["Attributes"]
    assert attributes["FifoQueue"] == "true"
    assert attributes["ApproximateNumberOfMessages"] == "0"


def _features(user_agent: str) -> list[str]:
    """The feature ids a User-Agent names (its ``m/`` part)."""
    return next((p[2:].split(",") for p in user_agent.split() if p.startswith("m/")), [])


def test_a_clients_user_agent_is_built_once_per_set_of_features(
    start: Start, monkeypatch: pytest.MonkeyPatch
) -> None:
    """botocore built a client's User-Agent from the same parts twice a call; under the
    emulator it is kept per set of features: built again only for features it has not seen,
    and a copy for another client config builds its own."""
    import botocore.useragent
    from botocore.context import start_as_current_context
    from botocore.useragent import register_feature_id

    aws = start()
    creator = client(aws, "dynamodb")._user_agent_creator
    builds: list[int] = []
    parts = botocore.useragent.UserAgentString._build_sdk_metadata  # type: ignore[attr-defined]

    def counted(self: Any) -> Any:
        builds.append(id(self))
        return parts(self)

    monkeypatch.setattr(botocore.useragent.UserAgentString, "_build_sdk_metadata", counted)
    first = creator.to_string()
    assert creator.to_string() == first and len(builds) <= 1
    with start_as_current_context():
        register_feature_id("WAITER")
        featured = creator.to_string()
        assert creator.to_string() == featured
    assert featured != first and "B" in _features(featured) and "B" not in _features(first)
    other = creator.with_client_config(Config(user_agent_extra="shoal-test"))
    assert other.to_string().endswith("shoal-test") and "shoal-test" not in first
    assert creator.to_string() == first
    assert builds.count(id(creator)) <= 2 and builds.count(id(other)) == 1


def test_the_emulator_calls_skip_only_the_signature_arithmetic(start: Start) -> None:
    """A JSON-protocol call handed over in-process carries the credential scope moto reads,
    not a computed signature; a call to any other endpoint is signed as usual; a call without
    credentials is refused as botocore refuses it."""
    aws = start()
    seen: list[str] = []

    def keep(request: Any, **_: Any) -> None:
        seen.append(request.headers["Authorization"].decode())

    ddb = create_counter_table(aws)
    ddb.meta.events.register_last("before-send.dynamodb", keep)
    ddb.list_tables()
    assert seen[-1].startswith("AWS4-HMAC-SHA256 Credential=testing/")
    assert "/us-east-1/dynamodb/aws4_request" in seen[-1]
    assert seen[-1].endswith("Signature=in-process")

    # another endpoint (here the same server, addressed by another name) is signed in full
    other = boto3.session.Session(
        aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1"
    ).client("dynamodb", endpoint_url=f"http://localhost:{aws.port}", config=CLIENT_CONFIG)
    other.meta.events.register_last("before-send.dynamodb", keep)
    other.list_tables()
    assert re.search(r"Signature=[0-9a-f]{64}$", seen[-1])

    bare = client(aws, "dynamodb")
    bare._request_signer._credentials = None  # as with no credentials anywhere
    with pytest.raises(NoCredentialsError):
        bare.list_tables()


def test_the_journal_writes_outside_the_lock_and_no_answer_leaves_before_its_disk_write(
    start: Start, state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Group commit: a write's record goes to disk after the backend lock is let go, with the
    records staged meanwhile, and no answer (a read's neither) leaves before what it may have
    seen is on disk."""
    aws = start()
    ddb = create_counter_table(aws)
    journal = aws.journal
    assert journal is not None
    write_out = journal.write_out
    writing, go_on = threading.Event(), threading.Event()
    written: list[int] = []

    def slow_disk(chunks: list[bytes]) -> None:
        writing.set()
        assert go_on.wait(10)
        written.append(len(chunks))
        write_out(chunks)

    monkeypatch.setattr(journal, "write_out", slow_disk)
    answers: list[str] = []

    def put(key: str) -> None:
        ddb.put_item(TableName=TABLE, Item={"pk": {"S": key}})
        answers.append(key)

    def read() -> None:
        ddb.get_item(TableName=TABLE, Key={"pk": {"S": "a"}})
        answers.append("read")

    # Given a write whose disk write hangs
    first = threading.Thread(target=put, args=("a",))
    first.start()
    assert writing.wait(10)
    # Then the lock is free meanwhile: two more writes and a read are applied and staged...
    rest = [threading.Thread(target=put, args=(k,)) for k in ("b", "c")]
    rest.append(threading.Thread(target=read))
    for t in rest:
        t.start()
    deadline = time.monotonic() + 10
    while journal.staged_seq < journal.durable_seq + 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert journal.staged_seq == journal.durable_seq + 3
    # ...but none of the four is answered before the disk has what it saw
    time.sleep(0.2)
    assert answers == []
    go_on.set()
    for t in [first, *rest]:
        t.join(10)
    assert sorted(answers) == ["a", "b", "c", "read"]
    # the first write alone, then the two staged behind it together
    assert written == [1, 2]
    assert journal_length(state_dir) == 4  # the table and the three items


def test_a_throttled_dynamodb_call_is_refused_unapplied(start: Start) -> None:
    """``SHOAL_DEV_THROTTLE=dynamodb=...``: the call is refused as DynamoDB refuses it, and
    changes nothing; other services are not throttled."""
    aws = start()
    ddb = create_counter_table(aws)
    # Given every DynamoDB call refused
    aws.throttle(Throttles.parse("dynamodb=1.0"))
    try:
        with pytest.raises(ClientError) as refused:
            ddb.put_item(TableName=TABLE, Item={"pk": {"S": "a"}, "n": {"N": "1"}})
        # S3 answers as ever
        client(aws, "s3").create_bucket(Bucket="unthrottled")
    finally:
        aws.throttle(None)
    # Then the refusal is DynamoDB's throttling error, and the item was never written
    assert refused.value.response["Error"]["Code"] == "ProvisionedThroughputExceededException"
    assert "Item" not in ddb.get_item(TableName=TABLE, Key={"pk": {"S": "a"}})
