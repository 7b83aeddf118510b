"""Who is on the other end of a connection: SASL/SCRAM, or a client certificate.

One ``Session`` per connection, one ``Authenticator`` per agent, shared by both listeners:
the codecs hand it the SaslHandshake / SaslAuthenticate requests (Kafka's v1 exchange, the
same on the native protocol), and the server refuses every other request of a connection
that must authenticate and has not (``Session.pending``).

Principals are Kafka's: ``User:<name>`` after SCRAM, ``User:<common name>`` for a verified
client certificate (on an SSL listener, and on a SASL_SSL listener, where a verified
certificate stands in for SASL: agents reach each other that way), ``User:ANONYMOUS``
otherwise.

SCRAM (RFC 5802, RFC 7677) is ``scramp``'s. The agent holds only each user's verifier
(``storage.metadata.users``), read from ZooKeeper at each login (so a changed or deleted
credential counts at once). Replay: every exchange gets a fresh server nonce, and the client's
proof covers it, so a captured exchange sent again fails its proof.

Bounded work, so failed logins from one client do not slow anyone else:

* the SCRAM steps and the credential lookup run in a small thread pool
  (``sasl.max.concurrent.authentications`` at a time; more wait, at most
  ``4 x`` that many; beyond that a login is refused at once), never on the event loop;
* a failed login is answered only after ``connection.failed.authentication.delay.ms`` (that
  connection's task sleeps; nothing is held meanwhile), then the connection is closed;
* a connection has ``sasl.authentication.deadline.ms`` to finish authenticating, then it
  is closed (the server's idle watchdog);
* an unknown user gets a made-up verifier (a salt stable per name), so the exchange fails
  where a wrong password fails: the answers do not tell which names exist.

Passwords, proofs and nonces are never logged; a failure is logged with the peer and the
user name only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import hmac
import logging
import secrets
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from scramp import ScramException, ScramMechanism

from storage.errors import (
    AuthenticationFailedError,
    IllegalSaslStateError,
    MetadataUnavailableError,
    UnsupportedSaslMechanismError,
)
from storage.metadata.users import DEFAULT_ITERATIONS, MECHANISMS, ScramCredential
from storage.tls import principal_of

log = logging.getLogger(__name__)

ANONYMOUS = "User:ANONYMOUS"
CredentialLookup = Callable[[str], Coroutine[Any, Any, dict[str, ScramCredential] | None]]


@dataclass(frozen=True, slots=True, kw_only=True)
class AuthSettings:
    mechanisms: tuple[str, ...] = MECHANISMS
    max_concurrent: int = 2
    failure_delay_s: float = 0.1
    deadline_s: float = 10.0
    lookup_timeout_s: float = 5.0


@dataclass(slots=True)
class Session:
    """One connection's security state."""

    peer: Any
    sasl: bool  # the listener wants SASL
    principal: str = ANONYMOUS
    authenticated: bool = False
    deadline: float = 0.0  # loop time by which a pending session must be authenticated
    mechanism: str | None = None
    failed: bool = False  # a login failed: the connection is closed after the answer
    user: str = ""  # the SCRAM user name, once the first message named it
    _scram: Any = field(default=None, repr=False)
    _step: int = 0

    @property
    def pending(self) -> bool:
        return self.sasl and not self.authenticated


class Authenticator:
    def __init__(self, lookup: CredentialLookup, settings: AuthSettings | None = None) -> None:
        self.lookup = lookup
        self.settings = settings or AuthSettings()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.settings.max_concurrent, thread_name_prefix="sasl"
        )
        self._slots = asyncio.Semaphore(self.settings.max_concurrent * 4)
        self._secret = secrets.token_bytes(32)  # for made-up verifiers of unknown users
        #: counters for metrics and tests: logins that succeeded, failed, were turned away
        self.succeeded = 0
        self.failed = 0
        self.busy = 0
        self.in_pool = 0
        self.in_pool_peak = 0

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def session(self, peer: Any, *, sasl: bool, peercert: dict[str, Any] | None) -> Session:
        s = Session(peer, sasl)
        cn = principal_of(peercert)
        if cn is not None:  # verified by the TLS handshake
            s.principal, s.authenticated = f"User:{cn}", True
        if s.pending:
            s.deadline = asyncio.get_running_loop().time() + self.settings.deadline_s
        return s

    # ---- the exchange ----------------------------------------------------------------------
    def handshake(self, session: Session, mechanism: str) -> list[str]:
        """SaslHandshake: the mechanisms offered; raises for one not offered or out of order."""
        offered = list(self.settings.mechanisms)
        if not session.sasl or session.authenticated or session.mechanism is not None:
            session.failed = True
            raise IllegalSaslStateError("SaslHandshake is not expected on this connection now")
        if mechanism not in offered:
            session.failed = True
            raise UnsupportedSaslMechanismError(
                f"mechanism {mechanism!r} is not offered; offered: {', '.join(offered)}"
            )
        session.mechanism = mechanism
        return offered

    async def authenticate(self, session: Session, token: bytes) -> bytes:
        """One SaslAuthenticate step: the server's answer, or AuthenticationFailedError
        (after the failure delay; the connection is then closed)."""
        if session.mechanism is None or session.authenticated or session.failed:
            session.failed = True
            raise IllegalSaslStateError("SaslAuthenticate before SaslHandshake, or after the end")
        if self._slots.locked():
            self.busy += 1
            session.failed = True
            raise AuthenticationFailedError("too many authentications in progress; try later")
        try:
            async with self._slots:
                if session._step == 0:
                    answer = await self._first(session, bytes(token))
                else:
                    answer = await self._final(session, bytes(token))
        except AuthenticationFailedError:
            self.failed += 1
            session.failed = True
            await asyncio.sleep(self.settings.failure_delay_s)
            raise
        return answer

    async def _first(self, session: Session, token: bytes) -> bytes:
        assert session.mechanism is not None
        loop = asyncio.get_running_loop()
        mechanism = ScramMechanism(session.mechanism)
        creds: dict[str, ScramCredential | None] = {}

        def auth_info(name: str) -> tuple[bytes, bytes, bytes, int]:
            future: concurrent.futures.Future[dict[str, ScramCredential] | None]
            future = asyncio.run_coroutine_threadsafe(self.lookup(name), loop)
            found = future.result(self.settings.lookup_timeout_s)
            cred = (found or {}).get(mechanism.name)
            creds[name] = cred
            if cred is None:
                cred = self._made_up(name)
            return cred.salt, cred.stored_key, cred.server_key, cred.iterations

        def step() -> tuple[Any, bytes]:
            server = mechanism.make_server(auth_info)
            server.set_client_first(token.decode("utf-8"))
            return server, server.get_server_first().encode()

        answer: bytes
        try:
            server, answer = await self._run(step)
        except TimeoutError:  # the credential lookup (ZooKeeper) took too long: retriable
            raise MetadataUnavailableError(
                "the user's credentials could not be read in time"
            ) from None
        except (ScramException, UnicodeDecodeError, ValueError) as exc:
            log.warning("SCRAM login from %s refused: %s", session.peer, _safe(exc))
            raise AuthenticationFailedError("authentication failed") from None
        session._scram = server
        session._step = 1
        session.user = next(iter(creds), "")
        return answer

    async def _final(self, session: Session, token: bytes) -> bytes:
        server = session._scram
        user = session.user

        def step() -> bytes:
            server.set_client_final(token.decode("utf-8"))
            return bytes(server.get_server_final().encode())

        try:
            answer: bytes = await self._run(step)
        except (ScramException, UnicodeDecodeError, ValueError) as exc:
            log.warning("SCRAM login of %r from %s refused: %s", user, session.peer, _safe(exc))
            raise AuthenticationFailedError("authentication failed") from None
        session._scram = None
        session.authenticated = True
        session.principal = f"User:{user}"
        self.succeeded += 1
        log.info(
            "%s authenticated from %s (%s)", session.principal, session.peer, session.mechanism
        )
        return answer

    async def _run(self, fn: Callable[[], Any]) -> Any:
        self.in_pool += 1
        self.in_pool_peak = max(self.in_pool_peak, self.in_pool)
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn)
        finally:
            self.in_pool -= 1

    def _made_up(self, name: str) -> ScramCredential:
        """A verifier no password matches, the same for a name every time."""
        digest = hmac.new(self._secret, name.encode(), hashlib.sha256).digest()
        return ScramCredential(
            digest[:16], secrets.token_bytes(32), digest[16:], DEFAULT_ITERATIONS
        )


def _safe(exc: BaseException) -> str:
    """An exception's class and scramp's short reason (never the exchange's bytes)."""
    reason = exc.args[0] if exc.args and isinstance(exc.args[0], str) else ""
    return type(exc).__name__ + (f" ({reason})" if reason and len(reason) < 80 else "")
