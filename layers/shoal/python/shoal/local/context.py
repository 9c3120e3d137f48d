"""The Lambda context object of in-process invocations: ``shoal dev``, tests and benchmarks.

Handlers and Powertools read the function's name, version, memory, ARN, request id, log group
and stream, and the remaining time; nothing else. One class serves every in-process caller so
that they all hand handlers the same shape.
"""

from __future__ import annotations

import time
import uuid

from aws_lambda_powertools.utilities.typing import LambdaContext as PowertoolsContext

from shoal.local.provision import ACCOUNT_ID

#: the emulated account's region (``shoal dev`` sets it for the functions)
REGION = "us-east-1"


class NotInvoked(Exception):
    """An invocation that never ran: no sandbox of the function was free before the caller's
    deadline, or its caller had gone meanwhile (``shoal.local.runtime.Functions``)."""


class LambdaContext(PowertoolsContext):
    """The parts of Lambda's context object a handler (and Powertools) reads; the type handlers
    are annotated with, so that the same handler takes Lambda's object and this one."""

    def __init__(
        self,
        function_name: str,
        *,
        memory_mb: int = 512,
        timeout_s: float = 30.0,
        request_id: str | None = None,
        log_stream: str = "shoal-dev",
    ) -> None:
        self._function_name = function_name
        self._function_version = "$LATEST"
        self._memory_limit_in_mb = memory_mb
        self._invoked_function_arn = (
            f"arn:aws:lambda:{REGION}:{ACCOUNT_ID}:function:{function_name}"
        )
        self._aws_request_id = request_id or str(uuid.uuid4())
        self._log_group_name = f"/aws/lambda/{function_name}"
        self._log_stream_name = log_stream
        self._deadline = time.monotonic() + timeout_s

    def get_remaining_time_in_millis(self) -> int:
        return max(0, int((self._deadline - time.monotonic()) * 1000))
