"""The WebSocket API's reading of a REQUEST authorizer's answer, as API Gateway reads it."""

from __future__ import annotations

import fnmatch
import logging
from typing import Any

log = logging.getLogger("shoal-dev.websocket")


class PolicyRefused(Exception):
    """The handshake is refused with this status: 403 (denied) or 500 (no policy)."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


def authorizer_policy(result: Any, method_arn: str) -> tuple[str, dict[str, Any]]:
    """The authorizer's IAM policy for ``method_arn``: Allow gives (principalId, context); Deny
    is 403, and an answer that is no policy is 500."""
    try:
        principal = result["principalId"]
        statements = result["policyDocument"]["Statement"]
        context = result.get("context") or {}
        if not isinstance(statements, list) or not isinstance(context, dict):
            raise TypeError("malformed policy")
    except (KeyError, TypeError) as exc:
        log.error("authorizer answered no policy: %s", type(exc).__name__)
        raise PolicyRefused(500) from None
    if any(not isinstance(v, str | int | float | bool) for v in context.values()):
        # API Gateway accepts only strings, numbers and booleans in the context
        log.error("authorizer context holds a value that is not a string, number or boolean")
        raise PolicyRefused(500)
    allowed = denied = False
    for statement in statements:
        if not isinstance(statement, dict) or not _covers(statement, method_arn):
            continue
        if statement.get("Effect") == "Deny":
            denied = True
        elif statement.get("Effect") == "Allow":
            allowed = True
    if denied or not allowed:
        raise PolicyRefused(403)
    return str(principal), dict(context)


def _covers(statement: dict[str, Any], method_arn: str) -> bool:
    actions = statement.get("Action", [])
    resources = statement.get("Resource", [])
    actions = [actions] if isinstance(actions, str) else actions
    resources = [resources] if isinstance(resources, str) else resources
    return any(
        fnmatch.fnmatchcase("execute-api:Invoke", a) for a in actions if isinstance(a, str)
    ) and any(fnmatch.fnmatchcase(method_arn, r) for r in resources if isinstance(r, str))
