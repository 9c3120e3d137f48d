"""Synthesized templates, built once per session: a synth costs seconds.

``deployed`` is the stack of the real declarations; ``variant`` is the test-only ``VARIANT``
deployment, synthesized with -c defaultPartitions=4 -c retainData=false -c retainStreams=true;
``fan_out`` the real declarations with the enhanced fan-out option on.
"""

from __future__ import annotations

import pytest
from shoal.declarations import DEPLOYMENT

from tests.infra.stacks import VARIANT, Synth, context, synth


@pytest.fixture(scope="session")
def deployed() -> Synth:
    return synth(DEPLOYMENT, context())


@pytest.fixture(scope="session")
def variant(tmp_path_factory: pytest.TempPathFactory) -> Synth:
    functions_dir = tmp_path_factory.mktemp("functions")
    for fn in VARIANT.functions:
        (functions_dir / fn.name).mkdir()
        (functions_dir / fn.name / "app.py").write_text("def handler(event, context):\n    pass\n")
    return synth(
        VARIANT,
        context(defaultPartitions="4", retainData="false", retainStreams="true"),
        functions_dir=functions_dir,
    )


@pytest.fixture(scope="session")
def fan_out() -> Synth:
    """The real declarations' stack with -c enhancedFanOut=router (issue 48)."""
    return synth(DEPLOYMENT, context(enhancedFanOut="router"))
