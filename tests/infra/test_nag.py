"""cdk-nag's AwsSolutions and Serverless rule packs on the stack: no error left unacknowledged.

cdk-nag 3 runs as a CDK validation plugin after synthesis and writes its findings to the cloud
assembly's ``policy-validation-report.json``; a finding the stack keeps is acknowledged beside
the construct that causes it (``cdk.Validations.of(construct).acknowledge(id=..., reason=...)``),
which names the rule and says why, and is then left out of the report.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from shoal.declarations import DEPLOYMENT

from tests.infra.stacks import context

pytestmark = pytest.mark.infra

REPORT = "policy-validation-report.json"


def _violations(report: Any) -> Iterator[dict[str, Any]]:
    """Every violation in the report, whatever plugin reported it."""
    if isinstance(report, dict):
        if "ruleName" in report:
            yield report
            return
        for value in report.values():
            yield from _violations(value)
    elif isinstance(report, list):
        for value in report:
            yield from _violations(value)


def _where(resource: dict[str, Any]) -> Any:
    return resource.get("locations") or resource.get("resourceLogicalId")


def nag_findings(outdir: Path) -> list[dict[str, Any]]:
    import aws_cdk as cdk
    from cdk_nag import AwsSolutionsChecks, ServerlessChecks

    from infra.stack import ShoalStack

    app = cdk.App(
        context={**context(), "@aws-cdk/core:validationReportPrettyPrint": False},
        outdir=str(outdir),
    )
    ShoalStack(app, "shoal-test", stack_name="shoal-test", deployment=DEPLOYMENT)
    cdk.Validations.of(app).add_plugins(AwsSolutionsChecks(app), ServerlessChecks(app))
    # a violation interrupts synthesis with an error; the report says which
    with contextlib.suppress(Exception):
        app.synth()
    path = outdir / REPORT
    assert path.exists(), "cdk-nag ran and wrote its report"
    return list(_violations(json.loads(path.read_text())))


@pytest.mark.xfail(
    strict=False,
    reason=(
        "issue 32: the packs' findings on this stack are not yet acknowledged (or fixed): "
        "the helper's machine could not finish one synth to list them; see the assertion's "
        "message for the list, then acknowledge each beside its construct and drop this"
    ),
)
def test_no_rule_of_the_packs_is_broken_unacknowledged(tmp_path: Path) -> None:
    # Given the stack of the real declarations, checked by AwsSolutions and Serverless
    findings = nag_findings(tmp_path)
    # Then no error-level finding is left: each the stack keeps is acknowledged with a reason
    errors = [
        f"{f['ruleName']}: {[_where(r) for r in f.get('violatingResources', [])]}"
        for f in findings
        if str(f.get("severity", "error")).lower() == "error"
    ]
    assert errors == [], "\n".join(errors)
