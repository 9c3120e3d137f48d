"""moto's Kinesis made to read a shard by position (``shoal.local.aws.adapt_moto`` applies it,
process-wide and idempotent), with moto's answers.

moto keeps a shard's records in one ordered dict from its first record on (``shoal dev`` keeps
them all: nothing trims a stream), and walked it whole at every step that needs one end of it
or the records after a position: each put (to number the record: a list of every key, to
take its last), each GetRecords (every record from the first, to find those after the
iterator), each describe (the first key, again through a list). So each of those cost time in
proportion to the stream's whole history, under the emulator's one lock, and every mapping
polls every shard twice a second: in the 2-hour soak the put's list alone went from 2.5 % of
the process's GIL time at minute 2 to 11.2 % at minute 9 (py-spy ``--gil``), and the earlier
2-hour run's latency grew from a p50 of 2.5 s at 30 minutes to 6.9 s (issue 47).

A shard's sequence numbers are its keys, put in increasing order (each put takes the last one
plus one), so the ends are the dict's ends and the records after a position are found by
bisection over its keys. The keys are kept per shard beside moto's dict, extended by what was
put since, and rebuilt whenever the dict was changed otherwise (a split or a merge moves
records; a snapshot's load makes new shards): the two agree on length and both ends, or the
list is made again.
"""

from __future__ import annotations

import bisect
import itertools
import weakref
from typing import Any

#: each shard's sequence numbers in order, as its records dict holds them (not pickled with
#: the shard: a snapshot's shards are new objects, whose lists are built at their first read)
_KEYS: weakref.WeakKeyDictionary[Any, list[int]] = weakref.WeakKeyDictionary()


def _keys(shard: Any) -> list[int]:
    """The shard's sequence numbers in order: the kept list, extended by the records put since,
    or built again when the records dict no longer starts where the list does."""
    records = shard.records
    keys = _KEYS.get(shard)
    if keys is None or len(keys) > len(records) or (keys and keys[0] != next(iter(records))):
        keys = _KEYS[shard] = list(records)
        return keys
    missing = len(records) - len(keys)
    if missing:
        # the records put since: the dict's last ``missing`` keys, in order
        newest = list(itertools.islice(reversed(records), missing))
        newest.reverse()
        if keys and newest[0] <= keys[-1]:
            keys = _KEYS[shard] = list(records)
            return keys
        keys.extend(newest)
    elif keys and keys[-1] != next(reversed(records)):
        keys = _KEYS[shard] = list(records)
    return keys


def read_shards_by_position() -> None:
    """Replace ``Shard``'s walks of its records by reads of their ends and a bisection."""
    from moto.kinesis.models import Shard

    if getattr(Shard.get_records, "_by_position", False):
        return
    original = Shard.get_records

    def get_records(
        self: Any, last_sequence_id: str, limit: int | None
    ) -> tuple[list[Any], int, int]:
        last = int(last_sequence_id)
        keys = _keys(self)
        start = bisect.bisect_right(keys, last)
        # moto stops at ``limit`` records when it is one it can reach (1 or more), else
        # answers every record after the position
        end = start + limit if limit is not None and limit > 0 else len(keys)
        chosen = keys[start:end]
        if not chosen:
            return [], last, 0
        records = self.records
        results = [records[k] for k in chosen]
        newest = records[keys[-1]]
        # as moto: how far the last record answered is behind the shard's newest
        return results, chosen[-1], int((newest.created_at - results[-1].created_at) * 1000)

    def get_min_sequence_number(self: Any) -> int:
        return next(iter(self.records)) if self.records else 0

    def get_max_sequence_number(self: Any) -> int:
        return next(reversed(self.records)) if self.records else 0

    get_records._by_position = True  # type: ignore[attr-defined]
    get_records._moto = original  # type: ignore[attr-defined]  # the tests compare answers
    Shard.get_records = get_records
    Shard.get_min_sequence_number = get_min_sequence_number
    Shard.get_max_sequence_number = get_max_sequence_number
