"""The event log under the local runtime: the archiver's declared mapping, made once, and the
check ``shoal pipeline sync`` waits on (every log record done by the archiver's mapping)."""

from __future__ import annotations

from typing import Any

import boto3
from shoal.core.clock import ManualClock
from shoal.core.config import get_config
from shoal.delivery.events import EVENT_LOG, Recording
from shoal.local.checkpoints import MemoryCheckpoints
from shoal.local.esm.mappings import EventSourceMappings, caught_up
from shoal.local.provision import LocalNames, provision_mappings

import functions.archiver.app as archiver_app
from tests.helpers import FakeContext

T0 = 1_700_000_000_000


def test_the_archiver_mapping_is_made_once_and_sync_waits_until_it_is_done(
    aws: boto3.Session,
) -> None:
    names = LocalNames.for_deployment()
    archiver = names.functions["archiver"]
    # Given the declared mappings provisioned twice (a restart), the second window shortened
    # (the archiver's on the event log, the pusher's on the push queue, the reaper's on the
    # wills queue)
    made = provision_mappings(aws, names)
    assert len(made) == 3
    assert provision_mappings(aws, names, batching_window_s=1) == made
    listed = aws.client("lambda").list_event_source_mappings(FunctionName=archiver)
    [mapping] = listed["EventSourceMappings"]
    assert mapping["UUID"] in made
    assert mapping["BatchSize"] == 10_000
    # And a get's events appended to the log
    recorder = Recording(get_config().streams[EVENT_LOG], ManualClock(T0), aws.client("kinesis"))
    events = recorder.new()
    events.add("delivered", "session", "s", message_id="m", delivery_id="s.1", published_at=T0)
    events.flush("get/s/1")
    checkpoints = MemoryCheckpoints()
    # Then the archiver is not caught up until its mapping has handed the record over
    assert not caught_up(aws, checkpoints, archiver)
    invoked: list[str] = []

    def invoke(function_name: str, event: dict[str, Any]) -> Any:
        invoked.append(function_name)
        return archiver_app.handler(event, FakeContext())

    # (the declared 60 s window holds a small batch back until the emulator's clock passes it)
    clock = ManualClock(T0)
    esm = EventSourceMappings(aws, invoke, clock, checkpoints)
    esm.sync()
    esm.drain()
    assert invoked == [] and not caught_up(aws, checkpoints, archiver)
    clock.advance(61)
    esm.drain()
    assert invoked == [archiver]
    assert caught_up(aws, checkpoints, archiver)
    # And the event is in the archive
    s3 = aws.client("s3")
    listed_objects = s3.list_objects_v2(Bucket=get_config().buckets["archive"], Prefix="events/")
    assert len(listed_objects["Contents"]) == 1
