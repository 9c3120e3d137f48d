"""Bundle the shared layer with a local pip step, because these machines have no Docker."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import aws_cdk as cdk
import jsii

#: The Lambda target the layer's wheels are chosen for (see the functions' runtime and
#: architecture in ``infra.stack``).
PLATFORM = "manylinux2014_aarch64"
PYTHON_VERSION = "3.12"

#: Installed as dependencies of the layer's requirements, but shipped by the Lambda runtime
#: with boto3. A second copy in the layer would shadow the runtime's botocore and break the
#: pairing with the runtime's boto3, and costs cold-start time for nothing.
RUNTIME_PROVIDED = ("botocore", "s3transfer")

#: Parts of the ``shoal`` package that no function runs, left out of the layer: the local
#: runtime of ``shoal dev`` (``shoal.local``, which needs moto), the ``shoal`` command
#: (``shoal.cli``) and the Python client of the API (``shoal.client``).
NOT_IN_LAYER = ("local", "cli", "client")

Runner = Callable[[Sequence[str]], None]


def _run(command: Sequence[str]) -> None:
    subprocess.run(list(command), check=True)


@jsii.implements(cdk.ILocalBundling)
class PipLayerBundling:
    """Builds ``<out>/python``: the layer's pinned requirements for Lambda, plus ``shoal``."""

    def __init__(self, layer_dir: Path, *, python: str = sys.executable, run: Runner = _run):
        self._layer_dir = layer_dir
        self._python = python
        self._run = run

    def command(self, target: Path) -> list[str]:
        return [
            self._python,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-compile",
            "-r",
            str(self._layer_dir / "requirements.txt"),
            "-t",
            str(target),
            "--platform",
            PLATFORM,
            "--implementation",
            "cp",
            "--python-version",
            PYTHON_VERSION,
            "--only-binary=:all:",
        ]

    # jsii hands the bundling options over as one positional struct; none of them matter here
    def try_bundle(self, output_dir: str, *_options: Any, **_named: Any) -> bool:
        target = Path(output_dir) / "python"
        target.mkdir(parents=True, exist_ok=True)
        self._run(self.command(target))
        for pattern in RUNTIME_PROVIDED:
            for path in (*target.glob(pattern), *target.glob(f"{pattern}-*.dist-info")):
                shutil.rmtree(path)
        package = self._layer_dir / "python" / "shoal"
        shutil.copytree(package, target / "shoal", ignore=_layer_files(package), dirs_exist_ok=True)
        return True


def _layer_files(package: Path) -> Callable[[str, list[str]], set[str]]:
    """``copytree``'s ignore: bytecode anywhere, and the subpackages of ``NOT_IN_LAYER``."""
    bytecode = shutil.ignore_patterns("__pycache__", "*.pyc")

    def ignore(directory: str, names: list[str]) -> set[str]:
        skipped = set(bytecode(directory, names))
        if Path(directory) == package:
            skipped.update(name for name in names if name in NOT_IN_LAYER)
        return skipped

    return ignore
