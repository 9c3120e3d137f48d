"""The client's values: its retry policy, a publish's result, a connection, a delivered message."""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from shoal.core.clock import Clock


def check_url(url: str) -> str:
    """``url`` without its trailing slash if it can be an API's URL (http or https, a host);
    else ValueError saying why, before anything is sent or kept under it."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        hint = f"; did you mean http://{url}?" if "://" not in url else ""
        raise ValueError(f"{url!r} is not an http:// or https:// URL{hint}")
    return url.rstrip("/")


@dataclass(frozen=True)
class CallRetry:
    timeout_s: float = 10.0
    attempts: int = 6
    backoff_s: float = 0.2
    max_backoff_s: float = 10.0
    retry_statuses: frozenset[int] = frozenset({429, 502, 503, 504})

    def delay_s(self, retry: int, rng: random.Random, retry_after_s: float | None = None) -> float:
        """Backoff before retry number ``retry`` (0-based): exponential, jittered (half to all).

        Jitter keeps clients that failed together from coming back together.
        """
        ceiling = min(self.max_backoff_s, self.backoff_s * 2**retry)
        delay = ceiling * (0.5 + rng.random() / 2)
        if retry_after_s is not None:
            delay = max(delay, min(retry_after_s, self.max_backoff_s))
        return delay


@dataclass(frozen=True)
class Outages:
    """How a receiving loop (``ShoalClient.messages``) rides out a lost server: it tries again
    for ever (``forever``; False: the ``Unavailable`` is raised as from any call), waiting
    ``first_s`` doubling up to ``max_s`` between tries (jittered), as paho's and mosquitto's
    clients reconnect. Only a permanent refusal (403, a token the server refuses and no new one
    to send) ends it."""

    forever: bool = True
    first_s: float = 0.5
    max_s: float = 30.0

    def delay_s(self, retry: int, rng: random.Random) -> float:
        ceiling = min(self.max_s, self.first_s * 2**retry)
        return ceiling * (0.5 + rng.random() / 2)

    def pauses(self, clock: Clock, rng: random.Random, until_ms: int | None) -> Iterator[int]:
        """The waits before each try, each slept before it is yielded (the try's number);
        it ends, having slept out the rest, when ``until_ms`` (the clock's) would come first.
        Both clients' receiving loops ride out an outage with it."""
        retry = 0
        while True:
            delay_s = self.delay_s(retry, rng)
            if until_ms is not None:
                left_s = (until_ms - clock.now_ms()) / 1000
                if left_s <= delay_s:
                    clock.sleep(max(left_s, 0))
                    return
            clock.sleep(delay_s)
            retry += 1
            yield retry


@dataclass(frozen=True)
class PublishResult:
    message_id: str
    topic: str
    storage_topic: int | None
    partition: int | None
    duplicate: bool
    publisher_id: str
    publisher_seq: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "message_id": self.message_id,
            "topic": self.topic,
            "storage_topic": self.storage_topic,
            "partition": self.partition,
            "duplicate": self.duplicate,
            "publisher_id": self.publisher_id,
            "publisher_seq": self.publisher_seq,
        }


@dataclass(frozen=True)
class Connection:
    session_present: bool
    channel: str
    keepalive_s: int


@dataclass(frozen=True)
class ReceivedMessage:
    """A delivered message; ``raw`` is the message object exactly as the API sent it."""

    id: str
    topic: str
    payload: bytes
    qos: int
    retain: bool
    dup: bool
    subscription: Any
    properties: Mapping[str, Any]
    published_at: Any
    raw: Mapping[str, Any] = field(repr=False)

    @classmethod
    def from_api(cls, raw: Mapping[str, Any]) -> ReceivedMessage:
        return cls(
            id=str(raw["id"]),
            topic=str(raw.get("topic", "")),
            payload=_payload(raw),
            qos=int(raw.get("qos", 0)),
            retain=bool(raw.get("retain", False)),
            dup=bool(raw.get("dup", False)),
            subscription=raw.get("subscription"),
            properties=raw.get("properties") or {},
            published_at=raw.get("published_at"),
            raw=raw,
        )

    @property
    def text(self) -> str | None:
        """The payload as text, when it is UTF-8."""
        try:
            return self.payload.decode("utf-8")
        except UnicodeDecodeError:
            return None

    def as_json_line(self) -> str:
        """The API's message object plus ``text`` when the payload is UTF-8: one JSON line."""
        line = dict(self.raw)
        text = self.text
        if text is not None:
            line["text"] = text
        return json.dumps(line, ensure_ascii=False, separators=(",", ":"))


def _payload(raw: Mapping[str, Any]) -> bytes:
    if isinstance(raw.get("payload"), str):
        try:
            return base64.b64decode(raw["payload"], validate=True)
        except (binascii.Error, ValueError):
            pass
    if isinstance(raw.get("text"), str):
        return str(raw["text"]).encode("utf-8")
    return b""


@dataclass(frozen=True)
class BatchSettings:
    """When a batch of publishes goes out, as Google Pub/Sub's publisher ``BatchSettings``:
    once it holds ``max_messages`` (at most the API's 500 per ``POST /v1/messages:batch``) or
    ``max_bytes``, or ``max_latency_s`` after its first message arrived."""

    max_messages: int = 100
    max_bytes: int = 1_000_000
    max_latency_s: float = 0.01
    #: messages waiting to be sent at most; ``publish`` blocks beyond (publisher flow control)
    max_queued: int = 10_000

    def __post_init__(self) -> None:
        if not 1 <= self.max_messages <= MAX_BATCH:
            raise ValueError(f"max_messages must be 1 to {MAX_BATCH}")
        if self.max_bytes < 1 or self.max_latency_s < 0 or self.max_queued < 1:
            raise ValueError("max_bytes, max_queued: positive; max_latency_s: not negative")


#: messages in one POST /v1/messages:batch (the API's limit)
MAX_BATCH = 500


@dataclass(frozen=True)
class FlowControl:
    """How much a subscriber holds unacked at most, as Google Pub/Sub's subscriber
    ``FlowControl``: no more messages are fetched while ``max_messages`` handed out (or their
    ``max_bytes`` of payload) wait for their ack."""

    max_messages: int = 1000
    max_bytes: int = 100 * 1024 * 1024

    def __post_init__(self) -> None:
        if self.max_messages < 1 or self.max_bytes < 1:
            raise ValueError("max_messages and max_bytes must be positive")


def principal_of(token: str) -> str:
    """The token's subject, read without verifying it (the server verifies): the client keys
    its state by it. A token it cannot read is known by a digest of it, never by itself."""
    try:
        claims = token.split(".")[1]
        data = json.loads(base64.urlsafe_b64decode(claims + "=" * (-len(claims) % 4)))
        sub = data.get("sub") if isinstance(data, dict) else None
        if isinstance(sub, str) and sub:
            return sub
    except (IndexError, ValueError, binascii.Error, UnicodeDecodeError):
        pass
    return "token-" + hashlib.sha256(token.encode("utf-8", "replace")).hexdigest()[:16]
