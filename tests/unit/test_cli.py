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


def test_dev_without_the_emulator_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given an environment without moto (installed by the dev extra only)
    monkeypatch.setitem(sys.modules, "moto", None)
    # When shoal dev is run, Then it refuses to start and names the extra to install
    assert main(["dev", "--port", "0"]) == 2
    error = capsys.readouterr().err
    assert "moto" in error
    assert "'.[dev]'" in error
