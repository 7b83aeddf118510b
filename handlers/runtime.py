"""The process-wide runtime of the handlers: one event loop and one ZooKeeper session.

A Lambda execution environment (and the local runtime) keeps the process alive between
invocations, so the expensive parts live at module level and are reused, created on first
use:

* one asyncio event loop, running for good in a daemon thread (``strata-handlers``). Handler
  code runs on whatever thread invokes it and hands coroutines to the loop with
  ``run_coroutine_threadsafe`` — never ``asyncio.run`` per call, which would build a loop and a
  ZooKeeper session every time;
* one :class:`AsyncZooKeeper` session and its :class:`MetadataStore`, connected on the loop
  the first time a coroutine needs it. A failed connect is not remembered: the next call tries
  again. Once connected, kazoo reconnects by itself (a suspended or expired session comes back
  on its own); calls made meanwhile fail with ``MetadataUnavailableError`` (503).

Every call has a deadline: :class:`Invocation` takes the smaller of ``call_timeout`` and what
the Lambda context says is left (minus a margin to answer in). At the deadline the coroutine
is cancelled and the caller gets ``RequestTimedOutError``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from handlers.http import InternalError
from storage.errors import MetadataError, RequestTimedOutError
from storage.metadata import AsyncZooKeeper, MetadataStore

log = logging.getLogger(__name__)

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

ZOOKEEPER_ENV = "STRATA_ZOOKEEPER_CONNECT"
NATIVE_RECORDS = "strataRecords"
"""The event key under which the event-source runner (``infra.event_source``) hands a batch,
as the SDK read it (``ConsumerRecord`` lists by ``TopicPartition``), to a function marked
:func:`takes_native_records`, instead of Lambda's ``records`` (base64 keys and values, each
header value a list of ints): in the same process there is nothing to serialise. Such a
function still reads Lambda's event when it runs on Lambda."""


def takes_native_records(function: F) -> F:
    """Mark ``function`` (a ``handler(event, context)``) as reading :data:`NATIVE_RECORDS`
    when the event has it."""
    function.strata_native_records = True  # type: ignore[attr-defined]
    return function


def wants_native_records(function: Callable[..., Any]) -> bool:
    return bool(getattr(function, "strata_native_records", False))


ANSWER_MARGIN = 0.25
"""Seconds kept back from the Lambda deadline to build and send the answer."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RuntimeConfig:
    zookeeper: str
    """``host:port[,host:port...][/chroot]``."""
    session_timeout: float = 10.0
    connect_timeout: float = 5.0
    request_timeout: float = 5.0
    """Deadline of one ZooKeeper request."""
    call_timeout: float = 10.0
    """Deadline of one handler's whole metadata work (connect included)."""

    def __post_init__(self) -> None:
        if not self.zookeeper.strip():
            raise InternalError(f"{ZOOKEEPER_ENV} is empty")
        for name in ("session_timeout", "connect_timeout", "request_timeout", "call_timeout"):
            if not getattr(self, name) > 0:
                raise InternalError(f"handler runtime: {name} must be positive")

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> RuntimeConfig:
        """``STRATA_ZOOKEEPER_CONNECT`` (required); ``STRATA_ZOOKEEPER_SESSION_TIMEOUT_MS``,
        ``STRATA_ZOOKEEPER_CONNECT_TIMEOUT_MS``, ``STRATA_ZOOKEEPER_REQUEST_TIMEOUT_MS``,
        ``STRATA_HANDLER_CALL_TIMEOUT_MS`` (optional).
        """
        connect = env.get(ZOOKEEPER_ENV)
        if not connect:
            raise InternalError(f"{ZOOKEEPER_ENV} is not set: the handlers cannot reach ZooKeeper")

        def seconds(key: str, default: float) -> float:
            text = env.get(key)
            if text is None:
                return default
            try:
                return int(text) / 1000
            except ValueError:
                raise InternalError(f"{key}={text!r} is not a number of milliseconds") from None

        return cls(
            zookeeper=connect,
            session_timeout=seconds("STRATA_ZOOKEEPER_SESSION_TIMEOUT_MS", 10.0),
            connect_timeout=seconds("STRATA_ZOOKEEPER_CONNECT_TIMEOUT_MS", 5.0),
            request_timeout=seconds("STRATA_ZOOKEEPER_REQUEST_TIMEOUT_MS", 5.0),
            call_timeout=seconds("STRATA_HANDLER_CALL_TIMEOUT_MS", 10.0),
        )


class Runtime:
    """An event loop in a daemon thread and one lazily connected ZooKeeper session."""

    def __init__(self, config: RuntimeConfig) -> None:
        self.config = config
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="strata-handlers", daemon=True
        )
        self._thread.start()
        self._zk: AsyncZooKeeper | None = None
        self._store: MetadataStore | None = None
        self._connecting: asyncio.Lock | None = None
        self._closed = False

    def call(self, fn: Callable[[MetadataStore], Awaitable[T]], *, timeout: float) -> T:
        """Run ``fn(store)`` on the loop and wait at most ``timeout`` s for its result."""
        if self._closed:
            raise InternalError("the handler runtime is closed")
        if timeout <= 0:
            raise RequestTimedOutError("no time left for the request")
        future = asyncio.run_coroutine_threadsafe(self._run(fn), self._loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise RequestTimedOutError(
                f"the request did not finish within {timeout:.1f} s"
            ) from None

    async def _run(self, fn: Callable[[MetadataStore], Awaitable[T]]) -> T:
        return await fn(await self.store())

    async def store(self) -> MetadataStore:
        """The connected store (connecting first if need be); runs on the loop."""
        if self._store is not None:
            return self._store
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._store is None:
                zk = AsyncZooKeeper(
                    self.config.zookeeper,
                    session_timeout=self.config.session_timeout,
                    connect_timeout=self.config.connect_timeout,
                    request_timeout=self.config.request_timeout,
                )
                await zk.start()
                store = MetadataStore(zk)
                try:
                    await store.init()
                except BaseException:
                    await zk.stop()
                    raise
                self._zk, self._store = zk, store
                log.info("handler runtime connected to ZooKeeper %s", self.config.zookeeper)
        return self._store

    @property
    def session_id(self) -> int | None:
        """The ZooKeeper session id (None before the first connect)."""
        return None if self._zk is None else self._zk.session_id

    def close(self, timeout: float = 5.0) -> None:
        """Close the ZooKeeper session, stop the loop and join its thread."""
        if self._closed:
            return
        self._closed = True
        if self._zk is not None:
            stopping = asyncio.run_coroutine_threadsafe(self._zk.stop(), self._loop)
            with contextlib.suppress(concurrent.futures.TimeoutError, MetadataError):
                stopping.result(timeout)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._loop.close()


_shared: Runtime | None = None
_shared_lock = threading.Lock()


def shared_runtime() -> Runtime:
    """The process's runtime, created from the environment on first use."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = Runtime(RuntimeConfig.from_env())
        return _shared


def close_shared_runtime() -> None:
    """Close the process's runtime (tests; the local runtime at shutdown). The next use
    creates a new one, reading the environment again."""
    global _shared
    with _shared_lock:
        runtime, _shared = _shared, None
    if runtime is not None:
        runtime.close()


class Invocation:
    """One handler invocation's deadline, and the way to run metadata work within it."""

    def __init__(self, context: Any, *, runtime: Callable[[], Runtime] = shared_runtime) -> None:
        self._runtime = runtime
        self._started = time.monotonic()
        self._lambda_budget: float | None = None
        remaining = getattr(context, "get_remaining_time_in_millis", None)
        if callable(remaining):
            with contextlib.suppress(TypeError, ValueError):
                self._lambda_budget = float(remaining()) / 1000 - ANSWER_MARGIN

    def budget(self) -> float:
        """Seconds left for this invocation's metadata work."""
        budget = self._runtime().config.call_timeout
        if self._lambda_budget is not None:
            budget = min(budget, self._lambda_budget)
        return budget - (time.monotonic() - self._started)

    def run(self, fn: Callable[[MetadataStore], Awaitable[T]]) -> T:
        return self._runtime().call(fn, timeout=self.budget())
