"""The receiving loop of ``shoal.client.ws.ShoalWsClient``: ``messages()`` and ``consume``,
and how a lost connection is ridden out (the module's docstring there says what they promise).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any, NoReturn

from shoal.client.errors import ApiError, Unavailable
from shoal.client.support import Outages, ReceivedMessage
from shoal.client.wslink import Link, LinkLost

if TYPE_CHECKING:
    import random
    import threading

    from shoal.core.clock import Clock

logger = logging.getLogger("shoal.client")


class _TakenOver(Exception):
    """The server's ``disconnect`` with ``session_taken_over`` came on the live connection."""


class _Busy(Exception):
    """A frame answered 429 or 5xx (or API Gateway's internal error): try again later."""

    def __init__(self, error: ApiError) -> None:
        super().__init__(str(error))
        self.error = error


class ReceivingLoop:
    """What ``ShoalWsClient`` hands out, and how: the client's state and steps it uses are
    declared here and made by the client."""

    if TYPE_CHECKING:
        url: str
        clock: Clock
        rng: random.Random
        _lock: threading.RLock
        _link: Link | None
        _buffer: deque[ReceivedMessage]
        _outstanding: dict[str, ReceivedMessage]

        def mark_processed(self, *messages: ReceivedMessage | str) -> None: ...
        def _wait_for_message(self, until_ms: int | None) -> ReceivedMessage | None: ...
        def _drop_link(self, code: int = ...) -> None: ...
        def _reconnect(self) -> None: ...
        def _taken_over(self) -> NoReturn: ...

    def messages(
        self,
        *,
        count: int | None = None,
        auto_ack: bool = True,
        until_ms: int | None = None,
        outages: Outages | None = None,
        on_outage: Callable[[str], None] | None = None,
    ) -> Generator[ReceivedMessage, None, None]:
        """Messages in order, each once, as they are pushed.

        With ``auto_ack`` (the default), asking for the next one marks the previous processed
        (recorded in the state file, then acked). Without it, a message stays outstanding until
        ``mark_processed`` (from any thread) or ``ack``. ``until_ms`` (the client clock's time)
        ends the iteration then, whatever ``count`` says. A lost connection is ridden out as
        ``outages`` says (default: for ever), each outage told once as it starts and once as it
        ends to ``on_outage`` (default: the ``shoal.client`` logger). Raises
        ``SessionTakenOver`` when a newer connect took the session, and what is permanent
        (a refused token without a renewal, 403).
        """
        outages = outages or Outages()
        say = on_outage or logger.warning
        handed = 0
        current: ReceivedMessage | None = None
        try:
            while count is None or handed < count:
                if current is not None and auto_ack:
                    self.mark_processed(current)
                current = None
                if until_ms is not None and until_ms - self.clock.now_ms() <= 0:
                    return
                try:
                    message = self._wait_for_message(until_ms)
                except (LinkLost, _Busy) as exc:
                    if not outages.forever:
                        self._drop_link()
                        raise Unavailable(0, "no_answer", str(exc), {}) from exc
                    if not self._ride_out(str(exc), outages, say, until_ms):
                        return
                    continue
                except Unavailable:
                    if not outages.forever:
                        raise
                    if not self._ride_out("no connection", outages, say, until_ms):
                        return
                    continue
                except _TakenOver:
                    self._taken_over()
                if message is None:
                    return  # until_ms came
                handed += 1
                with self._lock:
                    self._outstanding[message.id] = message
                current = message
                yield message
            if current is not None and auto_ack:
                self.mark_processed(current)
                current = None
        finally:
            with self._lock:
                if auto_ack and current is not None and current.id in self._outstanding:
                    # handed out, not processed (the handler raised, the loop was left): the
                    # next messages() hands it out first
                    del self._outstanding[current.id]
                    self._buffer.appendleft(current)
            # what was processed is acked at its delay (the keep-alive thread), or at close

    def _ride_out(
        self, lost: str, outages: Outages, say: Callable[[str], None], until_ms: int | None
    ) -> bool:
        """Wait out a lost connection and open a new one; False if ``until_ms`` came first.
        Raises only what is permanent (``ApiError`` but ``Unavailable``; a takeover)."""
        self._drop_link()
        say(
            f"lost {self.url} ({lost}); trying again, at most every {outages.max_s:g} s, "
            "until it answers"
        )
        for _ in outages.pauses(self.clock, self.rng, until_ms):
            try:
                self._reconnect()
            except (LinkLost, _Busy):
                self._drop_link()
                continue
            except _TakenOver:
                self._taken_over()
            link = self._link
            assert link is not None and link.connection is not None
            how = (
                "the session was resumed"
                if link.connection.session_present
                else "the session had ended: a new one, subscribed again"
            )
            say(f"{self.url} answers again; {how}")
            return True
        return False

    def consume(
        self,
        handler: Callable[[ReceivedMessage], Any],
        *,
        count: int | None = None,
        until_ms: int | None = None,
        on_outage: Callable[[str], None] | None = None,
    ) -> int:
        """Call ``handler`` with each message; a message is processed (recorded, acked) only
        once the handler returned. A handler that raises ends the loop with its exception;
        that message is not acked, and is handed out first by the next ``messages()`` or
        ``consume`` (or comes again from the server). The number handled."""
        handled = 0
        # auto_ack: a message is marked processed when the loop asks for the next, which is
        # after the handler returned
        for message in self.messages(count=count, until_ms=until_ms, on_outage=on_outage):
            handler(message)
            handled += 1
        return handled
