"""Lambda's package limits and runtime: each function with the layer stays under 250 MB
unzipped, and the Python the stack declares is the one the suite runs.

The layer's size is measured without building it (a build downloads wheels for Lambda's
platform, and the suite reaches nothing beyond loopback): the layer's requirements and what
they require, as installed in this environment, less what the Lambda runtime provides
(``infra.bundling.RUNTIME_PROVIDED``), plus the ``shoal`` package as bundled. This machine's
wheels stand in for Lambda's arm64 ones: the same files but for the compiled parts (pydantic's
core, a few MB either way), far inside the margin.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterable
from importlib import metadata
from pathlib import Path

import pytest

from tests.infra.stacks import ROOT, Synth

pytestmark = pytest.mark.infra

#: Lambda's quota: a function's deployment package and its layers, unzipped
UNZIPPED_LIMIT_BYTES = 250 * 1024 * 1024
MB = 1024 * 1024
LAYER_DIR = ROOT / "layers" / "shoal"


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(roots: Iterable[str]) -> dict[str, metadata.Distribution]:
    """The installed distributions ``roots`` need, with what they need, markers honoured
    (extras named in the requirements file included)."""
    from packaging.requirements import Requirement

    wanted: dict[str, metadata.Distribution] = {}
    queue = [Requirement(r) for r in roots]
    while queue:
        requirement = queue.pop()
        name = _canonical(requirement.name)
        if name in wanted:
            continue
        dist = metadata.distribution(name)
        wanted[name] = dist
        extras = requirement.extras or {""}
        for text in dist.requires or []:
            child = Requirement(text)
            if child.marker is None or any(
                child.marker.evaluate({"extra": extra}) for extra in extras
            ):
                queue.append(child)
    return wanted


def _dist_bytes(dist: metadata.Distribution) -> int:
    total = 0
    for file in dist.files or []:
        if "__pycache__" in file.parts or file.suffix == ".pyc":
            continue  # the layer is built with --no-compile
        path = Path(str(dist.locate_file(file)))
        if path.is_file():
            total += path.stat().st_size
    return total


def _tree_bytes(folder: Path, skip: Iterable[str] = ()) -> int:
    skipped = set(skip)
    return sum(
        p.stat().st_size
        for p in folder.rglob("*")
        if p.is_file()
        and "__pycache__" not in p.parts
        and p.suffix != ".pyc"
        and not (skipped & set(p.relative_to(folder).parts[:1]))
    )


def layer_bytes() -> tuple[int, dict[str, int]]:
    """The layer unzipped: its dependencies (per distribution) and the ``shoal`` package."""
    from infra.bundling import NOT_IN_LAYER, RUNTIME_PROVIDED

    requirements = (LAYER_DIR / "requirements.txt").read_text().splitlines()
    lines = [line.split("#", 1)[0].strip() for line in requirements]
    closure = _closure(line for line in lines if line)
    parts = {
        name: _dist_bytes(dist)
        for name, dist in closure.items()
        if name not in {_canonical(p) for p in RUNTIME_PROVIDED}
    }
    parts["shoal"] = _tree_bytes(LAYER_DIR / "python" / "shoal", skip=NOT_IN_LAYER)
    return sum(parts.values()), parts


def test_each_function_with_the_layer_stays_under_lambdas_unzipped_limit(
    deployed: Synth, record_property: Callable[[str, object], None]
) -> None:
    # Given the layer as bundled and each declared function's code folder
    layer, parts = layer_bytes()
    largest = max(parts, key=lambda name: parts[name])
    sizes = {
        fn.name: _tree_bytes(ROOT / "functions" / fn.name) + layer
        for fn in deployed.deployment.functions
    }
    worst = max(sizes, key=lambda name: sizes[name])
    # Then each package is inside the quota, and the suite says by how much
    summary = (
        f"package sizes: largest function {worst} with the layer {sizes[worst] / MB:.1f} MB "
        f"unzipped of Lambda's 250 MB ({100 * sizes[worst] / UNZIPPED_LIMIT_BYTES:.0f}%); "
        f"the layer {layer / MB:.1f} MB, of which {largest} {parts[largest] / MB:.1f} MB"
    )
    record_property("suite_summary", summary)
    over = {name: size for name, size in sizes.items() if size >= UNZIPPED_LIMIT_BYTES}
    assert not over, summary
    # And the layer holds what the functions import (not a measure of an empty folder)
    assert {"pydantic", "pynamodb", "aws-lambda-powertools", "shoal"} <= set(parts)


def test_the_functions_run_on_the_python_the_suite_runs(deployed: Synth) -> None:
    from infra.bundling import PYTHON_VERSION

    running = f"python{sys.version_info.major}.{sys.version_info.minor}"
    # Given every declared function's runtime and the layer's runtimes
    declared = {
        deployed.function(fn.name)["Properties"]["Runtime"] for fn in deployed.deployment.functions
    }
    [layer] = deployed.of_type("AWS::Lambda::LayerVersion").values()
    # Then they are one Python, the one running these tests, and the layer's wheels are for it
    assert declared == {running}
    assert layer["Properties"]["CompatibleRuntimes"] == [running]
    assert f"python{PYTHON_VERSION}" == running
