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
* **PEM text instead of files** (``inline_pem_files``, Kafka's KIP-651 settings
  ``ssl.keystore.certificate.chain``, ``ssl.keystore.key``, ``ssl.truststore.certificates``):
  where the material arrives in the environment (an ECS task's secrets, docs/deploy.md), it
  is written once to files only this process's user can read, in a private directory
  removed at exit, and used as the files above. Such material changes with a new process,
  not by reload.
* **The principal of a certificate** (``principal_of``): the subject's common name of a
  verified peer certificate, as Kafka's default ``ssl.principal.mapping.rules`` give it.

A file that is missing or unreadable, or a key that does not match its certificate, at
start raises ``InvalidConfigError`` (the process should not start half-secured).
"""

from __future__ import annotations

import atexit
import dataclasses
import enum
import functools
import logging
import os
import shutil
import ssl
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

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


#: the settings that carry PEM text, and the file setting each one stands for
INLINE_PEM = {
    "ssl.keystore.certificate.chain": "certfile",
    "ssl.keystore.key": "keyfile",
    "ssl.truststore.certificates": "cafile",
}


class PemSettings(Protocol):
    """A config with the file settings and their PEM twins (the agent's and the SDK's)."""

    @property
    def ssl_certfile(self) -> str | None: ...
    @property
    def ssl_keyfile(self) -> str | None: ...
    @property
    def ssl_cafile(self) -> str | None: ...
    @property
    def ssl_keystore_certificate_chain(self) -> str | None: ...
    @property
    def ssl_keystore_key(self) -> Any: ...  # a pydantic SecretStr
    @property
    def ssl_truststore_certificates(self) -> str | None: ...


def _inline(config: PemSettings) -> tuple[str | None, str | None, str | None]:
    key = config.ssl_keystore_key
    return (
        config.ssl_keystore_certificate_chain,
        None if key is None else key.get_secret_value(),
        config.ssl_truststore_certificates,
    )


def check_inline_pem(config: PemSettings) -> None:
    """Refuse a setting given both as a file and as PEM text, and text that is not PEM."""
    _check_pem(*_inline(config))
    files = (config.ssl_certfile, config.ssl_keyfile, config.ssl_cafile)
    for (name, setting), path, text in zip(INLINE_PEM.items(), files, _inline(config), strict=True):
        if text is not None and path is not None:
            raise InvalidConfigError(f"give ssl.{setting} or {name}, not both")


def with_inline_pem(files: TlsFiles, config: PemSettings) -> TlsFiles:
    """``files`` with the PEM texts ``config`` gives written out, in place of their files."""
    texts = _inline(config)
    if texts == (None, None, None):
        return files
    paths = inline_pem_files(*texts)
    return dataclasses.replace(
        files,
        certfile=paths.get("certfile", files.certfile),
        keyfile=paths.get("keyfile", files.keyfile),
        cafile=paths.get("cafile", files.cafile),
    )


def inline_pem_files(
    certificate_chain: str | None, key: str | None, ca: str | None
) -> dict[str, str]:
    """Paths of files holding the PEM texts given (``certfile``, ``keyfile``, ``cafile``:
    only those given). Each distinct set is written once per process (0600 files in a 0700
    directory, removed at exit). A text that is not PEM raises ``InvalidConfigError``
    without showing it (it may be a key)."""
    _check_pem(certificate_chain, key, ca)
    return dict(_written(certificate_chain, key, ca))


def _check_pem(certificate_chain: str | None, key: str | None, ca: str | None) -> None:
    for name, text in zip(INLINE_PEM, (certificate_chain, key, ca), strict=True):
        if text is not None and "-----BEGIN " not in text:
            raise InvalidConfigError(f"{name} is not PEM text (no -----BEGIN line)")
    if certificate_chain is None and key is not None:
        raise InvalidConfigError("ssl.keystore.key needs ssl.keystore.certificate.chain")


@functools.lru_cache(maxsize=8)
def _written(
    certificate_chain: str | None, key: str | None, ca: str | None
) -> tuple[tuple[str, str], ...]:
    directory = tempfile.mkdtemp(prefix="strata-tls-")  # mode 0700
    atexit.register(shutil.rmtree, directory, True)
    out = []
    for setting, text in zip(INLINE_PEM.values(), (certificate_chain, key, ca), strict=True):
        if text is None:
            continue
        # mkstemp: a new file (O_EXCL), mode 0600; not the data directory (no fileio seam)
        fd, path = tempfile.mkstemp(dir=directory, prefix=f"{setting}-", suffix=".pem")
        with os.fdopen(fd, "w") as f:
            f.write(text if text.endswith("\n") else text + "\n")
        out.append((setting, path))
    return tuple(out)


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
