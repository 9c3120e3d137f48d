"""Shared fixtures: an emulated account built from the declarations, with serialized moto."""

from __future__ import annotations

import os
from collections.abc import Iterator

import boto3
import pytest
from moto import mock_aws
from shoal.aws import clients
from shoal.core.config import get_config
from shoal.local.aws import adapt_moto
from shoal.local.provision import LocalNames, provision
from shoal.local.serialize import serialized_moto

FAKE_AWS_ENV = {
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_MAX_ATTEMPTS": "1",
    "AWS_ACCOUNT_ID_ENDPOINT_MODE": "disabled",
    "POWERTOOLS_TRACE_DISABLED": "1",
    "POWERTOOLS_METRICS_NAMESPACE": "Shoal",
    "POWERTOOLS_LOG_LEVEL": "WARNING",
    "JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION": "20",
}


@pytest.fixture(autouse=True, scope="session")
def _fake_aws_env() -> Iterator[None]:
    # No test may reach a real account: fake credentials, one region, no SDK retries.
    saved = {k: os.environ.get(k) for k in FAKE_AWS_ENV}
    os.environ.update(FAKE_AWS_ENV)
    os.environ.pop("AWS_ENDPOINT_URL", None)
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch) -> Iterator[boto3.Session]:
    """An emulated account holding every declared resource, configured as deployed."""
    names = LocalNames.for_deployment()
    for key, value in names.environment().items():
        monkeypatch.setenv(key, value)
    get_config.cache_clear()
    # the emulators deliver stream records themselves; moto's own delivery needs Docker
    adapt_moto()
    with mock_aws(), serialized_moto():
        # clients are shared per process; a fresh account gets fresh ones
        clients.reset()
        session = boto3.Session(region_name="us-east-1")
        provision(session, names)
        yield session
    get_config.cache_clear()
