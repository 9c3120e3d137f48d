"""The CDK app's entry point: a missing context value is one line, not a traceback."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.infra


def test_synth_without_its_context_says_what_to_pass_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from infra.app import main

    # Given no context at all (as `cdk synth` without -c jwtIssuer=... -c jwtAudience=...)
    monkeypatch.delenv("CDK_CONTEXT_JSON", raising=False)
    monkeypatch.delenv("CDK_OUTDIR", raising=False)
    # When the app runs / Then it exits 1 with one line naming what to pass
    assert main() == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("shoal: cannot synthesize the stack: the JWT authorizer needs CDK")
    assert "-c jwtIssuer=" in err and "-c jwtAudience=" in err
