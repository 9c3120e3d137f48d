"""What the emulator changes in moto answers as moto did: a Query reads only the queried
partition; attribute values are written into responses directly."""

from __future__ import annotations

import gc
import json
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import boto3
import pytest
from boto3.dynamodb.conditions import Key
from moto import mock_aws
from moto.core.serialize import BaseJSONSerializer
from moto.dynamodb.models.dynamo_type import DynamoType, Item
from moto.dynamodb.models.table import Table
from shoal.local import moto_dynamodb
from shoal.local.aws import adapt_moto
from shoal.local.moto_dynamodb import _attribute_value_json, _NotAnAttributeValue


@pytest.fixture
def table() -> Iterator[Any]:
    adapt_moto()
    with mock_aws():
        dynamodb = boto3.resource("dynamodb", region_name="us-east-1")
        table = dynamodb.create_table(
            TableName="t",
            KeySchema=[
                {"AttributeName": "p", "KeyType": "HASH"},
                {"AttributeName": "k", "KeyType": "RANGE"},
            ],
            AttributeDefinitions=[
                {"AttributeName": "p", "AttributeType": "S"},
                {"AttributeName": "k", "AttributeType": "N"},
                {"AttributeName": "g", "AttributeType": "S"},
            ],
            GlobalSecondaryIndexes=[
                {
                    "IndexName": "by_g",
                    "KeySchema": [{"AttributeName": "g", "KeyType": "HASH"}],
                    "Projection": {"ProjectionType": "ALL"},
                }
            ],
            BillingMode="PAY_PER_REQUEST",
        )
        with table.batch_writer() as batch:
            for p in ("a", "b", "c"):
                for k in (5, 1, 10, 3, 7):
                    batch.put_item(Item={"p": p, "k": k, "g": f"g{k % 2}", "v": f"{p}{k}"})
        yield table


def _values(answer: dict[str, Any]) -> list[str]:
    return [i["v"] for i in answer["Items"]]


def test_a_table_query_never_reads_the_whole_table(
    table: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given moto's whole-table read made to fail
    def whole_table(self: Table) -> list[Any]:
        raise AssertionError("the query read every item of the table")

    monkeypatch.setattr(Table, "all_items", whole_table)

    # When a partition is queried, forwards, backwards, under a key condition
    forward = table.query(
        KeyConditionExpression="p = :p AND k > :k", ExpressionAttributeValues={":p": "b", ":k": 3}
    )
    backward = table.query(
        KeyConditionExpression="p = :p",
        ExpressionAttributeValues={":p": "c"},
        ScanIndexForward=False,
    )
    nothing = table.query(KeyConditionExpression="p = :p", ExpressionAttributeValues={":p": "z"})

    # Then it answers that partition's items in key order, as DynamoDB does
    assert _values(forward) == ["b5", "b7", "b10"]
    assert _values(backward) == ["c10", "c7", "c5", "c3", "c1"]
    assert _values(nothing) == []


def test_a_table_query_sizes_only_the_items_its_key_condition_names(
    table: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given moto's item sizes watched
    sized: set[tuple[str, str]] = set()
    size = Item.size

    def watched(self: Item) -> int:
        sized.add((str(self.hash_key.value), str(self.range_key.value)))
        return size(self)

    monkeypatch.setattr(Item, "size", watched)

    # When one partition's items past a key are queried
    answer = table.query(
        KeyConditionExpression="p = :p AND k > :k", ExpressionAttributeValues={":p": "a", ":k": 5}
    )

    # Then only those items were sized, and answered
    assert _values(answer) == ["a7", "a10"]
    assert sized == {("a", "7"), ("a", "10")}


def test_a_limited_table_query_pages_through_the_partition(table: Any) -> None:
    # Given a query of two items a page
    pages: list[list[str]] = []
    kwargs: dict[str, Any] = {}
    while True:
        answer = table.query(
            KeyConditionExpression="p = :p",
            ExpressionAttributeValues={":p": "a"},
            Limit=2,
            **kwargs,
        )
        pages.append(_values(answer))
        if "LastEvaluatedKey" not in answer:
            break
        kwargs = {"ExclusiveStartKey": answer["LastEvaluatedKey"]}

    # Then the pages hold the partition once, in key order
    assert pages == [["a1", "a3"], ["a5", "a7"], ["a10"]]


def test_an_index_query_still_finds_items_of_every_partition(table: Any) -> None:
    answer = table.query(
        IndexName="by_g", KeyConditionExpression="g = :g", ExpressionAttributeValues={":g": "g0"}
    )
    assert sorted(_values(answer)) == ["a10", "b10", "c10"]


EVERY_KIND: dict[str, Any] = {
    "p": {"S": "every"},
    "k": {"N": "1.50"},
    "empty": {"S": ""},
    "bin": {"B": b"\x00\xffhi"},
    "yes": {"BOOL": True},
    "no": {"BOOL": False},
    "null": {"NULL": True},
    "strings": {"SS": ["x", "y"]},
    "numbers": {"NS": ["1", "-2.5"]},
    "binaries": {"BS": [b"a", b"\x01"]},
    "none": {"L": []},
    "map": {
        "M": {
            "empty": {"M": {}},
            "list": {"L": [{"S": "q"}, {"B": b"zz"}, {"L": []}, {"M": {"n": {"N": "-3"}}}]},
            "null": {"NULL": True},
        }
    },
}


def _reads(client: Any) -> list[dict[str, Any]]:
    key = {"p": {"S": "every"}, "k": {"N": "1.5"}}
    answers = [
        # first, so that both rounds of reads see the same item
        client.update_item(
            TableName="t",
            Key=key,
            UpdateExpression="SET extra = :v",
            ExpressionAttributeValues={":v": {"B": b"q"}},
            ReturnValues="ALL_NEW",
        ),
        client.get_item(TableName="t", Key=key),
        client.query(
            TableName="t",
            KeyConditionExpression="p = :p",
            ExpressionAttributeValues={":p": {"S": "every"}},
        ),
        client.query(
            TableName="t",
            KeyConditionExpression="p = :p",
            ExpressionAttributeValues={":p": {"S": "a"}},
            Limit=2,
        ),
        client.scan(TableName="t", Limit=4),
        client.batch_get_item(RequestItems={"t": {"Keys": [key]}}),
        client.transact_get_items(TransactItems=[{"Get": {"TableName": "t", "Key": key}}]),
    ]
    return [{k: v for k, v in a.items() if k != "ResponseMetadata"} for a in answers]


def test_attribute_values_are_written_as_moto_writes_them(
    table: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given an item holding every kind of attribute value, nested ones too
    client = boto3.client("dynamodb", region_name="us-east-1")
    client.put_item(TableName="t", Item=EVERY_KIND)
    assert getattr(BaseJSONSerializer._serialize, "_attribute_values", False)

    # When the same reads are answered directly and by moto's own serializer
    direct = _reads(client)
    monkeypatch.setattr(
        BaseJSONSerializer,
        "_serialize",
        BaseJSONSerializer._serialize.__wrapped__,
    )
    generic = _reads(client)

    # Then the clients read the same answers
    assert direct == generic
    assert direct[1]["Item"]["bin"] == {"B": b"\x00\xffhi"}


@pytest.mark.parametrize(
    "value", [{}, {"S": "x", "N": "1"}, {"X": "y"}, {"M": {"a": "not a value"}}, "S"]
)
def test_what_is_not_an_attribute_value_goes_the_generic_way(value: Any) -> None:
    with pytest.raises(_NotAnAttributeValue):
        _attribute_value_json(value)


def test_a_response_class_is_listed_once(table: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """moto lists a response class's methods on every request; the emulator lists each class
    once (``cache_action_names``), and every action is still answered."""
    import inspect

    from moto.core import responses

    listed: list[object] = []
    original = inspect.getmembers

    def counting(obj: object, predicate: Any = None) -> Any:
        listed.append(obj)
        return original(obj, predicate)

    monkeypatch.setattr(inspect, "getmembers", counting)
    responses.method_names_from_class.cache_clear()
    for n in range(5):
        table.put_item(Item={"p": "listed", "k": n})
    assert len(table.query(KeyConditionExpression=Key("p").eq("listed"))["Items"]) == 5
    from moto.dynamodb.responses import DynamoHandler

    assert listed.count(DynamoHandler) == 1


def test_an_update_expression_is_parsed_once_and_each_update_gets_its_own_values(
    table: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """moto parsed an UpdateExpression twice a call (``parse_update_expressions_once``): the
    emulator keeps each text's tree, and every update still applies its own values."""
    from moto.dynamodb.parsing.tokens import ExpressionTokenizer

    tokenized: list[str] = []
    original = ExpressionTokenizer.make_list

    def counting(expression: str) -> Any:
        tokenized.append(expression)
        return original(expression)

    monkeypatch.setattr(ExpressionTokenizer, "make_list", staticmethod(counting))
    expression = "SET #v = :v, n = if_not_exists(n, :zero) + :one REMOVE gone"
    for k in (1, 3, 5):
        table.update_item(
            Key={"p": "a", "k": k},
            UpdateExpression=expression,
            ExpressionAttributeNames={"#v": "v"},
            ExpressionAttributeValues={":v": f"new{k}", ":zero": 0, ":one": k},
        )
    table.update_item(
        Key={"p": "a", "k": 1},
        UpdateExpression=expression,
        ExpressionAttributeNames={"#v": "v"},
        ExpressionAttributeValues={":v": "again", ":zero": 0, ":one": 10},
    )
    assert tokenized.count(expression) <= 1
    items = {i["k"]: i for i in table.query(KeyConditionExpression=Key("p").eq("a"))["Items"]}
    assert (items[1]["v"], items[1]["n"]) == ("again", 11)
    assert (items[3]["v"], items[3]["n"]) == ("new3", 3)
    assert (items[5]["v"], items[5]["n"]) == ("new5", 5)
    assert items[7]["v"] == "a7" and "n" not in items[7]


@pytest.mark.parametrize(
    "expression",
    [
        "SET v = :v SET w = :v",
        "ADD n :one ADD m :one",
        "REMOVE v REMOVE w",
        "SET v = :v, v = :v",
        "SET p = :v",
        "SET v = nothing(:v)",
        "SET v = :missing",
    ],
)
def test_an_update_moto_refuses_is_still_refused(table: Any, expression: str) -> None:
    """The validators' maps kept per processor and the action count checked at the root
    (``traverse_with_fixed_maps``) refuse what moto refused, and change nothing."""
    from botocore.exceptions import ClientError

    with pytest.raises(ClientError) as refused:
        table.update_item(
            Key={"p": "a", "k": 1},
            UpdateExpression=expression,
            ExpressionAttributeValues={":v": "x", ":one": 1},
        )
    assert refused.value.response["Error"]["Code"] == "ValidationException"
    assert table.get_item(Key={"p": "a", "k": 1})["Item"] == {
        "p": "a",
        "k": 1,
        "g": "g1",
        "v": "a1",
    }


def test_a_validator_builds_its_map_once_an_update(
    table: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """moto built a processor's map of node types at every node it walked; now once."""
    from moto.dynamodb.parsing.validators import ExpressionAttributeValueProcessor

    built: list[object] = []
    original = ExpressionAttributeValueProcessor._processing_map

    def counting(self: Any) -> Any:
        built.append(self)
        return original(self)

    monkeypatch.setattr(ExpressionAttributeValueProcessor, "_processing_map", counting)
    table.update_item(
        Key={"p": "b", "k": 3},
        UpdateExpression="SET a = :a, b = :b, c = list_append(:l, :l)",
        ExpressionAttributeValues={":a": "1", ":b": 2, ":l": [1]},
    )
    assert len(built) == 1
    item = table.get_item(Key={"p": "b", "k": 3})["Item"]
    assert (item["a"], item["b"], item["c"]) == ("1", 2, [1, 1])


def test_a_condition_is_lexed_once_and_each_call_gets_its_own_names_and_values(
    table: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """moto lexed a ConditionExpression from its text twice a call (``lex_conditions_once``):
    the emulator keeps each text's tokens, and every call still resolves its own names and
    values: the writes it allows go through, the ones it refuses are refused."""
    from botocore.exceptions import ClientError
    from moto.dynamodb.comparisons import ConditionExpressionParser

    lexed: list[str] = []
    original = ConditionExpressionParser._lex_one_node

    def counting(self: Any, remaining: str) -> Any:
        lexed.append(remaining)
        return original(self, remaining)

    monkeypatch.setattr(ConditionExpressionParser, "_lex_one_node", counting)
    condition = "#v = :old AND (attribute_not_exists(#u) OR #u < :now)"
    allowed = []
    for k, old in ((1, "a1"), (3, "nope"), (5, "a5")):
        try:
            table.update_item(
                Key={"p": "a", "k": k},
                UpdateExpression="SET #u = :now",
                ConditionExpression=condition,
                ExpressionAttributeNames={"#v": "v", "#u": "until"},
                ExpressionAttributeValues={":old": old, ":now": k},
            )
            allowed.append(k)
        except ClientError as exc:
            assert exc.response["Error"]["Code"] == "ConditionalCheckFailedException"
    # the same text with other names: its own attribute, resolved for this call
    with pytest.raises(ClientError):
        table.update_item(
            Key={"p": "a", "k": 1},
            UpdateExpression="SET #u = :now",
            ConditionExpression=condition,
            ExpressionAttributeNames={"#v": "g", "#u": "until"},
            ExpressionAttributeValues={":old": "a1", ":now": 9},
        )
    assert allowed == [1, 5]
    assert lexed.count(condition) <= 1
    items = {i["k"]: i for i in table.query(KeyConditionExpression=Key("p").eq("a"))["Items"]}
    assert (items[1]["until"], items[5]["until"]) == (1, 5)
    assert "until" not in items[3]


def test_an_item_nothing_holds_any_more_is_let_go(table: Any) -> None:
    # Given an item put and then overwritten, and a query's answer read and dropped: of the
    # Item objects moto made for them, only the table's current one is referenced
    marker = f"let-go-{uuid.uuid4().hex}"
    table.put_item(Item={"p": marker, "k": 1, "v": "first"})
    table.put_item(Item={"p": marker, "k": 1, "v": "second"})
    table.query(KeyConditionExpression=Key("p").eq(marker))

    # When the garbage is collected
    gc.collect()

    # Then only that one is alive (soak, issue 47: moto kept every model object it ever made
    # for its dashboard, and shoal dev grew by ~30 MB a minute)
    alive = [
        o for o in gc.get_objects() if type(o) is Item and o.hash_key == DynamoType({"S": marker})
    ]
    assert [o.attrs["v"].value for o in alive] == ["second"]


def test_metric_queries_put_each_datapoint_in_its_period_as_moto_did() -> None:
    """``GetMetricData``'s metric queries answer as moto's own loop over periods answered,
    for random datapoints (single values and statistic sets, units, dimensions, namespaces)."""
    import datetime as dt
    import random

    from moto.cloudwatch.models import CloudWatchBackend
    from shoal.local.moto_cloudwatch import bucket_metric_queries

    bucket_metric_queries()
    bucketed = CloudWatchBackend.get_metric_data
    original = bucketed._moto
    assert not getattr(original, "_bucketed", False)
    rng = random.Random(7)
    start = dt.datetime(2026, 12, 4, 20, 0, tzinfo=dt.UTC)
    with mock_aws():
        cloudwatch = boto3.client("cloudwatch", region_name="us-east-1")
        data: list[dict[str, Any]] = []
        for _ in range(400):
            dims = [{"Name": "service", "Value": rng.choice(["publish", "edge", "reaper"])}]
            if rng.random() < 0.3:
                dims.append({"Name": "subscription", "Value": rng.choice(["a", "b"])})
            datum: dict[str, Any] = {
                "MetricName": rng.choice(["MessagesPublished", "RouterLag"]),
                "Dimensions": dims,
                "Timestamp": start + dt.timedelta(seconds=rng.randrange(0, 4 * 3600)),
                "Unit": rng.choice(["Count", "Milliseconds"]),
            }
            if rng.random() < 0.5:
                datum["Value"] = rng.randrange(0, 50)
            else:
                low = rng.randrange(0, 10)
                datum["StatisticValues"] = {
                    "SampleCount": 3,
                    "Sum": low * 3 + 4,
                    "Minimum": low,
                    "Maximum": low + 4,
                }
            data.append(datum)
        for at in range(0, len(data), 20):
            cloudwatch.put_metric_data(Namespace="Shoal", MetricData=data[at : at + 20])
        backend = next(iter(next(iter(_cloudwatch_backends().values())).values()))
        queries = [
            {
                "Id": f"q{n}",
                "MetricStat": {
                    "Metric": {
                        "Namespace": namespace,
                        "MetricName": name,
                        "Dimensions": dims,
                    },
                    "Period": period,
                    "Stat": stat,
                    **({"Unit": unit} if unit else {}),
                },
                "ReturnData": n % 5 != 0,
            }
            for n, (namespace, name, dims, period, stat, unit) in enumerate(
                (
                    rng.choice(["Shoal", "Other"]),
                    rng.choice(["MessagesPublished", "RouterLag"]),
                    rng.choice(
                        [
                            [],
                            [{"Name": "service", "Value": "publish"}],
                            [
                                {"Name": "service", "Value": "edge"},
                                {"Name": "subscription", "Value": "a"},
                            ],
                        ]
                    ),
                    rng.choice([60, 300, 3600]),
                    rng.choice(["Sum", "Maximum", "Minimum", "Average", "SampleCount"]),
                    rng.choice([None, "Count"]),
                )
                for _ in range(60)
            )
        ]
        # the backend holds times as moto's responses parse them: naive, in UTC
        begin = start.replace(tzinfo=None)
        for end in (begin + dt.timedelta(hours=4), begin + dt.timedelta(minutes=90)):
            for scan_by in ("TimestampAscending", "TimestampDescending"):
                expected = original(backend, queries, begin, end, scan_by)
                assert bucketed(backend, queries, begin, end, scan_by) == expected
                assert any(r["values"] for r in expected)


def _cloudwatch_backends() -> Any:
    from moto.cloudwatch.models import cloudwatch_backends

    return cloudwatch_backends


def test_a_receive_checks_retention_as_moto_did_without_building_the_queues_attributes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The check a receive makes of each message it hands out answers as moto's: past its
    queue's retention period a message is not valid, within it it is; and it no longer builds
    every attribute of the queue (a walk of all its messages) for each message."""
    import moto.sqs.models as sqs_models

    adapt_moto()
    check = sqs_models.SQSBackend.is_message_valid_based_on_retention_period
    assert getattr(check, "_direct", False)
    now = [1_000_000.0]
    monkeypatch.setattr(sqs_models, "unix_time", lambda: now[0])
    monkeypatch.setattr(sqs_models, "unix_time_millis", lambda: now[0] * 1000)
    built: list[int] = []
    attributes = sqs_models.Queue.attributes

    def counting(queue: Any) -> Any:
        built.append(1)
        return attributes.fget(queue)

    monkeypatch.setattr(sqs_models.Queue, "attributes", property(counting))
    with mock_aws():
        sqs = boto3.client("sqs", region_name="us-east-1")
        url = sqs.create_queue(QueueName="q", Attributes={"MessageRetentionPeriod": "60"})[
            "QueueUrl"
        ]
        backend = sqs_models.sqs_backends["123456789012"]["us-east-1"]
        sqs.send_message(QueueUrl=url, MessageBody="old")
        now[0] += 59
        sqs.send_message(QueueUrl=url, MessageBody="young")
        queue = backend.get_queue("q")
        old, young = list(queue._messages)
        # the two answers, as moto's own check gives them, at 59 s and past 60 s
        for at in (now[0], now[0] + 2):
            now[0] = at
            built.clear()
            ours = [check(backend, "q", m) for m in (old, young)]
            assert not built
            assert ours == [check._moto(backend, "q", m) for m in (old, young)]
        assert ours == [False, True]


ARN = "arn:aws:sqs:us-east-1:123456789012"


def test_a_send_reads_the_attributes_it_asks_for_as_moto_built_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Within a send, a queue's attributes are built as asked, not all at once (each build
    counted every message of the queue); each answer is moto's, and the FIFO queue's
    content-based deduplication still works. Outside a send the property is moto's."""
    import moto.sqs.models as sqs_models
    from shoal.local import moto_sqs

    adapt_moto()
    counted: list[int] = []
    real = sqs_models.Queue.approximate_number_of_messages

    def counting(queue: Any) -> int:
        counted.append(1)
        return real.fget(queue)

    monkeypatch.setattr(sqs_models.Queue, "approximate_number_of_messages", property(counting))
    with mock_aws():
        sqs = boto3.client("sqs", region_name="us-east-1")
        sqs.create_queue(QueueName="d.fifo", Attributes={"FifoQueue": "true"})
        url = sqs.create_queue(
            QueueName="q.fifo",
            Attributes={
                "FifoQueue": "true",
                "ContentBasedDeduplication": "true",
                "RedrivePolicy": json.dumps(
                    {"deadLetterTargetArn": f"{ARN}:d.fifo", "maxReceiveCount": "3"}
                ),
            },
        )["QueueUrl"]
        counted.clear()
        for body in ("a", "b", "a"):
            sqs.send_message(QueueUrl=url, MessageBody=body, MessageGroupId="g")
        # the third, the same body within the deduplication interval, was not added
        assert not counted
        # nor does a batch (moto checks every entry before it sends any): the one new body
        # goes in, the repeated one does not
        answer = sqs.send_message_batch(
            QueueUrl=url,
            Entries=[
                {"Id": "1", "MessageBody": "b", "MessageGroupId": "g"},
                {"Id": "2", "MessageBody": "c", "MessageGroupId": "g"},
            ],
        )
        assert len(answer["Successful"]) == 2
        assert not counted
        queue = sqs_models.sqs_backends["123456789012"]["us-east-1"].get_queue("q.fifo")
        whole = sqs_models.Queue.attributes.fget(queue)
        assert counted and whole["ApproximateNumberOfMessages"] == 3
        asked = moto_sqs._AsAsked(queue, lambda q: whole)
        for name in [*whole, "KmsMasterKeyId", "Nothing"]:
            assert asked.get(name) == whole.get(name), name
        assert dict(asked) == whole


def test_a_projection_converts_each_item_once_and_answers_as_moto_did(
    table: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ProjectionExpression's paths are read from one conversion of the item
    (``project_from_one_conversion``): a group's load projects 24 attributes, and moto
    converted the whole item once a path. Overlapping paths, list elements, nested maps,
    sets, numbers and a missing path each pick what moto's own projection picks."""
    from moto.dynamodb.models import dynamodb_backends

    table.put_item(
        Item={
            "p": "proj",
            "k": 1,
            "m": {"a": {"b": 1, "c": "x"}, "d": [1, {"e": "f"}]},
            "l": ["zero", {"one": 1}, {"two": [2, 2]}],
            "s": {"p", "q"},
            "n": Decimal("12.5"),
        }
    )
    stored = dynamodb_backends["123456789012"]["us-east-1"].get_table("t")
    item = stored.get_item(DynamoType({"S": "proj"}), DynamoType({"N": "1"}))
    converted: list[int] = []
    to_regular_json = Item.to_regular_json

    def counting(self: Item) -> Any:
        converted.append(1)
        return to_regular_json(self)

    monkeypatch.setattr(Item, "to_regular_json", counting)
    for projection in (
        "m, m.a.b",
        "m.a.b, m",
        "m.a.b, m.a.c, m.d[1].e",
        "l[1], l",
        "l, l[2].two",
        "s, n, nothing, m.nothing.deeper",
        "m.d[0], m.d[1]",
        "p, k, m, l, s, n",
    ):
        # moto's form of the paths: each split at its dots, a list index kept on its name
        paths = [path.strip().split(".") for path in projection.split(",")]
        converted.clear()
        ours = item.project(paths)
        assert len(converted) == 1, projection
        theirs = Item.project._moto(item, paths)
        assert ours.to_json() == theirs.to_json(), projection
    # and through the API: what the projection names, nothing else
    answer = table.get_item(Key={"p": "proj", "k": 1}, ProjectionExpression="m.a.b, l[1], n")
    assert answer["Item"] == {"m": {"a": {"b": 1}}, "l": [{"one": 1}], "n": Decimal("12.5")}


class _CountedRecords(OrderedDict[int, Any]):
    """A shard's records dict that counts the records its forward walks pass."""

    walked = 0

    def __iter__(self) -> Iterator[int]:
        for key in super().__iter__():
            _CountedRecords.walked += 1
            yield key

    def items(self) -> Any:
        return [(k, self[k]) for k in self]

    def keys(self) -> Any:
        return list(self)

    def values(self) -> Any:
        return [self[k] for k in self]


def _read_all(kinesis: Any, stream: str, shard_id: str, limit: int) -> list[str]:
    iterator = kinesis.get_shard_iterator(
        StreamName=stream, ShardId=shard_id, ShardIteratorType="TRIM_HORIZON"
    )["ShardIterator"]
    read: list[str] = []
    while True:
        answer = kinesis.get_records(ShardIterator=iterator, Limit=limit)
        read += [r["Data"].decode() for r in answer["Records"]]
        if not answer["Records"]:
            return read
        iterator = answer["NextShardIterator"]


def test_a_shard_is_read_from_a_position_not_walked_from_its_first_record(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A put numbers its record from the shard's last key, and GetRecords finds the records
    after its iterator by bisection (``read_shards_by_position``): moto walked every record of
    the shard for each, so under ``shoal dev``, which keeps every record, both grew with the
    stream's history. The answers are moto's: the same records in order, the same pages, the
    same next positions, after a split that moves the records too."""
    from moto.kinesis.models import Shard, kinesis_backends

    adapt_moto()
    with mock_aws():
        kinesis = boto3.client("kinesis", region_name="us-east-1")
        kinesis.create_stream(StreamName="s", ShardCount=1)
        shard = (
            kinesis_backends["123456789012"]["us-east-1"]
            .streams["s"]
            .shards["shardId-000000000000"]
        )
        shard.records = _CountedRecords(shard.records)
        for n in range(200):
            kinesis.put_record(StreamName="s", Data=f"r{n}".encode(), PartitionKey="k")
        assert _read_all(kinesis, "s", "shardId-000000000000", 7) == [f"r{n}" for n in range(200)]

        # Given a shard of 200 records, read once: every later put and read of its newest
        # records passes a few records of the dict's front, not all of them
        _CountedRecords.walked = 0
        last = kinesis.put_record(StreamName="s", Data=b"r200", PartitionKey="k")
        iterator = kinesis.get_shard_iterator(
            StreamName="s",
            ShardId="shardId-000000000000",
            ShardIteratorType="AT_SEQUENCE_NUMBER",
            StartingSequenceNumber=last["SequenceNumber"],
        )["ShardIterator"]
        answer = kinesis.get_records(ShardIterator=iterator)
        assert [r["Data"] for r in answer["Records"]] == [b"r200"]
        assert answer["MillisBehindLatest"] == 0
        assert _CountedRecords.walked < 10

        # And moto's own read answers the same, page by page
        original = Shard.get_records._moto
        for after in ("0", "1", "150", "200", "201", "500"):
            for limit in (None, 1, 7, 1000):
                assert shard.get_records(after, limit) == original(shard, after, limit)

        # When the shard is split (moto moves its records to the children), each child's
        # records are read as moto lays them out
        kinesis.split_shard(
            StreamName="s",
            ShardToSplit="shardId-000000000000",
            NewStartingHashKey=str(2**127),
        )
        children = kinesis.list_shards(StreamName="s")["Shards"]
        read = [data for c in children for data in _read_all(kinesis, "s", c["ShardId"], 50)]
        assert sorted(read) == sorted(f"r{n}" for n in range(201))


def _items(pages: list[dict[str, Any]]) -> list[Any]:
    return [item for page in pages for item in page["Items"]]


class _WatchedPartition(dict[Any, Any]):
    """A partition dict that counts the walks of its items."""

    walks = 0

    def values(self) -> Any:
        _WatchedPartition.walks += 1
        return super().values()


def _keyed_table(dynamodb: Any, name: str, kind: str) -> Any:
    return dynamodb.create_table(
        TableName=name,
        KeySchema=[
            {"AttributeName": "p", "KeyType": "HASH"},
            {"AttributeName": "k", "KeyType": "RANGE"},
        ],
        AttributeDefinitions=[
            {"AttributeName": "p", "AttributeType": "S"},
            {"AttributeName": "k", "AttributeType": kind},
        ],
        BillingMode="PAY_PER_REQUEST",
    )


def test_a_sort_key_condition_finds_its_items_by_bisection_as_moto_found_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A query's sort key condition is met from the partition's sorted keys
    (``shoal.local.moto_partitions``), kept in step by puts and deletes and sorted anew after a
    transaction's rollback: under ``shoal dev`` an inbox partition grows all run, and every
    idle long poll queried it by a walk of every item. Random puts, overwrites, deletes and a
    rolled-back transaction, with every kind of condition after each step, answer what moto's
    own query answers, and a partition once sorted is not walked again."""
    import random

    from boto3.dynamodb.conditions import Key
    from botocore.exceptions import ClientError
    from moto.dynamodb.models import dynamodb_backends

    adapt_moto()
    rng = random.Random(47)
    with mock_aws():
        dynamodb = boto3.resource("dynamodb", region_name="us-east-1")
        strings, numbers = _keyed_table(dynamodb, "s", "S"), _keyed_table(dynamodb, "n", "N")
        backend = dynamodb_backends["123456789012"]["us-east-1"]

        def key(table: Any) -> Any:
            if table is strings:
                return rng.choice(["a", "ab", "abc", "b", "ba", "c", "x#"]) + str(rng.randrange(30))
            return Decimal(rng.randrange(-50, 50)) / rng.choice([1, 4])

        for table in (strings, numbers):
            for _ in range(40):
                table.put_item(Item={"p": "one", "k": key(table), "v": "x"})
            moto_table = backend.get_table(table.name)
            hash_key = DynamoType({"S": "one"})
            moto_table.items[hash_key] = _WatchedPartition(moto_table.items[hash_key])

        def conditions(table: Any) -> list[Any]:
            a, b = sorted([key(table), key(table)])
            found = [
                Key("p").eq("one") & Key("k").eq(a),
                Key("p").eq("one") & Key("k").lt(a),
                Key("p").eq("one") & Key("k").lte(a),
                Key("p").eq("one") & Key("k").gt(a),
                Key("p").eq("one") & Key("k").gte(a),
                Key("p").eq("one") & Key("k").between(a, b),
            ]
            if table is strings:
                found += [Key("p").eq("one") & Key("k").begins_with(p) for p in ("a", "ab", "x")]
            return found

        def answered(table: Any, asked: dict[str, Any]) -> list[dict[str, Any]]:
            """Every page of the query, as the API answers them."""
            pages = [table.query(**asked)]
            while "LastEvaluatedKey" in pages[-1] and len(pages) < 100:
                pages.append(table.query(**asked, ExclusiveStartKey=pages[-1]["LastEvaluatedKey"]))
            return [{k: v for k, v in p.items() if k != "ResponseMetadata"} for p in pages]

        def same_as_moto(table: Any, some: int | None = None) -> None:
            asked_of = conditions(table)
            for condition in rng.sample(asked_of, some) if some else asked_of:
                for forward in (True, False):
                    for limit in (None, 4):
                        asked = {"KeyConditionExpression": condition, "ScanIndexForward": forward}
                        if limit is not None:
                            asked["Limit"] = limit
                        walked = _WatchedPartition.walks
                        ours = answered(table, asked)
                        # found without a walk of the partition's items
                        assert _WatchedPartition.walks == walked, condition.get_expression()
                        said = (table.name, condition.get_expression(), limit)
                        with monkeypatch.context() as walking:
                            # the partition walked, as before the sorted keys: the same pages
                            walking.setattr(moto_dynamodb, "candidates", lambda *_: None)
                            assert answered(table, asked) == ours, said
                        if limit is not None:
                            continue
                        with monkeypatch.context() as moto_own:
                            # moto's own query: the same items (paged, it may end a page on an
                            # item the condition does not name, which DynamoDB never reads)
                            moto_own.setattr(Table, "query", Table.query.__wrapped__)
                            theirs = answered(table, asked)
                        assert _items(ours) == _items(theirs), said

        for table in (strings, numbers):
            same_as_moto(table)
        for step in range(30):
            table = rng.choice([strings, numbers])
            done = rng.random()
            if done < 0.5:
                table.put_item(Item={"p": "one", "k": key(table), "v": f"put {step}"})
            elif done < 0.85:
                items = table.query(KeyConditionExpression=Key("p").eq("one"))["Items"]
                if items:
                    table.delete_item(Key={"p": "one", "k": rng.choice(items)["k"]})
            else:
                # a transaction that puts a new key, deletes one, then fails: rolled back
                items = table.query(KeyConditionExpression=Key("p").eq("one"))["Items"]
                with pytest.raises(ClientError):
                    table.meta.client.transact_write_items(
                        TransactItems=[
                            {
                                "Put": {
                                    "TableName": table.name,
                                    "Item": {
                                        "p": "one",
                                        "k": "zz" if table is strings else 999,
                                        "v": "t",
                                    },
                                }
                            },
                            {
                                "Delete": {
                                    "TableName": table.name,
                                    "Key": {"p": "one", "k": items[0]["k"]},
                                }
                            },
                            {
                                "ConditionCheck": {
                                    "TableName": table.name,
                                    "Key": {"p": "none", "k": items[0]["k"]},
                                    "ConditionExpression": "attribute_exists(p)",
                                }
                            },
                        ]
                    )
            same_as_moto(table, some=3)

        for table in (strings, numbers):
            same_as_moto(table)

        # and a page of one from the partition's start checks two items, not the partition
        compared: list[int] = []
        compare = DynamoType.compare

        def counting(self: DynamoType, *args: Any) -> bool:
            compared.append(1)
            return compare(self, *args)

        monkeypatch.setattr(DynamoType, "compare", counting)
        page = strings.query(KeyConditionExpression=Key("p").eq("one") & Key("k").gt("0"), Limit=1)
        assert page["Count"] == 1 and "LastEvaluatedKey" in page
        # ours checks the item and the one after it, moto's own check the item again
        assert len(compared) <= 3


def test_sorted_keys_that_name_a_gone_item_are_dropped_and_the_partition_walked(
    table: Any,
) -> None:
    """An item taken out of a partition behind ``Table.delete_item``'s back (nothing in moto
    or Shoal does; a guard) is not answered from the kept keys: they are dropped, the query
    walks the partition, and the next query sorts its keys anew."""
    from moto.dynamodb.models import dynamodb_backends
    from shoal.local import moto_partitions

    condition = Key("p").eq("a") & Key("k").gte(3)
    assert _values(table.query(KeyConditionExpression=condition)) == ["a3", "a5", "a7", "a10"]
    moto_table = dynamodb_backends["123456789012"]["us-east-1"].get_table("t")
    partition = moto_table.items[DynamoType({"S": "a"})]
    del partition[DynamoType({"N": "5"})]
    partition[DynamoType({"N": "6"})] = moto_table.get_item(
        DynamoType({"S": "a"}), DynamoType({"N": "7"})
    )

    assert _values(table.query(KeyConditionExpression=condition)) == ["a3", "a7", "a7", "a10"]
    assert moto_table not in moto_partitions._SORTED
    assert _values(table.query(KeyConditionExpression=condition)) == ["a3", "a7", "a7", "a10"]
    kept = moto_partitions._SORTED[moto_table][DynamoType({"S": "a"})]
    assert [k.value for k in kept.keys] == ["1", "3", "6", "7", "10"]
