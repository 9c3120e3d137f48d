"""A ``Select=COUNT`` scan under the emulator (``shoal.local.moto_scans``) answers as moto's
own scan does: the same pages (``Limit``, 1 MB), counts, scanned counts and start keys."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from moto import mock_aws
from moto.dynamodb.models.table import Table
from shoal.local.aws import adapt_moto


def _table(client: Any, name: str, range_type: str | None, hash_type: str = "S") -> None:
    keys = [{"AttributeName": "p", "KeyType": "HASH"}]
    attributes = [{"AttributeName": "p", "AttributeType": hash_type}]
    if range_type is not None:
        keys.append({"AttributeName": "k", "KeyType": "RANGE"})
        attributes.append({"AttributeName": "k", "AttributeType": range_type})
    client.create_table(
        TableName=name,
        KeySchema=keys,
        AttributeDefinitions=attributes,
        BillingMode="PAY_PER_REQUEST",
    )


@pytest.fixture
def client() -> Iterator[Any]:
    adapt_moto()
    with mock_aws():
        dynamodb = boto3.client("dynamodb", region_name="us-east-1")
        # a table of string partitions and numeric sort keys (negative, fractional, out of
        # order), items of sizes that end 1 MB pages mid-partition, some matching the filter
        _table(dynamodb, "ranged", "N")
        items: list[dict[str, Any]] = []
        for p in ("b", "a", "c", "ab"):
            for k in ("10", "-3", "2.5", "7", "100", "0", "-0.5"):
                items.append(
                    {
                        "p": {"S": p},
                        "k": {"N": k},
                        "kind": {"S": "conn#" if k.startswith("-") else "other"},
                        "pad": {"S": "x" * (200_000 if p in ("a", "ab") else 300)},
                        "nested": {"M": {"l": {"L": [{"N": k}, {"S": p}]}}},
                    }
                )
        # and a table keyed by a number alone
        _table(dynamodb, "numbered", None, "N")
        for n in (5, -1, 30, 2, 11, 0, 7):
            items.append({"p": {"N": str(n)}, "connected": {"BOOL": n % 2 == 1}})
        for item in items:
            table = "ranged" if "k" in item else "numbered"
            dynamodb.put_item(TableName=table, Item=item)
        yield dynamodb


def _pages(client: Any, **request: Any) -> list[tuple[int, int, Any]]:
    pages = []
    while True:
        answer = client.scan(Select="COUNT", **request)
        assert "Items" not in answer
        last = answer.get("LastEvaluatedKey")
        pages.append((answer["Count"], answer["ScannedCount"], last))
        if last is None:
            return pages
        request["ExclusiveStartKey"] = last


def _with_moto_scan(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Table, "scan", Table.scan._moto)


REQUESTS = [
    {"TableName": "ranged"},
    {"TableName": "ranged", "Limit": 3},
    {"TableName": "ranged", "Limit": 1},
    {
        "TableName": "ranged",
        "FilterExpression": "begins_with(#kind, :c)",
        "ExpressionAttributeNames": {"#kind": "kind"},
        "ExpressionAttributeValues": {":c": {"S": "conn#"}},
    },
    {
        "TableName": "ranged",
        "Limit": 4,
        "FilterExpression": "#k > :z",
        "ExpressionAttributeNames": {"#k": "k"},
        "ExpressionAttributeValues": {":z": {"N": "0"}},
    },
    {"TableName": "ranged", "ExclusiveStartKey": {"p": {"S": "a"}, "k": {"N": "2.5"}}},
    {"TableName": "numbered"},
    {"TableName": "numbered", "Limit": 2},
    {
        "TableName": "numbered",
        "FilterExpression": "#c = :t",
        "ExpressionAttributeNames": {"#c": "connected"},
        "ExpressionAttributeValues": {":t": {"BOOL": True}},
    },
    {"TableName": "numbered", "ExclusiveStartKey": {"p": {"N": "6"}}},
]


@pytest.mark.parametrize("request_", REQUESTS)
def test_a_counting_scan_pages_as_motos_own(
    client: Any, request_: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    ours = _pages(client, **request_)
    with monkeypatch.context() as moto_only:
        _with_moto_scan(moto_only)
        theirs = _pages(client, **request_)
    assert ours == theirs
    if request_ == {"TableName": "ranged"}:
        # the large items end pages inside a partition: more than one page to compare
        assert len(ours) > 1


def test_a_counting_scan_keeps_no_copy_and_other_scans_are_motos(
    client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import copy

    copies: list[object] = []
    deepcopy = copy.deepcopy

    def counted(value: Any, memo: Any = None) -> Any:
        copies.append(value)
        return deepcopy(value, memo)

    monkeypatch.setattr(copy, "deepcopy", counted)
    assert _pages(client, TableName="numbered") == [(7, 7, None)]
    assert copies == []
    # a scan that answers items still answers copies of them, by moto's own scan
    answer = client.scan(TableName="numbered", Limit=2)
    assert len(answer["Items"]) == 2 and len(copies) >= 2
