"""One JSON object per log line for every Strata process (agents, the local supervisor, the
admin runtime): ``ts``, ``level``, ``logger``, ``msg``, and ``exc_info`` (the traceback) when
there is one. python-json-logger does the escaping, so quotes, newlines and tracebacks in a
message never break a line (the earlier %-format template did)."""

from __future__ import annotations

import logging
import sys
from typing import TextIO

from pythonjsonlogger.json import JsonFormatter

_RENAMES = {"asctime": "ts", "levelname": "level", "name": "logger", "message": "msg"}


def json_formatter() -> logging.Formatter:
    return JsonFormatter("{asctime}{levelname}{name}{message}", style="{", rename_fields=_RENAMES)


def configure(level: int = logging.INFO, stream: TextIO | None = None) -> None:
    """JSON lines on ``stream`` (stderr) for the root logger; kazoo's chatter at WARNING."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(json_formatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("kazoo").setLevel(logging.WARNING)
