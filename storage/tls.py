"""TLS contexts for the agents' listeners and for clients, re-read when their files change.

Both sides use Python's ``ssl`` (OpenSSL) with its defaults for protocol versions and
ciphers (TLS 1.2 at least). What this module adds:

* **One description of the files** (``TlsFiles``: certificate chain, private key, CA bundle,
  whether the peer must show a certificate) shared by the agent config and the SDK config,
  which both spell them with Kafka-like dotted names (``ssl.certfile``, ``ssl.keyfile``,
  ``ssl.cafile``, ``ssl.client.auth``).
* **Reload without restart** (``ReloadingContext``): the context is built from the files and
  rebuilt, on the next connection, once any of them changed (size, mtime or inode, so an
  atomic rename of a renewed certificate counts). A rebuild that fails (a half-written key,
  a key that does not match the certificate) keeps serving with the previous context and
  logs why; connections already open keep the context they were made with. At most one
  ``stat`` per file per ``check_interval`` seconds, so a connection storm does not become a
  ``stat`` storm.
* **The principal of a certificate** (``principal_of``): the subject's common name of a
  verified peer certificate, as Kafka's default ``ssl.principal.mapping.rules`` give it.

A file that is missing or unreadable, or a key that does not match its certificate, at
start raises ``InvalidConfigError`` (the process should not start half-secured).
"""

from __future__ import annotations

import enum
import logging
import os
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from storage.errors import InvalidConfigError

log = logging.getLogger(__name__)


class SecurityProtocol(enum.StrEnum):
    """Kafka's ``security.protocol`` values: transport (TLS or not) x authentication (SASL)."""

    PLAINTEXT = "PLAINTEXT"
    SSL = "SSL"
    SASL_PLAINTEXT = "SASL_PLAINTEXT"
    SASL_SSL = "SASL_SSL"

    @property
    def tls(self) -> bool:
        return self in (SecurityProtocol.SSL, SecurityProtocol.SASL_SSL)

    @property
    def sasl(self) -> bool:
        return self in (SecurityProtocol.SASL_PLAINTEXT, SecurityProtocol.SASL_SSL)


class ClientAuth(enum.StrEnum):
    """Kafka's ``ssl.client.auth``: whether a client must (or may) show a certificate."""

    NONE = "none"
    REQUESTED = "requested"
    REQUIRED = "required"


@dataclass(frozen=True, slots=True, kw_only=True)
class TlsFiles:
    """Where one side's TLS material lives (any may be None where that side needs none)."""

    certfile: str | None = None
    keyfile: str | None = None
    cafile: str | None = None
    client_auth: ClientAuth = ClientAuth.NONE
    check_hostname: bool = True

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(p for p in (self.certfile, self.keyfile, self.cafile) if p)


def server_context(files: TlsFiles) -> ssl.SSLContext:
    """A listener's context: its certificate chain and key; with ``client_auth`` requested or
    required, client certificates are verified against ``cafile``."""
    if not files.certfile:
        raise InvalidConfigError("a TLS listener needs ssl.certfile (and ssl.keyfile)")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_chain(ctx, files)
    if files.client_auth is not ClientAuth.NONE:
        if not files.cafile:
            raise InvalidConfigError("ssl.client.auth needs ssl.cafile to verify clients with")
        _load_ca(ctx, files.cafile)
        ctx.verify_mode = (
            ssl.CERT_REQUIRED if files.client_auth is ClientAuth.REQUIRED else ssl.CERT_OPTIONAL
        )
    return ctx


def client_context(files: TlsFiles) -> ssl.SSLContext:
    """A client's context: the server is verified against ``cafile`` (or the system's CAs),
    its name checked unless ``check_hostname`` is off; ``certfile``/``keyfile`` if the client
    shows a certificate of its own (mTLS)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if files.cafile:
        _load_ca(ctx, files.cafile)
    else:
        ctx.load_default_certs()
    ctx.check_hostname = files.check_hostname
    if files.certfile:
        _load_chain(ctx, files)
    return ctx


def _load_chain(ctx: ssl.SSLContext, files: TlsFiles) -> None:
    assert files.certfile is not None
    try:
        ctx.load_cert_chain(files.certfile, files.keyfile)
    except (OSError, ssl.SSLError) as exc:
        raise InvalidConfigError(
            f"cannot load the certificate {files.certfile} with key {files.keyfile}: {exc}"
        ) from None


def _load_ca(ctx: ssl.SSLContext, cafile: str) -> None:
    try:
        ctx.load_verify_locations(cafile=cafile)
    except (OSError, ssl.SSLError) as exc:
        raise InvalidConfigError(f"cannot load the CA bundle {cafile}: {exc}") from None


def _signature(paths: tuple[str, ...]) -> tuple[Any, ...]:
    out: list[Any] = []
    for p in paths:
        try:
            st = os.stat(p)
            out.append((st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError:
            out.append(None)
    return tuple(out)


class ReloadingContext:
    """An ``ssl.SSLContext`` rebuilt when its files change (see the module docstring)."""

    def __init__(
        self,
        files: TlsFiles,
        build: Callable[[TlsFiles], ssl.SSLContext],
        *,
        check_interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.files = files
        self._build = build
        self._check_interval = check_interval
        self._clock = clock
        self._signature = _signature(files.paths)
        self._context = build(files)  # a bad file at start is the operator's to fix now
        self._checked = clock()
        #: how many times the files were read again (a successful reload)
        self.reloads = 0

    def get(self) -> ssl.SSLContext:
        now = self._clock()
        if now - self._checked < self._check_interval:
            return self._context
        self._checked = now
        signature = _signature(self.files.paths)
        if signature != self._signature:
            try:
                self._context = self._build(self.files)
            except InvalidConfigError as exc:
                log.warning("TLS files changed but cannot be loaded; keeping the old ones: %s", exc)
            else:
                self._signature = signature
                self.reloads += 1
                log.info("TLS files changed: reloaded %s", ", ".join(self.files.paths))
        return self._context


def principal_of(peercert: dict[str, Any] | None) -> str | None:
    """The common name of a verified peer certificate's subject (None: no certificate)."""
    if not peercert:
        return None
    for rdn in peercert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return None
