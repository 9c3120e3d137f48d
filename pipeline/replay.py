"""Replay: archived messages, selected by topic filter and publish time, into one consumer again.

This is how a consumer seeks past the storage streams' retention. Two steps:

1. **select** (Spark, ``select``): the archive's messages, one per id, whose topic the filter
   matches (``shoal.topics.matches``) and whose publish time is in [since, until), each with a
   *replay id* (a digest of the replay's name and the original id) and a *replay position* that
   sorts in per-ordering-key publish order (composite topic, storage topic index, shard,
   sequence number, index in the record). The plan is sorted by that position.
2. **inject** (``inject``): the plan, streamed to the driver in order, into a target. Every id
   and position is deterministic, so running the same replay again writes the same items and
   the consumer gets nothing twice; a different ``--replay-id`` makes a new replay.

Targets (``--target KIND:NAME``): ``session:<client id>`` writes into the session's inbox (a
source of its own, read by get like any other; each message carries the session's subscription
that matches it, the one granting the highest QoS, or is left out when none does); ``plan:<dir>``
writes the plan as JSON lines (what an EMR job does: injecting needs the service's tables;
``--plan <file or s3://bucket/key>`` then injects such a plan without Spark, wherever the
service's tables are reachable: ``shoal pipeline replay --plan ... --target push:orders``);
``group:<share>/<filter>`` (or ``group:$share/<share>/<filter>``) writes into the shared
group's partition as a group stream of the replay's own (the leader learns of it as of a storage
shard's and hands it to one member; each message once to the group, in per-key order);
``push:<subscription>`` reserves them in the push subscription's retry queue through
``shoal.push.replay`` (the same service code locally and on EMR): each message the
subscription's filter matches is an RQ entry due now, reserved in its key's group state like a
redrive, so it goes out ahead of the key's newer messages and in plan order, with the original
message id (``Shoal-Message-Id``) for the endpoint to deduplicate by; the key's mark of the
replay (in the same conditional write) makes a second run, or a run after a crash, reserve
nothing twice.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from pipeline.columnar import read_messages
from pipeline.common import (
    Output,
    Progress,
    in_range,
    job_parser,
    matching_topics,
    parse_time,
    spark_session,
    unique_messages,
)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from shoal.core.clock import Clock
    from shoal.core.config import Config

#: messages handed to a target at once (one inbox write per session per batch)
BATCH = 200


class TargetUnavailable(RuntimeError):
    """The target kind exists in the design but not (yet) in the service."""


@dataclass(frozen=True)
class Selection:
    topic_filter: str
    since: int | None = None
    until: int | None = None


def replay_id_for(selection: Selection, target: str) -> str:
    """The default name of a replay: the same selection into the same target is the same
    replay (so running it twice is harmless)."""
    raw = json.dumps([selection.topic_filter, selection.since, selection.until, target])
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def replay_message_id(replay_id: str, message_id: str) -> str:
    """The id a replayed message carries (``select`` computes the same in Spark)."""
    return hashlib.sha256(f"{replay_id}#{message_id}".encode()).hexdigest()[:32]


def select(messages: DataFrame, selection: Selection, replay_id: str) -> DataFrame:
    """The replay plan: matching messages in replay-position order (pure; no I/O but a
    collect of the distinct topic names in the time range)."""
    from pyspark.sql import functions as F

    unique = in_range(unique_messages(messages), "published_at", selection.since, selection.until)
    topics = [r[0] for r in unique.select("topic").distinct().collect()]
    wanted = matching_topics(topics, selection.topic_filter)

    def digest(column: str, size: int) -> Any:
        return F.substring(F.sha2(F.coalesce(F.col(column), F.lit("")), 256), 1, size)

    digits = F.regexp_replace(F.coalesce("sequence_number", F.lit("0")), "^0+(?=.)", "")
    position = F.concat_ws(
        ".",
        digest("composite_topic", 8),
        F.lpad(F.coalesce("storage_topic", F.lit(0)).cast("string"), 4, "0"),
        digest("shard_id", 8),
        # a sequence number as a string that sorts as the number: its length, then its digits
        F.concat(F.lpad(F.length(digits).cast("string"), 3, "0"), digits),
        F.lpad(F.coalesce("position", F.lit(0)).cast("string"), 5, "0"),
    )
    replay_id_col = F.substring(
        F.sha2(F.concat(F.lit(f"{replay_id}#"), F.col("message_id")), 256), 1, 32
    )
    return (
        unique.where(F.col("topic").isin(wanted) if wanted else F.lit(False))
        .select(
            replay_id_col.alias("replay_message_id"),
            "message_id",
            "topic",
            "composite_topic",
            "ordering_key",
            "qos",
            "retain",
            "published_at",
            "properties",
            "payload",
            position.alias("replay_position"),
        )
        .orderBy("replay_position")
    )


@dataclass(frozen=True)
class ReplayMessage:
    replay_message_id: str
    message_id: str
    topic: str
    ordering_key: str
    qos: int
    published_at: int
    payload: bytes
    replay_position: str
    composite_topic: str = ""
    retain: bool = False
    properties: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> ReplayMessage:
        return cls(
            replay_message_id=str(row["replay_message_id"]),
            message_id=str(row["message_id"]),
            topic=str(row["topic"]),
            ordering_key=str(row["ordering_key"] or row["topic"]),
            qos=int(row["qos"] if row["qos"] is not None else 1),
            published_at=int(row["published_at"]),
            payload=base64.b64decode(row["payload"] or ""),
            replay_position=str(row["replay_position"]),
            composite_topic=str(row["composite_topic"] or ""),
            retain=bool(row["retain"]),
            properties=_properties(row["properties"]),
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "replay_message_id": self.replay_message_id,
            "message_id": self.message_id,
            "topic": self.topic,
            "composite_topic": self.composite_topic,
            "ordering_key": self.ordering_key,
            "qos": self.qos,
            "retain": self.retain,
            "published_at": self.published_at,
            "properties": dict(self.properties),
            "payload": base64.b64encode(self.payload).decode(),
            "replay_position": self.replay_position,
        }


def _properties(raw: Mapping[str, Any] | None) -> dict[str, Any]:
    # the archive reads properties as strings; numbers go back to numbers
    out: dict[str, Any] = {}
    for key, value in (raw or {}).items():
        out[key] = int(value) if isinstance(value, str) and value.isdigit() else value
    return out


class ReplayTarget(Protocol):
    """Where a replay goes. ``inject`` takes messages in replay-position order and answers how
    many it wrote; the same messages again must change nothing."""

    description: str

    def inject(self, messages: Sequence[ReplayMessage]) -> int: ...

    def close(self) -> None: ...


# -- targets ---------------------------------------------------------------------------------------


class PlanTarget:
    """The plan as JSON lines in a folder (or s3:// prefix): one file, rewritten whole."""

    def __init__(self, output: Output, name: str = "plan.jsonl") -> None:
        self.output = output
        self.name = name
        self.lines: list[bytes] = []
        self.description = f"plan {output.path(name)}"

    def inject(self, messages: Sequence[ReplayMessage]) -> int:
        self.lines += [json.dumps(m.as_json()).encode() + b"\n" for m in messages]
        return len(messages)

    def close(self) -> None:
        self.output.write(self.name, b"".join(self.lines))


class SessionInboxTarget:
    """A session's inbox: a source of the replay's own, positions from the replay plan.

    Get reads it like the router's sources, in position order; a message goes out with the
    session's subscription that matches its topic (the highest QoS one), because get hands out
    only deliveries whose subscription the session still holds.
    """

    def __init__(
        self,
        client_id: str,
        replay_id: str,
        *,
        sessions: Any,
        inbox: Any,
        payloads: Any,
        retention_s: int,
        clock: Clock,
    ) -> None:
        self.client_id = client_id
        self.replay_id = replay_id
        self.sessions = sessions
        self.inbox = inbox
        self.payloads = payloads
        self.retention_s = retention_s
        self.clock = clock
        self.description = f"session {client_id!r}"
        self.unmatched = 0
        self._session: tuple[str, dict[str, tuple[int, str]]] | None = None

    @classmethod
    def from_config(
        cls, config: Config, client_id: str, replay_id: str, clock: Clock | None = None
    ) -> SessionInboxTarget:
        from shoal.core.clock import SystemClock
        from shoal.delivery.inbox import InboxStore, PayloadStore
        from shoal.sessions.repository import SessionRepository

        return cls(
            client_id,
            replay_id,
            sessions=SessionRepository.from_config(config),
            inbox=InboxStore.from_config(config),
            payloads=PayloadStore.from_config(config),
            retention_s=config.delivery.retention_s,
            clock=clock or SystemClock(),
        )

    @property
    def source(self) -> str:
        # sorts after the router's sources (hex digests), so a session gets what the router
        # delivered first, then the replay
        return "r" + hashlib.blake2b(self.replay_id.encode(), digest_size=6).hexdigest()

    def _subscriptions(self) -> tuple[str, dict[str, tuple[int, str]]]:
        if self._session is None:
            head = self.sessions.head(self.client_id)
            if head is None or not head.session_alive(self.clock.now_ms()):
                raise TargetUnavailable(f"client {self.client_id!r} has no session to replay into")
            subscriptions = {
                topic_filter: (int(option.get("qos", 1)), str(option["sid"]))
                for topic_filter, option in head.subscriptions.items()
                if not topic_filter.startswith("$share/") and option and option.get("sid")
            }
            self._session = (str(head.session_id), subscriptions)
        return self._session

    def inject(self, messages: Sequence[ReplayMessage]) -> int:
        from shoal.delivery.inbox import InboxMessage, pack
        from shoal.delivery.model import MAX_INLINE_PAYLOAD
        from shoal.topics.filters import matches

        session_id, subscriptions = self._subscriptions()
        deliveries = []
        for m in messages:
            granted = [
                (min(qos, m.qos), topic_filter, sid)
                for topic_filter, (qos, sid) in subscriptions.items()
                if matches(topic_filter, m.topic)
            ]
            if not granted:
                self.unmatched += 1
                continue
            qos, topic_filter, sid = max(granted)
            payload, ref = m.payload, None
            if len(payload) > MAX_INLINE_PAYLOAD and self.payloads is not None:
                ref = self.payloads.put(m.replay_message_id, payload)
                payload = b""
            deliveries.append(
                InboxMessage(
                    position=m.replay_position,
                    message_id=m.replay_message_id,
                    topic=m.topic,
                    payload=payload,
                    qos=qos,
                    subscription=topic_filter,
                    sid=sid,
                    published_at_ms=m.published_at,
                    properties=dict(m.properties),
                    retain=False,
                    payload_ref=ref,
                )
            )
        if not deliveries:
            return 0
        expires = self.clock.now_ms() // 1000 + self.retention_s
        items = pack(session_id, self.source, deliveries, deliveries[-1].position, expires)
        self.inbox.put(items)
        return len(deliveries)

    def close(self) -> None:
        return None


class GroupStreamTarget:
    """A shared group: a stream of the replay's own in the group's partition.

    Written exactly as the router writes a storage shard's stream (items keyed by source and
    position, packed per batch) and made known to the group's leader, which hands it to one
    member like any other stream: the group gets each message once, in plan (per-key) order.
    The ids and positions are the plan's, so running the replay again rewrites the same items.
    """

    def __init__(
        self,
        text: str,
        replay_id: str,
        *,
        groups: Any,
        inbox: Any,
        payloads: Any,
        retention_s: int,
        clock: Clock,
    ) -> None:
        from shoal.topics.filters import parse_shared

        shared = parse_shared(text if text.startswith("$share/") else f"$share/{text}")
        if shared is None:
            raise ValueError(f"a group target is group:<share name>/<filter>, got {text!r}")
        self.share, self.topic_filter = shared
        self.text = f"$share/{self.share}/{self.topic_filter}"
        self.replay_id = replay_id
        self.groups = groups
        self.inbox = inbox
        self.payloads = payloads
        self.retention_s = retention_s
        self.clock = clock
        self.description = f"shared group {self.text!r}"
        self.unmatched = 0
        self._incarnation: str | None = None

    @classmethod
    def from_config(
        cls, config: Config, text: str, replay_id: str, clock: Clock | None = None
    ) -> GroupStreamTarget:
        from shoal.core.clock import SystemClock
        from shoal.delivery.inbox import InboxStore, PayloadStore
        from shoal.groups.store import GroupStore

        return cls(
            text,
            replay_id,
            groups=GroupStore.from_config(config, clock),
            inbox=InboxStore.from_config(config),
            payloads=PayloadStore.from_config(config),
            retention_s=config.delivery.retention_s,
            clock=clock or SystemClock(),
        )

    @property
    def key(self) -> str:
        from shoal.groups.records import group_key

        return group_key(self.share, self.topic_filter)

    @property
    def source(self) -> str:
        # the same rule as a session's replay source: after the router's sources
        return "r" + hashlib.blake2b(self.replay_id.encode(), digest_size=6).hexdigest()

    def _group(self) -> str:
        """The group's incarnation, its replay stream made known to the leader (once)."""
        if self._incarnation is None:
            loaded = self.groups.load(self.key)
            if loaded is None:
                raise TargetUnavailable(f"no shared group {self.text!r} to replay into")
            incarnation = str(loaded.state.incarnation)
            # before the first write, as the router does: a leader never misses a stream
            self.groups.ensure_stream(self.key, incarnation, self.source)
            self._incarnation = incarnation
        return self._incarnation

    def inject(self, messages: Sequence[ReplayMessage]) -> int:
        from shoal.delivery.inbox import InboxMessage, pack
        from shoal.delivery.model import MAX_INLINE_PAYLOAD
        from shoal.groups.streams import group_partition
        from shoal.topics.filters import matches

        incarnation = self._group()
        deliveries = []
        for m in messages:
            if not matches(self.topic_filter, m.topic):
                self.unmatched += 1
                continue
            payload, ref = m.payload, None
            if len(payload) > MAX_INLINE_PAYLOAD and self.payloads is not None:
                ref = self.payloads.put(m.replay_message_id, payload)
                payload = b""
            deliveries.append(
                InboxMessage(
                    position=m.replay_position,
                    message_id=m.replay_message_id,
                    topic=m.topic,
                    payload=payload,
                    # the member's subscription caps it when it goes out
                    qos=m.qos,
                    subscription=self.text,
                    sid=incarnation,
                    published_at_ms=m.published_at,
                    properties=dict(m.properties),
                    retain=False,
                    payload_ref=ref,
                )
            )
        if not deliveries:
            return 0
        expires = self.clock.now_ms() // 1000 + self.retention_s
        partition = group_partition(incarnation)
        self.inbox.put(pack(partition, self.source, deliveries, deliveries[-1].position, expires))
        return len(deliveries)

    def close(self) -> None:
        return None


class PushSubscriptionTarget:
    """A push subscription: its retry queue, through ``shoal.push.replay`` (the same service
    code locally and on EMR; see its docstring for reservation, order and idempotence).

    The endpoint gets the original message (``Shoal-Message-Id`` is the original id). A key
    with too many replayed entries not yet delivered has the rest of its messages handed back;
    they are passed again, first and in order, after a pause, until taken or ``patience_s``
    passes without progress (the subscription is not delivering: the replay stops, and running
    it again resumes it).
    """

    def __init__(
        self, name: str, replay_id: str, *, service: Any, clock: Clock, patience_s: float = 600.0
    ) -> None:
        self.name = name
        self.replay_id = replay_id
        self.service = service
        self.clock = clock
        self.patience_s = patience_s
        self.description = f"push subscription {name!r}"
        self.unmatched = 0
        self.already = 0

    @classmethod
    def from_config(
        cls, config: Config, name: str, replay_id: str, clock: Clock | None = None
    ) -> PushSubscriptionTarget:
        from shoal.core.clock import SystemClock
        from shoal.push.replay import PushReplay

        clock = clock or SystemClock()
        return cls(name, replay_id, service=PushReplay.from_config(config, clock), clock=clock)

    def inject(self, messages: Sequence[ReplayMessage]) -> int:
        from shoal.core.errors import SubscriptionNotFound

        todo = [archived(m) for m in messages]
        written = 0
        waited = 0.0
        while todo:
            try:
                report = self.service.replay(self.name, self.replay_id, todo)
            except SubscriptionNotFound as exc:
                raise TargetUnavailable(str(exc)) from None
            written += report.injected
            self.unmatched += report.unmatched
            self.already += report.already
            todo = list(report.deferred)
            if report.injected:
                waited = 0.0  # the subscription delivers: patience counts from here
            if todo:
                if waited >= self.patience_s:
                    raise TargetUnavailable(
                        f"push subscription {self.name!r} is not delivering the replay; "
                        "run it again later (it resumes)"
                    )
                self.clock.sleep(1.0)
                waited += 1.0
        return written

    def close(self) -> None:
        return None


def archived(m: ReplayMessage) -> Any:
    """A plan's message as ``shoal.push.replay`` takes it: the original message, its replay
    position and, when the position names it, its main position."""
    from shoal.push.replay import Archived
    from shoal.records import Message

    message = Message(
        message_id=m.message_id,
        topic=m.topic,
        payload=m.payload,
        qos=m.qos,
        retain=m.retain,
        ordering_key=m.ordering_key,
        published_at_ms=m.published_at,
        sub="",
        properties=dict(m.properties),
    )
    return Archived(message, m.replay_position, main_of(m.replay_position))


def main_of(replay_position: str) -> str:
    """The main position (``shoal.push.entries.main_position``) a plan's replay position names,
    or "" (composite digest . storage topic . shard digest . digit count + sequence . index)."""
    from shoal.push.entries import main_position

    parts = replay_position.split(".")
    if len(parts) != 5 or not all(p.isdigit() for p in (parts[1], parts[3], parts[4])):
        return ""
    digits = parts[3][3:]
    if not digits:
        return ""
    return main_position(int(parts[1]), digits, int(parts[4]))


#: target kind -> factory(name, replay_id, spark) for kinds the design has and the service not
UNAVAILABLE: dict[str, Callable[..., ReplayTarget]] = {}


def make_target(
    spec: str, replay_id: str, spark: SparkSession | None = None, config: Config | None = None
) -> ReplayTarget:
    """``session:<client id>``, ``plan:<folder or s3:// prefix>``, ``group:...``, ``push:...``."""
    kind, sep, name = spec.partition(":")
    if not sep or not name:
        raise ValueError(f"a target is KIND:NAME, e.g. session:client-1 or plan:out/, got {spec!r}")
    if kind == "plan":
        return PlanTarget(Output(name, spark))
    if kind == "session":
        from shoal.core.config import get_config

        return SessionInboxTarget.from_config(config or get_config(), name, replay_id)
    if kind == "group":
        from shoal.core.config import get_config

        return GroupStreamTarget.from_config(config or get_config(), name, replay_id)
    if kind == "push":
        from shoal.core.config import get_config

        return PushSubscriptionTarget.from_config(config or get_config(), name, replay_id)
    if kind in UNAVAILABLE:
        return UNAVAILABLE[kind](name, replay_id)
    raise ValueError(f"unknown target kind {kind!r}: session, group, push or plan")


def batches(rows: Iterable[Any], size: int = BATCH) -> Iterator[list[ReplayMessage]]:
    batch: list[ReplayMessage] = []
    for row in rows:
        batch.append(ReplayMessage.from_row(row.asDict() if hasattr(row, "asDict") else row))
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def inject(plan: DataFrame, target: ReplayTarget, progress: Progress | None = None) -> int:
    """Stream the plan to the target in order (partition by partition: the driver holds one
    batch at a time). Returns how many messages the target took."""
    written = 0
    for batch in batches(plan.toLocalIterator()):
        written += target.inject(batch)
        if progress is not None:
            progress(f"{written} messages into {target.description}")
    target.close()
    return written


# -- the job ---------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", help="archive root: a folder or s3://bucket")
    parser.add_argument(
        "--plan",
        help="instead of --input/--filter: inject a plan a plan: target wrote (file or s3://)",
    )
    parser.add_argument("--filter", help="MQTT topic filter of what to replay (with --input)")
    parser.add_argument("--since", help="publish time from (ISO 8601 or epoch ms), inclusive")
    parser.add_argument("--until", help="publish time until (ISO 8601 or epoch ms), exclusive")
    parser.add_argument(
        "--target",
        required=True,
        help="session:<client id> | plan:<folder> | group:<share>/<filter> | push:<id>",
    )
    parser.add_argument(
        "--replay-id", help="names the replay (default: from filter, time range and target)"
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        help="inject into the shoal dev running on this state folder (its runtime.json)",
    )
    parser.add_argument("--dry-run", action="store_true", help="select and count, inject nothing")
    parser.add_argument("--quiet", action="store_true")


def use_local_runtime(state_dir: Path) -> None:
    """Point this process at the emulated account of the shoal dev on ``state_dir``."""
    from shoal.core.config import get_config
    from shoal.local.provision import LocalNames
    from shoal.local.runtime import BASE_ENVIRONMENT, RUNTIME_FILE

    info = json.loads((state_dir / RUNTIME_FILE).read_text())
    os.environ.update(BASE_ENVIRONMENT)
    os.environ["AWS_ENDPOINT_URL"] = info["aws_url"]
    os.environ.update(LocalNames.for_deployment().environment())
    get_config.cache_clear()


def read_plan(location: str) -> Iterator[dict[str, Any]]:
    """The rows of a plan file (``plan.jsonl``, local or ``s3://bucket/key``), in order."""
    if location.startswith("s3://"):
        import boto3

        bucket, _, key = location[len("s3://") :].partition("/")
        body = boto3.client("s3").get_object(Bucket=bucket, Key=key)["Body"]
        lines: Iterable[bytes] = body.iter_lines()
    else:
        path = Path(location)
        lines = (path / "plan.jsonl" if path.is_dir() else path).read_bytes().splitlines()
    for line in lines:
        if line.strip():
            yield json.loads(line)


def run_plan(args: argparse.Namespace, progress: Progress) -> dict[str, Any]:
    """Inject a written plan: no Spark, the plan's ids and positions as they are."""
    if args.target.startswith("plan:"):
        raise ValueError("--plan injects into a session, group or push target, not another plan")
    replay_id = args.replay_id or replay_id_for(Selection(args.plan), args.target)
    if args.state_dir is not None:
        use_local_runtime(args.state_dir)
    messages = list(read_plan(args.plan))
    progress(f"{len(messages)} messages in the plan {args.plan} (replay id {replay_id})")
    written = 0
    if not args.dry_run:
        target = make_target(args.target, replay_id)
        for batch in batches(messages):
            written += target.inject(batch)
            progress(f"{written} messages into {target.description}")
        target.close()
    return {"replay_id": replay_id, "selected": len(messages), "written": written}


def run(args: argparse.Namespace, spark: SparkSession | None = None) -> dict[str, Any]:
    progress = Progress("replay", quiet=args.quiet)
    if args.plan is not None:
        if args.input is not None or args.filter is not None:
            raise ValueError("--plan replaces --input and --filter")
        return run_plan(args, progress)
    if args.input is None or args.filter is None:
        raise ValueError("--input and --filter are required (or --plan)")
    selection = Selection(args.filter, parse_time(args.since), parse_time(args.until))
    replay_id = args.replay_id or replay_id_for(selection, args.target)
    if args.state_dir is not None:
        use_local_runtime(args.state_dir)
    progress("starting Spark")
    spark = spark or spark_session("shoal-replay")
    target = None if args.dry_run else make_target(args.target, replay_id, spark)
    progress(f"selecting {selection.topic_filter!r} from {args.input}")
    plan = select(
        read_messages(spark, args.input, selection.since, selection.until), selection, replay_id
    ).cache()
    selected = plan.count()
    progress(f"{selected} messages selected (replay id {replay_id})")
    written = 0 if target is None else inject(plan, target, progress)
    already = getattr(target, "already", 0)
    if already:
        progress(f"{already} messages were replayed into the target before: left out")
    unmatched = getattr(target, "unmatched", 0)
    if unmatched:
        progress(f"{unmatched} messages matched none of the target's subscriptions: left out")
    return {"replay_id": replay_id, "selected": selected, "written": written}


def main(argv: Sequence[str] | None = None) -> int:
    parser = job_parser("replay")
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.plan is not None and (args.input is not None or args.filter is not None):
        parser.error("--plan replaces --input and --filter")
    if args.plan is None and (args.input is None or args.filter is None):
        parser.error("--input and --filter are required (or --plan)")
    if args.plan is not None and args.target.startswith("plan:"):
        parser.error("--plan injects into a session, group or push target, not another plan")
    try:
        result = run(args)
    except TargetUnavailable as exc:
        print(f"shoal pipeline replay: {exc}")
        return 2
    print(json.dumps(result))
    return 0
