"""Shared fixtures: an emulated account built from the declarations, with serialized moto."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator

import boto3
import pytest
from hypothesis import HealthCheck, settings
from moto import mock_aws
from shoal.aws import clients
from shoal.core.config import get_config
from shoal.local.aws import adapt_moto
from shoal.local.provision import LocalNames
from shoal.local.serialize import serialized_moto

from tests.account import provision_account

# Speed is measured in bench/, never asserted by a test: hypothesis's per-example deadline
# (200 ms) and its too-slow health check are timing assertions, and they failed unit tests of
# topic matching on CI's slow, shared machine while the property held.
settings.register_profile("shoal", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("shoal")

#: Tests whose fixtures outlast pytest-timeout's default 300 s on CI's slow, shared machine: a
#: synthesis (jsii drives CDK's Node.js library) took over 5 minutes with the other worker busy,
#: and the audit's module fixture (a local Spark session, then its stages) as long. They get 20
#: minutes; a hang still stops. The default counts a test's fixtures too.
SLOW_FOLDERS_TIMEOUT_S = {"tests/infra/": 1200, "tests/pipeline/": 1200}

#: every AWS call a function makes in the run is held against its role (tests/iam/plugin.py)
pytest_plugins = ("tests.iam.plugin",)

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


# The collector's full passes walk every object of the process: botocore's service models,
# moto's backends, CDK's and Spark's modules. Measured on CI's machine, whose random memory
# reads are slow (a pass over 280,000 objects took 6 s), they were a third of an integration
# module's time. What exists once the tests are collected (modules, models, constants) lives
# until the end: it is frozen out of the collector, as a pre-forking server does after loading.
gc.disable()


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput") and config.getoption("numprocesses", None):
        gc.enable()  # xdist's controller collects no tests: it would never reach the freeze


def pytest_collection_finish(session: pytest.Session) -> None:
    gc.freeze()
    gc.enable()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("timeout") is not None:
            continue
        for folder, timeout_s in SLOW_FOLDERS_TIMEOUT_S.items():
            if item.nodeid.startswith(folder):
                item.add_marker(pytest.mark.timeout(timeout_s))


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
        provision_account(session, names)
        yield session
    get_config.cache_clear()
