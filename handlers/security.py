"""The admin API's user and ACL endpoints (routes added to ``handlers.admin.ROUTER``).

    GET    /users                  -> 200 {"users": {name: [mechanisms]}}
    PUT    /users/{name}           {"password", "mechanisms"?, "iterations"?} -> 200 {"name",
                                   "mechanisms"}  (the password is salted here and dropped)
    DELETE /users/{name}           -> 200 {"deleted": bool}
    GET    /acls                   -> 200 {"acls": [binding]}
    POST   /acls                   {"acls": [binding]} -> 201 {"acls": [binding]}
    DELETE /acls                   {"acls": [binding]} -> 200 {"removed": n}

A binding is ``{"principal": "User:alice", "resource_type": "topic|group|cluster|
transactional_id", "name", "pattern_type": "literal|prefixed", "operation": "read|write|
create|delete|alter|describe|all", "permission": "allow|deny"}``. Passwords never appear in
an answer or a log line; the PBKDF2 of a new credential runs in a worker thread.
"""

from __future__ import annotations

import asyncio

from pydantic import BaseModel, ConfigDict, Field

from handlers.http import Request, Response, Route, parse_body
from handlers.runtime import Invocation
from storage.errors import InvalidRequestError
from storage.metadata import MetadataStore
from storage.metadata.acls import AclBinding, AclStore
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


ROUTES = [
    Route("GET", "/users", _list_users),
    Route("PUT", "/users/{name}", _set_user),
    Route("DELETE", "/users/{name}", _delete_user),
    Route("GET", "/acls", _list_acls),
    Route("POST", "/acls", _add_acls),
    Route("DELETE", "/acls", _remove_acls),
]
