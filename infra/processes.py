"""Child processes of the local stack: start with a log file, check readiness, stop for sure.

The local stack (ZooKeeper, moto, agents) and the integration tests run real servers as child
processes. Every child here

* gets its own session (``start_new_session``), so a Ctrl-C in the terminal reaches only the
  parent, and :func:`terminate` can signal the child's whole process group (a child's own
  children go with it);
* writes stdout and stderr to one log file, never to the parent's terminal;
* optionally dies with its parent (``PR_SET_PDEATHSIG``, Linux) so a parent killed with
  SIGKILL does not leave servers behind. The kernel sends that signal when the *thread* that
  started the child exits, so it is only set up from the main thread, whose end is the
  process's end;
* is stopped by :func:`terminate`: SIGTERM to the group, a deadline, then SIGKILL, then a wait
  for the exit status — no zombie, no survivor.

Readiness is polled with short timeouts (``POLL_INTERVAL``) under one overall deadline, and a
child that exits while starting is reported with the tail of its log.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Self

from storage.errors import StrataError

POLL_INTERVAL = 0.05
"""Seconds between two readiness probes."""

_PR_SET_PDEATHSIG = 1


class LocalStackError(StrataError):
    """A local-stack process could not be started, or is not what it should be.

    Raised on the developer's machine (missing Java, a server that exits or never becomes
    ready); it never travels over the wire.
    """


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now.

    Another process can take it before the caller binds it: launchers that pass the port to a
    server on its command line retry with a new one when the server fails to bind.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct TCP ports that are free on ``host`` right now (same caveat as
    :func:`free_port`: all are bound at once, so they differ, then released)."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((host, 0))
            ports.append(int(sock.getsockname()[1]))
        return ports


def _pdeathsig_preexec(sig: signal.Signals) -> Callable[[], None] | None:
    """A ``preexec_fn`` that asks the kernel to send ``sig`` to the child when we die."""
    if not sys.platform.startswith("linux"):
        return None
    if threading.current_thread() is not threading.main_thread():
        return None
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return None
    prctl = ctypes.CDLL(libc_name, use_errno=True).prctl  # resolved before fork
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died between fork and prctl
            os._exit(1)

    return preexec


def spawn(
    argv: Sequence[str],
    *,
    log_path: Path,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    die_with_parent: bool = True,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` in its own session with stdout and stderr appended to ``log_path``.

    ``env`` is the child's whole environment (``None``: inherit ours). With
    ``die_with_parent`` the child gets SIGTERM when this process dies (Linux, main thread).
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=None if env is None else dict(env),
            cwd=cwd,
            start_new_session=True,
            preexec_fn=_pdeathsig_preexec(signal.SIGTERM) if die_with_parent else None,
        )


def signal_group(process: subprocess.Popen[bytes], sig: int) -> None:
    """Send ``sig`` to the process group that ``process`` leads (see :func:`spawn`).

    A group whose members have all exited is not an error.
    """
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)


def terminate(process: subprocess.Popen[bytes], *, timeout: float = 5.0) -> int:
    """Stop ``process`` and its group: SIGTERM, wait up to ``timeout`` s, SIGKILL, reap.

    Returns the exit status (negative: killed by that signal). Safe to call on a process that
    has already exited; its leftover group members still get the signals.
    """
    signal_group(process, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=timeout)
    # SIGKILL the group even when the leader exited on SIGTERM: its children may not have.
    signal_group(process, signal.SIGKILL)
    return process.wait(timeout=timeout)


def log_tail(log_path: Path, limit: int = 4000) -> str:
    """The last ``limit`` characters of a log file ("" if there is none)."""
    try:
        with open(log_path, "rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - limit))
            return log.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return ""


class ExitedWhileStarting(LocalStackError):
    """The child exited before it became ready (often: its port was taken meanwhile)."""

    def __init__(self, message: str, *, returncode: int) -> None:
        super().__init__(message)
        self.returncode = returncode


def wait_until_ready(
    process: subprocess.Popen[bytes],
    probe: Callable[[], bool],
    *,
    what: str,
    log_path: Path,
    timeout: float,
) -> None:
    """Call ``probe`` every ``POLL_INTERVAL`` s until it returns True, within ``timeout`` s.

    ``probe`` must itself be bounded (a socket timeout well under ``timeout``) and return
    False, not raise, while the server is not ready. Raises :class:`ExitedWhileStarting` if
    the child exits meanwhile and :class:`LocalStackError` at the deadline; in both cases the
    message ends with the tail of the child's log.
    """
    deadline = time.monotonic() + timeout
    while True:
        returncode = process.poll()
        if returncode is not None:
            raise ExitedWhileStarting(
                f"{what} exited with status {returncode} while starting; "
                f"end of {log_path}:\n{log_tail(log_path)}",
                returncode=returncode,
            )
        if probe():
            return
        if time.monotonic() >= deadline:
            raise LocalStackError(
                f"{what} was not ready after {timeout:g} s; end of {log_path}:\n"
                f"{log_tail(log_path)}"
            )
        time.sleep(POLL_INTERVAL)


@dataclass(frozen=True, slots=True, kw_only=True)
class ChildProcess:
    """A running child server; stop it with :meth:`stop` or a ``with`` block."""

    _process: subprocess.Popen[bytes] = field(repr=False, compare=False)

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def running(self) -> bool:
        return self._process.poll() is None

    def stop(self, *, timeout: float = 10.0) -> int:
        """SIGTERM, then SIGKILL after ``timeout`` s; returns once the child has exited."""
        return terminate(self._process, timeout=timeout)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


PORT_ATTEMPTS = 3
"""Starts tried with a fresh free port when a server exits while starting (port taken)."""


def start_on_port(
    argv_for: Callable[[int], Sequence[str]],
    probe_for: Callable[[int], Callable[[], bool]],
    *,
    host: str,
    port: int | None,
    what: str,
    output_path: Path,
    log_path: Path,
    timeout: float,
    env: Mapping[str, str] | None = None,
    die_with_parent: bool = True,
) -> tuple[subprocess.Popen[bytes], int]:
    """Spawn ``argv_for(port)`` and wait until ``probe_for(port)()`` holds; (process, port).

    ``port=None`` picks a free port and, if the server exits while starting (the port was
    taken before it bound it), tries up to ``PORT_ATTEMPTS`` ports. The child's output goes to
    ``output_path``; ``log_path`` is the log quoted when it fails. A child that fails to come
    up is terminated before the error is raised.
    """
    attempt = 0
    while True:
        attempt += 1
        chosen = free_port(host) if port is None else port
        process = spawn(
            argv_for(chosen), log_path=output_path, env=env, die_with_parent=die_with_parent
        )
        try:
            wait_until_ready(
                process,
                probe_for(chosen),
                what=f"{what} on {host}:{chosen}",
                log_path=log_path,
                timeout=timeout,
            )
        except ExitedWhileStarting:
            terminate(process)
            if port is not None or attempt == PORT_ATTEMPTS:
                raise
            continue
        except BaseException:
            terminate(process)
            raise
        return process, chosen
