"""The teardown custom resource over moto: a stack's Delete removes every stream and mapping
that topics and push subscriptions made at run time, and only those; it is idempotent."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError
from botocore.stub import Stubber
from shoal.aws.dynamo import Dynamo
from shoal.composite.model import StorageTopic, stream_name
from shoal.core.clock import ManualClock
from shoal.core.config import get_config
from shoal.push.admin import PushAdmin
from shoal.push.api import CreateRequest
from shoal.push.endpoint import EndpointPolicy
from shoal.push.queues import Queues
from shoal.push.store import KeyStore, PushSubscriptionStore
from shoal.teardown import PHYSICAL_ID, Teardown, TeardownIncomplete, on_event, stack_status

from functions.teardown.app import handler
from tests.helpers import FakeContext
from tests.integration.test_publish_harness import Harness, admin_call

STACK_ID = "arn:aws:cloudformation:us-east-1:123456789012:stack/shoal/0000"
#: streams the teardown must leave: another application's, and one of the prefix that no
#: table or mapping of this stack names (another deployment sharing the prefix)
FOREIGN = ("billing-events", "shoal-elsewhere-0")


def event(request: str, retain: Any = False) -> dict[str, Any]:
    """A CloudFormation request as CDK's Provider framework passes it (values as strings)."""
    return {
        "RequestType": request,
        "StackId": STACK_ID,
        "RequestId": "1",
        "LogicalResourceId": "RuntimeResources",
        "ResourceType": "Custom::ShoalRuntimeResources",
        "PhysicalResourceId": PHYSICAL_ID,
        "ResourceProperties": {"ServiceToken": "arn", "Retain": str(retain).lower()},
    }


@pytest.fixture
def world(aws: boto3.Session, monkeypatch: pytest.MonkeyPatch) -> Iterator[Harness]:
    """Topics made the way the admin API makes them, a push subscription, a topic whose
    creation crashed after its stream, and streams that are not the stack's."""
    h = Harness(aws)
    h.install(monkeypatch)
    h.default()
    assert admin_call("POST", "/v1/topics", {"name": "orders", "partitions": 2})[0] == 201
    assert admin_call("POST", "/v1/topics", {"name": "metrics", "partitions": 1})[0] == 201
    status, _ = admin_call("POST", "/v1/topics/orders/storage-topics", {"partitions": 1})
    assert status == 201
    push = PushAdmin(
        h.config,
        PushSubscriptionStore.from_config(h.config, h.clock),
        KeyStore.from_config(h.config),
        Queues(h.streams, h.clock),
        clock=h.clock,
        endpoints=EndpointPolicy(),
    )
    push.create(CreateRequest(name="hook", filter="orders/#", endpoint="https://example.com/hook"))
    # a creation that crashed after making its stream: recorded as pending only
    pending = StorageTopic(0, stream_name(h.config.stream_prefix, "halfway", 0), 1, 1)
    assert h.store.reserve("halfway", pending)
    h.streams.ensure_stream(pending.stream, 1)
    kinesis = aws.client("kinesis")
    for name in FOREIGN:
        kinesis.create_stream(StreamName=name, ShardCount=1)
    yield h


def kept() -> set[str]:
    """What a teardown leaves: streams that are not the stack's, and the streams the stack
    declares (CloudFormation deletes those itself: the event log)."""
    return {*FOREIGN, *get_config().streams.values()}


def streams(aws: boto3.Session) -> set[str]:
    return set(aws.client("kinesis").list_streams()["StreamNames"])


def mappings(aws: boto3.Session) -> list[dict[str, Any]]:
    found = aws.client("lambda").list_event_source_mappings()["EventSourceMappings"]
    return [dict(m) for m in found]


def teardown(aws: boto3.Session, **kw: Any) -> Teardown:
    return Teardown(
        get_config(),
        aws.client("kinesis"),
        aws.client("lambda"),
        Dynamo(aws.client("dynamodb")),
        ManualClock(),
        **kw,
    )


def delete(aws: boto3.Session, td: Teardown | None = None, retain: Any = False) -> dict[str, Any]:
    made = td or teardown(aws)
    return on_event(event("Delete", retain), lambda: made, lambda _: "DELETE_IN_PROGRESS")


def fail_on(client: Any, operation: str, code: str, calls: set[int]) -> list[int]:
    """Make the ``calls``-th calls (1-based) of ``operation`` fail with ``code``."""
    seen: list[int] = []

    def hook(**_: Any) -> None:
        seen.append(1)
        if len(seen) in calls:
            raise ClientError({"Error": {"Code": code, "Message": "injected"}}, operation)

    client.meta.events.register(f"before-call.*.{operation}", hook)
    return seen


def test_delete_removes_every_runtime_stream_and_mapping_once(
    world: Harness, aws: boto3.Session
) -> None:
    # Given topics, a grown topic, a push subscription and a half-made topic
    made = streams(aws) - kept()
    assert {
        "shoal-default-0",
        "shoal-orders-0",
        "shoal-orders-1",
        "shoal-metrics-0",
        "shoal-halfway-0",
    } < made
    assert any(".rq-" in s for s in made) and any(".dlq-" in s for s in made)
    functions = {m["FunctionArn"].rsplit(":", 1)[1] for m in mappings(aws)}
    assert functions == {"shoal-router", "shoal-push"}
    count = len(mappings(aws))
    # When the stack is deleted
    answer = delete(aws)
    # Then every stream the stack made and every mapping are gone, and nothing else
    assert answer["PhysicalResourceId"] == PHYSICAL_ID
    assert answer["Data"] == {
        "MappingsDeleted": count,
        "ConsumersDeregistered": 0,
        "StreamsDeleted": len(made),
    }
    assert mappings(aws) == []
    assert streams(aws) == kept()
    # And a second delete (the tables still name every stream) finds them gone: no error
    assert delete(aws)["Data"] == {
        "MappingsDeleted": 0,
        "ConsumersDeregistered": 0,
        "StreamsDeleted": 0,
    }
    assert streams(aws) == kept()


def test_a_delete_after_a_partial_first_pass_finishes_the_job(
    world: Harness, aws: boto3.Session
) -> None:
    # Given a first pass that fails on its third stream (an error that is not "busy")
    first = teardown(aws)
    fail_on(first.kinesis, "DeleteStream", "InternalFailure", {3})
    with pytest.raises(ClientError):
        delete(aws, first)
    # it removed the mappings and two streams, and left the rest
    assert mappings(aws) == []
    left = streams(aws) - kept()
    assert left
    # When CloudFormation's delete is repeated (a fresh container)
    answer = delete(aws)
    # Then the rest goes, found again from the tables
    assert answer["Data"] == {
        "MappingsDeleted": 0,
        "ConsumersDeregistered": 0,
        "StreamsDeleted": len(left),
    }
    assert streams(aws) == kept()


def test_busy_resources_are_waited_for_within_the_budget(
    world: Harness, aws: boto3.Session
) -> None:
    made = streams(aws) - kept()
    # Given streams busy for longer than the budget (moto reports them ACTIVE, so "in use"
    # means a resharding, not a delete under way)
    stuck = teardown(aws, budget_s=10)
    fail_on(stuck.kinesis, "DeleteStream", "ResourceInUseException", set(range(1, 1000)))
    # Then the delete fails, saying what to do, and leaves them for the next one
    with pytest.raises(TeardownIncomplete, match="delete again"):
        delete(aws, stuck)
    assert streams(aws) - kept() == made
    # Given a mapping and a stream busy only at the first attempts
    td = teardown(aws)
    calls = fail_on(td.kinesis, "DeleteStream", "LimitExceededException", {1, 2})
    fail_on(td.awslambda, "DeleteEventSourceMapping", "ResourceInUseException", {1})
    # Then each is tried again after backoff, and all goes
    assert delete(aws, td)["Data"]["StreamsDeleted"] == len(made)
    assert len(calls) == len(made) + 2
    assert streams(aws) == kept()
    assert mappings(aws) == []


def test_nothing_is_removed_unless_the_stack_goes_without_retain(
    world: Harness, aws: boto3.Session
) -> None:
    before_streams, before_mappings = streams(aws), mappings(aws)
    # Create and Update (the handler as deployed) keep the one physical id and change nothing
    for request in ("Create", "Update"):
        answer = handler(event(request), FakeContext())
        assert answer == {"PhysicalResourceId": PHYSICAL_ID, "Data": {"Retain": "false"}}
    # A Delete with Retain "true" (retainStreams) while the stack is deleted removes nothing
    assert delete(aws, retain=True) == {"PhysicalResourceId": PHYSICAL_ID}
    # Nor a Delete while the stack stays (the resource left the template in an update)
    made = teardown(aws)
    for status in ("UPDATE_COMPLETE_CLEANUP_IN_PROGRESS", "UPDATE_ROLLBACK_IN_PROGRESS", None):

        def status_of(_: str, status: str | None = status) -> str | None:
            return status

        answer = on_event(event("Delete"), lambda: made, status_of)
        assert answer == {"PhysicalResourceId": PHYSICAL_ID}
    assert streams(aws) == before_streams
    assert mappings(aws) == before_mappings


def test_the_stack_status_is_read_from_cloudformation() -> None:
    # moto's CloudFormation takes seconds to load; botocore's Stubber checks the request and
    # the answers against the service model instead
    client = boto3.client("cloudformation", region_name="us-east-1")
    with Stubber(client) as stub:
        stack = {"StackName": "shoal", "CreationTime": "2026-01-01T00:00:00Z"}
        stub.add_response(
            "describe_stacks",
            {"Stacks": [stack | {"StackStatus": "DELETE_IN_PROGRESS"}]},
            {"StackName": STACK_ID},
        )
        stub.add_client_error(
            "describe_stacks", "ValidationError", "Stack with id x does not exist"
        )
        assert stack_status(client, STACK_ID) == "DELETE_IN_PROGRESS"
        # a stack CloudFormation does not know is not one being deleted
        assert stack_status(client, "x") is None
