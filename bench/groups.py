"""Shared groups: throughput through get+ack, rebalance times, hand-off, moves, conflicts.

- **Throughput**: messages/s through get (max 100) + ack of 1, 4 and 16 members, one thread
  each, draining a backlog of 800 unkeyed messages on a 1-partition and an 8-partition topic
  (the router's items: 100 messages per source and invocation), with the default lanes (8 per
  partition) and, side by side in the same run, with one lane (the design before lanes) as the
  baseline. Members poll as the client does: get, ack what came, heartbeat every 2 s; an empty
  get waits as a long poll looks again (0.1 s, then 1.5 times longer, at most 1 s). The clock
  stands still (the emulator's serialized calls would otherwise let leases expire). Measured per
  case: messages/s, p50 of get+ack, AWS calls and DynamoDB write units per message (get, ack and
  heartbeat only; units from the items' sizes as ``bench.delivery.WriteUnits`` counts them),
  read units of the messages' queries, and how the messages spread over the members. Then the
  same on 1 partition with 10 ms of work per message between get and ack.
- **Rebalance** (real clock, default lease timeout and lanes, a 1-partition topic): 4 members
  poll every 0.15 s and heartbeat every 2 s while a publisher writes 10 messages every 0.1 s.
  A fifth member joins (subscribe: the membership transaction, then ``GroupService.after``), one
  leaves gracefully (it acks what it holds, then unsubscribes), one crashes (it stops calling
  with messages unacked). Grants are timed when their transaction committed: join to the new
  member holding its share of lanes and to its first message; leave to its lanes granted to
  others; crash (from its last renewal) to its lanes granted to survivors and to its unacked
  messages handed out again. Then every published message is checked to have been delivered.
- **Reassignment** (injected clock): the crash again, in heartbeat rounds of lease timeout / 3.
- **Moves**: streams that change holder when one member joins or leaves a settled group, for
  1..50 members over 16 and 64 streams (the pure leader), against the least possible.
- **Conflicts**: 50 members join one group at once (one thread each, through the subscribe-side
  membership transaction and the advance after it), then heartbeat, get and ack for a few
  rounds; conditional writes per operation and how many lost a race (re-read and retried).

The emulator serializes DynamoDB calls (``shoal.local.serialize``), so concurrency shows up as
conflicts, not as speed-up; throughput is Shoal's work plus moto's, not DynamoDB's.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from shoal.client.http import GROUP_HEARTBEAT_MS
from shoal.core.config import DEFAULT_GROUP_PARALLELISM, DEFAULT_LEASE_TIMEOUT_S
from shoal.core.errors import ServerBusy
from shoal.core.retry import backoff_s
from shoal.delivery.model import MAX_POLL_INTERVAL_S, POLL_INTERVAL_S
from shoal.groups.records import default_lanes

from bench.account import CallMeter, emulated_account, item_size
from bench.delivery import WriteUnits

LEASE_TIMEOUTS_S = (DEFAULT_LEASE_TIMEOUT_S, 15.0)
MOVE_MEMBERS = (1, 2, 3, 4, 8, 16, 32, 50)
MOVE_STREAMS = (16, 64)
HEARTBEAT_S = GROUP_HEARTBEAT_MS / 1000
#: the lanes a group gets by default on a topic of one partition (ceil(parallelism / 1))
DEFAULT_GROUP_LANES = default_lanes(DEFAULT_GROUP_PARALLELISM, 1)
#: the throughput matrix: members x partitions (sources), each with these lane counts
THROUGHPUT_MEMBERS = (1, 4, 16)
THROUGHPUT_PARTITIONS = (1, 8)
THROUGHPUT_LANES = (DEFAULT_GROUP_LANES, 1)
THROUGHPUT_MESSAGES = 800
#: the same with work per message between get and ack, on 1 partition
WORK_MEMBERS = (4, 16)
WORK_MESSAGES = 400
WORK_MS = 10.0
#: messages the router writes per source and invocation (one Kinesis batch)
ROUTER_BATCH = 100
#: the rebalance scenario
REBALANCE_MEMBERS = 4
REBALANCE_REPEATS = 3
REBALANCE_POLL_S = 0.15
TRICKLE_MESSAGES = 10
TRICKLE_EVERY_S = 0.1
WATCH_EVERY_S = 0.05
#: a pause between the scenario's steps (the group settles, polls go on)
SETTLE_S = 0.5
WAIT_S = 30.0


class _FrozenClock:
    """Time stands still (no lease expires while the emulator is slow), but sleeps sleep."""

    def __init__(self) -> None:
        self._now = time.time_ns() // 1_000_000

    def now_ms(self) -> int:
        return self._now

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


def _world(session: Any, share: str, lease_s: float, clock: Any, lanes: int | None = None) -> Any:
    from shoal.aws.dynamo import Dynamo
    from shoal.core.config import DeliverySettings, get_config
    from shoal.delivery.inbox import InboxStore
    from shoal.groups.service import GroupService
    from shoal.groups.streams import StreamReader

    config = get_config()
    dynamo = Dynamo(session.client("dynamodb"))
    service = GroupService(
        _store(dynamo, lease_s, clock, lanes),
        StreamReader(dynamo, config.table("inboxes")),
        DeliverySettings(ack_timeout_s=30, window=100),
        clock=clock,
    )
    return _Group(share, service, InboxStore(dynamo, config.table("inboxes")), clock)


def _store(dynamo: Any, lease_s: float, clock: Any, lanes: int | None = None) -> Any:
    from shoal.core.config import GroupSettings, get_config
    from shoal.groups.store import GroupStore

    config = get_config()
    return GroupStore(
        dynamo,
        config.table("groups"),
        config.table("inboxes"),
        settings=GroupSettings(lease_timeout_s=lease_s, lanes=lanes or DEFAULT_GROUP_LANES),
        clock=clock,
    )


class _Group:
    def __init__(self, share: str, service: Any, inbox: Any, clock: Any) -> None:
        self.share = share
        self.text = f"$share/{share}/orders/#"
        self.service = service
        self.store = service.store
        self.inbox = inbox
        self.clock = clock
        self.incarnation = ""
        self.seq = 0
        self.join_attempts = 0
        self.join_conflicts = 0
        #: every message id published, in order
        self.published: list[str] = []
        self._known: set[str] = set()
        self._lock = threading.Lock()

    @property
    def key(self) -> str:
        from shoal.groups.records import group_key

        return group_key(self.share, "orders/#")

    def subs(self) -> dict[str, Any]:
        return {self.text: {"qos": 1, "share": self.share, "group": self.incarnation}}

    def join(self, member: str) -> None:
        """Subscribe: the membership transaction, then the advance after it."""
        for attempt in range(64):
            plan = self.service.membership(f"c-{member}", member, joins=[self.text])
            reasons = self.store.dynamo.transact(plan.parts)
            with self._lock:
                self.join_attempts += 1
                self.join_conflicts += reasons is not None
            if reasons is None:
                self.incarnation = plan.incarnations[self.text]
                self.service.after(plan)
                return
            time.sleep(backoff_s(attempt, 0.005, 0.2))
        raise RuntimeError("join did not land")

    def leave(self, member: str) -> None:
        """Unsubscribe: the membership transaction, then the advance after it."""
        for attempt in range(64):
            plan = self.service.membership(f"c-{member}", member, leaves=self.subs())
            if self.store.dynamo.transact(plan.parts) is None:
                self.service.after(plan)
                return
            time.sleep(backoff_s(attempt, 0.005, 0.2))
        raise RuntimeError("leave did not land")

    def publish(self, sources: int, per_source: int, batch: int = ROUTER_BATCH) -> int:
        """Write messages into the group's partition as the router does: one record per
        message, one pack per source and invocation of ``batch`` records; unkeyed, so they
        spread over the lanes by message id."""
        from shoal.delivery.inbox import InboxMessage, pack
        from shoal.delivery.model import position, record_end
        from shoal.groups.streams import group_partition

        total = 0
        for s in range(sources):
            source = f"src{s:03d}"
            for start in range(0, per_source, batch):
                messages = []
                for _ in range(min(batch, per_source - start)):
                    with self._lock:
                        self.seq += 1
                        seq = self.seq
                    messages.append(
                        InboxMessage(
                            position=position(seq, 0),
                            message_id=f"{source}-{seq}",
                            topic=f"orders/{s}",
                            payload=b"x" * 64,
                            qos=1,
                            subscription=self.text,
                            sid=self.incarnation,
                            published_at_ms=self.clock.now_ms(),
                        )
                    )
                self.inbox.put(
                    pack(
                        group_partition(self.incarnation),
                        source,
                        messages,
                        record_end(seq),
                        2_000_000_000,
                    )
                )
                with self._lock:
                    self.published += [m.message_id for m in messages]
                if source not in self._known:
                    self.store.ensure_stream(self.key, self.incarnation, source)
                    self._known.add(source)
                total += len(messages)
        return total


def _granted(state: Any) -> dict[str, list[str]]:
    """Member -> the streams granted to it."""
    from shoal.groups.streams import StreamState

    out: dict[str, list[str]] = {}
    for stream, lease in sorted(state.streams.items()):
        if lease.holder is not None and lease.state is StreamState.GRANTED:
            out.setdefault(lease.holder, []).append(stream)
    return out


# --- throughput --------------------------------------------------------------------------------


class _InboxReads:
    """Read units of the queries of the inboxes table (the messages a get reads, its own
    lane's and the ones it passes over), by DynamoDB's rule: a query's items' total size in
    4 KB units, strongly consistent."""

    def __init__(self) -> None:
        self.units = 0
        self.items = 0

    def attach(self, client: Any) -> None:
        client.meta.events.register("after-call.dynamodb.Query", self._record)

    def _record(self, parsed: dict[str, Any], **_: Any) -> None:
        found = [i for i in parsed.get("Items", []) if "inbox" in i and "position" in i]
        if found:
            self.items += len(found)
            self.units += math.ceil(sum(item_size(i) for i in found) / 4096)


def _throughput(
    session: Any,
    members: int,
    partitions: int,
    lanes: int,
    *,
    messages: int = THROUGHPUT_MESSAGES,
    work_ms: float = 0.0,
) -> dict[str, Any]:
    """``work_ms``: a member's work per message between its get and its ack (a sleep)."""
    # a frozen clock: the emulator serializes every call, so a member's call can wait behind
    # the others' for longer than the lease timeout, which DynamoDB's latency never makes it
    clock = _FrozenClock()
    group = _world(
        session,
        f"tp{members}x{partitions}x{lanes}x{work_ms:g}",
        DEFAULT_LEASE_TIMEOUT_S,
        clock,
        lanes,
    )
    names = [f"m{n:02d}" for n in range(members)]
    for name in names:
        group.join(name)
    total = group.publish(sources=partitions, per_source=messages // partitions)
    for name in names:
        group.service.heartbeat(name, group.subs())
    loaded = group.store.load(group.key)
    streams = len(loaded.state.streams)
    meter, units, reads = CallMeter(), WriteUnits(), _InboxReads()
    for counter in (meter, units, reads):
        counter.attach(group.store.dynamo.client)
    lock = threading.Lock()
    acked = 0
    last_ack = 0.0
    busy = 0
    latencies: list[float] = []
    received: dict[str, int] = dict.fromkeys(names, 0)
    deliveries: dict[str, int] = {}
    deadline = time.monotonic() + 120

    def consume(member: str) -> None:
        nonlocal acked, last_ack, busy
        last_beat = time.monotonic()
        idle = POLL_INTERVAL_S
        while time.monotonic() < deadline:
            with lock:
                if acked >= total:
                    return
            try:
                if time.monotonic() - last_beat >= HEARTBEAT_S:
                    group.service.heartbeat(member, group.subs())
                    last_beat = time.monotonic()
                t0 = time.perf_counter()
                got = group.service.get(member, group.subs(), 100)
                if not got:
                    time.sleep(idle)
                    idle = min(idle * 1.5, MAX_POLL_INTERVAL_S)
                    continue
                idle = POLL_INTERVAL_S
                took = time.perf_counter() - t0
                if work_ms:
                    time.sleep(len(got) * work_ms / 1000)
                t1 = time.perf_counter()
                n = group.service.ack(member, group.subs(), [m["id"] for m in got])
                took += time.perf_counter() - t1
            except ServerBusy:
                with lock:
                    busy += 1
                time.sleep(0.05)
                continue
            with lock:
                latencies.append(took)
                acked += n
                last_ack = time.perf_counter()
                received[member] += len(got)
                for m in got:
                    deliveries[m["message_id"]] = deliveries.get(m["message_id"], 0) + 1

    meter.reset()
    units.units, units.by_operation = 0.0, {}
    reads.units = reads.items = 0
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=members) as pool:
        list(pool.map(consume, names))
    elapsed = (last_ack or time.perf_counter()) - started
    calls = sum(meter.calls.values())
    spread = sorted(received.values())
    return {
        "members": members,
        "partitions": partitions,
        "lanes": lanes,
        "streams": streams,
        "messages": total,
        "work_ms_per_message": work_ms,
        "acked": acked,
        "delivered_twice": sum(1 for n in deliveries.values() if n > 1),
        "never_delivered": total - len(deliveries),
        "busy": busy,
        "seconds": round(elapsed, 2),
        "messages_per_s": round(acked / elapsed, 1) if elapsed > 0 else None,
        "p50_get_ack_ms": round(statistics.median(latencies) * 1000, 1) if latencies else None,
        "calls": calls,
        "calls_per_message": round(calls / max(1, acked), 3),
        "calls_by_operation": dict(sorted(meter.calls.items())),
        "write_units_per_message": round(units.units / max(1, acked), 3),
        "write_units_by_operation": dict(sorted(units.by_operation.items())),
        "inbox_read_units_per_message": round(reads.units / max(1, acked), 3),
        "inbox_items_read_per_message": round(reads.items / max(1, acked), 3),
        "members_receiving": sum(1 for n in spread if n),
        "min_per_member": spread[0],
        "max_per_member": spread[-1],
    }


# --- rebalance: join, graceful leave, crash ------------------------------------------------------


class _Pollers:
    """Member threads polling as a client would: get (max 100) and ack every ``poll_s``,
    heartbeat every 2 s. A crash stops a member right after a get that brought messages,
    without acking them."""

    def __init__(self, group: Any, poll_s: float = REBALANCE_POLL_S) -> None:
        self.group = group
        self.poll_s = poll_s
        #: message id -> (member, ms the get began, ms it answered) of every delivery
        self.seen: dict[str, list[tuple[str, int, int]]] = {}
        self.first_ms: dict[str, int] = {}
        self.last_call_ms: dict[str, int] = {}
        self.unacked: dict[str, list[str]] = {}
        self.errors: list[str] = []
        self._stop: dict[str, threading.Event] = {}
        self._crash: dict[str, threading.Event] = {}
        self._threads: dict[str, threading.Thread] = {}
        self._lock = threading.Lock()

    def start(self, member: str) -> None:
        self._stop[member] = threading.Event()
        self._crash[member] = threading.Event()
        thread = threading.Thread(target=self._loop, args=(member,), daemon=True)
        self._threads[member] = thread
        thread.start()

    def stop(self, member: str) -> None:
        self._stop[member].set()
        self._threads[member].join()

    def crash(self, member: str) -> None:
        self._crash[member].set()
        self._threads[member].join()

    def stop_all(self) -> None:
        for member in list(self._threads):
            self._stop[member].set()
        for thread in self._threads.values():
            thread.join()

    def delivered_to(
        self, message_id: str, others_than: str, after_ms: int
    ) -> tuple[int, int] | None:
        """When the get that first gave the message to another member than ``others_than``
        after ``after_ms`` began and answered."""
        with self._lock:
            times = [(t, b) for m, b, t in self.seen.get(message_id, []) if m != others_than]
        times = [x for x in times if x[0] >= after_ms]
        return min(times) if times else None

    def delivered(self) -> set[str]:
        with self._lock:
            return set(self.seen)

    def delivered_again(self) -> int:
        """Messages that went out more than once."""
        with self._lock:
            return sum(1 for times in self.seen.values() if len(times) > 1)

    def _loop(self, member: str) -> None:
        group = self.group
        clock = group.clock
        last_beat = 0.0
        while not self._stop[member].is_set():
            try:
                if time.monotonic() - last_beat >= HEARTBEAT_S:
                    group.service.heartbeat(member, group.subs())
                    last_beat = time.monotonic()
                began = clock.now_ms()
                got = group.service.get(member, group.subs(), 100)
                now = clock.now_ms()
                with self._lock:
                    self.last_call_ms[member] = now
                    for m in got:
                        self.seen.setdefault(m["message_id"], []).append((member, began, now))
                    if got and member not in self.first_ms:
                        self.first_ms[member] = now
                if got and self._crash[member].is_set():
                    self.unacked[member] = [m["message_id"] for m in got]
                    return
                if got:
                    group.service.ack(member, group.subs(), [m["id"] for m in got])
            except ServerBusy as exc:
                with self._lock:
                    self.errors.append(f"{member}: {exc}")
            time.sleep(self.poll_s)


class _Publisher:
    """A steady trickle: ``count`` messages on one source every ``every_s``."""

    def __init__(self, group: Any, count: int = TRICKLE_MESSAGES, every_s: float = TRICKLE_EVERY_S):
        self.group = group
        self.count = count
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.group.publish(sources=1, per_source=self.count)
            time.sleep(self.every_s)


def _wait(store: Any, key: str, done: Callable[[Any], bool], timeout_s: float = WAIT_S) -> Any:
    """Load the leader every 50 ms until ``done(state)``; the state that satisfied it."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = store.load(key).state
        if done(state):
            return state
        if time.monotonic() > deadline:
            raise TimeoutError("the group did not get there in time")
        time.sleep(WATCH_EVERY_S)


def _balanced(state: Any, now_ms: int, timeout_ms: int) -> bool:
    """Every stream granted to a live member, each holding the floor or ceiling of its share."""
    live = state.live_members(now_ms, timeout_ms)
    if not live:
        return False
    granted = _granted(state)
    if sum(len(s) for s in granted.values()) != len(state.streams) or set(granted) - set(live):
        return False
    floor = len(state.streams) // len(live)
    return all(floor <= len(granted.get(m, [])) <= floor + 1 for m in live)


class _Grants:
    """When each grant was committed: wraps the group store's ``commit`` (every transition
    of the group goes through it) and notes the clock after each one that succeeded."""

    def __init__(self, store: Any, clock: Any) -> None:
        from shoal.groups.streams import StreamState

        self.at: dict[tuple[str, int], int] = {}
        commit = store.commit

        def committed(loaded: Any, new: Any, operation: str = "advance") -> bool:
            ok = bool(commit(loaded, new, operation))
            if ok:
                now = clock.now_ms()
                for stream, lease in new.streams.items():
                    if lease.state is StreamState.GRANTED:
                        self.at.setdefault((stream, lease.lease), now)
            return ok

        store.commit = committed

    def of(self, state: Any, streams: list[str]) -> int | None:
        """When the last of ``streams``' current grants was committed."""
        times = [self.at.get((s, state.streams[s].lease)) for s in streams]
        return None if not times or None in times else max(t for t in times if t is not None)


def _rebalance(session: Any, round_: int, lease_s: float) -> dict[str, Any]:
    from shoal.aws.dynamo import Dynamo
    from shoal.core.clock import SystemClock

    clock = SystemClock()
    timeout_ms = int(lease_s * 1000)
    group = _world(session, f"rb{round_}", lease_s, clock)
    grants = _Grants(group.store, clock)
    # the watcher reads the leader through a client of its own
    watch = _store(Dynamo(session.client("dynamodb")), lease_s, clock)
    names = [f"m{n}" for n in range(REBALANCE_MEMBERS)]
    for name in names:
        group.join(name)
    publisher = _Publisher(group)
    pollers = _Pollers(group)
    publisher.start()
    for name in names:
        pollers.start(name)

    def granted_to(streams: list[str], holders: list[str]) -> Callable[[Any], bool]:
        return lambda s: all(
            s.streams[x].holder in holders and s.streams[x].state.value == "granted"
            for x in streams
        )

    try:
        _wait(watch, group.key, lambda s: _balanced(s, clock.now_ms(), timeout_ms))
        time.sleep(SETTLE_S)

        # join: subscribe (membership transaction + advance), then poll as a client
        joiner = f"m{REBALANCE_MEMBERS}"
        t0 = clock.now_ms()
        group.join(joiner)
        subscribed_ms = clock.now_ms() - t0
        pollers.start(joiner)
        state = _wait(
            watch,
            group.key,
            lambda s: _balanced(s, clock.now_ms(), timeout_ms) and joiner in _granted(s),
        )
        share = _granted(state)[joiner]
        join_at = grants.of(state, share)
        deadline = time.monotonic() + WAIT_S
        while joiner not in pollers.first_ms and time.monotonic() < deadline:
            time.sleep(WATCH_EVERY_S)
        join_first = pollers.first_ms.get(joiner)
        time.sleep(SETTLE_S)

        # graceful leave: the member stops polling (it acked what it got), then unsubscribes
        leaver = names[1]
        left = _granted(watch.load(group.key).state).get(leaver, [])
        pollers.stop(leaver)
        t1 = clock.now_ms()
        group.leave(leaver)
        unsubscribed_ms = clock.now_ms() - t1
        others = [m for m in [*names, joiner] if m != leaver]
        state = _wait(watch, group.key, granted_to(left, others))
        leave_at = grants.of(state, left)
        time.sleep(SETTLE_S)

        # crash: the member gets messages and stops calling without acking them
        victim = names[2]
        pollers.crash(victim)
        crashed_at = pollers.last_call_ms[victim]
        before = watch.load(group.key).state
        renewed = before.members[victim].renewed_at_ms
        held = _granted(before).get(victim, [])
        unacked = pollers.unacked.get(victim, [])
        survivors = [m for m in others if m != victim]
        state = _wait(watch, group.key, granted_to(held, survivors))
        crash_at = grants.of(state, held)
        deadline = time.monotonic() + WAIT_S
        again: list[tuple[int, int] | None] = [None]
        while time.monotonic() < deadline:
            again = [pollers.delivered_to(m, victim, crashed_at) for m in unacked]
            if None not in again:
                break
            time.sleep(WATCH_EVERY_S)
        done = [x for x in again if x is not None]
        redelivered_at = max(t for t, _ in done) if done and None not in again else None
        # how long the gets that handed them out again took
        redelivering_s = max(((t - b) / 1000 for t, b in done), default=None)

        # every message published went out to some member
        publisher.stop()
        deadline = time.monotonic() + WAIT_S
        missing = set(group.published)
        while missing and time.monotonic() < deadline:
            missing -= pollers.delivered()
            time.sleep(WATCH_EVERY_S)
    finally:
        publisher.stop()
        pollers.stop_all()

    def since(at: int | None, start: int) -> float | None:
        return None if at is None else (at - start) / 1000

    return {
        "round": round_,
        "streams": len(state.streams),
        "join_subscribe_s": subscribed_ms / 1000,
        "join_share": len(share),
        "join_share_s": since(join_at, t0),
        "join_first_message_s": since(join_first, t0),
        "leave_lanes": len(left),
        "leave_unsubscribe_s": unsubscribed_ms / 1000,
        "leave_granted_s": since(leave_at, t1),
        "crash_lanes": len(held),
        "crash_unacked": len(unacked),
        "crash_renewed_before_last_call_s": (crashed_at - renewed) / 1000,
        "crash_granted_s": since(crash_at, renewed),
        "crash_redelivered_s": since(redelivered_at, renewed),
        "crash_redelivering_get_s": redelivering_s,
        "published": len(group.published),
        "never_delivered": len(missing),
        "delivered_again": pollers.delivered_again(),
        "busy": len(pollers.errors),
    }


# --- reassignment after a death (injected clock) -------------------------------------------------


def _reassignment(session: Any, lease_s: float) -> dict[str, Any]:
    from shoal.core.clock import ManualClock

    clock = ManualClock()
    group = _world(session, f"dead{int(lease_s)}", lease_s, clock)
    members = [f"m{n}" for n in range(4)]
    for member in members:
        group.join(member)
    group.publish(sources=1, per_source=80)
    interval = lease_s / 3
    for member in members:
        group.service.heartbeat(member, group.subs())
    # the victim takes messages from the streams it holds and never acks them
    victim = members[0]
    unacked = {m["message_id"] for m in group.service.get(victim, group.subs(), 100)}
    held = {s for s, x in group.store.load(group.key).state.streams.items() if x.holder == victim}
    died_at = clock.now_ms()
    survivors = members[1:]
    rounds = 0
    reassigned_round = redelivered_round = None
    reassigned_s = redelivered_s = None
    seen: set[str] = set()
    while rounds < 100 and (reassigned_round is None or redelivered_round is None):
        rounds += 1
        clock.advance(interval)
        for member in survivors:
            group.service.heartbeat(member, group.subs())
        for member in survivors:
            for message in group.service.get(member, group.subs(), 100):
                seen.add(message["message_id"])
                group.service.ack(member, group.subs(), [message["id"]])
        state = group.store.load(group.key).state
        if reassigned_round is None and all(
            state.streams[s].holder in survivors and state.streams[s].state.value == "granted"
            for s in held
        ):
            reassigned_round, reassigned_s = rounds, (clock.now_ms() - died_at) / 1000
        if redelivered_round is None and unacked <= seen:
            redelivered_round, redelivered_s = rounds, (clock.now_ms() - died_at) / 1000
    return {
        "lease_timeout_s": lease_s,
        "heartbeat_interval_s": round(interval, 3),
        "streams": len(group.store.load(group.key).state.streams),
        "streams_held_by_dead_member": len(held),
        "unacked_at_death": len(unacked),
        "rounds_to_reassignment": reassigned_round,
        "seconds_to_reassignment": reassigned_s,
        "rounds_to_redelivery": redelivered_round,
        "seconds_to_redelivery": redelivered_s,
    }


# --- moves per join / leave (pure) ---------------------------------------------------------------


def _moves() -> list[dict[str, Any]]:
    from shoal.groups.state import add_streams, advance, join, leave, new_group

    timeout = 10_000
    now = 1_000_000

    def settle(state: Any) -> Any:
        for _ in range(200):
            drained = replace(
                state, streams={s: replace(x, in_flight=0) for s, x in state.streams.items()}
            )
            after = advance(drained, now, timeout)
            if after.same_assignment(drained):
                return after
            state = after
        raise RuntimeError("did not settle")

    def holders(state: Any) -> dict[str, Any]:
        return {s: x.holder for s, x in state.streams.items()}

    out = []
    for n in MOVE_STREAMS:
        for k in MOVE_MEMBERS:
            state = new_group("g", "orders/#", "i", now)
            for m in range(k):
                state = join(state, f"m{m:02d}", "c", now)
            state = settle(add_streams(state, [f"s{i:02d}" for i in range(n)]))
            before = holders(state)
            joined = settle(join(state, "new", "c", now))
            join_moves = sum(1 for s, h in holders(joined).items() if h != before[s])
            leaver_had = sum(1 for h in before.values() if h == "m00")
            left_moves = None
            if k > 1:
                left = settle(leave(state, "m00", now))
                left_moves = sum(1 for s, h in holders(left).items() if h != before[s])
            out.append(
                {
                    "streams": n,
                    "members": k,
                    "join_moves": join_moves,
                    "join_least": n // (k + 1),
                    "leave_moves": left_moves,
                    "leave_least": leaver_had if k > 1 else None,
                }
            )
    return out


# --- conflicts with 50 concurrent members ------------------------------------------------------


def _conflicts(
    session: Any, members: int = 50, sources: int = 2, rounds: int = 3
) -> dict[str, Any]:
    # a frozen clock: conflicts come from concurrency alone, not from leases that the
    # emulator's slowness lets expire
    clock = _FrozenClock()
    group = _world(session, "crowd", DEFAULT_LEASE_TIMEOUT_S, clock)
    names = [f"m{n:02d}" for n in range(members)]
    group.join(names[0])
    group.publish(sources=sources, per_source=80)
    group.join_attempts = group.join_conflicts = 0
    group.store.stats.writes.clear()
    group.store.stats.conflicts.clear()
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=members) as pool:
        list(pool.map(group.join, names[1:]))
    join_s = time.perf_counter() - started
    acks = 0
    lock = threading.Lock()

    def work(member: str) -> None:
        nonlocal acks
        for _ in range(rounds):
            group.service.heartbeat(member, group.subs())
            got = group.service.get(member, group.subs(), 10)
            if got:
                n = group.service.ack(member, group.subs(), [m["id"] for m in got])
                with lock:
                    acks += n

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=members) as pool:
        list(pool.map(work, names))
    work_s = time.perf_counter() - started
    stats = group.store.stats.as_dict()
    operations: dict[str, Any] = {
        "membership": {"writes": group.join_attempts, "conflicts": group.join_conflicts}
    }
    for name, writes in sorted(stats["writes"].items()):
        operations[name] = {"writes": writes, "conflicts": stats["conflicts"].get(name, 0)}
    for figures in operations.values():
        figures["conflict_rate"] = round(figures["conflicts"] / max(1, figures["writes"]), 3)
    return {
        "members": members,
        "sources": sources,
        "lanes": DEFAULT_GROUP_LANES,
        "streams": len(group.store.load(group.key).state.streams),
        "rounds": rounds,
        "join_s": round(join_s, 2),
        "work_s": round(work_s, 2),
        "acked": acks,
        "operations": operations,
    }


#: (field, what it measures from, until) of the rebalance table
REBALANCE_EVENTS = (
    ("join_share_s", "join", "the subscribe began", "the new member holds its share of lanes"),
    ("join_first_message_s", "join", "the subscribe began", "the new member got a message"),
    (
        "leave_granted_s",
        "graceful leave",
        "the unsubscribe began",
        "its lanes are granted to others",
    ),
    ("crash_granted_s", "crash", "its last renewal", "its lanes are granted to survivors"),
    (
        "crash_redelivered_s",
        "crash",
        "its last renewal",
        "its unacked messages went out again",
    ),
)


def _summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, *_ in REBALANCE_EVENTS:
        values = [r[name] for r in rounds if r[name] is not None]
        out[name] = {
            "median": round(statistics.median(values), 3) if values else None,
            "max": round(max(values), 3) if values else None,
            "missing": len(rounds) - len(values),
        }
    return out


def run() -> dict[str, Any]:
    started = time.perf_counter()
    figures: dict[str, Any] = {"moves": _moves()}
    with emulated_account() as session:
        figures["throughput"] = [
            _throughput(session, members, partitions, lanes)
            for partitions in THROUGHPUT_PARTITIONS
            for members in THROUGHPUT_MEMBERS
            for lanes in THROUGHPUT_LANES
        ]
        figures["throughput_with_work"] = [
            _throughput(session, members, 1, lanes, messages=WORK_MESSAGES, work_ms=WORK_MS)
            for members in WORK_MEMBERS
            for lanes in THROUGHPUT_LANES
        ]
    with emulated_account() as session:
        rounds = [_rebalance(session, n, DEFAULT_LEASE_TIMEOUT_S) for n in range(REBALANCE_REPEATS)]
    figures["rebalance"] = {
        "lease_timeout_s": DEFAULT_LEASE_TIMEOUT_S,
        "heartbeat_s": HEARTBEAT_S,
        "lanes": DEFAULT_GROUP_LANES,
        "members": REBALANCE_MEMBERS,
        "poll_s": REBALANCE_POLL_S,
        "trickle_per_s": round(TRICKLE_MESSAGES / TRICKLE_EVERY_S),
        "summary": _summary(rounds),
        "rounds": rounds,
    }
    with emulated_account() as session:
        figures["reassignment"] = [_reassignment(session, s) for s in LEASE_TIMEOUTS_S]
        figures["conflicts"] = _conflicts(session)
    figures["seconds"] = round(time.perf_counter() - started, 1)
    return figures


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


def _throughput_table(cases: list[dict[str, Any]]) -> tuple[list[str], list[float]]:
    """The table's lines, and msg/s of the default lanes over one lane, per pair."""
    base = {(c["partitions"], c["members"]): c["messages_per_s"] for c in cases if c["lanes"] == 1}
    lines = [
        "| partitions | members | lanes | streams | msg/s | vs 1 lane | p50 get+ack ms "
        "| AWS calls / msg | write units / msg | inbox read units / msg "
        "| members receiving | per member min-max |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ratios: list[float] = []
    for c in cases:
        ratio = _ratio(c["messages_per_s"], base.get((c["partitions"], c["members"])))
        if c["lanes"] != 1 and ratio is not None:
            ratios.append(ratio)
        lines.append(
            f"| {c['partitions']} | {c['members']} | {c['lanes']} | {c['streams']} "
            f"| {c['messages_per_s']} | {'x' + str(ratio) if c['lanes'] != 1 else '-'} "
            f"| {c['p50_get_ack_ms']} | {c['calls_per_message']} "
            f"| {c['write_units_per_message']} | {c['inbox_read_units_per_message']} "
            f"| {c['members_receiving']} of {c['members']} "
            f"| {c['min_per_member']}-{c['max_per_member']} |"
        )
    return lines, ratios


def _verdict(value: float | None, goal: float) -> str:
    return "not measured" if value is None else "met" if value <= goal else "NOT met"


def _per(cases: list[dict[str, Any]], field: str, lanes: int) -> str:
    values = [c[field] for c in cases if c["lanes"] == lanes]
    return f"{min(values)}-{max(values)}" if values else "-"


def report(figures: dict[str, Any]) -> str:
    cases = figures["throughput"]
    lanes = max(c["lanes"] for c in cases)
    lines = [
        "## Shared groups",
        "",
        f"`python -m bench groups` ({figures.get('seconds', '?')} s). In-process emulator, "
        "which serializes every DynamoDB call: members add no parallel capacity, so msg/s does "
        "not scale with members here, and the figures are Shoal's work plus moto's (moto's "
        "response serialization makes a call's cost grow with the size of what it reads).",
        "",
        f"### Throughput through get (max 100) + ack, {lanes} lanes against 1",
        "",
        f"A backlog of {cases[0]['messages']} unkeyed messages (100 per source and router "
        "invocation) drained by one thread per member: get, ack what came, heartbeat every "
        f"{HEARTBEAT_S:g} s, an empty get waits as a long poll looks again (0.1 s, then 1.5 "
        "times longer, at most 1 s). The clock stands still (a call waiting behind the others' "
        "could otherwise outlast the lease timeout, which DynamoDB's latency never makes it), "
        "so no get writes a renewal (at most one UpdateItem per member every 2 s). "
        "Calls and units count get, ack and heartbeat of all members, idle ones too; write "
        "units from the items' sizes (1 KB units, a transaction's parts twice, an UpdateItem "
        "as 1); inbox read units are the messages' queries by DynamoDB's rule (4 KB units of "
        "the items read, strongly consistent), the lane's own messages and the ones it passes "
        "over.",
        "",
    ]
    table, ratios = _throughput_table(cases)
    lines += table
    lines += [
        "",
        f"With {lanes} lanes msg/s is x{min(ratios)} to x{max(ratios)} that of one lane here, "
        f"at {_per(cases, 'calls_per_message', lanes)} AWS calls, "
        f"{_per(cases, 'write_units_per_message', lanes)} write units and "
        f"{_per(cases, 'inbox_read_units_per_message', lanes)} inbox read units per message "
        f"(one lane: {_per(cases, 'calls_per_message', 1)}, "
        f"{_per(cases, 'write_units_per_message', 1)} and "
        f"{_per(cases, 'inbox_read_units_per_message', 1)}): each lane reads its source's "
        "items from its cursor (a get shares the reads of the lanes of one source it holds, "
        "other members read them again) and saves its progress on its own, and a get goes "
        "through the lanes it holds until it has its 100 messages, so the cost grows with "
        "the lanes a member holds and falls with the messages each lane has per get. What "
        "lanes buy is the spread: "
        "with one lane at most one member per partition receives, with "
        f"{lanes} up to {lanes} per partition. A group created without its own count gets "
        "ceil(8 / partitions) lanes (`SHOAL_GROUP_PARALLELISM`): the 8-lane rows of 1 "
        "partition are the default, those of 8 partitions what a subscribe asking "
        "`lanes: 8` costs (the default there is the 1-lane row).",
        "",
    ]
    work = figures.get("throughput_with_work") or []
    if work:
        table, ratios = _throughput_table(work)
        lines += [
            f"The same on 1 partition with {work[0]['work_ms_per_message']:g} ms of work per "
            f"message between get and ack (a sleep), {work[0]['messages']} messages:",
            "",
            *table,
            "",
            f"With work to do, {lanes} lanes give x{min(ratios)} to x{max(ratios)} the msg/s "
            "of one lane: the work of the members holding lanes overlaps.",
            "",
        ]
    rb = figures["rebalance"]
    rounds = rb["rounds"]
    goal = rb["lease_timeout_s"] + rb["heartbeat_s"]
    lines += [
        "### Rebalance",
        "",
        f"{rb['members']} members of a 1-partition group ({rb['lanes']} lanes, lease timeout "
        f"{rb['lease_timeout_s']:g} s), real clock, each polling every {rb['poll_s']:g} s "
        f"(get, ack) and heartbeating every {rb['heartbeat_s']:g} s while "
        f"{rb['trickle_per_s']} messages/s arrive; a fifth member joins (subscribe: the "
        "membership transaction, then the advance after it), then one member leaves "
        "gracefully (it stops polling, then unsubscribes), then one crashes (it stops calling "
        "with the messages of its last get unacked). Grants are timed when their transaction "
        f"committed; {len(rounds)} rounds, a new group each:",
        "",
        "| event | from | until | median s | max s | each round s |",
        "|---|---|---|---|---|---|",
    ]
    for name, event, start, until in REBALANCE_EVENTS:
        summary = rb["summary"][name]
        each = ", ".join("-" if r[name] is None else f"{r[name]:g}" for r in rounds)
        lines.append(
            f"| {event} | {start} | {until} | {summary['median']} | {summary['max']} | {each} |"
        )
    crash_max = rb["summary"]["crash_granted_s"]["max"]
    again_max = rb["summary"]["crash_redelivered_s"]["max"]
    lines += [
        "",
        f"Lanes held: the joiner's share {', '.join(str(r['join_share']) for r in rounds)}; "
        f"the leaver's {', '.join(str(r['leave_lanes']) for r in rounds)}; the crashed "
        f"member's {', '.join(str(r['crash_lanes']) for r in rounds)} with "
        f"{', '.join(str(r['crash_unacked']) for r in rounds)} unacked, its last renewal "
        f"{', '.join(str(r['crash_renewed_before_last_call_s']) for r in rounds)} s before "
        "its last call. A join's lane is granted by the subscribe's own advance when the lane "
        "it takes is idle, else by the call of its holder that empties it. Against the goal (lease "
        f"timeout + one heartbeat = {goal:g} s after the crashed member's last renewal), its lanes "
        f"moved at most {crash_max} s after ({_verdict(crash_max, goal)}) and its unacked messages "
        f"went out again at most {again_max} s after ({_verdict(again_max, goal)}): the get "
        "that hands them out again also reads the backlog its lanes gathered meanwhile (it "
        "took "
        f"{', '.join(str(r['crash_redelivering_get_s']) for r in rounds)} s here). Published "
        f"{', '.join(str(r['published']) for r in rounds)} messages, never delivered "
        f"{', '.join(str(r['never_delivered']) for r in rounds)}, delivered more than once "
        f"{', '.join(str(r['delivered_again']) for r in rounds)} (the crashed member's "
        "unacked).",
        "",
        "### Hand-off after a death, injected clock",
        "",
        "4 members, heartbeats every lease timeout / 3, one member dies holding unacked "
        "messages; rounds and seconds since its last renewal:",
        "",
        "| lease timeout s | heartbeat s | streams | streams it held | unacked "
        "| rounds to reassignment | s to reassignment | rounds to redelivery | s to redelivery |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in figures["reassignment"]:
        lines.append(
            f"| {r['lease_timeout_s']} | {r['heartbeat_interval_s']} | {r['streams']} "
            f"| {r['streams_held_by_dead_member']} | {r['unacked_at_death']} "
            f"| {r['rounds_to_reassignment']} | {r['seconds_to_reassignment']} "
            f"| {r['rounds_to_redelivery']} | {r['seconds_to_redelivery']} |"
        )
    lines += [
        "",
        "### Rebalance moves",
        "",
        "Streams changing holder when one member joins or leaves a settled group (the pure "
        "leader), against the least any balanced assignment needs:",
        "",
        "| streams | members | join moves | least | leave moves | least |",
        "|---|---|---|---|---|---|",
    ]
    for m in figures["moves"]:
        lines.append(
            f"| {m['streams']} | {m['members']} | {m['join_moves']} | {m['join_least']} "
            f"| {m['leave_moves'] if m['leave_moves'] is not None else '-'} "
            f"| {m['leave_least'] if m['leave_least'] is not None else '-'} |"
        )
    c = figures["conflicts"]
    lines += [
        "",
        "### Conflicts",
        "",
        f"{c['members']} members join one group at once ({c['join_s']} s: the membership "
        "update, then the advance after it), then each runs "
        f"{c['rounds']} rounds of heartbeat + get + ack over {c['streams']} streams "
        f"({c['sources']} sources x {c['lanes']} lanes; {c['work_s']} s, {c['acked']} acked); "
        "frozen clock. Conditional writes by operation (the leader's transitions are named "
        "by the call that ran them):",
        "",
        "| operation | conditional writes | lost a race | rate |",
        "|---|---|---|---|",
    ]
    for name, o in c["operations"].items():
        lines.append(f"| {name} | {o['writes']} | {o['conflicts']} | {o['conflict_rate']} |")
    transitions = {k: o for k, o in c["operations"].items() if k not in ("membership", "progress")}
    lost = sum(o["conflicts"] for o in transitions.values())
    tried = sum(o["writes"] for o in transitions.values())
    beats = c["operations"].get("heartbeat", {"writes": 0, "conflicts": 0})
    lines += [
        "",
        "A membership update adds or removes its own map entry and never conflicts with "
        "another's; transitions are read-modify-writes of the leader's version. Here "
        f"{lost} of {tried} leader transactions lost a race; heartbeats wrote "
        f"{beats['writes']} transitions and lost {beats['conflicts']} (before lanes, in the "
        "results file of 2026-11-24: 10 of 11 leader transactions of racing heartbeats lost, "
        "16 streams of one lane): a heartbeat or get now writes "
        "only a transition that concerns its member, while the advance after every join "
        "still tries the group's whole transition.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=2))
