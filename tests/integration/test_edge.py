"""The WebSocket edge's routes over moto: frames in, frames out, deliveries pushed.

The edge function is driven with API Gateway's WebSocket events (``events/edge_*.json``), the
router runs through the emulated event source mappings, and ``@connections`` is a recording
port: what each connection was sent, and which were closed or are gone.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import boto3
import pytest
import shoal.edge.push as push_module
import shoal.router.fanout as fanout_module
from botocore.exceptions import ClientError
from shoal.aws.dynamo import Dynamo
from shoal.core.auth import Principal
from shoal.core.clock import Clock
from shoal.core.config import get_config
from shoal.core.errors import ServerBusy, SessionTakenOver
from shoal.declarations import PUSHER_MAPPING
from shoal.delivery.model import STATE
from shoal.edge.connections import MAX_CONNECTION_S, ConnectionStore
from shoal.edge.frames import SERVICE_FRAMES
from shoal.edge.posts import Connections
from shoal.edge.push import PushWorker
from shoal.edge.pushwork import HandOffs, PushQueue
from shoal.edge.routes import handle
from shoal.edge.service import CHANNEL_MARGIN_S, EdgeService
from shoal.edge.sweep import PushSweep, SweepReport
from shoal.groups.records import group_key
from shoal.local.esm.queues import QueueMapping, QueueMappings
from shoal.local.provision import LocalNames
from shoal.sessions.reaper import Reaper
from shoal.sessions.repository import SessionRepository

import functions.messages.app as messages_app
import functions.router.app as router_app
import functions.sessions.app as sessions_app
import functions.subscriptions.app as subscriptions_app
from tests.helpers import load_event
from tests.integration.test_delivery_support import World
from tests.integration.test_groups_support import LEASE_S, GroupWorld
from tests.integration.test_sessions_support import RecordingPublisher

_MODELS = {m.model_fields["action"].default: m for m in SERVICE_FRAMES}


class RecordingConnections(Connections):
    """``@connections`` as a port: frames posted per connection, closed and gone ones. Its
    SDK client is a recording stand-in (``_Management``), so ``Connections.post``'s own retry
    of throttled posts runs; ``throttle`` (when set) says whether a post is refused as
    throttled, 429 ``LimitExceededException``."""

    def __init__(self, clock: Clock | None = None) -> None:
        super().__init__(client=_Management(self), clock=clock)
        self.sent: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self.closed: list[str] = []
        self.gone: set[str] = set()
        self.throttle: Callable[[str, dict[str, Any]], bool] | None = None
        #: posts refused as throttled, by connection
        self.refused: Counter[str] = Counter()


class _Management:
    """The management API's calls as API Gateway answers them, recorded on ``owner``."""

    def __init__(self, owner: RecordingConnections) -> None:
        self.owner = owner

    def post_to_connection(self, ConnectionId: str, Data: bytes) -> None:
        owner = self.owner
        if ConnectionId in owner.gone:
            raise _error("GoneException", 410)
        data = json.loads(Data)
        if owner.throttle is not None and owner.throttle(ConnectionId, data):
            owner.refused[ConnectionId] += 1
            raise _error("LimitExceededException", 429)
        # every frame the service sends fits its schema
        _MODELS[data["action"]].model_validate(data)
        owner.sent[ConnectionId].append(data)

    def delete_connection(self, ConnectionId: str) -> None:
        if ConnectionId in self.owner.gone:
            raise _error("GoneException", 410)
        self.owner.closed.append(ConnectionId)
        self.owner.gone.add(ConnectionId)


def _error(code: str, status: int) -> ClientError:
    answer: Any = {
        "Error": {"Code": code, "Message": code},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    return ClientError(answer, "PostToConnection")


class Edge:
    """The edge's routes over moto, with the push queue drained by the pusher's worker after
    every routed batch and every frame, as Lambda's mapping on the queue would take it: a
    test sees what a connected client would have been sent by then."""

    def __init__(self, world: World, monkeypatch: pytest.MonkeyPatch) -> None:
        self.world = world
        config = get_config()
        self.api = RecordingConnections(world.clock)
        self.connections = ConnectionStore(
            Dynamo(world.session.client("dynamodb")), config.table("connections"), world.clock
        )
        self.queue = PushQueue(
            world.session.client("sqs"), config.queues["push"], config.push.lanes, world.clock
        )
        self.worker = PushWorker(
            self.connections, self.api, world.delivery, self.queue, world.clock
        )
        # Lambda's mapping of the pusher on the push queue, as the stack declares it
        self.pushers = QueueMappings(world.session, lambda _name, event: self.worker.handle(event))
        names = LocalNames.for_deployment()
        self.mapping = QueueMapping(
            uuid="pusher",
            function_arn=names.functions["pusher"],
            queue_arn=names.queue_arn("push"),
            batch_size=PUSHER_MAPPING["BatchSize"],
            concurrency=1,
            report_item_failures=True,
            enabled=True,
        )
        publish = world.harness.publish
        self.service = EdgeService(
            world.registry,
            world.subscriptions,
            publish,
            delivery=world.delivery,
            connections=self.connections,
            api=self.api,
            queue=self.queue,
            settings=world.settings,
            clock=world.clock,
        )
        # the router hands its connected sessions' pushes to the queue after its writes
        router = router_app.router()
        monkeypatch.setattr(router, "queue", self.queue)
        monkeypatch.setattr(router, "connections", self.connections)
        route = world.route

        def routed_then_pushed() -> int:
            routed = route()
            self.push()
            return routed

        monkeypatch.setattr(world, "route", routed_then_pushed)

    def push(self) -> int:
        """The pusher over everything the queue holds now; the chunks it finished."""
        return self.pushers.drain_mapping(self.mapping)

    def event(self, name: str, connection: str, **context: Any) -> dict[str, Any]:
        event = load_event(name)
        event["requestContext"]["connectionId"] = connection
        event["requestContext"]["requestTimeEpoch"] = self.world.clock.now_ms()
        event["requestContext"].update(context)
        return event

    def send(self, connection: str, frame: dict[str, Any] | str, **context: Any) -> Any:
        """One client frame, then the pushes it handed over; the route response's frame (None
        when it sent none)."""
        event = self.event("edge_frame.json", connection, **context)
        event["body"] = frame if isinstance(frame, str) else json.dumps(frame)
        event["requestContext"]["routeKey"] = (
            frame.get("action", "$default") if isinstance(frame, dict) else "$default"
        )
        answer = handle(lambda: self.service, event)
        assert answer["statusCode"] == 200
        self.push()
        return json.loads(answer["body"]) if "body" in answer else None

    def connect(self, connection: str, client_id: str = "alice-1", **fields: Any) -> dict[str, Any]:
        # a connect's version is its request time: two in one millisecond are ordered by their
        # random part (either may be the newer), so a test's connects come a millisecond apart
        self.world.clock.advance(0.001)
        fields.setdefault("clean_start", False)
        fields.setdefault("session_expiry_s", 3600)
        answer = self.send(connection, {"action": "connect", "client_id": client_id, **fields})
        assert answer is None, answer
        connected = self.api.sent[connection][0]
        assert connected["action"] == "connected", connected
        return connected

    def dropped(self, connection: str, **context: Any) -> None:
        """The connection is gone without a disconnect frame: ``$disconnect`` (its event's
        time is now unless ``requestTimeEpoch`` says when the connection went)."""
        self.api.gone.add(connection)
        handle(lambda: self.service, self.event("edge_disconnect.json", connection, **context))
        self.push()

    def messages(self, connection: str) -> list[dict[str, Any]]:
        """The deliveries the connection was sent, once the queue's pushes are done."""
        self.push()
        return [f for f in self.api.sent[connection] if f["action"] == "message"]

    def sweep(self) -> SweepReport:
        """The reaper's sweep of pushed deliveries past their ack timeout, and its pushes."""
        report = PushSweep(
            self.connections, self.world.delivery, self.queue, self.world.clock
        ).sweep()
        self.push()
        return report

    def push_again(self, connection: str) -> None:
        """A push of the connection's session handed over (as a trigger would) and run."""
        found = self.connections.connection(connection)
        assert found is not None
        self.queue.hand_off([found.session_id])
        self.push()


def fail_first_get(edge: Edge, monkeypatch: pytest.MonkeyPatch, why: str) -> None:
    """The pusher's next get raises ``ServerBusy`` (a contended group lane, a throttled
    call), and a returned chunk is visible again at once (its jittered delay drawn as 0)."""
    real = edge.worker._get
    calls = {"n": 0}

    def failing_once(*args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        calls["n"] += 1
        if calls["n"] == 1:
            raise ServerBusy(why)
        return real(*args, **kwargs)

    monkeypatch.setattr(edge.worker, "_get", failing_once)
    monkeypatch.setattr(push_module, "backoff_s", lambda *_: 0.0)


def texts(frames: list[dict[str, Any]]) -> list[str]:
    return [base64.b64decode(f["payload"]).decode() for f in frames]


def away_while_published(edge: Edge, text: str) -> None:
    """``c1`` connects, subscribes to ``a/#`` (QoS 1) and is dropped; then ``text`` is
    published and routed: a message waits in the session's inbox for its next connect."""
    edge.connect("c1")
    edge.send("c1", {"action": "subscribe", "subscriptions": [{"filter": "a/#", "qos": 1}]})
    edge.dropped("c1")
    edge.world.publish("a/b", text)
    edge.world.route()


def answered_first(edge: Edge, connection: str, waiting: str) -> None:
    """The connection's first frame is its connect's (or renewal's) answer, the delivery that
    waited comes after it, and the connection is ready: the next message goes out at once."""
    frames = edge.api.sent[connection]
    assert [f["action"] for f in frames] == ["connected", "message"]
    assert texts(frames[1:]) == [waiting]
    edge.world.publish("a/b", "next")
    edge.world.route()
    assert texts(edge.messages(connection)) == [waiting, "next"]


@pytest.fixture
def edge(aws: boto3.Session, monkeypatch: pytest.MonkeyPatch) -> Iterator[Edge]:
    world = World(aws, monkeypatch)
    world.topic("default")
    yield Edge(world, monkeypatch)


# --- connect


def test_connect_answers_the_session_and_the_window(edge: Edge) -> None:
    connected = edge.connect("c1", ref="r1", receive_maximum=5)
    assert connected["ref"] == "r1"
    assert connected["session_present"] is False
    assert connected["receive_maximum"] == 5
    # the connection's liveness replaces the keepalive
    assert connected["keepalive_s"] == 0
    # a larger Receive Maximum than the service's window gets the service's
    other = edge.connect("c2", client_id="alice-2", receive_maximum=65_535)
    assert other["receive_maximum"] == edge.world.settings.window


def test_a_frame_before_connect_is_refused_with_a_code(edge: Edge) -> None:
    answer = edge.send(
        "c1", {"action": "subscribe", "ref": "s", "subscriptions": [{"filter": "a"}]}
    )
    assert answer["action"] == "error"
    assert answer["ref"] == "s"
    assert answer["error"]["code"] == "not_connected"
    assert answer["status"] == 409


def test_a_second_connect_on_one_connection_is_refused(edge: Edge) -> None:
    edge.connect("c1")
    answer = edge.send("c1", {"action": "connect", "client_id": "alice-1"})
    assert answer["error"]["code"] == "already_connected"


def test_connect_as_a_client_id_the_token_does_not_allow_is_forbidden(edge: Edge) -> None:
    answer = edge.send("c1", {"action": "connect", "client_id": "bob-1", "ref": "x"})
    assert answer["status"] == 403
    assert answer["error"]["code"] == "forbidden"
    assert answer["ref"] == "x"
    assert edge.connections.connection("c1") is None


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ("not json", "malformed_json"),
        ("[1, 2]", "invalid_request"),
        ('{"action": "shout"}', "unknown_action"),
        ('{"action": "connect", "client_id": "alice-1", "receive_maximum": 0}', "invalid_request"),
        ('{"action": "ack", "ids": "x"}', "invalid_request"),
    ],
)
def test_bad_frames_get_the_http_apis_codes(edge: Edge, body: str, code: str) -> None:
    answer = edge.send("c1", body)
    assert answer["action"] == "error"
    assert answer["error"]["code"] == code
    assert 400 <= answer["status"] < 500


# --- pushed delivery


def test_a_connected_session_is_pushed_its_messages_and_an_ack_ends_them(edge: Edge) -> None:
    edge.connect("c1")
    edge.send(
        "c1", {"action": "subscribe", "ref": "s1", "subscriptions": [{"filter": "a/#", "qos": 1}]}
    )
    assert edge.api.sent["c1"][1] == {"action": "subscribed", "ref": "s1", "granted": [1]}
    for n in range(3):
        edge.world.publish("a/b", f"m{n}")
    edge.world.route()
    pushed = edge.messages("c1")
    assert texts(pushed) == ["m0", "m1", "m2"]
    assert not any(f["dup"] for f in pushed)
    edge.send("c1", {"action": "ack", "ref": "a1", "ids": [f["id"] for f in pushed]})
    assert {"action": "acked", "ref": "a1", "acked": 3} in edge.api.sent["c1"]
    # an acked id never comes again, after the ack timeout either
    edge.world.clock.advance(edge.world.settings.ack_timeout_s + 1)
    edge.push_again("c1")
    assert len(edge.messages("c1")) == 3


def test_an_ack_without_a_ref_is_answered_with_nothing_and_still_acks(edge: Edge) -> None:
    edge.connect("c1", receive_maximum=1)
    edge.send("c1", {"action": "subscribe", "subscriptions": [{"filter": "a/#", "qos": 1}]})
    for n in range(2):
        edge.world.publish("a/b", f"m{n}")
    edge.world.route()
    [first] = edge.messages("c1")
    before = len(edge.api.sent["c1"])
    # an ack without a ref: no acked frame (MQTT 5 §3.4, a PUBACK is not answered) ...
    assert edge.send("c1", {"action": "ack", "ids": [first["id"]]}) is None
    after = edge.api.sent["c1"][before:]
    assert [f["action"] for f in after] == ["message"]
    # ... yet the window opened (the next message pushed) and the id is acked for good
    assert texts(after) == ["m1"]
    edge.world.clock.advance(edge.world.settings.ack_timeout_s + 1)
    edge.push_again("c1")
    assert [f["id"] for f in edge.messages("c1")].count(first["id"]) == 1


def test_the_window_holds_deliveries_until_acks_open_it(edge: Edge) -> None:
    edge.connect("c1", receive_maximum=2)
    edge.send("c1", {"action": "subscribe", "subscriptions": [{"filter": "a/#", "qos": 1}]})
    for n in range(5):
        edge.world.publish("a/b", f"m{n}")
    edge.world.route()
    assert texts(edge.messages("c1")) == ["m0", "m1"]
    edge.send("c1", {"action": "ack", "ids": [edge.messages("c1")[0]["id"]]})
    assert texts(edge.messages("c1")) == ["m0", "m1", "m2"]
    edge.send("c1", {"action": "ack", "ids": [f["id"] for f in edge.messages("c1")]})
    assert texts(edge.messages("c1")) == ["m0", "m1", "m2", "m3", "m4"]


def test_unacked_messages_come_again_with_dup_after_the_ack_timeout(edge: Edge) -> None:
    edge.connect("c1")
    edge.send("c1", {"action": "subscribe", "subscriptions": [{"filter": "a/#", "qos": 1}]})
    edge.world.publish("a/b", "once")
    edge.world.route()
    first = edge.messages("c1")
    assert [f["dup"] for f in first] == [False]
    edge.world.clock.advance(edge.world.settings.ack_timeout_s + 1)
    # the next trigger of a push (here another message routed) sends it again first
    edge.world.publish("a/b", "twice")
    edge.world.route()
    frames = edge.messages("c1")
    assert texts(frames) == ["once", "once", "twice"]
    assert [f["dup"] for f in frames] == [False, True, False]
    assert frames[0]["id"] == frames[1]["id"]


def _session_of(edge: Edge, connection: str) -> str:
    found = edge.connections.connection(connection)
    assert found is not None
    return found.session_id


def test_the_sweep_pushes_again_with_dup_what_passed_its_ack_timeout(edge: Edge) -> None:
    edge.connect("c1")
    edge.send("c1", {"action": "subscribe", "subscriptions": [{"filter": "a/#", "qos": 1}]})
    edge.world.publish("a/b", "once")
    edge.world.route()
    assert [f["dup"] for f in edge.messages("c1")] == [False]
    # before the ack timeout the sweep finds nothing due
    assert edge.sweep().swept == 0
    edge.world.clock.advance(edge.world.settings.ack_timeout_s + 1)
    # no other trigger: the reaper's sweep alone sends it again
    report = edge.sweep()
    assert (report.swept, report.pushed, report.armed) == (1, 1, 1)
    frames = edge.messages("c1")
    assert [f["dup"] for f in frames] == [False, True]
    assert frames[0]["id"] == frames[1]["id"]
    edge.send("c1", {"action": "ack", "ids": [frames[1]["id"]]})
    edge.world.clock.advance(edge.world.settings.ack_timeout_s + 1)
    # acked: found due once more, then off the index; never sent again
    assert edge.sweep().pushed == 0
    assert edge.sweep().swept == 0
    assert len(edge.messages("c1")) == 2


def test_a_session_that_acked_in_time_costs_the_sweep_one_look(edge: Edge) -> None:
    edge.connect("c1")
    edge.send("c1", {"action": "subscribe", "subscriptions": [{"filter": "a/#", "qos": 1}]})
    edge.world.publish("a/b", "m")
    edge.world.route()
    edge.send("c1", {"action": "ack", "ids": [f["id"] for f in edge.messages("c1")]})
    edge.world.clock.advance(edge.world.settings.ack_timeout_s + 1)
    report = edge.sweep()
    assert (report.swept, report.pushed, report.armed) == (1, 0, 0)
    assert edge.sweep().swept == 0


def test_the_sweep_arms_the_next_deadline_of_later_deliveries(edge: Edge) -> None:
    timeout = edge.world.settings.ack_timeout_s
    edge.connect("c1")
    edge.send("c1", {"action": "subscribe", "subscriptions": [{"filter": "a/#", "qos": 1}]})
    edge.world.publish("a/b", "early")
    edge.world.route()
    edge.world.clock.advance(timeout / 2)
    edge.world.publish("a/b", "late")
    edge.world.route()
    early = edge.messages("c1")[0]
    edge.send("c1", {"action": "ack", "ids": [early["id"]]})
    # the first deadline (early's) passes: early was acked, late is not due yet
    edge.world.clock.advance(timeout / 2 + 0.5)
    assert (edge.sweep().pushed, len(edge.messages("c1"))) == (0, 2)
    edge.world.clock.advance(timeout / 2 + 0.5)
    assert edge.sweep().pushed == 1
    assert texts(edge.messages("c1")) == ["early", "late", "late"]
    assert edge.messages("c1")[-1]["dup"] is True


def test_a_taken_over_sessions_due_item_is_not_pushed_to_the_old_connection(edge: Edge) -> None:
    edge.connect("c1")
    edge.send("c1", {"action": "subscribe", "subscriptions": [{"filter": "a/#", "qos": 1}]})
    edge.world.publish("a/b", "m")
    edge.world.route()
    edge.connect("c2")  # takes the session over: c1 is told and closed
    sent_before = len(edge.api.sent["c1"])
    # the newer connection got the unacked message again on its connect (dup)
    assert [(texts([f]), f["dup"]) for f in edge.messages("c2")] == [(["m"], True)]
    edge.world.clock.advance(edge.world.settings.ack_timeout_s + 1)
    assert edge.sweep().pushed == 1
    # still unacked after its timeout: again to the newer connection, never to the older
    assert len(edge.api.sent["c1"]) == sent_before
    assert [(texts([f]), f["dup"]) for f in edge.messages("c2")] == [(["m"], True)] * 2


def test_a_push_to_a_gone_connection_loses_nothing(edge: Edge) -> None:
    edge.connect("c1")
    edge.send("c1", {"action": "subscribe", "subscriptions": [{"filter": "a/#", "qos": 1}]})
    edge.api.gone.add("c1")  # gone, and $disconnect not come yet
    edge.world.publish("a/b", "kept")
    edge.world.route()
    assert edge.messages("c1") == []
    edge.dropped("c1")
    # the session resumes on a new connection: the message comes, as a redelivery
    connected = edge.connect("c2")
    assert connected["session_present"] is True
    frames = edge.messages("c2")
    assert texts(frames) == ["kept"]


def test_a_fan_out_is_pushed_side_by_side_each_session_in_order(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One router batch for many connected sessions pushes them on several threads (each
    push waits on its round trips); every session still gets each message once, in order."""
    threads: dict[str, set[str]] = defaultdict(set)
    post = edge.api.post

    def recording(connection_id: str, frame: str) -> None:
        threads[connection_id].add(threading.current_thread().name)
        # a post's round trip: the pushes of one batch wait side by side
        time.sleep(0.02)
        post(connection_id, frame)

    monkeypatch.setattr(edge.api, "post", recording)
    connections = [f"c{n}" for n in range(12)]
    for n, connection in enumerate(connections):
        edge.connect(connection, client_id=f"alice-{n}")
        edge.send(
            connection, {"action": "subscribe", "subscriptions": [{"filter": "a/#", "qos": 1}]}
        )
    for n in range(3):
        edge.world.publish("a/b", f"m{n}")
    edge.world.route()
    for connection in connections:
        assert texts(edge.messages(connection)) == ["m0", "m1", "m2"], connection
    pushers = {name for connection in connections for name in threads[connection]}
    assert len({name for name in pushers if name.startswith("shoal-push")}) > 1, pushers


def test_a_push_stopped_by_an_error_returns_its_chunk_and_its_retry_pushes(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A push that stops early (a contended group lane, a throttled call) returns its chunk
    to the queue, after a jittered delay: its retry pushes what waits, with no other
    trigger, once."""
    edge.connect("c1")
    edge.send("c1", {"action": "subscribe", "subscriptions": [{"filter": "a/#", "qos": 1}]})
    fail_first_get(edge, monkeypatch, "this group stream is contended; retry")
    answers: list[dict[str, Any]] = []
    real = edge.worker.handle

    def recording(event: Any) -> dict[str, Any]:
        answers.append(real(event))
        return answers[-1]

    monkeypatch.setattr(edge.worker, "handle", recording)
    edge.world.publish("a/b", "first")
    edge.world.route()
    # the first attempt returned its chunk; the second (its delay drawn as 0 here) pushed it
    assert [len(a["batchItemFailures"]) for a in answers] == [1, 0]
    assert texts(edge.messages("c1")) == ["first"]


def test_the_routers_push_fills_deliveries_from_the_lines_its_batch_wrote(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The router holds the archive lines its batch has just written: its pushes hand the
    deliveries that name them out without reading the archive back (a ranged GET per pushed
    session and batch, each one more call behind the emulator's lock)."""
    payloads = edge.world.delivery.payloads
    assert payloads is not None
    reads: list[str] = []
    real = payloads.s3.get_object

    def counting(**request: Any) -> Any:
        reads.append(request["Key"])
        return real(**request)

    monkeypatch.setattr(payloads.s3, "get_object", counting)
    connections = [f"c{n}" for n in range(3)]
    for n, connection in enumerate(connections):
        edge.connect(connection, client_id=f"alice-{n}")
        edge.send(
            connection, {"action": "subscribe", "subscriptions": [{"filter": "a/#", "qos": 1}]}
        )
    for n in range(2):
        edge.world.publish("a/b", f"m{n}")
    edge.world.route()
    for connection in connections:
        assert texts(edge.messages(connection)) == ["m0", "m1"], connection
    assert reads == []
    # a redelivery (no router batch behind it) still reads its lines from the archive
    edge.world.clock.advance(edge.world.settings.ack_timeout_s + 1)
    assert edge.sweep().pushed == 3
    assert texts(edge.messages("c0")) == ["m0", "m1", "m0", "m1"]
    assert reads


def test_the_routers_push_looks_for_new_deliveries_where_its_batch_wrote_them(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session's inbox keeps consumed items until TTL, so a get walks from the partition's
    first item and jumps to each source's cursor (a query each). The router's push knows the
    source it just wrote to: its get reads from that source's cursor, one query; and when the
    router container wrote the session's previous delivery of the source too (and everything
    of the source since), the push hands out the items it carries without reading at all. So
    does the first message of a source never written (its ledger empty): no inbox holds an
    item of it."""
    edge.connect("c1")
    edge.send("c1", {"action": "subscribe", "subscriptions": [{"filter": "a/#", "qos": 1}]})
    queries = _counted_queries(edge, monkeypatch)
    # the first message of the source: nothing of it was written before, anywhere
    edge.world.publish("a/b", "m0")
    edge.world.route()
    assert texts(edge.messages("c1")) == ["m0"]
    assert queries == []
    edge.send("c1", {"action": "ack", "ids": [f["id"] for f in edge.messages("c1")]})
    # the next: the push takes what the router wrote, no query
    edge.world.publish("a/b", "m1")
    edge.world.route()
    assert texts(edge.messages("c1")) == ["m0", "m1"]
    assert queries == []
    # and after the router container's memory is lost (another container), one query
    router_app.router().fanout._written.clear()
    edge.world.publish("a/b", "m2")
    edge.world.route()
    assert texts(edge.messages("c1")) == ["m0", "m1", "m2"]
    assert len(queries) == 1, queries


def test_the_routers_push_posts_to_the_connections_the_router_read_without_reading_them(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A router batch reaching a few sessions reads which are connected (strongly consistent,
    after its writes) and hands their connections to the pusher with the work, which posts
    to them without reading them again: one read of the connections a push, not two."""
    sessions = {_subscribed(edge, c) for c in ("c1", "c2")}
    read: list[str] = []

    class Counted:
        """The pusher's connection store (the router's is the same store, not counted)."""

        def __getattr__(self, name: str) -> Any:
            return getattr(edge.connections, name)

        def targets(self, session_ids: Any) -> Any:
            asked = list(session_ids)
            read.extend(asked)
            return edge.connections.targets(asked)

    monkeypatch.setattr(edge.worker, "connections", Counted())
    # When a message to both is routed
    edge.world.publish("a/b", "m1")
    edge.world.route()
    # Then both got it, and the pusher read neither connection
    assert texts(edge.messages("c1")) == ["m1"] and texts(edge.messages("c2")) == ["m1"]
    assert read == []
    # and a push the router did not hand over (a connect's own) reads its session's
    edge.connect("c3", "alice-c1")
    assert texts(edge.messages("c3")) == ["m1"]
    assert read and set(read) <= sessions, read


def _counted_queries(edge: Edge, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The sessions whose inbox a get queries for new items, from now on."""
    inbox = edge.world.delivery.inbox
    queries: list[str] = []
    real = inbox.after

    def counting(session_id: str, key: str, **kw: Any) -> Any:
        queries.append(session_id)
        return real(session_id, key, **kw)

    monkeypatch.setattr(inbox, "after", counting)
    return queries


def _subscribed(edge: Edge, connection: str) -> str:
    """Connects client ``alice-<connection>`` on ``connection``, subscribed to ``a/#``; its
    session id."""
    edge.connect(connection, f"alice-{connection}")
    subscribe = {"action": "subscribe", "subscriptions": [{"filter": "a/#", "qos": 1}]}
    edge.send(connection, subscribe)
    head = edge.world.registry.repository.head(f"alice-{connection}")
    assert head is not None and head.session_id is not None
    return head.session_id


def test_a_session_new_to_a_source_takes_its_first_items_unread_only_where_it_is_safe(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session the router container never wrote an item of the source for has none, if the
    container wrote the source since its ledger was empty and still remembers every session
    it wrote: its first push takes what the router carries. Once the container forgot (its
    memory past ``MAX_REMEMBERED``, or a new container), such a session's push reads."""
    monkeypatch.setattr(fanout_module, "MAX_REMEMBERED", 3)
    for connection in ("c1", "c2", "c3"):
        _subscribed(edge, connection)
    edge.world.publish("a/b", "m0")
    edge.world.route()
    # Given a session that subscribes after the source's first batch
    late = _subscribed(edge, "c4")
    queries = _counted_queries(edge, monkeypatch)
    edge.world.publish("a/b", "m1")
    edge.world.route()
    # Then its first push reads nothing, and it gets m1 (its subscription starts after m0)
    assert texts(edge.messages("c4")) == ["m1"]
    assert queries == []
    # Given one more session new to the source: m2's batch still finds the memory whole
    newest = _subscribed(edge, "c5")
    queries.clear()  # the subscribe's own look for what the session holds
    edge.world.publish("a/b", "m2")
    edge.world.route()
    assert texts(edge.messages("c5")) == ["m2"]
    assert queries == [], (late, newest, queries)
    # When the memory overflowed at m2's batch (five sessions past three: forgotten, and
    # remembered anew from that batch on), a session new to the source since
    last = _subscribed(edge, "c6")
    queries.clear()
    edge.world.publish("a/b", "m3")
    edge.world.route()
    # Then its push reads its items back; the sessions remembered still take theirs unread
    assert texts(edge.messages("c6")) == ["m3"]
    assert queries == [last], (late, newest, queries)
    for connection in ("c1", "c2", "c3"):
        assert texts(edge.messages(connection)) == ["m0", "m1", "m2", "m3"]


def _handed_off(edge: Edge, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The sessions whose pushes are handed to the queue from now on, one entry a hand-off."""
    taken: list[str] = []
    real = edge.queue.hand_off

    def counting(sessions: Any, **kwargs: Any) -> int:
        taken.extend(sessions)
        return real(sessions, **kwargs)

    monkeypatch.setattr(edge.queue, "hand_off", counting)
    return taken


def test_an_ack_that_opens_no_room_for_waiting_deliveries_pushes_nothing(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A push hands out everything it finds within the window, so deliveries wait only
    behind a full one: an ack of a session whose window was not full would hand over a push
    that finds nothing (a queue message, an invocation, two reads). The next message is
    pushed by its own router write."""
    edge.connect("c1", receive_maximum=5)
    edge.send("c1", {"action": "subscribe", "subscriptions": [{"filter": "a/#", "qos": 1}]})
    edge.world.publish("a/b", "m0")
    edge.world.route()
    taken = _handed_off(edge, monkeypatch)
    [first] = edge.messages("c1")
    edge.send("c1", {"action": "ack", "ref": "a1", "ids": [first["id"]]})
    assert {"action": "acked", "ref": "a1", "acked": 1} in edge.api.sent["c1"]
    assert edge.send("c1", {"action": "ack", "ids": [first["id"]]}) is None
    assert taken == []
    edge.world.publish("a/b", "m1")
    edge.world.route()
    assert texts(edge.messages("c1")) == ["m0", "m1"]
    assert len(taken) == 1


def test_an_ack_that_opens_a_full_window_pushes_what_waits(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    edge.connect("c1", receive_maximum=2)
    edge.send("c1", {"action": "subscribe", "subscriptions": [{"filter": "a/#", "qos": 1}]})
    for n in range(3):
        edge.world.publish("a/b", f"m{n}")
    edge.world.route()
    assert texts(edge.messages("c1")) == ["m0", "m1"]
    taken = _handed_off(edge, monkeypatch)
    edge.send("c1", {"action": "ack", "ref": "a1", "ids": [edge.messages("c1")[1]["id"]]})
    assert texts(edge.messages("c1")) == ["m0", "m1", "m2"]
    # m0 and m2 fill the window again: the next ack pushes (nothing is left)
    edge.send("c1", {"action": "ack", "ref": "a2", "ids": [edge.messages("c1")[0]["id"]]})
    assert len(taken) == 2
    # the window was not full: this ack has nothing to let out
    edge.send("c1", {"action": "ack", "ref": "a3", "ids": [edge.messages("c1")[2]["id"]]})
    assert len(taken) == 2
    assert texts(edge.messages("c1")) == ["m0", "m1", "m2"]


def test_a_pusher_that_dies_before_posting_leaves_what_it_handed_out_timed(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pusher that died after its get wrote the state and before it posted: its chunk comes
    back (its visibility timeout run out) and finds nothing new; what the dead attempt handed
    out was armed before any post, so the sweep sends it after its ack timeout, with ``dup``,
    in order, once."""
    edge.connect("c1", receive_maximum=5)
    edge.send("c1", {"action": "subscribe", "subscriptions": [{"filter": "a/#", "qos": 1}]})
    real_post = edge.worker._post
    calls = {"n": 0}

    def dies_before_posting(push: Any, messages: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("the worker died")
        real_post(push, messages)

    monkeypatch.setattr(edge.worker, "_post", dies_before_posting)
    chunks_visible_again_at_once(edge)
    for n in range(2):
        edge.world.publish("a/b", f"m{n}")
    edge.world.route()
    assert edge.messages("c1") == []
    edge.world.clock.advance(edge.world.settings.ack_timeout_s + 1)
    assert edge.sweep().pushed == 1
    frames = edge.messages("c1")
    assert texts(frames) == ["m0", "m1"]
    assert [f["dup"] for f in frames] == [True, True]


def test_qos0_is_pushed_at_most_once(edge: Edge) -> None:
    edge.connect("c1", receive_maximum=1)
    edge.send("c1", {"action": "subscribe", "subscriptions": [{"filter": "a/#", "qos": 0}]})
    for n in range(3):
        edge.world.publish("a/b", f"q{n}", qos=0)
    edge.world.route()
    # QoS 0 takes no room in the window, and never comes again
    assert texts(edge.messages("c1")) == ["q0", "q1", "q2"]
    edge.world.clock.advance(edge.world.settings.ack_timeout_s + 1)
    edge.world.publish("a/b", "q3", qos=0)
    edge.world.route()
    assert texts(edge.messages("c1")) == ["q0", "q1", "q2", "q3"]


def test_qos0_to_a_connected_session_is_posted_and_forgotten_without_state(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A QoS 0 delivery to a session the router finds connected is written nowhere: no inbox
    item, no delivery-state write; posted once, never again (not after the ack timeout, not on
    a reconnect). MQTT 5 §4.3.1: at most once."""
    edge.connect("c1")
    edge.send("c1", {"action": "subscribe", "subscriptions": [{"filter": "a/#", "qos": 0}]})
    session = _session_of(edge, "c1")
    writes: list[tuple[str, Any]] = []
    real = Dynamo.call

    def recording(self: Dynamo, operation: str, **request: Any) -> Any:
        if operation in ("put_item", "update_item", "batch_write_item", "transact_write_items"):
            writes.append((operation, json.dumps(request, default=str)))
        return real(self, operation, **request)

    monkeypatch.setattr(Dynamo, "call", recording)
    for n in range(3):
        edge.world.publish("a/b", f"q{n}", qos=0)
    edge.world.route()
    frames = edge.messages("c1")
    assert texts(frames) == ["q0", "q1", "q2"]
    assert {f["qos"] for f in frames} == {0}
    # no write names the session: neither an inbox item nor its delivery state
    assert not [w for w in writes if session in w[1]], writes
    # and nothing brings them again: an ack of them acks nothing, the timeout, a reconnect
    assert edge.send("c1", {"action": "ack", "ref": "a", "ids": [f["id"] for f in frames]}) is None
    assert {"action": "acked", "ref": "a", "acked": 0} in edge.api.sent["c1"]
    edge.world.clock.advance(edge.world.settings.ack_timeout_s + 1)
    edge.sweep()
    edge.connect("c2")
    assert texts(edge.messages("c1")) == ["q0", "q1", "q2"] and edge.messages("c2") == []


def test_qos0_to_an_offline_session_waits_in_its_inbox(edge: Edge) -> None:
    """An offline session's QoS 0 messages are kept as today (MQTT 5 §4.1 lets a server keep
    them) and go out on its next connect."""
    edge.connect("c1")
    edge.send("c1", {"action": "subscribe", "subscriptions": [{"filter": "a/#", "qos": 0}]})
    edge.dropped("c1")
    edge.world.publish("a/b", "kept", qos=0)
    edge.world.route()
    edge.connect("c2")
    assert texts(edge.messages("c2")) == ["kept"]


# --- publish


def test_publish_over_the_connection_is_exactly_once(edge: Edge) -> None:
    edge.connect("c1")
    frame: dict[str, Any] = {"action": "publish", "ref": "p1", "topic": "a/b", "text": "x"}
    frame |= {"publisher_id": "dev-1", "publisher_seq": 1}
    first = edge.send("c1", frame)
    assert first["action"] == "published"
    assert first["ref"] == "p1"
    assert first["duplicate"] is False
    again = edge.send("c1", frame)
    assert again["duplicate"] is True
    assert again["message_id"] == first["message_id"]
    gap = edge.send("c1", frame | {"publisher_seq": 5})
    assert gap["error"]["code"] == "publisher_seq_gap"


# --- takeover, disconnect and wills


def test_a_newer_connect_takes_the_session_over_and_closes_the_older_connection(
    edge: Edge,
) -> None:
    edge.connect("c1")
    edge.connect("c2")
    assert {"action": "disconnect", "reason": "session_taken_over"} in edge.api.sent["c1"]
    assert edge.api.closed == ["c1"]
    # the older connection's frames are refused from now on
    answer = edge.send("c1", {"action": "subscribe", "subscriptions": [{"filter": "a"}]})
    assert answer["action"] == "error"
    # its $disconnect, when it comes, leaves the newer channel alone
    edge.dropped("c1")
    later = edge.send("c2", {"action": "subscribe", "subscriptions": [{"filter": "a/#"}]})
    assert later is None
    assert edge.api.sent["c2"][-1]["action"] == "subscribed"


def test_a_connection_a_push_found_gone_still_publishes_its_will(edge: Edge) -> None:
    """A push that meets a closed connection (410) stops pushes to it; its $disconnect, when it
    comes, loses the channel as for any other lost connection, and the will follows after
    its delay (before, the push removed the connection's item and $disconnect found nothing
    to lose: the will waited for the channel's 2-hour bound)."""
    edge.connect("c1", will=WILL)
    edge.send("c1", {"action": "subscribe", "subscriptions": [{"filter": "a/#", "qos": 1}]})
    edge.api.gone.add("c1")
    edge.world.publish("a/b", "kept")
    edge.world.route()
    # no more pushes to it
    assert edge.connections.target(_session_of(edge, "c1")) is None
    edge.dropped("c1")
    assert_will_follows_its_delay(edge)


def test_a_taken_over_connections_disconnect_writes_only_its_own_items(edge: Edge) -> None:
    """A connect on a new connection takes the session over (a client that connects again
    rather than renew): the older connection's $disconnect comes after the takeover. It
    deletes the connection's items and leaves the registry's head alone: its channel is not
    the live one, and a conditional write that fails would still be billed. Its only registry
    write settles the will the takeover held for this close (``closed_after_takeover``): it
    closed after the takeover, so the will is dropped."""
    edge.connect("c1", will=WILL)
    edge.connect("c2")
    writes: list[str] = []

    def record(model: Any, params: dict[str, Any], **_: Any) -> None:
        if model.name in ("UpdateItem", "PutItem", "DeleteItem", "TransactWriteItems"):
            writes.append(f"{model.name} {params.get('TableName', 'transaction')}")

    client = edge.world.registry.repository.dynamo.client
    client.meta.events.register("before-parameter-build.dynamodb.*", record)
    connections = edge.connections.dynamo.client
    if connections is not client:
        connections.meta.events.register("before-parameter-build.dynamodb.*", record)
    edge.dropped("c1")
    table = get_config().table("connections")
    sessions = get_config().table("sessions")
    # the session's item, the held will, then the connection's own item (last: a crash
    # before it leaves the $disconnect something to run again)
    assert writes == [f"DeleteItem {table}", f"DeleteItem {sessions}", f"DeleteItem {table}"]
    # the session stays with the newer connection: no will, deliveries pushed there
    reaper, publisher = _reaper(edge)
    edge.world.clock.advance(6)
    reaper.run()
    assert publisher.published == []
    edge.send("c2", {"action": "subscribe", "subscriptions": [{"filter": "a/#", "qos": 1}]})
    edge.world.publish("a/b", "after")
    edge.world.route()
    assert texts(edge.messages("c2")) == ["after"]


def test_unsubscribe_answers_each_filter_as_the_http_api(edge: Edge) -> None:
    """MQTT 5's UNSUBACK (§3.11.2.2): a reason per filter, in order (it answered 500 before:
    the frame's schema had another field than the service's answer)."""
    edge.connect("c1")
    edge.send("c1", {"action": "subscribe", "subscriptions": [{"filter": "a/#", "qos": 1}]})
    answer = edge.send("c1", {"action": "unsubscribe", "filters": ["a/#", "b/#"], "ref": "u"})
    assert answer == {
        "action": "unsubscribed",
        "ref": "u",
        "unsubscribed": ["success", "no_subscription_existed"],
    }
    edge.world.publish("a/b", "not for us")
    edge.world.route()
    assert edge.messages("c1") == []


# --- renewal: the client's own new connection before API Gateway's 2 hours


def _renew(edge: Edge, connection: str, channel: str, client_id: str = "alice-1") -> Any:
    frame = {"action": "renew", "client_id": client_id, "channel": channel, "ref": "r"}
    return edge.send(connection, frame)


def test_a_renewal_keeps_the_channel_and_what_is_in_flight_and_publishes_no_will(
    edge: Edge,
) -> None:
    """Unlike a ``connect`` that takes the session over (which publishes a will without a
    delay at once, MQTT 5 §3.1.2.5), a renewal moves the live channel: no will, nothing said
    to the older connection, the delivery in flight on it acked over the new one."""
    connected = edge.connect("c1", will=WILL | {"delay_s": 0})
    edge.send("c1", {"action": "subscribe", "subscriptions": [{"filter": "a/#", "qos": 1}]})
    edge.world.publish("a/b", "first")
    edge.world.route()
    [first] = edge.messages("c1")
    assert _renew(edge, "c2", connected["channel"]) is None
    assert edge.api.sent["c2"] == [
        {
            "action": "connected",
            "ref": "r",
            "session_present": True,
            "channel": connected["channel"],
            "keepalive_s": 0,
            "receive_maximum": connected["receive_maximum"],
        }
    ]
    # nothing in flight came again on the new connection, and the old one was told nothing
    assert edge.api.sent["c1"][-1] == first and edge.api.closed == []
    # the old connection holds nothing now: its frames are refused, its $disconnect is a no-op
    refused = edge.send("c1", {"action": "ack", "ids": [first["id"]], "ref": "x"})
    assert refused["error"]["code"] == "not_connected"
    edge.dropped("c1")
    acked = edge.send("c2", {"action": "ack", "ids": [first["id"]], "ref": "a"})
    assert acked is None and edge.api.sent["c2"][-1] == {"action": "acked", "ref": "a", "acked": 1}
    edge.world.publish("a/b", "second")
    edge.world.route()
    [second] = edge.messages("c2")
    assert texts([second]) == ["second"]
    edge.send("c2", {"action": "ack", "ids": [second["id"]]})
    # the next renewal, 7,000 s on; then 8,000 s after the connect, past the bound a channel
    # registers with (7,500 s): the renewal restarted it, so the reaper expires nothing
    edge.world.clock.advance(7000)
    assert _renew(edge, "c3", connected["channel"]) is None
    edge.world.clock.advance(1000)
    reaper, publisher = _reaper(edge)
    reaper.run()
    reaper.run()
    assert publisher.published == []
    assert edge.send("c3", {"action": "subscribe", "subscriptions": [{"filter": "x/#"}]}) is None


def test_nothing_is_pushed_to_a_renewed_connection_before_its_answer(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a connect's (MQTT 5 [MQTT-3.2.0-1]): a router's push that comes between the
    renewal's move and its answer finds the connection not ready; the renewal's own push
    sends what waits after its ``connected`` frame."""
    connected = edge.connect("c1")
    edge.send("c1", {"action": "subscribe", "subscriptions": [{"filter": "a/#", "qos": 1}]})
    real_keep = edge.service._keep
    raced: list[int] = []

    def keep_then_race(connection: Any, head: Any) -> None:
        real_keep(connection, head)
        if connection.connection_id == "c2":
            # a message routed right after the move, and the router's push of it
            edge.world.publish("a/b", "raced")
            edge.world.route()
            raced.append(len(edge.api.sent["c2"]))

    monkeypatch.setattr(edge.service, "_keep", keep_then_race)
    assert _renew(edge, "c2", connected["channel"]) is None
    assert raced == [0]
    answered_first(edge, "c2", "raced")


def test_a_push_under_way_when_a_renewal_moves_the_session_times_what_it_handed_out(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A push to the older connection is under way when the renewal moves the session: what
    it handed out is in flight for the same channel, and the push arms its redelivery on the
    session's item (now the new connection's), so the sweep sends it again over the new
    connection after its ack timeout."""
    connected = edge.connect("c1")
    edge.send("c1", {"action": "subscribe", "subscriptions": [{"filter": "a/#", "qos": 1}]})
    real_post = edge.api.post

    def renew_while_posting(connection_id: str, frame: str) -> None:
        real_post(connection_id, frame)
        if connection_id == "c1" and json.loads(frame)["action"] == "message":
            monkeypatch.setattr(edge.api, "post", real_post)
            assert _renew(edge, "c2", connected["channel"]) is None

    monkeypatch.setattr(edge.api, "post", renew_while_posting)
    edge.world.publish("a/b", "in flight")
    edge.world.route()
    assert texts(edge.messages("c1")) == ["in flight"]
    # the renewal found it in flight, not due: nothing more on the new connection yet
    assert [f["action"] for f in edge.api.sent["c2"]] == ["connected"]
    edge.world.clock.advance(edge.world.settings.ack_timeout_s + 1)
    assert edge.sweep().pushed == 1
    [again] = edge.messages("c2")
    assert texts([again]) == ["in flight"] and again["dup"] is True


def test_a_push_to_the_older_connection_gone_after_a_renewal_times_what_it_handed_out(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The older connection is closed while a push to it is under way, and the session was
    renewed meanwhile: what the push handed out is in flight for the same channel, so it
    comes again over the new connection after its ack timeout."""
    connected = edge.connect("c1")
    edge.send("c1", {"action": "subscribe", "subscriptions": [{"filter": "a/#", "qos": 1}]})
    real_post = edge.api.post

    def renewed_then_gone(connection_id: str, frame: str) -> None:
        if connection_id == "c1" and json.loads(frame)["action"] == "message":
            monkeypatch.setattr(edge.api, "post", real_post)
            assert _renew(edge, "c2", connected["channel"]) is None
            edge.api.gone.add("c1")
        real_post(connection_id, frame)

    monkeypatch.setattr(edge.api, "post", renewed_then_gone)
    edge.world.publish("a/b", "lost on the way")
    edge.world.route()
    assert edge.messages("c1") == [] and edge.messages("c2") == []
    edge.world.clock.advance(edge.world.settings.ack_timeout_s + 1)
    assert edge.sweep().pushed == 1
    [again] = edge.messages("c2")
    assert texts([again]) == ["lost on the way"] and again["dup"] is True


def test_a_renewal_after_the_connection_was_lost_is_refused_and_a_connect_resumes(
    edge: Edge,
) -> None:
    connected = edge.connect("c1", will=WILL)
    edge.dropped("c1")  # $disconnect came first: the channel is lost, the will waits its delay
    refused = _renew(edge, "c2", connected["channel"])
    assert (refused["status"], refused["error"]["code"]) == (409, "renew_refused")
    # the client connects instead: the session resumes within the will delay, no will
    again = edge.connect("c2")
    assert again["session_present"] is True and again["channel"] != connected["channel"]
    reaper, publisher = _reaper(edge)
    edge.world.clock.advance(6)
    reaper.run()
    assert publisher.published == []


def test_a_renewal_of_a_channel_taken_over_or_of_another_principal_is_refused(
    edge: Edge,
) -> None:
    first = edge.connect("c1")
    edge.connect("c2")  # takes the session over: c1's channel is not the live one
    refused = _renew(edge, "c3", first["channel"])
    assert refused["error"]["code"] == "renew_refused"
    live = edge.api.sent["c2"][0]["channel"]
    other = {"sub": "mallory", "clients": "alice-1"}
    forbidden = edge.send(
        "c4",
        {"action": "renew", "client_id": "alice-1", "channel": live, "ref": "m"},
        authorizer=other,
    )
    assert forbidden["status"] == 403
    # neither refusal moved the session: deliveries still go to c2
    edge.send("c2", {"action": "subscribe", "subscriptions": [{"filter": "a/#", "qos": 1}]})
    edge.world.publish("a/b", "kept")
    edge.world.route()
    assert texts(edge.messages("c2")) == ["kept"]
    assert edge.api.sent.get("c3", []) == [] or edge.messages("c3") == []


def test_a_renewal_writes_a_third_of_a_takeovers_units(edge: Edge) -> None:
    """What the renewal is for (bench/cost.py, "fleet"): one registry write, the channel
    recorded for the new connection (``connecting#``, for its ``$disconnect`` if the
    renewal dies halfway), the session's item moved (the push's lease taken with it), the
    new connection's item put and the older one's deleted, the lease given back; the older
    connection's $disconnect then writes nothing. A takeover
    by ``connect`` writes a transaction of three items, a transaction of two, and two
    deletes at the older connection's $disconnect."""
    connected = edge.connect("c1")
    writes: list[str] = []

    def record(model: Any, params: dict[str, Any], **_: Any) -> None:
        if model.name in ("UpdateItem", "PutItem", "DeleteItem", "TransactWriteItems"):
            table = params.get("TableName", "transaction").rsplit("-", 1)[-1]
            writes.append(f"{model.name} {table}")

    client = edge.world.registry.repository.dynamo.client
    client.meta.events.register("before-parameter-build.dynamodb.*", record)
    connections = edge.connections.dynamo.client
    if connections is not client:
        connections.meta.events.register("before-parameter-build.dynamodb.*", record)
    assert _renew(edge, "c2", connected["channel"]) is None
    edge.dropped("c1")
    assert writes == [
        "UpdateItem sessions",
        "PutItem connections",
        "UpdateItem connections",
        "PutItem connections",
        "DeleteItem connections",
        "UpdateItem connections",
    ]


def _reaper(edge: Edge) -> tuple[Reaper, RecordingPublisher]:
    publisher = RecordingPublisher()
    repository = SessionRepository(
        Dynamo(edge.world.session.client("dynamodb")), get_config().table("sessions")
    )
    return Reaper(repository, publisher, edge.world.clock), publisher


WILL = {"topic": "alice/status", "text": "offline", "delay_s": 5}


def test_a_renewal_killed_between_its_moves_leaves_the_channel_to_the_new_connections_disconnect(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A renewal moves the session's item to the new connection, then puts that
    connection's own item. Killed in between, the session named a connection no item named:
    the new connection's ``$disconnect`` found nothing, the older one's found the session
    named elsewhere (a takeover, it thought), and the channel stayed live for the registry's
    two-hour bound, its will unpublished. The renewal records the channel first, as a connect
    does, and the new connection's ``$disconnect`` loses it."""
    connected = edge.connect("c1", will=WILL)
    dynamo = edge.connections.dynamo
    real_call = dynamo.call

    def killed_at_the_item(operation: str, **params: Any) -> Any:
        if operation == "put_item" and params["Item"]["key"] == {"S": "conn#c2"}:
            raise RuntimeError("killed between the session's item and the connection's")
        return real_call(operation, **params)

    monkeypatch.setattr(dynamo, "call", killed_at_the_item)
    _renew(edge, "c2", connected["channel"])
    monkeypatch.setattr(dynamo, "call", real_call)
    target = edge.connections.target(_session_of(edge, "c1"))
    assert target is not None and target.connection_id == "c2"
    assert edge.connections.connection("c2") is None
    # When both connections go (the client gave up on its renewal)
    edge.dropped("c1")
    edge.dropped("c2")
    # Then the channel is lost and its will follows its delay
    assert_will_follows_its_delay(edge)


def chunks_visible_again_at_once(edge: Edge) -> None:
    """A push chunk received and not deleted is visible again at once (as once its
    visibility timeout ran out)."""
    sqs = edge.world.session.client("sqs")
    sqs.set_queue_attributes(QueueUrl=edge.queue.url, Attributes={"VisibilityTimeout": "0"})


def assert_will_follows_its_delay(edge: Edge) -> None:
    """The lost channel's will: not while its 5 s delay runs, then published once."""
    reaper, publisher = _reaper(edge)
    reaper.run()
    assert publisher.published == []  # the delay runs
    edge.world.clock.advance(6)
    reaper.run()
    assert [(c, w.text) for _, c, w, _ in publisher.published] == [("alice-1", "offline")]


def test_a_heartbeat_on_a_lost_channel_does_not_move_its_close(edge: Edge) -> None:
    """A WebSocket channel lost at its ``$disconnect``, then a request over HTTP naming it
    (a heartbeat): the channel is refused, and its will's delay still runs from the close
    (a heartbeat that moved the close later would hold the will back, and a resume within
    the moved delay would drop it)."""
    edge.connect("c1", will=WILL)
    found = edge.connections.connection("c1")
    assert found is not None
    edge.dropped("c1")
    edge.world.clock.advance(2)
    who = Principal(sub=found.sub, clients=(found.client_id,))
    with pytest.raises(SessionTakenOver):
        edge.service.registry.heartbeat(who, found.client_id, found.channel)
    # the will follows its delay from the close (5 s: 2 s gone, 3 s to go)
    reaper, publisher = _reaper(edge)
    edge.world.clock.advance(3.5)
    reaper.run()
    assert [(c, w.text) for _, c, w, _ in publisher.published] == [("alice-1", "offline")]


def test_a_lost_connection_publishes_its_will_after_the_delay(edge: Edge) -> None:
    edge.connect("c1", will=WILL)
    edge.dropped("c1")
    assert_will_follows_its_delay(edge)


@pytest.mark.parametrize("step", ["forget", "lose", "release"])
def test_a_disconnect_that_crashed_partway_does_its_work_when_run_again(
    edge: Edge, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    """A restarted ``shoal dev`` runs the ``$disconnect`` its ledger still owes, of a
    connection whose ``$disconnect`` a kill cut short (``shoal.local.wsledger``). The 30-minute
    soak at 200 clients lost a will when the kill came after the connection's item was gone
    and before the lose: run again, the ``$disconnect`` found no connection."""
    edge.connect("c1", will=WILL)
    # Given the $disconnect crashes at one of its steps (as a kill -9 there would end it)
    target: Any = {
        "forget": edge.connections,
        "lose": edge.service.registry,
        "release": edge.service,
    }[step]
    name = "_release" if step == "release" else step
    real = getattr(target, name)

    def crash(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"killed at {step}")

    monkeypatch.setattr(target, name, crash)
    with pytest.raises(RuntimeError):
        edge.dropped("c1")
    # When it runs again, whole
    monkeypatch.setattr(target, name, real)
    edge.dropped("c1")
    # Then the channel is lost and its will follows its delay; the connection is gone
    assert_will_follows_its_delay(edge)
    assert edge.connections.connection("c1") is None


def test_a_disconnect_run_again_later_keeps_the_close_its_first_run_recorded(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``$disconnect`` killed after its lose (at the release, or the connection's item) is
    run again by the restart's ledger, with the restart's time, not the close's. The lose
    run again moved the lost channel's close to that time, so the will's delay ran from the
    restart: a client that resumed within the delay of the restart, but long after the
    delay of the close, had its will dropped ([MQTT-3.1.2-8] requires it)."""
    edge.connect("c1", will=WILL)
    real = edge.service._release

    def crash(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("killed at release")

    # Given the $disconnect lost the channel at its close, then was killed
    monkeypatch.setattr(edge.service, "_release", crash)
    with pytest.raises(RuntimeError):
        edge.dropped("c1")
    monkeypatch.setattr(edge.service, "_release", real)
    # When the restart, a minute later, runs it again with its own time
    edge.world.clock.advance(60)
    edge.dropped("c1")
    # and the client resumes its session 2 s after the restart
    edge.world.clock.advance(2)
    assert edge.connect("c2")["session_present"] is True
    # Then the will is published: its delay ran out a minute before the resume
    reaper, publisher = _reaper(edge)
    reaper.run()
    assert [(c, w.text) for _, c, w, _ in publisher.published] == [("alice-1", "offline")]


def test_a_connect_that_read_the_head_before_its_channels_lose_publishes_the_will(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The 30-minute soak at 200 clients lost a will this way: a client's ``$disconnect`` ran
    70 s after it dropped its connection, 40 ms before the same client's connect committed,
    which had read the head before the lose. The head still looked live to it, so it held
    the will for the ``$disconnect`` to decide, which had come already: withheld after ten
    minutes. The lose changes what a connect decides from, so it moves the head's revision,
    and the connect reads again."""
    edge.connect("c1", will=WILL)
    closed_at = edge.world.clock.now_ms()
    edge.api.gone.add("c1")  # dropped; its $disconnect comes late
    edge.world.clock.advance(WILL["delay_s"] + 5)  # type: ignore[operator]
    repository = edge.service.registry.repository
    real = repository.register
    raced: list[bool] = []

    def lost_meanwhile(*args: Any, **kwargs: Any) -> bool:
        # Given the connect read the head, then the $disconnect of c1 ran before its write
        if not raced:
            raced.append(True)
            event = edge.event("edge_disconnect.json", "c1", requestTimeEpoch=closed_at)
            handle(lambda: edge.service, event)
        return bool(real(*args, **kwargs))

    monkeypatch.setattr(repository, "register", lost_meanwhile)
    # When the client connects again, resuming its session, past the will's delay
    assert edge.connect("c2")["session_present"] is True
    assert raced
    # Then the will is published: its delay ran out before the connect ([MQTT-3.1.2-8])
    reaper, publisher = _reaper(edge)
    reaper.run()
    assert [(c, w.text) for _, c, w, _ in publisher.published] == [("alice-1", "offline")]


def test_an_older_connects_late_bind_does_not_take_the_session_from_a_newer_connection(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two connections connect one client id at once (a client that gave up waiting for its
    CONNACK and opened another). The older connect registered and found its channel live,
    then stalled; the newer one took the session over and bound the session's item to its
    connection; then the older connect's bind wrote the session's item over it. The newer
    connection's ``$disconnect`` then found the session's item naming another connection,
    took that for a takeover and lost nothing: the session stayed connected to a gone
    connection (until the registry's two-hour bound) and its will was not published (a
    resume after the delay would hold it for a close that had come already)."""
    store = edge.connections
    real_bind = store.bind
    raced: list[bool] = []

    def newer_connects_first(connection: Any) -> bool:
        # Given the older connect (c1) registered and read its channel live, then the newer
        # one (c2) connects, resuming the session, before c1's bind
        if not raced:
            raced.append(True)
            edge.connect("c2", will=WILL)
        return real_bind(connection)

    monkeypatch.setattr(store, "bind", newer_connects_first)
    frame = {"action": "connect", "client_id": "alice-1", "clean_start": False}
    answer = edge.send("c1", frame | {"session_expiry_s": 3600, "will": WILL})
    assert raced
    # Then the older connect is refused as taken over, and its connection holds no session
    assert answer["error"]["code"] == "session_taken_over", answer
    assert edge.connections.connection("c1") is None
    monkeypatch.setattr(store, "bind", real_bind)
    session_id = _session_of(edge, "c2")
    # and the session's deliveries go to the newer connection, the live channel's
    target = edge.connections.target(session_id)
    assert target is not None and target.connection_id == "c2"
    # When the newer connection is lost
    edge.dropped("c2")
    # Then its channel is lost and its will follows its delay
    assert_will_follows_its_delay(edge)


def _connect_killed_before_its_bind(edge: Edge, monkeypatch: pytest.MonkeyPatch) -> None:
    """c1's connect (with a will) dies between its registration and its bind."""
    store = edge.connections
    real_bind = store.bind

    def killed(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("killed between the registration and the bind")

    monkeypatch.setattr(store, "bind", killed)
    frame = {"action": "connect", "client_id": "alice-1", "clean_start": False}
    edge.world.clock.advance(0.001)
    edge.send("c1", frame | {"session_expiry_s": 3600, "will": WILL})
    monkeypatch.setattr(store, "bind", real_bind)


def test_a_connect_that_crashed_before_its_bind_still_leaves_its_will_to_the_disconnect(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kill -9 of ``shoal dev`` (or a function that timed out) between a connect frame's
    registration and its bind: the registry holds the channel live, the connections table
    knows nothing of it but the channel the connect was about to register
    (``connecting#``). The restart runs the connection's owed ``$disconnect``, which found
    no connection and did nothing: the channel stayed live (its two-hour bound), and the
    client's resume past the will's delay held the will for a close that had come already
    (withheld ten minutes later). Now it loses the channel the connect registered.
    [MQTT-3.1.2-8]: the will is published."""
    _connect_killed_before_its_bind(edge, monkeypatch)
    # When the restart runs the $disconnect the connection is owed
    edge.dropped("c1")
    # and the client connects again, resuming, after the will's delay
    edge.world.clock.advance(WILL["delay_s"] + 5)  # type: ignore[operator]
    assert edge.connect("c2")["session_present"] is True
    # Then the will is published
    reaper, publisher = _reaper(edge)
    reaper.run()
    edge.world.clock.advance(700)
    reaper.run()
    assert [(c, w.text) for _, c, w, _ in publisher.published] == [("alice-1", "offline")]


def test_a_connect_that_crashed_before_its_bind_and_a_resume_before_its_disconnect_publish_the_will(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The connect died between its registration and its bind, and the client's resume came
    before the connection's ``$disconnect`` (late, as after a restart under load): the
    resume found the channel live and held its will for that ``$disconnect``, which finds no
    connection but the channel the connect was about to hold. It closed a whole will delay
    before the resume, so the will is published ([MQTT-3.1.2-8])."""
    _connect_killed_before_its_bind(edge, monkeypatch)
    closed_at = edge.world.clock.now_ms()
    edge.api.gone.add("c1")
    # When the client resumes after the will's delay, before c1's $disconnect
    edge.world.clock.advance(WILL["delay_s"] + 5)  # type: ignore[operator]
    assert edge.connect("c2")["session_present"] is True
    reaper, publisher = _reaper(edge)
    reaper.run()
    assert publisher.published == []
    # and then c1's $disconnect comes, saying when the connection went
    handle(
        lambda: edge.service, edge.event("edge_disconnect.json", "c1", requestTimeEpoch=closed_at)
    )
    # Then the held will is published, and c2 still holds the session
    reaper.run()
    assert [(c, w.text) for _, c, w, _ in publisher.published] == [("alice-1", "offline")]
    target = edge.connections.target(_session_of(edge, "c2"))
    assert target is not None and target.connection_id == "c2"


def test_a_disconnect_that_ran_before_its_connect_registered_leaves_the_will_to_the_connect(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client closed its connection right after sending ``connect`` (deployed, the two
    functions run at once): the ``$disconnect`` ran after the connect recorded its channel but
    before it registered it, so it found nothing live to lose. The connect then registered,
    bound, and found the connection gone when it posted its answer: the close's work is its
    own then, and the will follows its delay ([MQTT-3.1.2-8])."""
    store = edge.connections
    real_connecting = store.connecting

    def then_closed(*args: Any, **kwargs: Any) -> None:
        real_connecting(*args, **kwargs)
        edge.dropped("c1")

    monkeypatch.setattr(store, "connecting", then_closed)
    edge.world.clock.advance(0.001)
    frame = {"action": "connect", "client_id": "alice-1", "clean_start": False}
    assert edge.send("c1", frame | {"session_expiry_s": 3600, "will": WILL}) is None
    monkeypatch.setattr(store, "connecting", real_connecting)
    assert edge.connections.connection("c1") is None
    assert_will_follows_its_delay(edge)


def test_a_bind_that_meets_a_transaction_conflict_is_answered_busy_and_its_retry_binds(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A transaction conflict at the bind (another write to one of its items at that moment)
    wrote nothing: the connect frame is answered busy, not taken over, and sent again it
    binds the connection."""
    dynamo = edge.connections.dynamo
    real_transact = dynamo.transact
    conflicts: list[int] = []

    def conflict_once(parts: list[dict[str, Any]]) -> list[str] | None:
        if not conflicts:
            conflicts.append(1)
            return ["TransactionConflict"]
        return real_transact(parts)

    monkeypatch.setattr(dynamo, "transact", conflict_once)
    frame = {"action": "connect", "client_id": "alice-1", "clean_start": False}
    frame |= {"session_expiry_s": 3600}
    answer = edge.send("c1", frame)
    assert conflicts and answer["error"]["code"] == "server_busy", answer
    assert edge.connections.connection("c1") is None
    edge.connect("c1")
    target = edge.connections.target(_session_of(edge, "c1"))
    assert target is not None and target.connection_id == "c1"


def test_a_normal_disconnect_publishes_no_will(edge: Edge) -> None:
    edge.connect("c1", will=WILL)
    assert edge.send("c1", {"action": "disconnect", "ref": "d"}) is None
    assert edge.api.sent["c1"][-1] == {"action": "disconnect", "ref": "d", "reason": "normal"}
    edge.dropped("c1")
    reaper, publisher = _reaper(edge)
    edge.world.clock.advance(6)
    reaper.run()
    assert publisher.published == []


def test_disconnect_with_will_publishes_it(edge: Edge) -> None:
    edge.connect("c1", will=WILL | {"delay_s": 0})
    edge.send("c1", {"action": "disconnect", "with_will": True})
    reaper, publisher = _reaper(edge)
    reaper.run()
    reaper.run()
    assert len(publisher.published) == 1


def test_resuming_within_the_will_delay_publishes_no_will(edge: Edge) -> None:
    edge.connect("c1", will=WILL)
    edge.dropped("c1")
    reaper, publisher = _reaper(edge)
    reaper.run()
    edge.connect("c2")  # resumes the session within the delay
    edge.world.clock.advance(6)
    reaper.run()
    assert publisher.published == []


def test_a_connection_whose_disconnect_never_came_is_expired_after_api_gateways_limit(
    edge: Edge,
) -> None:
    edge.connect("c1", will=WILL | {"delay_s": 0})
    edge.api.gone.add("c1")  # API Gateway closed it, and its $disconnect was lost
    reaper, publisher = _reaper(edge)
    edge.world.clock.advance(MAX_CONNECTION_S)
    reaper.run()
    # a connection may still be open up to the two-hour limit: no will yet
    assert publisher.published == []
    edge.world.clock.advance(CHANNEL_MARGIN_S + 60)
    reaper.run()
    reaper.run()
    assert [(c, w.text) for _, c, w, _ in publisher.published] == [("alice-1", "offline")]


# --- the handshake


def test_connect_route_answers_the_offered_subprotocol_never_the_token(edge: Edge) -> None:
    answer = handle(lambda: edge.service, edge.event("edge_connect.json", "c1"))
    assert answer == {"statusCode": 200, "headers": {"Sec-WebSocket-Protocol": "shoal.v1"}}
    event = edge.event("edge_connect.json", "c1")
    del event["headers"]["Sec-WebSocket-Protocol"]
    assert handle(lambda: edge.service, event) == {"statusCode": 200}


# --- shared groups over the edge


@pytest.fixture
def group_edge(aws: boto3.Session, monkeypatch: pytest.MonkeyPatch) -> Iterator[Edge]:
    world = GroupWorld(aws, monkeypatch, lanes=4)
    world.topic("default")
    edge = Edge(world, monkeypatch)
    # the HTTP functions hand the members their requests hand lanes to to the push queue
    # (``wiring.hand_overs``)
    watcher = HandOffs(edge.queue)
    monkeypatch.setattr(messages_app, "hand_overs", lambda: watcher)
    monkeypatch.setattr(subscriptions_app, "hand_overs", lambda: watcher)
    monkeypatch.setattr(sessions_app, "hand_overs", lambda: watcher)
    # an HTTP subscribe finds the connection that holds its channel, as
    # ``wiring.subscription_service`` wires it
    world.subscriptions.connections = edge.connections
    yield edge


def test_a_stream_handed_over_to_an_idle_member_is_pushed_to_it(group_edge: Edge) -> None:
    """A lane revoked from a member with deliveries in flight goes to the new member when the
    old one acks its last (its final progress). The new member is connected and idle: no
    function of its own runs, so whoever commits the hand-off pushes it, or its lane's
    backlog would wait for the next message routed (in the kill -9 test: for ever)."""
    edge = group_edge
    share = {"filter": "$share/g/a/#", "qos": 1}
    keys = [f"k{n}" for n in range(8)]
    edge.connect("c1", client_id="alice-1")
    edge.send("c1", {"action": "subscribe", "subscriptions": [share]})
    for key in keys:
        edge.world.publish("a/b", f"first-{key}", ordering_key=key)
    edge.world.route()
    # the only member holds every lane, each with a delivery in flight
    assert len(edge.messages("c1")) == len(keys)
    edge.connect("c2", client_id="alice-2")
    edge.send("c2", {"action": "subscribe", "subscriptions": [share]})
    # the newcomer's lanes are revoking: their next messages wait for the hand-off
    for key in keys:
        edge.world.publish("a/b", f"second-{key}", ordering_key=key)
    edge.world.route()
    # the first member acks all it has: its final progress hands the revoked lanes over
    edge.send("c1", {"action": "ack", "ids": [f["id"] for f in edge.messages("c1")]})
    edge.send("c1", {"action": "ack", "ids": [f["id"] for f in edge.messages("c1")]})
    got = texts(edge.messages("c1")) + texts(edge.messages("c2"))
    # every message reached one member, with no other trigger (no publish, no sweep)
    assert sorted(set(got)) == sorted(f"{p}-{k}" for p in ("first", "second") for k in keys)
    # and the newcomer got its share: the lanes it was handed
    assert edge.messages("c2")


def test_a_lane_an_http_member_hands_over_is_pushed_to_a_websocket_member(
    group_edge: Edge,
) -> None:
    """A group of an HTTP member (long-poll, get and ack) and a WebSocket member: the HTTP
    member's final ack hands the revoked lanes to the WebSocket member, which is idle and
    runs nothing; the messages function pushes it when the ack's request ends."""
    edge = group_edge
    world = edge.world
    share = {"filter": "$share/g/a/#", "qos": 1}
    keys = [f"k{n}" for n in range(8)]
    channel = world.connect("alice-1", clean_start=False, session_expiry_s=3600)
    world.subscribe("alice-1", channel, share)
    for key in keys:
        world.publish("a/b", f"first-{key}", ordering_key=key)
    world.route()
    first = world.get("alice-1", channel, max_messages=100)
    assert len(first) == len(keys)
    edge.connect("c2", client_id="alice-2")
    edge.send("c2", {"action": "subscribe", "subscriptions": [share]})
    for key in keys:
        world.publish("a/b", f"second-{key}", ordering_key=key)
    world.route()
    assert edge.messages("c2") == []  # its lanes wait for the HTTP member's acks
    assert world.ack("alice-1", channel, [m["id"] for m in first])[0] == 200
    # pushed by the ack's request: no publish, no sweep, no get of the WebSocket member
    handed = texts(edge.messages("c2"))
    assert handed and set(handed) <= {f"second-{k}" for k in keys}
    rest = world.get("alice-1", channel, max_messages=100)
    assert sorted(handed + texts(rest)) == sorted(f"second-{k}" for k in keys)


def test_lanes_an_http_member_leaves_are_pushed_to_a_websocket_member(
    group_edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The HTTP member of a two-member group unsubscribes with its lanes' messages unread: the
    unsubscribe's request (the subscriptions function) pushes the WebSocket member, idle
    with everything acked, what those lanes hold. Here the WebSocket member's connection does
    not keep it live (its keep was never written: a crash between its subscribe's commit and
    the keep), so it lapses as any idle member does."""
    edge = group_edge
    world = edge.world
    assert isinstance(world, GroupWorld)
    monkeypatch.setattr(world.groups, "_keep", lambda *_: False)
    share = {"filter": "$share/g/a/#", "qos": 1}
    keys = [f"k{n}" for n in range(8)]
    channel = world.connect("alice-1", clean_start=False, session_expiry_s=3600)
    world.subscribe("alice-1", channel, share)
    edge.connect("c2", client_id="alice-2")
    edge.send("c2", {"action": "subscribe", "subscriptions": [share]})
    for key in keys:
        world.publish("a/b", f"m-{key}", ordering_key=key)
    world.route()
    first = edge.messages("c2")
    assert 0 < len(first) < len(keys)
    edge.send("c2", {"action": "ack", "ids": [f["id"] for f in first]})
    assert len(edge.messages("c2")) == len(first)  # nothing more without the HTTP member
    # idle past the lease timeout: no function of the WebSocket member ran to renew its
    # lease, so the leave's advance has no live member to grant the lanes to; they go free,
    # and the members who could take them are pushed (``freed_for``)
    world.clock.advance(LEASE_S + 1)
    status, _ = world.unsubscribe("alice-1", channel, "$share/g/a/#")
    assert status == 200
    assert sorted(texts(edge.messages("c2"))) == sorted(f"m-{k}" for k in keys)


def test_a_router_push_reads_its_sessions_heads_and_states_in_one_call(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The router's push to the sessions its batch wrote to reads their heads and delivery
    states together (one batch read), not two reads a session before each frame goes out."""
    clients = [f"alice-{n}" for n in range(4)]
    for n, client_id in enumerate(clients):
        edge.connect(f"c{n}", client_id=client_id)
        edge.send(f"c{n}", {"action": "subscribe", "subscriptions": [{"filter": "a/#", "qos": 1}]})
    calls: list[tuple[str, dict[str, Any]]] = []
    real = Dynamo.call

    def recording(self: Dynamo, operation: str, **request: Any) -> Any:
        calls.append((operation, request))
        return real(self, operation, **request)

    monkeypatch.setattr(Dynamo, "call", recording)
    edge.world.publish("a/b", "m0")
    edge.world.route()
    for n in range(len(clients)):
        assert texts(edge.messages(f"c{n}")) == ["m0"]
    # no head or state read a session: what the router's push read came in batch reads
    keys = [r.get("Key", {}) for op, r in calls if op == "get_item"]
    assert not [k for k in keys if k.get("item") == {"S": "head"}]
    assert not [k for k in keys if k.get("position") == {"S": STATE}]
    batched = [
        key
        for op, r in calls
        if op == "batch_get_item"
        for part in r["RequestItems"].values()
        for key in part["Keys"]
    ]
    assert sum(k.get("item") == {"S": "head"} for k in batched) == len(clients)
    assert sum(k.get("position") == {"S": STATE} for k in batched) == len(clients)


def test_a_push_from_a_stale_read_hands_out_nothing_twice(edge: Edge) -> None:
    """A push that starts from a head and state read before another push wrote the state (a
    stale read) fails its conditional write, reads again, and hands out only what is new."""
    edge.connect("c1")
    edge.send("c1", {"action": "subscribe", "subscriptions": [{"filter": "a/#", "qos": 1}]})
    found = edge.connections.connection("c1")
    assert found is not None
    session_id = found.session_id
    connection = edge.connections.targets([session_id])[0]
    stale = edge.world.delivery.read_sessions([(connection.client_id, session_id)])
    edge.world.publish("a/b", "m0")
    edge.world.route()  # its push hands m0 out: the state moves past what ``stale`` holds
    assert texts(edge.messages("c1")) == ["m0"]
    # m1 is routed, and its push starts from the stale read
    real_read = edge.worker._read
    edge.worker._read = lambda pushes: stale  # type: ignore[method-assign]
    try:
        edge.world.publish("a/b", "m1")
        edge.world.route()
    finally:
        edge.worker._read = real_read  # type: ignore[method-assign]
    assert texts(edge.messages("c1")) == ["m0", "m1"]


# --- a WebSocket member's liveness comes from its connection

SHARE = {"filter": "$share/g/a/#", "qos": 1}
KEYS = [f"k{n}" for n in range(8)]


def _group_world(edge: Edge) -> GroupWorld:
    assert isinstance(edge.world, GroupWorld)
    return edge.world


def _member(edge: Edge, client_id: str) -> tuple[bool, list[str]]:
    """Whether the client's session is a live member of the group now, and its lanes."""
    world = _group_world(edge)
    loaded = world.group("g", "a/#")
    assert loaded is not None
    session_id = world.session_id(client_id)
    member = loaded.state.members[session_id]
    live = member.alive(edge.world.clock.now_ms(), int(LEASE_S * 1000))
    return live, sorted(loaded.state.holdings(session_id))


def _two_members(edge: Edge) -> None:
    """alice-1 (on c1) and alice-2 (on c2) share the group's four lanes, two each, with
    nothing in flight (the router makes a group's lanes known with its first write)."""
    edge.connect("c1", client_id="alice-1")
    edge.send("c1", {"action": "subscribe", "subscriptions": [SHARE]})
    for key in KEYS:
        edge.world.publish("a/b", f"first-{key}", ordering_key=key)
    edge.world.route()
    edge.send("c1", {"action": "ack", "ids": [f["id"] for f in edge.messages("c1")]})
    edge.connect("c2", client_id="alice-2")
    edge.send("c2", {"action": "subscribe", "subscriptions": [SHARE]})
    edge.api.sent.clear()


def _idle(edge: Edge, timeouts: int = 3) -> None:
    """Time passes with no function of the members running; the group advances each lease
    timeout as any other invocation touching it (a member's get, the reaper) advances it."""
    world = _group_world(edge)
    for _ in range(timeouts):
        world.clock.advance(LEASE_S + 1)
        world.group_store.advance(group_key("g", "a/#"), world.clock.now_ms())


def test_an_idle_websocket_member_is_live_while_its_connection_lives(group_edge: Edge) -> None:
    """Two members connected over the WebSocket API stay idle for several lease timeouts: no
    function of theirs runs, yet each is live and keeps its lanes (its connection keeps it),
    and is pushed the group's messages. One's $disconnect releases it at once: its lanes,
    with what it had in flight, go to the other, pushed to it by the $disconnect."""
    edge = group_edge
    _two_members(edge)
    first, second = _member(edge, "alice-1"), _member(edge, "alice-2")
    assert first[0] and second[0] and len(first[1]) == len(second[1]) == 2
    _idle(edge)
    # live past three lease timeouts without a renewal, the lanes where they were
    assert _member(edge, "alice-1") == first
    assert _member(edge, "alice-2") == second
    for key in KEYS:
        edge.world.publish("a/b", f"m-{key}", ordering_key=key)
    edge.world.route()
    pushed = texts(edge.messages("c1")), texts(edge.messages("c2"))
    assert pushed[0] and pushed[1]
    assert sorted(pushed[0] + pushed[1]) == sorted(f"m-{k}" for k in KEYS)
    edge.dropped("c1")
    # at once: no time passed, no lease ran out
    assert _member(edge, "alice-1") == (False, [])
    assert _member(edge, "alice-2") == (True, sorted(first[1] + second[1]))
    # what the first had in flight went to the second, pushed by the $disconnect
    assert sorted(set(texts(edge.messages("c2")))) == sorted(f"m-{k}" for k in KEYS)


def test_a_takeover_keeps_the_member_live_by_the_newer_connection(group_edge: Edge) -> None:
    """A connect over the WebSocket API that resumes the session takes it over: the newer
    connection keeps the member live from then, and the older one's $disconnect releases
    nothing."""
    edge = group_edge
    _two_members(edge)
    lanes = _member(edge, "alice-1")
    edge.connect("c3", client_id="alice-1")
    assert edge.api.closed == ["c1"]
    edge.dropped("c1")
    _idle(edge)
    assert _member(edge, "alice-1") == lanes


def test_an_http_takeover_releases_the_member_its_connection_kept_at_once(
    group_edge: Edge,
) -> None:
    """An HTTP connect that resumes the session takes it over from the WebSocket connection,
    which API Gateway may hold open (refused) for a long while: the member that connection
    kept is released by the connect, not at the connection's $disconnect. Its lanes, with
    what it had in flight, go to the other member, pushed to it when the connect ends; from
    then the HTTP channel's member is live as any HTTP member is, by renewing."""
    edge = group_edge
    world = edge.world
    # Given two idle WebSocket members sharing the lanes, each with deliveries in flight
    _two_members(edge)
    _idle(edge)
    for key in KEYS:
        world.publish("a/b", f"m-{key}", ordering_key=key)
    world.route()
    held = texts(edge.messages("c1"))
    assert held and texts(edge.messages("c2"))
    # When an HTTP connect takes alice-1's session over, c1 still open (no $disconnect)
    world.connect("alice-1", clean_start=False, session_expiry_s=3600)
    # Then at once (no time passed, no lease ran out) alice-2 holds every lane
    assert _member(edge, "alice-1") == (False, [])
    assert _member(edge, "alice-2") == (True, _all_lanes(edge))
    # and was pushed what alice-1 had in flight, by the connect
    assert set(held) <= set(texts(edge.messages("c2")))
    # c1's $disconnect, when it comes, changes nothing
    edge.dropped("c1")
    assert _member(edge, "alice-2") == (True, _all_lanes(edge))


def test_a_share_subscribed_over_http_on_a_websocket_channel_is_kept_by_its_connection(
    group_edge: Edge,
) -> None:
    """A client connected over the WebSocket API subscribes a share over the HTTP API, naming
    its connection's channel: the connection keeps that member live from the subscribe, as
    if the subscribe had come over it (no connect or renewal needed), and its $disconnect
    releases it."""
    edge = group_edge
    world = edge.world
    # Given alice-2, a member over the WebSocket API, and alice-1 connected over it too
    edge.connect("c2", client_id="alice-2")
    edge.send("c2", {"action": "subscribe", "subscriptions": [SHARE]})
    channel = edge.connect("c1", client_id="alice-1")["channel"]
    # When alice-1 subscribes the share over HTTP on c1's channel
    assert world.subscribe("alice-1", channel, SHARE) == [1]
    for key in KEYS:
        world.publish("a/b", f"first-{key}", ordering_key=key)
    world.route()
    for connection in ("c1", "c2"):
        ids = [f["id"] for f in edge.messages(connection)]
        edge.send(connection, {"action": "ack", "ids": ids})
    lanes = _member(edge, "alice-1")
    assert lanes[0] and lanes[1]
    # Then idle past three lease timeouts, running nothing, it is live with its lanes
    _idle(edge)
    assert _member(edge, "alice-1") == lanes
    # and its connection's $disconnect releases it at once
    edge.dropped("c1")
    assert _member(edge, "alice-1") == (False, [])
    assert _member(edge, "alice-2") == (True, _all_lanes(edge))


def test_a_renewal_keeps_the_member_live_by_the_new_connection(group_edge: Edge) -> None:
    """The client renews its connection before API Gateway's two hours (make-before-break):
    the new connection keeps the member from then, the older one's $disconnect releases
    nothing, and the new one's releases it."""
    edge = group_edge
    _two_members(edge)
    lanes = _member(edge, "alice-1")
    head = edge.world.registry.repository.head("alice-1")
    assert head is not None
    _renew(edge, "c3", head.newest.channel)
    assert edge.api.sent["c3"][0]["action"] == "connected"
    edge.dropped("c1")
    _idle(edge)
    assert _member(edge, "alice-1") == lanes
    edge.dropped("c3")
    assert _member(edge, "alice-1") == (False, [])
    assert _member(edge, "alice-2") == (True, _all_lanes(edge))


def test_the_reaper_releases_a_member_whose_connections_end_released_nothing(
    group_edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A $disconnect that died after losing the channel and before releasing the member
    (here: its release does nothing): the reaper's expiry of the lost channel, due at once,
    releases it, and its lanes go to the live member."""
    edge = group_edge
    world = _group_world(edge)
    _two_members(edge)
    monkeypatch.setattr(world.groups, "connection_ended", lambda *_: 0)
    edge.dropped("c1")
    assert _member(edge, "alice-1")[0]  # kept still: nothing released it
    repository = SessionRepository(
        Dynamo(world.session.client("dynamodb")), get_config().table("sessions")
    )
    reaper = Reaper(
        repository,
        RecordingPublisher(),
        world.clock,
        on_channel_expired=world.groups.channel_expired,
    )
    assert reaper.run().channels_expired == 1
    assert _member(edge, "alice-1") == (False, [])
    assert _member(edge, "alice-2") == (True, _all_lanes(edge))


def _all_lanes(edge: Edge) -> list[str]:
    loaded = _group_world(edge).group("g", "a/#")
    assert loaded is not None
    return sorted(loaded.state.streams)


def test_an_ack_frame_reads_its_sessions_head_and_state_in_one_call(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection knows its session: an ``ack`` frame reads the session's head and
    delivery state together, in one batch read, and a stale state read that way costs only a
    read again. It reads its connection, and then the session, eventually consistent (half
    the read units)."""
    edge.connect("c1")
    edge.send("c1", {"action": "subscribe", "subscriptions": [{"filter": "a/#", "qos": 1}]})
    for n in range(2):
        edge.world.publish("a/b", f"m{n}")
    edge.world.route()
    first, second = edge.messages("c1")
    calls: list[tuple[str, dict[str, Any]]] = []
    real = Dynamo.call

    def recording(self: Dynamo, operation: str, **request: Any) -> Any:
        calls.append((operation, request))
        return real(self, operation, **request)

    monkeypatch.setattr(Dynamo, "call", recording)
    edge.send("c1", {"action": "ack", "ids": [first["id"]], "ref": "a1"})
    reads = [r for op, r in calls if op == "get_item"]
    # the one item read alone is the connection's, which names the session
    assert [(r["Key"], r["ConsistentRead"]) for r in reads] == [({"key": {"S": "conn#c1"}}, False)]
    [batch] = [r for op, r in calls if op == "batch_get_item"]
    assert sorted(len(part["Keys"]) for part in batch["RequestItems"].values()) == [1, 1]
    assert [part["ConsistentRead"] for part in batch["RequestItems"].values()] == [False, False]
    assert edge.api.sent["c1"][-1] == {"action": "acked", "ref": "a1", "acked": 1}
    # a state that moved after the read: the write fails, the ack reads again and lands
    service = edge.service.delivery
    real_read = service.read_sessions

    def stale_read(*args: Any, **kwargs: Any) -> Any:
        read = real_read(*args, **kwargs)
        monkeypatch.setattr(service, "read_sessions", real_read)
        edge.world.publish("a/b", "m2")
        edge.world.route()  # its push hands m2 out: a new state version
        return read

    monkeypatch.setattr(service, "read_sessions", stale_read)
    assert edge.send("c1", {"action": "ack", "ids": [second["id"]], "ref": "a2"}) is None
    answers = [f for f in edge.api.sent["c1"] if f.get("action") == "acked"]
    assert [a["acked"] for a in answers] == [1, 1]
    assert texts(edge.messages("c1")) == ["m0", "m1", "m2"]


def test_nothing_is_pushed_to_a_connection_before_its_connect_is_answered(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MQTT 5 [MQTT-3.2.0-1]: CONNACK is the server's first packet. A router's push that
    comes between the connect's bind and its answer finds the connection not ready, and the
    connect's own push, handed over after its ``connected`` frame, sends the deliveries."""
    away_while_published(edge, "waiting")
    real_keep = edge.service._keep
    raced: list[int] = []

    def keep_then_race(connection: Any, head: Any) -> None:
        real_keep(connection, head)
        # the router's push of a message routed right after the bind
        edge.queue.hand_off([connection.session_id])
        edge.push()
        raced.append(len(edge.api.sent[connection.connection_id]))

    monkeypatch.setattr(edge.service, "_keep", keep_then_race)
    edge.world.clock.advance(0.001)
    edge.send("c2", {"action": "connect", "client_id": "alice-1", "clean_start": False})
    assert raced == [0]
    answered_first(edge, "c2", "waiting")
