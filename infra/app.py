"""The CDK app (see cdk.json): `npx aws-cdk@2 deploy -c jwtIssuer=... -c jwtAudience=...`."""

from __future__ import annotations

import sys

import aws_cdk as cdk

from infra.stack import MissingContextError, ShoalStack


def main() -> int:
    app = cdk.App()
    stack_name = app.node.try_get_context("stackName") or "shoal"
    try:
        ShoalStack(
            app,
            stack_name,
            stack_name=stack_name,
            description="Shoal: durable pub/sub with MQTT topic semantics (infra/stack.py)",
        )
    except MissingContextError as exc:
        # what to pass, in one line: the traceback says nothing a user needs (cdk then adds
        # its own "Subprocess exited with error 1")
        print(f"shoal: cannot synthesize the stack: {exc}", file=sys.stderr)
        return 1
    app.synth()
    return 0


if __name__ == "__main__":
    sys.exit(main())
