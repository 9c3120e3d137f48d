"""The WebSocket pushes' carrier: push work handed to an SQS FIFO queue, posted by the pusher.

Whoever has deliveries for sessions that may be connected over the WebSocket API hands their
push to the *push queue* and goes on: the router after a batch's inbox writes, a connect or a
renewal after its answer, a subscribe after its SUBACK (retained messages), an ack that
opened the window, the reaper's sweep (ack timeouts), a group's hand-over of lanes. The
pusher function (``shoal.edge.push.PushWorker``) takes the queue's messages, a batch at a
time, and posts each session's deliveries to its connection. So one message to many connected
clients is posted by as many workers as Lambda runs side by side (up to the mapping's maximum
concurrency), not by the router invocation that routed it, and a shard never waits on posts.

Why a FIFO queue. A session's pushes must post its frames in the order their deliveries were
handed out: two pushers each handing out and posting could interleave their frames. A FIFO
queue's *message groups* give that order without any lock: every push of a session goes to
its *lane* (a message group chosen by a stable hash of the session id, ``lane_of``), and
Lambda's mapping never runs two batches of one group at once, nor a later message of a group
before an earlier one is done (a failed one holds its group until it succeeds or goes to the
dead-letter queue). The lanes run side by side: a hand-off to 1,000 sessions is at most
``PushSettings.lanes`` messages (one per lane, a chunk of sessions each), so it spreads over
that many workers at most. The queue's deduplication keeps one copy of a hand-off sent twice
within 5 minutes (a retried router batch, deterministic ids).

What travels: the sessions (and their client ids where the sender knows them, which saves the
worker a read), the source the deliveries were written to (the router's shard: the worker's
get looks there only), and the archive lines the deliveries name, when they are few (the
worker then reads nothing back from S3). Never the deliveries' state: the inbox stays the one
source of truth, and a push that never happens loses nothing (the session's next trigger, a
reconnect, or the ack timeout's sweep serves what waits). The one exception is QoS 0 for a
session the router found connected: its deliveries are not written at all but travel here
whole (``PushWork.direct``), posted and forgotten (MQTT 5 §4.3.1, at most once). Each frame
carries its message's position in the source, so the worker posts it in order among what its
get hands out from the inbox, and drops it when a later delivery of that source went out
before it (the order per ordering key holds across QoS levels; the frame is at most once).
"""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
import threading
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from shoal.aws import clients
from shoal.core.clock import Clock, SystemClock
from shoal.core.config import Config
from shoal.core.errors import ServerBusy
from shoal.core.observability import logger
from shoal.core.retry import backoff_s
from shoal.delivery.inbox import Given, InboxMessage, LineCache
from shoal.delivery.model import ArchiveLine
from shoal.edge.connections import Connection

#: the push queue's logical name (``shoal.declarations``)
PUSH_QUEUE = "push"
#: a message's body at most (SQS allows 256 KB a message and a batch call): room for the
#: envelope of a SendMessageBatch entry
MAX_BODY_BYTES = 200 * 1024
#: SQS takes ten messages a SendMessageBatch, 256 KB in all
MAX_BATCH_ENTRIES = 10
MAX_BATCH_BYTES = 250 * 1024
#: archive lines travel with the work while they take at most this much of a body; beyond, the
#: worker reads the lines it needs back (one ranged GET per archive object)
MAX_LINES_BYTES = 64 * 1024
#: SendMessageBatch calls of one hand-off in flight at once
SEND_CONCURRENCY = 4
SEND_ATTEMPTS = 4
VERSION = 1


@dataclass(frozen=True)
class PushWork:
    """One queue message: sessions whose deliveries to push, one lane's."""

    #: session id -> its client id (None: the worker reads it with the session's connection)
    sessions: Mapping[str, str | None]
    #: the source the sender wrote the deliveries to (None: look in every source)
    source: str | None = None
    #: archive lines the deliveries name, as the sender holds them
    lines: LineCache = field(default_factory=dict)
    #: QoS 0 deliveries not written anywhere, by session: their ``message`` frames as they
    #: are posted (``qos0_frames``)
    direct: Mapping[str, list[dict[str, Any]]] = field(default_factory=dict)
    #: items of ``source`` the sender wrote for (some of) the sessions, handed out without a
    #: read when the session's cursor stands where they follow (``shoal.delivery.Given``)
    given: Mapping[str, Given] = field(default_factory=dict)
    #: the connections of (some of) the sessions as the sender read them, strongly consistent
    #: after its writes: the worker posts to them without reading them again
    connections: Mapping[str, Connection] = field(default_factory=dict)
    #: the stream of ``source`` when it is a storage topic (``shoal.drain``): the worker posts
    #: ``direct`` frames only once the drain's gate is open for the session (else they would
    #: pass the earlier storage topics' messages) and not once the session has passed it
    #: (else they would come after the later ones'). Written only with ``direct`` frames
    stream: str | None = None

    def body(self) -> str:
        data: dict[str, Any] = {"v": VERSION, "s": [[s, c] for s, c in self.sessions.items()]}
        if self.source is not None:
            data["src"] = self.source
        if self.stream is not None and self.direct:
            data["st"] = self.stream
        if self.lines:
            data["l"] = [[k.key, k.offset, k.length, v] for k, v in self.lines.items()]
        if self.direct:
            # a message's frame once, however many of the chunk's sessions get it
            shared: dict[str, int] = {}
            frames: list[dict[str, Any]] = []
            to: dict[str, list[list[Any]]] = {}
            for session_id, posts in self.direct.items():
                for frame in posts:
                    common = {k: v for k, v in frame.items() if k not in ("id", "subscription")}
                    mark = json.dumps(common, sort_keys=True)
                    if mark not in shared:
                        shared[mark] = len(frames)
                        frames.append(common)
                    to.setdefault(session_id, []).append([shared[mark], frame["subscription"]])
            data["q"] = {"m": frames, "to": to}
        if self.given:
            data["g"] = {session_id: g.data() for session_id, g in self.given.items()}
        if self.connections:
            data["c"] = {session_id: c.carried() for session_id, c in self.connections.items()}
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def parse(cls, body: str) -> PushWork:
        """``ValueError`` for a body this version cannot read."""
        data = json.loads(body)
        if not isinstance(data, dict) or data.get("v") != VERSION:
            raise ValueError("not a push work message of this version")
        direct: dict[str, list[dict[str, Any]]] = {}
        if data.get("q"):
            frames = data["q"]["m"]
            for session_id, posts in data["q"]["to"].items():
                direct[str(session_id)] = [
                    {
                        **frames[n],
                        "id": qos0_id(str(session_id), frames[n]["message_id"]),
                        "subscription": str(subscription),
                    }
                    for n, subscription in posts
                ]
        source = str(data["src"]) if data.get("src") else None
        return cls(
            sessions={str(s): (str(c) if c else None) for s, c in data["s"]},
            source=source,
            lines={ArchiveLine(str(k), int(o), int(n)): v for k, o, n, v in data.get("l") or []},
            direct=direct,
            given={
                str(s): Given.from_data(str(s), source, g)
                for s, g in (data.get("g") or {}).items()
                if source is not None
            },
            connections={
                str(s): Connection.from_carried(str(s), fields)
                for s, fields in (data.get("c") or {}).items()
            },
            stream=str(data["st"]) if data.get("st") else None,
        )


def qos0_id(session_id: str, message_id: str) -> str:
    """A QoS 0 push's delivery id: the session's and the message's, never an ordinal (a QoS 0
    push writes no state, and is never acked: an ack of it acks nothing)."""
    return f"{session_id}.q-{message_id}"


def qos0_frames(
    session_id: str, messages: Sequence[InboxMessage], now_ms: int
) -> list[dict[str, Any]]:
    """The ``message`` frames of QoS 0 deliveries posted without state (a get's answers'
    fields: ``shoal.delivery.service``, and the message's ``position`` in its source, which
    the worker takes off before posting), expired ones left out."""
    frames = []
    for m in messages:
        if m.expires_at_ms is not None and m.expires_at_ms <= now_ms:
            continue
        properties = dict(m.properties)
        if m.expires_at_ms is not None:
            properties["message_expiry_s"] = max(0, (m.expires_at_ms - now_ms) // 1000)
        frames.append(
            {
                "id": qos0_id(session_id, m.message_id),
                "message_id": m.message_id,
                "topic": m.topic,
                "payload": base64.b64encode(m.payload).decode("ascii"),
                "qos": 0,
                "retain": False,
                "dup": False,
                "subscription": m.subscription,
                "properties": properties,
                "published_at": m.published_at_ms,
                "position": m.position,
            }
        )
    return frames


def lane_of(session_id: str, lanes: int) -> int:
    """A session's lane: stable across processes and releases (crc32, not ``hash``)."""
    return zlib.crc32(session_id.encode("utf-8", "surrogatepass")) % lanes


def group_id(lane: int) -> str:
    return f"lane-{lane}"


@dataclass(frozen=True)
class _Entry:
    lane: int
    body: str
    dedupe: str


class PushQueue:
    """Hands push work to the push queue (``SendMessageBatch``), a message per lane."""

    def __init__(self, sqs: Any, url: str, lanes: int, clock: Clock | None = None) -> None:
        self.sqs = sqs
        self.url = url
        self.lanes = lanes
        self.clock = clock or SystemClock()
        #: messages sent so far by this process (tests and the benchmarks count them)
        self.sent = 0

    @classmethod
    def from_config(cls, config: Config, clock: Clock | None = None) -> PushQueue | None:
        """None without a WebSocket API or a push queue: nothing is pushed."""
        url = config.queues.get(PUSH_QUEUE)
        if not url or not config.connections_endpoint:
            return None
        return cls(clients.client("sqs", config.region), url, config.push.lanes, clock)

    def hand_off(
        self,
        sessions: Mapping[str, str | None] | Iterable[str],
        *,
        source: str | None = None,
        lines: LineCache | None = None,
        key: str | None = None,
        direct: Mapping[str, Sequence[InboxMessage]] | None = None,
        now_ms: int = 0,
        named: Mapping[str, set[ArchiveLine]] | None = None,
        given: Mapping[str, Given] | None = None,
        connections: Mapping[str, Connection] | None = None,
        stream: str | None = None,
    ) -> int:
        """Hands the push of ``sessions`` (ids, or ids with their client ids) to the queue;
        the messages sent. ``key``: what makes the hand-off the same when it is sent again (a
        router batch's source and range): its messages then carry the same deduplication ids,
        and the queue keeps one of each. ``direct``: QoS 0 deliveries of (some of) the
        sessions, written nowhere, to be posted and forgotten (as of ``now_ms``). Raises when
        the queue refused a message past ``SEND_ATTEMPTS`` (the caller's retry sends it
        again). ``named``: the lines of ``lines`` each session's deliveries name: a message
        carries those of its own sessions only (all of ``lines`` without it). ``given``: the
        items just written for some of the sessions, carried to their pushes (``Given``).
        ``connections``: the sessions' connections the caller read after its writes, carried
        so that the worker does not read them again. ``stream``: ``source``'s stream, when the
        drain gates it (``PushWork.stream``)."""
        pairs = dict(sessions) if isinstance(sessions, Mapping) else dict.fromkeys(sessions)
        if not pairs:
            return 0
        frames = {s: qos0_frames(s, m, now_ms) for s, m in (direct or {}).items()}
        entries = list(
            self._entries(
                pairs,
                source=source,
                lines=lines or {},
                key=key,
                direct=frames,
                named=named,
                given=given or {},
                connections=connections or {},
                stream=stream,
            )
        )
        calls = list(_calls(entries))
        # a lane split into parts must reach the queue in order: SQS keeps the order of one
        # group's messages within a call, not across calls sent at once
        split = len({e.lane for e in entries}) < len(entries)
        if len(calls) == 1 or split:
            for call in calls:
                self._send(call)
        else:
            with ThreadPoolExecutor(min(SEND_CONCURRENCY, len(calls))) as pool:
                for done in [pool.submit(self._send, call) for call in calls]:
                    done.result()
        self.sent += len(entries)
        return len(entries)

    def _entries(
        self,
        pairs: Mapping[str, str | None],
        *,
        source: str | None,
        lines: LineCache,
        key: str | None,
        direct: Mapping[str, list[dict[str, Any]]],
        named: Mapping[str, set[ArchiveLine]] | None,
        given: Mapping[str, Given],
        connections: Mapping[str, Connection],
        stream: str | None = None,
    ) -> Iterator[_Entry]:
        by_lane: dict[int, dict[str, str | None]] = {}
        for session_id, client_id in sorted(pairs.items()):
            by_lane.setdefault(lane_of(session_id, self.lanes), {})[session_id] = client_id
        salt = key or secrets.token_hex(8)
        for lane, chunk in sorted(by_lane.items()):
            wanted = (
                {line for s in chunk for line in named.get(s, ())} if named is not None else lines
            )
            carried = {line: lines[line] for line in wanted if line in lines}
            if _lines_bytes(carried) > MAX_LINES_BYTES:
                carried = {}
            posts = {s: direct[s] for s in chunk if direct.get(s)}
            items = {s: given[s] for s in chunk if s in given}
            held = {s: connections[s] for s in chunk if s in connections}
            bodies = _bodies(chunk, source, carried, posts, items, connections=held, stream=stream)
            for part, body in enumerate(bodies):
                dedupe = hashlib.sha256(f"{salt}|{lane}|{part}".encode()).hexdigest()
                yield _Entry(lane, body, dedupe)

    def _send(self, entries: Sequence[_Entry]) -> None:
        pending = {str(n): e for n, e in enumerate(entries)}
        for attempt in range(SEND_ATTEMPTS):
            answer = self.sqs.send_message_batch(
                QueueUrl=self.url,
                Entries=[
                    {
                        "Id": n,
                        "MessageBody": e.body,
                        "MessageGroupId": group_id(e.lane),
                        "MessageDeduplicationId": e.dedupe,
                    }
                    for n, e in pending.items()
                ],
            )
            failed = {f["Id"] for f in answer.get("Failed") or []}
            pending = {n: e for n, e in pending.items() if n in failed}
            if not pending:
                return
            self.clock.sleep(backoff_s(attempt, 0.05, 1.0))
        raise ServerBusy("the push queue refused a hand-off; retry")


def _lines_bytes(lines: LineCache) -> int:
    return sum(len(k.key) + len(json.dumps(v)) + 24 for k, v in lines.items())


def _bodies(
    chunk: Mapping[str, str | None],
    source: str | None,
    lines: LineCache,
    direct: Mapping[str, list[dict[str, Any]]],
    given: Mapping[str, Given],
    *,
    connections: Mapping[str, Connection],
    stream: str | None = None,
) -> Iterator[str]:
    """A lane's sessions as one body, or as several in order when one would be too large (a
    session too large alone goes without its QoS 0 frames, at most once, and its items,
    which its push then reads)."""
    body = PushWork(chunk, source, lines, direct, given, connections, stream).body()
    if len(body) <= MAX_BODY_BYTES:
        yield body
        return
    if len(chunk) == 1:
        yield PushWork(chunk, source, {}, {}, {}, connections, stream).body()
        return
    items = list(chunk.items())
    half = len(items) // 2
    for part in (dict(items[:half]), dict(items[half:])):
        yield from _bodies(
            part,
            source,
            lines,
            {s: direct[s] for s in part if s in direct},
            {s: given[s] for s in part if s in given},
            connections={s: connections[s] for s in part if s in connections},
            stream=stream,
        )


def _calls(entries: Sequence[_Entry]) -> Iterator[list[_Entry]]:
    """Entries packed into SendMessageBatch calls: ten at most, 256 KB in all, in order."""
    call: list[_Entry] = []
    size = 0
    for entry in entries:
        grows = len(entry.body) + 200
        if call and (len(call) == MAX_BATCH_ENTRIES or size + grows > MAX_BATCH_BYTES):
            yield call
            call, size = [], 0
        call.append(entry)
        size += grows
    if call:
        yield call


class HandOffs:
    """Sessions noted during one invocation (per context: ``shoal dev`` runs invocations on
    threads, each with its own), handed to the push queue at its end: the shared-group
    members a request's work handed streams to (an ack's final progress, a leave, a
    subscribe's rebalance, an expired lease). A member connected over the WebSocket API and
    idle runs nothing that would read them, so a group of HTTP and WebSocket members would
    leave a lane's backlog waiting for the next message routed to the group. Nothing without
    a push queue."""

    def __init__(self, queue: PushQueue | None) -> None:
        self.queue = queue
        # the invocation's, not the thread's: the threads a pusher runs its gets on
        # (``shoal.core.pools``, each step in a copy of the invocation's context) note into the
        # invocation's set, which a thread's local would hide from its flush
        self._pending: ContextVar[set[str] | None] = ContextVar(
            f"shoal-hand-offs-{id(self)}", default=None
        )
        self._lock = threading.Lock()

    def begin(self) -> None:
        """An invocation's notes start empty, in its context (before it starts threads)."""
        self._pending.set(set())

    def watch(self, groups: object | None) -> None:
        """Notes the hand-overs of ``groups`` (a ``GroupService``) from now on."""
        store = getattr(groups, "store", None)
        if self.queue is not None and store is not None:
            store.on_granted = self.note

    @contextmanager
    def watching(self, groups: object | None) -> Iterator[None]:
        """Notes the hand-overs of ``groups`` during the block, then hands them off (an HTTP
        request's: its function makes one such object per container)."""
        self.watch(groups)
        self.begin()
        try:
            yield
        finally:
            self.flush()

    def note(self, session_ids: set[str]) -> None:
        pending = self._pending.get()
        if pending is None:
            pending = set()
            self._pending.set(pending)
        with self._lock:
            pending.update(session_ids)

    def flush(self) -> int:
        """Hands what this invocation noted to the queue (best effort: a failed hand-off
        leaves the streams to the member's next trigger); the messages sent."""
        pending = self._pending.get()
        if not pending or self.queue is None:
            return 0
        with self._lock:
            noted = set(pending)
            pending.clear()
        try:
            return self.queue.hand_off(noted)
        except (ServerBusy, ClientError, BotoCoreError) as exc:
            logger.warning(
                "group hand-over not handed off", extra={"error_type": type(exc).__name__}
            )
            return 0
