"""DiskGuard: the free-space floor counts the bytes it let through since its last reading."""

from __future__ import annotations

from pathlib import Path

import pytest

from broker_agents.disk import DiskGuard
from storage.errors import LogDirFullError
from storage.wal import fileio


def test_requests_accepted_between_readings_are_counted_against_the_floor(tmp_path: Path) -> None:
    now = [0.0]
    free = fileio.fs.free_bytes(tmp_path)
    guard = DiskGuard(tmp_path, free - (1 << 20), interval=10.0, clock=lambda: now[0])
    guard.check(600 << 10)  # 1 MiB of room: taken
    guard.check(600 << 10)  # found above the floor (424 KiB left): taken, crosses it
    with pytest.raises(LogDirFullError):  # no new reading, yet the floor is known crossed
        guard.check(1)
    assert guard.refusals == 1
    now[0] = 11.0  # the next reading is the filesystem's own again (nothing was written)
    guard.check(0)


def test_a_floor_of_zero_never_refuses(tmp_path: Path) -> None:
    guard = DiskGuard(tmp_path, 0)
    guard.check(1 << 40)
    assert guard.refusals == 0
