"""``shoal token`` on its own: no server needed, only a state directory."""

from __future__ import annotations

import subprocess
from pathlib import Path

import jwt
import pytest
from shoal.local.authorizer import IssuerSettings, SigningKey

from tests.e2e.conftest import ROOT, shoal_command

pytestmark = pytest.mark.e2e


def shoal_token(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*shoal_command(), "token", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_token_without_a_known_issuer_explains_what_to_do(tmp_path: Path) -> None:
    done = shoal_token("--sub", "alice", "--state-dir", str(tmp_path / "none"))
    assert done.returncode == 2
    assert "shoal dev --state-dir" in done.stderr
    assert done.stdout == ""


def test_token_is_signed_for_the_state_dirs_issuer(tmp_path: Path) -> None:
    # Given a state directory a shoal dev has used (its key and issuer settings)
    key = SigningKey.load_or_create(tmp_path)
    IssuerSettings("http://127.0.0.1:9999", "shoal").save(tmp_path)
    # When a token is asked for with permissions
    done = shoal_token(
        "--sub",
        "bob",
        "--state-dir",
        str(tmp_path),
        "--clients",
        "bob-*",
        "--subscribe",
        "a/#",
        "--ttl-s",
        "120",
    )
    # Then the last line is the token alone, verifiable with the state directory's key
    assert done.returncode == 0
    token = done.stdout.strip().splitlines()[-1]
    jwk = jwt.PyJWK(key.jwk())
    claims = jwt.decode(
        token, jwk.key, algorithms=["RS256"], audience="shoal", issuer="http://127.0.0.1:9999"
    )
    assert (claims["sub"], claims["shoal:clients"], claims["shoal:subscribe"]) == (
        "bob",
        ["bob-*"],
        ["a/#"],
    )
    assert claims["exp"] - claims["iat"] == 120
    assert "shoal:admin" not in claims
