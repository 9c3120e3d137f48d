"""A small WebSocket client of Shoal's edge for the end-to-end tests (real ``websockets``).

``WsClient`` reads every frame the service sends on a task of its own, checks it against
``docs/asyncapi.yaml`` (the contract: each service frame's schema, chosen by its ``action``),
and sorts it: an answer (a frame echoing a ``ref`` this client sent) resolves that request,
a delivery goes to ``messages``, anything else (``pong``, a server ``disconnect``, an error
with no ref) to ``others``. A frame that breaks the contract is kept in ``violations``; the
tests assert none came. ``closed`` resolves with the close code when the connection ends.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

ROOT = Path(__file__).resolve().parents[2]
CONTRACT = ROOT / "docs" / "asyncapi.yaml"
#: generous: the suite shares a 2-core machine, and a cold sandbox's first frame takes seconds
ANSWER_TIMEOUT_S = 60.0
#: times a frame answered with a 5xx error is sent again
RETRIES = 5


@cache
def _validators() -> dict[str, jsonschema.Draft202012Validator]:
    """The schema of each frame the service sends, by its ``action``, from the contract."""
    doc = yaml.safe_load(CONTRACT.read_text())
    components = doc["components"]
    out: dict[str, jsonschema.Draft202012Validator] = {}
    for name, message in components["messages"].items():
        if not name.startswith("service."):
            continue
        schema = {"$ref": message["payload"]["$ref"], "components": components}
        out[message["name"]] = jsonschema.Draft202012Validator(schema)
    return out


def contract_problems(frame: Any) -> list[str]:
    """Why ``frame`` (parsed JSON) is not a service frame of the contract; [] when it is."""
    if not isinstance(frame, dict) or not isinstance(frame.get("action"), str):
        return [f"not a frame with an action: {frame!r}"]
    validator = _validators().get(frame["action"])
    if validator is None:
        return [f"the contract sends no frame with action {frame['action']!r}"]
    return [f"{frame['action']}: {e.message}" for e in validator.iter_errors(frame)]


def headers_for(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token is not None else {}


def close_code(ws: ClientConnection) -> int | None:
    """The close code the service sent (None when the connection ended without one)."""
    received = ws.protocol.close_rcvd
    return received.code if received is not None else None


@dataclass
class Received:
    frame: dict[str, Any]
    #: the event loop's clock when the frame was read
    at: float = field(default_factory=time.monotonic)


class WsClient:
    """One connection: requests matched to answers by ``ref``, deliveries in a queue."""

    _refs = itertools.count(1)

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.frames: list[Received] = []
        self.violations: list[str] = []
        self.messages: asyncio.Queue[Received] = asyncio.Queue()
        self.others: asyncio.Queue[Received] = asyncio.Queue()
        self._pending: dict[str, asyncio.Future[dict[str, Any]]] = {}
        #: when each answer was read, by ref
        self.answered_at: dict[str, float] = {}
        #: 5xx answers that were retried
        self.retried: list[dict[str, Any]] = []
        #: publishes carry a publisher id and sequence, so that a retried one is kept once
        self.publisher_id = f"e2e-{uuid.uuid4().hex[:12]}"
        self._seq = itertools.count(1)
        #: the frames sent with a ref, by ref
        self.sent: dict[str, dict[str, Any]] = {}
        self.closed: asyncio.Future[int | None] = asyncio.get_running_loop().create_future()
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def open(cls, url: str, token: str | None, **kwargs: Any) -> WsClient:
        ws = await connect(
            url,
            additional_headers=headers_for(token),
            open_timeout=ANSWER_TIMEOUT_S,
            # API Gateway answers no WebSocket pings; keep-alives are `ping` frames
            ping_interval=None,
            max_size=None,
            **kwargs,
        )
        return cls(ws)

    async def _read(self) -> None:
        try:
            async for raw in self.ws:
                if isinstance(raw, bytes):
                    self.violations.append("the service sent a binary frame")
                    continue
                try:
                    frame = json.loads(raw)
                except ValueError:
                    self.violations.append(f"not JSON: {raw[:200]!r}")
                    continue
                self.violations.extend(contract_problems(frame))
                received = Received(frame)
                self.frames.append(received)
                ref = frame.get("ref") if isinstance(frame, dict) else None
                waiter = self._pending.pop(ref, None) if isinstance(ref, str) else None
                if isinstance(ref, str) and waiter is not None and not waiter.done():
                    self.answered_at[ref] = received.at
                    waiter.set_result(frame)
                elif isinstance(frame, dict) and frame.get("action") == "message":
                    self.messages.put_nowait(received)
                else:
                    self.others.put_nowait(received)
        except ConnectionClosed:
            pass
        finally:
            for waiter in self._pending.values():
                if not waiter.done():
                    waiter.set_exception(ConnectionError("the connection closed"))
            self._pending.clear()
            if not self.closed.done():
                self.closed.set_result(close_code(self.ws))

    # -- talking

    async def send(self, frame: Mapping[str, Any] | str | bytes) -> None:
        await self.ws.send(frame if isinstance(frame, str | bytes) else json.dumps(frame))

    async def request(self, frame: Mapping[str, Any]) -> asyncio.Future[dict[str, Any]]:
        """Sends ``frame`` with a fresh ``ref``; the future of its answer (not awaited)."""
        ref = f"r{next(self._refs)}"
        waiter: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[ref] = waiter
        self.sent[ref] = {**frame, "ref": ref}
        await self.send(self.sent[ref])
        return waiter

    async def ask(
        self, frame: Mapping[str, Any], timeout: float = ANSWER_TIMEOUT_S
    ) -> dict[str, Any]:
        """The answer to ``frame``. A 5xx error frame says "retry the frame" (the emulator
        answers busy when the machine is loaded): it is sent again, as a client would; the
        callers send only frames that are safe to repeat (publishes carry a publisher id)."""
        for attempt in range(RETRIES + 1):
            answer = await asyncio.wait_for(await self.request(frame), timeout)
            if answer.get("action") != "error" or answer.get("status", 0) < 500:
                return answer
            self.retried.append(answer)
            await asyncio.sleep(0.2 * (attempt + 1))
        return answer

    async def connect(self, client_id: str, **fields: Any) -> dict[str, Any]:
        answer = await self.ask({"action": "connect", "client_id": client_id, **fields})
        assert answer["action"] == "connected", answer
        return answer

    async def subscribe(self, *filters: str, qos: int = 1) -> dict[str, Any]:
        subscriptions = [{"filter": f, "qos": qos} for f in filters]
        answer = await self.ask({"action": "subscribe", "subscriptions": subscriptions})
        assert answer == {
            "ref": answer.get("ref"),
            "action": "subscribed",
            "granted": [qos] * len(filters),
        }, answer
        return answer

    async def publish(self, topic: str, text: str, **fields: Any) -> dict[str, Any]:
        answer = await self.ask(
            {
                "action": "publish",
                "topic": topic,
                "text": text,
                "qos": 1,
                "publisher_id": self.publisher_id,
                "publisher_seq": next(self._seq),
                **fields,
            }
        )
        assert answer["action"] == "published", answer
        return answer

    async def ack(self, *ids: str) -> int:
        answer = await self.ask({"action": "ack", "ids": list(ids)})
        assert answer["action"] == "acked", answer
        acked: int = answer["acked"]
        return acked

    async def next_message(self, timeout: float = ANSWER_TIMEOUT_S) -> dict[str, Any]:
        return (await asyncio.wait_for(self.messages.get(), timeout)).frame

    async def next_other(self, timeout: float = ANSWER_TIMEOUT_S) -> dict[str, Any]:
        return (await asyncio.wait_for(self.others.get(), timeout)).frame

    async def wait_closed(self, timeout: float = ANSWER_TIMEOUT_S) -> int | None:
        return await asyncio.wait_for(asyncio.shield(self.closed), timeout)

    # -- ending

    async def close(self) -> None:
        await self.ws.close()
        await asyncio.wait_for(asyncio.shield(self._reader), ANSWER_TIMEOUT_S)

    def abort(self) -> None:
        """Drop the TCP connection: no close frame, no disconnect frame (a lost network)."""
        transport = self.ws.transport
        assert transport is not None
        transport.abort()


def text_of(message: Mapping[str, Any]) -> str:
    return base64.b64decode(message["payload"]).decode()
