"""Removing what Shoal made at run time when its stack is deleted: the streams and mappings.

Kinesis streams (storage topics, push subscriptions' retry and dead-letter queues) and the
event source mappings that feed them to the router and push functions are made by the admin
API and the deploy-time bootstrap, not by CloudFormation, so deleting the stack alone leaves
them behind, every shard billed by the hour. The stack runs this module as a custom resource
(``functions/teardown``) that CloudFormation deletes before the functions and tables it reads;
its Delete removes them.

What is removed is found where Shoal records it, never by listing the account's streams by
name (another deployment may share the prefix):

* the topics table: every storage topic of every composite topic, and a pending one (its
  stream may exist: ``shoal.composite.service`` creates the stream before it records it);
* the push subscriptions table: each subscription's RQ and DLQ streams, and each push tap's
  storage stream;
* the event source mappings of the functions that runtime mappings invoke
  (``MAPPED_FUNCTIONS``), and the streams they read;
* the router's enhanced fan-out consumers (``shoal.aws.kinesis.ROUTER_CONSUMER``): those its
  mappings read, and, with the option on, every one registered on the streams above (a make
  that crashed before its mapping). With the option off the role may not list consumers; the
  stream's deletion (``EnforceConsumerDeletion``) removes any left from a time it was on.

Mappings go first (a mapping on a deleted stream only fails), then consumers, then streams.
Every step treats "already gone" as done and nothing is written to the tables, so a Delete that
stopped halfway (a timeout, a throttled call) is finished by the next one: the tables still name
everything.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from botocore.exceptions import ClientError

from shoal.aws import clients, tables
from shoal.aws.clients import error_code
from shoal.aws.dynamo import Dynamo
from shoal.aws.kinesis import ROUTER_CONSUMER
from shoal.composite.model import CompositeTopic
from shoal.core.clock import Clock, SystemClock
from shoal.core.config import Config
from shoal.core.observability import logger
from shoal.core.retry import backoff_s
from shoal.push.model import DLQ, RQ, PushSubscription
from shoal.push.store import TAP_PREFIX

if TYPE_CHECKING:
    from mypy_boto3_kinesis import KinesisClient
    from mypy_boto3_lambda import LambdaClient

#: the declared functions that event source mappings made at run time invoke (the admin API's
#: and bootstrap's ``event_source_mappings`` grants name no other; tests/infra checks it)
MAPPED_FUNCTIONS = ("router", "push")
#: the one physical id of the custom resource, whatever its properties: a new id on an Update
#: would make CloudFormation Delete the "old" resource, which would tear down a live stack
PHYSICAL_ID = "shoal-runtime-resources"
#: a Delete of the custom resource removes the runtime resources only while the whole stack is
#: going away: deleted, or rolled back after a failed create (the bootstrap may have made the
#: default topic). In an update (the resource removed from the template, or an update that
#: added it rolled back) the stack and its topics stay.
STACK_GOING = frozenset({"DELETE_IN_PROGRESS", "ROLLBACK_IN_PROGRESS"})
#: a stream still being created or resharded, a mapping still being created or updated, and
#: Kinesis' limit of five DeleteStream calls a second per account: worth waiting for
_BUSY = frozenset({"ResourceInUseException", "LimitExceededException", "TooManyRequestsException"})
_GONE = frozenset({"ResourceNotFoundException"})
BACKOFF_S = 0.5
BACKOFF_CAP_S = 5.0
#: Kinesis allows five DeleteStream calls a second per account: deletes are paced to that
#: rate, so that hundreds of streams go in one pass instead of many passes of refusals
STREAM_DELETE_PACE_S = 0.2


class TeardownIncomplete(RuntimeError):
    """Some streams or mappings were still busy when the budget ran out; deleting again
    finishes the job (CloudFormation reports the message, and ``cdk destroy`` repeats)."""


@dataclass(frozen=True)
class Inventory:
    """What a teardown removes: stream names and mapping UUIDs."""

    streams: frozenset[str]
    mappings: frozenset[str]
    #: consumer ARNs
    consumers: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Outcome:
    mappings_deleted: int
    streams_deleted: int
    consumers_deregistered: int = 0


def truthy(value: Any) -> bool:
    """A custom resource property as a boolean: CloudFormation passes every value as a string."""
    if isinstance(value, bool):
        return value
    return str(value).strip().lower() in {"1", "true", "yes"}


class Teardown:
    def __init__(
        self,
        config: Config,
        kinesis: KinesisClient,
        awslambda: LambdaClient,
        dynamo: Dynamo,
        clock: Clock | None = None,
        *,
        budget_s: float = 240.0,
    ) -> None:
        self.config = config
        self.kinesis = kinesis
        self.awslambda = awslambda
        self.dynamo = dynamo
        self.clock = clock or SystemClock()
        #: how long busy resources are waited for before the teardown gives up (and fails,
        #: so that the stack's deletion stops instead of leaving billed shards silently)
        self.budget_s = budget_s
        self.prefix = f"{config.stream_prefix}-"

    @classmethod
    def from_config(cls, config: Config, clock: Clock | None = None) -> Teardown:
        return cls(
            config,
            clients.client("kinesis", config.region, "streams"),
            clients.client("lambda", config.region, "streams"),
            Dynamo.from_config(config),
            clock,
        )

    # -- what is there ----------------------------------------------------------------------

    def inventory(self) -> Inventory:
        streams: set[str] = set()
        for record in self._scan(tables.TOPICS):
            topic = CompositeTopic.from_record(record)
            pending = [topic.pending] if topic.pending is not None else []
            streams |= {s.stream for s in (*topic.storage_topics, *pending)}
        for record in self._scan(tables.PUSH_SUBSCRIPTIONS):
            name = str(record["name"])
            if name.startswith(TAP_PREFIX):
                streams.add(name[len(TAP_PREFIX) :])
            elif record.get("spec"):
                sub = PushSubscription.from_record(record)
                streams |= {sub.queue(q, self.config.stream_prefix).stream for q in (RQ, DLQ)}
        mappings: set[str] = set()
        consumers: set[str] = set()
        for function in MAPPED_FUNCTIONS:
            for mapping in self._mappings(function):
                source = str(mapping.get("EventSourceArn", ""))
                stream = _stream_of(source)
                if stream is not None and stream.startswith(self.prefix):
                    mappings.add(str(mapping["UUID"]))
                    streams.add(stream)
                    if _consumer_of(source) == ROUTER_CONSUMER:
                        consumers.add(source)
        # only streams in the stack's own namespace (its IAM allows no other anyway)
        owned = frozenset(s for s in streams if s.startswith(self.prefix))
        if "router" in self.config.enhanced_fan_out:
            consumers |= self._router_consumers(owned)
        return Inventory(
            streams=owned, mappings=frozenset(mappings), consumers=frozenset(consumers)
        )

    def _router_consumers(self, streams: Iterable[str]) -> set[str]:
        """The router's consumers registered on ``streams``, with or without a mapping."""
        found: set[str] = set()
        for stream in sorted(streams):
            try:
                arn = self.kinesis.describe_stream_summary(StreamName=stream)[
                    "StreamDescriptionSummary"
                ]["StreamARN"]
                kwargs: dict[str, Any] = {"StreamARN": arn}
                while True:
                    response = self.kinesis.list_stream_consumers(**kwargs)
                    found |= {
                        c["ConsumerARN"]
                        for c in response.get("Consumers", [])
                        if c["ConsumerName"] == ROUTER_CONSUMER
                    }
                    if not response.get("NextToken"):
                        break
                    kwargs = {"StreamARN": arn, "NextToken": response["NextToken"]}
            except ClientError as exc:
                if error_code(exc) in _GONE:
                    continue  # the stream went first: its consumers went with it
                raise
        return found

    def _scan(self, logical: str) -> list[dict[str, Any]]:
        if logical not in self.config.tables:
            return []
        try:
            return self.dynamo.scan(self.config.table(logical), ConsistentRead=True)
        except ClientError as exc:
            if error_code(exc) in _GONE:
                return []  # the table went first: nothing it named can be found this way
            raise

    def _mappings(self, function: str) -> list[Mapping[str, Any]]:
        physical = self.config.functions.get(function)
        if physical is None:
            return []
        found: list[Mapping[str, Any]] = []
        kwargs: dict[str, Any] = {"FunctionName": physical}
        try:
            while True:
                response = self.awslambda.list_event_source_mappings(**kwargs)
                found.extend(response.get("EventSourceMappings", []))
                if not response.get("NextMarker"):
                    return found
                kwargs["Marker"] = response["NextMarker"]
        except ClientError as exc:
            if error_code(exc) in _GONE:
                return found
            raise

    # -- removing it ------------------------------------------------------------------------

    def run(self) -> Outcome:
        found = self.inventory()
        deadline = self.clock.now_ms() + int(self.budget_s * 1000)
        mappings = self._until_done(sorted(found.mappings), self._delete_mapping, deadline)
        consumers = self._until_done(sorted(found.consumers), self._deregister_consumer, deadline)
        streams = self._until_done(
            sorted(found.streams), self._delete_stream, deadline, pace_s=STREAM_DELETE_PACE_S
        )
        logger.info(
            "runtime resources removed",
            extra={"mappings": mappings, "consumers": consumers, "streams": streams},
        )
        return Outcome(
            mappings_deleted=mappings, streams_deleted=streams, consumers_deregistered=consumers
        )

    def _until_done(
        self,
        names: Iterable[str],
        delete: Callable[[str], bool | None],
        deadline_ms: int,
        *,
        pace_s: float = 0.0,
    ) -> int:
        """Delete each, ``pace_s`` apart; a busy one is tried again after the others, with
        backoff, until the deadline. The count of those this call deleted (gone already: not
        counted)."""
        left = list(names)
        deleted = 0
        attempt = 0
        while left:
            busy: list[str] = []
            for i, name in enumerate(left):
                if i and pace_s:
                    self.clock.sleep(pace_s)
                if self.clock.now_ms() > deadline_ms:
                    # end before Lambda's timeout would, with a message CloudFormation shows
                    raise TeardownIncomplete(
                        f"{len(busy) + len(left) - i} resources not deleted yet; "
                        "delete again to finish"
                    )
                outcome = delete(name)
                if outcome is None:
                    busy.append(name)
                elif outcome:
                    deleted += 1
            left = busy
            if not left:
                break
            attempt += 1
            wait = backoff_s(attempt, BACKOFF_S, BACKOFF_CAP_S)
            if self.clock.now_ms() + wait * 1000 > deadline_ms:
                raise TeardownIncomplete(
                    f"{len(left)} resources still busy (for example {left[0]}); "
                    "delete again to finish"
                )
            self.clock.sleep(wait)
        return deleted

    def _delete_mapping(self, uuid: str) -> bool | None:
        """True: deleted; False: gone already; None: busy, try again."""
        try:
            self.awslambda.delete_event_source_mapping(UUID=uuid)
        except ClientError as exc:
            if error_code(exc) in _GONE:
                return False
            if error_code(exc) in _BUSY:
                return None
            raise
        return True

    def _deregister_consumer(self, consumer_arn: str) -> bool | None:
        """True: deregistered; False: gone already; None: busy (throttled), try again."""
        try:
            self.kinesis.deregister_stream_consumer(ConsumerARN=consumer_arn)
        except ClientError as exc:
            if error_code(exc) in _GONE:
                return False
            if error_code(exc) in _BUSY:
                return None
            raise
        return True

    def _delete_stream(self, stream: str) -> bool | None:
        """True: deleted (or being deleted); False: gone already; None: busy, try again."""
        try:
            # consumers (enhanced fan-out) would make the delete fail: the router's were
            # deregistered above when the option is on, and one left from a time it was on,
            # or an operator's, goes with the stream
            self.kinesis.delete_stream(StreamName=stream, EnforceConsumerDeletion=True)
        except ClientError as exc:
            if error_code(exc) in _GONE:
                return False
            if error_code(exc) == "ResourceInUseException" and self._status(stream) in (
                None,
                "DELETING",
            ):
                return False  # another delete (an earlier pass) is already removing it
            if error_code(exc) in _BUSY:
                return None
            raise
        return True

    def _status(self, stream: str) -> str | None:
        try:
            summary = self.kinesis.describe_stream_summary(StreamName=stream)
        except ClientError as exc:
            if error_code(exc) in _GONE:
                return None
            raise
        return str(summary["StreamDescriptionSummary"]["StreamStatus"])


def _consumer_of(arn: str) -> str | None:
    """The consumer name of a consumer ARN (``...:stream/N/consumer/NAME:CREATED``); None for
    a stream's ARN."""
    _, marker, rest = arn.partition("/consumer/")
    return rest.split(":", 1)[0] if marker else None


def _stream_of(arn: str) -> str | None:
    """The stream name of a Kinesis stream ARN (arn:aws:kinesis:<region>:<account>:stream/N)."""
    parts = arn.split(":", 5)
    if len(parts) != 6 or parts[2] != "kinesis" or not parts[5].startswith("stream/"):
        return None
    return parts[5][len("stream/") :].split("/", 1)[0]


def stack_status(cloudformation: Any, stack_id: str) -> str | None:
    """The stack's status as CloudFormation reports it; None when it names no stack."""
    try:
        stacks = cloudformation.describe_stacks(StackName=stack_id)["Stacks"]
    except ClientError as exc:
        if error_code(exc) == "ValidationError":  # "Stack with id ... does not exist"
            return None
        raise
    return str(stacks[0]["StackStatus"]) if stacks else None


def on_event(
    event: Mapping[str, Any],
    teardown: Callable[[], Teardown],
    status_of: Callable[[str], str | None],
) -> dict[str, Any]:
    """The custom resource's answer to CloudFormation (CDK's Provider framework sends it).

    Create and Update only record the resource (always under ``PHYSICAL_ID``). Delete removes
    the runtime resources unless the ``Retain`` property is true, and only while the stack is
    going away (``STACK_GOING``).
    """
    request = event.get("RequestType")
    retain = truthy((event.get("ResourceProperties") or {}).get("Retain", False))
    answer: dict[str, Any] = {"PhysicalResourceId": PHYSICAL_ID}
    if request != "Delete":
        return answer | {"Data": {"Retain": "true" if retain else "false"}}
    if retain:
        logger.info("runtime resources retained (Retain is true)")
        return answer
    status = status_of(str(event.get("StackId", "")))
    if status not in STACK_GOING:
        logger.info("the stack stays: runtime resources kept", extra={"stack_status": status})
        return answer
    outcome = teardown().run()
    return answer | {
        "Data": {
            "MappingsDeleted": outcome.mappings_deleted,
            "ConsumersDeregistered": outcome.consumers_deregistered,
            "StreamsDeleted": outcome.streams_deleted,
        }
    }
