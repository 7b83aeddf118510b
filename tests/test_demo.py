"""`make demo` must keep working: run it (smaller) as a real subprocess and check its report."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_demo_writes_reopens_and_reads_back_a_real_log(tmp_path: Path) -> None:
    log_dir = tmp_path / "orders-0"
    run = subprocess.run(
        [sys.executable, "-m", "infra.demo_storage", "--messages", "20000", "--dir", str(log_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "FAIL" not in run.stdout
    assert run.stdout.count("[ok]") == 5
    assert "20,000 msgs back as Arrow" in run.stdout
    assert sorted(p.suffix for p in log_dir.iterdir()) == [".log"]  # one active segment on disk
