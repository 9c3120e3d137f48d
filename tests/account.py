"""The emulated account a test starts from: provisioned through the API once per process,
then copied for each test.

Provisioning every declared table, stream, bucket and function through moto's API took 8 to
25 s per account on CI's machine (moto serializes each response attribute by attribute), and
about 400 integration tests each start from a fresh account: over an hour of the suite. The
first account of a process is provisioned through the API (``shoal.local.provision``, as
``shoal dev`` does it); moto's backends are then deep-copied, and each later account is that
copy again (about half a second), as independent of the others as a provisioned one.
"""

from __future__ import annotations

import copy
import gc
from typing import Any

import boto3
from moto.backends import get_backend
from shoal.local.provision import LocalNames, provision, provision_queues

#: the services ``provision`` creates resources in
#: the services whose backends are copied (SQS's queues hold locks, which no copy takes:
#: they are made anew for each test, ``provision_queues``)
SERVICES = (
    "dynamodb",
    "kinesis",
    "s3",
    "iam",
    "lambda",
)

_provisioned: dict[tuple[tuple[str, str], ...], dict[str, dict[str, Any]]] = {}


def provision_account(session: boto3.Session, names: LocalNames) -> None:
    """Inside a fresh ``mock_aws()``: every declared resource, named by ``names``."""
    key = tuple(sorted(names.environment().items()))
    snapshot = _provisioned.get(key)
    if snapshot is None:
        provision(session, names)
        _provisioned[key] = {
            service: copy.deepcopy(dict(get_backend(service))) for service in SERVICES
        }
        # the snapshot lives as long as the process: out of the collector's passes (conftest)
        gc.freeze()
        return
    for service, accounts in snapshot.items():
        backends = get_backend(service)
        for account, backend in accounts.items():
            backends[account] = copy.deepcopy(backend)
            # moto empties only the services it has seen read by account (a read registers
            # the service in BackendDict._instances; an assignment does not), at mock_aws's
            # start and end and in shoal dev's reset_backends. Unregistered, a copy this test
            # never reads (Lambda's functions, IAM's role) outlived the test: the next
            # embedded emulator of the process found the functions there, its provision's
            # creates were refused as existing and not journaled, and its replay lacked them
            # (tests/integration/test_account.py)
            backends._create_account_specific_backend(account)
    provision_queues(session, names)
