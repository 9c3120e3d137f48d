"""The lifecycle of what Shoal makes at run time: a custom resource whose Delete removes it.

Kinesis streams and event source mappings are made by the admin API and the bootstrap, not by
CloudFormation, so ``cdk destroy`` alone would leave every shard billed. The declared
``teardown`` function (``functions/teardown``, logic in ``shoal.teardown``) runs as a custom
resource: Create and Update change nothing; Delete removes the streams and mappings that the
topics and push subscriptions tables and the router's and push's mappings name, unless
``Retain`` (CDK context ``retainStreams``) is true.

Why CDK's ``Provider`` framework rather than a plain ``CustomResource`` on the function: a
plain one must answer CloudFormation's presigned URL itself, and a handler that crashes or
times out before answering leaves the stack waiting for an hour; the framework answers for
it (a raised error becomes a FAILED answer with the message at once), logs each event, and is
what the bootstrap already uses, so the teardown function stays a plain on_event handler.

Order: CloudFormation deletes a resource before whatever it depends on. The resource depends
on the teardown function (through the provider, with its role's policy), on the functions
whose mappings it deletes and on every table it reads, so all of them are still there when
its Delete runs; the bootstrap's default topic depends on it, so it is created before the
bootstrap makes any stream (a create that fails later rolls back through its Delete).
"""

from __future__ import annotations

import aws_cdk as cdk
from aws_cdk import aws_iam as iam
from aws_cdk import aws_logs as logs
from aws_cdk import custom_resources
from shoal.teardown import MAPPED_FUNCTIONS

from infra.nag import acknowledge_provider
from infra.parts import StackParts

#: the declared function the stack runs as the runtime resources' custom resource
TEARDOWN = "teardown"
RESOURCE_TYPE = "Custom::ShoalRuntimeResources"
#: the bootstrap's custom resource (infra/stack.py), created after this one
BOOTSTRAP_RESOURCE = "DefaultTopic"


def runtime_resources(parts: StackParts) -> cdk.CustomResource | None:
    """The teardown custom resource, when the deployment declares a ``teardown`` function."""
    stack = cdk.Stack.of(parts)
    function = parts.functions.get(TEARDOWN)
    if function is None:
        return None
    # the handler reads its own stack's status: a Delete tears down only a stack going away
    function.add_to_role_policy(
        iam.PolicyStatement(actions=["cloudformation:DescribeStacks"], resources=[stack.stack_id])
    )
    provider = custom_resources.Provider(
        stack,
        "TeardownProvider",
        on_event_handler=function,
        log_group=logs.LogGroup(
            stack,
            "TeardownProviderLogs",
            retention=logs.RetentionDays.ONE_MONTH,
            removal_policy=cdk.RemovalPolicy.DESTROY,
        ),
    )
    acknowledge_provider(provider, function)
    resource = cdk.CustomResource(
        stack,
        "RuntimeResources",
        service_token=provider.service_token,
        resource_type=RESOURCE_TYPE,
        properties={"Retain": parts.settings.retain_streams},
        # never RETAIN: retention is the handler's decision (the Retain property), so that a
        # deploy that changes the setting changes what the next deletion does
        removal_policy=cdk.RemovalPolicy.DESTROY,
    )
    for name in MAPPED_FUNCTIONS:
        if name in parts.functions:
            resource.node.add_dependency(parts.functions[name])
    for table in parts.tables.values():
        resource.node.add_dependency(table)
    bootstrap = stack.node.try_find_child(BOOTSTRAP_RESOURCE)
    if bootstrap is not None:
        bootstrap.node.add_dependency(resource)
    return resource
