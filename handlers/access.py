"""ACL checks on the admin API's routes: the ``guard`` of ``handlers.admin.ROUTER``.

Off unless the admin runtime's environment turns it on (``AccessConfig.from_env``)::

    STRATA_ADMIN_AUTHORIZER=1                    # check every route
    STRATA_SUPER_USERS=User:admin,User:agents    # pass everything (',' or ';' between)
    STRATA_ADMIN_ACL_CACHE_MS=1000               # how stale the ACLs may be (default 1000)

Off, every caller may use every route (as before: on AWS IAM guards the whole API, locally
the runtime listens on loopback). On, each call goes through :class:`AdminGuard`:

1. the caller is ``request.principal`` (``handlers.http.principal_of``: an IAM ARN, a Lambda
   authorizer's principal, or ``User:ANONYMOUS``);
2. a super user passes;
3. otherwise every need of the route's :class:`~handlers.http.Rule` must be allowed by
   ``storage.metadata.acls.authorize`` (deny wins, ``describe`` implied by read, write,
   delete and alter), the resource names found from the path, the body or ZooKeeper;
4. the first need refused answers 403 with the resource type's error
   (``TopicAuthorizationFailedError``, ``GroupAuthorizationFailedError``,
   ``ClusterAuthorizationFailedError``) before the endpoint runs, so a refused call changes
   nothing; the refusal is logged with the principal, the route and the need, never a
   credential;
5. a route whose rule ``shows`` a listing has its 200 answer filtered: the entries the
   caller may not describe are left out (``GET /topics``, ``GET /groups``).

The ACLs are read from ``/config/acls`` (``storage.metadata.acls.AclStore``) at most once per
``STRATA_ADMIN_ACL_CACHE_MS`` per ZooKeeper session, on the runtime's event loop: a change
counts within that time. A list that does not parse keeps the previous one (none yet: no
access for anyone but super users).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from handlers.http import AnyOf, Listing, Need, Request, Response, Route, Rule
from storage.errors import (
    AuthorizationError,
    ClusterAuthorizationFailedError,
    GroupAuthorizationFailedError,
    InvalidRequestError,
    TopicAuthorizationFailedError,
    TransactionalIdAuthorizationFailedError,
)
from storage.metadata import MetadataStore
from storage.metadata.acls import AclBinding, AclStore, ResourceType, authorize

log = logging.getLogger(__name__)

AUTHORIZER_ENV = "STRATA_ADMIN_AUTHORIZER"
SUPER_USERS_ENV = "STRATA_SUPER_USERS"
CACHE_ENV = "STRATA_ADMIN_ACL_CACHE_MS"
DEFAULT_CACHE_S = 1.0

REFUSALS: dict[ResourceType, type[AuthorizationError]] = {
    ResourceType.TOPIC: TopicAuthorizationFailedError,
    ResourceType.GROUP: GroupAuthorizationFailedError,
    ResourceType.CLUSTER: ClusterAuthorizationFailedError,
    ResourceType.TRANSACTIONAL_ID: TransactionalIdAuthorizationFailedError,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class AccessConfig:
    enabled: bool = False
    super_users: frozenset[str] = frozenset()
    cache_s: float = DEFAULT_CACHE_S

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> AccessConfig:
        flag = env.get(AUTHORIZER_ENV, "").strip().lower()
        if flag not in ("", "0", "1", "true", "false", "yes", "no"):
            raise InvalidRequestError(f"{AUTHORIZER_ENV} must be 1 or 0, not {flag!r}")
        supers = env.get(SUPER_USERS_ENV, "").replace(";", ",")
        users = frozenset(u.strip() for u in supers.split(",") if u.strip())
        bad = sorted(u for u in users if not u.startswith("User:") or len(u) <= 5)
        if bad:
            raise InvalidRequestError(f"{SUPER_USERS_ENV}: {bad} are not User:<name>")
        text = env.get(CACHE_ENV)
        try:
            cache_s = DEFAULT_CACHE_S if text is None else int(text) / 1000
        except ValueError:
            raise InvalidRequestError(f"{CACHE_ENV}={text!r} is not milliseconds") from None
        return cls(
            enabled=flag in ("1", "true", "yes"),
            super_users=users,
            cache_s=max(cache_s, 0.0),
        )


class AclCache:
    """The bindings of ``/config/acls``, read again when older than ``ttl`` seconds or when
    the store (the ZooKeeper session) is another. Used on the runtime's loop only."""

    def __init__(self, ttl: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl = ttl
        self.clock = clock
        self._store: MetadataStore | None = None
        self._bindings: list[AclBinding] | None = None
        self._read_at = 0.0

    async def bindings(self, store: MetadataStore) -> list[AclBinding]:
        now = self.clock()
        fresh = self._store is store and now - self._read_at < self.ttl
        if fresh and self._bindings is not None:
            return self._bindings
        try:
            bindings = await AclStore(store.zk).list()
        except (InvalidRequestError, ValueError, TypeError) as exc:
            log.error("the ACLs in ZooKeeper do not parse; keeping the previous ones: %s", exc)
            bindings = self._bindings if self._store is store and self._bindings else []
        self._store, self._bindings, self._read_at = store, bindings, now
        return bindings


@dataclass(frozen=True, slots=True)
class Refusal:
    need: Need
    name: str

    def error(self, principal: str) -> AuthorizationError:
        op, rtype = self.need.operation, self.need.resource
        kind = rtype.replace("_", " ")
        what = "the cluster" if rtype is ResourceType.CLUSTER else f"{kind} {self.name!r}"
        return REFUSALS[rtype](f"{principal} may not {op} {what}")


async def first_refusal(
    rule: Rule,
    request: Request,
    params: Mapping[str, str],
    store: MetadataStore,
    bindings: Sequence[AclBinding],
) -> Refusal | None:
    """The first need of ``rule`` that ``bindings`` do not allow ``request.principal``."""
    principal = request.principal
    for item in rule.needs:
        options = item.needs if isinstance(item, AnyOf) else (item,)
        refused: Refusal | None = None
        for need in options:
            name = await need.name.resolve(request, params, store)
            if authorize(bindings, principal, need.operation, need.resource, name):
                refused = None
                break
            refused = refused or Refusal(need, name)
        if refused is not None:
            return refused
    return None


def listing_filter(
    shows: Sequence[Listing], principal: str, bindings: Sequence[AclBinding]
) -> Callable[[Response], Response]:
    def allowed(listing: Listing, entry: Any) -> bool:
        name = entry.get(listing.field) if listing.field and isinstance(entry, dict) else entry
        return isinstance(name, str) and authorize(
            bindings, principal, listing.operation, listing.resource, name
        )

    def shown(response: Response) -> Response:
        if response.status != 200 or not isinstance(response.body, dict):
            return response
        body = dict(response.body)
        for listing in shows:
            entries = body.get(listing.key)
            if isinstance(entries, list):
                body[listing.key] = [e for e in entries if allowed(listing, e)]
        return Response(response.status, body, response.headers)

    return shown


class AdminGuard:
    """The router's guard (``handlers.http.Guard``); its settings are read once, from the
    environment, at the first call (:func:`reset` forgets them)."""

    def __init__(self, config: AccessConfig | None = None) -> None:
        self._config = config
        self._cache: AclCache | None = None

    @property
    def config(self) -> AccessConfig:
        if self._config is None:
            self._config = AccessConfig.from_env()
        return self._config

    def __call__(
        self, request: Request, route: Route, params: Mapping[str, str], invocation: Any
    ) -> Callable[[Response], Response] | None:
        config = self.config
        if not config.enabled or request.principal in config.super_users:
            return None
        if self._cache is None:
            self._cache = AclCache(config.cache_s)
        cache = self._cache
        rule = route.rule

        async def decide(store: MetadataStore) -> tuple[Refusal | None, list[AclBinding]]:
            bindings = await cache.bindings(store)
            return await first_refusal(rule, request, params, store, bindings), bindings

        refusal, bindings = invocation.run(decide)
        if refusal is not None:
            log.warning(
                "admin API refused %s %s: %s lacks %s (%r)",
                route.method,
                route.pattern,
                request.principal,
                refusal.need,
                refusal.name,
            )
            raise refusal.error(request.principal)
        if rule.shows:
            return listing_filter(rule.shows, request.principal, bindings)
        return None

    def reset(self) -> None:
        self._config = None
        self._cache = None


GUARD = AdminGuard()


def reset() -> None:
    """Forget the settings and the cached ACLs (tests; the next call reads them again)."""
    GUARD.reset()


def rule_table(routes: Sequence[Route]) -> str:
    """The route -> permission table of ``docs/security.md`` (markdown), from the routes."""
    lines = ["| route | needs |", "| --- | --- |"]
    for route in routes:
        lines.append(f"| `{route.method} {route.pattern}` | {route.rule} |")
    return "\n".join(lines)
