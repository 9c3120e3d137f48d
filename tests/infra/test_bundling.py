"""The layer's local pip step, with pip replaced by a recorder: no network, no Docker."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from infra.bundling import PipLayerBundling, Runner

pytestmark = pytest.mark.infra

LAYER_DIR = Path(__file__).resolve().parents[2] / "layers" / "shoal"


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
