"""SCRAM credentials in ZooKeeper: salted keys, never passwords.

Layout (under the cluster's chroot; ``docs/security.md``)::

    /config/users/<name>   {"SCRAM-SHA-256": {"salt": b64, "stored_key": b64,
                            "server_key": b64, "iterations": 8192}, "SCRAM-SHA-512": {...}}

What is kept is RFC 5802's verifier (``scramp.ScramMechanism.make_auth_info``): a random salt,
the iteration count and two keys derived from ``PBKDF2(password, salt, iterations)``. The
agent checks a client's proof with a few HMACs against them; it never sees or keeps the
password, and a copy of the znode does not let anyone log in (it lets someone guess
passwords offline at ``iterations`` PBKDF2 rounds a guess, which is why the count is at
least 4096, Kafka's and RFC 7677's floor). The PBKDF2 work is done where the credential is
set (the admin handler), off any event loop.

Names are Kafka's user names: 1 to 255 characters, no ``/`` (a znode name), no control
characters. Setting a credential for one mechanism keeps the other's.
"""

from __future__ import annotations

import base64
import json
import re
from dataclasses import dataclass
from typing import Any

from scramp import ScramMechanism

from storage.errors import (
    InvalidRequestError,
    NodeExistsError,
    NodeNotFoundError,
    VersionConflictError,
)
from storage.metadata.zk import AsyncZooKeeper

USERS = "/config/users"
MECHANISMS = ("SCRAM-SHA-256", "SCRAM-SHA-512")
MIN_ITERATIONS = 4096
DEFAULT_ITERATIONS = 8192
_NAME = re.compile(r"^[^/\x00-\x1f\x7f]{1,255}$")


def validate_user(name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name) or name in (".", ".."):
        raise InvalidRequestError(
            f"{name!r} is not a user name (1-255 characters, no '/' or control characters)"
        )
    return name


@dataclass(frozen=True, slots=True)
class ScramCredential:
    """One mechanism's verifier for one user."""

    salt: bytes
    stored_key: bytes
    server_key: bytes
    iterations: int

    @classmethod
    def make(
        cls, mechanism: str, password: str, iterations: int = DEFAULT_ITERATIONS
    ) -> ScramCredential:
        """Salt and derive (``iterations`` PBKDF2 rounds: run it off the event loop)."""
        if mechanism not in MECHANISMS:
            raise InvalidRequestError(f"mechanism must be one of {', '.join(MECHANISMS)}")
        if iterations < MIN_ITERATIONS:
            raise InvalidRequestError(f"iterations must be at least {MIN_ITERATIONS}")
        if not password:
            raise InvalidRequestError("the password is empty")
        salt, stored, server, its = ScramMechanism(mechanism).make_auth_info(
            password, iteration_count=iterations
        )
        return cls(salt, stored, server, its)

    def to_json(self) -> dict[str, Any]:
        b64 = base64.b64encode
        return {
            "salt": b64(self.salt).decode(),
            "stored_key": b64(self.stored_key).decode(),
            "server_key": b64(self.server_key).decode(),
            "iterations": self.iterations,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ScramCredential:
        b = base64.b64decode
        return cls(b(d["salt"]), b(d["stored_key"]), b(d["server_key"]), int(d["iterations"]))


def decode_user(data: bytes) -> dict[str, ScramCredential]:
    raw = json.loads(data)
    return {m: ScramCredential.from_json(v) for m, v in raw.items() if m in MECHANISMS}


def encode_user(creds: dict[str, ScramCredential]) -> bytes:
    return json.dumps({m: c.to_json() for m, c in sorted(creds.items())}).encode()


class UserStore:
    """Reads and writes ``/config/users`` (one znode a user)."""

    def __init__(self, zk: AsyncZooKeeper) -> None:
        self.zk = zk

    async def get(self, name: str) -> dict[str, ScramCredential] | None:
        try:
            data, _ = await self.zk.get(f"{USERS}/{validate_user(name)}")
        except NodeNotFoundError:
            return None
        return decode_user(data)

    async def list(self) -> dict[str, list[str]]:
        """Every user and the mechanisms it has a credential for."""
        try:
            names = await self.zk.get_children(USERS)
        except NodeNotFoundError:
            return {}
        out = {}
        for name in sorted(names):
            creds = await self.get(name)
            if creds is not None:
                out[name] = sorted(creds)
        return out

    async def set(self, name: str, mechanism: str, credential: ScramCredential) -> None:
        """Create or replace one mechanism's credential (compare-and-set on the znode)."""
        path = f"{USERS}/{validate_user(name)}"
        while True:
            try:
                data, stat = await self.zk.get(path)
            except NodeNotFoundError:
                try:
                    await self.zk.create(path, encode_user({mechanism: credential}), makepath=True)
                    return
                except NodeExistsError:
                    continue
            creds = decode_user(data)
            creds[mechanism] = credential
            try:
                await self.zk.set(path, encode_user(creds), stat.version)
                return
            except (VersionConflictError, NodeNotFoundError):  # someone else wrote: again
                continue

    async def delete(self, name: str) -> bool:
        try:
            await self.zk.delete(f"{USERS}/{validate_user(name)}")
        except NodeNotFoundError:
            return False
        return True
