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
a publish carries its sequence number, connect registers a newer channel, acks and subscribes
are idempotent, and a lost ``GET .../messages`` answer only delays those messages until they are
delivered again. ``409 session_taken_over`` is never retried: another channel owns the client
id now, so the client forgets its channel, raises ``SessionTakenOver``, and connects again (not
starting clean) only when it is asked to do another session call.

Crash safety. The client keeps a small state file, rewritten atomically (temporary file, fsync,
rename, fsync of the folder) and locked for the life of the client, with:

- per publisher id, the last sequence number the server accepted and the publish *in flight*
  (its seq and body). The in-flight publish is written before it is sent, so a client killed
  at any point resends it with the same seq: publishing the same message again after a
  restart reuses it (the server answers ``duplicate``), and publishing a different one first
  finishes the in-flight one. The next seq always continues after the last one;
- per client id, the ids of recently processed messages (a bounded, most-recent window). An id
  is recorded before it is acked; a message redelivered because its ack was lost is acked
  again without being handed to the application.

A message counts as processed once the application asks ``messages()`` for the next one (or
calls ``ack``). One that was being processed when the process died comes again: processing is
at-least-once at that boundary, unless the application records its own progress atomically
with its side effect.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import random
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

import requests

from shoal import __version__
from shoal.client.errors import (
    ApiError,
    ClientError,
    SessionTakenOver,
    Unavailable,
    error_of,
    retry_after,
)
from shoal.client.state import ClientState
from shoal.client.support import CallRetry, Connection, PublishResult, ReceivedMessage
from shoal.core.clock import Clock, SystemClock

CHANNEL_HEADER = "Shoal-Channel"
#: ids per ack request (the API's limit)
MAX_ACK_IDS = 1000
#: the pause between empty polls when the poll itself waits less than this
IDLE_POLL_MS = 500
#: a member of a shared group heartbeats this often (a third of the server's default group lease
#: timeout, 6 s) and long-polls no longer, or it loses its group streams between two heartbeats
GROUP_HEARTBEAT_MS = 2_000


def _digest(body: Mapping[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()


class ShoalClient:
    """One principal's client: a publisher (``publisher_id``) and a session (``client_id``).

    ``http`` is the transport (a ``requests.Session``; tests mount a fake adapter on it),
    ``clock`` gives the time for keepalives and the sleeps between retries, ``rng`` the jitter.
    """

    def __init__(
        self,
        url: str,
        token: str,
        *,
        client_id: str | None = None,
        publisher_id: str | None = None,
        state: ClientState | str | Path | None = None,
        policy: CallRetry | None = None,
        http: requests.Session | None = None,
        clock: Clock | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self._token = token
        self.client_id = client_id
        self.state = state if isinstance(state, ClientState) else ClientState(state)
        self._publisher_id = publisher_id
        self.policy = policy or CallRetry()
        self.http = http or requests.Session()
        self.clock = clock or SystemClock()
        self.rng = rng or random.Random()
        self.connection: Connection | None = None
        self._connect_options: dict[str, Any] = {}
        self._last_heartbeat_ms = 0
        # a $share/ filter was subscribed through this client: heartbeat for its group leases
        self._in_group = False
        # processed (recorded) ids whose ack has not been sent yet
        self._unacked: list[str] = []

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
        headers = {
            "Authorization": f"Bearer {self._token}",
            "User-Agent": f"shoal-client/{__version__}",
        }
        if channel is not None:
            headers[CHANNEL_HEADER] = channel
        uncertain = False
        last: ApiError | None = None
        for attempt in range(self.policy.attempts):
            if attempt:
                wait_s = retry_after(last)
                self.clock.sleep(self.policy.delay_s(attempt - 1, self.rng, wait_s))
            try:
                response = self.http.request(
                    method,
                    self.url + path,
                    json=body,
                    params=params,
                    headers=headers,
                    timeout=(self.policy.timeout_s, self.policy.timeout_s + extra_wait_s),
                )
            except (requests.ConnectionError, requests.Timeout) as exc:
                # the request may have arrived: only its answer is known to be lost
                uncertain = True
                last = Unavailable(0, "no_answer", type(exc).__name__, {})
                continue
            answer = _json(response)
            if 200 <= response.status_code < 300:
                return answer, uncertain
            error = error_of(response.status_code, answer, response.headers)
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

    # -- publishing ---------------------------------------------------------------------

    @property
    def publisher_id(self) -> str:
        """The given one, else one made once per state file (a restart keeps it)."""
        if self._publisher_id is None:
            self._publisher_id = self.state.default_publisher_id()
        return self._publisher_id

    @property
    def next_seq(self) -> int:
        """The seq the next publish will carry (the in-flight one's, if one is in flight)."""
        publisher = self.state.publisher(self.publisher_id)
        in_flight = publisher["in_flight"]
        return int(in_flight["seq"]) if in_flight else int(publisher["last_seq"]) + 1

    @property
    def pending_publish(self) -> dict[str, Any] | None:
        """The body of the publish in flight (sent but not known to be accepted), if any."""
        in_flight = self.state.publisher(self.publisher_id)["in_flight"]
        return dict(in_flight["body"]) if in_flight else None

    def publish(
        self,
        topic: str,
        *,
        text: str | None = None,
        payload: bytes | None = None,
        qos: int = 1,
        retain: bool = False,
        ordering_key: str | None = None,
        properties: Mapping[str, Any] | None = None,
    ) -> PublishResult:
        """Publish one message exactly once (``POST /v1/messages`` with the next seq).

        When a publish is in flight from before (its answer never came, or the process died),
        the same message reuses its seq, and a different one first finishes it.
        """
        if (text is None) == (payload is None):
            raise ValueError("give exactly one of text and payload")
        body: dict[str, Any] = {"topic": topic, "qos": qos, "retain": retain}
        if text is not None:
            body["text"] = text
        else:
            assert payload is not None
            body["payload"] = base64.b64encode(payload).decode("ascii")
        if ordering_key is not None:
            body["ordering_key"] = ordering_key
        if properties:
            body["properties"] = dict(properties)
        digest = _digest(body)
        publisher = self.state.publisher(self.publisher_id)
        in_flight = publisher["in_flight"]
        if in_flight is not None and in_flight["digest"] != digest:
            self.finish_pending()
        if publisher["in_flight"] is not None:
            return self._send_in_flight(publisher, fresh=False)
        publisher["in_flight"] = {
            "seq": int(publisher["last_seq"]) + 1,
            "digest": digest,
            "body": body,
        }
        # durable before it is sent: a crash from here on resends it with this seq
        self.state.save()
        return self._send_in_flight(publisher, fresh=True)

    def finish_pending(self) -> PublishResult | None:
        """Resend the publish in flight with its own seq, if there is one."""
        publisher = self.state.publisher(self.publisher_id)
        if publisher["in_flight"] is None:
            return None
        return self._send_in_flight(publisher, fresh=False)

    def _send_in_flight(self, publisher: dict[str, Any], *, fresh: bool) -> PublishResult:
        in_flight = publisher["in_flight"]
        seq = int(in_flight["seq"])
        request = {
            **in_flight["body"],
            "publisher_id": self.publisher_id,
            "publisher_seq": seq,
        }
        try:
            answer, _ = self._send("POST", "/v1/messages", body=request)
        except Unavailable:
            raise  # the outcome is unknown: it stays in flight
        except ApiError as exc:
            # Refused outright (invalid, forbidden, a seq gap): the seq is free again, unless
            # some earlier attempt, here or before a restart, may have been carried out.
            if fresh and not exc.details.get("uncertain"):
                publisher["in_flight"] = None
                self.state.save()
            raise
        publisher["last_seq"] = seq
        publisher["in_flight"] = None
        self.state.save()
        return PublishResult(
            message_id=str(answer["message_id"]),
            topic=str(answer.get("topic", request["topic"])),
            storage_topic=answer.get("storage_topic"),
            partition=answer.get("partition"),
            duplicate=bool(answer.get("duplicate", False)),
            publisher_id=self.publisher_id,
            publisher_seq=seq,
        )

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
        # a retried connect registers a newer channel than a lost one: no connected_at_ms
        answer, _ = self._send("PUT", self._session_path(), body=body)
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
        return list(answer.get("granted", []))

    def unsubscribe(self, filters: str | Sequence[str]) -> None:
        items = [filters] if isinstance(filters, str) else list(filters)
        self._session_call("POST", "/unsubscribe", body={"filters": items})

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
        """Record messages as processed (durably) and queue their acks for ``flush_acks``."""
        assert self.client_id is not None
        ids = [m.id if isinstance(m, ReceivedMessage) else m for m in messages]
        self.state.record_processed(self.client_id, ids)
        self._unacked.extend(i for i in ids if i not in self._unacked)

    def flush_acks(self) -> int:
        """``POST .../acks`` with every processed id not acked yet; the number acked now."""
        acked = 0
        while self._unacked:
            ids = self._unacked[:MAX_ACK_IDS]
            answer = self._session_call("POST", "/acks", body={"ids": ids})
            del self._unacked[: len(ids)]
            acked += int((answer or {}).get("acked", len(ids)))
        return acked

    def ack(self, *messages: ReceivedMessage | str) -> int:
        """Record the messages as processed, then ack them (and any queued acks) now."""
        self.mark_processed(*messages)
        return self.flush_acks()

    def messages(
        self, *, max_messages: int = 10, wait_ms: int = 20_000, count: int | None = None
    ) -> Iterator[ReceivedMessage]:
        """Messages in order, each once. Asking for the next one marks the previous processed;
        acks go out in one request before each fetch and when the iteration ends."""
        handed = 0
        try:
            while count is None or handed < count:
                self.flush_acks()
                wanted = max_messages if count is None else min(max_messages, count - handed)
                batch = self.fetch(wanted, wait_ms)
                if not batch and not self._unacked and wait_ms < IDLE_POLL_MS:
                    # the server did not wait: do not ask again at once
                    self.clock.sleep(IDLE_POLL_MS / 1000)
                for message in batch:
                    if count is not None and handed >= count:
                        break  # the rest stay in flight and come again
                    handed += 1
                    yield message
                    self.mark_processed(message)
        finally:
            # best effort: a processed id that misses its ack is acked when it comes again
            if self.connection is not None:
                with contextlib.suppress(ClientError):
                    self.flush_acks()


def _json(response: requests.Response) -> Any:
    if not response.content:
        return None
    try:
        return response.json()
    except ValueError:
        return None
