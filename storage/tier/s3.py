"""The object-store adapter: the one boundary between Strata and the S3 client libraries.

Every call but one goes through **aioboto3** (aiobotocore under it): an asyncio client on the
agent's event loop, no thread per request. The exception is the streamed read of tiered
segments (``read_into``, the hot path of catch-up reads): it runs a blocking boto3 ``GET``
on a bounded thread pool so that the body is received with ``recv_into`` straight into the
reader's cache buffers (``_receiver``), which ``make bench-tier`` holds at >= 0.8 of plain
GETs; aiohttp hands a body out as freshly allocated chunks (one copy more per byte), and an
aiohttp version of this path has not been measured against it yet. Both clients come from
one lock: boto3 and botocore pinned to the versions the latest aioboto3 supports. Uploads
measured on both (``docs/benchmarks.md``, *aioboto3*).

Rules every call follows:

* **Deadline.** Each attempt has ``request_timeout`` seconds (``asyncio.wait_for``; and
  botocore's ``connect_timeout``/``read_timeout`` on both clients, so an abandoned streamed
  read's thread also gives up). botocore's own retries are off: this module owns the retry
  policy.
* **Retries.** Throttling (503 SlowDown, 429, 500/502/504, ``RequestTimeout``), timeouts and
  connection errors (refused, reset, closed, broken responses; aiohttp's client errors) are
  retried up to
  ``max_attempts`` times with exponential backoff and full jitter (``Backoff``, injectable).
* **Batches.** ``delete_many`` removes up to 1,000 keys per ``DeleteObjects`` request (a
  deleted topic's segments, ``broker_agents.deletion``); keys the store reports as failed are
  sent again under the same retry policy.
* **Errors.** botocore's exceptions become ``ObjectStoreError`` (retriable),
  ``ObjectExistsError`` (412 on a create-only put) or ``ObjectNotFoundError`` (404), here and
  nowhere else.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import queue
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import aioboto3
import aiohttp
import boto3
import botocore.exceptions
from aiobotocore.config import AioConfig
from botocore.config import Config as BotoConfig

from storage.errors import ObjectExistsError, ObjectNotFoundError, ObjectStoreError

T = TypeVar("T")


def _nothing() -> None:
    pass


class Targets:
    """The buffers a streamed GET (``ObjectStore.read_into``) fills, in order, handed over by
    the event loop while the transfer runs: thread-safe, unbounded only in name (the caller
    hands over buffers it owns, so what it has reserved bounds the queue)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()

    def put(self, view: memoryview) -> None:
        self._queue.put(view)

    def close(self) -> None:
        """No more buffers: the transfer ends once it has filled those already handed over."""
        self._queue.put(None)

    def take(self, timeout: float) -> memoryview | None:
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None


class _Transfer:
    """What the attempts of one ``read_into`` share: where to resume, and a stop flag."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        targets: Targets,
        filled: Callable[[int], None],
        pos: int,
        end: int,
        idle: float,
        inspect: Callable[[memoryview], None] | None = None,
    ) -> None:
        self.loop = loop
        self.targets = targets
        self.filled = filled
        self.inspect = inspect
        self.pos = pos  # where the current (or next) buffer starts in the object
        self.end = end
        self.idle = idle
        self.current: memoryview | None = None  # a buffer being filled; refilled on retry
        self.count = 0  # buffers filled
        self.over = False  # no more buffers will come
        self.stop = False


def _post(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    """``fn(*args)`` on ``loop`` from another thread; nothing if the loop has closed."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(fn, *args)


def _layers(body: Any) -> tuple[Any, http.client.HTTPResponse | None]:
    """The urllib3 response under a botocore streaming body, and the standard library's
    ``http.client.HTTPResponse`` under that (None where the HTTP stack is another)."""
    raw = getattr(body, "_raw_stream", None)
    fp = getattr(raw, "_fp", None)
    return raw, fp if isinstance(fp, http.client.HTTPResponse) else None


def _finish(body: Any) -> None:
    """Done with a streamed body: its connection goes back to the pool when the body was read
    to its end (what urllib3 does itself when its own ``read`` reaches the end), else closed.
    Reusing the connection matters: a new one per GET costs a handshake (TLS on real S3) and
    starts in TCP slow start."""
    raw, fp = _layers(body)
    if fp is not None and fp.isclosed() and fp.length == 0:
        raw.release_conn()
    else:
        body.close()


def _receiver(body: Any) -> Callable[[memoryview], int]:
    """``readinto`` for a botocore streaming body.

    urllib3's own ``readinto`` reads a new ``bytes`` and copies it; under it sits the
    standard library's ``http.client.HTTPResponse``, whose ``readinto`` is ``recv_into``
    straight into the caller's buffer. That one is used when the body is plain (no
    content-encoding, not chunked); anything else goes through urllib3's copy.
    """
    raw, fp = _layers(body)
    headers = getattr(raw, "headers", {}) or {}
    if fp is not None and not fp.chunked and not headers.get("Content-Encoding"):
        return fp.readinto

    def copy(view: memoryview) -> int:
        data: bytes = body.read(min(view.nbytes, 1 << 20))
        view[: len(data)] = data
        return len(data)

    return copy


_RETRIABLE_STATUS = {429, 500, 502, 503, 504}
MAX_DELETE_KEYS = 1000
"""S3's limit of keys per ``DeleteObjects`` request."""
_RETRIABLE_CODES = {
    "SlowDown",
    "Throttling",
    "RequestTimeout",
    "InternalError",
    "ServiceUnavailable",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class ObjectStoreConfig:
    bucket: str
    endpoint_url: str | None = None
    region: str | None = None
    prefix: str = ""
    request_timeout: float = 10.0
    connect_timeout: float = 2.0
    max_attempts: int = 5
    backoff_base: float = 0.1
    backoff_max: float = 2.0
    max_workers: int = 8
    multipart_part_bytes: int = 64 << 20


class Backoff:
    """Full jitter: a random delay in ``[0, min(maximum, base * 2**attempt)]`` seconds."""

    def __init__(self, base: float, maximum: float, rng: random.Random | None = None) -> None:
        self.base = base
        self.maximum = maximum
        self._rng = rng or random.Random()

    def __call__(self, attempt: int) -> float:
        return float(self._rng.random() * min(self.maximum, self.base * (2 ** min(attempt, 30))))


def _translate(exc: BaseException, what: str) -> ObjectStoreError:
    if isinstance(exc, botocore.exceptions.ClientError):
        err = exc.response.get("Error", {})
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        code = str(err.get("Code", ""))
        if status == 412 or code == "PreconditionFailed":
            return ObjectExistsError(f"{what}: key already exists (412)")
        if status == 404 or code in {"NoSuchKey", "NotFound", "404"}:
            return ObjectNotFoundError(f"{what}: not found")
        out = ObjectStoreError(f"{what}: {status} {code} {err.get('Message', '')}".strip())
        out.retry = status in _RETRIABLE_STATUS or code in _RETRIABLE_CODES  # type: ignore[attr-defined]
        return out
    if isinstance(exc, TimeoutError):
        out = ObjectStoreError(f"{what}: deadline passed")
    else:
        out = ObjectStoreError(f"{what}: {type(exc).__name__}: {exc}")
    out.retry = isinstance(  # type: ignore[attr-defined]
        exc,
        TimeoutError
        | botocore.exceptions.ConnectionError
        | botocore.exceptions.HTTPClientError
        | botocore.exceptions.ResponseStreamingError
        | aiohttp.ClientError
        | ConnectionError,
    )
    return out


class ObjectStore:
    """Async S3 operations with deadlines, retries and typed errors."""

    def __init__(
        self,
        config: ObjectStoreConfig,
        *,
        backoff: Callable[[int], float] | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.config = config
        self.bucket = config.bucket
        self._backoff = backoff or Backoff(config.backoff_base, config.backoff_max)
        self._sleep = sleep
        self._pool = ThreadPoolExecutor(config.max_workers, thread_name_prefix="s3")
        #: boto3, for the streamed reads only (see the module docstring)
        self._client: Any = self._new_client(config.request_timeout)
        self._session = aioboto3.Session()
        self._clients = contextlib.AsyncExitStack()
        self._aio: Any = None
        # CompleteMultipartUpload: the store assembles the whole object before it answers
        # (S3 may take many seconds, moto much longer), so its socket read timeout cannot be
        # the per-request one; its attempt deadline still scales with the object's size
        self._slow_aio: Any = None
        self.requests: dict[str, int] = {}

    def _new_client(self, read_timeout: float) -> Any:
        config = self.config
        return boto3.session.Session().client(
            "s3",
            endpoint_url=config.endpoint_url,
            region_name=config.region,
            config=BotoConfig(
                connect_timeout=config.connect_timeout,
                read_timeout=read_timeout,
                retries={"total_max_attempts": 1},
                max_pool_connections=config.max_workers,
                s3={"addressing_style": "path"},
            ),
        )

    async def _new_aio(self, read_timeout: float) -> Any:
        config = self.config
        return await self._clients.enter_async_context(
            self._session.client(
                "s3",
                endpoint_url=config.endpoint_url,
                region_name=config.region,
                config=AioConfig(
                    connect_timeout=config.connect_timeout,
                    read_timeout=read_timeout,
                    retries={"total_max_attempts": 1},
                    max_pool_connections=config.max_workers,
                    s3={"addressing_style": "path"},
                ),
            )
        )

    async def _aio_client(self) -> Any:
        if self._aio is None:
            self._aio = await self._new_aio(self.config.request_timeout)
        return self._aio

    async def start(self) -> None:
        """Make the aioboto3 client now: botocore loads the S3 service model as it does, a few
        hundred milliseconds in which the event loop runs nothing else (so: before serving)."""
        await self._aio_client()

    async def close(self) -> None:
        """Release both clients (the aioboto3 one on the loop it was made on)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()
        self._aio = self._slow_aio = None
        await self._clients.aclose()

    async def _acall(
        self, what: str, make: Callable[[Any], Awaitable[T]], *, attempt_s: float | None = None
    ) -> T:
        """``make(client)`` (an aioboto3 call) with the deadline, retries and typed errors."""
        deadline = attempt_s or self.config.request_timeout
        attempt = 0
        while True:
            op = what.split(" ", 1)[0]
            self.requests[op] = self.requests.get(op, 0) + 1
            try:
                client = await self._aio_client()
                async with asyncio.timeout(deadline):
                    return await make(client)
            except (ObjectStoreError, asyncio.CancelledError):
                raise
            except Exception as exc:
                err = _translate(exc, what)
            attempt = await self._next_attempt(err, attempt)

    async def _next_attempt(self, err: ObjectStoreError, attempt: int) -> int:
        """Back off before the attempt after ``attempt``, or raise ``err`` when it is final."""
        if not getattr(err, "retry", False) or attempt + 1 >= self.config.max_attempts:
            raise err
        await self._sleep(self._backoff(attempt))
        return attempt + 1

    # ---- operations ---------------------------------------------------------------------------
    async def put_if_absent(self, key: str, body: bytes) -> None:
        """Create ``key`` with ``body``; ``ObjectExistsError`` if the key exists (HTTP 412)."""
        await self._acall(
            f"PUT {key}",
            lambda c: c.put_object(Bucket=self.bucket, Key=key, Body=body, IfNoneMatch="*"),
            attempt_s=self._timeout_for(len(body)),
        )

    async def put(self, key: str, body: bytes) -> None:
        """Create or overwrite ``key`` (manifest snapshots; segments use ``put_if_absent``)."""
        await self._acall(
            f"PUT {key}",
            lambda c: c.put_object(Bucket=self.bucket, Key=key, Body=body),
            attempt_s=self._timeout_for(len(body)),
        )

    async def put_multipart_if_absent(
        self, key: str, size: int, read_part: Callable[[int, int], Awaitable[bytes]]
    ) -> int:
        """Upload ``size`` bytes in parts (``read_part(start, end)``), create-only. Returns parts.

        One part is in memory at a time. A failed upload is aborted (best effort; an
        unfinished multipart upload is invisible to readers and expires by bucket lifecycle).
        """
        part_bytes = self.config.multipart_part_bytes
        created = await self._acall(
            f"POST {key} create-multipart",
            lambda c: c.create_multipart_upload(Bucket=self.bucket, Key=key),
        )
        upload_id = created["UploadId"]
        parts = []
        try:
            for number, start in enumerate(range(0, size, part_bytes), start=1):
                body = await read_part(start, min(size, start + part_bytes))

                def upload(c: Any, body: bytes = body, number: int = number) -> Awaitable[Any]:
                    return c.upload_part(  # type: ignore[no-any-return]
                        Bucket=self.bucket,
                        Key=key,
                        UploadId=upload_id,
                        PartNumber=number,
                        Body=body,
                    )

                result = await self._acall(
                    f"PUT {key} part {number}", upload, attempt_s=self._timeout_for(len(body))
                )
                parts.append({"ETag": result["ETag"], "PartNumber": number})
                del body
            if self._slow_aio is None:
                self._slow_aio = await self._new_aio(self._timeout_for(5 << 30))
            slow = self._slow_aio
            await self._acall(
                f"POST {key} complete-multipart",
                lambda _c: slow.complete_multipart_upload(
                    Bucket=self.bucket,
                    Key=key,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": parts},
                    IfNoneMatch="*",
                ),
                # the store assembles the whole object before it answers: scale the deadline
                # with the size, or every large upload times out and is redone from scratch
                attempt_s=self._timeout_for(size),
            )
        except BaseException:
            with contextlib.suppress(Exception):
                await self._acall(
                    f"DELETE {key} abort-multipart",
                    lambda c: c.abort_multipart_upload(
                        Bucket=self.bucket, Key=key, UploadId=upload_id
                    ),
                )
            raise
        return len(parts)

    async def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``key`` (``start < 0``: the last ``-start`` bytes)."""
        # a suffix range is "bytes=-N"; "bytes=-N-" is malformed and S3 answers the whole object
        rng = f"bytes={start}" if start < 0 else f"bytes={start}-{end - 1}"

        async def get(c: Any) -> bytes:
            resp = await c.get_object(Bucket=self.bucket, Key=key, Range=rng)
            async with resp["Body"] as body:
                data: bytes = await body.read()
            return data

        size = end - start if start >= 0 else -start
        return await self._acall(f"GET {key} {rng}", get, attempt_s=self._timeout_for(size))

    async def read_into(
        self,
        key: str,
        start: int,
        end: int,
        targets: Targets,
        filled: Callable[[int], None],
        released: Callable[[], None],
        *,
        idle: float = 2.0,
        whole: bool = False,
        inspect: Callable[[memoryview], None] | None = None,
    ) -> None:
        """Stream bytes from ``start`` (up to ``end``) of ``key`` into the buffers ``targets``
        hands over, in order, with one GET per attempt. ``whole``: ``[start, end)`` is the whole
        object (``start`` 0, ``end`` its size), asked for without a ``Range`` (an S3
        implementation may serve a range by slicing the whole object first) and refused unless
        the object is ``end`` bytes long; a retry resumes with a range. ``inspect(buffer)`` runs
        on the worker thread on each buffer once it holds its bytes, before ``filled`` is posted
        (while the bytes are likely still in the CPU's cache).

        The transfer waits up to ``idle`` seconds for each next buffer, so a sequential reader
        hands buffers over as it makes room and one long GET serves its whole catch-up (TCP
        flow control pauses the sender meanwhile); it ends at ``end``, when ``targets`` is
        closed, or when no buffer comes in time. ``filled(i)`` runs on the event loop once the
        ``i``-th buffer holds its bytes; the body is received straight into the buffers
        (``recv_into``) where the HTTP stack allows it. A retried attempt resumes at the first
        buffer not filled yet. Deadlines: the socket's read timeout, and each buffer must be
        filled within the time its size allows (a trickling connection is a timeout too).

        ``released()`` runs on the event loop exactly once, as soon as no worker thread can
        write into a buffer any more — before this returns or raises, or, when the caller is
        cancelled mid-transfer, once the worker notices (within one socket read): only then
        may the caller reuse the buffers that were not filled.
        """
        loop = asyncio.get_running_loop()
        state = _Transfer(loop, targets, filled, start, end, idle, inspect)
        attempt = 0
        try:
            while not state.over and state.pos < end:
                what = f"GET {key} bytes={state.pos}-{end - 1}"
                self.requests["GET"] = self.requests.get("GET", 0) + 1
                worker = loop.run_in_executor(self._pool, self._receive, key, state, whole)
                try:
                    await asyncio.shield(worker)
                    continue
                except asyncio.CancelledError:
                    state.stop = True

                    def done(_: object, later: Callable[[], None] = released) -> None:
                        later()

                    worker.add_done_callback(done)
                    released = _nothing
                    raise
                except Exception as exc:
                    err = _translate(exc, what)
                attempt = await self._next_attempt(err, attempt)
        finally:
            released()

    def _receive(self, key: str, state: _Transfer, whole: bool) -> None:
        """One attempt of ``read_into``, on a worker thread."""
        if state.current is None:  # wait for a buffer before opening a connection
            state.current = state.targets.take(state.idle)
            if state.current is None:
                state.over = True
                return
        first, last = state.pos, state.end - 1
        if whole and first == 0:
            resp = self._client.get_object(Bucket=self.bucket, Key=key)
            asked, got = f"{state.end} bytes", resp.get("ContentLength")
            ok = got == state.end
        else:
            rng = f"bytes={first}-{last}"
            resp = self._client.get_object(Bucket=self.bucket, Key=key, Range=rng)
            asked, got = rng, str(resp.get("ContentRange", ""))
            # S3 answers a range it cannot serve with the whole object (200, no range)
            ok = got.startswith(f"bytes {first}-{last}/")
        body = resp["Body"]
        try:
            if not ok:
                raise ObjectStoreError(f"GET {key}: asked {asked}, got {got!r}")
            receive = _receiver(body)
            while True:
                view = state.current
                if view is None:
                    view = state.current = state.targets.take(state.idle)
                    if view is None:
                        state.over = True
                        return
                if view.nbytes > state.end - state.pos:
                    raise ValueError(f"a {view.nbytes}-byte buffer past the range's end")
                deadline = time.monotonic() + self._timeout_for(view.nbytes)
                got = 0
                while got < view.nbytes:
                    if state.stop:
                        return
                    n = receive(view[got:])
                    if n == 0:
                        raise botocore.exceptions.ResponseStreamingError(
                            error=f"body ended at {state.pos + got} of {state.end}"
                        )
                    got += n
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{got} of {view.nbytes} bytes by the deadline")
                state.pos += got
                state.current = None
                if state.inspect is not None:
                    state.inspect(view)
                _post(state.loop, state.filled, state.count)
                state.count += 1
                if state.pos >= state.end:
                    return
        finally:
            _finish(body)

    async def delete(self, key: str) -> None:
        await self._acall(f"DELETE {key}", lambda c: c.delete_object(Bucket=self.bucket, Key=key))

    async def delete_many(self, keys: Sequence[str]) -> None:
        """Delete up to ``MAX_DELETE_KEYS`` keys with one ``DeleteObjects`` request.

        A key that does not exist counts as deleted (S3's rule). Keys the store reports as
        not deleted are sent again, with the same deadline, backoff and attempts as any call,
        while their errors are retriable; then ``ObjectStoreError`` names how many are left.
        """
        if len(keys) > MAX_DELETE_KEYS:
            raise ValueError(f"{len(keys)} keys: DeleteObjects takes at most {MAX_DELETE_KEYS}")
        pending = list(keys)
        attempt = 0
        while pending:
            batch = [{"Key": k} for k in pending]

            async def run(c: Any, batch: list[dict[str, str]] = batch) -> list[dict[str, Any]]:
                resp = await c.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}
                )
                errors: list[dict[str, Any]] = resp.get("Errors", [])
                return errors

            what = f"DELETEOBJECTS {len(pending)} keys from {pending[0]}"
            errors = await self._acall(what, run, attempt_s=self._timeout_for(len(pending) * 200))
            if not errors:
                return
            pending = [str(e.get("Key")) for e in errors]
            first = errors[0]
            err = ObjectStoreError(
                f"{what}: {len(pending)} not deleted ({first.get('Code')}: {first.get('Message')})"
            )
            err.retry = any(str(e.get("Code")) in _RETRIABLE_CODES for e in errors)  # type: ignore[attr-defined]
            attempt = await self._next_attempt(err, attempt)

    async def list_keys(self, prefix: str, *, max_keys: int = 1000, after: str = "") -> list[str]:
        """Up to ``max_keys`` keys under ``prefix`` in key order, from after ``after``: one
        LIST request (so a caller walking a huge prefix holds one page at a time)."""

        async def run(c: Any) -> list[str]:
            extra = {"StartAfter": after} if after else {}
            resp = await c.list_objects_v2(
                Bucket=self.bucket, Prefix=prefix, MaxKeys=max_keys, **extra
            )
            return [str(o["Key"]) for o in resp.get("Contents", [])]

        return await self._acall(f"LIST {prefix}", run)

    async def count(self, prefix: str, *, page_keys: int = 1000) -> int:
        """How many objects are under ``prefix`` (page by page, each with its deadline)."""
        total, after = 0, ""
        while True:
            page = await self.list_keys(prefix, max_keys=page_keys, after=after)
            total += len(page)
            if len(page) < page_keys:
                return total
            after = page[-1]

    async def list(self, prefix: str) -> list[tuple[str, int, float]]:
        """(key, size, last-modified epoch seconds) of every object under ``prefix``."""

        async def run(c: Any) -> list[tuple[str, int, float]]:
            out = []
            pages = c.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
            async for page in pages:
                for o in page.get("Contents", []):
                    out.append((o["Key"], int(o["Size"]), o["LastModified"].timestamp()))
            return out

        return await self._acall(f"LIST {prefix}", run, attempt_s=self.config.request_timeout * 3)

    def _timeout_for(self, size: int) -> float:
        # a large transfer gets extra time at a pessimistic 8 MB/s, never less than the base
        return self.config.request_timeout + size / (8 << 20)
