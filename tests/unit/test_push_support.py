"""Fakes for push subscription tests (no tests here): a scripted endpoint and key states."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from shoal.push.endpoint import DeliveryRequest, DeliveryResult
from shoal.records import Message

Respond = Callable[[DeliveryRequest], DeliveryResult]

OK = DeliveryResult(status=200)


def message(
    n: int,
    key: str = "k",
    *,
    topic: str = "orders/1",
    published_at_ms: int = 1_700_000_000_000,
    payload: bytes = b"",
) -> Message:
    return Message(
        message_id=f"m{n:04d}-{key}",
        topic=topic,
        payload=payload or f"payload {n}".encode(),
        qos=1,
        retain=False,
        ordering_key=key,
        published_at_ms=published_at_ms + n,
        sub="alice",
    )


@dataclass
class FakeEndpoint:
    """An in-memory endpoint: answers by ``respond`` (default 200) and records every call."""

    respond: Respond = lambda _request: OK
    calls: list[DeliveryRequest] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def deliver(self, request: DeliveryRequest) -> DeliveryResult:
        result = self.respond(request)
        with self._lock:
            self.calls.append(request)
            self._results.append(result)
        return result

    def __post_init__(self) -> None:
        self._results: list[DeliveryResult] = []

    def delivered(self) -> list[tuple[str, str]]:
        """(ordering key, message id) of every successful call, in call order."""
        with self._lock:
            return [
                (c.ordering_key, c.message_id)
                for c, r in zip(self.calls, self._results, strict=True)
                if r.ok
            ]

    def first_deliveries(self) -> list[tuple[str, str]]:
        seen: set[str] = set()
        out: list[tuple[str, str]] = []
        for key, message_id in self.delivered():
            if message_id not in seen:
                seen.add(message_id)
                out.append((key, message_id))
        return out

    def attempts(self, message_id: str) -> list[int]:
        with self._lock:
            return [c.attempt for c in self.calls if c.message_id == message_id]


def failing_keys(*keys: str, status: int = 503) -> Respond:
    """Answers ``status`` for the given ordering keys, 200 for the others."""
    failing = set(keys)

    def respond(request: DeliveryRequest) -> DeliveryResult:
        return DeliveryResult(status=status) if request.ordering_key in failing else OK

    return respond


class Switch:
    """A respond function whose failing keys change while a test runs."""

    def __init__(self, *keys: str, status: int = 503) -> None:
        self.failing = set(keys)
        self.status = status

    def __call__(self, request: DeliveryRequest) -> DeliveryResult:
        if request.ordering_key in self.failing:
            return DeliveryResult(status=self.status)
        return OK
