"""shoal dev's own log: JSON lines, and no traceback when a client hangs up."""

from __future__ import annotations

import json
import logging
import sys

import pytest
from shoal.local.gateway import GatewayServer
from shoal.local.logs import JsonLines


def test_a_log_line_is_one_json_object_with_its_extras_and_no_exception_message() -> None:
    secret = "-".join(("payload", "not", "logged"))  # made at run time: frames quote source
    try:
        raise ValueError(secret)
    except ValueError:
        record = logging.LogRecord(
            "shoal-dev.gateway", logging.ERROR, __file__, 1, "GET %s %d", ("/v1/x", 500), None
        )
        record.exc_info = sys.exc_info()
    record.status = 500
    line = JsonLines().format(record)
    assert "\n" not in line
    fields = json.loads(line)
    assert (fields["level"], fields["logger"], fields["message"]) == (
        "ERROR",
        "shoal-dev.gateway",
        "GET /v1/x 500",
    )
    assert (fields["status"], fields["error"]) == (500, "ValueError")
    assert "test_dev_log.py" in fields["frames"]
    assert secret not in line


@pytest.mark.parametrize("gone", [BrokenPipeError, ConnectionResetError])
def test_a_client_that_hangs_up_is_a_debug_line_not_a_traceback(
    gone: type[OSError], capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    server = GatewayServer("127.0.0.1", 0)
    try:
        with caplog.at_level(logging.DEBUG, logger="shoal-dev.gateway"):
            try:
                raise gone()
            except OSError:
                # what socketserver calls when a connection's thread raised
                server._server.handle_error(None, ("127.0.0.1", 1))
    finally:
        server.stop()
    assert "Traceback" not in capsys.readouterr().err
    assert [r.levelname for r in caplog.records] == ["DEBUG"]
    assert gone.__name__ in caplog.records[0].getMessage()
