"""The one declaration of what a Shoal deployment is made of.

The CDK stack (``infra/``) and the local runtime (``shoal.local``) both read this module:
tables (from ``shoal.aws.tables``), buckets, functions with their routes, schedules and grants, and
the environment each function gets. Adding a function or a route here adds it to both.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from shoal.aws.kinesis import ARCHIVER_MAPPING
from shoal.aws.tables import TABLES, TableDef
from shoal.core.config import (
    BUCKET_ENV_PREFIX,
    FUNCTION_ENV_PREFIX,
    QUEUE_ENV_PREFIX,
    STREAM_ENV_PREFIX,
    TABLE_ENV_PREFIX,
)

Access = Literal["read", "write", "read_write"]

#: the route API Gateway sends a request to when no other route matches
DEFAULT_ROUTE = "$default"


@dataclass(frozen=True)
class Route:
    method: str
    path: str  # API Gateway syntax: /v1/topics/{name}
    authorized: bool = True

    @property
    def key(self) -> str:
        return DEFAULT_ROUTE if self.path == DEFAULT_ROUTE else f"{self.method} {self.path}"


@dataclass(frozen=True)
class Grant:
    """What a function may do to one resource: a table, a bucket, a stream the stack owns
    (``stream``), the storage streams (``streams``: every topic's, made at run time), or the
    WebSocket API's connections (``connections``: ``execute-api:ManageConnections`` on its
    ``@connections`` API, to push frames to connected clients and close them), a mapping's
    enhanced fan-out consumers of the storage streams (``stream_consumers``, named by the
    mapping: list to read, register and deregister to write; given only when the stack's
    option names that mapping, ``enhancedFanOut``), a queue the stack owns (``queue``:
    write sends to it, read consumes it as a mapping's function), or the account's CloudWatch
    metrics (``metrics``, read only: ``cloudwatch:GetMetricData``, which names no resource)."""

    kind: Literal[
        "table",
        "bucket",
        "stream",
        "streams",
        "event_source_mappings",
        "connections",
        "stream_consumers",
        "queue",
        "metrics",
    ]
    name: str
    access: Access


@dataclass(frozen=True)
class WsRoute:
    """A route of the WebSocket API: ``$connect``, ``$disconnect``, ``$default`` or the
    ``action`` of a client frame (the API's route selection expression)."""

    key: str
    #: the function's answer body goes back to the client as a frame (a route response)
    two_way: bool = True


@dataclass(frozen=True)
class MockRoute:
    """A WebSocket route API Gateway answers by itself (a mock integration): no function runs,
    so a keep-alive costs an idle connection no compute (DESIGN.md, property 8)."""

    key: str
    #: the frame sent back, verbatim; None for a one-way route (nothing is sent back: one
    #: billed message instead of two)
    response: str | None


@dataclass(frozen=True)
class WebSocketDef:
    """The WebSocket API beside the HTTP API (``shoal.edge``): its routes are the functions'
    ``ws_routes`` and these mock routes, ``$connect`` guarded by ``authorizer``."""

    #: the REQUEST authorizer function of ``$connect``
    authorizer: str = "wsauth"
    route_selection: str = "$request.body.action"
    mock_routes: tuple[MockRoute, ...] = (
        MockRoute("ping", '{"action":"pong"}'),
        MockRoute("keepalive", None),
    )
    #: API Gateway's quotas, which ``shoal dev`` enforces the same way: a frame and a message
    #: (close 1009 beyond either), idle and whole-connection lifetimes
    max_frame_bytes: int = 32 * 1024
    max_message_bytes: int = 128 * 1024
    idle_timeout_s: int = 600
    max_connection_s: int = 7200
    stage: str = "v1"


@dataclass(frozen=True)
class StreamDef:
    """A Kinesis stream the stack owns (CloudFormation creates and deletes it), unlike the
    storage streams, which the admin API makes at run time."""

    logical: str
    #: provisioned shards (docs/operations.md, "Cost": why provisioned, and when to add one)
    shards: int = 1
    retention_hours: int = 24


@dataclass(frozen=True)
class QueueDef:
    """An SQS queue the stack owns, with its dead-letter queue (``<logical>-dead``).

    A FIFO queue delivers the messages of one message group in order, one batch at a time
    (Lambda's mapping holds a group while a batch of it is in flight), and the groups side by
    side: the WebSocket pushes' carrier (``shoal.edge.pushwork``). A standard queue delays each
    message on its own (``DelaySeconds``, up to 15 minutes): the sessions' due timers
    (``shoal.sessions.timers``)."""

    logical: str
    fifo: bool = False
    #: how long a received message stays invisible: six times its consumer's timeout (AWS's
    #: advice for a Lambda mapping), so a batch is never handed to a second worker while the
    #: first still runs it
    visibility_timeout_s: int = 30
    #: receives before a message goes to the dead-letter queue
    max_receive_count: int = 10
    retention_s: int = 4 * 24 * 3600

    @property
    def dead_letter(self) -> str:
        return f"{self.logical}-dead"


@dataclass(frozen=True)
class EventSource:
    """An event source mapping the stack owns: a declared stream (``stream``) or queue
    (``queue``) feeding a function."""

    stream: str = ""
    #: CreateEventSourceMapping's arguments besides the source and function (not hashed: a
    #: dict of lists, and the stream names the source anyway)
    mapping: Mapping[str, Any] = field(hash=False, default_factory=dict)
    #: a declared queue instead of a stream
    queue: str = ""

    @property
    def source(self) -> str:
        return self.queue or self.stream


@dataclass(frozen=True)
class FunctionDef:
    name: str
    #: "app.handler" inside functions/<name>/
    handler: str = "app.handler"
    routes: tuple[Route, ...] = ()
    #: the WebSocket API's routes it serves (``WebSocketDef``)
    ws_routes: tuple[WsRoute, ...] = ()
    grants: tuple[Grant, ...] = ()
    #: run every this many seconds (EventBridge schedule); None for no schedule
    schedule_s: int | None = None
    #: declared streams and queues that invoke it through event source mappings
    sources: tuple[EventSource, ...] = ()
    memory_mb: int = 512
    timeout_s: int = 29
    description: str = ""

    @property
    def module(self) -> str:
        """The module the local runtime and the tests import: functions.<name>.app."""
        return f"functions.{self.name}.{self.handler.rsplit('.', 1)[0]}"

    @property
    def attribute(self) -> str:
        return self.handler.rsplit(".", 1)[1]


@dataclass(frozen=True)
class BucketDef:
    logical: str
    #: every object expires after this many days (None: kept)
    expire_days: int | None = None
    #: (prefix, days): objects under a prefix expire after that many days
    expire_prefixes: tuple[tuple[str, int], ...] = ()

    def expiry_days(self, prefix: str) -> int | None:
        """After how many days the first objects under ``prefix`` expire: the earliest rule
        covering any of them (None: all kept)."""
        days = [
            d
            for rule, d in self.expire_prefixes
            if prefix.startswith(rule) or rule.startswith(prefix)
        ]
        if self.expire_days is not None:
            days.append(self.expire_days)
        return min(days, default=None)


#: the pusher function's timeout: a chunk's pushes, posts retried when throttled
#: (``shoal.edge.posts.POST_ATTEMPTS``, about 4 s at most a frame), well inside it
PUSHER_TIMEOUT_S = 60
#: the pusher's mapping on the push queue: ten messages (chunks of sessions) an invocation,
#: FIFO's most; a failed chunk is returned alone (with the later ones of its group)
PUSHER_MAPPING: Mapping[str, Any] = {
    "BatchSize": 10,
    "FunctionResponseTypes": ["ReportBatchItemFailures"],
}

#: the reaper's timeout: a scheduled run's sweeps, or one batch of the wills queue's timers
REAPER_TIMEOUT_S = 120
#: the reaper's mapping on the wills queue (``shoal.sessions.timers``): ten timers an
#: invocation, each reported alone when it fails; at most ``MaximumConcurrency`` batches at
#: once, so that a burst of lost connections (a network blip drops thousands) does not take
#: the account's concurrency from the API's functions (the schedule's sweep is the backstop)
WILLS_MAPPING: Mapping[str, Any] = {
    "BatchSize": 10,
    "FunctionResponseTypes": ["ReportBatchItemFailures"],
    "ScalingConfig": {"MaximumConcurrency": 10},
}

#: what inbox items name in the archive bucket: the router's message lines (deliveries by
#: reference, ``shoal.delivery.codec``) and large payloads (``shoal.delivery.inbox``)
INBOX_REFERENCES = ("messages/", "payloads/")


def check_archive_lifetime(buckets: tuple[BucketDef, ...], retention_s: int) -> None:
    """``ValueError`` when an archive object an inbox item may name could expire before the
    item: items live ``retention_s`` (``SHOAL_INBOX_RETENTION_S``) after their write, and their
    objects were written before them, so an expiry needs a day more (S3 rounds expiry up to
    the next midnight UTC, never down). The stack checks it at synth."""
    for bucket in buckets:
        if bucket.logical != "archive":
            continue
        for prefix in INBOX_REFERENCES:
            days = bucket.expiry_days(prefix)
            if days is not None and days * 86_400 < retention_s + 86_400:
                raise ValueError(
                    f"archive objects under {prefix} expire after {days} days, but inbox items "
                    f"that name them live {retention_s} s: make the expiry at least "
                    f"{-(-retention_s // 86_400) + 1} days"
                )


@dataclass(frozen=True)
class Deployment:
    tables: tuple[TableDef, ...]
    buckets: tuple[BucketDef, ...]
    functions: tuple[FunctionDef, ...]
    streams: tuple[StreamDef, ...] = ()
    queues: tuple[QueueDef, ...] = ()
    websocket: WebSocketDef = field(default_factory=WebSocketDef)
    #: the composite topic every MQTT topic without a topic of its own belongs to
    default_topic: str = "default"
    stream_prefix: str = "shoal"
    extra_env: Mapping[str, str] = field(default_factory=dict)

    def function(self, name: str) -> FunctionDef:
        return next(f for f in self.functions if f.name == name)

    def routes(self) -> list[tuple[Route, FunctionDef]]:
        return [(r, f) for f in self.functions for r in f.routes]

    def ws_routes(self) -> list[tuple[WsRoute, FunctionDef]]:
        return [(r, f) for f in self.functions for r in f.ws_routes]


DEPLOYMENT = Deployment(
    tables=TABLES,
    buckets=(
        BucketDef(
            "archive",
            # large payloads are read only through inbox items, which TTL removes after the
            # inbox retention (SHOAL_INBOX_RETENTION_S, 14 days by default): one day more.
            # messages/ never expires: inbox items name its lines (and the pipeline reads
            # it); check_archive_lifetime holds any expiry to the retention
            expire_prefixes=(("payloads/", 15),),
        ),
    ),
    # the delivery-event log (shoal.delivery.events): gets, acks, the router and push append
    # their events, the archiver writes them to the archive bucket
    streams=(StreamDef("events"),),
    # the WebSocket pushes' carrier (shoal.edge.pushwork): whoever has deliveries for connected
    # sessions hands the pushes to it, and the pusher function's workers post them, a session's
    # pushes one after the other (its message group), the sessions side by side
    queues=(
        QueueDef(
            "push",
            fifo=True,
            visibility_timeout_s=6 * PUSHER_TIMEOUT_S,
            max_receive_count=10,
        ),
        # the sessions' due timers (shoal.sessions.timers): a lost connection's head, a will
        # after its delay, a will due at once, each reaped when it is due (a message delayed
        # until then) instead of at the reaper's next scheduled run. Standard, not FIFO: no
        # order to keep, and only a standard queue delays each message on its own. A timer
        # that fails five times is dead-lettered (the schedule's sweep reaps its item anyway)
        QueueDef(
            "wills",
            visibility_timeout_s=6 * REAPER_TIMEOUT_S,
            max_receive_count=5,
            retention_s=24 * 3600,
        ),
    ),
    functions=(
        FunctionDef(
            name="health",
            description="GET /v1/health, and the coded 404 for every unknown route",
            routes=(
                Route("GET", "/v1/health", authorized=False),
                Route("ANY", DEFAULT_ROUTE, authorized=False),
            ),
            memory_mb=256,
            timeout_s=5,
        ),
        FunctionDef(
            name="admin",
            description=(
                "Composite topics: create, list, get, add a storage topic, switch produce; "
                "a shared group's members and lanes; the console's Overview (metrics)"
            ),
            routes=(
                Route("POST", "/v1/topics"),
                Route("GET", "/v1/topics"),
                Route("GET", "/v1/topics/{name}"),
                Route("POST", "/v1/topics/{name}/storage-topics"),
                Route("POST", "/v1/topics/{name}/switch-produce"),
                Route("GET", "/v1/groups/{share}"),
                Route("GET", "/v1/metrics"),
            ),
            grants=(
                Grant("table", "topics", "read_write"),
                # create the storage streams and read their shards; a switch puts the seals of
                # the storage topics it left behind (shoal.drain)
                Grant("streams", "storage", "read_write"),
                # the router's mapping on each new stream; listing makes creation idempotent
                Grant("event_source_mappings", "router", "read_write"),
                # with the enhanced fan-out option, the router's consumer of each new stream
                Grant("stream_consumers", "router", "read_write"),
                # a new storage topic joins the push taps of the topic's push subscriptions
                Grant("table", "push_subscriptions", "read_write"),
                Grant("event_source_mappings", "push", "read_write"),
                # a switch seals what it left behind and marks it in the drain records, which
                # live in the inboxes table (shoal.drain; seen by the IAM check, 2026-11-29)
                Grant("table", "inboxes", "read_write"),
                # a shared group's view (shoal.groups.admin): one query of its partition, and
                # its members' session heads (connected or not); it writes neither
                Grant("table", "groups", "read"),
                Grant("table", "sessions", "read"),
                # the Overview (shoal.overview): one GetMetricData a view, the stack's own
                # metrics; it counts the topics and push subscriptions (granted above)
                Grant("metrics", "cloudwatch", "read"),
            ),
        ),
        FunctionDef(
            name="publish",
            description="POST /v1/messages[:batch]: validate, deduplicate, route, put",
            routes=(Route("POST", "/v1/messages"), Route("POST", "/v1/messages:batch")),
            grants=(
                Grant("table", "topics", "read"),
                Grant("table", "publishers", "read_write"),
                Grant("table", "retained", "write"),
                Grant("streams", "storage", "write"),
                # a retry of a crashed publish reads its shard back (two grants: no stream
                # management, which read_write on streams would add)
                Grant("streams", "storage", "read"),
            ),
            memory_mb=1024,
        ),
        FunctionDef(
            name="router",
            description="Consumes the storage streams: fan-out to session inboxes, archive",
            grants=(
                Grant("streams", "storage", "read"),
                # it writes the archive (the pusher reads it, not the router)
                Grant("bucket", "archive", "write"),
                # the subscription store's versions, changes and subscriptions
                Grant("table", "subscriptions", "read"),
                # deliveries, and the per-shard ledger that makes a retried batch write nothing
                # twice (a retry reads what it wrote before)
                Grant("table", "inboxes", "read_write"),
                # a shared group's new stream is made known to its leader (a conditional put)
                Grant("table", "groups", "read_write"),
                # its ``routed`` delivery events (shoal.delivery.events)
                Grant("stream", "events", "write"),
                # which sessions are connected over the WebSocket API: their pushes are handed
                # to the push queue (shoal.edge.pushwork), the pusher posts them
                Grant("table", "connections", "read"),
                Grant("queue", "push", "write"),
            ),
            # a full vCPU (Lambda's CPU grows with memory up to 1,769 MB): one message to many
            # subscribers is CPU-bound here (matching, encoding an item a subscriber: about
            # 0.1 ms each), and 100,000 of them are 10 s of it at 512 MB's share (bench fanout)
            memory_mb=1769,
            timeout_s=60,
        ),
        FunctionDef(
            name="archiver",
            description="Consumes the delivery-event log: one S3 object per batch and hour",
            grants=(
                Grant("stream", "events", "read"),
                Grant("bucket", "archive", "write"),
            ),
            sources=(EventSource("events", ARCHIVER_MAPPING),),
            # a batch of 10,000 records (at most Lambda's 6 MB of them) is decompressed and
            # written as a few objects: seconds, with room for S3's slow answers
            timeout_s=120,
        ),
        FunctionDef(
            name="bootstrap",
            description="Custom resource: creates the default composite topic at deploy",
            grants=(
                Grant("table", "topics", "read_write"),
                Grant("streams", "storage", "read_write"),
                Grant("event_source_mappings", "router", "read_write"),
                Grant("stream_consumers", "router", "read_write"),
            ),
            timeout_s=300,
        ),
        FunctionDef(
            name="teardown",
            description="Custom resource: on stack deletion, removes runtime streams and mappings",
            grants=(
                # where the runtime streams are recorded (shoal.teardown)
                Grant("table", "topics", "read"),
                Grant("table", "push_subscriptions", "read"),
                # read_write: DeleteStream (with describe, to tell "being deleted" apart)
                Grant("streams", "storage", "read_write"),
                # the mappings made at run time invoke these two (shoal.teardown.MAPPED_FUNCTIONS)
                Grant("event_source_mappings", "router", "read_write"),
                Grant("event_source_mappings", "push", "read_write"),
                # the router's enhanced fan-out consumers, when the option made them
                Grant("stream_consumers", "router", "read_write"),
            ),
            timeout_s=300,
        ),
        FunctionDef(
            name="sessions",
            description="Connect, disconnect, heartbeat and read sessions (the session registry)",
            routes=(
                Route("PUT", "/v1/sessions/{client_id}"),
                Route("DELETE", "/v1/sessions/{client_id}"),
                Route("GET", "/v1/sessions/{client_id}"),
                Route("POST", "/v1/sessions/{client_id}/heartbeat"),
            ),
            grants=(
                Grant("table", "sessions", "read_write"),
                # a connect that ends a session removes its subscriptions from the router's store
                Grant("table", "subscriptions", "read_write"),
                # a heartbeat renews group leases and advances their leaders; an ended session
                # leaves its groups, and the last member removes a group with its backlog
                Grant("table", "groups", "read_write"),
                Grant("table", "inboxes", "read_write"),
                # an ended session's held QoS 2 group deliveries are dropped, each recorded
                # with its reason ([MQTT-4.8.2-5]; seen by the IAM check, 2026-11-29)
                Grant("stream", "events", "write"),
                # a connect that takes a WebSocket connection's channel over releases the
                # members it kept: the members handed their lanes are pushed
                # (``wiring.HandOvers``; the pusher skips those not connected)
                Grant("queue", "push", "write"),
                # a connect that takes a live channel over (or ends a session) arms the timer
                # of the wills it makes due at once (shoal.sessions.timers)
                Grant("queue", "wills", "write"),
            ),
            # a connect retries racing connects for up to 5 s (shoal.sessions.CONNECT_BUDGET_S)
            timeout_s=15,
        ),
        FunctionDef(
            name="reaper",
            description=(
                "Scheduled: keepalive expiry, wills after their delay, session expiry; the census. "
                "The wills queue's timers: a due item reaped at its time"
            ),
            sources=(EventSource(queue="wills", mapping=WILLS_MAPPING),),
            grants=(
                # the due index and the registry's conditional writes
                Grant("table", "sessions", "read_write"),
                # wills go through the publish path, with the publish function's grants
                Grant("table", "topics", "read"),
                Grant("table", "publishers", "read_write"),
                Grant("table", "retained", "write"),
                Grant("streams", "storage", "write"),
                Grant("streams", "storage", "read"),
                # an expired session's subscriptions leave the router's store
                Grant("table", "subscriptions", "read_write"),
                # and its shared groups (the last member removes a group with its backlog)
                Grant("table", "groups", "read_write"),
                Grant("table", "inboxes", "read_write"),
                # WebSocket connections whose $disconnect never came (shoal.edge): the sweep
                # ends their channels
                Grant("table", "connections", "read_write"),
                # and hands the push of what passed its ack timeout to the push queue (the
                # due index is in the connections table)
                Grant("queue", "push", "write"),
                # an expired session's held QoS 2 group deliveries are dropped, each recorded
                # with its reason ([MQTT-4.8.2-5])
                Grant("stream", "events", "write"),
                # the census (shoal.census) scans the connections, sessions and groups tables
                # (granted above) and reads each push subscription's dead letters
                Grant("table", "push_subscriptions", "read"),
                Grant("table", "push_groups", "read"),
                # its timers: taken from the wills queue by its mapping, armed again when one
                # comes early, and armed for the will an expired channel leaves waiting
                Grant("queue", "wills", "read_write"),
            ),
            schedule_s=60,
            timeout_s=REAPER_TIMEOUT_S,
        ),
        FunctionDef(
            name="subscriptions",
            description="Subscribe and unsubscribe: session state, subscription store, retained",
            routes=(
                Route("POST", "/v1/sessions/{client_id}/subscriptions"),
                Route("POST", "/v1/sessions/{client_id}/unsubscribe"),
            ),
            grants=(
                Grant("table", "sessions", "read_write"),
                Grant("table", "subscriptions", "read_write"),
                # retained messages matching a new subscription go to the session's inbox
                Grant("table", "inboxes", "read_write"),
                Grant("table", "retained", "read"),
                Grant("table", "topics", "read"),
                # shared subscriptions join and leave their groups in the same transaction
                Grant("table", "groups", "read_write"),
                # a member that leaves drops its held QoS 2 deliveries, recording each
                Grant("stream", "events", "write"),
                # the members a rebalance handed group lanes to: their pushes go to the push
                # queue (``wiring.HandOvers``; the pusher skips those not connected)
                Grant("queue", "push", "write"),
                # a share subscribed over HTTP on a channel a WebSocket connection holds is
                # kept live by that connection (``shoal.edge.connections.ConnectionKeeps``)
                Grant("table", "connections", "read"),
            ),
        ),
        FunctionDef(
            name="messages",
            description="Get and ack: a session's inbox, in order, within its in-flight window",
            routes=(
                Route("GET", "/v1/sessions/{client_id}/messages"),
                Route("POST", "/v1/sessions/{client_id}/acks"),
            ),
            grants=(
                # a get or ack counts for the channel's keepalive (MQTT 5 §3.1.2.10)
                Grant("table", "sessions", "read_write"),
                Grant("table", "inboxes", "read_write"),
                # the group streams the session leases: leaders, fences, progress
                Grant("table", "groups", "read_write"),
                # payloads too large for an inbox item are kept once there (shoal.delivery)
                Grant("bucket", "archive", "read"),
                # delivery events of gets and acks (shoal.delivery.events)
                Grant("stream", "events", "write"),
                # the members an ack handed group lanes to: their pushes go to the push queue
                # (``wiring.HandOvers``; the pusher skips those not connected)
                Grant("queue", "push", "write"),
            ),
        ),
        FunctionDef(
            name="wsauth",
            description="The WebSocket API's $connect authorizer: the HTTP API's JWT rules",
            memory_mb=256,
            timeout_s=10,
        ),
        FunctionDef(
            name="edge",
            description="The WebSocket API: a session's life in JSON frames, deliveries pushed",
            ws_routes=(
                # $connect answers the browser's chosen subprotocol; $disconnect ends the
                # channel (a will after its delay unless a normal disconnect came first)
                WsRoute("$connect", two_way=False),
                WsRoute("$disconnect", two_way=False),
                WsRoute("connect"),
                WsRoute("renew"),
                WsRoute("subscribe"),
                WsRoute("unsubscribe"),
                WsRoute("publish"),
                WsRoute("ack"),
                WsRoute("disconnect"),
                # a frame without a known action: a coded error frame
                WsRoute("$default"),
            ),
            grants=(
                # the connect, subscribe, publish and get/ack paths, as their HTTP functions
                Grant("table", "sessions", "read_write"),
                Grant("table", "subscriptions", "read_write"),
                Grant("table", "inboxes", "read_write"),
                Grant("table", "groups", "read_write"),
                Grant("table", "retained", "read_write"),
                Grant("table", "topics", "read"),
                Grant("table", "publishers", "read_write"),
                Grant("streams", "storage", "write"),
                Grant("streams", "storage", "read"),
                Grant("stream", "events", "write"),
                # which session a connection holds
                Grant("table", "connections", "read_write"),
                # answers, and closing a taken-over connection
                Grant("connections", "websocket", "write"),
                # deliveries: a connect's, a subscribe's retained messages, an ack that opened
                # the window are handed to the push queue, after the frame's answer
                Grant("queue", "push", "write"),
                # a lost connection ($disconnect) arms its head's timer, a takeover its will's
                # (shoal.sessions.timers)
                Grant("queue", "wills", "write"),
            ),
        ),
        FunctionDef(
            name="pusher",
            description="WebSocket pushes: a chunk of connected sessions' deliveries posted",
            sources=(EventSource(queue="push", mapping=PUSHER_MAPPING),),
            grants=(
                # it takes its work from the push queue, and hands the members its gets hand
                # group lanes to back to it (their own pushes)
                Grant("queue", "push", "read_write"),
                # a push is a get for the connection's channel (shoal.delivery): the session's
                # head, its delivery state and inbox, its group streams (a member's lanes)
                Grant("table", "sessions", "read"),
                Grant("table", "inboxes", "read_write"),
                Grant("table", "groups", "read_write"),
                # the deliveries' archive lines and large payloads, when the chunk does not
                # carry them
                Grant("bucket", "archive", "read"),
                # its ``delivered`` events, appended before the frames go
                Grant("stream", "events", "write"),
                # the sessions' connections (forgotten when gone; the due index armed)
                Grant("table", "connections", "read_write"),
                Grant("connections", "websocket", "write"),
            ),
            # posts wait on their round trips, and the gets' writes on theirs: more memory
            # buys more CPU for the chunk's threads (docs/operations.md, "Fan-out")
            memory_mb=1024,
            timeout_s=PUSHER_TIMEOUT_S,
        ),
        FunctionDef(
            name="push",
            description="Push subscriptions: HTTP delivery from storage streams and retry queues",
            grants=(
                # specs and cursors (a cursor moves per batch); the per-key group states
                Grant("table", "push_subscriptions", "read_write"),
                Grant("table", "push_groups", "read_write"),
                # reads its batches' sources again when it repairs a missing queue entry;
                # puts into retry and dead-letter queues (two grants: no stream management)
                Grant("streams", "storage", "read"),
                Grant("streams", "storage", "write"),
                # delivery events of its POST attempts (shoal.delivery.events)
                Grant("stream", "events", "write"),
                # the ordered drain's gate: whether a tap may take a storage topic behind the
                # pointer, and that it passed the seals (drain records in inboxes, shoal.drain)
                Grant("table", "inboxes", "read_write"),
            ),
            # an invocation waits for a retry's attempt time up to shoal.push.consumer.MAX_HOLD_S
            timeout_s=120,
        ),
        FunctionDef(
            name="pushadmin",
            description="Push subscriptions (admin): create, list, get, change, delete, seek, DLQ",
            routes=(
                Route("POST", "/v1/subscriptions"),
                Route("GET", "/v1/subscriptions"),
                Route("GET", "/v1/subscriptions/{name}"),
                Route("PATCH", "/v1/subscriptions/{name}"),
                Route("DELETE", "/v1/subscriptions/{name}"),
                Route("POST", "/v1/subscriptions/{name}/seek"),
                Route("GET", "/v1/subscriptions/{name}/dlq"),
                Route("POST", "/v1/subscriptions/{name}/dlq/redrive"),
            ),
            grants=(
                Grant("table", "push_subscriptions", "read_write"),
                Grant("table", "push_groups", "read_write"),
                # the subscription's topic and its storage streams
                Grant("table", "topics", "read"),
                # retry and dead-letter queues: create, delete, read (DLQ), put (redrive)
                Grant("streams", "storage", "read_write"),
                # the push taps and retry-queue mappings; a seek replaces a tap's mapping
                Grant("event_source_mappings", "push", "read_write"),
            ),
        ),
    ),
)


def environment(
    tables: Mapping[str, str],
    buckets: Mapping[str, str],
    functions: Mapping[str, str],
    *,
    stream_prefix: str,
    default_partitions: int,
    streams: Mapping[str, str] | None = None,
    queues: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment variables every function gets, given physical resource names (a
    queue's: its URL, what SQS's calls name it by)."""
    env = {f"{TABLE_ENV_PREFIX}{k.upper()}": v for k, v in tables.items()}
    env |= {f"{STREAM_ENV_PREFIX}{k.upper()}": v for k, v in (streams or {}).items()}
    env |= {f"{QUEUE_ENV_PREFIX}{k.upper()}": v for k, v in (queues or {}).items()}
    env |= {f"{BUCKET_ENV_PREFIX}{k.upper()}": v for k, v in buckets.items()}
    env |= {f"{FUNCTION_ENV_PREFIX}{k.upper()}": v for k, v in functions.items()}
    env["SHOAL_STREAM_PREFIX"] = stream_prefix
    env["SHOAL_DEFAULT_PARTITIONS"] = str(default_partitions)
    env["POWERTOOLS_SERVICE_NAME"] = "shoal"
    return env


def function_environment(fn: FunctionDef) -> dict[str, str]:
    """What one function's environment adds to ``environment``: its service name, the
    ``service`` dimension of its metrics and the ``service`` key of its log lines (the
    function's folder name: a handful of values, a bounded dimension)."""
    return {"POWERTOOLS_SERVICE_NAME": fn.name}
