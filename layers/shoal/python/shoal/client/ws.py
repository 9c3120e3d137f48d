"""A session over Shoal's WebSocket API: deliveries pushed, each processed once, across reconnects.

    client = ShoalWsClient(ws_url, token, client_id="sensor-7", state="sensor-7.json",
                           flow=FlowControl(max_messages=50))
    client.subscribe(["alerts/#"], qos=1)                    # connects on demand
    for message in client.messages():                        # acked once you ask for the next
        handle(message)

It holds one WebSocket connection (``websockets.sync.client``) and speaks the frames of
``shoal.edge.frames`` (``docs/asyncapi.yaml``). It reuses the HTTP client's pieces
(``shoal.client.http``): the state file, token sources, errors, ``FlowControl``, ``Outages``.

Sessions. The first connect takes ``clean_start`` as given; every later one resumes the
session (``clean_start`` false), and when the server answers ``session_present`` false (the
session expired meanwhile) the client subscribes again with every subscription it made.

Reconnects. Any loss (a server restart, a close 1001 or 1006, a ``ping`` left unanswered for
``WsSettings.pong_timeout_s``) is ridden out by ``messages()`` as the HTTP client rides out an
outage: said once as it starts and once as it ends (``on_outage``), tried again for ever with
capped exponential backoff and jitter (``Outages``), the token renewed before each handshake.
API Gateway closes every connection after 2 hours: the client opens a new one before that, at a
jittered moment, make-before-break (the new connection's ``renew`` moves the live channel to
it, or a ``connect`` takes the session over when the old one was lost meanwhile; the old one is
then closed), so nothing waits for a reconnect. Calls (``connect``, ``subscribe``, ...)
outside ``messages()`` try ``CallRetry.attempts`` times, then raise ``Unavailable``.

Flow control. ``flow.max_messages`` is the connection's ``receive_maximum`` (MQTT 5
§3.3.4): the server pushes no more QoS 1/2 deliveries than that unacked, so the client never
holds more than the application can. ``flow.max_bytes`` cannot be told to the server; the client
hands out no more messages while the outstanding ones (``auto_ack=False``) hold that many bytes.

Acks, exactly-once processing. A message counts as processed once the application asks
``messages()`` for the next one (or ``consume``'s handler returned, or ``mark_processed``): its
id is recorded in the state file, then its ack is held and sent with others
(``shoal.client.acks``: the delay, when acks go sooner, and the trade-off). A message handed
out but not processed (the handler raised, the loop was left) is handed out first by the next
``messages()`` of this client.

Keep-alive: ``shoal.client.wslink``. The keep-alive thread also sends held acks when their
delay ends and no loop is receiving (without it, ``WsSettings.keepalive_thread`` false, they
go with the next ``messages()`` or at ``close``).

Takeover. A newer connect for the client id elsewhere makes the server send ``disconnect``
with ``session_taken_over`` and close: the client forgets its connection and raises
``SessionTakenOver`` (from ``messages()`` or the call), and connects again (not clean) only
when asked for another session call, as the HTTP client does.

Never logged: tokens, payloads.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import threading
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from shoal import __version__
from shoal.client.acks import (
    ACK_POLL_S,
    DEFAULT_ACK_DELAY_S,
    HeldAcks,
)
from shoal.client.errors import (
    ApiError,
    ClientError,
    SessionTakenOver,
    Unavailable,
    error_of,
)
from shoal.client.state import ClientState
from shoal.client.support import (
    CallRetry,
    Connection,
    FlowControl,
    ReceivedMessage,
    principal_of,
)
from shoal.client.tokens import StaticToken, TokenKeeper, TokenSource
from shoal.client.wslink import (
    NORMAL_CLOSURE,
    Connector,
    HandshakeRefused,
    Link,
    LinkLost,
    Socket,
    WsSettings,
    check_ws_url,
    handshake_error,
    websockets_connector,
)
from shoal.client.wsloop import ReceivingLoop, _Busy, _TakenOver
from shoal.core.clock import Clock, SystemClock

logger = logging.getLogger("shoal.client")

#: MQTT 5 §3.1.2.11.3: Receive Maximum is at most 65,535
MAX_RECEIVE_MAXIMUM = 65_535
#: the receive maximum when no ``FlowControl`` is given (the server caps it at its own window)
DEFAULT_RECEIVE_MAXIMUM = 100
#: how long a session outlives its connection unless told (as ``ShoalClient.connect``)
DEFAULT_SESSION_EXPIRY_S = 3600


class ShoalWsClient(ReceivingLoop):
    """One principal's session (``client_id``) over the WebSocket API at ``url`` (ws://, wss://).

    ``token``: a JWT, or where to read one again (``shoal.client.tokens``). ``state_scope``: the
    URL the state file keeps the processed ids under (default ``url``). ``flow`` bounds what
    the application holds (``receive_maximum`` is its ``max_messages``). ``ack_delay_s``: how
    long processed ids are held to share one ack frame (0 to ``MAX_ACK_DELAY_S``; see the
    module's docstring for the trade-off). ``connector`` opens a
    connection (tests give a fake server), ``clock`` gives the time for keep-alives and the
    sleeps between retries, ``rng`` the jitter.
    """

    def __init__(
        self,
        url: str,
        token: str | TokenSource | TokenKeeper,
        *,
        client_id: str,
        state: ClientState | str | Path | None = None,
        state_scope: str | None = None,
        flow: FlowControl | None = None,
        ack_delay_s: float = DEFAULT_ACK_DELAY_S,
        policy: CallRetry | None = None,
        settings: WsSettings | None = None,
        connector: Connector | None = None,
        clock: Clock | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.url = check_ws_url(url)
        if isinstance(token, str):
            token = StaticToken(token)
        self.tokens = token if isinstance(token, TokenKeeper) else TokenKeeper(token)
        self.client_id = client_id
        self.principal = principal_of(self.tokens.token())
        self.state = state if isinstance(state, ClientState) else ClientState(state)
        # what the processed ids are kept under: the WebSocket URL unless told (``shoal
        # subscribe`` gives the HTTP API's URL, so that both transports share them: delivery
        # ids are the session's, whichever transport carried them)
        self.state.use_scope((state_scope or self.url, self.principal))
        self.flow = flow or FlowControl(max_messages=DEFAULT_RECEIVE_MAXIMUM)
        self.policy = policy or CallRetry()
        self.settings = settings or WsSettings()
        self.connector = connector or websockets_connector
        self.clock = clock or SystemClock()
        # processed (recorded) ids whose ack has not been sent yet (``shoal.client.acks``)
        self._acks = HeldAcks(ack_delay_s, self.clock)
        self.rng = rng or random.Random()
        #: connections opened (handshakes that succeeded): tests and the CLI's notes read it
        self.connections_opened = 0
        self._link: Link | None = None
        # sends (from the loop and the keep-alive thread) and link swaps
        self._lock = threading.RLock()
        # a connect on demand (a call before ``connect``) keeps the session, as connect's
        # defaults do
        self._connect_options: dict[str, Any] = {
            "clean_start": False,
            "session_expiry_s": DEFAULT_SESSION_EXPIRY_S,
        }
        self._subscriptions: dict[str, dict[str, Any]] = {}
        # received, not yet handed out, in order; their ids (to drop a second copy)
        self._buffer: deque[ReceivedMessage] = deque()
        # handed out and not processed yet, by id; the one auto_ack will mark
        self._outstanding: dict[str, ReceivedMessage] = {}
        self._outstanding_changed = threading.Condition(self._lock)
        # wakes the keep-alive thread: an ack was held (its delay may end before a keep-alive)
        self._wake = threading.Event()
        # answers to our frames by ref
        self._answers: dict[str, dict[str, Any]] = {}
        self._waiting: set[str] = set()
        self._internal_errors = 0
        self._closed = False
        self._keepalive: threading.Thread | None = None
        self._stop = threading.Event()

    def __enter__(self) -> ShoalWsClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def connection(self) -> Connection | None:
        """The live connection's session (``session_present``, ``channel``), if connected."""
        link = self._link
        return link.connection if link is not None else None

    @property
    def receive_maximum(self) -> int:
        """The window this connection was granted (the server's answer), else the one asked."""
        link = self._link
        if link is not None and link.receive_maximum:
            return link.receive_maximum
        return min(self.flow.max_messages, MAX_RECEIVE_MAXIMUM)

    def close(self, *, disconnect: bool = False) -> None:
        """Send held acks (best effort; before a disconnect, answered), optionally disconnect
        (no will), close, release the state file."""
        try:
            if self._link is not None:
                with contextlib.suppress(ClientError, LinkLost, _TakenOver, _Busy):
                    self._flush_acks(answered=disconnect)
                if disconnect:
                    with contextlib.suppress(ClientError, LinkLost, _TakenOver):
                        self.disconnect()
        finally:
            self._closed = True
            self._stop.set()
            self._wake.set()
            self._drop_link()
            self.state.close()

    # -- the connection -----------------------------------------------------------------

    def connect(
        self,
        *,
        clean_start: bool = False,
        session_expiry_s: int = DEFAULT_SESSION_EXPIRY_S,
        will: Mapping[str, Any] | None = None,
    ) -> Connection:
        """Open a connection and send ``connect``: the session resumes unless ``clean_start``.

        The defaults keep the session across restarts. Later reconnects resume it. Tries
        ``policy.attempts`` times (``Unavailable`` after); a refusal (401 without a renewed
        token, 403) raises at once."""
        options: dict[str, Any] = {"clean_start": clean_start, "session_expiry_s": session_expiry_s}
        if will is not None:
            options["will"] = dict(will)
        self._connect_options = options
        try:
            self._call_with_retries(self._reconnect, "connect")
        except _TakenOver:
            self._taken_over()
        connection = self.connection
        assert connection is not None
        return connection

    def _ensure_link(self) -> Link:
        if self._link is None:
            if self._closed:
                raise ClientError("this client is closed")
            self._call_with_retries(self._reconnect, "connect")
        assert self._link is not None
        return self._link

    def _reconnect(self) -> None:
        """A new connection holding the session (make-before-break: the old one, if any, is
        closed only once the new one's connect was answered). Raises ``LinkLost`` and
        ``ApiError``."""
        socket = self._open_socket()
        now = self.clock.now_ms()
        life_ms = self.settings.max_connection_s * 1000
        before_ms = self.settings.renew_before_s * 1000 * (1 + self.rng.random())
        link = Link(
            socket=socket,
            opened_ms=now,
            renew_at_ms=int(now + life_ms - before_ms),
            last_sent_ms=now,
            last_received_ms=now,
        )
        old = self._link
        try:
            answer = self._open_session(link, old)
        except BaseException:
            socket.close()
            raise
        link.connection = Connection(
            session_present=bool(answer.get("session_present")),
            channel=str(answer.get("channel", "")),
            keepalive_s=int(answer.get("keepalive_s", 0)),
        )
        link.receive_maximum = int(answer.get("receive_maximum") or 0)
        with self._lock:
            self._link = link
        # a later connect resumes this session rather than starting a new one
        self._connect_options = {**self._connect_options, "clean_start": False}
        self.connections_opened += 1
        if old is not None:
            old.socket.close()
        self._start_keepalive()
        if not link.connection.session_present and self._subscriptions:
            # the session did not survive: subscribe again with everything made before
            self._subscribe_on(link, list(self._subscriptions.values()))
        # acks of messages processed while no connection was open
        self._flush_acks()

    def _open_session(self, link: Link, old: Link | None) -> dict[str, Any]:
        """The new connection's first frame, answered: ``renew`` while the old connection
        still holds the session's live channel (before API Gateway's 2 hours: the channel
        and what is in flight carry over, no will, about half a connect's writes), else, or
        when the renewal is refused (the old connection was lost meanwhile), ``connect``."""
        if old is not None and old.connection is not None and old.connection.channel:
            renew = {
                "action": "renew",
                "client_id": self.client_id,
                "channel": old.connection.channel,
            }
            try:
                return self._ask_on(link, renew)
            except ApiError as exc:
                if exc.code != "renew_refused":
                    raise
                logger.info("the renewal was refused: connecting")
        return self._ask_on(
            link,
            {
                "action": "connect",
                "client_id": self.client_id,
                **self._connect_options,
                "receive_maximum": min(self.flow.max_messages, MAX_RECEIVE_MAXIMUM),
            },
        )

    def _open_socket(self) -> Socket:
        renewed = False
        while True:
            token = self.tokens.token()
            headers = {
                "Authorization": f"Bearer {token}",
                "User-Agent": f"shoal-client/{__version__}",
            }
            try:
                return self.connector(self.url, headers, self.settings.open_timeout_s)
            except HandshakeRefused as exc:
                if exc.status == 401 and not renewed and self._renewed(token):
                    # expired or revoked, and the source has another: send it now, once
                    renewed = True
                    continue
                raise handshake_error(exc) from exc

    def _renewed(self, refused: str) -> bool:
        if not self.tokens.refused(refused):
            return False
        if principal_of(self.tokens.token()) != self.principal:
            raise ClientError(
                f"{self.tokens.source.description} now holds a token of another principal "
                f"than {self.principal!r}"
            )
        return True

    def _drop_link(self, code: int = NORMAL_CLOSURE) -> None:
        with self._lock:
            link, self._link = self._link, None
        if link is not None:
            link.socket.close(code)

    def _call_with_retries(self, attempt: Callable[[], Any], what: str) -> Any:
        """``attempt`` until it does not lose its connection, ``policy.attempts`` times with
        backoff; a busy server (429, 5xx) counts as a loss."""
        last = ""
        for tried in range(self.policy.attempts):
            if tried:
                self.clock.sleep(self.policy.delay_s(tried - 1, self.rng))
            try:
                return attempt()
            except LinkLost as exc:
                self._drop_link()
                last = str(exc)
            except _Busy as exc:
                self._drop_link()
                last = exc.error.message
        raise Unavailable(
            0, "no_answer", f"{what}: no answer after {self.policy.attempts} attempts ({last})", {}
        )

    # -- sending and receiving frames -----------------------------------------------------

    def _send_on(self, link: Link, frame: Mapping[str, Any]) -> None:
        text = json.dumps(frame, separators=(",", ":"), ensure_ascii=False)
        with self._lock:
            link.socket.send(text)
            link.last_sent_ms = self.clock.now_ms()

    def _ask_on(self, link: Link, frame: Mapping[str, Any]) -> dict[str, Any]:
        """Send ``frame`` with a fresh ``ref`` and receive until its answer (other frames are
        handled meanwhile); the answer, or its error raised (``_Busy`` for 429/5xx)."""
        ref = uuid.uuid4().hex[:12]
        self._waiting.add(ref)
        try:
            self._send_on(link, {**frame, "ref": ref})
            deadline = self.clock.now_ms() + self.settings.answer_timeout_s * 1000
            internal_errors = self._internal_errors
            while ref not in self._answers:
                left_s = (deadline - self.clock.now_ms()) / 1000
                if left_s <= 0:
                    raise LinkLost(
                        f"no answer to {frame['action']} in {self.settings.answer_timeout_s:g} s"
                    )
                self._receive_on(link, left_s)
                if self._internal_errors != internal_errors and ref not in self._answers:
                    # API Gateway's answer when a function fails carries no ref: ours (the one
                    # frame waiting) may have failed. Every frame is safe to send again.
                    raise _Busy(ApiError(500, "internal_error", "Internal server error", {}))
            answer = self._answers.pop(ref)
        finally:
            self._waiting.discard(ref)
            self._answers.pop(ref, None)
        if answer.get("action") == "error":
            error = error_of(int(answer.get("status", 500)), answer)
            if error.code == "session_taken_over":
                raise _TakenOver()
            if error.status in self.policy.retry_statuses or error.status >= 500:
                raise _Busy(error)
            raise error
        return answer

    def _receive_on(self, link: Link, timeout_s: float) -> bool:
        """Receive and handle one frame, waiting at most ``timeout_s``; False if none came."""
        try:
            text = link.socket.recv(max(timeout_s, 0))
        except TimeoutError:
            return False
        link.last_received_ms = self.clock.now_ms()
        link.ping_sent_ms = None
        try:
            frame = json.loads(text)
        except ValueError:
            logger.warning("a frame that is not JSON was ignored")
            return True
        if isinstance(frame, dict):
            self._handle(frame)
        return True

    def _handle(self, frame: dict[str, Any]) -> None:
        action = frame.get("action")
        ref = frame.get("ref")
        if action == "message":
            self._received(frame)
        elif action == "disconnect" and ref not in self._waiting:
            if frame.get("reason") == "session_taken_over":
                raise _TakenOver()
            # the server ends the connection (its close follows): reconnect and resume
            raise LinkLost(f"the server disconnected ({frame.get('reason')})")
        elif isinstance(ref, str) and ref in self._waiting:
            self._answers[ref] = frame
        elif action == "error":
            code = (frame.get("error") or {}).get("code") if isinstance(frame, dict) else None
            if code == "session_taken_over":
                raise _TakenOver()
            # an ack's refusal: the message comes again, and is acked again then
            logger.info("a frame was refused (%s %s)", frame.get("status"), code)
        elif action is None and frame.get("message") == "Internal server error":
            self._internal_errors += 1
            logger.info("the server failed a frame (Internal server error)")

    def _received(self, frame: dict[str, Any]) -> None:
        raw = {k: v for k, v in frame.items() if k != "action"}
        try:
            message = ReceivedMessage.from_api(raw)
        except (KeyError, TypeError, ValueError):
            logger.warning("a message frame without an id was ignored")
            return
        with self._lock:
            if self.state.was_processed(self.client_id, message.id):
                # redelivered because its ack was lost or still held (or the client was killed
                # inside its ack delay): ack again, never hand it out again
                self._hold_acks([message.id])
                return
            if message.id in self._outstanding or any(m.id == message.id for m in self._buffer):
                return  # a second copy (dup) of one held already
            self._buffer.append(message)

    # -- keep-alive and the connection's life ------------------------------------------

    def _ping_if_due(self) -> None:
        with self._lock:
            link = self._link
            if link is None:
                return
            frame = link.keepalive_frame(self.settings, self.clock.now_ms())
            if frame is not None:
                link.socket.send(frame)

    def _start_keepalive(self) -> None:
        if not self.settings.keepalive_thread or self._keepalive is not None:
            return

        def run() -> None:
            # wakes when the next keep-alive is due (at most 30 s apart, to see a new link):
            # a keep-alive sent late by a fixed wake-up period would need a wider margin
            # under the 10-minute idle limit, so more of them a month. It wakes too when held
            # acks are due: a handler that runs long would otherwise hold them past their delay
            while True:
                self._wake.wait(self._keepalive_wait_s())
                self._wake.clear()
                if self._stop.is_set():
                    return
                # a loss (or a takeover) is the receiving loop's to find and handle
                with contextlib.suppress(LinkLost, OSError, ClientError, _TakenOver):
                    self._ping_if_due()
                    self._flush_acks_if_due()

        self._keepalive = threading.Thread(target=run, name="shoal-ws-keepalive", daemon=True)
        self._keepalive.start()

    def _keepalive_wait_s(self) -> float:
        link = self._link
        if link is None:
            # the next connection sends what is held as it opens
            return 30.0
        due_ms = link.keepalive_due_ms(self.settings)
        if self._acks.due_ms is not None:
            due_ms = min(due_ms, self._acks.due_ms)
        due_s = (due_ms - self.clock.now_ms()) / 1000
        return min(max(due_s, 0.05), 30.0)

    def _wait_s(self, link: Link) -> float:
        """How long the loop may wait for a frame before it has something to do."""
        now = self.clock.now_ms()
        due = [link.keepalive_due_ms(self.settings), link.renew_at_ms]
        if link.ping_sent_ms is not None:
            due.append(link.ping_sent_ms + self.settings.pong_timeout_s * 1000)
        if self._acks.due_ms is not None:
            due.append(self._acks.due_ms)
        wait_s = max((min(due) - now) / 1000, 0.0)
        if self._outstanding:
            # acks marked from other threads go out within this
            wait_s = min(wait_s, ACK_POLL_S)
        return wait_s

    # -- session calls ------------------------------------------------------------------

    def _session_call(self, frame: Mapping[str, Any]) -> dict[str, Any]:
        """One frame answered on the live connection, connecting on demand; a lost connection
        is opened again and the frame sent again (every frame is safe to repeat)."""

        def attempt() -> dict[str, Any]:
            link = self._ensure_link()
            return self._ask_on(link, frame)

        try:
            result: dict[str, Any] = self._call_with_retries(attempt, str(frame["action"]))
        except _TakenOver:
            self._taken_over()
        return result

    def _taken_over(self) -> NoReturn:
        self._drop_link()
        raise SessionTakenOver(
            409, "session_taken_over", "a newer connect for this client id took the session", {}
        )

    def subscribe(
        self,
        filters: str | Sequence[str | Mapping[str, Any]],
        *,
        qos: int = 1,
    ) -> list[Any]:
        """Subscribe with one or more filters (strings take ``qos``; mappings are sent as they
        are); the granted QoS or error code of each, in order. Made again after a reconnect
        that found the session gone."""
        items = [filters] if isinstance(filters, str) else list(filters)
        subscriptions = [
            {"filter": item, "qos": qos} if isinstance(item, str) else dict(item) for item in items
        ]
        answer = self._session_call({"action": "subscribe", "subscriptions": subscriptions})
        granted = list(answer.get("granted", []))
        self._remember(subscriptions, granted)
        return granted

    def _subscribe_on(self, link: Link, subscriptions: list[dict[str, Any]]) -> None:
        answer = self._ask_on(link, {"action": "subscribe", "subscriptions": subscriptions})
        self._remember(subscriptions, list(answer.get("granted", [])))

    def _remember(self, subscriptions: list[dict[str, Any]], granted: list[Any]) -> None:
        for subscription, outcome in zip(subscriptions, granted, strict=False):
            if isinstance(outcome, int):
                self._subscriptions[str(subscription["filter"])] = subscription

    def unsubscribe(self, filters: str | Sequence[str]) -> list[Any]:
        items = [filters] if isinstance(filters, str) else list(filters)
        answer = self._session_call({"action": "unsubscribe", "filters": items})
        for item in items:
            self._subscriptions.pop(item, None)
        return list(answer.get("unsubscribed") or [])

    def disconnect(self, *, with_will: bool = False) -> None:
        """End the session's connection normally: no will (``with_will``: MQTT 5's
        "Disconnect with Will Message", the will follows after its delay)."""
        link = self._link
        if link is None:
            return
        frame: dict[str, Any] = {"action": "disconnect"}
        if with_will:
            frame["with_will"] = True
        try:
            self._ask_on(link, frame)
        except (LinkLost, _Busy):
            pass  # closed before the answer came: it was sent, the close follows anyway
        except _TakenOver:
            pass  # nothing of ours to end
        finally:
            self._drop_link()

    # -- receiving ----------------------------------------------------------------------

    def mark_processed(self, *messages: ReceivedMessage | str) -> None:
        """Record messages as processed (durably) and hold their acks. Safe from any
        thread: the acks go at their delay (``ack_delay_s``), or sooner."""
        ids = [m.id if isinstance(m, ReceivedMessage) else m for m in messages]
        with self._outstanding_changed:
            # recorded (durably) before its ack is held: a crash inside the delay brings the
            # message again, and it is acked again then, not handed out
            self.state.record_processed(self.client_id, ids)
            self._hold_acks(ids)
            for message_id in ids:
                self._outstanding.pop(message_id, None)
            self._outstanding_changed.notify_all()

    def ack(self, *messages: ReceivedMessage | str) -> None:
        """Record the messages as processed, then send their acks (and any queued) now."""
        self.mark_processed(*messages)
        self._ensure_link()
        try:
            self._flush_acks()
        except LinkLost:
            # the acks stay queued: the next connection sends them
            self._drop_link()
        except _TakenOver:
            self._taken_over()

    @property
    def ack_delay_s(self) -> float:
        return self._acks.delay_s

    def _hold_acks(self, ids: Sequence[str]) -> None:
        with self._lock:
            if self._acks.hold(ids):
                # the keep-alive thread sends them at the delay if no loop is receiving then
                self._wake.set()

    def _acks_due(self) -> bool:
        with self._lock:
            return self._acks.due(self.receive_maximum)

    def _flush_acks_if_due(self) -> int:
        return self._flush_acks() if self._acks_due() else 0

    def _window_shut(self) -> bool:
        """Whether the service's window is full as this client sees it: QoS 1/2 deliveries
        received and not acked yet (held here, handed out, or acks held) fill
        ``receive_maximum``, so it pushes nothing until an ack comes. Waiting for frames then
        would wait for the ack delay: the held acks go first."""
        with self._lock:
            held = sum(1 for m in self._buffer if m.qos > 0)
            held += sum(1 for m in self._outstanding.values() if m.qos > 0)
            return held + len(self._acks) >= self.receive_maximum

    def _flush_acks(self, *, answered: bool = False) -> int:
        """Every held ack now, one frame per 1000 ids; the ids sent. No answer is asked for (a
        lost ack means the message comes again, acked again then), but for the last frame
        when ``answered``: a disconnect sent next would not overtake it."""
        sent = 0
        while True:
            with self._lock:
                link = self._link
                if link is None or not self._acks:
                    return sent
                ids, last = self._acks.next_frame()
                if not (answered and last):
                    # no ref: an ack is answered only when asked (one billed message fewer)
                    self._send_on(link, {"action": "ack", "ids": ids})
                self._acks.sent(ids)
            if answered and last:
                # not held again if this fails: the ids are processed (the state file), so
                # their messages, sent again, are acked again then
                self._ask_on(link, {"action": "ack", "ids": ids})
            sent += len(ids)

    def _next_ready(self, flow_bytes: int) -> ReceivedMessage | None:
        """The next buffered message to hand out, if ``flow.max_bytes`` leaves room."""
        with self._lock:
            while self._buffer:
                message = self._buffer[0]
                if self.state.was_processed(self.client_id, message.id):
                    # processed meanwhile (a copy handed out earlier): ack again, skip
                    self._buffer.popleft()
                    self._hold_acks([message.id])
                    continue
                held = sum(len(m.payload) for m in self._outstanding.values())
                if self._outstanding and held + len(message.payload) > flow_bytes:
                    return None
                return self._buffer.popleft()
        return None

    def _wait_for_message(self, until_ms: int | None) -> ReceivedMessage | None:
        """The next message to hand out, receiving frames (and sending acks and pings, and
        renewing the connection before its end) until one is ready or ``until_ms`` came."""
        while True:
            link = self._ensure_link()
            # held acks whose delay ended (or half a window of them) go first
            self._flush_acks_if_due()
            message = self._next_ready(self.flow.max_bytes)
            if message is not None:
                return message
            if self._window_shut():
                # nothing comes until an ack opens the window: send the held ones now
                self._flush_acks()
            link.check(self.settings, self.clock.now_ms())
            if self.clock.now_ms() >= link.renew_at_ms:
                # before API Gateway's 2-hour close: a new connection takes the session over
                self._call_with_retries(self._reconnect, "connect")
                continue
            self._ping_if_due()
            wait_s = self._wait_s(link)
            if until_ms is not None:
                left_s = (until_ms - self.clock.now_ms()) / 1000
                if left_s <= 0:
                    return None
                wait_s = min(wait_s, left_s)
            self._receive_on(link, wait_s)
