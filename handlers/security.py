"""The admin API's user, ACL and quota endpoints (routes added to ``handlers.admin.ROUTER``).

    GET    /users                  -> 200 {"users": {name: [mechanisms]}}
    PUT    /users/{name}           {"password", "mechanisms"?, "iterations"?} -> 200 {"name",
                                   "mechanisms"}  (the password is salted here and dropped)
    DELETE /users/{name}           -> 200 {"deleted": bool}
    GET    /acls                   -> 200 {"acls": [binding]}
    POST   /acls                   {"acls": [binding]} -> 201 {"acls": [binding]}
    DELETE /acls                   {"acls": [binding]} -> 200 {"removed": n}
    GET    /quotas                 -> 200 {"quotas": {principal: {rate: n}}}
    PUT    /quotas/{principal}     {"producer_byte_rate"?, "consumer_byte_rate"?,
                                   "request_rate"?} -> 200 {"principal", "quota"}
                                   (replaces the principal's quota; ``{}`` removes it)
    DELETE /quotas/{principal}     -> 200 {"deleted": bool}

A binding is ``{"principal": "User:alice", "resource_type": "topic|group|cluster|
transactional_id", "name", "pattern_type": "literal|prefixed", "operation": "read|write|
create|delete|alter|describe|all", "permission": "allow|deny"}``. A quota's principal is
``User:<name>`` or the default ``User:*``, percent-encoded in the path (``User%3Aalice``);
its rates are whole numbers per second, a rate left out is unlimited
(``storage.metadata.quotas``). Passwords never appear in an answer or a log line; the PBKDF2
of a new credential runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import json

from pydantic import BaseModel, ConfigDict, Field

from handlers.http import CLUSTER_ALTER, CLUSTER_DESCRIBE, Request, Response, Route, parse_body
from handlers.runtime import Invocation
from storage.errors import InvalidRequestError
from storage.metadata import MetadataStore
from storage.metadata.acls import AclBinding, AclStore
from storage.metadata.quotas import QuotaConfig, QuotaStore, parse_quota, validate_principal
from storage.metadata.users import (
    DEFAULT_ITERATIONS,
    MECHANISMS,
    MIN_ITERATIONS,
    ScramCredential,
    UserStore,
    validate_user,
)


class SetUserBody(BaseModel):
    """Everything but the password, which is checked apart: a validation error quotes the
    value it refuses, and a password must never be quoted."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mechanisms: list[str] = Field(default_factory=lambda: list(MECHANISMS), min_length=1)
    iterations: int = Field(DEFAULT_ITERATIONS, ge=MIN_ITERATIONS, le=1_000_000)


class AclsBody(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    acls: list[dict[str, str]] = Field(min_length=1, max_length=10_000)


def _list_users(request: Request, invocation: Invocation) -> Response:
    users = invocation.run(lambda store: UserStore(store.zk).list())
    return Response(200, {"users": users})


def _set_user(request: Request, invocation: Invocation, name: str) -> Response:
    name = validate_user(name)
    data = dict(request.json())
    password = data.pop("password", None)
    if not isinstance(password, str) or not 0 < len(password) <= 1024:
        raise InvalidRequestError("password: a string of 1 to 1024 characters is required")
    body = parse_body(SetUserBody, data)
    for mech in body.mechanisms:
        if mech not in MECHANISMS:
            raise InvalidRequestError(f"mechanism must be one of {', '.join(MECHANISMS)}")

    async def run(store: MetadataStore) -> None:
        users = UserStore(store.zk)
        for mech in body.mechanisms:
            cred = await asyncio.to_thread(ScramCredential.make, mech, password, body.iterations)
            await users.set(name, mech, cred)

    invocation.run(run)
    return Response(200, {"name": name, "mechanisms": sorted(body.mechanisms)})


def _delete_user(request: Request, invocation: Invocation, name: str) -> Response:
    name = validate_user(name)
    deleted = invocation.run(lambda store: UserStore(store.zk).delete(name))
    return Response(200, {"deleted": deleted})


def _list_acls(request: Request, invocation: Invocation) -> Response:
    acls = invocation.run(lambda store: AclStore(store.zk).list())
    return Response(200, {"acls": [b.to_json() for b in acls]})


def _bindings(request: Request) -> list[AclBinding]:
    body = parse_body(AclsBody, request.json())
    return [AclBinding.parse(d) for d in body.acls]


def _add_acls(request: Request, invocation: Invocation) -> Response:
    bindings = _bindings(request)
    invocation.run(lambda store: AclStore(store.zk).add(bindings))
    return Response(201, {"acls": [b.to_json() for b in bindings]})


def _remove_acls(request: Request, invocation: Invocation) -> Response:
    bindings = _bindings(request)
    removed = invocation.run(lambda store: AclStore(store.zk).remove(bindings))
    return Response(200, {"removed": removed})


QUOTA_KEYS = tuple(QuotaConfig.model_fields)


def _list_quotas(request: Request, invocation: Invocation) -> Response:
    quotas = invocation.run(lambda store: QuotaStore(store.zk).list())
    return Response(200, {"quotas": {p: q.to_json() for p, q in sorted(quotas.items())}})


def _set_quota(request: Request, invocation: Invocation, principal: str) -> Response:
    principal = validate_principal(principal)
    data = request.json()
    unknown = sorted(k for k in data if k not in QUOTA_KEYS)
    if unknown:
        raise InvalidRequestError(
            f"unknown quota key {', '.join(map(repr, unknown))}; known: {', '.join(QUOTA_KEYS)}"
        )
    for key, value in data.items():
        # JSON integers only: pydantic would take true as 1 and "100" as 100
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            shown = json.dumps(value)
            raise InvalidRequestError(
                f"quota of {principal}: {key}: a whole number per second is required "
                f"(got {shown if len(shown) <= 40 else shown[:37] + '...'})"
            )
    quota = parse_quota(principal, data)
    invocation.run(lambda store: QuotaStore(store.zk).set(principal, quota))
    return Response(200, {"principal": principal, "quota": quota.to_json()})


def _delete_quota(request: Request, invocation: Invocation, principal: str) -> Response:
    principal = validate_principal(principal)
    deleted = invocation.run(lambda store: QuotaStore(store.zk).delete(principal))
    return Response(200, {"deleted": deleted})


ROUTES = [
    Route("GET", "/users", _list_users, CLUSTER_DESCRIBE),
    Route("PUT", "/users/{name}", _set_user, CLUSTER_ALTER),
    Route("DELETE", "/users/{name}", _delete_user, CLUSTER_ALTER),
    Route("GET", "/acls", _list_acls, CLUSTER_DESCRIBE),
    Route("POST", "/acls", _add_acls, CLUSTER_ALTER),
    Route("DELETE", "/acls", _remove_acls, CLUSTER_ALTER),
    Route("GET", "/quotas", _list_quotas, CLUSTER_DESCRIBE),
    Route("PUT", "/quotas/{principal}", _set_quota, CLUSTER_ALTER),
    Route("DELETE", "/quotas/{principal}", _delete_quota, CLUSTER_ALTER),
]
"""Users, ACLs and quotas are the cluster's: Describe on it to look, Alter to change."""
