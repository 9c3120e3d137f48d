"""A small HTTP client for the Shoal API that survives lost answers and its own crashes.

    client = ShoalClient(url, token, client_id="sensor-7", state="sensor-7.json")
    client.publish("sensors/7/temp", text="21.5")          # publisher_seq chosen and kept
    client.subscribe(["alerts/#"], qos=1)                    # connects on demand
    for message in client.messages():                        # acked once you ask for the next
        handle(message)

Retries (the lazy pirate pattern). Every request has a timeout; a request that times out, loses
its connection or is answered 429, 502, 503 or 504 is sent again after an exponential backoff
with jitter (``Retry-After`` is honoured up to the largest backoff), at most
``CallRetry.attempts`` times, then ``Unavailable`` is raised. Every call is safe to repeat:
a publish carries its sequence number, connect its ``connect_token``, acks and subscribes
are idempotent, and a lost ``GET .../messages`` answer only delays those messages until they are
delivered again. ``409 session_taken_over`` is never retried: another channel owns the client
id now, so the client forgets its channel, raises ``SessionTakenOver``, and connects again (not
starting clean) only when it is asked to do another session call.

Tokens. ``token`` is a JWT, or a ``TokenSource`` (``shoal.client.tokens``: a file or a command
read again when the token is due): a token about to expire is renewed before a request, and a
401 is answered by sending again with a renewed token when the source has one; with none, the
401 is final.

Outages. ``messages()`` outlives a lost server: when a call gets no answer after its retries
(``Unavailable``), the loop says so once (``on_outage``, else a warning of the
``shoal.client`` logger), tries again for ever with capped backoff (``Outages``), then resumes
its session: the old channel if the server still knows it, else a new connect that resumes the
session (not starting clean) and subscribes again when the session did not survive. Only a
permanent refusal (403, a refused token without a renewal) ends it.

Crash safety. The client keeps a small state file, rewritten atomically (temporary file, fsync,
rename, fsync of the folder) and locked for the life of the client. Everything in it is keyed by
(URL, principal), the principal being the token's ``sub`` read without verifying it: what was
left for one server or principal is never sent to another. It holds:

- per publisher id, the last sequence number the server accepted and the publishes *in flight*
  (seq and body each). They are written before they are sent, so a client killed at any point
  resends them with the same seqs: publishing the same message again after a restart reuses
  its seq (the server answers ``duplicate``), and publishing a different one first finishes
  them (``on_resend`` is told). The next seq always continues after the last one;
- per client id, the ids of recently processed messages (a bounded, most-recent window). An id
  is recorded before it is acked; a message redelivered because its ack was lost is acked
  again without being handed to the application.

Batching. ``publish_many`` numbers a list of messages, writes them in one state write and sends
them as ``POST /v1/messages:batch`` (``BatchSettings`` bounds a request's count and bytes);
``batch_publisher()`` batches by count, bytes and delay in a thread (``shoal.client.batch``).
A message the server refuses is settled with its error; the messages after it then get
``409 publisher_seq_gap`` with the seq the server expects, and are renumbered from it, in order
(a seq is only reused when the server says it holds nothing from it on).

A message counts as processed once the application asks ``messages()`` for the next one (or
calls ``ack``); with ``auto_ack=False`` it stays outstanding until ``mark_processed``, and
``FlowControl`` bounds how many messages and bytes are outstanding (no fetch while full).
One that was being processed when the process died comes again: processing is
at-least-once at that boundary, unless the application records its own progress atomically
with its side effect.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

import requests

from shoal import __version__
from shoal.client.batch import BatchPublisher
from shoal.client.errors import (
    ApiError,
    ClientError,
    SessionTakenOver,
    Unavailable,
    error_of,
    retry_after,
)
from shoal.client.publishing import Publishing
from shoal.client.state import ClientState
from shoal.client.support import (
    BatchSettings,
    CallRetry,
    Connection,
    FlowControl,
    Outages,
    ReceivedMessage,
    check_url,
    principal_of,
)
from shoal.client.tokens import StaticToken, TokenKeeper, TokenSource
from shoal.core.clock import Clock, SystemClock

logger = logging.getLogger("shoal.client")

CHANNEL_HEADER = "Shoal-Channel"
#: ids per ack request (the API's limit)
MAX_ACK_IDS = 1000
#: the pause between empty polls when the poll itself waits less than this
IDLE_POLL_MS = 500
#: a member of a shared group heartbeats this often (a third of the server's default group lease
#: timeout, 6 s) and long-polls no longer, or it loses its group streams between two heartbeats
GROUP_HEARTBEAT_MS = 2_000


class ShoalClient(Publishing):
    """One principal's client: a publisher (``publisher_id``) and a session (``client_id``).

    ``token``: a JWT, or where to read one again (``shoal.client.tokens``). ``http`` is the
    transport (a ``requests.Session``; tests mount a fake adapter on it), ``clock`` gives the
    time for keepalives and the sleeps between retries, ``rng`` the jitter.
    """

    def __init__(
        self,
        url: str,
        token: str | TokenSource | TokenKeeper,
        *,
        client_id: str | None = None,
        publisher_id: str | None = None,
        state: ClientState | str | Path | None = None,
        policy: CallRetry | None = None,
        http: requests.Session | None = None,
        clock: Clock | None = None,
        rng: random.Random | None = None,
        on_resend: Callable[[list[dict[str, Any]]], None] | None = None,
    ) -> None:
        # refused before the state file is opened: nothing is kept under a URL that is none
        self.url = check_url(url)
        if isinstance(token, str):
            token = StaticToken(token)
        self.tokens = token if isinstance(token, TokenKeeper) else TokenKeeper(token)
        self.client_id = client_id
        #: whose sequences and sessions these are: the token's subject (read, not verified)
        self.principal = principal_of(self.tokens.token())
        self.state = state if isinstance(state, ClientState) else ClientState(state)
        self.state.use_scope((self.url, self.principal))
        self._publisher_id = publisher_id
        self._named_publisher = publisher_id is not None
        #: called with the bodies of publishes an earlier run left in flight, before they are
        #: sent again (the CLI says so on stderr)
        self.on_resend = on_resend
        # marks the in-flight entries this client made, to tell them from an earlier run's
        self._run = uuid.uuid4().hex[:12]
        #: HTTP requests sent, retries included (requests per message in the bench and tests)
        self.requests_sent = 0
        self.policy = policy or CallRetry()
        self.http = http or requests.Session()
        self.clock = clock or SystemClock()
        self.rng = rng or random.Random()
        self.connection: Connection | None = None
        self._connect_options: dict[str, Any] = {}
        self._last_heartbeat_ms = 0
        # a $share/ filter was subscribed through this client: heartbeat for its group leases
        self._in_group = False
        # every subscription made through this client, by filter: made again after an outage
        # that the session did not survive
        self._subscriptions: dict[str, dict[str, Any]] = {}
        # processed (recorded) ids whose ack has not been sent yet
        self._unacked: list[str] = []
        # handed out without auto_ack and not processed yet: id -> payload bytes (flow control)
        self._outstanding: dict[str, int] = {}
        self._outstanding_changed = threading.Condition(threading.RLock())

    def __enter__(self) -> ShoalClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, *, disconnect: bool = False) -> None:
        """Send pending acks (best effort), optionally disconnect, release the state file."""
        try:
            if self.connection is not None:
                with contextlib.suppress(ClientError):
                    self.flush_acks()
                if disconnect:
                    with contextlib.suppress(ClientError):
                        self.disconnect()
        finally:
            self.state.close()
            self.http.close()

    # -- requests -----------------------------------------------------------------------

    def _send(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: Mapping[str, Any] | None = None,
        channel: str | None = None,
        extra_wait_s: float = 0.0,
    ) -> tuple[Any, bool]:
        """One call with retries: the parsed answer, and whether an earlier attempt's outcome is
        unknown (it may have been carried out though its answer never came)."""
        uncertain = False
        last: ApiError | None = None
        renewals = 0
        attempt = -1
        while attempt + 1 < self.policy.attempts:
            attempt += 1
            if attempt:
                wait_s = retry_after(last)
                self.clock.sleep(self.policy.delay_s(attempt - 1, self.rng, wait_s))
            token = self.tokens.token()
            headers = {
                "Authorization": f"Bearer {token}",
                "User-Agent": f"shoal-client/{__version__}",
            }
            if channel is not None:
                headers[CHANNEL_HEADER] = channel
            self.requests_sent += 1
            try:
                response = self.http.request(
                    method,
                    self.url + path,
                    json=body,
                    params=params,
                    headers=headers,
                    timeout=(self.policy.timeout_s, self.policy.timeout_s + extra_wait_s),
                )
            except (
                requests.ConnectionError,
                requests.Timeout,
                # the answer's body cut short: the server or the connection died while it was
                # sent (a kill -9 of ``shoal dev`` mid-answer)
                requests.exceptions.ChunkedEncodingError,
            ) as exc:
                # the request may have arrived: only its answer is known to be lost
                uncertain = True
                last = Unavailable(0, "no_answer", type(exc).__name__, {})
                continue
            answer = _json(response)
            if 200 <= response.status_code < 300:
                return answer, uncertain
            error = error_of(response.status_code, answer, response.headers)
            if response.status_code == 401 and renewals == 0 and self._renewed(token):
                # the token expired (or was revoked) and its source has a new one: send it now,
                # once, without counting an attempt
                renewals += 1
                attempt -= 1
                continue
            if response.status_code in self.policy.retry_statuses:
                uncertain = uncertain or response.status_code != 429
                error.details.setdefault("retry_after", response.headers.get("Retry-After"))
                last = error
                continue
            if error.code == "session_taken_over":
                raise SessionTakenOver(error.status, error.code, error.message, error.details)
            error.details["uncertain"] = uncertain
            raise error
        assert last is not None
        raise Unavailable(
            last.status,
            last.code,
            f"{method} {path}: no answer after {self.policy.attempts} attempts ({last.message})",
            {"uncertain": uncertain},
        )

    def _renewed(self, refused: str) -> bool:
        """The server refused ``refused``: whether another token of the same principal is now
        at hand (a token of another principal would mix two principals' state: refused)."""
        if not self.tokens.refused(refused):
            return False
        if principal_of(self.tokens.token()) != self.principal:
            raise ClientError(
                f"{self.tokens.source.description} now holds a token of another principal "
                f"than {self.principal!r}"
            )
        return True

    def call(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: Mapping[str, Any] | None = None,
    ) -> Any:
        """One call of any route (the admin ones: topics, push subscriptions), with the same
        retries and errors as the rest; the parsed answer."""
        answer, _ = self._send(method, path, body=body, params=params)
        return answer

    def batch_publisher(self, settings: BatchSettings | None = None) -> BatchPublisher:
        """A publisher that batches by count, bytes and delay in a thread of its own (see
        ``shoal.client.batch``); close it (or use it as a context manager) to flush."""
        return BatchPublisher(self, settings or BatchSettings())

    # -- the session --------------------------------------------------------------------

    def _session_path(self, suffix: str = "") -> str:
        if self.client_id is None:
            raise ValueError("this client has no client_id")
        return f"/v1/sessions/{quote(self.client_id, safe='')}{suffix}"

    def connect(
        self,
        *,
        clean_start: bool = False,
        session_expiry_s: int = 3600,
        keepalive_s: int = 60,
        will: Mapping[str, Any] | None = None,
    ) -> Connection:
        """``PUT /v1/sessions/{client_id}``. The defaults keep the session across restarts."""
        body: dict[str, Any] = {
            "clean_start": clean_start,
            "session_expiry_s": session_expiry_s,
            "keepalive_s": keepalive_s,
        }
        if will is not None:
            body["will"] = dict(will)
        # one token for this connect's retries: a retry whose earlier try registered (its
        # answer lost) gets that channel back, not a newer one that takes it over and
        # publishes its will. No connected_at_ms: a retry after a lost channel is newer.
        token = {"connect_token": uuid.uuid4().hex}
        answer, _ = self._send("PUT", self._session_path(), body={**body, **token})
        self.connection = Connection(
            session_present=bool(answer["session_present"]),
            channel=str(answer["channel"]),
            keepalive_s=int(answer.get("keepalive_s", keepalive_s)),
        )
        # a connect on demand later resumes this session rather than starting a new one
        self._connect_options = {**body, "clean_start": False}
        self._last_heartbeat_ms = self.clock.now_ms()
        return self.connection

    def _channel(self) -> str:
        if self.connection is None:
            options = self._connect_options or {}
            self.connect(**options)
        assert self.connection is not None
        return self.connection.channel

    def _session_call(
        self,
        method: str,
        suffix: str,
        *,
        body: Any = None,
        params: Mapping[str, Any] | None = None,
        extra_wait_s: float = 0.0,
    ) -> Any:
        channel = self._channel()
        try:
            answer, _ = self._send(
                method,
                self._session_path(suffix),
                body=body,
                params=params,
                channel=channel,
                extra_wait_s=extra_wait_s,
            )
        except SessionTakenOver:
            self.connection = None
            raise
        return answer

    def call_session(self, method: str, suffix: str, *, body: Any = None) -> Any:
        """One call of a session route (``suffix`` after ``/v1/sessions/{client_id}``) on
        this client's channel, connecting on demand."""
        return self._session_call(method, suffix, body=body)

    def disconnect(self) -> None:
        """``DELETE /v1/sessions/{client_id}``: a clean end, no will."""
        if self.connection is None:
            return
        self._session_call("DELETE", "")
        self.connection = None

    def heartbeat(self) -> dict[str, Any]:
        answer: dict[str, Any] = self._session_call("POST", "/heartbeat") or {}
        self._last_heartbeat_ms = self.clock.now_ms()
        return answer

    def _heartbeat_if_due(self) -> None:
        if self.connection is None:
            return
        # twice per keepalive, so one lost heartbeat never lets the server expire the channel
        due_ms = self.connection.keepalive_s * 500 if self.connection.keepalive_s > 0 else None
        if self._in_group:
            due_ms = min(due_ms or GROUP_HEARTBEAT_MS, GROUP_HEARTBEAT_MS)
        if due_ms is not None and self.clock.now_ms() - self._last_heartbeat_ms >= due_ms:
            self.heartbeat()

    def subscribe(
        self,
        filters: str | Sequence[str | Mapping[str, Any]],
        *,
        qos: int = 1,
    ) -> list[Any]:
        """Subscribe with one or more filters (strings take ``qos``; mappings are sent as they
        are); the granted QoS or error code of each, in order."""
        items = [filters] if isinstance(filters, str) else list(filters)
        subscriptions = [
            {"filter": item, "qos": qos} if isinstance(item, str) else dict(item) for item in items
        ]
        answer = self._session_call("POST", "/subscriptions", body={"subscriptions": subscriptions})
        if any(str(s.get("filter", "")).startswith("$share/") for s in subscriptions):
            self._in_group = True
        granted = list(answer.get("granted", []))
        for subscription, outcome in zip(subscriptions, granted, strict=False):
            if isinstance(outcome, int):
                self._subscriptions[str(subscription["filter"])] = subscription
        return granted

    def unsubscribe(self, filters: str | Sequence[str]) -> None:
        items = [filters] if isinstance(filters, str) else list(filters)
        self._session_call("POST", "/unsubscribe", body={"filters": items})
        for item in items:
            self._subscriptions.pop(item, None)

    # -- receiving ----------------------------------------------------------------------

    def fetch(self, max_messages: int = 10, wait_ms: int = 0) -> list[ReceivedMessage]:
        """One ``GET .../messages``: the messages not processed yet. Redelivered ones that were
        processed (their ack was lost) are queued to be acked again, not returned."""
        self._heartbeat_if_due()
        if self._in_group:
            wait_ms = min(wait_ms, GROUP_HEARTBEAT_MS)
        answer = self._session_call(
            "GET",
            "/messages",
            params={"max": max_messages, "wait_ms": wait_ms},
            extra_wait_s=wait_ms / 1000,
        )
        assert self.client_id is not None
        fresh: list[ReceivedMessage] = []
        seen: set[str] = set()
        for raw in answer.get("messages", []):
            message = ReceivedMessage.from_api(raw)
            if message.id in seen:
                continue
            seen.add(message.id)
            if self.state.was_processed(self.client_id, message.id):
                self._unacked.append(message.id)
            else:
                fresh.append(message)
        return fresh

    def mark_processed(self, *messages: ReceivedMessage | str) -> None:
        """Record messages as processed (durably) and queue their acks for ``flush_acks``.

        Safe from any thread: a receiving loop with ``auto_ack=False`` sends the acks and
        fetches again once flow control has room."""
        assert self.client_id is not None
        ids = [m.id if isinstance(m, ReceivedMessage) else m for m in messages]
        with self._outstanding_changed:
            self.state.record_processed(self.client_id, ids)
            self._unacked.extend(i for i in ids if i not in self._unacked)
            for message_id in ids:
                self._outstanding.pop(message_id, None)
            self._outstanding_changed.notify_all()

    def flush_acks(self) -> int:
        """``POST .../acks`` with every processed id not acked yet; the number acked now."""
        acked = 0
        while True:
            with self._outstanding_changed:
                ids = self._unacked[:MAX_ACK_IDS]
            if not ids:
                return acked
            answer = self._session_call("POST", "/acks", body={"ids": ids})
            with self._outstanding_changed:
                del self._unacked[: len(ids)]
            acked += int((answer or {}).get("acked", len(ids)))

    def ack(self, *messages: ReceivedMessage | str) -> int:
        """Record the messages as processed, then ack them (and any queued acks) now."""
        self.mark_processed(*messages)
        return self.flush_acks()

    def _room(self, flow: FlowControl | None, wanted: int) -> int:
        """How many messages a fetch may ask for under ``flow`` (0: wait for acks)."""
        if flow is None:
            return wanted
        with self._outstanding_changed:
            held = len(self._outstanding)
            held_bytes = sum(self._outstanding.values())
        if held >= flow.max_messages or held_bytes >= flow.max_bytes:
            return 0
        return min(wanted, flow.max_messages - held)

    def messages(
        self,
        *,
        max_messages: int = 10,
        wait_ms: int = 20_000,
        count: int | None = None,
        flow: FlowControl | None = None,
        auto_ack: bool = True,
        until_ms: int | None = None,
        outages: Outages | None = None,
        on_outage: Callable[[str], None] | None = None,
    ) -> Iterator[ReceivedMessage]:
        """Messages in order, each once.

        With ``auto_ack`` (the default), asking for the next one marks the previous processed;
        acks go out in one request before each fetch and when the iteration ends. Without it,
        a message stays outstanding until ``mark_processed`` (from any thread) or ``ack``, and
        ``flow`` bounds what is outstanding: no fetch while it is full. ``until_ms`` (the
        client clock's time) ends the iteration then, whatever ``count`` says. A lost server is
        ridden out as ``outages`` says (default: for ever), each outage told once as it starts
        and once as it ends to ``on_outage`` (default: the ``shoal.client`` logger).
        """
        outages = outages or Outages()
        say = on_outage or logger.warning
        handed = 0
        try:
            while count is None or handed < count:
                if until_ms is not None:
                    left_ms = until_ms - self.clock.now_ms()
                    if left_ms <= 0:
                        return
                    wait_ms = min(wait_ms, left_ms)
                wanted = max_messages if count is None else min(max_messages, count - handed)
                try:
                    self.flush_acks()
                    room = self._room(flow, wanted)
                    if room == 0:
                        # full: wait for acks, heartbeating so the session and leases stay alive
                        self._heartbeat_if_due()
                        with self._outstanding_changed:
                            self._outstanding_changed.wait(IDLE_POLL_MS / 1000)
                        continue
                    batch = self.fetch(room, wait_ms)
                except Unavailable as exc:
                    if not outages.forever:
                        raise
                    if not self._ride_out(exc, outages, say, until_ms):
                        return
                    continue
                if not batch and not self._unacked and wait_ms < IDLE_POLL_MS:
                    # the server did not wait: do not ask again at once
                    self.clock.sleep(IDLE_POLL_MS / 1000)
                for message in batch:
                    if count is not None and handed >= count:
                        break  # the rest stay in flight and come again
                    handed += 1
                    if not auto_ack:
                        with self._outstanding_changed:
                            self._outstanding[message.id] = len(message.payload)
                    yield message
                    if auto_ack:
                        self.mark_processed(message)
        finally:
            # best effort: a processed id that misses its ack is acked when it comes again
            if self.connection is not None:
                with contextlib.suppress(ClientError):
                    self.flush_acks()

    def _ride_out(
        self,
        lost: Unavailable,
        outages: Outages,
        say: Callable[[str], None],
        until_ms: int | None,
    ) -> bool:
        """Wait out a lost server and resume the session; False if ``until_ms`` came first.

        Raises only what is permanent (any ``ApiError`` but ``Unavailable``)."""
        say(
            f"lost {self.url} ({lost.message}); trying again, at most every "
            f"{outages.max_s:g} s, until it answers"
        )
        for _ in outages.pauses(self.clock, self.rng, until_ms):
            try:
                how = self._resume()
            except Unavailable:
                continue
            say(f"{self.url} answers again; {how}")
            return True
        return False

    def _resume(self) -> str:
        """After an outage: the old channel if the server still knows it, else a connect that
        resumes the session (and subscribes again if the session was lost); what was done."""
        if self.connection is not None:
            try:
                self.heartbeat()
                return "the session goes on"
            except SessionTakenOver:
                pass  # the channel expired meanwhile (its keepalive ran out): connect again
            except ApiError as exc:
                if exc.code != "session_not_found":
                    raise
        self.connection = None
        connection = self.connect(**self._connect_options)
        if connection.session_present:
            return "the session was resumed"
        if self._subscriptions:
            self.subscribe(list(self._subscriptions.values()))
        return "the session had ended: a new one, subscribed again"


def _json(response: requests.Response) -> Any:
    if not response.content:
        return None
    try:
        return response.json()
    except ValueError:
        return None
