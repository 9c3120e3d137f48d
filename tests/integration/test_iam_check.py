"""The check of calls against roles fails when a grant is missing, and names the call.

The whole-suite check (tests/iam/plugin.py) passes when every call is allowed; this proves it
would not pass a call its role lacks: the same publish, held against a stack synthesized from
declarations without the publish function's write grant on the storage streams.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import boto3
import pytest
from shoal.aws import clients
from shoal.core.config import get_config
from shoal.declarations import DEPLOYMENT, Deployment, Grant
from shoal.local import calls as recorder

from tests.iam.check import denied
from tests.iam.requests import Call
from tests.iam.roles import deployed_roles, synthesized_roles
from tests.integration.test_publish_harness import publish_call

pytestmark = pytest.mark.infra

STORAGE_WRITE = Grant("streams", "storage", "write")


def without_grant(deployment: Deployment, function: str, grant: Grant) -> Deployment:
    functions = tuple(
        dataclasses.replace(f, grants=tuple(g for g in f.grants if g != grant))
        if f.name == function
        else f
        for f in deployment.functions
    )
    return dataclasses.replace(deployment, functions=functions)


@contextmanager
def recorded(folder: Path) -> Iterator[list[Call]]:
    """The calls functions make inside the block, each one, as the suite's recorder sees them
    (installed here when the suite's check is off: it records every client made afterwards)."""
    log = recorder.installed()
    if log is None:
        log = recorder.install(folder)
        # botocore gives the recorder's handlers to sessions made from now on
        clients.reset()
    seen: list[Call] = []

    def listen(line: Mapping[str, Any]) -> None:
        seen.append(Call.from_json(line))

    log.listeners.append(listen)
    try:
        yield seen
    finally:
        log.listeners.remove(listen)


def test_a_publish_without_its_stream_grant_is_named_by_the_check(
    aws: boto3.Session, tmp_path: Path
) -> None:
    from shoal.composite.service import ensure_default_topic
    from shoal.wiring import topic_service

    ensure_default_topic(topic_service(get_config()))
    # Given a publish, recorded
    with recorded(tmp_path) as calls:
        status, _ = publish_call({"topic": "orders/eu/1", "text": "hello"})
    assert status == 201
    puts = [c for c in calls if c.function == "publish" and c.service == "kinesis"]
    assert puts, "the publish function's put is recorded as its own"
    # When held against the roles of the real declarations, Then every call is allowed
    assert denied(calls, deployed_roles()) == []
    # When held against a stack whose publish role lacks the write grant on the streams
    reduced = synthesized_roles(without_grant(DEPLOYMENT, "publish", STORAGE_WRITE))
    found = denied(calls, reduced)
    # Then the check names the function, the action and the stream it was put to
    assert any(
        d.function == "publish"
        and d.action in ("kinesis:PutRecord", "kinesis:PutRecords")
        and d.resource == "arn:aws:kinesis:us-east-1:123456789012:stream/shoal-default-0"
        and d.why == "no statement allows it"
        for d in found
    ), found
    # and says which test was running when the call was seen (to tell a test's own calls
    # from a function's)
    assert all("test_a_publish_without_its_stream_grant" in d.seen_in for d in found), found
    # And nothing it still grants (the reads kept by the read grant) is named
    assert {d.action for d in found} <= {"kinesis:PutRecord", "kinesis:PutRecords"}


INBOXES = "arn:aws:dynamodb:us-east-1:123456789012:table/shoal-inboxes"
GROUPS = "arn:aws:dynamodb:us-east-1:123456789012:table/shoal-groups"
ARCHIVE_LINES = "arn:aws:s3:::shoal-archive-123456789012/messages/<key>"


@pytest.mark.parametrize(
    ("function", "action", "resource"),
    [
        # a switch seals what it left behind: the drain records (shoal.drain)
        ("admin", "dynamodb:GetItem", INBOXES),
        ("admin", "dynamodb:UpdateItem", INBOXES),
        # push's ordered drain gate (shoal.push.gate) reads and marks the same records
        ("push", "dynamodb:GetItem", INBOXES),
        ("push", "dynamodb:UpdateItem", INBOXES),
        # the pushes to connected sessions (shoal.edge.push, the pusher's since the push queue)
        # read the archive lines inbox items name, and the shared groups' deliveries
        ("pusher", "s3:GetObject", ARCHIVE_LINES),
        ("pusher", "dynamodb:GetItem", GROUPS),
        ("pusher", "dynamodb:Query", GROUPS),
    ],
)
def test_the_calls_the_first_whole_run_found_ungranted_are_allowed(
    function: str, action: str, resource: str
) -> None:
    # Given a call the check's first whole run with it on named (2026-11-29), made by the
    # function's own code deployed as it is (not a test's)
    from tests.iam.policy import Request, evaluate

    # Then the function's role in the synthesized stack allows it
    assert evaluate(deployed_roles().statements[function], Request(action, resource)).allowed


def _handler(hook: Callable[[], str | None]) -> str | None:
    return hook()


def _library_call() -> str | None:
    return recorder.calling_function()


def test_a_tests_own_call_inside_a_handler_is_the_tests_not_the_handlers() -> None:
    # Given a handler's module, and a library's code it calls (the same code, given the
    # globals of a functions.<name> module and of a library module)
    handler = types.FunctionType(_handler.__code__, {"__name__": "functions.router.app"})
    call = types.FunctionType(
        _library_call.__code__, {"__name__": "shoal.somewhere", "recorder": recorder}
    )
    # When the handler calls the library, Then the call is the handler's function's
    assert handler(call) == "router"

    # When a test's hook that the handler runs (a fault switch, a clock's sleep) calls AWS
    def hook() -> str | None:
        return call()

    # Then it is the test's, no function's (the first whole run took such calls for the
    # router's and the messages function's)
    assert handler(hook) is None


def test_each_allowlisted_unused_grant_has_a_reason_and_is_still_granted() -> None:
    from tests.iam.allowlist import UNUSED_GRANTS
    from tests.iam.check import granted

    roles = deployed_roles()
    for (function, action), entry in UNUSED_GRANTS.items():
        # Then each entry says why, and names an action some role (that one) is granted
        assert entry.reason.strip(), (function, action)
        holders = list(roles.statements) if function == "*" else [function]
        assert any(action in granted(roles.statements.get(f, ())) for f in holders), action


def test_the_unused_grant_report_names_what_the_allowlist_lacks_and_what_it_keeps_too_long() -> (
    None
):
    from tests.iam.allowlist import Unused
    from tests.iam.check import report, stale_entries, unlisted_unused, unused_grants

    roles = deployed_roles()
    put = Call.from_json(
        {
            "function": "publish",
            "service": "kinesis",
            "operation": "PutRecords",
            "params": {"StreamName": "shoal-default-0"},
        }
    )
    # Given a run in which publish put records, and one in which it did not
    used, idle = unused_grants([put], roles), unused_grants([], roles)
    # Then the grant it did not use is reported, and named unless the allowlist gives a reason
    assert "kinesis:PutRecords" in idle["publish"]
    assert "kinesis:PutRecords" not in used.get("publish", set())
    assert ("publish", "kinesis:PutRecords") in unlisted_unused(idle, {})
    kept = {("publish", "kinesis:PutRecords"): Unused("a test's reason")}
    assert ("publish", "kinesis:PutRecords") not in unlisted_unused(idle, kept)
    # And an entry for a grant that was used after all, or that no role has, is named stale
    assert stale_entries(used, roles, kept) == [("publish", "kinesis:PutRecords")]
    # but for an entry of a grant used in some runs only
    sometimes = {("publish", "kinesis:PutRecords"): Unused("a test's reason", sometimes=True)}
    assert stale_entries(used, roles, sometimes) == []
    assert stale_entries(idle, roles, sometimes) == []
    gone = {("publish", "kinesis:UpdateShardCount"): Unused("a test's reason")}
    assert stale_entries(idle, roles, gone) == [("publish", "kinesis:UpdateShardCount")]
    gone = {("publish", "kinesis:UpdateShardCount"): Unused("a test's reason", sometimes=True)}
    assert stale_entries(idle, roles, gone) == [("publish", "kinesis:UpdateShardCount")]
    # And the report says, per function, what was used and what was not
    assert "  publish: " in report([put], roles)


def test_a_run_of_every_integration_and_end_to_end_module_is_known_as_covering() -> None:
    from tests.iam.plugin import covering_modules

    # Given the modules whose tests decide whether a grant is unused
    wanted = covering_modules()
    # Then they are the modules with tests, not the support and harness modules named test_*
    # (none of whose tests is ever reported: with them wanted, no run was ever covering and the
    # allowlist was never enforced)
    assert "tests/integration/test_iam_check.py" in wanted
    assert "tests/e2e/test_publish_e2e.py" in wanted
    assert "tests/integration/test_delivery_support.py" not in wanted
    assert "tests/integration/test_publish_harness.py" not in wanted
