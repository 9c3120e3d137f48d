"""The ``shoal`` command's entry points, and ``shoal dev`` without its emulator installed."""

from __future__ import annotations

import importlib
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from shoal.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


def test_the_console_script_names_the_main_function() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, attribute = scripts["shoal"].partition(":")
    assert getattr(importlib.import_module(module), attribute) is main


def test_python_dash_m_runs_the_command() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "shoal.cli", "token", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: shoal token")


@pytest.mark.parametrize(
    ("command", "module"),
    [
        (["dev", "--port", "0"], "moto"),
        (["dev", "--port", "0"], "jwt"),
        (["token", "--sub", "alice", "--issuer", "http://x"], "jwt"),
    ],
)
def test_dev_tools_without_the_dev_extra_say_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    command: list[str],
    module: str,
) -> None:
    # Given an environment without a module only the dev extra installs
    monkeypatch.setitem(sys.modules, module, None)
    # When the command is run, Then it refuses to start and names the extra to install
    assert main(command) == 2
    error = capsys.readouterr().err
    assert f"missing: {module}" in error
    assert "'shoal[dev]'" in error
