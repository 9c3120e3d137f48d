"""The emulator's shortcuts through the SDKs' shape walks answer as the walks do: attribute values
parsed directly (``shoal.local.attribute_values``: botocore's parse of DynamoDB's answers, moto's of
its requests), moto's item size checked once (``size_items_once``) and its serializer's members
picked by known keys (``pick_members_by_known_keys``)."""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Iterator
from typing import Any

import boto3
import botocore.session
import pytest
from botocore import parsers
from botocore.exceptions import ClientError
from moto import mock_aws
from moto.core import parse as moto_parse
from moto.core.utils import get_service_model
from moto.dynamodb.exceptions import ItemSizeTooLarge
from moto.dynamodb.models.dynamo_type import Item
from shoal.local.attribute_values import _directly
from shoal.local.aws import adapt_moto
from shoal.local.moto_dynamodb import ITEM_LIMIT

B64 = base64.b64encode(b"\x00\xffbinary").decode()

#: every kind of attribute value, nested ones and empty ones
PLAIN: dict[str, Any] = {
    "s": {"S": "text"},
    "empty": {"S": ""},
    "n": {"N": "12.5"},
    "b": {"B": B64},
    "ss": {"SS": ["a", "b"]},
    "ns": {"NS": ["1", "2"]},
    "bs": {"BS": [B64, base64.b64encode(b"x").decode()]},
    "null": {"NULL": True},
    "yes": {"BOOL": True},
    "no": {"BOOL": False},
    "m": {"M": {"a": {"N": "1"}, "deeper": {"M": {"l": {"L": [{"S": "x"}, {"B": B64}]}}}}},
    "l": {"L": [{"M": {}}, {"L": []}, {"NS": ["3"]}, {"BOOL": False}]},
    "em": {"M": {}},
}
#: values a direct parse leaves to the walk: two members, an unknown one, a null member, a null
#: element of a list, a nested one
ODD: list[dict[str, Any]] = [
    {"two": {"S": "a", "N": "1"}},
    {"unknown": {"X": "1"}},
    {"null_member": {"S": None}},
    {"null_element": {"L": [{"S": "a"}, None]}},
    {"nested_odd": {"M": {"k": {"S": "a", "BOOL": True}}}},
]


def _answer(operation: str, body: dict[str, Any], parser: type) -> Any:
    model = botocore.session.get_session().get_service_model("dynamodb")
    shape = model.operation_model(operation).output_shape
    response = {"body": json.dumps(body).encode(), "headers": {}, "status_code": 200}
    return parser().parse(response, shape)


@pytest.fixture
def walks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The shapes botocore's own ``_handle_structure`` walked while a test ran."""
    walked: list[str] = []
    walker: Any = parsers.BaseJSONParser
    handle = walker._handle_structure

    def counting(self: Any, shape: Any, value: Any) -> Any:
        walked.append(shape.name)
        return handle(self, shape, value)

    monkeypatch.setattr(walker, "_handle_structure", counting)
    return walked


def test_botocore_parses_plain_items_directly_as_its_walk_does(walks: list[Any]) -> None:
    direct = _directly(parsers.JSONParser, "_handle_structure", "_handle_map")
    items = [PLAIN, {"s": {"S": "second"}}]
    bodies: dict[str, dict[str, Any]] = {
        "GetItem": {"Item": PLAIN},
        "Query": {"Items": items, "Count": 2, "LastEvaluatedKey": {"p": {"S": "a"}}},
        "BatchGetItem": {"Responses": {"t": items}, "UnprocessedKeys": {}},
    }
    for operation, body in bodies.items():
        theirs = _answer(operation, body, parsers.JSONParser)
        walks.clear()
        ours = _answer(operation, body, direct)
        assert ours == theirs, operation
        # and no attribute value was walked (the answer's own structure was)
        assert "AttributeValue" not in walks, operation
    assert ours["Responses"]["t"][0]["b"] == {"B": b"\x00\xffbinary"}
    assert ours["Responses"]["t"][0]["bs"]["BS"][1] == b"x"


def test_botocore_leaves_odd_values_to_its_walk_with_the_same_answer(walks: list[Any]) -> None:
    direct = _directly(parsers.JSONParser, "_handle_structure", "_handle_map")
    for odd in ODD:
        body = {"Item": {**PLAIN, **odd}}
        walks.clear()
        assert _answer("GetItem", body, direct) == _answer("GetItem", body, parsers.JSONParser)
        assert "AttributeValue" in walks
    # an unknown member is botocore's own answer (it keeps none of it), not a value made here
    assert _answer("GetItem", {"Item": ODD[1]}, direct)["Item"]["unknown"] == {}


def _request(operation: str, body: dict[str, Any], parser: type) -> Any:
    model = get_service_model("dynamodb").operation_model(operation)
    return parser(model).parse(
        {
            "method": "POST",
            "values": {},
            "headers": {},
            "body": json.dumps(body).encode(),
            "url_path": "/",
            "url_params": {},
        }
    )


def test_moto_parses_requested_items_directly_as_its_walk_does() -> None:
    direct = _directly(moto_parse.JSONParser, "_parse_structure", "_parse_map")
    put = {
        "TableName": "t",
        "Item": PLAIN,
        "ConditionExpression": "#v = :old",
        "ExpressionAttributeNames": {"#v": "v"},
        "ExpressionAttributeValues": {":old": {"N": "3"}, ":b": {"B": B64}},
    }
    batch = {"RequestItems": {"t": {"Keys": [{"p": {"S": "a"}, "k": {"N": "1"}}]}}}
    for operation, body in (("PutItem", put), ("BatchGetItem", batch)):
        ours = _request(operation, body, direct)
        assert ours == _request(operation, body, moto_parse.JSONParser), operation
    assert ours["RequestItems"]["t"]["Keys"][0]["k"] == {"N": "1"}
    for odd in ODD:
        body = {**put, "Item": {**PLAIN, **odd}}
        ours = _request("PutItem", body, direct)
        assert ours == _request("PutItem", body, moto_parse.JSONParser), odd


def test_the_direct_parsers_are_the_ones_installed() -> None:
    from shoal.local.attribute_values import parse_attribute_values_directly

    adapt_moto()
    parse_attribute_values_directly()
    assert getattr(moto_parse.PROTOCOL_PARSERS["json"], "shoal_attribute_values", False)
    assert getattr(parsers.PROTOCOL_PARSERS["json"], "shoal_attribute_values", False)
    # installed twice, still one layer over the walk
    parse_attribute_values_directly()
    installed: Any = parsers.PROTOCOL_PARSERS["json"]
    assert installed.__mro__[1] is parsers.JSONParser


@pytest.fixture
def table() -> Iterator[Any]:
    adapt_moto()
    with mock_aws():
        dynamodb = boto3.resource("dynamodb", region_name="us-east-1")
        yield dynamodb.create_table(
            TableName="t",
            KeySchema=[{"AttributeName": "p", "KeyType": "HASH"}],
            AttributeDefinitions=[{"AttributeName": "p", "AttributeType": "S"}],
            BillingMode="PAY_PER_REQUEST",
        )


def test_an_item_is_sized_once_and_refused_past_the_limit_as_moto_refused(table: Any) -> None:
    """``size_items_once``: one sum of the item's sizes, not one per attribute; the same
    refusal as moto's per-attribute check, and the same attributes kept."""
    assert getattr(Item.__init__, "_sized_once", False)
    original = Item.__init__._moto
    key = {"S": "k"}
    # the names "p", "a", "b" and the key's value "k": 4 bytes; the item at the limit is kept
    at_limit = (ITEM_LIMIT - 4) // 2
    for size, refused in ((at_limit, False), (at_limit + 1, True)):
        attrs = {"p": key, "a": {"S": "x" * size}, "b": {"S": "y" * size}}
        outcomes: list[tuple[str, dict[str, Any] | None]] = []
        for init in (Item.__init__, original):
            item = Item.__new__(Item)
            try:
                init(item, key, None, attrs)
                outcomes.append(("kept", dict(item.attrs)))
            except ItemSizeTooLarge:
                outcomes.append(("refused", None))
        assert outcomes[0] == outcomes[1], size
        assert (outcomes[0][0] == "refused") is refused, size
    # through the API: refused, nothing stored
    with pytest.raises(ClientError) as refusal:
        table.put_item(Item={"p": "big", "a": "x" * (ITEM_LIMIT // 2), "b": "y" * ITEM_LIMIT})
    assert refusal.value.response["Error"]["Code"] == "ValidationException"
    assert "Item" not in table.get_item(Key={"p": "big"})


#: answers as moto's handlers make them (plain dicts), for operations whose outputs have
#: structures in lists and maps: Kinesis records, DynamoDB consumed capacity, SQS messages
ANSWERS: list[tuple[str, str, dict[str, Any]]] = [
    (
        "kinesis",
        "GetRecords",
        {
            "Records": [
                {
                    "SequenceNumber": str(n),
                    "ApproximateArrivalTimestamp": 1_796_619_054.5 + n,
                    "Data": b"\x00data",
                    "PartitionKey": f"key-{n}",
                }
                for n in range(3)
            ],
            "NextShardIterator": "iterator",
            "MillisBehindLatest": 0,
        },
    ),
    (
        "kinesis",
        "PutRecords",
        {
            "FailedRecordCount": 1,
            "Records": [
                {"SequenceNumber": "1", "ShardId": "shardId-000000000000"},
                {"ErrorCode": "ProvisionedThroughputExceededException", "ErrorMessage": "slow"},
            ],
        },
    ),
    (
        "dynamodb",
        "BatchGetItem",
        {
            "ConsumedCapacity": [{"CapacityUnits": 2, "TableName": "t"}],
            "Responses": {"t": [{"p": {"S": "a"}, "b": {"B": b"\x01"}}]},
            "UnprocessedKeys": {"u": {"Keys": [{"p": {"S": "b"}}], "ConsistentRead": True}},
        },
    ),
    (
        "sqs",
        "ReceiveMessage",
        {
            "Messages": [
                {
                    "MessageId": "m",
                    "ReceiptHandle": "r",
                    "MD5OfBody": "x",
                    "Body": "{}",
                    "Attributes": {"MessageGroupId": "lane-1"},
                }
            ]
        },
    ),
]


def _serialized(service: str, operation: str, answer: dict[str, Any]) -> Any:
    from moto.core.serialize import SERIALIZERS, XFormedAttributePicker

    model = get_service_model(service).operation_model(operation)
    serializer = SERIALIZERS[model.metadata["protocol"]](
        operation_model=model, value_picker=XFormedAttributePicker(response_transformers={})
    )
    return json.loads(serializer.serialize(answer)["body"])


def test_moto_picks_members_by_known_keys_as_its_picker_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``pick_members_by_known_keys``: the same answers as moto's picker, twice (the second
    time from the keys kept), and the picker's aliases listed once per member."""
    from moto.core import serialize

    adapt_moto()
    serializer: Any = serialize.ResponseSerializer
    patched = serializer.get_value
    assert getattr(patched, "shoal_known_keys", False)
    listed: list[str] = []
    possible_keys = serialize.AttributePicker.get_possible_keys

    def listing(self: Any, context: Any) -> Any:
        listed.append(context.key)
        return possible_keys(self, context)

    monkeypatch.setattr(serialize.AttributePicker, "get_possible_keys", listing)
    for service, operation, answer in ANSWERS:
        ours = [_serialized(service, operation, answer) for _ in range(2)]
        listed_before = len(listed)
        ours.append(_serialized(service, operation, answer))
        # known by now: nothing listed again
        assert len(listed) == listed_before, operation
        monkeypatch.setattr(serializer, "get_value", patched.shoal_moto)
        theirs = _serialized(service, operation, answer)
        monkeypatch.setattr(serializer, "get_value", patched)
        assert ours == [theirs] * 3, operation
    assert ours[0]["Messages"][0]["Attributes"] == {"MessageGroupId": "lane-1"}


#: values botocore's validation reports (each beside valid attributes): a wrong type at each
#: kind, as deep as a map's list, and the shapes that are not one attribute value
INVALID: list[Any] = [
    {"S": 1},
    {"N": 5},
    {"B": 5},
    {"SS": "a"},
    {"NS": [1]},
    {"BS": [1]},
    {"NULL": "yes"},
    {"BOOL": 1},
    {"M": {"k": {"S": 1}}},
    {"M": {1: {"S": "a"}}},
    {"L": [{"S": "a"}, {"X": "b"}]},
    {"L": "x"},
    {"S": "a", "N": "1"},
    {"X": "1"},
    {},
    None,
]


def _report(params: dict[str, Any], operation: str = "PutItem") -> str:
    from botocore.validate import ParamValidator

    model = botocore.session.get_session().get_service_model("dynamodb")
    shape: Any = model.operation_model(operation).input_shape
    return str(ParamValidator().validate(params, shape).generate_report())


def test_botocore_validates_attribute_values_directly_as_its_walk_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from botocore.validate import ParamValidator
    from shoal.local.attribute_values import parse_attribute_values_directly

    parse_attribute_values_directly()
    validator: Any = ParamValidator
    direct = (validator._validate_structure, validator._validate_map)
    assert all(getattr(f, "shoal_walk", None) for f in direct)
    blob = {"B": b"\x00", "BS": [bytearray(b"x"), "y"]}
    requests = [
        {"TableName": "t", "Item": {**PLAIN, "raw": {"B": b"\x00"}, "set": {"BS": blob["BS"]}}},
        *({"TableName": "t", "Item": {**PLAIN, "bad": bad}} for bad in INVALID),
        {"TableName": "t", "Item": {"l": {"L": ({"S": "tuple"},)}}},
    ]
    for params in requests:
        ours = _report(params)
        monkeypatch.setattr(validator, "_validate_structure", direct[0].shoal_walk)
        monkeypatch.setattr(validator, "_validate_map", direct[1].shoal_walk)
        theirs = _report(params)
        monkeypatch.setattr(validator, "_validate_structure", direct[0])
        monkeypatch.setattr(validator, "_validate_map", direct[1])
        assert ours == theirs, params
    assert _report(requests[0]) == ""
    assert "Invalid type for parameter Item.bad.S" in _report(requests[1])


def test_a_kept_condition_evaluates_each_calls_own_values_and_names(table: Any) -> None:
    """``parse_conditions_once``: a condition parsed before, with other values, is evaluated
    with this call's; the same text and values again come from the kept parse; a name a call
    gives and its condition does not use is refused each time, kept or not (moto checks the
    names a put's condition uses, not its values)."""
    from moto.dynamodb.comparisons import ConditionExpressionParser

    assert getattr(ConditionExpressionParser.parse, "_kept", False)
    parsed: list[str] = []
    make: Any = ConditionExpressionParser._make_op_condition

    def counting(self: Any, node: Any) -> Any:
        # the last step of a parse: once per condition moto parses
        parsed.append(self.condition_expression)
        return make(self, node)

    walker: Any = ConditionExpressionParser
    walker._make_op_condition = counting
    # a text no other test of this process parsed (the kept parses are process-wide)
    old_name = f":old{uuid.uuid4().hex}"
    condition = f"#v = {old_name}"
    try:
        table.put_item(Item={"p": "s", "v": 1})

        def put(version: int, old: int, **extra: Any) -> str:
            try:
                table.put_item(
                    Item={"p": "s", "v": version},
                    ConditionExpression=condition,
                    ExpressionAttributeNames={"#v": "v", **extra.get("names", {})},
                    ExpressionAttributeValues={old_name: old, **extra.get("values", {})},
                )
            except ClientError as exc:
                return str(exc.response["Error"]["Code"])
            return "put"

        failed = "ConditionalCheckFailedException"
        assert put(2, 1) == "put"
        assert put(3, 1) == failed  # the same condition, kept: the item is at 2 now
        assert put(3, 2) == "put"
        assert put(4, 2) == failed
        assert table.get_item(Key={"p": "s"})["Item"]["v"] == 3
        # the old version 1 and 2 parsed once each (moto's response layer and its backend
        # share the kept parse)
        assert parsed == [condition, condition]
        for _ in range(2):
            assert put(4, 3, names={"#u": "u"}) == "ValidationException"
        assert put(4, 3) == "put"
    finally:
        walker._make_op_condition = make
