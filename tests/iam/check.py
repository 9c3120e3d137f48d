"""Calls against roles: what a function did that its role does not allow, and what its role
allows that it was never seen to do."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tests.iam.allowlist import UNUSED_GRANTS, Unused
from tests.iam.policy import Request, Statement, evaluate, wildcard
from tests.iam.requests import Call
from tests.iam.roles import Roles


@dataclass(frozen=True, order=True)
class Denied:
    function: str
    action: str
    resource: str
    operation: str
    #: "explicit deny" or "no statement allows it"
    why: str
    #: the test running when the call was first seen (one of them, if several)
    seen_in: str = field(default="", compare=False)

    def __str__(self) -> str:
        said = f"{self.function}: {self.action} on {self.resource} ({self.operation}): {self.why}"
        return f"{said} (first seen in {self.seen_in})" if self.seen_in else said


def load_calls(folder: Path) -> list[Call]:
    """Every distinct call the processes recording into ``folder`` saw."""
    lines: set[str] = set()
    for path in sorted(folder.glob("calls-*.jsonl")):
        # a line cut short by a killed process is no call
        lines.update(line for line in path.read_text().splitlines() if line.endswith("}"))
    return [Call.from_json(json.loads(line)) for line in sorted(lines)]


def denied(calls: Iterable[Call], roles: Roles) -> list[Denied]:
    """Each call some request of which the function's role does not allow."""
    found: set[Denied] = set()
    for call in calls:
        statements = roles.statements.get(call.function)
        for request in call.requests():
            if statements is None:
                found.add(_denied(call, request, "the template declares no such function"))
                continue
            decision = evaluate(statements, request)
            if not decision.allowed:
                why = "explicit deny" if decision.by is not None else "no statement allows it"
                found.add(_denied(call, request, why))
    return sorted(found)


def _denied(call: Call, request: Request, why: str) -> Denied:
    return Denied(
        call.function, request.action, request.resource, call.operation, why, call.seen_in
    )


def granted(statements: Iterable[Statement]) -> set[str]:
    """The action patterns the Allow statements name (``s3:GetObject*`` as written)."""
    return {a for s in statements if s.effect == "Allow" for a in s.actions}


def unused_grants(calls: Iterable[Call], roles: Roles) -> dict[str, set[str]]:
    """Per function, the granted action patterns that none of its recorded calls needed."""
    seen: dict[str, set[str]] = {}
    for call in calls:
        seen.setdefault(call.function, set()).update(r.action for r in call.requests())
    unused: dict[str, set[str]] = {}
    for function, statements in roles.statements.items():
        actions = seen.get(function, set())
        idle = {
            pattern
            for pattern in granted(statements)
            if not any(wildcard(pattern, a, case=False) for a in actions)
        }
        if idle:
            unused[function] = idle
    return unused


def listed(function: str, action: str, allowlist: Mapping[tuple[str, str], Unused]) -> bool:
    return (function, action) in allowlist or ("*", action) in allowlist


def unlisted_unused(
    unused: Mapping[str, set[str]], allowlist: Mapping[tuple[str, str], Unused] = UNUSED_GRANTS
) -> list[tuple[str, str]]:
    """Unused grants that the allowlist does not give a reason for."""
    return sorted(
        (f, a) for f, actions in unused.items() for a in actions if not listed(f, a, allowlist)
    )


def stale_entries(
    unused: Mapping[str, set[str]],
    roles: Roles,
    allowlist: Mapping[tuple[str, str], Unused] = UNUSED_GRANTS,
) -> list[tuple[str, str]]:
    """Allowlist entries for a grant that was used after all, or that no role has."""
    stale = []
    for function, action in allowlist:
        functions = list(roles.statements) if function == "*" else [function]
        having = [f for f in functions if action in granted(roles.statements.get(f, ()))]
        used = not any(action in unused.get(f, set()) for f in having)
        if not having or (used and not allowlist[(function, action)].sometimes):
            stale.append((function, action))
    return sorted(stale)


def report(calls: list[Call], roles: Roles) -> str:
    """The unused-grant report: per function, what it was seen to use and what it was not."""
    unused = unused_grants(calls, roles)
    lines = [f"IAM: {len(calls)} distinct calls recorded"]
    for function in sorted(roles.statements):
        idle = sorted(unused.get(function, ()))
        used = len(granted(roles.statements[function])) - len(idle)
        lines.append(f"  {function}: {used} granted actions used, {len(idle)} not seen")
        for action in idle:
            entry = UNUSED_GRANTS.get((function, action)) or UNUSED_GRANTS.get(("*", action))
            lines.append(f"    {action}: {entry.reason if entry else 'NOT ON THE ALLOWLIST'}")
        for ref in roles.unresolved.get(function, ()):
            lines.append(f"    (resolved as *: {ref})")
    return "\n".join(lines)
