"""The CDK app (see cdk.json): `npx aws-cdk@2 deploy -c jwtIssuer=... -c jwtAudience=...`."""

from __future__ import annotations

import aws_cdk as cdk

from infra.stack import ShoalStack


def main() -> None:
    app = cdk.App()
    stack_name = app.node.try_get_context("stackName") or "shoal"
    ShoalStack(
        app,
        stack_name,
        stack_name=stack_name,
        description="Shoal: durable pub/sub with MQTT topic semantics (infra/stack.py)",
    )
    app.synth()


if __name__ == "__main__":
    main()
