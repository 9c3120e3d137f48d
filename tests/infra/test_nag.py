"""cdk-nag's AwsSolutions and Serverless rule packs on the stack: no error left unacknowledged.

cdk-nag 3 is a CDK policy validation plugin: added with ``cdk.Validations.of(app).add_plugins``
it runs after synthesis, fails it, and writes ``validation-report.json`` to the cloud assembly.
The tests run the packs on the session's synthesized stack instead (``NagPack.validate_scope``,
the same walk over the construct tree, which the plugin runs too): no second synthesis. A
finding the stack keeps is acknowledged beside its construct (``infra/nag.py``), which names
the rule (or the one finding of it) and says why, and is then not reported.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.infra.stacks import Synth

pytestmark = pytest.mark.infra


def nag_findings(synth: Synth) -> list[tuple[str, str, str]]:
    """(rule or finding, severity, construct path) of each finding of the two packs."""
    from cdk_nag import AwsSolutionsChecks, ServerlessChecks

    found = []
    for pack in (AwsSolutionsChecks(), ServerlessChecks()):
        result: Any = pack.validate_scope(synth.stack)
        for violation in result.violations:
            for resource in violation.violating_resources:
                found.append((violation.rule_name, violation.severity, resource.construct_path))
    return found


def test_no_rule_of_the_packs_is_broken_unacknowledged(deployed: Synth) -> None:
    # Given the stack of the real declarations, checked by AwsSolutions and Serverless
    findings = nag_findings(deployed)
    # Then no error-level finding is left: each the stack keeps is acknowledged with a reason
    errors = [f"{rule}: {path}" for rule, severity, path in findings if severity == "error"]
    assert errors == [], "\n".join(sorted(errors))


def test_a_wildcard_is_reported_until_acknowledged_with_its_reason() -> None:
    # Given two roles granted the same wildcard, one of them acknowledged by infra/nag.py
    import aws_cdk as cdk
    from aws_cdk import aws_iam as iam
    from cdk_nag import AwsSolutionsChecks

    from infra.nag import acknowledge_wildcards, wildcard_findings

    stack = cdk.Stack(cdk.App(), "nag-proof")
    statement = iam.PolicyStatement(actions=["kinesis:Get*"], resources=["*"])
    roles = {}
    for name in ("Kept", "Forgotten"):
        roles[name] = iam.Role(stack, name, assumed_by=iam.ServicePrincipal("lambda.amazonaws.com"))
        roles[name].add_to_policy(statement)
    acknowledge_wildcards(roles["Kept"], [statement], "a test's reason")
    # When the pack checks the stack
    result: Any = AwsSolutionsChecks().validate_scope(stack)
    found = {
        (v.rule_name, r.construct_path) for v in result.violations for r in v.violating_resources
    }
    # Then each wildcard of the forgotten role is named, by the ids infra/nag.py computes, and
    # none of the kept one's
    ids = wildcard_findings(stack, [statement])
    assert ids == ["AwsSolutions-IAM5[Action::kinesis:Get*]", "AwsSolutions-IAM5[Resource::*]"]
    assert {(i, "nag-proof/Forgotten/DefaultPolicy/Resource") for i in ids} <= found
    assert not [f for f in found if f[1].startswith("nag-proof/Kept/")]
