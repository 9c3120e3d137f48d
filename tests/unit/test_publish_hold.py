"""The writer's hold check: a message too late for its put holds back what follows it."""

from __future__ import annotations

from shoal.core.clock import ManualClock
from shoal.core.errors import ServerBusy
from shoal.publish.items import Item, Ticket
from shoal.publish.sequences import RESERVATION_HOLD_MS, Reservation
from shoal.publish.writer import RecordWriter


def sequenced(seq: int, ordering_key: str, held_until: int, publisher: str = "alice/p") -> Item:
    item = Item(position=seq, ordering_key=ordering_key, key=publisher, seq=seq)
    run = Reservation(lo=seq, hi=seq, reserved_at=0, held_until=held_until, attempt=1, targets=())
    item.ticket = Ticket(publisher, run, [item])
    return item


def unsequenced(position: int, ordering_key: str) -> Item:
    return Item(position=position, ordering_key=ordering_key)


def test_a_late_message_holds_back_later_ones_of_its_publisher_and_key() -> None:
    clock = ManualClock()
    now = clock.now_ms()
    # Given seq 1, whose hold (taken over in an earlier round) leaves no time for a put, and
    # seqs 2 and 3 reserved later (one of another ordering key), then messages of others
    early = sequenced(1, "k1", held_until=now + 1_000)
    same_key = sequenced(2, "k1", held_until=now + RESERVATION_HOLD_MS)
    other_key = sequenced(3, "k2", held_until=now + RESERVATION_HOLD_MS)
    stranger_same_key = unsequenced(4, "k1")
    stranger = unsequenced(5, "k3")
    other_publisher = sequenced(1, "k4", now + RESERVATION_HOLD_MS, publisher="bob/p")
    items = [early, same_key, other_key, stranger_same_key, stranger, other_publisher]
    # When the writer checks which may still be put
    kept = RecordWriter(streams=None, clock=clock).within_hold(items)  # type: ignore[arg-type]
    # Then every message after the late one, of its publisher or its key, fails with it
    assert kept == [stranger, other_publisher]
    for item in (early, same_key, other_key, stranger_same_key):
        assert isinstance(item.error, ServerBusy)
    assert stranger.error is None and other_publisher.error is None
