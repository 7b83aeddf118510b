"""moto in server mode as a child process: the S3 of the local stack and the integration tests.

A separate process (``python -m moto.server``), not a thread in the caller, so that agents,
handlers and tests — all separate processes — talk to one S3 over HTTP on loopback, as they
would to the real one. Its request log goes to ``<state_dir>/moto.log``. Everything moto
stores lives in that process's memory: :meth:`MotoServer.reset` (``POST /moto-api/reset``)
empties it between tests, and it is gone when the server stops.

Readiness: ``GET /moto-api/data.json`` answers 200 with JSON, probed every 50 ms up to a
deadline.
"""

from __future__ import annotations

import functools
import os
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from infra.processes import ChildProcess, LocalStackError, start_on_port

HOST = "127.0.0.1"


def _answers(endpoint_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{endpoint_url}/moto-api/data.json", timeout=0.5) as reply:
            status: int = reply.status
            first: bytes = reply.read(1)
            return status == 200 and first == b"{"
    except (OSError, ValueError):
        return False


@dataclass(frozen=True, slots=True, kw_only=True)
class MotoServer(ChildProcess):
    """A running moto server; stop it with :meth:`stop` or a ``with`` block."""

    host: str
    port: int
    state_dir: Path
    log_path: Path

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def reset(self, *, timeout: float = 10.0) -> None:
        """Forget every bucket and object (every moto backend, in fact)."""
        request = urllib.request.Request(f"{self.endpoint_url}/moto-api/reset", method="POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as reply:
                reply.read()
        except OSError as exc:
            raise LocalStackError(f"resetting moto at {self.endpoint_url} failed: {exc}") from exc


def start_moto(
    state_dir: Path,
    *,
    port: int | None = None,
    startup_timeout: float = 20.0,
    die_with_parent: bool = True,
) -> MotoServer:
    """Start ``python -m moto.server`` on ``127.0.0.1`` and return once it answers HTTP.

    ``port=None`` picks a free port (and tries another if it is taken before the server
    binds it). ``die_with_parent=False`` lets the server outlive this process (the local
    stack's ``up``). Raises :class:`LocalStackError` if it does not come up within
    ``startup_timeout`` s.
    """
    state_dir = state_dir.resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    log_path = state_dir / "moto.log"
    process, chosen = start_on_port(
        lambda p: [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(p)],
        lambda p: functools.partial(_answers, f"http://{HOST}:{p}"),
        host=HOST,
        port=port,
        what="moto server",
        output_path=log_path,
        log_path=log_path,
        timeout=startup_timeout,
        env=dict(os.environ, PYTHONUNBUFFERED="1", NO_COLOR="1"),
        die_with_parent=die_with_parent,
    )
    return MotoServer(
        host=HOST, port=chosen, state_dir=state_dir, log_path=log_path, _process=process
    )
