"""Which DynamoDB errors the service answers ``server_busy`` (503, retry) rather than 500."""

from __future__ import annotations

from typing import Any

import pytest
from botocore.exceptions import ClientError
from shoal.aws.dynamo import Dynamo
from shoal.core.errors import ServerBusy


class Refusing:
    """A DynamoDB client whose every call fails with ``code``."""

    def __init__(self, code: str) -> None:
        self.code = code

    def get_item(self, **_: Any) -> Any:
        raise ClientError({"Error": {"Code": self.code, "Message": "no"}}, "GetItem")


@pytest.mark.parametrize(
    "code",
    [
        "ProvisionedThroughputExceededException",
        "ThrottlingException",
        "RequestLimitExceeded",
        "InternalServerError",
        # DynamoDB's 503, and what shoal dev's emulator answers past its wait for a turn: the
        # 200-client soak's 150 "unexpected error" 500s and 3 lost $disconnects
        "ServiceUnavailable",
    ],
)
def test_a_busy_or_unavailable_store_is_server_busy(code: str) -> None:
    with pytest.raises(ServerBusy):
        Dynamo(Refusing(code)).call("get_item", TableName="t", Key={})


def test_any_other_error_stays_the_sdks_own() -> None:
    with pytest.raises(ClientError):
        Dynamo(Refusing("ValidationException")).call("get_item", TableName="t", Key={})
