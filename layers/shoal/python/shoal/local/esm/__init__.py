"""Lambda's Kinesis event source mappings, emulated: ``shoal dev`` delivers stream records itself.

moto stores event source mappings but cannot run a function (that needs Docker), so the local
runtime reads the mappings through the Lambda API, reads the streams with GetShardIterator and
GetRecords, and hands each batch to the handler in-process through an injected ``invoke``.
What it copies from Lambda (AWS docs: "Using AWS Lambda with Amazon Kinesis", "Configuring
partial batch response with Kinesis", "Retain discarded batch records"):

- StartingPosition TRIM_HORIZON / LATEST / AT_TIMESTAMP; BatchSize; the 6 MB payload limit;
  MaximumBatchingWindowInSeconds (read from the injected clock); records of one shard in order.
- The event exactly as Lambda sends it (see ``events/kinesis_batch.json``).
- FunctionResponseTypes ["ReportBatchItemFailures"]: a null response, an empty one, or a
  null/empty ``batchItemFailures`` list is complete success; an empty or null
  ``itemIdentifier`` or a bad key name is complete failure; otherwise the records before the
  lowest failed sequence number are done and the batch is retried from there. Two choices
  where the docs are silent: an ``itemIdentifier`` that names no record of the batch, and a
  response that is not an object, are complete failures. Without that response type any
  return value is success.
- A raised exception is a function error: the batch is retried. With BisectBatchOnFunctionError
  a failed batch of two or more records is split in halves, each retried in order, and the
  split does not count towards MaximumRetryAttempts (-1: unlimited); a partial response is not
  split further (the docs: "bisected at the returned sequence number"). Records older than
  MaximumRecordAgeInSeconds (-1: unlimited) are discarded before an invocation. A discarded
  batch ("RetryAttemptsExhausted" / "RecordAgeExceeded") sends the documented invocation record
  to DestinationConfig.OnFailure (SQS queue, SNS topic, or S3 bucket with the whole event as
  ``payload``), then processing moves on.
- ParallelizationFactor N: each shard has N lanes, a record's lane is chosen by its partition
  key, each lane has at most one batch in flight, and the shard's checkpoint only moves past a
  record once every record before it is done (succeeded or discarded).
- A disabled mapping is not polled and resumes from its checkpoint when enabled; a deleted one
  stops and its checkpoints are forgotten. Checkpoints are kept by mapping UUID and shard id
  in a ``CheckpointStore``; records after the checkpoint may be delivered again after a
  restart (at least once, as Lambda).

- A mapping on an enhanced fan-out consumer (its EventSourceArn a consumer's ARN) reads the
  consumer's stream, each shard within 70 ms of a record's arrival (``FAN_OUT_FEED_S``; Kinesis
  documents an average of 70 ms, Lambda polls a standard mapping's shard about once a second);
  every other setting acts as on the stream. Not emulated: the consumer's own 2 MB/s per shard
  (nothing is throttled here), and SubscribeToShard itself (a shard is read with GetRecords).

Not emulated: FilterCriteria, TumblingWindowInSeconds, throttling and Lambda's backoff between
retries (a failed batch is retried on the next round).

``seek`` moves a mapping to TRIM_HORIZON, LATEST or a time. Lambda has no such call (deployed,
the same effect needs a new mapping); push subscriptions' seek uses it locally.
"""
