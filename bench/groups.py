"""Shared groups: hand-off after a member's death, rebalance moves, conflicts, throughput.

- **Reassignment**: members heartbeat every ``lease timeout / 3`` of an injected clock
  (``GroupService.heartbeat`` over the emulator); one member dies holding unacked messages.
  Measured: heartbeat rounds and clock seconds from its last renewal until every stream it held
  is granted to a live member, and until its unacked messages were handed out again.
- **Moves**: streams that change holder when one member joins or leaves a settled group, for
  1..50 members over 16 and 64 streams (the pure leader), against the least possible.
- **Conflicts**: 50 members join one group at once (one thread each, through the subscribe-side
  membership transaction), then heartbeat, get and ack for a few rounds; conditional writes per
  operation and how many lost a race (re-read and retried).
- **Throughput**: messages/s through get+ack (batches of 100) of 1, 4 and 16 members draining
  2,000 messages over 16 group streams, one thread per member.

The emulator serializes DynamoDB calls (``shoal.local.serialize``), so concurrency shows up as
conflicts, not as speed-up; throughput is Shoal's work plus moto's, not DynamoDB's.
"""

from __future__ import annotations

import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from shoal.core.retry import backoff_s

from bench.account import emulated_account

LEASE_TIMEOUTS_S = (5.0, 15.0)
MOVE_MEMBERS = (1, 2, 3, 4, 8, 16, 32, 50)
MOVE_STREAMS = (16, 64)


class _FrozenClock:
    """Time stands still (no lease expires while the emulator is slow), but sleeps sleep."""

    def __init__(self) -> None:
        self._now = time.time_ns() // 1_000_000

    def now_ms(self) -> int:
        return self._now

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


def _world(session: Any, share: str, lease_s: float, clock: Any) -> Any:
    from shoal.aws.dynamo import Dynamo
    from shoal.core.config import DeliverySettings, GroupSettings, get_config
    from shoal.delivery.inbox import InboxStore
    from shoal.groups.service import GroupService
    from shoal.groups.store import GroupStore
    from shoal.groups.streams import StreamReader

    config = get_config()
    dynamo = Dynamo(session.client("dynamodb"))
    store = GroupStore(
        dynamo,
        config.table("groups"),
        config.table("inboxes"),
        settings=GroupSettings(lease_timeout_s=lease_s),
        clock=clock,
    )
    service = GroupService(
        store,
        StreamReader(dynamo, config.table("inboxes")),
        DeliverySettings(ack_timeout_s=30, window=100),
        clock=clock,
    )
    return _Group(share, service, InboxStore(dynamo, config.table("inboxes")), clock)


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
        self._lock = threading.Lock()

    @property
    def key(self) -> str:
        from shoal.groups.store import group_key

        return group_key(self.share, "orders/#")

    def subs(self) -> dict[str, Any]:
        return {self.text: {"qos": 1, "share": self.share, "group": self.incarnation}}

    def join(self, member: str) -> None:
        for attempt in range(64):
            plan = self.service.membership(f"c-{member}", member, joins=[self.text])
            reasons = self.store.dynamo.transact(plan.parts)
            with self._lock:
                self.join_attempts += 1
                self.join_conflicts += reasons is not None
            if reasons is None:
                self.incarnation = plan.incarnations[self.text]
                return
            time.sleep(backoff_s(attempt, 0.005, 0.2))
        raise RuntimeError("join did not land")

    def publish(self, sources: int, per_source: int) -> int:
        """Write messages into the group's streams as the router does."""
        from shoal.delivery.inbox import InboxMessage, pack
        from shoal.delivery.model import position, record_end
        from shoal.groups.streams import group_partition

        total = 0
        for s in range(sources):
            self.seq += 1
            source = f"src{s:03d}"
            messages = [
                InboxMessage(
                    position=position(self.seq, n),
                    message_id=f"{source}-{self.seq}-{n}",
                    topic=f"orders/{s}",
                    payload=b"x" * 64,
                    qos=1,
                    subscription=self.text,
                    sid=self.incarnation,
                    published_at_ms=self.clock.now_ms(),
                )
                for n in range(per_source)
            ]
            self.inbox.put(
                pack(
                    group_partition(self.incarnation),
                    source,
                    messages,
                    record_end(self.seq),
                    2_000_000_000,
                )
            )
            self.store.ensure_stream(self.key, self.incarnation, source)
            total += per_source
        return total


# --- reassignment after a death ------------------------------------------------------------------


def _reassignment(session: Any, lease_s: float) -> dict[str, Any]:
    from shoal.core.clock import ManualClock

    clock = ManualClock()
    group = _world(session, f"dead{int(lease_s)}", lease_s, clock)
    members = [f"m{n}" for n in range(4)]
    for member in members:
        group.join(member)
    group.publish(sources=8, per_source=5)
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
    session: Any, members: int = 50, streams: int = 16, rounds: int = 3
) -> dict[str, Any]:
    # a frozen clock: conflicts come from concurrency alone, not from leases that the
    # emulator's slowness lets expire
    clock = _FrozenClock()
    group = _world(session, "crowd", 15.0, clock)
    names = [f"m{n:02d}" for n in range(members)]
    group.join(names[0])
    group.publish(sources=streams, per_source=10)
    group.join_attempts = group.join_conflicts = 0
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
        "join": {"writes": group.join_attempts, "conflicts": group.join_conflicts}
    }
    for name, writes in sorted(stats["writes"].items()):
        operations[name] = {"writes": writes, "conflicts": stats["conflicts"].get(name, 0)}
    for figures in operations.values():
        figures["conflict_rate"] = round(figures["conflicts"] / max(1, figures["writes"]), 3)
    return {
        "members": members,
        "streams": streams,
        "rounds": rounds,
        "join_s": round(join_s, 2),
        "work_s": round(work_s, 2),
        "acked": acks,
        "operations": operations,
    }


# --- throughput --------------------------------------------------------------------------------


def _throughput(session: Any, members: int, messages_per_source: int = 125) -> dict[str, Any]:
    clock = _FrozenClock()
    group = _world(session, f"tp{members}", 30.0, clock)
    names = [f"m{n:02d}" for n in range(members)]
    for name in names:
        group.join(name)
    total = group.publish(sources=16, per_source=messages_per_source)
    for name in names:
        group.service.heartbeat(name, group.subs())
    acked = 0
    lock = threading.Lock()
    latencies: list[float] = []

    def drain(member: str) -> None:
        nonlocal acked
        idle = 0
        last_beat = time.monotonic()
        while idle < 3:
            if time.monotonic() - last_beat > 2:
                group.service.heartbeat(member, group.subs())
                last_beat = time.monotonic()
            t0 = time.perf_counter()
            got = group.service.get(member, group.subs(), 100)
            if not got:
                with lock:
                    if acked >= total:
                        return
                idle += 1
                group.service.heartbeat(member, group.subs())
                continue
            idle = 0
            n = group.service.ack(member, group.subs(), [m["id"] for m in got])
            with lock:
                acked += n
                latencies.append(time.perf_counter() - t0)

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=members) as pool:
        list(pool.map(drain, names))
    elapsed = time.perf_counter() - started
    return {
        "members": members,
        "messages": total,
        "acked": acked,
        "seconds": round(elapsed, 2),
        "messages_per_s": round(acked / elapsed, 1),
        "p50_get_ack_ms": round(statistics.median(latencies) * 1000, 1) if latencies else None,
    }


def run() -> dict[str, Any]:
    figures: dict[str, Any] = {"moves": _moves()}
    with emulated_account() as session:
        figures["reassignment"] = [_reassignment(session, s) for s in LEASE_TIMEOUTS_S]
        figures["conflicts"] = _conflicts(session)
        figures["throughput"] = [_throughput(session, m) for m in (1, 4, 16)]
    return figures


def report(figures: dict[str, Any]) -> str:
    lines = [
        "## Shared groups",
        "",
        "Hand-off after a member dies (4 members, 8 streams, heartbeats every lease timeout / 3,",
        "injected clock; rounds and seconds since the dead member's last renewal):",
        "",
        "| lease timeout s | heartbeat s | streams it held | unacked | rounds to reassignment "
        "| s to reassignment | rounds to redelivery | s to redelivery |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in figures["reassignment"]:
        lines.append(
            f"| {r['lease_timeout_s']} | {r['heartbeat_interval_s']} "
            f"| {r['streams_held_by_dead_member']} | {r['unacked_at_death']} "
            f"| {r['rounds_to_reassignment']} | {r['seconds_to_reassignment']} "
            f"| {r['rounds_to_redelivery']} | {r['seconds_to_redelivery']} |"
        )
    lines += [
        "",
        "Rebalance moves (streams changing holder) when one member joins or leaves a settled",
        "group, against the least any balanced assignment needs:",
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
        f"Conditional-write conflicts, {c['members']} members joining at once ({c['join_s']} s), "
        f"then {c['rounds']} rounds of heartbeat + get + ack each over {c['streams']} streams "
        f"({c['work_s']} s, {c['acked']} acked):",
        "",
        "| operation | conditional writes | lost a race | rate |",
        "|---|---|---|---|",
    ]
    for name, o in c["operations"].items():
        lines.append(f"| {name} | {o['writes']} | {o['conflicts']} | {o['conflict_rate']} |")
    lines += [
        "",
        "Throughput through get (max 100) + ack, one thread per member, 16 streams:",
        "",
        "| members | messages | s | msg/s | p50 get+ack ms |",
        "|---|---|---|---|---|",
    ]
    for t in figures["throughput"]:
        lines.append(
            f"| {t['members']} | {t['messages']} | {t['seconds']} | {t['messages_per_s']} "
            f"| {t['p50_get_ack_ms']} |"
        )
    lines += [
        "",
        "A join is one update of the leader that never conflicts with other joins (it adds its",
        "own map entry), so racing joins lose only to transitions; transitions (``advance``,",
        "``heartbeat``) are read-modify-writes on the leader's version and lose while the group",
        "is changing; progress writes conflict only between one member's own racing calls.",
        "The emulator serializes calls, so more members add conflicts rather than speed.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=2))
