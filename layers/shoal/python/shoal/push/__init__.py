"""Push subscriptions (Varadhi): HTTP delivery with retry routing MQ -> RQ -> DLQ.

A push subscription delivers every message of its composite topic (the *main queue*, MQ) that
matches its MQTT filter to an HTTP endpoint. A failed delivery goes to the subscription's retry
queue (RQ) with an attempt time; one that cannot succeed goes to its dead-letter queue (DLQ).
RQ and DLQ are composite topics of their own (one storage topic each, routed with the router
formula by ordering key, so one key's entries stay in one shard) that publishers cannot reach.

Key state (the design's *group state*)
--------------------------------------
Per (subscription, ordering key) one item holds, for RQ and for DLQ, the *produced* position
``p`` and the *consumed* position ``c``. A position is (``n``, ``m``): ``n`` is the entry's
offset in the key's own sequence of that queue (1, 2, ...), ``m`` the main position of the
entry's message (main storage topic index, sequence number, index in the record). The per-key
offset stands in for the internal Kinesis offset: it is known before the put (so a reservation
can name it), and a record put twice by a retry carries it twice, which the consumer drops.
A key is *blocked* while ``p != c`` in RQ or DLQ; an ordered subscription sends a blocked
key's later messages behind the pending ones, so no message is overtaken by a later one of its
key, while other keys keep flowing.

Every change is one conditional write on the item's version. A producer first *reserves* the
entry (``p.n + 1``, recorded in ``pending`` with where the message can be read again), then
puts the record; a crash in between is repaired by the retry of the same batch (the producer
finds its own reservation and puts again) or by the consumer, which reads a missing entry from
its source. So no entry is ever put without a reservation (nothing a consumer has to guess
about), and a reserved one is never lost.

Flows
-----
- **MQ** (``shoal.push.main_queue``): a non-matching message is skipped; an already routed one
  (main position at or below the key's mark for that storage topic in the same seek
  generation: positions of two storage topics never compare, their taps run side by side) is
  skipped; a blocked key's message follows into RQ (or DLQ, when only DLQ holds the key);
  otherwise it is POSTed: 2xx done; a ``retry_on`` outcome goes to RQ with its attempt time;
  anything else (or ``max_attempts`` 1) to DLQ with the reason.
- **RQ** (``shoal.push.retry_queue``): entries are taken in per-key order; an entry before its
  attempt time holds its key (the rest of the batch goes on, the mapping gives the held record
  back); success moves ``c``; exhaustion or a non-retryable answer moves the entry to DLQ.
- **DLQ** (``shoal.push.dead_letters``): listed with reason and attempts; a redrive moves a
  key's oldest entries, in order, into RQ ahead of the key's newer messages; a key whose DLQ
  drains unblocks.
- **Replay** (``shoal.push.replay``): archived messages reserved into RQ as a redrive reserves
  (reason ``REPLAYED``), idempotently by a per-key mark of the replay.

Attempt times are exponential backoff with jitter, bounded: after attempt ``a`` the next
waits ``b/2 .. b`` with ``b = min(initial * multiplier**(a-1), max)``, the jitter a stable
hash of (message, attempt), so a retried batch computes the same time.

Modules
-------
``model`` (the subscription, its spec and taps), ``api`` (the admin API's request bodies),
``endpoint`` (endpoint policy and the HTTP POST), ``entries`` (positions and queue entries),
``state`` (the key state), ``decisions`` (what a consumer does, pure), ``store`` (subscription,
tap and key state items in DynamoDB), ``queues`` (RQ/DLQ streams and event source mappings on
Kinesis and Lambda), ``gate`` (the ordered drain's gate), ``consumer``, ``main_queue``,
``retry_queue`` and ``delivery`` (the push function), ``admin`` and ``dead_letters`` (the admin
function), ``replay`` (archived messages into RQ).
"""
