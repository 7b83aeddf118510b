"""HTTP Basic authentication for the local runtime, against the SCRAM users in ZooKeeper.

A secured local stack (``strata local up --secure``) runs the admin runtime with
``--authenticate``. Each request must then carry ``Authorization: Basic base64(user:password)``
for a user of ``/config/users`` (``storage.metadata.users``). What is stored there is RFC 5802's
verifier, not the password: the password is checked by deriving the verifier again, with the
stored salt and iteration count (``scramp``'s ``make_auth_info``: SASLprep, PBKDF2, HMAC,
hash) and comparing the stored key in constant time. On success the request's principal is
``User:<user>``, handed to the handler as a Lambda authorizer would (``handlers.http``); a
missing, malformed or wrong credential, or an unknown user, is ``AuthenticationFailedError``
(401, with ``WWW-Authenticate: Basic``), and the answer does not say which.

Bounded work, so that failed logins cannot slow others down without limit:

* a derivation costs ``iterations`` PBKDF2 rounds (milliseconds). A success is remembered
  (at most ``CACHE_ENTRIES``, least recently used out) under the user, the salt, the count
  and an HMAC of the password with a per-process key (never the password itself): a known
  client's next requests derive nothing. A changed password has a new salt, so it misses;
  a deleted user has no verifier, so it fails;
* failures are not remembered (they cannot push the successes out), and at most
  ``MAX_DERIVATIONS`` derivations run at a time; a request that cannot start one within
  ``DERIVATION_WAIT_S`` gets a retriable ``NetworkError`` (503). A flood of wrong passwords
  thus delays only other uncached logins, by at most that wait;
* an unknown user gets a made-up verifier (stable per name), so it costs what a wrong
  password costs and is refused the same way.

Passwords are never logged; a refusal is logged with the peer and the user name.
"""

from __future__ import annotations

import base64
import binascii
import collections
import hashlib
import hmac
import logging
import secrets
import threading
from collections.abc import Callable

from scramp import ScramException, ScramMechanism

from storage.errors import AuthenticationFailedError, InvalidRequestError, NetworkError
from storage.metadata.users import DEFAULT_ITERATIONS, ScramCredential

log = logging.getLogger("infra.local_runtime")

CACHE_ENTRIES = 1024
MAX_DERIVATIONS = 2
DERIVATION_WAIT_S = 5.0
MAX_HEADER = 4096
PREFERRED = ("SCRAM-SHA-512", "SCRAM-SHA-256")

Lookup = Callable[[str], dict[str, ScramCredential] | None]
"""``lookup(user)``: the user's verifiers by mechanism, None for an unknown user."""


def parse_basic(header: str | None) -> tuple[str, str]:
    """``(user, password)`` from an ``Authorization: Basic`` value; anything else is
    ``AuthenticationFailedError``."""
    if not header:
        raise AuthenticationFailedError("authentication required: send HTTP Basic credentials")
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "basic" or not token.strip() or len(header) > MAX_HEADER:
        raise AuthenticationFailedError("malformed Authorization header: Basic credentials only")
    try:
        text = base64.b64decode(token.strip(), validate=True).decode("utf-8")
    except (binascii.Error, ValueError):
        raise AuthenticationFailedError(
            "malformed Authorization header: not base64 of UTF-8 'user:password'"
        ) from None
    user, colon, password = text.partition(":")
    if not colon or not user or not password:
        raise AuthenticationFailedError("malformed Authorization header: 'user:password' expected")
    return user, password


class BasicAuthenticator:
    """Checks Basic credentials against ``lookup``'s verifiers (thread-safe)."""

    def __init__(
        self,
        lookup: Lookup,
        *,
        max_derivations: int = MAX_DERIVATIONS,
        derivation_wait_s: float = DERIVATION_WAIT_S,
        cache_entries: int = CACHE_ENTRIES,
    ) -> None:
        self.lookup = lookup
        self.derivation_wait_s = derivation_wait_s
        self.cache_entries = cache_entries
        self._slots = threading.BoundedSemaphore(max_derivations)
        self._key = secrets.token_bytes(32)
        self._cache: collections.OrderedDict[tuple[str, str, bytes, int, bytes], bytes] = (
            collections.OrderedDict()
        )
        self._lock = threading.Lock()
        #: derivations run so far (tests and metrics: a cached login adds none)
        self.derivations = 0

    def authenticate(self, header: str | None, peer: str = "") -> str:
        """The principal (``User:<name>``) the header proves, or ``AuthenticationFailedError``."""
        user, password = parse_basic(header)
        try:
            found = self.lookup(user)
        except InvalidRequestError:  # not a user name at all
            found = None
        mechanism, cred = _pick(found)
        if cred is None:
            mechanism, cred = PREFERRED[0], self._made_up(user)
        if not hmac.compare_digest(
            self._stored_key(user, password, mechanism, cred), cred.stored_key
        ):
            log.warning("admin API login of %r from %s refused", user, peer or "?")
            raise AuthenticationFailedError("authentication failed")
        return f"User:{user}"

    def _stored_key(self, user: str, password: str, mechanism: str, cred: ScramCredential) -> bytes:
        tag = hmac.new(self._key, password.encode("utf-8", "surrogatepass"), hashlib.sha256)
        key = (user, mechanism, cred.salt, cred.iterations, tag.digest())
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
        if not self._slots.acquire(timeout=self.derivation_wait_s):
            raise NetworkError("too many logins in progress; try again")
        try:
            self.derivations += 1
            _, stored_key, _, _ = ScramMechanism(mechanism).make_auth_info(
                password, iteration_count=cred.iterations, salt=cred.salt
            )
        except ScramException:  # a password SASLprep refuses: no user can have it
            return b""
        finally:
            self._slots.release()
        if hmac.compare_digest(stored_key, cred.stored_key):
            with self._lock:
                self._cache[key] = stored_key
                while len(self._cache) > self.cache_entries:
                    self._cache.popitem(last=False)
        return bytes(stored_key)

    def _made_up(self, user: str) -> ScramCredential:
        """A verifier no password matches, the same for a name every time."""
        digest = hmac.new(self._key, b"unknown:" + user.encode("utf-8", "replace"), "sha256")
        salt = digest.digest()[:16]
        return ScramCredential(salt, secrets.token_bytes(64), salt, DEFAULT_ITERATIONS)


def _pick(found: dict[str, ScramCredential] | None) -> tuple[str, ScramCredential | None]:
    for mechanism in PREFERRED:
        if found and mechanism in found:
            return mechanism, found[mechanism]
    return PREFERRED[0], None
