"""``shoal dev``'s own log: one JSON object a line on stderr, as the functions log (Powertools).

Each line has ``timestamp`` (UTC, ISO 8601 with milliseconds), ``level``, ``logger``,
``message`` and the fields a call passed in ``extra`` (the gateway's method, path, status and
duration). An exception adds its type (``error``) and where it was raised (``frames``), never
its message: a message may quote a payload or a token.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import traceback
from typing import Any

#: attributes every LogRecord has; anything else on a record came from ``extra``
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JsonLines(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "timestamp": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                line[key] = value
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            line["error"] = type(exc).__name__
            line["frames"] = "".join(traceback.format_tb(exc.__traceback__)).rstrip()
        return json.dumps(line, default=str, ensure_ascii=False)


def configure(level: str) -> None:
    """The runtime's lines (loggers "shoal-dev.*") and everyone else's warnings, as JSON lines.

    The runtime gets a handler of its own: Powertools filters every record whose logger name
    holds its service name ("shoal") out of the root logger's handlers. Everything else (moto,
    botocore, werkzeug) reaches stderr through the root logger from WARNING up.
    """
    import sys

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLines())
    runtime_log = logging.getLogger("shoal-dev")
    runtime_log.addHandler(handler)
    runtime_log.setLevel(level)
    runtime_log.propagate = False
    others = logging.StreamHandler(sys.stderr)
    others.setFormatter(JsonLines())
    # the functions' Powertools loggers ("shoal", "shoal.*") write JSON through handlers of
    # their own; through the root logger they would be written twice
    others.addFilter(lambda r: r.name != "shoal" and not r.name.startswith("shoal."))
    root = logging.getLogger()
    root.addHandler(others)
    root.setLevel(logging.WARNING)
