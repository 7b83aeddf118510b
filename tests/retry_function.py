"""A ``handler(event, context)`` for the event-source runner, for the kill -9 test of
``test_retries``: it logs every record it handles as one line ``ok <record number>`` to
``$STRATA_TEST_LOG`` (O_APPEND, one write each: a kill -9 loses nothing written), and kills
its own process (SIGKILL, nothing cleaned up) when it meets a record listed in
``$STRATA_TEST_POISON`` (comma-separated record numbers), from any topic."""

from __future__ import annotations

import base64
import os
import signal
from typing import Any


def handler(event: dict[str, Any], context: Any) -> None:
    poison = {int(v) for v in os.environ["STRATA_TEST_POISON"].split(",")}
    fd = os.open(os.environ["STRATA_TEST_LOG"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        for records in event["records"].values():
            for record in records:
                i = int(base64.b64decode(record["value"]))
                if i in poison:
                    os.kill(os.getpid(), signal.SIGKILL)
                os.write(fd, b"ok %d\n" % i)
    finally:
        os.close(fd)
