"""The IAM evaluator of the calls-against-roles check: IAM's matching, Deny first."""

from __future__ import annotations

from tests.iam.policy import Request, Statement, evaluate, wildcard
from tests.iam.requests import Call

TABLE = "arn:aws:dynamodb:us-east-1:123456789012:table/shoal-topics"


def allow(actions: list[str], resources: list[str], **condition: dict[str, str]) -> Statement:
    raw: dict[str, object] = {"Effect": "Allow", "Action": actions, "Resource": resources}
    if condition:
        raw["Condition"] = condition
    return Statement.from_json(raw)


def test_wildcards_match_as_iam_matches_them() -> None:
    # `*` spans `/` and `:`, `?` is one character, `.` is a dot, actions ignore case
    assert wildcard("arn:aws:kinesis:*:*:stream/shoal-*", "arn:aws:kinesis:r:1:stream/shoal-a-0")
    assert not wildcard("arn:aws:s3:::b/payloads/*", "arn:aws:s3:::b/messages/x")
    assert wildcard("table/shoal-???", "table/shoal-abc")
    assert not wildcard("table/shoal.topics", "table/shoalxtopics")
    assert wildcard("dynamodb:getitem", "dynamodb:GetItem", case=False)
    assert not wildcard("arn:aws:s3:::B", "arn:aws:s3:::b")


def test_an_allow_on_the_resource_allows_and_another_resource_is_denied() -> None:
    statements = [allow(["dynamodb:GetItem", "dynamodb:Query"], [TABLE, f"{TABLE}/index/*"])]
    assert evaluate(statements, Request("dynamodb:GetItem", TABLE)).allowed
    assert evaluate(statements, Request("dynamodb:Query", f"{TABLE}/index/by-name")).allowed
    # another table, another action: nothing allows them (an implicit deny)
    other = Request("dynamodb:GetItem", TABLE.replace("topics", "sessions"))
    assert not evaluate(statements, other).allowed
    assert evaluate(statements, Request("dynamodb:PutItem", TABLE)).by is None


def test_an_explicit_deny_wins_over_every_allow() -> None:
    statements = [
        allow(["dynamodb:*"], ["*"]),
        Statement.from_json({"Effect": "Deny", "Action": "dynamodb:DeleteItem", "Resource": TABLE}),
    ]
    decision = evaluate(statements, Request("dynamodb:DeleteItem", TABLE))
    assert not decision.allowed
    assert decision.by is not None and decision.by.effect == "Deny"
    assert evaluate(statements, Request("dynamodb:PutItem", TABLE)).allowed


def test_not_action_and_not_resource_match_what_they_do_not_name() -> None:
    statements = [
        Statement.from_json({"Effect": "Allow", "NotAction": "s3:Delete*", "NotResource": TABLE})
    ]
    assert evaluate(statements, Request("s3:GetObject", "arn:aws:s3:::b/k")).allowed
    assert not evaluate(statements, Request("s3:DeleteObject", "arn:aws:s3:::b/k")).allowed
    assert not evaluate(statements, Request("s3:GetObject", TABLE)).allowed


def test_a_condition_on_a_key_the_call_gives_is_evaluated() -> None:
    router = "arn:aws:lambda:us-east-1:123456789012:function:shoal-router"
    statements = [
        allow(
            ["lambda:CreateEventSourceMapping"],
            ["*"],
            StringLike={"lambda:FunctionArn": router},
        )
    ]
    create = "lambda:CreateEventSourceMapping"
    assert evaluate(statements, Request(create, "*", {"lambda:FunctionArn": router})).allowed
    push = router.replace("router", "push")
    assert not evaluate(statements, Request(create, "*", {"lambda:FunctionArn": push})).allowed
    # a key the call does not give is taken as met, and said so
    loose = evaluate(statements, Request(create, "*"))
    assert loose.allowed and loose.unchecked == ("StringLike:lambda:FunctionArn",)


def test_calls_become_the_requests_iam_authorizes() -> None:
    def requests(service: str, operation: str, **params: object) -> list[tuple[str, str]]:
        call = Call("f", service, operation, "us-east-1", params)
        return [(r.action, r.resource) for r in call.requests()]

    bucket = "arn:aws:s3:::shoal-archive-123456789012"
    assert requests(
        "s3", "HeadObject", Bucket="shoal-archive-123456789012", Key="messages/<key>"
    ) == [("s3:GetObject", f"{bucket}/messages/<key>")]
    assert requests("s3", "ListObjectsV2", Bucket="shoal-archive-123456789012") == [
        ("s3:ListBucket", bucket)
    ]
    items = [["Put", "shoal-sessions"], ["ConditionCheck", "shoal-topics"]]
    assert requests("dynamodb", "TransactWriteItems", TransactItems=items) == [
        ("dynamodb:PutItem", TABLE.replace("topics", "sessions")),
        ("dynamodb:ConditionCheckItem", TABLE),
    ]
    assert requests("dynamodb", "Query", TableName="shoal-topics", IndexName="due") == [
        ("dynamodb:Query", f"{TABLE}/index/due")
    ]
    assert requests("kinesis", "ListStreams") == [("kinesis:ListStreams", "*")]
    # CloudWatch signs its calls as "monitoring"; IAM names its actions "cloudwatch:"
    assert requests("monitoring", "GetMetricData") == [("cloudwatch:GetMetricData", "*")]
    assert requests("kinesis", "PutRecords", StreamName="shoal-default-0") == [
        ("kinesis:PutRecords", "arn:aws:kinesis:us-east-1:123456789012:stream/shoal-default-0")
    ]
    call = Call(
        "ws",
        "execute-api",
        "PostToConnection",
        "us-east-1",
        {"ConnectionId": "c1"},
        endpoint="abc.execute-api.us-east-1.amazonaws.com",
        path="/prod/@connections/c1",
        method="POST",
    )
    assert [(r.action, r.resource) for r in call.requests()] == [
        (
            "execute-api:ManageConnections",
            "arn:aws:execute-api:us-east-1:123456789012:abc/prod/POST/@connections/c1",
        )
    ]
