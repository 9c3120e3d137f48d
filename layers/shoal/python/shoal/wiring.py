"""The wiring root: where services are composed from ``Config``.

Handlers, ``shoal dev``, tests and benchmarks build their services here, so that the way a
service is put together (its stores, clients, clock and hooks) is written once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial
from typing import Generic, TypeVar

from shoal.aws import tables
from shoal.aws.dynamo import Dynamo
from shoal.aws.kinesis import Streams
from shoal.census import Census
from shoal.composite.directory import TopicDirectory
from shoal.composite.model import CompositeTopic
from shoal.composite.service import TopicService
from shoal.composite.store import TopicStore
from shoal.core.auth import Principal
from shoal.core.clock import Clock, SystemClock
from shoal.core.config import Config, get_config
from shoal.core.errors import TopicNotFound
from shoal.core.faults import Faults
from shoal.delivery.events import Recording
from shoal.delivery.gate import SessionGate
from shoal.delivery.inbox import InboxStore, PayloadStore
from shoal.delivery.retained import RetainedReader
from shoal.delivery.service import DeliveryService
from shoal.delivery.subscriptions import SubscriptionRetirer, SubscriptionService, SubscriptionStore
from shoal.drain import DrainStore, RouterDrain, Sealer, seal_grace_ms
from shoal.edge.connections import ConnectionStore
from shoal.edge.posts import Connections
from shoal.edge.push import PushWorker
from shoal.edge.pushwork import HandOffs, PushQueue
from shoal.edge.service import EdgeService
from shoal.edge.sweep import PushSweep
from shoal.groups.gate import group_gate
from shoal.groups.service import GroupService, StreamRegistrar
from shoal.groups.store import GroupStore
from shoal.groups.streams import StreamReader
from shoal.publish.request import PublishRequest
from shoal.publish.service import PublishService
from shoal.push.admin import TapHooks
from shoal.router.archive import ArchiveWriter
from shoal.router.batch import Router
from shoal.router.fanout import Fanout, SubscriptionCache
from shoal.sessions.model import WillMessage
from shoal.sessions.reaper import Reaper
from shoal.sessions.registry import SessionRegistry
from shoal.sessions.repository import SessionRepository
from shoal.sessions.timers import SqsDueTimer
from shoal.teardown import Teardown

T = TypeVar("T")


class PerConfig(Generic[T]):
    """One object per configuration: a container builds its service (clients, caches) once.

    Tests that load a new configuration (``get_config.cache_clear()``) get a fresh object.
    """

    def __init__(self, factory: Callable[[Config], T]) -> None:
        self._factory = factory
        self._lock = threading.Lock()
        self._held: tuple[Config, T] | None = None

    def __call__(self) -> T:
        config = get_config()
        with self._lock:
            if self._held is None or self._held[0] is not config:
                self._held = (config, self._factory(config))
            return self._held[1]


def topic_service(
    config: Config, clock: Clock | None = None, *, stream_wait_s: float = 20.0
) -> TopicService:
    """Composite topics' admin, with the push subscriptions' taps following their changes.

    ``stream_wait_s``: how long a request waits for a new stream to become active (Kinesis
    takes ~30 s); an API request gives up in time to answer 503 within API Gateway's 30 s and
    repeating it completes the topic, the deploy-time bootstrap can wait longer.
    """
    clock = clock or SystemClock()
    streams = Streams.from_config(config, clock)
    return TopicService(
        config,
        TopicStore.from_config(config),
        streams,
        clock,
        hooks=SealingHooks(config, streams, clock, sealer(config, clock)),
        stream_wait_s=stream_wait_s,
    )


#: how long a switch-produce call waits to seal what it left behind: the grace (11 s) fits in
#: API Gateway's 30 s with room; a longer configured grace leaves the sealing to the reaper
SWITCH_SEAL_WAIT_MS = 20_000


class SealingHooks(TapHooks):
    """The push taps follow a topic's changes, and a switch seals what it left behind as soon
    as no put routed before it can land (``shoal.drain``), instead of at the reaper's next
    run: delivery from the new storage topic waits seconds, not a minute or two."""

    def __init__(self, config: Config, streams: Streams, clock: Clock, sealer: Sealer) -> None:
        super().__init__(config, streams, clock)
        self.sealer = sealer

    def switch_in_effect(self, topic: CompositeTopic) -> None:
        self.sealer.seal_behind(topic, SWITCH_SEAL_WAIT_MS)


def teardown(config: Config) -> Teardown:
    """What the stack made at run time, removed when it is deleted (infra/lifecycle.py)."""
    return Teardown.from_config(config)


def topic_directory(config: Config, clock: Clock) -> TopicDirectory:
    return TopicDirectory(TopicStore.from_config(config), clock)


# --- sessions, delivery, shared groups ------------------------------------------------------------


def group_service(
    config: Config,
    clock: Clock | None = None,
    *,
    payloads: bool = True,
    events: Recording | None = None,
) -> GroupService:
    """Shared groups; ``payloads`` False for those that never hand out messages (subscribe,
    the session's end). ``events``: the container's recording when its function has one;
    else its own, as every path that ends a member's holding records why: an unsubscribe's or
    a session end's dropped QoS 2 deliveries ([MQTT-4.8.2-5]) are ``dropped`` events, which
    the audit counts, never lost."""
    store = GroupStore.from_config(config, clock)
    store.partitions_of = partial(
        partitions_of,
        TopicDirectory(TopicStore(store.dynamo, config.table(tables.TOPICS)), clock or store.clock),
    )
    return GroupService(
        store,
        StreamReader(store.dynamo, config.table(tables.INBOXES)),
        config.delivery,
        clock=clock,
        payloads=PayloadStore.from_config(config) if payloads else None,
        events=events if events is not None else Recording.from_config(config, clock),
        drain=group_gate(config, clock or store.clock, store.lane_progress),
    )


def partitions_of(topics: TopicDirectory, topic_filter: str) -> int | None:
    """The partitions a filter's messages are written to now, found as a publish routes (its
    first level's composite topic, else ``default``'s); None when neither exists. Read when a
    shared group is created (its lanes per shard)."""
    found = topics.destinations([topic_filter])[0]
    return None if isinstance(found, TopicNotFound) else found.storage.partitions


def session_registry(
    config: Config,
    clock: Clock | None = None,
    groups: GroupService | None = None,
    *,
    requests_seen: bool = True,
) -> SessionRegistry:
    """``groups``: the container's groups service, when its function builds one anyway (one
    service, one drain gate cache, per container). ``requests_seen``: the calls are the
    client's (they count for its keepalive), not a pusher's."""
    groups = groups or group_service(config, clock, payloads=False)
    return SessionRegistry(
        SessionRepository.from_config(config),
        clock,
        # an ended session's subscriptions leave the router's store and its shared groups,
        # and its end is recorded (the audit's "dropped" for what it did not ack)
        on_session_end=SubscriptionRetirer(
            SubscriptionStore.from_config(config), clock, groups, events=groups.events
        ),
        # a heartbeat renews the session's group leases
        groups=groups,
        deliveries=InboxStore.from_config(config),
        requests_seen=requests_seen,
        # a lost connection's head and a takeover's will are reaped at once, not at the
        # reaper's next run (the functions that lose or connect have the queue's grant)
        timer=due_timer(config, clock),
    )


def due_timer(config: Config, clock: Clock | None = None) -> SqsDueTimer | None:
    """The sessions' due timers over the wills queue (``shoal.sessions.timers``); None
    without it."""
    return SqsDueTimer.from_config(config, clock)


def subscription_service(config: Config, clock: Clock | None = None) -> SubscriptionService:
    dynamo = Dynamo.from_config(config)
    groups = group_service(config, clock, payloads=False)
    return SubscriptionService(
        session_registry(config, clock, groups),
        SubscriptionStore(dynamo, config.table(tables.SUBSCRIPTIONS)),
        InboxStore(dynamo, config.table(tables.INBOXES)),
        config.delivery,
        RetainedReader(
            dynamo,
            config.table(tables.RETAINED),
            TopicStore(dynamo, config.table(tables.TOPICS)).names,
        ),
        clock=clock,
        groups=groups,
        # a share subscribed over HTTP on a WebSocket connection's channel is kept by it
        connections=ConnectionStore(dynamo, config.table(tables.CONNECTIONS), clock),
    )


def delivery_service(
    config: Config, clock: Clock | None = None, *, requests_seen: bool = True
) -> DeliveryService:
    """Get and ack; ``requests_seen`` False for a pusher's (its gets are not the client's)."""
    events = Recording.from_config(config, clock)
    groups = group_service(config, clock, events=events)
    return DeliveryService(
        session_registry(config, clock, groups, requests_seen=requests_seen),
        InboxStore.from_config(config),
        config.delivery,
        clock,
        PayloadStore.from_config(config),
        groups=groups,
        events=events,
        drain=SessionGate.from_config(config, clock),
    )


def push_queue(config: Config, clock: Clock | None = None) -> PushQueue | None:
    """Where pushes to WebSocket connections are handed (``shoal.edge.pushwork``); None
    without a WebSocket API (``SHOAL_CONNECTIONS_ENDPOINT`` unset) or a push queue."""
    return PushQueue.from_config(config, clock)


def push_worker(config: Config, clock: Clock | None = None) -> PushWorker:
    """The pusher function's work (``shoal.edge.push``)."""
    api = Connections.from_config(config, clock)
    if api is None:
        raise RuntimeError("the pusher needs SHOAL_CONNECTIONS_ENDPOINT")
    # a push's gets are the service's own: they do not keep the channel alive
    delivery = delivery_service(config, clock, requests_seen=False)
    return PushWorker(
        ConnectionStore.from_config(config, clock),
        api,
        delivery,
        push_queue(config, clock),
        clock,
        parallelism=config.push.parallelism,
    )


def push_sweep(config: Config, clock: Clock | None = None) -> PushSweep | None:
    """The reaper's sweep of pushed deliveries past their ack timeout; None without pushes."""
    queue = push_queue(config, clock)
    if queue is None:
        return None
    return PushSweep(
        ConnectionStore.from_config(config, clock),
        delivery_service(config, clock, requests_seen=False),
        queue,
        clock,
    )


def hand_overs(config: Config, clock: Clock | None = None) -> HandOffs:
    """The shared-group members an HTTP request's work hands streams to, handed to the push
    queue when the request ends (``HandOffs.watching``)."""
    return HandOffs(push_queue(config, clock))


def edge_service(config: Config, clock: Clock | None = None) -> EdgeService:
    """The WebSocket API's routes: the HTTP routes' services, acting for a connection."""
    api = Connections.from_config(config, clock)
    queue = push_queue(config, clock)
    if api is None or queue is None:
        raise RuntimeError(
            "the WebSocket API's functions need SHOAL_CONNECTIONS_ENDPOINT and the push queue"
        )
    subscriptions = subscription_service(config, clock)
    return EdgeService(
        subscriptions.registry,
        subscriptions,
        PublishService.from_config(config),
        delivery=delivery_service(config, clock),
        connections=ConnectionStore.from_config(config, clock),
        api=api,
        queue=queue,
        settings=config.delivery,
        clock=clock,
    )


class ServiceWillPublisher:
    """Wills go through the publish path (``shoal.publish``), exactly once each.

    A will is published as its session's principal with ``publisher_id = "will:<channel>"``
    and ``publisher_seq = 1``: a channel has at most one will, and the publish path answers a
    retry of that pair as a duplicate instead of putting the message again.
    """

    def __init__(self, service: PublishService) -> None:
        self.service = service

    def publish_will(self, sub: str, client_id: str, will: WillMessage, will_id: str) -> None:
        request = PublishRequest(
            topic=will.topic,
            payload=will.payload,
            text=will.text if will.payload is None else None,
            qos=will.qos,
            retain=will.retain,
            publisher_id=f"will:{will_id}",
            publisher_seq=1,
        )
        # the connect checked the topic against the principal's shoal:publish filters
        as_owner = Principal(sub=sub, clients=(client_id,), publish=(will.topic,))
        self.service.publish(as_owner, request)


def reaper(config: Config, clock: Clock | None = None, hand_offs: HandOffs | None = None) -> Reaper:
    """Keepalive expiry, wills (through the publish path) and session expiry; ``hand_offs``:
    told whom the groups' advances hand streams to (a stack with a WebSocket API)."""
    groups = group_service(config, clock, payloads=False)
    if hand_offs is not None:
        hand_offs.watch(groups)
    return Reaper(
        SessionRepository.from_config(config),
        ServiceWillPublisher(PublishService.from_config(config)),
        # an ended session's subscriptions leave the router's store and its shared groups,
        # and its end is recorded (the audit's "dropped" for what it did not ack)
        on_session_end=SubscriptionRetirer(
            SubscriptionStore.from_config(config), clock, groups, events=groups.events
        ),
        # a dead channel's shared groups advance (its expired leases go to live members)
        on_channel_expired=groups.channel_expired,
        # the will an expired channel leaves waiting is published by its timer
        timer=due_timer(config, clock),
    )


def census(config: Config, clock: Clock | None = None) -> Census:
    """The reaper's count of connections, sessions, groups and dead letters (``shoal.census``)."""
    return Census.from_config(config, clock)


def sealer(config: Config, clock: Clock | None = None) -> Sealer:
    """Seals the storage topics a SwitchProduce left behind (``shoal.drain``)."""
    return Sealer(
        Streams.from_config(config, clock),
        DrainStore.from_config(config),
        TopicStore.from_config(config).scan,
        clock,
        grace_ms=seal_grace_ms(config.seal_grace_s),
    )


# --- the router -----------------------------------------------------------------------------------


def fanout(config: Config, clock: Clock | None = None) -> Fanout:
    dynamo = Dynamo.from_config(config)
    return Fanout(
        SubscriptionCache(SubscriptionStore(dynamo, config.table(tables.SUBSCRIPTIONS))),
        InboxStore.writer(config),
        config.delivery,
        payloads=PayloadStore.from_config(config),
        clock=clock,
        # shared groups: their streams are made known to their leaders
        groups=StreamRegistrar(GroupStore.from_config(config, clock)),
        drain=RouterDrain.from_config(config, clock),
    )


def router(config: Config) -> Router:
    return Router(
        fanout(config),
        ArchiveWriter.from_config(config),
        Recording.from_config(config),
        Faults.from_config(config, "router"),
        # sessions connected over the WebSocket API get their new deliveries pushed
        queue=push_queue(config),
        connections=ConnectionStore.from_config(config),
    )
