"""IAM's evaluation of identity statements, as far as one role's own policies decide it.

A request (action, resource, the condition keys the call gives) is allowed when some Allow
statement matches it and no Deny statement does: an explicit Deny wins over every Allow, and
nothing matching is an implicit deny. Actions match case-insensitively, resources
case-sensitively, both with IAM's wildcards (``*`` any run of characters, ``?`` one), and
``NotAction``/``NotResource`` match what they do not name.

Conditions: an operator on a key the request gives (``lambda:FunctionArn`` of a mapping's
create) is evaluated for the ``String*`` and ``Arn*`` operators; a condition on a key the
request does not give, or with another operator, is taken as met and counted (``unchecked``):
the check is then as loose as the statement without it. docs/operations.md says what that
leaves to a deploy.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any


@dataclass(frozen=True)
class Statement:
    effect: str  # "Allow" | "Deny"
    actions: tuple[str, ...] = ()
    not_actions: tuple[str, ...] = ()
    resources: tuple[str, ...] = ()
    not_resources: tuple[str, ...] = ()
    #: {operator: {key: (values...)}}
    conditions: Mapping[str, Mapping[str, tuple[str, ...]]] = field(default_factory=dict)

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Statement:
        return cls(
            effect=str(raw["Effect"]),
            actions=_strings(raw.get("Action")),
            not_actions=_strings(raw.get("NotAction")),
            resources=_strings(raw.get("Resource")),
            not_resources=_strings(raw.get("NotResource")),
            conditions={
                op: {k: _strings(v) for k, v in keys.items()}
                for op, keys in (raw.get("Condition") or {}).items()
            },
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"Effect": self.effect}
        for key, value in (
            ("Action", self.actions),
            ("NotAction", self.not_actions),
            ("Resource", self.resources),
            ("NotResource", self.not_resources),
        ):
            if value:
                out[key] = list(value)
        if self.conditions:
            out["Condition"] = {
                op: {k: list(v) for k, v in c.items()} for op, c in self.conditions.items()
            }
        return out

    def matches_action(self, action: str) -> bool:
        if self.actions:
            return any(wildcard(p, action, case=False) for p in self.actions)
        return not any(wildcard(p, action, case=False) for p in self.not_actions)

    def matches_resource(self, resource: str) -> bool:
        if self.resources:
            return any(wildcard(p, resource) for p in self.resources)
        return not any(wildcard(p, resource) for p in self.not_resources)

    def granted_actions(self) -> tuple[str, ...]:
        return self.actions


@dataclass(frozen=True)
class Request:
    action: str  # "dynamodb:PutItem"
    resource: str  # an ARN, or "*" for actions that name no resource
    #: condition keys the call gives (``lambda:FunctionArn``)
    keys: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Decision:
    allowed: bool
    #: the statement that decided it (an Allow, or the Deny that won), if any
    by: Statement | None = None
    #: condition keys taken as met because the request gives no value for them
    unchecked: tuple[str, ...] = ()


def evaluate(statements: Sequence[Statement], request: Request) -> Decision:
    """IAM's answer for ``request`` from these statements alone: Deny first, then Allow."""
    matching = [
        s
        for s in statements
        if s.matches_action(request.action) and s.matches_resource(request.resource)
    ]
    unchecked: list[str] = []
    for statement in (s for s in matching if s.effect == "Deny"):
        met, loose = _conditions_met(statement, request)
        unchecked += loose
        if met:
            return Decision(False, statement, tuple(unchecked))
    for statement in (s for s in matching if s.effect == "Allow"):
        met, loose = _conditions_met(statement, request)
        if met:
            return Decision(True, statement, tuple(unchecked + loose))
    return Decision(False, None, tuple(unchecked))


def wildcard(pattern: str, value: str, *, case: bool = True) -> bool:
    """IAM's matching: ``*`` any run of characters (``/`` and ``:`` included), ``?`` one."""
    return _compiled(pattern, case).fullmatch(value) is not None


@cache
def _compiled(pattern: str, case: bool) -> re.Pattern[str]:
    body = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
    return re.compile(body, 0 if case else re.IGNORECASE)


_STRING_OPERATORS: dict[str, Callable[[str, str], bool]] = {
    "StringEquals": lambda p, v: p == v,
    "StringLike": wildcard,
    "StringEqualsIgnoreCase": lambda p, v: p.lower() == v.lower(),
    "ArnEquals": wildcard,
    "ArnLike": wildcard,
}


def _conditions_met(statement: Statement, request: Request) -> tuple[bool, list[str]]:
    loose: list[str] = []
    for operator, keys in statement.conditions.items():
        for key, values in keys.items():
            test = _STRING_OPERATORS.get(operator)
            given = request.keys.get(key)
            if test is None or given is None:
                loose.append(f"{operator}:{key}")
                continue
            if not any(test(v, given) for v in values):
                return False, loose
    return True, loose


def _strings(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return tuple(str(v) for v in value)


def statements_of(raw: Iterable[Mapping[str, Any]]) -> list[Statement]:
    return [Statement.from_json(s) for s in raw]
