"""The embedded AWS behind ``shoal dev``: moto's server on loopback, serialized and journaled.

Two things moto's own server does not give us:

- **Atomic conditional writes.** moto checks a DynamoDB condition and writes without a lock,
  so racing writers can both pass. Every request runs under ``BACKEND_LOCK``.
- **Durability.** moto keeps everything in memory. With a state directory, every successful
  mutating request is appended to a journal and fsynced *before* its response leaves, while
  the lock is still held, so journal order is apply order. A restart replays the journal, in
  order, into the fresh backend before serving: whatever a client was told had succeeded is
  there again, including after a kill -9.

Replay reproduces what moto derives from time and randomness too: each journaled request runs
with moto's clock frozen at the request's journal time and moto's random generator seeded with
the request's journal sequence number, in the first run and in every replay. So Kinesis arrival
timestamps, event source mapping UUIDs and the like come back identical. Kinesis sequence
numbers are per-shard counters in moto, so in-order replay reproduces them on its own.
"""

from __future__ import annotations

import datetime as dt
import functools
import io
import json
import logging
import pickle
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import boto3

from shoal.local import moto_json, snapshot
from shoal.local.attribute_values import parse_requested_attribute_values_directly
from shoal.local.esm.consumers import keep_consumers_as_kinesis_does
from shoal.local.journal import JOURNAL_FILE, Journal, JournalRecord
from shoal.local.moto_cloudwatch import bucket_metric_queries
from shoal.local.moto_core import (
    detach_moto_lambda_triggers,
    draw_request_ids_cheaply,
    forget_model_instances,
    pick_members_by_known_keys,
    share_service_models,
)
from shoal.local.moto_dynamodb import (
    cache_action_names,
    lex_conditions_once,
    parse_conditions_once,
    parse_update_expressions_once,
    project_from_one_conversion,
    query_one_partition,
    roll_back_transactions_by_item,
    serialize_attribute_values_directly,
    size_items_once,
    traverse_with_fixed_maps,
)
from shoal.local.moto_kinesis import read_shards_by_position
from shoal.local.moto_scans import count_scans_without_copies
from shoal.local.moto_sqs import build_attributes_as_asked_while_sending, read_retention_directly
from shoal.local.serialize import BACKEND_LOCK
from shoal.local.throttle import DYNAMODB_THROTTLED, Throttles
from shoal.local.transport import PRESERVED_NAMES_KEY as _PRESERVED_NAMES_KEY
from shoal.local.transport import (
    InProcessTransport,
    call_wsgi,
    environ_for,
    json_target,
)

log = logging.getLogger("shoal-dev.aws")


#: actions (X-Amz-Target suffix or query-protocol Action) that change nothing in moto
READ_ONLY_ACTION_PREFIXES = (
    "Get",
    "List",
    "Describe",
    "Query",
    "Scan",
    "BatchGet",
    "TransactGet",
)
READ_ONLY_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
#: SQS's message calls: a queue's messages live in memory only, not in the journal. moto draws
#: receipt handles at random, so a replayed delete could not find what a replayed receive
#: made; and what the queues carry under ``shoal dev`` is pushes to WebSocket connections,
#: which end with the process anyway (the inboxes hold every delivery). The queues themselves
#: (create, attributes, mappings) are journaled as any resource.
TRANSIENT_QUEUE_ACTIONS = frozenset(
    {
        "SendMessage",
        "SendMessageBatch",
        "ReceiveMessage",
        "DeleteMessage",
        "DeleteMessageBatch",
        "ChangeMessageVisibility",
        "ChangeMessageVisibilityBatch",
        "PurgeQueue",
    }
)
SQS_TARGET = "AmazonSQS."

#: environ keys a replay needs to route and apply a request as the first run did
_REPLAYED_ENVIRON = (
    "REQUEST_METHOD",
    "PATH_INFO",
    "QUERY_STRING",
    "CONTENT_TYPE",
    "REQUEST_URI",
    "RAW_URI",
    "SERVER_NAME",
    "SERVER_PORT",
    "SERVER_PROTOCOL",
)
#: headers never journaled: connection handling, and credentials beyond the key id
_DROPPED_HEADERS = frozenset(
    {
        "HTTP_CONNECTION",
        "HTTP_KEEP_ALIVE",
        "HTTP_TRANSFER_ENCODING",
        "HTTP_EXPECT",
        "HTTP_ACCEPT_ENCODING",
        "HTTP_X_AMZ_SECURITY_TOKEN",
        "HTTP_CONTENT_LENGTH",
    }
)

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


# --- moto's clock and randomness, pinned per journaled request -------------------------------


class _MotoClock:
    """moto's ``utcnow``, pinnable to a request's journal time (set only under the lock)."""

    frozen_at: dt.datetime | None = None
    installed = False

    @classmethod
    def install(cls) -> None:
        """Route moto's ``utcnow`` through this class.

        moto's service modules import ``utcnow`` by name, so both the source and every copy
        already imported are replaced; modules imported later pick up the replacement.
        """
        if cls.installed:
            return
        import sys

        import moto.core.utils as core_utils

        original = core_utils.utcnow

        def utcnow() -> dt.datetime:
            pinned = cls.frozen_at
            return pinned if pinned is not None else original()

        for name, module in list(sys.modules.items()):
            if name.startswith("moto.") and getattr(module, "utcnow", None) is original:
                module.utcnow = utcnow  # type: ignore[attr-defined]
        core_utils.utcnow = utcnow
        cls.installed = True


class _Pinned:
    """moto's clock and random generator fixed for one journaled request (lock held)."""

    def __init__(self, seq: int, at_ms: int) -> None:
        self.seq = seq
        self.at_ms = at_ms

    def __enter__(self) -> None:
        from moto.moto_api._internal import mock_random

        at = dt.datetime.fromtimestamp(self.at_ms / 1000, tz=dt.UTC)
        _MotoClock.frozen_at = at.replace(tzinfo=None)  # moto's utcnow is naive UTC
        mock_random.seed(self.seq)

    def __exit__(self, *_: object) -> None:
        _MotoClock.frozen_at = None


def adapt_moto() -> None:
    """What the emulator changes in moto, process-wide and idempotent (server and tests)."""
    share_service_models()
    forget_model_instances()
    draw_request_ids_cheaply()
    pick_members_by_known_keys()
    detach_moto_lambda_triggers()
    roll_back_transactions_by_item()
    query_one_partition()
    serialize_attribute_values_directly()
    cache_action_names()
    parse_update_expressions_once()
    traverse_with_fixed_maps()
    lex_conditions_once()
    parse_conditions_once()
    keep_consumers_as_kinesis_does()
    bucket_metric_queries()
    read_retention_directly()
    build_attributes_as_asked_while_sending()
    project_from_one_conversion()
    size_items_once()
    count_scans_without_copies()
    parse_requested_attribute_values_directly()
    read_shards_by_position()


# --- the middleware --------------------------------------------------------------------------


def _action(environ: dict[str, Any], body: bytes) -> str | None:
    target = environ.get("HTTP_X_AMZ_TARGET")
    if target:
        return str(target).rsplit(".", 1)[-1]
    query = parse_qs(environ.get("QUERY_STRING", ""))
    if "Action" in query:
        return query["Action"][0]
    if str(environ.get("CONTENT_TYPE", "")).startswith("application/x-www-form-urlencoded"):
        form = parse_qs(body.decode("utf-8", "replace"))
        if "Action" in form:
            return form["Action"][0]
    return None


def is_mutating(environ: dict[str, Any], body: bytes) -> bool:
    """Whether a request may change moto's state, so a restart must replay it. A queue's
    messages are not replayed (``TRANSIENT_QUEUE_ACTIONS``)."""
    if str(environ.get("REQUEST_METHOD", "")).upper() in READ_ONLY_METHODS:
        return False
    action = _action(environ, body)
    if action in TRANSIENT_QUEUE_ACTIONS and _is_sqs(environ):
        return False
    return not (action and action.startswith(READ_ONLY_ACTION_PREFIXES))


def _is_sqs(environ: dict[str, Any]) -> bool:
    target = str(environ.get("HTTP_X_AMZ_TARGET") or "")
    return target.startswith(SQS_TARGET) or "/sqs/" in str(environ.get("HTTP_AUTHORIZATION", ""))


def _read_body(environ: dict[str, Any]) -> bytes:
    stream = environ["wsgi.input"]
    if environ.get("wsgi.input_terminated"):
        return bytes(stream.read())
    length = int(environ.get("CONTENT_LENGTH") or 0)
    chunks = []
    while length > 0:
        chunk = stream.read(length)
        if not chunk:
            break
        chunks.append(chunk)
        length -= len(chunk)
    return b"".join(chunks)


def _journaled_environ(environ: dict[str, Any]) -> dict[str, str]:
    kept = {k: str(environ[k]) for k in _REPLAYED_ENVIRON if k in environ}
    for key, value in environ.items():
        if key.startswith("HTTP_") and key not in _DROPPED_HEADERS and isinstance(value, str):
            kept[key] = value
    auth = kept.get("HTTP_AUTHORIZATION")
    if auth:
        # moto routes on the credential scope (service, region) and maps the key id to an
        # account; the signature is neither checked nor needed to replay.
        kept["HTTP_AUTHORIZATION"] = auth.split(",", 1)[0]
    return kept


@dataclass(frozen=True)
class ReplayStats:
    records: int
    seconds: float
    failures: int
    dropped_tail_bytes: int


#: how long a DynamoDB or Kinesis call waits for the emulator; below the shortest read timeout
#: of Shoal's clients (the publish path's writer: ``shoal.aws.clients.PUT_READ_TIMEOUT_S``)
LOCK_WAIT_BUDGET_S = 2.0


class QueueSends:
    """Wakes whoever waits for a message sent to a queue of this process's emulator, per
    queue (by name): a poller (``shoal.local.esm.queues``) waits for its own queue's sends.
    When every send woke every poller, ``bench connections``' 1,000 subscribers cost 3,300
    empty receives (3.3 s of CPU, traced 2026-12-07). ``notify()`` wakes every waiter."""

    def __init__(self) -> None:
        self._sent = threading.Condition()
        #: sends to any queue, and wake-ups of all
        self.count = 0
        self._everyone = 0
        self._by_queue: dict[str, int] = {}

    def notify(self, queue: str | None = None) -> None:
        """A send to ``queue`` (a name), or, without one, a wake-up of every waiter."""
        with self._sent:
            self.count += 1
            if queue is None:
                self._everyone += 1
            else:
                self._by_queue[queue] = self._by_queue.get(queue, 0) + 1
            self._sent.notify_all()

    def count_of(self, queue: str) -> int:
        """What ``wait`` compares for ``queue``: its sends and the wake-ups of all."""
        with self._sent:
            return self._seen(queue)

    def _seen(self, queue: str | None) -> int:
        if queue is None:
            return self.count
        return self._by_queue.get(queue, 0) + self._everyone

    def wait(self, seen: int, timeout_s: float, queue: str | None = None) -> int:
        """Waits until a send after the ``seen``-th (to ``queue`` when named, ``count_of``;
        to any otherwise) or ``timeout_s``; the sends so far."""
        with self._sent:
            self._sent.wait_for(lambda: self._seen(queue) > seen, timeout_s)
            return self._seen(queue)


#: the queue URL's member in an SQS send's JSON body: the serializer writes it first, and
#: no string value can hold it unescaped (a quote inside one is ``\"``)
_QUEUE_URL = re.compile(rb'"QueueUrl"\s*:\s*"([^"]*)"')


def sent_queue(body: bytes) -> str | None:
    """The name of the queue an SQS send's body names (its URL's last segment); None when
    it names none that can be read (then every poller is woken)."""
    found = _QUEUE_URL.search(body)
    if found is None:
        return None
    name = found.group(1).decode("utf-8", "replace").rstrip("/").rsplit("/", 1)[-1]
    return name or None


QUEUE_SENDS = QueueSends()
SQS_SEND = "AmazonSQS.SendMessage"

#: the X-Amz-Target prefix of DynamoDB's calls
DYNAMODB_TARGET = "DynamoDB_20120810."
_AMZ_JSON = "application/x-amz-json-1.0"
_JOURNAL_FAILED = b"the emulator's journal failed; restart shoal dev"
_UNAVAILABLE = json.dumps(
    {"__type": "ServiceUnavailable", "message": "the emulator is busy; retry"}
).encode()


class SerializedApp:
    """WSGI middleware: one request at a time, successful mutations journaled before replying."""

    def __init__(
        self, app: WsgiApp, journal: Journal | None = None, throttles: Throttles | None = None
    ) -> None:
        self.app = app
        self.journal = journal
        #: ``SHOAL_DEV_THROTTLE``'s share of DynamoDB calls refused as throttled
        self.throttles = throttles
        self.failed = False
        self.clock_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000
        #: snapshots taken while serving (None: none; ``EmbeddedAws.start`` sets it)
        self.snapshots: snapshot.Snapshotter | None = None

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        body = _read_body(environ)
        environ["wsgi.input"] = io.BytesIO(body)
        environ["CONTENT_LENGTH"] = str(len(body))
        environ.pop("wsgi.input_terminated", None)
        status, headers, payload = self._serve(
            environ,
            body,
            lambda: self._run(environ),
            mutating=is_mutating(environ, body),
            bounded=bool(environ.get("HTTP_X_AMZ_TARGET")),
            target=str(environ.get("HTTP_X_AMZ_TARGET") or ""),
        )
        start_response(status, headers)
        return [payload]

    def serve_in_process(self, request: Any) -> tuple[int, list[tuple[str, str]], bytes] | None:
        """A DynamoDB, Kinesis or SQS call made in this process, handed to moto's handler for
        its service without Flask (as moto's own in-process mock does), under the same bounded
        wait, lock and journal as ``__call__`` (a queue's message calls not journaled, as
        there); None for any other call. The journal keeps
        the environ werkzeug would have built, so a restart replays it through the server's
        path like any other record."""
        target = json_target(request)
        handler = _direct_handler(target)
        if handler is None or target is None:
            return None
        # the environ werkzeug's server would build: moto's request is made from it (moto's
        # own conversion builds one through werkzeug's test builder, a third of the call's
        # time outside the model), and the journal keeps it
        environ = environ_for(request)
        body = environ["wsgi.input"].getvalue()
        status, headers, payload = self._serve(
            environ,
            body,
            lambda: _call_handler(handler, environ),
            mutating=is_mutating(environ, body),
            bounded=True,
            target=target,
        )
        return int(status.split(" ", 1)[0]), headers, payload

    def _serve(
        self,
        environ: dict[str, Any],
        body: bytes,
        run: Callable[[], tuple[str, list[tuple[str, str]], bytes]],
        *,
        mutating: bool,
        bounded: bool,
        target: str = "",
    ) -> tuple[str, list[tuple[str, str]], bytes]:
        """One request under the backend lock (``bounded``: a DynamoDB or Kinesis call, which
        waits a bounded time for its turn), its record staged in the journal if it changed
        anything; the answer leaves once every record it may have seen is on disk.

        The disk write is not under the lock (group commit, ``Journal.wait_durable``): with
        it there, each write held the lock through a write and an fsync, both of which let go
        of the GIL, and got it back only after whichever thread took it meanwhile ran its
        slice: 2 ms at the median and 5 ms at p90 a write under a 10-session load, against
        0.3 ms for the fsync alone. A read waits as a write does (for what was staged before
        it), so no client sees a change that a restart would not bring back."""
        if (
            self.throttles is not None
            and target.startswith(DYNAMODB_TARGET)
            and self.throttles.refuse("dynamodb")
        ):
            # refused unapplied, as DynamoDB refuses past a partition's capacity
            return "400 Bad Request", [("Content-Type", _AMZ_JSON)], DYNAMODB_THROTTLED
        # DynamoDB and Kinesis calls wait a bounded time for their turn; past it they are
        # refused unapplied, as AWS throttles. Without the bound, a call queued behind a burst
        # could be applied after its caller timed out, and a put the publisher was told failed
        # would land in the stream after all.
        if not BACKEND_LOCK.acquire(timeout=LOCK_WAIT_BUDGET_S if bounded else -1):
            return (
                "503 Service Unavailable",
                [("Content-Type", "application/x-amz-json-1.1")],
                _UNAVAILABLE,
            )
        try:
            if self.failed:
                return "503 Service Unavailable", [("Content-Type", "text/plain")], _JOURNAL_FAILED
            journal = self.journal
            if journal is None or not mutating:
                answer = run()
            else:
                record = JournalRecord(
                    seq=journal.next_seq,
                    at_ms=self.clock_ms(),
                    environ=_journaled_environ(environ),
                    preserved_names=dict(environ.get(_PRESERVED_NAMES_KEY) or {}),
                    body=body,
                )
                with _Pinned(record.seq, record.at_ms):
                    answer = run()
                if answer[0].startswith("2"):
                    journal.stage(record)
                    if self.snapshots is not None and self.snapshots.due(record.seq):
                        self.snapshots.fork(record.seq)
            # whatever this request saw: every change staged so far
            seen = journal.staged_seq if journal is not None else None
        finally:
            BACKEND_LOCK.release()
        if target.startswith(SQS_SEND) and answer[0].startswith("2"):
            # the queue's poller (``shoal.local.esm.queues``) waits for this, not a timer
            QUEUE_SENDS.notify(sent_queue(body))
        if journal is not None and seen is not None:
            try:
                journal.wait_durable(seen)
            except OSError:
                # moto has applied what the journal lacks: serve nothing more, so no client
                # observes state that a restart would not bring back
                self.failed = True
                log.critical("journal: append failed; refusing every further request")
                raise
        return answer

    def _run(self, environ: dict[str, Any]) -> tuple[str, list[tuple[str, str]], bytes]:
        return call_wsgi(self.app, environ)

    def replay(self) -> ReplayStats:
        """Apply every journaled request, in order, to the (fresh) backend."""
        journal = self.journal
        if journal is None:
            return ReplayStats(0, 0.0, 0, 0)
        from werkzeug.test import EnvironBuilder

        started = time.perf_counter()
        failures = 0
        # the environ werkzeug builds for a request, made once: each record's own keys go over
        # a copy of it (building it anew took a third of a record's replay)
        template = EnvironBuilder(method="POST", data=b"").get_environ()
        # the collector stays on: a record's answer leaves cyclic garbage (a snapshot's load
        # leaves none), and held off through thousands of records it left the process
        # fragmented for its life: 488 MB of RSS after replaying the 10-minute soak's 41,285
        # records, 152 MB with it on (the 30-minute soak's restarts settled 60 to 150 MB high)
        with BACKEND_LOCK:
            for record in journal.pending():
                environ = dict(template)
                environ.update(record.environ)
                environ["CONTENT_LENGTH"] = str(len(record.body))
                environ["wsgi.input"] = io.BytesIO(record.body)
                if record.preserved_names:
                    environ[_PRESERVED_NAMES_KEY] = dict(record.preserved_names)
                # a DynamoDB, Kinesis or SQS call goes to moto's handler as it went live in-process
                # (``serve_in_process``), not through Flask's routing: most of a journal, and
                # a restart's time grows with it
                handler = _direct_handler(record.environ.get("HTTP_X_AMZ_TARGET"))
                with _Pinned(record.seq, record.at_ms):
                    if handler is not None:
                        status, _, _ = _call_handler(handler, environ)
                    else:
                        status, _, _ = self._run(environ)
                if not status.startswith("2"):
                    failures += 1
                    log.warning("journal: record %d replayed with %s", record.seq, status)
        return ReplayStats(
            journal.pending_count,
            time.perf_counter() - started,
            failures,
            journal.dropped_tail_bytes,
        )


@functools.cache
def _direct_handlers() -> dict[str, type]:
    """moto's handlers of the JSON-protocol services, by their ``X-Amz-Target`` prefix."""
    from moto.dynamodb.responses import DynamoHandler
    from moto.kinesis.responses import KinesisResponse
    from moto.sqs.responses import SQSResponse

    return {
        "DynamoDB_20120810": DynamoHandler,
        "Kinesis_20131202": KinesisResponse,
        "AmazonSQS": SQSResponse,
    }


def _direct_handler(target: str | None) -> type | None:
    """moto's handler of a JSON-protocol call by its ``X-Amz-Target`` (None: not such a call)."""
    return _direct_handlers().get(target.split(".", 1)[0]) if target else None


def _call_handler(
    handler: type, environ: dict[str, Any]
) -> tuple[str, list[tuple[str, str]], bytes]:
    """One call of a moto handler on a request made from ``environ``, answered as moto's Flask
    front answers it: an HTTP error (moto's ``JsonRESTError``) is its own answer, a botocore
    ``ClientError`` a 400. The handler is set up without werkzeug's parsing when the call is a
    plain JSON one (``shoal.local.moto_json``), else by moto's own ``setup_class``."""
    from botocore.exceptions import ClientError
    from moto.core.request import Request
    from werkzeug.exceptions import HTTPException

    normalized = Request(environ)
    response = handler()
    try:
        if moto_json.setup(response, normalized, environ, environ["wsgi.input"].getvalue()):
            status, headers, content = response.call_action()
        else:
            status, headers, content = response._dispatch(
                normalized, normalized.raw_url, normalized.headers
            )
    except HTTPException as exc:
        status, headers, content = exc.code or 500, exc.get_headers(), exc.get_body()
    except ClientError as exc:
        status, headers, content = 400, {}, exc.response["Error"]["Message"]
    pairs = list(headers.items()) if isinstance(headers, dict) else list(headers)
    payload = content.encode("utf-8") if isinstance(content, str) else bytes(content)
    return f"{int(status)} {_reason(int(status))}", [(str(k), str(v)) for k, v in pairs], payload


def _reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""


# --- the server ------------------------------------------------------------------------------


class EndpointSession(boto3.Session):
    """A boto3 session whose clients and resources talk to one endpoint (the emulator)."""

    def __init__(self, endpoint_url: str, **kwargs: Any) -> None:
        kwargs.setdefault("region_name", "us-east-1")
        kwargs.setdefault("aws_access_key_id", "testing")
        kwargs.setdefault("aws_secret_access_key", "testing")
        kwargs.setdefault("aws_session_token", "testing")
        super().__init__(**kwargs)
        self.endpoint_url = endpoint_url

    def client(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("endpoint_url") is None:
            kwargs["endpoint_url"] = self.endpoint_url
        return super().client(*args, **kwargs)

    def resource(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("endpoint_url") is None:
            kwargs["endpoint_url"] = self.endpoint_url
        return super().resource(*args, **kwargs)


def reset_backends() -> None:
    """Empty moto's process-wide backends (they outlive any one server object)."""
    from moto.moto_api._internal.models import moto_api_backend

    moto_api_backend.reset()


class EmbeddedAws:
    """moto on ``host:port`` (port 0: any free port), serialized, journaled under ``state_dir``.

    moto's backends are process-wide, so one EmbeddedAws runs per process at a time; ``start``
    empties them before replaying the journal. With ``in_process`` (the default), SDK clients
    made in this process after ``start`` reach it without a socket (``shoal.local.transport``).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        state_dir: Path | None = None,
        *,
        in_process: bool = True,
        throttles: Throttles | None = None,
    ) -> None:
        self.host = host
        self.throttles = throttles
        self.in_process = in_process
        self._transport: InProcessTransport | None = None
        self.port = port
        self.state_dir = state_dir
        self.journal: Journal | None = None
        self.replay_stats = ReplayStats(0, 0.0, 0, 0)
        #: the snapshot the last start loaded (None: none, or one it could not load)
        self.snapshot: snapshot.Loaded | None = None
        #: snapshots of this life, and the last journal record the newest holds
        self._snapshots: snapshot.Snapshotter | None = None
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._app: SerializedApp | None = None

    def throttle(self, throttles: Throttles | None) -> None:
        """Refuse calls as ``throttles`` say from now on (``SHOAL_DEV_THROTTLE``; None: none)."""
        self.throttles = throttles
        if self._app is not None:
            self._app.throttles = throttles

    def start(self) -> None:
        _MotoClock.install()
        adapt_moto()
        from moto.moto_server.werkzeug_app import (
            DomainDispatcherApplication,
            MotoRequestHandler,
            create_backend_app,
        )
        from werkzeug.serving import make_server

        class Dispatcher(DomainDispatcherApplication):
            # moto answers "which backend serves this host" by scanning its package folders on
            # every request (~1.5 ms); the answer never changes while the process runs
            def __init__(self) -> None:
                super().__init__(create_backend_app)
                self._backends: dict[str | None, Any] = {}

            def get_backend_for_host(self, host: str | None) -> Any:
                if host not in self._backends:
                    self._backends[host] = super().get_backend_for_host(host)
                return self._backends[host]

        class QuietHandler(MotoRequestHandler):
            # werkzeug logs every request line; the runtime logs its own, without payloads
            def log_request(self, *args: Any, **kwargs: Any) -> None:
                pass

        reset_backends()
        if self.state_dir is not None:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            # moto as of the snapshot's last record, then the journal's records after it
            self.snapshot = snapshot.load(self.state_dir)
            if self.snapshot is None:
                reset_backends()
            self.journal = Journal(self.state_dir / JOURNAL_FILE, after=self._snapshot_seq())
        app = SerializedApp(Dispatcher(), self.journal)
        self.replay_stats = app.replay()
        # after the replay: what a journal holds was answered, never refused
        app.throttles = self.throttles
        self._app = app
        if self.snapshot is not None:
            log.info(
                "snapshot: loaded %d MB in %.2f s (through record %d)",
                self.snapshot.size // 1_000_000,
                self.snapshot.seconds,
                self.snapshot.seq,
            )
        if self.replay_stats.records:
            log.info(
                "journal: replayed %d requests in %.2f s (%d failed)",
                self.replay_stats.records,
                self.replay_stats.seconds,
                self.replay_stats.failures,
            )
        if self.state_dir is not None:
            self._snapshots = snapshot.Snapshotter(self.state_dir, self._snapshot_seq())
            # nothing serves yet: moto holds exactly the journal's records
            self._snapshot_if_due()
            app.snapshots = self._snapshots
        self._server = make_server(
            self.host, self.port, app, threaded=True, request_handler=QuietHandler
        )
        self.port = self._server.server_address[1]
        if self.in_process:
            # this process's SDK calls to the emulator skip the socket (shoal.local.transport)
            self._transport = InProcessTransport(self.url, app)
            self._transport.install()
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="shoal-aws", daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def session(self) -> EndpointSession:
        return EndpointSession(self.url)

    def stop(self) -> None:
        if self._transport is not None:
            self._transport.uninstall()
            self._transport = None
        if self._server is not None:
            if self._thread is not None:
                self._server.shutdown()
                self._thread.join(timeout=10)
                self._thread = None
            self._server.server_close()
            self._server = None
        if self._app is not None:
            self._app.snapshots = None
        if self._snapshots is not None:
            self._snapshots.wait()  # a child writing one finishes first
        with BACKEND_LOCK:
            if self.journal is not None:
                self.journal.close()
                # nothing changes moto now: a clean stop's snapshot spares the next start
                # this life's records
                self._snapshot_if_due()
                self.journal = None

    def _snapshot_seq(self) -> int:
        """The last journal record the loaded snapshot holds (-1: none was loaded)."""
        return self.snapshot.seq if self.snapshot is not None else -1

    def _snapshot_if_due(self) -> None:
        """A snapshot of moto as of the journal's last record, once ``SNAPSHOT_AFTER`` records
        came after the last one (the caller holds moto still). Best effort: a failed write
        leaves the journal to replay, as before."""
        journal, state_dir, snapshots = self.journal, self.state_dir, self._snapshots
        if journal is None or state_dir is None or snapshots is None:
            return
        if journal.staged_seq - snapshots.last_seq < snapshot.SNAPSHOT_AFTER:
            return
        started = time.perf_counter()
        try:
            size = snapshot.write(state_dir, journal.staged_seq)
        except (OSError, ValueError, pickle.PicklingError, TypeError, AttributeError) as exc:
            log.warning("snapshot: not written (%s)", type(exc).__name__)
            return
        snapshots.last_seq = journal.staged_seq
        log.info(
            "snapshot: wrote %d MB in %.2f s (through record %d)",
            size // 1_000_000,
            time.perf_counter() - started,
            journal.staged_seq,
        )

    def __enter__(self) -> EmbeddedAws:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()
