"""The enhanced fan-out option in the template (issue 48): off by default, and when on, the
grants that register and deregister the router's consumers, for exactly the functions that
make and remove storage streams, and the setting in every function's environment."""

from __future__ import annotations

import json

import pytest
from shoal.core.config import FAN_OUT_ENV

from tests.infra.stacks import Synth, as_list, context, synth
from tests.infra.test_nag import nag_findings

pytestmark = pytest.mark.infra

CONSUMER_MANAGEMENT = {"kinesis:RegisterStreamConsumer", "kinesis:DeregisterStreamConsumer"}
#: the functions that make storage streams (admin API, bootstrap) and remove them (teardown)
MAKERS = {"admin", "bootstrap", "teardown"}


def managers(synth: Synth) -> set[str]:
    return {
        f.name
        for f in synth.deployment.functions
        if synth.actions(f.name, "kinesis") & CONSUMER_MANAGEMENT
    }


def test_off_by_default_no_function_may_register_consumers(deployed: Synth) -> None:
    # Given cdk.json's context (no enhancedFanOut)
    # Then no role may register or deregister a consumer, and no function reads the option on
    assert managers(deployed) == set()
    for fdef in deployed.deployment.functions:
        env = deployed.function(fdef.name)["Properties"]["Environment"]["Variables"]
        assert FAN_OUT_ENV not in env


def test_on_the_makers_of_storage_streams_manage_the_routers_consumers(fan_out: Synth) -> None:
    # Given -c enhancedFanOut=router
    # Then exactly the functions that make and remove storage streams may manage consumers
    assert managers(fan_out) == MAKERS
    for name in MAKERS:
        for statement in fan_out.statements(name):
            actions = set(as_list(statement["Action"]))
            resources = json.dumps(statement["Resource"])
            # registering acts on the stack's storage streams; deregistering on their router
            # consumers only (an ARN ends in the consumer's name and creation time)
            if "kinesis:RegisterStreamConsumer" in actions:
                assert ":stream/shoal-*" in resources and "/consumer/" not in resources
            if "kinesis:DeregisterStreamConsumer" in actions:
                assert ":stream/shoal-*/consumer/router:*" in resources
    # And every function reads the option from its environment
    for fdef in fan_out.deployment.functions:
        env = fan_out.function(fdef.name)["Properties"]["Environment"]["Variables"]
        assert env[FAN_OUT_ENV] == "router"


def test_on_the_router_may_read_through_a_consumer(fan_out: Synth) -> None:
    # Lambda's pollers of a consumer use the router's role: SubscribeToShard and
    # DescribeStreamConsumer on the storage streams' consumers
    reads = [
        s
        for s in fan_out.statements("router")
        if {"kinesis:SubscribeToShard", "kinesis:DescribeStreamConsumer"}
        <= set(as_list(s["Action"]))
    ]
    assert reads and ":stream/shoal-*/consumer/*" in json.dumps(reads[0]["Resource"])


def test_on_the_stack_is_nag_clean(fan_out: Synth) -> None:
    # Given the option's grants, checked by AwsSolutions and Serverless
    findings = nag_findings(fan_out)
    # Then each wildcard they hold is acknowledged with its reason: no error is left
    errors = [f"{rule}: {path}" for rule, severity, path in findings if severity == "error"]
    assert errors == [], "\n".join(sorted(errors))


def test_an_unknown_mapping_name_fails_the_synth() -> None:
    from shoal.declarations import DEPLOYMENT

    from infra.stack import MissingContextError

    # Given a mapping that cannot read through a consumer
    with pytest.raises(MissingContextError, match=r"enhancedFanOut: .*archiver"):
        synth(DEPLOYMENT, context(enhancedFanOut="router,archiver"))
