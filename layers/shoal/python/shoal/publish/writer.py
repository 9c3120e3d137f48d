"""The publish path's Kinesis writer: messages packed into records, put in order, bounded.

One Kinesis record carries messages of one ordering key from one request, in order (a JSON
header line, then the payloads). Its ``ExplicitHashKey`` is the starting hash key of the key's
partition (that routes it: shard consistent), and its ``PartitionKey`` is the ordering key
(``record_partition_key``): Lambda's parallelization factor splits a shard into lanes by
partition key, so one key's records stay in one lane, in order, however many lanes run (push
subscriptions' ``parallelism``). A key's messages of one record are written all or nothing,
and when a request has more than one record for a key they are written one round at a time: a
record that still fails after the bounded retries fails every later message of its key, so a
retry can never put a later message before an earlier one. Records of different keys go in
the same PutRecords call (which keeps no order among them; none is promised).

A read-back (``shoal.publish.service``) is unaffected: it looks in the partition's shard by
message id, whatever record holds the message.

Every put, sequenced or not, ends within ``ROUTED_PUT_BOUND_MS`` of the moment its storage
topic was chosen: no call starts later than that less ``PUT_DEADLINE_MS``, and a call ends
within ``PUT_CALL_BOUND_MS``. A message that would start later fails with 503 (nothing was put;
the client retries, and the retry routes again). That bound is what lets the sealer close a
storage topic seconds after a SwitchProduce (``shoal.drain.seal_grace_ms``).
"""

from __future__ import annotations

from shoal.aws.clients import PUT_CALL_BOUND_MS
from shoal.aws.kinesis import (
    MAX_RECORD_BYTES,
    OutRecord,
    PutOutcome,
    Streams,
    put_chunks,
)
from shoal.composite.model import ROUTED_PUT_BOUND_MS
from shoal.core.clock import Clock
from shoal.core.errors import ServerBusy
from shoal.core.retry import backoff_s
from shoal.publish.items import Item
from shoal.records import encode_record, record_partition_key, record_size

#: a holder starts a Kinesis call only while this much of its hold is left: one call ends
#: (answered or timed out) within ``PUT_CALL_BOUND_MS``, plus a second for the clocks
PUT_DEADLINE_MS = PUT_CALL_BOUND_MS + 1_000
#: Kinesis record attempts per round (the first try and the retries of failed records)
PUT_ATTEMPTS = 3
PUT_BACKOFF_S = 0.05
PUT_BACKOFF_CAP_S = 0.2


class RecordWriter:
    """Puts a request's messages into their storage topics' streams."""

    def __init__(self, streams: Streams, clock: Clock) -> None:
        self.streams = streams
        self.clock = clock

    def within_hold(self, items: list[Item]) -> list[Item]:
        """The items whose reservation and routing leave time for a put; the others fail with
        503, and so does every later item of their ordering key or publisher: put now, it would
        go before the one its client retries."""
        now = self.clock.now_ms()
        out: list[Item] = []
        late_keys: set[str] = set()
        late_publishers: set[str] = set()
        for item in items:
            deadline = _put_deadline([item])
            if (
                (deadline is not None and now >= deadline)
                or item.ordering_key in late_keys
                or (item.key is not None and item.key in late_publishers)
            ):
                item.error = ServerBusy("the publish took too long; retry")
                late_keys.add(item.ordering_key)
                if item.key is not None:
                    late_publishers.add(item.key)
            else:
                out.append(item)
        return out

    def put(self, items: list[Item]) -> None:
        """Put every item; each records its outcome (``put_ok``, or ``error``)."""
        if not items:
            return
        # one lane per (stream, partition, ordering key): a record holds one key's messages
        lanes: dict[tuple[str, int, str], list[Item]] = {}
        for item in items:
            lane = (item.storage.stream, item.partition, item.ordering_key)
            lanes.setdefault(lane, []).append(item)
        packed = {lane: _pack(group) for lane, group in lanes.items()}
        single = sum(len(records) for records in packed.values()) == 1
        failed: set[tuple[str, int, str]] = set()
        busy = ServerBusy("the storage topic did not take the message; retry")
        for index in range(max(len(records) for records in packed.values())):
            round_ = [
                (lane, records[index])
                for lane, records in packed.items()
                if index < len(records) and lane not in failed
            ]
            outcomes = self._put_round(
                [(lane[0], self._record(group), _put_deadline(group)) for lane, group in round_],
                single,
            )
            for (lane, group), outcome in zip(round_, outcomes, strict=True):
                for item in group:
                    item.put_ok = outcome.ok
                    if not outcome.ok:
                        item.error = busy
                if not outcome.ok:
                    failed.add(lane)
        for lane in failed:
            for item in lanes[lane]:
                if not item.put_ok:
                    item.error = busy

    def _record(self, group: list[Item]) -> OutRecord:
        first = group[0]
        return OutRecord(
            data=encode_record([i.message() for i in group]),
            partition_key=record_partition_key(first.ordering_key),
            explicit_hash_key=first.storage.starting_key(first.partition),
        )

    def _put_round(
        self, records: list[tuple[str, OutRecord, int | None]], single: bool
    ) -> list[PutOutcome]:
        """Put records (of distinct keys), retrying only the failed ones, bounded.

        No call starts for a record past its deadline (its reservation's hold, less what a
        call can take): a put of a sequenced message must end before a retry may take its
        reservation over and read the stream back.
        """
        outcomes: list[PutOutcome] = [PutOutcome(error_code="NotAttempted")] * len(records)
        todo = list(range(len(records)))
        for attempt in range(PUT_ATTEMPTS):
            if attempt:
                self.clock.sleep(backoff_s(attempt - 1, PUT_BACKOFF_S, PUT_BACKOFF_CAP_S))
            by_stream: dict[str, list[int]] = {}
            for n in todo:
                by_stream.setdefault(records[n][0], []).append(n)
            for stream, indexes in by_stream.items():
                if single:
                    n = indexes[0]
                    if self._in_time(records[n][2]):
                        outcomes[n] = self.streams.put_record(stream, records[n][1])
                    continue
                for chunk in put_chunks(indexes, [records[n][1].size for n in indexes]):
                    timely = [n for n in chunk if self._in_time(records[n][2])]
                    if not timely:
                        continue
                    results = self.streams.put_records(stream, [records[n][1] for n in timely])
                    for n, result in zip(timely, results, strict=True):
                        outcomes[n] = result
            # an ambiguous failure is not retried here: the record may be in the stream, and
            # only a read-back (the client's retry of a sequenced publish) can tell
            todo = [
                n
                for n in todo
                if not outcomes[n].ok and not outcomes[n].ambiguous and self._in_time(records[n][2])
            ]
            if not todo:
                break
        return outcomes

    def _in_time(self, deadline_ms: int | None) -> bool:
        return deadline_ms is None or self.clock.now_ms() < deadline_ms


def _put_deadline(group: list[Item]) -> int | None:
    """The last instant a call may start to put ``group``: the earliest of its holds' ends and
    its routing bounds, less a call's bound."""
    ends = [i.ticket.run.held_until for i in group if i.ticket is not None]
    ends += [i.routed_at + ROUTED_PUT_BOUND_MS for i in group if i.routed_at is not None]
    return min(ends) - PUT_DEADLINE_MS if ends else None


def _pack(items: list[Item]) -> list[list[Item]]:
    """Messages of one ordering key, in order, packed into as few records as fit."""
    records: list[list[Item]] = []
    headers: list[bytes] = []
    payload = 0
    for item in items:
        header = item.message().header()
        if (
            records
            and record_size(
                [*headers, header],
                payload + len(item.payload),
                record_partition_key(item.ordering_key),
            )
            <= MAX_RECORD_BYTES
        ):
            records[-1].append(item)
            headers.append(header)
            payload += len(item.payload)
        else:
            records.append([item])
            headers, payload = [header], len(item.payload)
    return records
