"""Each declared function's role, from the synthesized template, in the local runtime's names.

The stack is synthesized from ``shoal.declarations`` as the infra tests synthesize it; for each
function, the statements of every policy attached to its role (the ``AWS::IAM::Policy``
resources naming it, and the role's inline policies) are read from the template, and their
``Ref``, ``Fn::GetAtt``, ``Fn::Join``, ``Fn::Sub`` and ``Fn::Select``/``Fn::Split`` resolved to
the names ``shoal.local.provision.LocalNames`` gives the same resources under ``shoal dev``
and in the integration tests. A reference to something that has no local counterpart (a
resource the emulator does not make, such as an API's id) resolves to ``*``, and is listed in
``Roles.unresolved``: the check is then as loose there as a wildcard.

A synth costs seconds, so the result is kept in ``cdk.out/`` under a hash of everything that
shapes the roles (``infra/``, the declarations and the library modules they read, cdk.json):
one synth per change, not per run.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal.declarations import DEPLOYMENT, Deployment
from shoal.local.provision import ACCOUNT_ID, LocalNames

from tests.iam.policy import Statement

ROOT = Path(__file__).resolve().parents[2]
REGION = "us-east-1"
PARTITION = "aws"
CACHE_DIR = ROOT / "cdk.out"
#: what shapes the synthesized roles: a change to any of these synthesizes again
SHAPING = (
    "infra",
    "cdk.json",
    "layers/shoal/python/shoal/declarations.py",
    "layers/shoal/python/shoal/aws",
    "layers/shoal/python/shoal/teardown.py",
    "layers/shoal/python/shoal/core/config.py",
    "tests/iam/roles.py",
    "tests/infra/stacks.py",
)
#: the stack's own id and name are whatever the local test names: any stack of this account
STACK_NAME = "*"
STACK_ID = f"arn:{PARTITION}:cloudformation:{REGION}:{ACCOUNT_ID}:stack/*/*"
PSEUDO = {
    "AWS::Region": REGION,
    "AWS::AccountId": ACCOUNT_ID,
    "AWS::Partition": PARTITION,
    "AWS::URLSuffix": "amazonaws.com",
    "AWS::StackName": STACK_NAME,
    "AWS::StackId": STACK_ID,
    "AWS::NoValue": "",
}


@dataclass(frozen=True)
class Roles:
    #: declared function -> the statements of its role, resolved
    statements: Mapping[str, tuple[Statement, ...]]
    #: references that resolved to ``*`` (no local counterpart), per function
    unresolved: Mapping[str, tuple[str, ...]]

    def to_json(self) -> dict[str, Any]:
        return {
            "statements": {f: [s.to_json() for s in ss] for f, ss in self.statements.items()},
            "unresolved": {f: list(u) for f, u in self.unresolved.items()},
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Roles:
        return cls(
            statements={
                f: tuple(Statement.from_json(s) for s in ss) for f, ss in raw["statements"].items()
            },
            unresolved={f: tuple(u) for f, u in raw["unresolved"].items()},
        )


def shaping_hash(root: Path = ROOT) -> str:
    digest = hashlib.sha256()
    for entry in SHAPING:
        path = root / entry
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        for file in files:
            digest.update(str(file.relative_to(root)).encode())
            digest.update(file.read_bytes())
    from importlib.metadata import version

    digest.update(version("aws-cdk-lib").encode())
    return digest.hexdigest()[:16]


def deployed_roles(cache_dir: Path = CACHE_DIR) -> Roles:
    """The roles of ``shoal.declarations``' stack: from the cache, or synthesized once."""
    cached = cache_dir / f"iam-roles-{shaping_hash()}.json"
    if cached.exists():
        return Roles.from_json(json.loads(cached.read_text()))
    roles = synthesized_roles(DEPLOYMENT)
    cache_dir.mkdir(parents=True, exist_ok=True)
    partial = cached.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(roles.to_json(), indent=1, sort_keys=True))
    partial.replace(cached)
    return roles


#: the stack's options that add grants, all on: the suites run the code of each option (the
#: enhanced fan-out's consumers, issue 48), and its calls must be allowed. The roles of a stack
#: without an option are these less that option's grants (tests/infra checks both)
OPTIONS = {"enhancedFanOut": "router"}


def synthesized_roles(deployment: Deployment) -> Roles:
    """Synthesize ``deployment`` (the infra tests' context, every option on: ``OPTIONS``) and
    resolve each function's role."""
    from tests.infra.stacks import context, synth

    built = synth(deployment, context(**OPTIONS))
    stack = built.stack
    names = LocalNames.for_deployment(deployment)

    def logical_id(element: Any) -> str:
        return str(stack.resolve(element.logical_id))

    refs: dict[str, str] = {}
    arns: dict[str, str] = {}
    for logical, table in stack.tables.items():
        lid = logical_id(table)
        refs[lid] = names.tables[logical]
        arns[lid] = f"arn:{PARTITION}:dynamodb:{REGION}:{ACCOUNT_ID}:table/{refs[lid]}"
    for logical, stream in stack.streams.items():
        lid = logical_id(stream)
        refs[lid] = names.streams[logical]
        arns[lid] = f"arn:{PARTITION}:kinesis:{REGION}:{ACCOUNT_ID}:stream/{refs[lid]}"
    for logical, bucket in stack.buckets.items():
        lid = logical_id(bucket.node.default_child)
        refs[lid] = names.buckets[logical]
        arns[lid] = f"arn:{PARTITION}:s3:::{refs[lid]}"
    for logical, queue in [*stack.queues.items(), *stack.dead_letter_queues.items()]:
        name = logical if queue is stack.queues.get(logical) else f"{logical}-dead"
        lid = logical_id(queue.node.default_child)
        refs[lid] = names.queue_url(name)
        arns[lid] = f"arn:{PARTITION}:sqs:{REGION}:{ACCOUNT_ID}:{names.queues[name]}"
    for name, function in stack.functions.items():
        lid = logical_id(function.node.default_child)
        refs[lid] = names.functions[name]
        arns[lid] = f"arn:{PARTITION}:lambda:{REGION}:{ACCOUNT_ID}:function:{refs[lid]}"

    # the stack names its functions itself ("<stack name>-<name>", literal in the template);
    # locally they are LocalNames' (longest first: "-push" is a prefix of "-pushadmin")
    literals = sorted(
        ((stack.function_names[n], names.functions[n]) for n in stack.function_names),
        key=lambda pair: -len(pair[0]),
    )
    resources = built.resources
    statements: dict[str, tuple[Statement, ...]] = {}
    unresolved: dict[str, tuple[str, ...]] = {}
    for name, function in stack.functions.items():
        assert function.role is not None, f"{name} has a role of its own"
        role = logical_id(function.role.node.default_child)
        resolver = Resolver(refs, arns, resources)
        raw = list(_role_statements(resources, role))
        statements[name] = tuple(
            Statement.from_json(_localized(resolver.resolve(s), literals)) for s in raw
        )
        unresolved[name] = tuple(sorted(resolver.unresolved))
    return Roles(statements, unresolved)


def _localized(value: Any, literals: list[tuple[str, str]]) -> Any:
    if isinstance(value, str):
        for deployed, local in literals:
            value = value.replace(deployed, local)
        return value
    if isinstance(value, list):
        return [_localized(v, literals) for v in value]
    if isinstance(value, dict):
        return {k: _localized(v, literals) for k, v in value.items()}
    return value


def _role_statements(resources: Mapping[str, Any], role: str) -> Iterable[Mapping[str, Any]]:
    for resource in resources.values():
        props = resource.get("Properties", {})
        policy = resource["Type"] in ("AWS::IAM::Policy", "AWS::IAM::ManagedPolicy")
        if policy and {"Ref": role} in props.get("Roles", []):
            yield from props["PolicyDocument"]["Statement"]
    for policy in resources[role].get("Properties", {}).get("Policies", []):
        yield from policy["PolicyDocument"]["Statement"]


class Resolver:
    """CloudFormation's intrinsic functions over the local names; unknown references as ``*``."""

    def __init__(
        self, refs: Mapping[str, str], arns: Mapping[str, str], resources: Mapping[str, Any]
    ) -> None:
        self.refs = refs
        self.arns = arns
        self.resources = resources
        self.unresolved: set[str] = set()

    def resolve(self, value: Any) -> Any:
        if isinstance(value, list):
            return [self.resolve(v) for v in value]
        if not isinstance(value, dict):
            return value
        if len(value) == 1:
            ((key, arg),) = value.items()
            if key == "Ref":
                return self._ref(str(arg))
            if key == "Fn::GetAtt":
                target, attribute = arg if isinstance(arg, list) else str(arg).split(".", 1)
                return self._get_att(str(target), str(attribute))
            if key == "Fn::Join":
                separator, parts = arg
                return str(separator).join(str(self.resolve(p)) for p in self.resolve(parts))
            if key == "Fn::Sub":
                return self._sub(arg)
            if key == "Fn::Select":
                index, items = arg
                return self.resolve(items)[int(self.resolve(index))]
            if key == "Fn::Split":
                separator, text = arg
                return str(self.resolve(text)).split(str(separator))
        return {k: self.resolve(v) for k, v in value.items()}

    def _ref(self, name: str) -> str:
        if name in PSEUDO:
            return PSEUDO[name]
        if name in self.refs:
            return self.refs[name]
        self.unresolved.add(f"Ref {name}")
        return "*"

    def _get_att(self, target: str, attribute: str) -> str:
        if attribute == "Arn" and target in self.arns:
            return self.arns[target]
        if attribute == "StreamArn" and target in self.arns:  # pragma: no cover - no table streams
            return f"{self.arns[target]}/stream/*"
        self.unresolved.add(f"GetAtt {target}.{attribute}")
        return "*"

    def _sub(self, arg: Any) -> str:
        text = arg if isinstance(arg, str) else arg[0]
        variables: Mapping[str, Any] = {} if isinstance(arg, str) else arg[1]
        out: list[str] = []
        rest = str(text)
        while "${" in rest:
            before, _, after = rest.partition("${")
            name, _, rest = after.partition("}")
            out.append(before)
            if name.startswith("!"):
                out.append("${" + name[1:] + "}")
            elif name in variables:
                out.append(str(self.resolve(variables[name])))
            elif "." in name:
                target, attribute = name.split(".", 1)
                out.append(self._get_att(target, attribute))
            else:
                out.append(self._ref(name))
        out.append(rest)
        return "".join(out)
