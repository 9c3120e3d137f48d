"""cdk-nag's findings that the stack keeps, acknowledged beside the construct that causes them.

cdk-nag 3 reads CDK's own acknowledgements (``cdk.Validations.of(construct).acknowledge``): one
names a rule, or one finding of a rule (``AwsSolutions-IAM5[Resource::<Table.Arn>/index/*]``),
with the reason, on the construct or on one of its scopes. The wildcard rule reports one finding
per wildcard action and resource of a policy, named as cdk-nag flattens the template's
intrinsics; ``wildcard_findings`` names them the same way from the statements the stack makes,
so a grant acknowledges exactly the wildcards it adds, with the reason it needs them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any, TypeAlias

import aws_cdk as cdk
from aws_cdk import aws_iam as iam
from aws_cdk import aws_lambda as lambda_
from constructs import IConstruct

WILDCARD_RULE = "AwsSolutions-IAM5"
#: the managed policy CDK gives every Lambda function's role: its own logs, nothing else
BASIC_EXECUTION = (
    "AwsSolutions-IAM4[Policy::arn:<AWS::Partition>:iam::aws:policy/service-role/"
    "AWSLambdaBasicExecutionRole]"
)


def acknowledge(scope: IConstruct, rule: str, reason: str) -> None:
    """``rule`` (or one finding of it) is kept on ``scope`` and everything under it, because
    ``reason``."""
    cdk.Validations.of(scope).acknowledge(cdk.Acknowledgment(id=rule, reason=reason))


def flatten(reference: Any) -> str:
    """A resolved template value as cdk-nag names it in a finding (its flattenCfnReference):
    ``{"Fn::GetAtt": ["T", "Arn"]}`` -> ``<T.Arn>``, ``{"Ref": "AWS::Region"}`` ->
    ``<AWS::Region>``, joins joined."""
    if reference is None:
        return ""
    if isinstance(reference, str):
        return reference.replace("${", "<").replace("}", ">")
    if isinstance(reference, dict):
        if "Fn::Join" in reference:
            delimiter, items = reference["Fn::Join"]
            return str(delimiter).join(flatten(item) for item in items)
        if "Fn::Sub" in reference:
            return flatten(reference["Fn::Sub"])
        if "Fn::GetAtt" in reference:
            resource, attribute = reference["Fn::GetAtt"]
            return f"<{flatten(resource)}.{flatten(attribute)}>"
        if "Fn::ImportValue" in reference:
            return flatten(reference["Fn::ImportValue"])
        if "Ref" in reference:
            return f"<{flatten(reference['Ref'])}>"
    return json.dumps(reference, separators=(",", ":"))


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


#: a statement as the stack makes it, or as a template holds it (resolved)
Statement: TypeAlias = iam.PolicyStatement | Mapping[str, Any]


def wildcard_findings(scope: IConstruct, statements: Iterable[Statement]) -> list[str]:
    """The ``AwsSolutions-IAM5`` findings the statements' wildcards raise, by their ids."""
    stack = cdk.Stack.of(scope)
    found: list[str] = []
    for statement in statements:
        resolved = stack.resolve(
            statement.to_statement_json()
            if isinstance(statement, iam.PolicyStatement)
            else statement
        )
        if not isinstance(resolved, dict) or resolved.get("Effect") != "Allow":
            continue
        found += [
            f"{WILDCARD_RULE}[Action::{a}]" for a in _as_list(resolved.get("Action")) if "*" in a
        ]
        found += [
            f"{WILDCARD_RULE}[Resource::{r}]"
            for r in map(flatten, _as_list(resolved.get("Resource")))
            if "*" in r
        ]
    return list(dict.fromkeys(found))


def acknowledge_wildcards(scope: IConstruct, statements: Iterable[Statement], reason: str) -> None:
    """Each wildcard of ``statements`` (given to a role under ``scope``) is kept, because
    ``reason``."""
    findings = wildcard_findings(scope, statements)
    if findings and not reason.strip():
        raise ValueError(f"{scope.node.path}: a wildcard is kept only with its reason: {findings}")
    for finding in findings:
        acknowledge(scope, finding, reason)


def role_statements(role: iam.Role) -> list[Mapping[str, Any]]:
    """The statements of the role's default policy as they are now (CDK's grants included),
    resolved."""
    policy = role.node.try_find_child("DefaultPolicy")
    if not isinstance(policy, iam.Policy):
        return []
    document = cdk.Stack.of(role).resolve(policy.document.to_json())
    return list(_as_list(document.get("Statement", [])))


def acknowledge_function(fn: lambda_.IFunction) -> None:
    """What every declared function keeps (``infra.stack``): its execution role's managed
    policy, its runtime, no dead-letter queue."""
    acknowledge(
        fn, BASIC_EXECUTION, "CDK's execution role policy: the function's own log streams only"
    )
    for rule in ("AwsSolutions-L1", "Serverless-LambdaLatestVersion"):
        acknowledge(
            fn,
            rule,
            "the runtime is the Python the suite runs and the layer is built for "
            "(tests/infra/test_package_limits.py): it moves with them",
        )
    acknowledge(
        fn,
        "Serverless-LambdaDLQ",
        "a dead-letter queue serves asynchronous invocations only: API Gateway and the custom "
        "resource providers invoke synchronously, event source mappings never skip a batch "
        "(shoal.aws.kinesis.NEVER_SKIP), and a scheduled run that fails is superseded by the next",
    )


def acknowledge_provider(provider: IConstruct, on_event: lambda_.IFunction) -> None:
    """CDK's custom resource provider framework (``custom_resources.Provider``): its own
    function and role, which the stack does not write, calling ``on_event``."""
    acknowledge(provider, BASIC_EXECUTION, "CDK's provider framework: its function's own logs")
    acknowledge_wildcards(
        provider,
        [
            iam.PolicyStatement(
                actions=["lambda:InvokeFunction"], resources=[f"{on_event.function_arn}:*"]
            )
        ],
        "CDK's provider framework invokes the handler's versions and aliases too",
    )
    for rule, reason in (
        ("Serverless-LambdaDLQ", "CloudFormation invokes the framework and is answered FAILED"),
        ("Serverless-LambdaDefaultMemorySize", "CDK's framework function, a few calls a deploy"),
    ):
        acknowledge(provider, rule, reason)
