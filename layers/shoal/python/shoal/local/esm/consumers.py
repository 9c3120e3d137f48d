"""Kinesis' enhanced fan-out consumers as AWS keeps them, in moto (``shoal.local.aws.adapt_moto``
applies this, process-wide and idempotent), so that ``shoal dev`` and the tests run the
run-time code that registers the router's consumers (``shoal.aws.kinesis``) as it runs deployed.

moto stores consumers, but differs from Kinesis and Lambda where that code depends on them:

- RegisterStreamConsumer with a name the stream has already registers a second consumer of
  that name; Kinesis refuses it (``ResourceInUseException``), which is how racing makers of one
  storage topic converge on one consumer.
- A consumer's ARN lacks the ``:<creation time>`` AWS ends it with, so the grants' pattern
  (``.../consumer/router:*``) would not match it in the IAM check, and a consumer registered
  again after a deregistration would get the old one's ARN (AWS's gets a new one).
- CreateEventSourceMapping refuses a consumer's ARN (``Invalid EventSourceArn``); Lambda takes
  it, and reads the consumer's stream through it (the emulated mappings do:
  ``shoal.local.esm.config.MappingConfig.fan_out``).

The creation time comes from moto's clock, which ``shoal dev``'s journal pins per request, so
a replayed registration gets the ARN it had.
"""

from __future__ import annotations

from typing import Any

CONSUMER_MARKER = "/consumer/"


def keep_consumers_as_kinesis_does() -> None:
    """Patch moto's Kinesis consumers and Lambda's mapping creation (idempotent)."""
    from moto.awslambda.models import EventSourceMapping, LambdaBackend
    from moto.core.exceptions import JsonRESTError
    from moto.kinesis.exceptions import ResourceInUseError
    from moto.kinesis.models import Consumer, KinesisBackend, kinesis_backends

    if getattr(KinesisBackend.register_stream_consumer, "_shoal", False):
        return
    make_consumer = Consumer.__init__
    register = KinesisBackend.register_stream_consumer
    create_mapping = LambdaBackend.create_event_source_mapping

    def consumer_init(self: Any, *args: Any, **kwargs: Any) -> None:
        make_consumer(self, *args, **kwargs)
        self.consumer_arn = f"{self.consumer_arn}:{int(self.created.timestamp())}"

    def register_once(self: Any, stream_arn: str, consumer_name: str) -> Any:
        stream = self._find_stream_by_arn(stream_arn)
        if stream is not None and any(c.consumer_name == consumer_name for c in stream.consumers):
            raise ResourceInUseError(f"Consumer {consumer_name} under stream {stream_arn}")
        return register(self, stream_arn, consumer_name)

    def create_on_consumer(self: Any, spec: dict[str, Any]) -> Any:
        source = str(spec.get("EventSourceArn") or "")
        if CONSUMER_MARKER not in source:
            return create_mapping(self, spec)
        kinesis = kinesis_backends[self.account_id][self.region_name]
        if not any(s.get_consumer_by_arn(source) for s in kinesis.streams.values()):
            raise JsonRESTError("ResourceNotFoundException", "Invalid EventSourceArn")
        function = self._lambdas.get_function_by_name_or_arn_with_qualifier(
            spec.get("FunctionName", "")
        )
        spec.update(
            {
                "RegionName": self.region_name,
                "AccountId": self.account_id,
                "FunctionArn": function.function_arn,
            }
        )
        mapping = EventSourceMapping(spec)
        self._event_source_mappings[mapping.uuid] = mapping
        return mapping

    register_once._shoal = True  # type: ignore[attr-defined]
    Consumer.__init__ = consumer_init
    KinesisBackend.register_stream_consumer = register_once
    LambdaBackend.create_event_source_mapping = create_on_consumer
