"""Acks held by the WebSocket client (``shoal.client.ws``): processed ids share ack frames.

A message counts as processed once the application asks
``messages()`` for the next one (or ``consume``'s handler returned, or ``mark_processed``): its
id is recorded in the state file, then acked. Acks are held for ``ack_delay_s`` (300 ms by
default, as the API's contract says: "a few hundred ms at most") and go out together, up to
1,000 ids a frame: at the delay (sent by the keep-alive thread when no loop is receiving:
while a handler runs, or after the loop was left), sooner once half the window
(``receive_maximum``) waits for its acks or when waiting for frames with the acks held would
keep the window shut, and when the client closes (before a disconnect, answered: API Gateway
runs a connection's frames in no set order, and a disconnect that overtook the ack would leave
it refused). Each ack frame is a billed WebSocket message and an ``ack`` function invocation
with one state write, whatever its number of ids: at 1 message a second a 300 ms delay still
sends one frame per message, a delay of seconds one per several. A longer delay is fewer
frames, and more messages sent again after a crash (those processed in the last delay; they
are in the state file, so they are acked again and not handed out) or, past the service's ack
timeout (30 s by default), sent again with ``dup`` while the client runs: hence at most
``MAX_ACK_DELAY_S``. 0 sends one ack per message, before the next is handed out. Acks are not
waited for (but before a disconnect): a lost ack means the message comes again with ``dup``,
and a redelivered id already recorded is acked again without being handed to the application.
A message handed out but not processed (the handler raised, the loop was left) is handed out
first by the next ``messages()`` of this client.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from shoal.core.clock import Clock

#: ids per ack frame (the API's limit, as for ``POST .../acks``)
MAX_ACK_IDS = 1000
#: how often a loop waiting for frames looks at acks marked from other threads
ACK_POLL_S = 0.2
#: how long processed ids are held before their ack frame goes (the API's "a few hundred ms")
DEFAULT_ACK_DELAY_S = 0.3
#: the longest ack delay: a third of the service's default ack timeout (30 s), so that a
#: message processed at once is acked well before the service sends it again with ``dup``
MAX_ACK_DELAY_S = 10.0

__all__ = ["ACK_POLL_S", "DEFAULT_ACK_DELAY_S", "MAX_ACK_DELAY_S", "MAX_ACK_IDS", "HeldAcks"]


class HeldAcks:
    """Processed ids whose ack has not been sent, in the order processed, and when the oldest
    of them is to be acked (``delay_s`` after it was held). Not thread-safe: the client holds
    its lock around every call."""

    def __init__(self, delay_s: float, clock: Clock) -> None:
        if not 0 <= delay_s <= MAX_ACK_DELAY_S:
            raise ValueError(f"ack_delay_s must be 0 to {MAX_ACK_DELAY_S:g} s")
        self.delay_s = delay_s
        self.clock = clock
        self._ids: dict[str, None] = {}
        #: when the oldest held id is to be acked (None: none is held)
        self.due_ms: int | None = None

    def __len__(self) -> int:
        return len(self._ids)

    def hold(self, ids: Sequence[str]) -> bool:
        """Holds the acks of ``ids`` until their delay ends (the oldest's decides); whether
        this started a delay (none was running)."""
        for message_id in ids:
            self._ids[message_id] = None
        if self._ids and self.due_ms is None:
            self.due_ms = self.clock.now_ms() + int(self.delay_s * 1000)
            return True
        return False

    def due(self, receive_maximum: int) -> bool:
        """Whether the held acks go now: their delay ended, or half the window (or a full
        frame) waits for them."""
        if not self._ids or self.due_ms is None:
            return False
        enough = max(1, min(receive_maximum // 2, MAX_ACK_IDS))
        return len(self._ids) >= enough or self.clock.now_ms() >= self.due_ms

    def next_frame(self) -> tuple[list[str], bool]:
        """The ids of the next ack frame (the oldest, 1,000 at most), and whether they are
        all that is held."""
        ids = list(itertools.islice(self._ids, MAX_ACK_IDS))
        return ids, len(ids) == len(self._ids)

    def sent(self, ids: Sequence[str]) -> None:
        """``ids`` went: no longer held (the delay stops when nothing is)."""
        for message_id in ids:
            self._ids.pop(message_id, None)
        if not self._ids:
            self.due_ms = None
