"""``bench wspush`` says which WebSocket sessions the server closed during a run: its client
does not connect again, so their later deliveries count as missing, and the report says why."""

from __future__ import annotations

import asyncio
from typing import Any

from websockets.exceptions import ConnectionClosedError
from websockets.frames import Close

from bench.wspush import _closed, _Got, _PushClients


class _ClosedSocket:
    """A connection the server closed with 1011 after nothing was received."""

    async def recv(self) -> Any:
        raise ConnectionClosedError(Close(1011, "internal error"), None)


def test_a_session_closed_by_the_server_is_recorded_with_its_close() -> None:
    clients: Any = _PushClients.__new__(_PushClients)
    clients.wanted = 3
    got = _Got("bench-w-1")
    asyncio.run(clients._receive(_ClosedSocket(), got))
    assert got.closed == "1011 internal error"
    assert got.counts == {}


def test_the_report_names_the_closed_sessions_only_when_there_were_some() -> None:
    assert _closed({"closed_by_server": []}) == ""
    # runs recorded before the count existed say nothing either
    assert _closed({}) == ""
    said = _closed({"closed_by_server": ["1011 internal error", "1011 internal error"]})
    assert "closed before the end" in said and ": 2 (" in said
