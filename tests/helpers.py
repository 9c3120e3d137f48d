"""Event factories: sample events live in events/*.json; these build the variants tests need."""

from __future__ import annotations

import base64
import copy
import json
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode
from weakref import WeakKeyDictionary

from shoal.local.context import LambdaContext

if TYPE_CHECKING:
    import boto3

EVENTS = Path(__file__).resolve().parent.parent / "events"


@cache
def _load(name: str) -> dict[str, Any]:
    return json.loads((EVENTS / name).read_text())


def load_event(name: str) -> dict[str, Any]:
    return copy.deepcopy(_load(name))


def FakeContext() -> LambdaContext:
    """A Lambda context for handlers called directly in tests."""
    return LambdaContext("shoal-test", log_stream="test")


def http_event(
    method: str,
    path: str,
    *,
    body: Any = None,
    raw_body: str | None = None,
    claims: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
    query: dict[str, str] | None = None,
    route_key: str | None = None,
    path_parameters: dict[str, str] | None = None,
) -> dict[str, Any]:
    """An API Gateway HTTP API (payload 2.0) event; claims as the JWT authorizer passes them."""
    event = load_event("http_api_request.json")
    event["routeKey"] = event["requestContext"]["routeKey"] = route_key or f"{method} {path}"
    event["rawPath"] = event["requestContext"]["http"]["path"] = path
    event["requestContext"]["http"]["method"] = method
    event["rawQueryString"] = urlencode(query or {})
    event["queryStringParameters"] = query or None
    event["pathParameters"] = path_parameters
    if claims is None:
        del event["requestContext"]["authorizer"]
    else:
        event["requestContext"]["authorizer"]["jwt"]["claims"] = claims
    event["headers"].update({k.lower(): v for k, v in (headers or {}).items()})
    if raw_body is not None:
        event["body"] = raw_body
    elif body is not None:
        event["body"] = json.dumps(body)
    return event


def binary_body(event: dict[str, Any], data: bytes) -> dict[str, Any]:
    event["body"] = base64.b64encode(data).decode()
    event["isBase64Encoded"] = True
    return event


def response_json(response: dict[str, Any]) -> Any:
    return json.loads(response["body"]) if response.get("body") else None


#: per emulated account (its session): where ``archive_events`` got to in each log shard
_LOG_POSITIONS: WeakKeyDictionary[Any, dict[str, str]] = WeakKeyDictionary()


def archive_events(session: boto3.Session) -> int:
    """Run the archiver (its handler) over the delivery-event log's records it has not had
    yet, one batch per shard, as its mapping would; the records archived. Tests that read
    ``events/`` after the calls that recorded them call this first: the calls append to the
    log, only the archiver writes S3."""
    from shoal.core.config import get_config
    from shoal.delivery.events import EVENT_LOG
    from shoal.local.esm.invocation import StreamRecord, kinesis_event

    import functions.archiver.app as archiver_app

    stream = get_config().streams[EVENT_LOG]
    kinesis = session.client("kinesis")
    arn = kinesis.describe_stream_summary(StreamName=stream)["StreamDescriptionSummary"][
        "StreamARN"
    ]
    positions = _LOG_POSITIONS.setdefault(session, {})
    archived = 0
    for shard in kinesis.list_shards(StreamName=stream)["Shards"]:
        shard_id = shard["ShardId"]
        after = positions.get(shard_id)
        start: dict[str, Any] = (
            {"ShardIteratorType": "AFTER_SEQUENCE_NUMBER", "StartingSequenceNumber": after}
            if after
            else {"ShardIteratorType": "TRIM_HORIZON"}
        )
        iterator = kinesis.get_shard_iterator(StreamName=stream, ShardId=shard_id, **start)
        raw = kinesis.get_records(ShardIterator=iterator["ShardIterator"], Limit=10_000)["Records"]
        if not raw:
            continue
        event = kinesis_event(
            [StreamRecord.from_get_records(dict(r)) for r in raw],
            shard_id=shard_id,
            stream_arn=arn,
            region=session.region_name or "us-east-1",
            role_arn="arn:aws:iam::123456789012:role/shoal-local-lambda",
        )
        answer = archiver_app.handler(event, FakeContext())
        assert answer == {"batchItemFailures": []}, answer
        positions[shard_id] = raw[-1]["SequenceNumber"]
        archived += len(raw)
    return archived
