"""The ack-timeout sweep's lines of the fleet's costs (``bench.cost``: ``count_push``'s
``sweep redelivery``, ``count_group_sweep``): a few WebSocket clients on the real handlers over
moto, one message each not acked, the reaper's scheduled run past the (shortened) ack timeout
and the pushes it handed over, counted per message sent again.

The bounds below are derived from the code, call by call, for at most ten clients: the sweep
hands them to the push queue in one ``SendMessageBatch`` (ten entries a call), the pusher's
mapping takes them in one batch (ten records), and the round they were pushed in was one
pusher batch, which armed one due list."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from shoal.edge.connections import DUE_SHARDS as CONNECTION_DUE_SHARDS
from shoal.sessions.model import DUE_SHARDS as SESSION_DUE_SHARDS

from bench import cost

CLIENTS = 3

#: the reaper's scheduled run, whatever it finds: the sessions' due index (keepalives, wills,
#: expiry: a query a shard, ``Reaper.run``) and the sealer's scan of the topics
#: (``Sealer.run``); the census is off in these counts (``cost.NO_CENSUS``)
REAPER_RUN = SESSION_DUE_SHARDS + 1
#: the sweep (``PushSweep.sweep``): the connections' due index (a query a shard), the one due
#: list taken (``take_due``: DeleteItem), the swept sessions' states (one BatchGetItem, 100
#: keys a call), their connections (``targets``: one BatchGetItem), the hand-off to the push
#: queue (one SendMessageBatch)
SWEEP = CONNECTION_DUE_SHARDS + 4
#: the pusher's batch (``PushWorker.work``): the connections (``targets``: the sweep's
#: hand-off carries none), the sessions' heads and states (``read_sessions``: one
#: BatchGetItem), one due list armed for what it handed out (``_arm``: PutItem)
PUSHER_BATCH = 3
#: the archiver over the batch's delivery events: one S3 object
ARCHIVER = 1


def _frames(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Every frame the bench's clients took as pushed (``_Edge.pushed``), in order."""
    seen: list[dict[str, Any]] = []
    real = cost._Edge.pushed

    def pushed(self: cost._Edge, connection: str) -> list[dict[str, Any]]:
        back = real(self, connection)
        seen.extend(back)
        return back

    monkeypatch.setattr(cost._Edge, "pushed", pushed)
    return seen


@pytest.fixture(scope="module")
def small() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(cost, "FLEET_CLIENTS", CLIENTS)
        patched.setattr(cost, "FLEET_ROUNDS", 1)
        # the timeout waited out a few times a count: shorter than the bench's, and longer
        # than a round's pushes take on a loaded machine (at 0.3 s, beside a soak, a group
        # member's second push of the round came after it and sent its delivery again)
        patched.setattr(cost, "SWEEP_ACK_TIMEOUT_S", 2.0)
        yield


@pytest.fixture(scope="module")
def plain(small: None) -> tuple[dict[str, cost.Unit], list[dict[str, Any]]]:
    with pytest.MonkeyPatch.context() as patched:
        frames = _frames(patched)
        return cost.count_push(), frames


@pytest.fixture(scope="module")
def grouped(small: None) -> tuple[dict[str, cost.Unit], list[dict[str, Any]]]:
    with pytest.MonkeyPatch.context() as patched:
        frames = _frames(patched)
        return cost.count_group_sweep(CLIENTS), frames


def _sent_again(frames: list[dict[str, Any]]) -> None:
    """The last ``CLIENTS`` messages went out first without ``dup``, then once each again
    with it, the same ids: the sweep's redeliveries."""
    messages = [f for f in frames if f["action"] == "message"]
    first, again = messages[-2 * CLIENTS : -CLIENTS], messages[-CLIENTS:]
    assert [f["dup"] for f in first] == [False] * CLIENTS
    assert [f["dup"] for f in again] == [True] * CLIENTS
    assert sorted(f["id"] for f in again) == sorted(f["id"] for f in first)
    assert len({f["id"] for f in again}) == CLIENTS


def test_the_sweep_sends_each_message_not_acked_again_with_dup(
    plain: tuple[dict[str, cost.Unit], list[dict[str, Any]]],
) -> None:
    units, frames = plain
    _sent_again(frames)
    unit = units["sweep_redelivery"]
    assert unit.units == CLIENTS
    # one frame out a message, no frame in; one reaper run, one pusher batch, one archiver
    # batch for all
    assert unit.ws_out == 1 and unit.ws_in == 0
    assert unit.calls["apigatewaymanagementapi.PostToConnection"] == 1
    assert {k: v * CLIENTS for k, v in unit.invocations.items()} == {
        "reaper": 1,
        "pusher": 1,
        "archiver": 1,
    }


def test_a_redelivery_costs_the_calls_the_code_makes_for_it(
    plain: tuple[dict[str, cost.Unit], list[dict[str, Any]]],
) -> None:
    units, _ = plain
    unit = units["sweep_redelivery"]
    # the sweep arms the sessions it pushes again for their next deadline (PutItem)
    sweep = SWEEP + 1
    # the pusher's batch, and its delivery events put in one record
    batch = PUSHER_BATCH + 1
    # a session's get (``DeliveryService.get``) sending its run again: the run read (one
    # query), its archive line (one S3 GET), the inbox walked for new deliveries (the
    # partition's first item, then from the cursor: two queries), the state written
    # (PutItem); then the state read again before the post (``_not_acked_since``: GetItem),
    # and the post
    each = 1 + 1 + 2 + 1 + 1 + 1
    bound = REAPER_RUN + sweep + batch + ARCHIVER + each * CLIENTS
    assert unit.aws_calls * CLIENTS <= bound
    # the writes: the due list taken, the two armed (the sweep's, the pusher's), a state
    # each, every item under 1 KB
    assert unit.dynamodb_wru * CLIENTS <= 3 + CLIENTS


def test_the_sweep_asks_the_groups_once_for_all_its_sessions(
    grouped: tuple[dict[str, cost.Unit], list[dict[str, Any]]],
) -> None:
    """Each member's group delivery is judged by its group: the reaper's sweep reads what is
    still out for all the swept sessions in one batch read of the groups table (it read once
    a session before)."""
    units, frames = grouped
    _sent_again(frames)
    unit = units["sweep_group_redelivery"]
    assert unit.units == CLIENTS
    assert unit.tables["reaper: BatchGetItem groups"] * CLIENTS == pytest.approx(1)
    assert unit.ws_out == 1 and unit.calls["apigatewaymanagementapi.PostToConnection"] == 1
    # the sweep: its groups' read; no arm (a group's deliveries are armed by the push that
    # sends them again)
    sweep = SWEEP + 1
    # a member's get: the session's inbox walked (one query: nothing consumed there), the
    # member's lanes' progress (a query), the stream advanced (a query,
    # ``GroupStore.advance``), the stream's items through the get's cache
    # (``CachedReader``): the lanes that never held a message from the source's start, the
    # delivery's lane from its cursor, its due run; at most three queries, one when the
    # first covers the others (the lanes' order rotates from get to get, and the gets run
    # side by side); the progress saved (PutItem), the get's delivery events (one record);
    # then what was acked since, read before the post (one BatchGetItem of the groups
    # table, ``acked_since``), and the post
    each = 1 + 1 + 1 + 3 + 1 + 1 + 1 + 1
    bound = REAPER_RUN + sweep + PUSHER_BATCH + ARCHIVER + each * CLIENTS
    assert unit.aws_calls * CLIENTS <= bound


def test_the_fleet_report_renders_the_sweep_lines_and_a_results_file_without_them(
    plain: tuple[dict[str, cost.Unit], list[dict[str, Any]]],
    grouped: tuple[dict[str, cost.Unit], list[dict[str, Any]]],
) -> None:
    """``python -m bench`` renders RESULTS.md again from results.json: a file from before
    these lines (no sweep units, no ``tables``) still renders, and one with them lists them
    with the note of which of them the model has."""
    results = json.loads((Path(cost.__file__).parent / "results.json").read_text())
    before = copy.deepcopy(results["benchmarks"]["fleet"])
    for units in before["counted"].values():
        for key in [k for k in units if k.startswith("sweep")]:
            del units[key]
        for unit in units.values():
            unit.pop("tables", None)
    before.pop("sweep_ack_timeout_s", None)
    text = cost.fleet_report(before)
    assert "- push delivery:" in text and "sweep" not in text
    after = copy.deepcopy(before)
    swept = {**plain[0], **grouped[0]}
    after["counted"]["push"] |= {k: asdict(u) for k, u in swept.items() if k.startswith("sweep")}
    text = cost.fleet_report(after)
    assert "- sweep redelivery, shared group:" in text
    assert "reaper: BatchGetItem groups 0.33" in text
    assert "the model has the look at a session acked in time" in text
    assert "its redeliveries are not in it" in text
