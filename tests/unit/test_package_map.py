"""The package map of docs/design.md, held by the code: each part of ``shoal`` imports only the
parts below it, at module top (TYPE_CHECKING blocks count too), so there is no import circle."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "layers" / "shoal" / "python" / "shoal"

#: part -> the parts it may import (besides itself); docs/design.md opens with this map
MAY_IMPORT: dict[str, set[str]] = {
    "core": set(),
    "records": set(),
    "topics": {"core"},
    "aws": {"core"},
    "http": {"core"},
    "declarations": {"core", "aws"},
    "composite": {"core", "topics", "aws", "declarations"},
    "drain": {"core", "aws", "records", "declarations", "composite"},
    "publish": {"core", "topics", "aws", "records", "composite"},
    "sessions": {"core", "topics", "aws"},
    "delivery": {"core", "topics", "aws", "records", "composite", "drain", "sessions"},
    "groups": {"core", "topics", "aws", "composite", "drain", "sessions", "delivery"},
    #: the WebSocket edge: connections, pushing deliveries to them, the route functions' service
    "edge": {"core", "aws", "declarations", "publish", "sessions", "delivery"},
    "router": {
        "core",
        "topics",
        "aws",
        "records",
        "composite",
        "drain",
        "delivery",
        "groups",
        "edge",
    },
    "push": {"core", "topics", "aws", "records", "composite", "drain", "delivery"},
    "teardown": {"core", "aws", "composite", "push"},
    #: the reaper's count of connections, sessions, groups and dead letters (gauges)
    "census": {"core", "aws", "sessions", "groups", "edge", "push"},
    #: the console's Overview: the stack's metrics from CloudWatch, and the current figures
    "overview": {"core", "aws", "declarations", "composite", "push"},
    "wiring": {
        "core",
        "topics",
        "aws",
        "records",
        "declarations",
        "composite",
        "drain",
        "publish",
        "sessions",
        "delivery",
        "groups",
        "router",
        "push",
        "teardown",
        "edge",
        "census",
        "overview",
    },
    #: the console's static page (HTML, CSS, JavaScript) and how to send it
    "console": set(),
    #: shoal dev runs the whole deployment: its start hooks do what the bootstrap function does;
    #: it serves the console beside the HTTP API
    "local": {"core", "aws", "declarations", "composite", "wiring", "console"},
    "client": {"core"},
    "cli": {"core", "client", "local"},
}


def part_of(path: Path) -> str:
    relative = path.relative_to(ROOT)
    return relative.parts[0].removesuffix(".py")


def imported_parts(path: Path) -> list[tuple[int, str, bool]]:
    """(line, part of shoal imported, at module top) of every import of a shoal module."""
    tree = ast.parse(path.read_text(), str(path))
    top = {id(node) for node in tree.body}
    for statement in tree.body:
        if isinstance(statement, ast.If):  # ``if TYPE_CHECKING:`` blocks sit at the top too
            top |= {id(child) for child in statement.body}
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "shoal":  # a part, or the package's own __version__
                names = [a.name for a in node.names if a.name != "__version__"]
            elif node.module.startswith("shoal."):
                names = [node.module.split(".")[1]]
        elif isinstance(node, ast.Import):
            names = [a.name.split(".")[1] for a in node.names if a.name.startswith("shoal.")]
        for name in names:
            out.append((node.lineno, name, id(node) in top))
    return out


MODULES = sorted(p for p in ROOT.rglob("*.py") if p.parent != ROOT or p.name != "__init__.py")


def test_every_part_of_the_library_is_on_the_map() -> None:
    parts = {part_of(p) for p in MODULES}
    assert parts <= set(MAY_IMPORT), parts - set(MAY_IMPORT)
    # a folder without __init__.py imports as a namespace package here, but the layer's
    # bundling and the pipeline's staging copy packages, not namespaces
    folders = {p.parent for p in MODULES if "__pycache__" not in p.parts}
    assert [f for f in folders if not (f / "__init__.py").is_file()] == []


def test_a_module_imports_only_the_parts_below_its_own() -> None:
    wrong = []
    for path in MODULES:
        allowed = MAY_IMPORT.get(part_of(path), set()) | {part_of(path)}
        wrong += [
            f"{path.relative_to(ROOT)}:{line} imports shoal.{name}"
            for line, name, _ in imported_parts(path)
            if name not in allowed
        ]
    assert wrong == []


def test_shoal_imports_sit_at_module_top_unless_a_comment_says_why() -> None:
    inner = []
    for path in MODULES:
        lines = path.read_text().splitlines()
        inner += [
            f"{path.relative_to(ROOT)}:{line}"
            for line, _, at_top in imported_parts(path)
            if not at_top and not any("# " in text for text in lines[max(line - 4, 0) : line])
        ]
    assert inner == []


def test_the_map_has_no_circle() -> None:
    seen: dict[str, int] = {}

    def depth(part: str, path: tuple[str, ...] = ()) -> int:
        assert part not in path, (*path, part)
        if part not in seen:
            below = MAY_IMPORT[part]
            seen[part] = 1 + max((depth(p, (*path, part)) for p in below), default=0)
        return seen[part]

    for part in MAY_IMPORT:
        depth(part)
