"""The layer's local pip step, with pip replaced by a recorder: no network, no Docker."""

from __future__ import annotations

import ast
from collections.abc import Sequence
from pathlib import Path

import pytest

from infra.bundling import NOT_IN_LAYER, PipLayerBundling, Runner

pytestmark = pytest.mark.infra

ROOT = Path(__file__).resolve().parents[2]
LAYER_DIR = ROOT / "layers" / "shoal"
SOURCE = LAYER_DIR / "python"


def _fake_pip(commands: list[list[str]]) -> Runner:
    def run(command: Sequence[str]) -> None:
        commands.append(list(command))
        target = Path(command[command.index("-t") + 1])
        for package in ("pynamodb", "botocore", "botocore-1.0.dist-info", "s3transfer"):
            (target / package).mkdir(parents=True)
            (target / package / "__init__.py").write_text("")

    return run


def test_layer_holds_lambda_wheels_and_the_shoal_package(tmp_path: Path) -> None:
    # Given a bundler whose pip only records what it was asked and drops packages in place
    commands: list[list[str]] = []
    bundler = PipLayerBundling(LAYER_DIR, python="python3", run=_fake_pip(commands))
    # When CDK asks it to bundle
    assert bundler.try_bundle(str(tmp_path)) is True
    # Then pip installed the layer's requirements as arm64 CPython 3.12 wheels under python/
    [command] = commands
    assert command[command.index("-r") + 1] == str(LAYER_DIR / "requirements.txt")
    assert command[command.index("-t") + 1] == str(tmp_path / "python")
    assert command[command.index("--platform") + 1] == "manylinux2014_aarch64"
    assert command[command.index("--python-version") + 1] == "3.12"
    assert "--only-binary=:all:" in command
    # And the shoal package sits beside its dependencies, without bytecode
    assert (tmp_path / "python" / "shoal" / "declarations.py").is_file()
    assert not list((tmp_path / "python" / "shoal").rglob("__pycache__"))
    assert (tmp_path / "python" / "pynamodb").is_dir()
    # And the runtime's own botocore is not shadowed by a second copy
    assert not (tmp_path / "python" / "botocore").exists()
    assert not (tmp_path / "python" / "botocore-1.0.dist-info").exists()
    assert not (tmp_path / "python" / "s3transfer").exists()


def _staged_layer(tmp_path: Path) -> Path:
    """The layer's ``python/`` folder as the bundler leaves it (pip recorded, not run)."""
    bundler = PipLayerBundling(LAYER_DIR, python="python3", run=_fake_pip([]))
    assert bundler.try_bundle(str(tmp_path)) is True
    return tmp_path / "python"


def _module_file(root: Path, module: str) -> Path | None:
    base = root.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _shoal_imports(source: Path) -> set[str]:
    """Every ``shoal`` module a file imports, anywhere in it (in functions too), with the
    packages above each; ``from shoal.x import y`` counts ``shoal.x.y`` when y is a module."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
            names += [
                f"{node.module}.{alias.name}"
                for alias in node.names
                if _module_file(SOURCE, f"{node.module}.{alias.name}") is not None
            ]
        for name in names:
            parts = name.split(".")
            if parts[0] == "shoal":
                found.update(".".join(parts[:n]) for n in range(1, len(parts) + 1))
    return found


def test_layer_leaves_out_the_local_runtime_the_cli_and_the_client(tmp_path: Path) -> None:
    # When the layer is staged
    shoal = _staged_layer(tmp_path) / "shoal"
    # Then shoal dev's runtime, the shoal command and the API client are not in it
    assert set(NOT_IN_LAYER) == {"local", "cli", "client"}
    for left_out in ("local", "cli", "client"):
        assert (SOURCE / "shoal" / left_out / "__init__.py").is_file()
        assert not (shoal / left_out).exists()
    # And everything else of the package is, file for file
    source_files = {
        p.relative_to(SOURCE / "shoal")
        for p in (SOURCE / "shoal").rglob("*.py")
        if p.relative_to(SOURCE / "shoal").parts[0] not in NOT_IN_LAYER
    }
    assert {p.relative_to(shoal) for p in shoal.rglob("*.py")} == source_files


def test_layer_holds_every_shoal_module_the_functions_import(tmp_path: Path) -> None:
    # Given the staged layer and every function's handler
    staged = _staged_layer(tmp_path)
    handlers = sorted((ROOT / "functions").glob("*/app.py"))
    assert len(handlers) >= 10
    # When the shoal imports of each handler are followed through the staged modules
    missing: dict[str, set[str]] = {}
    for handler in handlers:
        seen: set[str] = set()
        todo = _shoal_imports(handler)
        while todo:
            module = todo.pop()
            if module in seen:
                continue
            seen.add(module)
            found = _module_file(staged, module)
            if found is None:
                missing.setdefault(handler.parent.name, set()).add(module)
            else:
                todo |= _shoal_imports(found) - seen
    # Then each one is there: no function needs what the layer leaves out
    assert missing == {}
