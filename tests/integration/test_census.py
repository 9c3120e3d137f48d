"""The reaper's census (``shoal.census``) over moto: it counts the WebSocket connections that
hold a session, the sessions whose channel is connected (HTTP or WebSocket), and the shared
groups, and reports each as a gauge of the invocation."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from shoal.census import Census, census_due
from shoal.core import metrics
from shoal.core.config import get_config
from shoal.core.observability import invocation

from tests.integration.test_edge import Edge
from tests.integration.test_groups_support import GroupWorld


@pytest.fixture
def edge(aws: boto3.Session, monkeypatch: pytest.MonkeyPatch) -> Iterator[Edge]:
    world = GroupWorld(aws, monkeypatch)
    world.topic("default")
    yield Edge(world, monkeypatch)


def test_the_census_counts_connections_connected_sessions_and_groups(edge: Edge) -> None:
    world = edge.world
    # Given two sessions over the WebSocket API, one of them in a shared group
    edge.connect("c1", client_id="alice-1")
    edge.connect("c2", client_id="alice-2")
    edge.send("c2", {"action": "subscribe", "subscriptions": [{"filter": "$share/g/a/#"}]})
    # one connected over HTTP, and one that disconnected and is kept for its expiry
    world.connect("alice-3", clean_start=False, session_expiry_s=600)
    gone = world.connect("alice-4", clean_start=False, session_expiry_s=600)
    world.disconnect("alice-4", gone)
    # When the census runs in an invocation
    with invocation() as recorded:
        report = Census.from_config(get_config()).run()
    # Then it counts what is connected, and reports it as levels
    assert (report.connections, report.sessions_connected, report.shared_groups) == (2, 3, 1)
    levels: dict[Any, dict[str, float]] = recorded.gauges
    assert levels[()] == {
        metrics.CONNECTIONS: 2.0,
        metrics.SESSIONS_CONNECTED: 3.0,
        metrics.SHARED_GROUPS: 1.0,
    }
    # a connection that ends is counted no more (its session, until the reaper expires the
    # channel its $disconnect made due: the census counts what the registry says)
    edge.dropped("c1")
    assert Census.from_config(get_config()).run().connections == 1


def test_a_census_counts_once_its_period_has_passed_give_or_take_the_schedule() -> None:
    minute = 60_000
    # the first run of a container counts; the reaper's next, a minute later (or a few
    # seconds less: its schedule wanders), counts again
    assert census_due(0, None, 60)
    assert census_due(minute - 3_000, 0, 60)
    # a reaper run every second (shoal dev's --schedule reaper=1) counts once a minute
    assert not census_due(30_000, 0, 60)
    # every five minutes: not at the next minute's run, at the fifth
    assert not census_due(minute, 0, 300)
    assert census_due(5 * minute - 2_000, 0, 300)
    # none at all
    assert not census_due(0, None, 0)
