"""The fsync thread (``storage.wal.flusher``): jobs run off the loop, in rounds, and each
caller gets its own result or error back; plain fsyncs go to the kernel instead, where it can."""

from __future__ import annotations

import asyncio
import errno
import gc
import os
import sys
import threading
from pathlib import Path

import pytest

from storage.wal import crashfs, fileio
from storage.wal.flusher import Flusher, _errno_of


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


# ---- fsyncs through the kernel (Linux AIO) ---------------------------------------------------


def _kernel_aio_expected() -> bool:
    """Where caio is installed on Linux, the kernel path must be taken: a silent fall back to
    the thread would undo the change without a test noticing."""
    if sys.platform != "linux":
        return False
    try:
        from caio import linux_aio_asyncio
    except ImportError:
        return False
    return linux_aio_asyncio is not None


def test_a_plain_fsync_goes_to_the_kernel_not_the_thread(tmp_path: Path) -> None:
    flusher = Flusher()
    fds = [os.open(tmp_path / name, os.O_WRONLY | os.O_CREAT) for name in "abc"]
    try:
        for fd in fds:
            os.write(fd, b"x" * 4096)

        async def main() -> None:
            await flusher.fsync(fds)
            await asyncio.gather(*(flusher.fsync([fd]) for fd in fds))

        asyncio.run(main())
        if _kernel_aio_expected():
            assert (flusher.kernel_fsyncs, flusher.jobs) == (6, 0)
        else:
            assert (flusher.kernel_fsyncs, flusher.jobs) == (0, 4)
    finally:
        for fd in fds:
            os.close(fd)


def test_a_refused_or_failed_fsync_raises_oserror_and_the_next_one_works(tmp_path: Path) -> None:
    flusher = Flusher()
    good = os.open(tmp_path / "good", os.O_WRONLY | os.O_CREAT)
    read_end, write_end = os.pipe()  # a pipe cannot be fsynced (EINVAL)
    try:

        async def main() -> None:
            os.write(good, b"x")
            await flusher.fsync([good])  # (the loop's AIO context and its eventfd exist now)
            closed = os.open(tmp_path / "closed", os.O_WRONLY | os.O_CREAT)
            os.close(closed)  # nor can a closed descriptor (EBADF; nothing reuses its number)
            # the errno an fsync in the thread (os.fsync) would give
            for bad, code in ((write_end, errno.EINVAL), (closed, errno.EBADF)):
                with pytest.raises(OSError) as failed:
                    await flusher.fsync([bad])
                assert failed.value.errno == code, failed.value
                assert failed.value.strerror == os.strerror(code)
            os.write(good, b"y")
            await flusher.fsync([good])

        asyncio.run(main())
    finally:
        for fd in (read_end, write_end, good):
            os.close(fd)


def test_fsyncs_stay_in_the_thread_under_a_recording_file_system(tmp_path: Path) -> None:
    """Fault drills record (and fail) fsyncs in ``fileio.fs``: the kernel path would bypass
    them, so it is not taken while another file system is installed."""
    flusher = Flusher()
    data, journal = tmp_path / "data", tmp_path / "journal"
    crashfs.start_recording(data, journal)
    recorder = crashfs.RecordingFileSystem(journal)
    old = fileio.set_file_system(recorder)
    fd = recorder.open(data / "f", os.O_WRONLY | os.O_CREAT)
    try:
        recorder.pwrite(fd, [b"z" * 10], 0)
        asyncio.run(flusher.fsync([fd]))
        assert (flusher.kernel_fsyncs, flusher.jobs) == (0, 1)
    finally:
        fileio.set_file_system(old)
        os.close(fd)


def test_event_loops_that_come_and_go_leave_no_descriptors_behind(tmp_path: Path) -> None:
    """Each loop gets its own AIO context (an eventfd); a closed loop's is freed once another
    loop makes one, so a process running many loops (tests) does not pile them up."""
    flusher = Flusher()
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)

    async def once() -> None:
        await flusher.fsync([fd])

    try:
        asyncio.run(once())
        before = len(os.listdir("/proc/self/fd"))
        for _ in range(50):
            asyncio.run(once())
        gc.collect()
        assert len(os.listdir("/proc/self/fd")) <= before + 2
    finally:
        os.close(fd)


def test_a_kernel_fsync_that_failed_keeps_its_errno() -> None:
    """caio reports a failed fsync (not a refused one) as ``SystemError`` with only
    ``strerror``'s text: a full disk stays ENOSPC and an I/O error EIO, as from os.fsync."""
    for code in (errno.EIO, errno.ENOSPC, errno.EDQUOT, errno.EROFS):
        assert _errno_of(SystemError(os.strerror(code))) == code
    assert _errno_of(ValueError("The file descriptor ... is invalid [EBADF]")) == errno.EBADF
    assert _errno_of(SystemError("something caio has not said before")) == errno.EIO
