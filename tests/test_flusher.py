"""The fsync thread (``storage.wal.flusher``): jobs run off the loop, in rounds, and each
caller gets its own result or error back."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import pytest

from storage.wal.flusher import Flusher


def test_a_job_runs_in_the_fsync_thread_and_its_result_comes_back(tmp_path: Path) -> None:
    flusher = Flusher()
    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        os.write(fd, b"x" * 100)

        def job() -> str:
            os.fsync(fd)
            return threading.current_thread().name

        async def main() -> str:
            return await flusher.run(job)

        assert asyncio.run(main()) == "fsync"
    finally:
        os.close(fd)


def test_an_error_reaches_its_caller_only() -> None:
    flusher = Flusher()

    def bad() -> None:
        raise OSError(5, "Input/output error")

    async def main() -> tuple[BaseException | int, ...]:
        return tuple(
            await asyncio.gather(
                flusher.run(bad), flusher.run(lambda: 1), flusher.run(lambda: 2),
                return_exceptions=True,
            )
        )  # fmt: skip

    first, one, two = asyncio.run(main())
    assert isinstance(first, OSError) and first.errno == 5
    assert (one, two) == (1, 2)


def test_jobs_queued_while_one_runs_go_in_one_round() -> None:
    """The thread takes everything queued by the time it wakes: jobs submitted while a slow
    one runs are done in the round after it, one wake-up of the loop for all of them."""
    flusher = Flusher()
    release = threading.Event()
    started = threading.Event()

    def slow() -> str:
        started.set()
        assert release.wait(10)
        return "slow"

    async def main() -> list[object]:
        first = asyncio.ensure_future(flusher.run(slow))
        await asyncio.to_thread(started.wait, 10)
        rest = [asyncio.ensure_future(flusher.run(lambda i=i: i)) for i in range(5)]
        await asyncio.sleep(0)  # every job queued
        release.set()
        return [await first, *[await r for r in rest]]

    assert asyncio.run(main()) == ["slow", 0, 1, 2, 3, 4]
    assert (flusher.rounds, flusher.jobs) == (2, 6)


def test_a_cancelled_caller_does_not_stop_the_job_nor_the_others() -> None:
    flusher = Flusher()
    release = threading.Event()
    ran: list[str] = []

    def job(name: str) -> str:
        assert release.wait(10)
        ran.append(name)
        return name

    async def main() -> str:
        gone = asyncio.ensure_future(flusher.run(lambda: job("gone")))
        kept = asyncio.ensure_future(flusher.run(lambda: job("kept")))
        await asyncio.sleep(0)
        gone.cancel()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await gone
        return await kept

    assert asyncio.run(main()) == "kept"
    assert ran == ["gone", "kept"]  # an fsync cannot be taken back: it still ran
