"""The router failing at every step of a batch, retried by the emulated event source mapping
(ReportBatchItemFailures, bisect on function error, unlimited retries, as deployed): every
message is delivered exactly once to every matching session, in order per ordering key, and
archived."""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import shoal.aws.dynamo as dynamo_module
from shoal.aws.dynamo import plain
from shoal.core.config import get_config
from shoal.delivery.inbox import InboxItem
from shoal.router.archive import ArchiveBatch, ArchiveWriter

import functions.router.app as router_app
from tests.integration.test_delivery_support import ALICE, BOB, World, world

__all__ = ["world"]  # fixture


class Crash(Exception):
    """The router dying at an injection point (an exception: Lambda reports a function error)."""


class Faults:
    """Numbered injection points around every step the router takes; raises at chosen ones.

    ``fail_at(invocation, first_try, step)``: the invocation's number, whether this exact
    batch (shard, records) is tried for the first time, the step's number within it.
    """

    def __init__(self, fail_at: Callable[[int, bool, int], bool]) -> None:
        self.fail_at = fail_at
        self.invocation = 0
        self.first_try = True
        self.step = 0
        self.tried: set[tuple[str, ...]] = set()
        self.crashes: list[str] = []
        self.steps_seen: list[int] = []
        self.lock = threading.Lock()

    def start(self, event: dict[str, Any]) -> None:
        self.invocation += 1
        self.step = 0
        batch = tuple(r["eventID"] for r in event["Records"])
        self.first_try = batch not in self.tried
        self.tried.add(batch)

    def point(self, name: str) -> None:
        # the inbox writes pass their points from the writer threads at once
        with self.lock:
            self.step += 1
            step = self.step
        if self.fail_at(self.invocation, self.first_try, step):
            self.crashes.append(f"{self.invocation}:{step}:{name}")
            raise Crash(name)

    def end(self) -> None:
        self.steps_seen.append(self.step)

    def wrap(self, target: Any, attribute: str, monkeypatch: pytest.MonkeyPatch) -> None:
        original = getattr(target, attribute)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self.point(f"before {attribute}")
            result = original(*args, **kwargs)
            self.point(f"after {attribute}")
            return result

        monkeypatch.setattr(target, attribute, wrapped)


def install(
    world: World, faults: Faults, monkeypatch: pytest.MonkeyPatch, *, interleave: bool = False
) -> None:
    """Wrap the router's steps; with ``interleave``, the sessions read and ack what is there
    before every attempt (so a retry that handed a delivery out again would be seen)."""
    inbox = world.fanout.inbox
    for attribute in ("ledger", "advance_ledger", "covered"):
        faults.wrap(inbox, attribute, monkeypatch)
    # each session's encoded item in a BatchWriteItem call of its own, the calls sent at once
    # (as the deployed router sends a round's calls), each call an injection point: a crash in
    # one leaves some sessions written and others not, while the calls beside it still land
    monkeypatch.setattr(dynamo_module, "MAX_BATCH_WRITE", 1)
    inbox.write_concurrency = 3
    faults.wrap(inbox.dynamo, "_write_chunk", monkeypatch)
    faults.wrap(world.fanout.cache.subscriptions, "versions", monkeypatch)
    writer = ArchiveWriter.from_config(get_config())
    faults.wrap(writer, "write", monkeypatch)
    monkeypatch.setattr(router_app.router(), "archive", writer)
    handler = world.router

    def router(event: dict[str, Any], context: Any) -> Any:
        if interleave:
            consume(world)
        faults.start(event)
        try:
            answer = handler(event, context)
            faults.point("after the handler returned")  # its answer lost: Lambda retries
            return answer
        finally:
            faults.end()

    world.router = router


def scenario(world: World) -> dict[str, list[str]]:
    """Three sessions with overlapping filters and a batch of traffic; what each should get."""
    world.topic("orders", 2)
    sessions = {
        "alice-a": (world.connect("alice-a", clean_start=False, session_expiry_s=600), ALICE),
        "alice-b": (world.connect("alice-b", clean_start=False, session_expiry_s=600), ALICE),
        "bob-1": (world.connect("bob-1", claims=BOB, clean_start=False, session_expiry_s=600), BOB),
    }
    world.subscribe("alice-a", sessions["alice-a"][0], "orders/#", "orders/+/1")
    world.subscribe("alice-b", sessions["alice-b"][0], "orders/eu/#", "misc/#")
    world.subscribe("bob-1", sessions["bob-1"][0], "orders/#", claims=BOB)
    published: list[tuple[str, str]] = []
    for n in range(9):
        topic = ("orders/eu/1", "orders/us/2", "misc/x")[n % 3]
        published.append((topic, world.publish(topic, f"{n}", ordering_key=f"k{n % 4}")))
    batch = [
        {"topic": "orders/eu/1", "text": f"b{n}", "ordering_key": f"k{n % 4}"} for n in range(4)
    ]
    world.publish_batch(batch)
    # the batch's ids, read back from the stream
    streams = {s: world.harness.messages(s) for s in ("shoal-orders-0", "shoal-default-0")}
    known = {mid for _, mid in published}
    for _, messages in streams.items():
        published += [(m.topic, m.message_id) for _, m in messages if m.message_id not in known]
    expected = {
        "alice-a": [mid for topic, mid in published if topic.startswith("orders/")],
        "alice-b": [mid for topic, mid in published if topic.startswith(("orders/eu/", "misc/"))],
        "bob-1": [mid for topic, mid in published if topic.startswith("orders/")],
    }
    world.sessions = sessions  # type: ignore[attr-defined]
    return expected


def consume(world: World) -> None:
    sessions = getattr(world, "sessions", {})
    got: dict[str, list[str]] = world.__dict__.setdefault("received", {})
    for client_id, (channel, claims) in sessions.items():
        messages = world.drain(client_id, channel, claims=claims)
        got.setdefault(client_id, []).extend(m["message_id"] for m in messages)


def received(world: World) -> dict[str, list[str]]:
    consume(world)
    out: dict[str, list[str]] = world.__dict__["received"]
    return out


def archived(world: World) -> Counter[str]:
    s3 = world.session.client("s3")
    bucket = get_config().buckets["archive"]
    ids: Counter[str] = Counter()
    for item in s3.list_objects_v2(Bucket=bucket, Prefix="messages/").get("Contents", []):
        body = s3.get_object(Bucket=bucket, Key=item["Key"])["Body"].read()
        ids.update({json.loads(line)["message_id"] for line in body.splitlines()})
    return ids


def written(world: World) -> Counter[tuple[str, str, str]]:
    """How many inbox items hold each (session, source, position)."""
    table = world.session.resource("dynamodb").Table(get_config().table("inboxes"))
    found: Counter[tuple[str, str, str]] = Counter()
    for raw in table.scan(ConsistentRead=True)["Items"]:
        if "b" not in raw:
            continue  # the state and the ledger
        item = InboxItem.from_record(plain(raw))
        for message in item.messages:
            found[(item.session_id, item.source, message.position)] += 1
    return found


def check(world: World, expected: dict[str, list[str]]) -> None:
    # a retried batch wrote nothing twice
    assert written(world) and set(written(world).values()) == {1}
    got = received(world)
    for client_id, ids in expected.items():
        # exactly once each
        assert Counter(got[client_id]) == Counter(ids), client_id
    everything = {mid for ids in expected.values() for mid in ids}
    assert set(archived(world)) >= everything


def drain_with_faults(world: World, faults: Faults) -> None:
    for _ in range(50):
        world.route()
        if not world.esm.drain():
            return
    raise AssertionError(f"the router never caught up: {faults.crashes}")


def test_a_clean_run_passes_every_injection_point(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    faults = Faults(lambda invocation, first_try, step: False)
    install(world, faults, monkeypatch)
    expected = scenario(world)
    drain_with_faults(world, faults)
    # Given the injection points are where the tests below think they are: a batch delivering
    # to three sessions passes 15 of them
    assert max(faults.steps_seen) == STEPS
    check(world, expected)


#: injection points of one invocation whose batch delivers to three sessions: archive (its
#: items name its lines, so it goes first), subscription versions, ledger read, ledger advance,
#: three concurrent inbox writes (before and after each), and the handler's return
STEPS = 15
#: right after the archive write, before anything of the inbox
AFTER_ARCHIVE = 2
#: right after the last inbox write
AFTER_INBOX = STEPS - 1


@pytest.mark.parametrize("step", range(1, STEPS + 1))
def test_a_crash_at_any_step_of_every_batch(
    world: World, monkeypatch: pytest.MonkeyPatch, step: int
) -> None:
    # Every batch dies at this step the first time it is tried; a retry is bisected (a
    # function error), so its halves are new batches that die there too, down to single
    # records, which then go through
    faults = Faults(lambda invocation, first_try, at: first_try and at == step)
    install(world, faults, monkeypatch)
    expected = scenario(world)
    drain_with_faults(world, faults)
    assert faults.crashes, "the injection point was never reached"
    check(world, expected)


def test_each_retry_crashing_one_step_further(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Invocation n dies at step n: batches are bisected, retried and cut again and again
    faults = Faults(lambda invocation, first_try, at: at == invocation)
    install(world, faults, monkeypatch, interleave=True)
    expected = scenario(world)
    drain_with_faults(world, faults)
    assert len(faults.crashes) >= 8
    check(world, expected)


@pytest.mark.parametrize("step", [AFTER_ARCHIVE, AFTER_INBOX], ids=["archive", "inbox"])
def test_crashes_after_the_archive_or_the_deliveries_across_rounds_of_traffic(
    world: World, monkeypatch: pytest.MonkeyPatch, step: int
) -> None:
    # Every first try dies right after its archive write (its items not written yet) or after
    # its inbox writes, in two rounds of traffic
    faults = Faults(lambda invocation, first_try, at: first_try and at == step)
    install(world, faults, monkeypatch, interleave=True)
    expected = scenario(world)
    drain_with_faults(world, faults)
    where = {AFTER_ARCHIVE: "after write", AFTER_INBOX: "after _write_chunk"}[step]
    assert faults.crashes and {c.rsplit(":", 1)[1] for c in faults.crashes} == {where}
    more = [world.publish("orders/eu/1", f"late{n}", ordering_key="k0") for n in range(5)]
    drain_with_faults(world, faults)
    for client_id in expected:
        expected[client_id] += more
    check(world, expected)


def test_a_record_reported_failed_is_retried_from_there(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given the record handler failing once on the fourth record of a shard (Powertools then
    # reports it, and Lambda retries the batch from that record, not bisected)
    expected = scenario(world)
    original = ArchiveBatch.add
    seen: list[str] = []

    def add(self: ArchiveBatch, record: Any) -> None:
        seen.append(record.kinesis.sequenceNumber)
        if len(seen) == 4:
            raise RuntimeError("one bad record, once")
        original(self, record)

    monkeypatch.setattr(ArchiveBatch, "add", add)
    world.route()
    check(world, expected)
