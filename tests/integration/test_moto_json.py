"""moto's handlers of JSON-protocol calls set up without werkzeug's parsing
(``shoal.local.moto_json``): the same handler state as moto's own ``setup_class``, for every
call the hot paths make, and moto's own setup for anything else."""

from __future__ import annotations

import io
from typing import Any

from moto.core.request import Request
from shoal.local import moto_json
from shoal.local.aws import _direct_handler
from shoal.local.transport import environ_for, json_target

from tests.integration.test_local_aws import (
    TABLE,
    Start,
    client,
    create_counter_table,
    start,
    state_dir,
)

__all__ = ["start", "state_dir"]  # fixtures


def _made_requests(start: Start) -> list[Any]:
    """The prepared requests of the DynamoDB, Kinesis and SQS calls the hot paths make,
    answered by the emulator as usual."""
    aws = start()
    made: list[Any] = []

    def keep(request: Any, **_: Any) -> None:
        made.append(request)

    ddb = create_counter_table(aws)
    kinesis = client(aws, "kinesis")
    sqs = client(aws, "sqs")
    for sdk in (ddb, kinesis, sqs):
        sdk.meta.events.register_first("before-send", keep)
    key = {"pk": {"S": "a"}}
    ddb.put_item(
        TableName=TABLE,
        Item={**key, "n": {"N": "1"}, "b": {"B": b"\x00\xff"}, "m": {"M": {"x": {"L": []}}}},
        ConditionExpression="attribute_not_exists(pk)",
    )
    ddb.get_item(TableName=TABLE, Key=key, ConsistentRead=True, ProjectionExpression="n")
    ddb.update_item(
        TableName=TABLE,
        Key=key,
        UpdateExpression="ADD n :one",
        ConditionExpression="n = :one",
        ExpressionAttributeValues={":one": {"N": "1"}},
        ReturnValues="ALL_NEW",
    )
    ddb.query(
        TableName=TABLE,
        KeyConditionExpression="pk = :p",
        ExpressionAttributeValues={":p": {"S": "a"}},
        Limit=1,
        ReturnConsumedCapacity="TOTAL",
    )
    ddb.batch_write_item(RequestItems={TABLE: [{"PutRequest": {"Item": {"pk": {"S": "b"}}}}]})
    ddb.batch_get_item(RequestItems={TABLE: {"Keys": [key, {"pk": {"S": "b"}}]}})
    ddb.transact_write_items(
        TransactItems=[{"Delete": {"TableName": TABLE, "Key": {"pk": {"S": "b"}}}}]
    )
    ddb.scan(TableName=TABLE, ConsistentRead=True)
    kinesis.create_stream(StreamName="s", ShardCount=1)
    kinesis.put_records(StreamName="s", Records=[{"Data": b"x", "PartitionKey": "k"}])
    shard = kinesis.list_shards(StreamName="s")["Shards"][0]["ShardId"]
    iterator = kinesis.get_shard_iterator(
        StreamName="s", ShardId=shard, ShardIteratorType="TRIM_HORIZON"
    )["ShardIterator"]
    kinesis.get_records(ShardIterator=iterator, Limit=10)
    url = sqs.create_queue(
        QueueName="lanes.fifo",
        Attributes={"FifoQueue": "true", "ContentBasedDeduplication": "true"},
    )["QueueUrl"]
    sqs.send_message_batch(
        QueueUrl=url, Entries=[{"Id": "0", "MessageBody": "push", "MessageGroupId": "lane-1"}]
    )
    received = sqs.receive_message(
        QueueUrl=url, MaxNumberOfMessages=10, AttributeNames=["All"], MessageAttributeNames=["All"]
    )["Messages"]
    sqs.delete_message_batch(
        QueueUrl=url, Entries=[{"Id": "0", "ReceiptHandle": received[0]["ReceiptHandle"]}]
    )
    sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["All"])
    return made


def _compared(handler: Any) -> dict[str, Any]:
    """A set-up handler's attributes, the request-bound ones by what they hold."""
    state = dict(vars(handler))
    state.pop("normalized_request")
    state["headers"] = dict(state["headers"])
    state["response_headers"] = dict(state["response_headers"])
    # the clock's second may turn between the two setups
    assert "date" in state["response_headers"]
    state["response_headers"].pop("date")
    return state


def test_a_json_calls_handler_is_set_up_as_motos_own_setup_sets_it_up(start: Start) -> None:
    made = _made_requests(start)
    targets = [json_target(r) for r in made]
    assert len(made) == 18 and all(targets)
    for request, target in zip(made, targets, strict=True):
        handler = _direct_handler(target)
        assert handler is not None, target
        theirs = Request(environ_for(request))
        by_moto = handler()
        by_moto.setup_class(theirs, theirs.raw_url, theirs.headers)
        environ = environ_for(request)
        ours = handler()
        assert moto_json.setup(ours, Request(environ), environ, environ["wsgi.input"].getvalue())
        # every attribute, the parsed parameters the action reads among them
        assert _compared(ours) == _compared(by_moto), target


def test_anything_but_a_plain_json_call_is_left_to_motos_own_setup() -> None:
    from moto.dynamodb.responses import DynamoHandler

    plain = {
        "REQUEST_METHOD": "POST",
        "PATH_INFO": "/",
        "CONTENT_TYPE": "application/x-amz-json-1.0",
        "HTTP_HOST": "127.0.0.1:4566",
        "wsgi.url_scheme": "http",
        "wsgi.input": io.BytesIO(b"{}"),
    }
    others = [
        {**plain, "CONTENT_TYPE": "application/x-www-form-urlencoded"},
        {**plain, "HTTP_CONTENT_ENCODING": "gzip"},
        {**plain, "QUERY_STRING": "Action=ListTables"},
    ]
    for environ in others:
        assert not moto_json.setup(DynamoHandler(), Request(environ), environ, b"{}")
