"""The ``aws`` fixture's emulated account (tests/account.py) leaves nothing behind in moto."""

from __future__ import annotations

import boto3
from moto import mock_aws
from moto.backends import get_backend
from shoal.local.aws import adapt_moto
from shoal.local.provision import LocalNames
from shoal.local.serialize import serialized_moto

from tests.account import SERVICES, provision_account


def accounts_left() -> dict[str, list[str]]:
    # len() and iteration of moto's BackendDict do not register it for a reset; a read by
    # account would
    return {
        service: list(get_backend(service)) for service in SERVICES if len(get_backend(service))
    }


def test_an_account_copied_from_the_snapshot_is_emptied_when_its_mock_ends() -> None:
    # Given two accounts one after the other, as two tests get them: the second (at the
    # latest) copied from the process's snapshot, and neither reading Lambda or IAM
    adapt_moto()
    names = LocalNames.for_deployment()
    for _ in range(2):
        with mock_aws(), serialized_moto():
            provision_account(boto3.Session(region_name="us-east-1"), names)
    # Then, their mocks ended, moto holds no account of any provisioned service (what a
    # service kept was there for the next embedded emulator of the process: its provision
    # found the functions, their creates went unjournaled, and its replay lacked them)
    assert accounts_left() == {}
