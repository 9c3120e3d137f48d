"""Scanning a session's inbox: the messages after each source's cursor, in order.

A get (``shoal.delivery.service``) hands out what a scan finds; the scan decides what each
query reads. Consumed items stay until TTL, so a scan jumps over them to each source's cursor,
asks for as many items as fit one read unit, and keeps across the idle polls of one get where
the partition's first item was (``ScanStart``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

from botocore.exceptions import BotoCoreError, ClientError

from shoal.core.errors import ShoalError
from shoal.core.observability import logger
from shoal.delivery.gate import SessionGate
from shoal.delivery.inbox import (
    DeliveryState,
    Given,
    InboxItem,
    InboxMessage,
    InboxStore,
    SessionRun,
)
from shoal.delivery.model import MAX_QUERIES_PER_GET, STATE, item_key

#: items a scan's query asks for after its first, at most and at least: as many as fit one read
#: unit (``READ_UNIT``) by the size of the items the previous query read
#: (``InboxScan.scan``)
SCAN_PAGE = 16
MIN_SCAN_PAGE = 2
#: DynamoDB bills a query per 4 KB it reads (strongly consistent), however many items
READ_UNIT = 4096
#: items a look's query asks for (``InboxScan.scan``). A look only asks whether anything is
#: new, and an idle inbox's answer is the next source's first consumed item (the look jumps to
#: that source's cursor), so a page of up to ``SCAN_PAGE`` items was read, copied and parsed
#: only to drop all but its first. A look queries once per source, so this grows with the
#: sources: in a 2-hour soak whose topic grew at minute 48 (two sources a session, then four)
#: idle looks were 16 % of `shoal dev`'s time at minute 10 and 29 % at minute 85 (py-spy
#: ``--gil``, 2026-12-06). The read units are the same: a page was sized to one unit.
LOOK_PAGE = 1


@dataclass(frozen=True)
class Found:
    """A message the scan found: where it is, and the item it is in."""

    source: str
    item: InboxItem
    message: InboxMessage
    last_in_item: bool


@dataclass
class ScanStart:
    """Where a get's scans start, kept across the idle polls of one get.

    ``source``: the source of the partition's first item (consumed), as a scan of this get
    found it. A poll again then starts at that source's cursor and skips the query that would
    find the same item again (up to 64 KB: up to 16 read units); one query of a key range
    that ends before that source's items (nothing in it, as a rule: the least a query costs)
    tells whether a source that sorts before it got an item during the wait (a new storage
    topic or shard, or a topic of the session's that had sent it nothing yet: issue 48).

    ``idle``: the get found nothing so far, so its polls are re-reads of an idle inbox. Each
    first looks eventually consistent (half the read units: an idle 20 s poll costs what it
    cost with one strongly consistent query a poll) and reads consistently, to hand out, only
    when the look found something. A look that misses a write not yet replicated (DynamoDB
    promises only that a read repeated "after a short time" sees it) sees it at a later poll."""

    source: str | None = None
    idle: bool = False
    #: sources a look jumped over that the session has passed (their storage topic drained
    #: and handed out to it, ``SessionGate.passed_sources``): their consumed items are deleted
    #: once the look ends, so later looks do not query past them for their TTL
    spent: set[str] = field(default_factory=set)
    #: sources this get deleted the items of, or tried to
    purged: set[str] = field(default_factory=set)
    #: sources whose items the drain's gate held back from this get (``shoal.drain``): a
    #: push of them must be tried again once the earlier storage topics are drained
    held: set[str] = field(default_factory=set)


class InboxScan:
    """Reads of one inbox table for gets: scans of new messages, and runs read back."""

    def __init__(self, inbox: InboxStore, drain: SessionGate | None = None) -> None:
        self.inbox = inbox
        #: holds items of a later storage topic until the earlier ones are drained and handed
        #: out (``shoal.drain``); None hands out every source as it comes
        self.drain = drain

    def read_run(self, session_id: str, run: SessionRun) -> list[Found] | None:
        """The run's messages in order, exactly as many as it has ordinals (else None)."""
        items = self.inbox.between(session_id, run.start_item, item_key(run.source, run.upto))
        found: dict[str, Found] = {}
        for item in items:
            for n, m in enumerate(item.messages):
                # a position is one message; the first item holding it is the one handed out
                if run.after < m.position <= run.upto and m.position not in found:
                    found[m.position] = Found(run.source, item, m, n == len(item.messages) - 1)
        ordered = sorted(found.values(), key=lambda f: f.message.position)
        return ordered if len(ordered) == run.count else None

    def scan(
        self,
        session_id: str,
        state: DeliveryState,
        only: str | None = None,
        start: ScanStart | None = None,
        given: Given | None = None,
    ) -> Iterator[Found]:
        """The session's messages after each source's cursor, source by source, in order
        (``_walk``). An idle poll's scan (``ScanStart.idle``) looks first, eventually
        consistent, and walks consistently only if the look found a message."""
        if only is None and start is not None and start.idle:
            look = self._walk(session_id, state, None, start, look=True)
            hit = next(look, None)
            if hit is None:
                self._purge(session_id, state, start)
                return
            # the look found nothing new in the sources before this one, so the walk that
            # hands out starts here, not at the partition's first item: a look's queries again,
            # consistent, for nothing. What a look missed there (a write not yet replicated)
            # the next get finds, as one that missed every source.
            yield from self._walk(session_id, state, start=start, given=given, begin=hit.source)
            return
        yield from self._walk(session_id, state, only, start, given=given)

    def _purge(self, session_id: str, state: DeliveryState, start: ScanStart) -> None:
        """Deletes the items of the sources the look found spent (``ScanStart.spent``) that no
        run in flight reads back (a redelivery reads its run's items) and no cursor is partway
        through. Otherwise, after a topic grows, each of a session's looks queries past every
        source of the drained storage topic until TTL removes its items (14 days by default):
        one query a look for each such source, against one delete an item, once. A failed
        delete is left to TTL, and a later get tries again."""
        if not start.spent:
            return
        busy = {run.source for run in state.runs} | set(state.partial)
        spent = sorted(start.spent - busy - start.purged)
        start.spent.clear()
        for source in spent:
            start.purged.add(source)
            try:
                deleted = self.inbox.delete_source(session_id, source)
            except (ClientError, BotoCoreError, ShoalError):
                logger.warning("a spent inbox source was not deleted", exc_info=True)
                continue
            logger.debug("spent inbox source deleted", extra={"items": deleted})
            if start.source == source:
                start.source = None

    def _walk(
        self,
        session_id: str,
        state: DeliveryState,
        only: str | None = None,
        start: ScanStart | None = None,
        *,
        look: bool = False,
        given: Given | None = None,
        begin: str | None = None,
    ) -> Iterator[Found]:
        """The session's messages after each source's cursor, source by source, in order.

        Consumed items stay until TTL, so when the scan runs into a source's consumed items it
        jumps to that source's cursor (one query per source with old items, no more). The first
        query asks for one item: the partition's first items are mostly consumed ones, up to
        64 KB each, and a query is billed for every item it reads, so reading ten of them to
        learn where to jump cost up to 160 read units a get. ``start``: where an earlier scan
        of the same get found the partition's first item (``ScanStart``). ``given``: items of
        ``only`` its caller wrote and holds, taken instead of a query when the cursor stands
        right before them: the session's last delivery of the source is the one they follow,
        and none of its items is partway (``Given``). ``look``: an idle poll's look (``scan``),
        eventually consistent, which asks only whether anything is new: one item a query (see
        ``LOOK_PAGE``). ``begin``: the walk starts at that source's cursor and goes on through
        the sources after it, not from the partition's first item (a look's hit, ``scan``).
        """
        consistent = not look
        spent = (
            self.drain.passed_sources(state)
            if look and start is not None and self.drain is not None
            else frozenset()
        )
        lower, inclusive = STATE, False
        limit = 1
        if only is not None or begin is not None:
            # straight to the source's cursor, or the item it is partway through
            lower, inclusive = _resume(state, only or begin or "")
            limit = MIN_SCAN_PAGE
        elif start is not None and start.source is not None:
            earlier = self.inbox.first_before(
                session_id, item_key(start.source, ""), consistent=consistent
            )
            if earlier is None:
                lower, inclusive = _resume(state, start.source)
                limit = LOOK_PAGE if look else MIN_SCAN_PAGE
            else:
                # a source that sorts before it has items now: from the partition's first again
                start.source = None
        # the partition's first item, looked for only when no earlier scan of the get found it
        first = (
            start
            if start is not None and start.source is None and only is None and begin is None
            else None
        )
        held_items: list[InboxItem] | None = None
        if (
            given is not None
            and only == given.source
            and given.items
            and state.cursors.get(only, "") == given.after
            and only not in state.partial
        ):
            held_items = list(given.items)
            # then nothing more: what follows them is the next trigger's
            limit = len(held_items) + 1
        for _ in range(MAX_QUERIES_PER_GET):
            if held_items is not None:
                items, held_items = held_items, None
            else:
                items = self.inbox.after(
                    session_id, lower, inclusive=inclusive, limit=limit, consistent=consistent
                )
            if first is not None:
                if items and not any(
                    m.position > state.cursors.get(items[0].source, "") for m in items[0].messages
                ):
                    # consumed: later polls of this get start at its source's cursor
                    first.source = items[0].source
                first = None
            if only is not None:
                # past the source's items: what other sources hold is not this scan's
                items = list(itertools.takewhile(lambda i: i.source == only, items))
                if not items:
                    return
            # as many items as one read unit holds, by the largest just read: small items by
            # reference (``MAX_REF_ITEM_BYTES``) four a query, 64 KB ones two
            biggest = max((i.stored_bytes for i in items), default=0)
            page = limit
            limit = (
                LOOK_PAGE
                if look
                else max(MIN_SCAN_PAGE, min(SCAN_PAGE, READ_UNIT // max(biggest, 1)))
            )
            if not items:
                return
            jumped = False
            held: str | None = None
            for item in items:
                source = item.source
                cursor = state.cursors.get(source, "")
                fresh = [m for m in item.messages if m.position > cursor]
                held = None
                if (
                    fresh
                    and self.drain is not None
                    and not self.drain.admits(session_id, state, item)
                ):
                    # a later storage topic waits for the earlier ones (``shoal.drain``)
                    held = source
                    if start is not None:
                        start.held.add(source)
                    continue
                if not fresh:
                    if source in spent and start is not None:
                        start.spent.add(source)
                    partial = state.partial.get(source)
                    if partial and partial > item.key:
                        lower, inclusive = partial, True
                    else:
                        lower, inclusive = item_key(source, cursor), False
                    if (lower, inclusive) <= (item.key, True):
                        lower, inclusive = item.key, False
                    jumped = True
                    break
                for n, message in enumerate(fresh):
                    yield Found(source, item, message, n == len(fresh) - 1)
            if not jumped:
                if len(items) < page:
                    return
                lower, inclusive = items[-1].key, False
                if held is not None:
                    # past the held source's other items in one step, not page by page
                    lower = item_key(held, "~")


def _resume(state: DeliveryState, source: str) -> tuple[str, bool]:
    """Where a scan of ``source`` goes on: the item it is partway through, or after its
    cursor (a query's lower bound, and whether it is inclusive)."""
    partial = state.partial.get(source)
    if partial:
        return partial, True
    return item_key(source, state.cursors.get(source, "")), False
