"""The one asyncio adapter over kazoo (ZooKeeper).

kazoo runs its own threads; everything it reports is bridged into the event loop here and
nowhere else:

* every ``*_async`` call becomes an awaitable with a deadline (``request_timeout``);
* kazoo exceptions are translated at this boundary into ``storage.errors`` types
  (``NodeNotFoundError``, ``NodeExistsError``, ``VersionConflictError``,
  ``MetadataUnavailableError``);
* connection state changes are delivered on the loop. The rule for callers (STYLE point 7):
  ``SUSPENDED`` means "stop acting as a leader until reconnected" — the session may already
  be gone; ``LOST`` means the session expired and every ephemeral node of ours is deleted;
  ``CONNECTED`` after ``SUSPENDED`` means the session survived;
* watches (``watch_children`` / ``watch_data``) use kazoo's ChildrenWatch / DataWatch recipes,
  which re-arm themselves, and call their callback on the loop;
* many nodes at once (``get_many``, ``watch_data_many``, chunked ``transaction``s in the
  store): every request is sent before any answer is awaited. ZooKeeper answers a session's
  requests in order on one connection, so N reads cost about one round trip plus the
  server's work, not N round trips (10,000 partition states: a fraction of a second instead
  of ten). kazoo's DataWatch would instead block the calling thread on one read per watch;
* with credentials (``auth``, or ``STRATA_ZOOKEEPER_AUTH=user:password`` in the environment,
  so that agents, handlers, the CLI and the Spark driver all pick them up), the session
  authenticates with ZooKeeper's ``digest`` scheme and every znode it creates carries an ACL
  that gives that user alone every right: a client without them can neither read nor change
  the cluster's state (docs/security.md, "ZooKeeper").
"""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import (
    EXCEPTIONS,
    BadVersionError,
    ConnectionLoss,
    KazooException,
    NoAuthError,
    NoNodeError,
    NotEmptyError,
    OperationTimeoutError,
    RolledBackError,
    RuntimeInconsistency,
    SessionExpiredError,
    UnimplementedError,
)
from kazoo.exceptions import (
    NodeExistsError as KazooNodeExists,
)
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.protocol.serialization import (
    GetData,
    MultiHeader,
    int_struct,
    multiheader_struct,
    read_buffer,
    stat_struct,
)
from kazoo.protocol.states import KazooState, WatchedEvent, ZnodeStat
from kazoo.security import ACL, make_digest_acl

from storage.errors import (
    InvalidConfigError,
    MetadataError,
    MetadataUnavailableError,
    NodeExistsError,
    NodeNotFoundError,
    VersionConflictError,
)

log = logging.getLogger(__name__)
MANY_IN_FLIGHT = 1024
"""Nodes ``get_many`` reads per request (its answers are held until all are in)."""


class MultiRead:
    """ZooKeeper's ``multiRead`` request (opcode 22, servers 3.6 and later): many ``getData``
    in one request, one answer each, in order. kazoo has the framing (``MultiHeader``) but not
    this request; it sends any object with ``type``, ``serialize`` and ``deserialize``.

    Request: per read ``MultiHeader(4 = getData, done=false, err=-1)`` and a ``GetData``
    (path, watch=false), then ``MultiHeader(-1, done=true, -1)``. Answer: per read a
    ``MultiHeader``, then the data buffer and a ``Stat`` for a getData, or an ``int`` error
    code for type -1; a ``done`` header ends it. A node that does not exist answers
    ``NoNodeError()`` in its place (``kazoo.exceptions.EXCEPTIONS[code]``), not a failure of
    the whole request.
    """

    type = 22

    def __init__(self, paths: Sequence[str]) -> None:
        self.paths = paths

    def serialize(self) -> bytearray:
        b = bytearray()
        head = MultiHeader(GetData.type, False, -1).serialize()
        for path in self.paths:
            b += head
            b += GetData(path, None).serialize()
        b += multiheader_struct.pack(-1, True, -1)
        return b

    @classmethod
    def deserialize(cls, data: bytes, offset: int) -> list[Any]:
        out: list[Any] = []
        while True:
            kind, done, _ = multiheader_struct.unpack_from(data, offset)
            offset += multiheader_struct.size
            if done:
                return out
            if kind == GetData.type:
                value, offset = read_buffer(data, offset)
                out.append((value, ZnodeStat._make(stat_struct.unpack_from(data, offset))))
                offset += stat_struct.size
            else:  # -1: an error code
                (code,) = int_struct.unpack_from(data, offset)
                offset += int_struct.size
                out.append(EXCEPTIONS[code]())


# kazoo warns when the chroot does not exist yet; ``start`` creates it right after connecting
warnings.filterwarnings("ignore", message="No chroot path exists", category=UserWarning)


class SessionState(enum.Enum):
    CONNECTED = "connected"
    SUSPENDED = "suspended"
    LOST = "lost"


AUTH_ENV = "STRATA_ZOOKEEPER_AUTH"
"""``user:password``: the digest credentials of every ZooKeeper session of this process."""


def digest_credentials(value: str | None) -> tuple[str, str] | None:
    """``user:password`` as a pair; ``None`` for no credentials (unset or empty)."""
    if not value:
        return None
    user, sep, password = value.partition(":")
    if not sep or not user or not password:
        raise InvalidConfigError(
            f"{AUTH_ENV} must be user:password (both non-empty); got a value without them"
        )  # never the value itself: it is a secret
    return user, password


def kazoo_client(hosts: str, *, timeout: float, auth: str | None = None, **kw: Any) -> KazooClient:
    """A ``KazooClient`` with this process's credentials (``auth``, else ``STRATA_ZOOKEEPER_AUTH``)
    and, with them, the ACL every node it creates gets: all rights to that user, none to
    anyone else."""
    credentials = digest_credentials(auth if auth is not None else os.environ.get(AUTH_ENV))
    acl: list[ACL] | None = None
    auth_data: list[tuple[str, str]] | None = None
    if credentials is not None:
        user, password = credentials
        acl = [make_digest_acl(user, password, all=True)]
        auth_data = [("digest", f"{user}:{password}")]
    return KazooClient(hosts=hosts, timeout=timeout, auth_data=auth_data, default_acl=acl, **kw)


def translate(exc: BaseException, what: str) -> MetadataError:
    if isinstance(exc, NoAuthError):
        return MetadataError(
            f"{what}: ZooKeeper refused it (NoAuth): this session lacks the credentials the"
            f" node's ACL asks for (set {AUTH_ENV})"
        )
    if isinstance(exc, NoNodeError):
        return NodeNotFoundError(f"{what}: no such node")
    if isinstance(exc, KazooNodeExists):
        return NodeExistsError(f"{what}: node exists")
    if isinstance(exc, BadVersionError):
        return VersionConflictError(f"{what}: version changed under us")
    if isinstance(exc, NotEmptyError):
        return MetadataError(f"{what}: node has children")
    if isinstance(
        exc,
        (
            ConnectionLoss,
            SessionExpiredError,
            OperationTimeoutError,
            KazooTimeoutError,
            TimeoutError,
        ),
    ):
        return MetadataUnavailableError(f"{what}: ZooKeeper unavailable ({type(exc).__name__})")
    if isinstance(exc, KazooException):
        return MetadataError(f"{what}: {type(exc).__name__}: {exc}")
    return MetadataError(f"{what}: {exc!r}")


class AsyncZooKeeper:
    """An asyncio face for one ZooKeeper session (``hosts`` may end in a chroot path)."""

    def __init__(
        self,
        hosts: str,
        *,
        session_timeout: float = 10.0,
        connect_timeout: float = 15.0,
        request_timeout: float = 10.0,
        auth: str | None = None,
    ) -> None:
        """``auth``: ``user:password`` (default: ``STRATA_ZOOKEEPER_AUTH``, if set)."""
        self.hosts = hosts
        self.request_timeout = request_timeout
        self.connect_timeout = connect_timeout
        self.client = kazoo_client(
            hosts,
            timeout=session_timeout,
            auth=auth,
            connection_retry={"max_tries": -1, "max_delay": 1.0},
        )
        self.state = SessionState.LOST
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listeners: list[Callable[[SessionState], None]] = []
        self.connected = asyncio.Event()
        self._multi_read = True

    # ---- lifecycle --------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.client.add_listener(self._on_state)
        try:
            await asyncio.to_thread(self.client.start, self.connect_timeout)
        except BaseException as exc:  # e.g. NoAuth on the chroot, which kazoo looks at
            await asyncio.to_thread(self.client.stop)
            await asyncio.to_thread(self.client.close)  # its socket pair too
            raise translate(exc, f"connect to {self.hosts}") from exc
        self._set_state(SessionState.CONNECTED)
        # a chroot must exist before anything under it can be created
        chroot = self.client.chroot
        if chroot:
            self.client.chroot = ""
            try:
                await self._call(self.client.ensure_path_async(chroot), f"ensure {chroot}")
                await self._lock(chroot)
            except BaseException:  # e.g. NoAuth: no session is left running behind the error
                await self.stop()
                raise
            finally:
                self.client.chroot = chroot

    async def _lock(self, chroot: str) -> None:
        """With credentials: the chroot itself gets their ACL too (an operator may have made it
        open), or anyone could add nodes beside the cluster's own."""
        acl = self.client.default_acl
        if not acl:
            return
        current, _ = await self._call(self.client.get_acls_async(chroot), f"acls of {chroot}")
        if list(current) != list(acl):
            await self._call(self.client.set_acls_async(chroot, acl), f"lock {chroot}")
            log.info("ZooKeeper chroot %s locked to this cluster's credentials", chroot)

    async def stop(self) -> None:
        self.client.remove_listener(self._on_state)
        await asyncio.to_thread(self.client.stop)
        await asyncio.to_thread(self.client.close)
        self._set_state(SessionState.LOST)

    @property
    def session_id(self) -> int | None:
        sid = self.client.client_id
        return None if sid is None else int(sid[0])

    def add_state_listener(self, fn: Callable[[SessionState], None]) -> None:
        """``fn(state)`` is called on the event loop at every connection state change."""
        self._listeners.append(fn)

    def _on_state(self, state: str) -> None:  # kazoo thread
        mapped = {
            KazooState.CONNECTED: SessionState.CONNECTED,
            KazooState.SUSPENDED: SessionState.SUSPENDED,
            KazooState.LOST: SessionState.LOST,
        }[state]
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._set_state, mapped)

    def _set_state(self, state: SessionState) -> None:
        if state == self.state:
            return
        log.info("zookeeper session %s -> %s", self.state.value, state.value)
        self.state = state
        if state == SessionState.CONNECTED:
            self.connected.set()
        else:
            self.connected.clear()
        for fn in list(self._listeners):
            fn(state)

    # ---- calls ------------------------------------------------------------------------
    async def _call(self, result: Any, what: str) -> Any:
        """Await a kazoo IAsyncResult with the request deadline, translating errors."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()

        def done(r: Any) -> None:  # kazoo thread
            def settle() -> None:
                if fut.done():
                    return
                try:
                    fut.set_result(r.get_nowait())
                except BaseException as exc:
                    fut.set_exception(exc)

            if not loop.is_closed():
                loop.call_soon_threadsafe(settle)

        result.rawlink(done)
        try:
            # not ``asyncio.wait_for``: on 3.11 it returns the result, and loses the
            # cancellation, when the reply lands in the same turn as a cancel (gh-86296); a
            # stopping agent's controller then went on for good and the stop hung
            async with asyncio.timeout(self.request_timeout):
                return await fut
        except MetadataError:
            raise
        except (KazooException, TimeoutError, OSError) as exc:
            raise translate(exc, what) from exc

    async def get(self, path: str) -> tuple[bytes, ZnodeStat]:
        value: tuple[bytes, ZnodeStat] = await self._call(
            self.client.get_async(path), f"get {path}"
        )
        return value

    async def exists(self, path: str) -> ZnodeStat | None:
        stat: ZnodeStat | None = await self._call(self.client.exists_async(path), f"exists {path}")
        return stat

    async def get_children(self, path: str) -> list[str]:
        children: list[str] = await self._call(
            self.client.get_children_async(path), f"children {path}"
        )
        return children

    async def create(
        self,
        path: str,
        data: bytes = b"",
        *,
        ephemeral: bool = False,
        sequence: bool = False,
        makepath: bool = False,
    ) -> str:
        created: str = await self._call(
            self.client.create_async(
                path, data, ephemeral=ephemeral, sequence=sequence, makepath=makepath
            ),
            f"create {path}",
        )
        return created

    async def update(self, path: str, change: Callable[[bytes | None], bytes]) -> None:
        """Replace ``path``'s data by ``change(old)`` (``None``: no node yet, created), by
        compare-and-set: retried while another writer gets in between."""
        while True:
            try:
                data, stat = await self.get(path)
            except NodeNotFoundError:
                try:
                    await self.create(path, change(None), makepath=True)
                    return
                except NodeExistsError:
                    continue
            try:
                await self.set(path, change(data), stat.version)
                return
            except (VersionConflictError, NodeNotFoundError):
                continue

    async def set(self, path: str, data: bytes, version: int = -1) -> ZnodeStat:
        stat: ZnodeStat = await self._call(
            self.client.set_async(path, data, version), f"set {path}"
        )
        return stat

    async def delete(self, path: str, version: int = -1, *, recursive: bool = False) -> None:
        if recursive:
            try:
                async with asyncio.timeout(self.request_timeout * 3):
                    await asyncio.to_thread(self.client.delete, path, version, True)
            except (KazooException, TimeoutError) as exc:
                raise translate(exc, f"delete {path}") from exc
            return
        await self._call(self.client.delete_async(path, version), f"delete {path}")

    async def ensure_path(self, path: str) -> None:
        await self._call(self.client.ensure_path_async(path), f"ensure {path}")

    async def transaction(self, build: Callable[[Any], object]) -> list[Any]:
        """Run ``build(tx)`` (kazoo TransactionRequest ops) and commit atomically."""
        tx = self.client.transaction()
        build(tx)
        results: list[Any] = await self._call(tx.commit_async(), "transaction")
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            # the operations around the one that failed say only "rolled back"
            cause = [
                r for r in failed if not isinstance(r, (RolledBackError, RuntimeInconsistency))
            ]
            raise translate((cause or failed)[0], "transaction")
        return results

    async def get_many(self, paths: Sequence[str]) -> list[tuple[bytes, ZnodeStat] | None]:
        """Read every node of ``paths`` (None for one that does not exist), ``MANY_IN_FLIGHT``
        per ``MultiRead`` request: one round trip and one hand-over between kazoo's thread
        and the loop per request, where a ``get`` each costs both per node (about 0.2 ms of
        CPU each through kazoo's threads). A server without multiRead (before 3.6) gets the
        reads pipelined instead. Each request has the request deadline."""
        out: list[tuple[bytes, ZnodeStat] | None] = []
        for first in range(0, len(paths), MANY_IN_FLIGHT):
            window = paths[first : first + MANY_IN_FLIGHT]
            if self._multi_read:
                try:
                    got = await self._multi_get(window)
                except UnimplementedError:
                    self._multi_read = False
                    log.warning("this ZooKeeper has no multiRead: reading nodes one by one")
            if not self._multi_read:
                got = await asyncio.gather(*(self._get_or_none(p) for p in window))
            for path, r in zip(window, got, strict=True):
                if isinstance(r, NoNodeError):
                    out.append(None)
                elif isinstance(r, BaseException):
                    raise translate(r, f"get {path}")
                else:
                    out.append(r)
        return out

    async def _multi_get(self, paths: Sequence[str]) -> list[Any]:
        chroot = self.client.chroot
        result = self.client.handler.async_result()
        self.client._call(MultiRead([chroot + p for p in paths]), result)
        try:
            got: list[Any] = await self._call(result, f"get {len(paths)} nodes")
        except MetadataError as exc:
            if isinstance(exc.__cause__, UnimplementedError):
                raise exc.__cause__ from None
            raise
        return got

    async def _get_or_none(self, path: str) -> tuple[bytes, ZnodeStat] | NoNodeError:
        try:
            return await self.get(path)
        except NodeNotFoundError:
            return NoNodeError()

    # ---- watches ----------------------------------------------------------------------
    def watch_children(
        self, path: str, callback: Callable[[list[str]], None]
    ) -> Callable[[], None]:
        """Call ``callback(children)`` on the loop now and at every change; returns a canceller."""
        loop = asyncio.get_running_loop()
        active = [True]

        def on_change(children: list[str] | None) -> bool:  # kazoo thread
            if not active[0] or loop.is_closed():
                return False
            loop.call_soon_threadsafe(deliver, list(children or []))
            return True

        def deliver(children: list[str]) -> None:
            if active[0]:
                callback(children)

        self.client.ChildrenWatch(path, on_change, allow_session_lost=True)

        def cancel() -> None:
            active[0] = False

        return cancel

    def watch_data(
        self, path: str, callback: Callable[[bytes | None, ZnodeStat | None], None]
    ) -> Callable[[], None]:
        """Call ``callback(data, stat)`` on the loop now and at every change (None: no node)."""
        loop = asyncio.get_running_loop()
        active = [True]

        def on_change(data: bytes | None, stat: ZnodeStat | None, event: Any = None) -> bool:
            if not active[0] or loop.is_closed():
                return False
            loop.call_soon_threadsafe(deliver, data, stat)
            return True

        def deliver(data: bytes | None, stat: ZnodeStat | None) -> None:
            if active[0]:
                callback(data, stat)

        self.client.DataWatch(path, on_change)

        def cancel() -> None:
            active[0] = False

        return cancel

    def watch_data_many(
        self,
        paths: Sequence[str],
        callback: Callable[[str, bytes | None, ZnodeStat | None], None],
    ) -> Callable[[], None]:
        """``watch_data`` for many nodes at once: ``callback(path, data, stat)`` on the loop
        for each path now and at every change (None: no node). The first reads are
        pipelined (one round trip for all, where a DataWatch each would block the loop for
        one round trip per node). Returns a canceller for the whole group."""
        watches = _DataWatches(self.client, asyncio.get_running_loop(), callback)
        watches.start(paths)
        return watches.cancel


class _DataWatches:
    """Data watches on a group of nodes, re-armed by hand (kazoo's DataWatch, batched).

    Each node is read with a watch; a change event reads it again (with a new watch) and
    delivers the data; a node that does not exist gets an ``exists`` watch instead, which
    fires at its creation. A read that failed for a lost connection, and every node at each
    reconnection (after a session expiry the server has forgotten the watches), is read
    again once connected, as kazoo's DataWatch does. Everything kazoo calls here runs on its
    threads; the callback runs on the loop, in the order the answers came.

    Many nodes are first read in ``MultiRead`` requests of ``MANY_IN_FLIGHT`` (no watch) and
    delivered a request at a time; the watched reads sent right after them deliver only what
    changed since (another ``mzxid``). A restarted agent watching 10,000 partition states got
    them one watched read at a time, ~600 a second while it opened their logs: its hosting
    waited on kazoo's threads. ZooKeeper answers one session's requests in order, and kazoo
    runs the answers' callbacks on one thread in that order, so a node's batch read is
    delivered before its watched read is looked at.
    """

    def __init__(
        self,
        client: KazooClient,
        loop: asyncio.AbstractEventLoop,
        callback: Callable[[str, bytes | None, ZnodeStat | None], None],
    ) -> None:
        self.client = client
        self.loop = loop
        self.callback = callback
        self.active = True
        #: one watcher object per path: kazoo keeps a set of them, so a re-arm adds none
        self.watchers: dict[str, Callable[[WatchedEvent], None]] = {}
        #: the ``mzxid`` each node was delivered at by a batch read whose watched read has not
        #: answered yet (kazoo's callback thread only)
        self.batch_read: dict[str, int] = {}
        self.multi_read = True

    def start(self, paths: Sequence[str]) -> None:
        for path in paths:
            self.watchers[path] = functools.partial(self._event, path)
        self.client.add_listener(self._on_state)
        # sent from kazoo's thread: each request wakes its connection thread, which would
        # stall the loop for about 0.2 ms per node
        self.client.handler.spawn(self._read_all)

    def cancel(self) -> None:
        self.active = False
        self.client.remove_listener(self._on_state)

    def _on_state(self, state: str) -> None:  # kazoo thread
        if state == KazooState.CONNECTED and self.active:
            self.client.handler.spawn(self._read_all)

    def _read_all(self) -> None:
        paths = list(self.watchers)
        if self.multi_read and len(paths) > 1:
            chroot = self.client.chroot
            for first in range(0, len(paths), MANY_IN_FLIGHT):
                window = paths[first : first + MANY_IN_FLIGHT]
                result = self.client.handler.async_result()
                try:
                    self.client._call(MultiRead([chroot + p for p in window]), result)
                except KazooException:
                    return  # the client is closing
                result.rawlink(functools.partial(self._got_many, window))
        for path in paths:
            self._read(path)

    def _got_many(self, paths: list[str], result: Any) -> None:
        try:
            got = result.get_nowait()
        except UnimplementedError:  # a server before 3.6: the watched reads deliver it all
            self.multi_read = False
            return
        except KazooException:
            return  # the watched reads answer (or fail) the same way
        delivered = []
        for path, r in zip(paths, got, strict=True):
            if isinstance(r, BaseException):
                continue  # e.g. no such node: its watched read sets an ``exists`` watch
            data, stat = r
            self.batch_read[path] = stat.mzxid
            delivered.append((path, data, stat))
        self._deliver_many(delivered)

    def _read(self, path: str) -> None:
        if not self.active:
            return
        try:
            result = self.client.get_async(path, watch=self.watchers[path])
        except KazooException:  # e.g. the client is closing: nothing to watch any more
            return
        result.rawlink(functools.partial(self._got, path))

    def _event(self, path: str, event: WatchedEvent) -> None:
        self._read(path)

    def _got(self, path: str, result: Any) -> None:
        try:
            data, stat = result.get_nowait()
        except NoNodeError:
            try:
                exists = self.client.exists_async(path, watch=self.watchers[path])
            except KazooException:
                return
            exists.rawlink(functools.partial(self._exists, path))
            return
        except (ConnectionLoss, SessionExpiredError, KazooTimeoutError):
            return  # read again at the reconnection
        except KazooException as exc:
            log.warning("watch of %s: %s", path, translate(exc, f"get {path}"))
            return
        if self.batch_read.pop(path, None) == stat.mzxid:
            return  # delivered by the batch read, unchanged since
        self._deliver(path, data, stat)

    def _exists(self, path: str, result: Any) -> None:
        try:
            stat = result.get_nowait()
        except KazooException:
            return  # read again at the reconnection
        if stat is not None:
            self._read(path)  # created between the two requests
        else:
            self._deliver(path, None, None)

    def _deliver(self, path: str, data: bytes | None, stat: ZnodeStat | None) -> None:
        self._deliver_many([(path, data, stat)])

    def _deliver_many(self, items: list[tuple[str, bytes | None, ZnodeStat | None]]) -> None:
        if not items or not self.active or self.loop.is_closed():
            return

        def deliver() -> None:
            for path, data, stat in items:
                if self.active:
                    self.callback(path, data, stat)

        self.loop.call_soon_threadsafe(deliver)
