"""Granted but never seen used in the integration and end-to-end suites: each with its reason.

The check of calls against roles (``tests.iam``) reports, per function, the actions its role
allows that none of its recorded calls needed. Each must be here with why it stays granted (a
path the suites do not reach, a grant CDK makes as a set); one that is used after all, or that
no role has any more, must leave the list. ``("*", action)`` stands for every function.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Unused:
    reason: str
    #: used in some whole runs and not in others (a path that timing decides): not held stale
    #: when a run used it, still when no role has it
    sometimes: bool = False


#: Whether a run that took in every integration and end-to-end module fails on an unused grant
#: missing here, or on an entry no longer unused. Filled from the report of tests/e2e and
#: tests/integration run with the check on (2026-11-29, 8,232 distinct calls of 12 functions):
#: each action below is granted to some function that was never seen to use it.
ENFORCED = True

#: a table Grant gives its access's whole set (infra/stack.py TABLE_READ, TABLE_WRITE), not
#: the actions one function's code calls
_TABLE_SET = (
    "a table Grant gives its access's whole action set (infra/stack.py TABLE_READ, "
    "TABLE_WRITE); this function's code calls others of it"
)
#: what Lambda's event source mapping pollers call with the function's role
_POLLED = (
    "Lambda's event source mappings read a function's streams with its role (the archiver's, "
    "the router's, push's); locally the runtime's pollers do it outside any function, "
    "unrecorded (docs/operations.md); other holders get it with the stream read set"
)
_FAN_OUT = (
    "enhanced fan-out, in the stream read set (infra/stack.py STREAM_READ): Lambda's pollers "
    "of a consumer (the router's, with the enhanced fan-out option) use the reading function's "
    "role; locally the runtime's pollers read, unrecorded. The makers of a consumer find it by "
    "listing (the stream_consumers grant), and only the teardown lists them otherwise"
)
_CONSUMERS = (
    "the stream_consumers grant gives register and deregister together (with the enhanced "
    "fan-out option, which the IAM check's roles have on); the teardown runs only as the "
    "stack's custom resource at deletion, which no suite deploys (its logic is tested without "
    "the handler), and the bootstrap deregisters only after a failed make, which the suites "
    "fail through the admin API (the same code, shoal.composite)"
)
_WRITE_SET = "the stream write set gives both PutRecord and PutRecords; each writer calls one"
_MANAGE = (
    "stream management (STREAM_MANAGE, with read_write on the storage streams): create and "
    "delete go together; the teardown (which deletes) runs only as the stack's custom resource "
    "at deletion, which no suite deploys, and bootstrap and admin delete no topic"
)
_MAPPINGS = (
    "an event_source_mappings grant gives get, list, create, update and delete; the teardown "
    "runs only as the stack's custom resource, and bootstrap and admin delete no topic's "
    "router mapping"
)
_BUCKET_SET = (
    "CDK's bucket grant gives its action groups (grant_read: s3:GetObject*, s3:GetBucket*, "
    "s3:List*; grant_write adds deletes, aborts, object lock and tagging); Shoal puts, gets "
    "and lists by prefix"
)

#: CDK's queue grants give sets too (grant_send_messages: SendMessage, GetQueueAttributes,
#: GetQueueUrl; grant_consume_messages adds ReceiveMessage, ChangeMessageVisibility,
#: DeleteMessage)
_QUEUE_SET = (
    "CDK's queue grants give their sets (send: SendMessage, GetQueueAttributes, GetQueueUrl); "
    "Shoal names its queues by URL (SHOAL_QUEUE_*) and reads none of their attributes"
)
_QUEUE_POLLED = (
    "Lambda's SQS event source mapping receives, deletes and reads the queue's attributes with "
    "the consuming function's role; locally the runtime's emulated mapping does it outside any "
    "function, unrecorded (shoal.local.esm.queues)"
)

UNUSED_GRANTS: dict[tuple[str, str], Unused] = {
    ("teardown", "cloudformation:DescribeStacks"): Unused(
        "the teardown reads its own stack's status at a Delete; it runs only as the stack's "
        "custom resource, which no suite deploys (its logic is tested without the handler)"
    ),
    **{
        ("*", f"dynamodb:{action}"): Unused(_TABLE_SET)
        for action in (
            "BatchGetItem",
            "BatchWriteItem",
            "DeleteItem",
            "GetItem",
            "Query",
            "Scan",
        )
    },
    ("*", "dynamodb:ConditionCheckItem"): Unused(
        "in both table sets: how a transaction writes under a condition on an item it does not "
        "write; no transaction of Shoal's does yet"
    ),
    ("*", "dynamodb:DescribeTable"): Unused(
        "in both table sets, for clients that look a table up; Shoal's code names its tables "
        "and describes none"
    ),
    **{
        ("*", f"kinesis:{action}"): Unused(_POLLED)
        for action in (
            "DescribeStream",
            "DescribeStreamSummary",
            "GetRecords",
            "GetShardIterator",
            "ListShards",
            "ListStreams",
        )
    },
    **{
        ("*", f"kinesis:{action}"): Unused(_FAN_OUT)
        for action in ("DescribeStreamConsumer", "ListStreamConsumers", "SubscribeToShard")
    },
    ("teardown", "kinesis:RegisterStreamConsumer"): Unused(_CONSUMERS),
    ("teardown", "kinesis:DeregisterStreamConsumer"): Unused(_CONSUMERS),
    ("bootstrap", "kinesis:DeregisterStreamConsumer"): Unused(_CONSUMERS),
    ("*", "kinesis:PutRecord"): Unused(_WRITE_SET),
    ("*", "kinesis:PutRecords"): Unused(_WRITE_SET),
    **{("*", f"kinesis:{action}"): Unused(_MANAGE) for action in ("CreateStream", "DeleteStream")},
    **{
        ("*", f"lambda:{action}EventSourceMapping{s}"): Unused(_MAPPINGS)
        for action, s in (
            ("Create", ""),
            ("Delete", ""),
            ("Get", ""),
            ("List", "s"),
            ("Update", ""),
        )
    },
    **{
        ("*", f"sqs:{action}"): Unused(_QUEUE_POLLED)
        for action in ("ReceiveMessage", "DeleteMessage")
    },
    **{
        ("*", f"sqs:{action}"): Unused(_QUEUE_SET)
        for action in ("GetQueueAttributes", "GetQueueUrl")
    },
    ("reaper", "sqs:ChangeMessageVisibility"): Unused(
        "in the consume set (the wills queue's mapping); a timer whose step failed returns to "
        "the queue by the batch response, after the visibility timeout: the schedule reaps "
        "its item meanwhile, so no shorter retry is set"
    ),
    **{
        ("*", f"s3:{action}"): Unused(_BUCKET_SET)
        for action in (
            "Abort*",
            "DeleteObject*",
            "GetBucket*",
            "List*",
            "PutObjectLegalHold",
            "PutObjectRetention",
            "PutObjectTagging",
            "PutObjectVersionTagging",
        )
    },
    ("pusher", "sqs:ChangeMessageVisibility"): Unused(
        "the pusher delays a returned chunk's retry (ChangeMessageVisibilityBatch); the suites "
        "that return one on purpose run the pusher's worker directly, outside a recorded "
        "function. A recorded one returns a chunk only when the store answers it busy, which "
        "timing decides: since the emulator's busy answer (ServiceUnavailable) is server_busy, "
        "used in one whole run (2026-12-05), not in the run before",
        sometimes=True,
    ),
    ("pusher", "dynamodb:UpdateItem"): Unused(
        "a write that timing decides: used in one whole run (2026-12-05), not in the run before "
        "nor in the soak's and the edge's modules run alone; the likely path is a push's get "
        "for a shared group's member writing the member's lanes when a lease or a hand-over "
        "falls due then (shoal.groups.store), which other runs leave to another function",
        sometimes=True,
    ),
}
