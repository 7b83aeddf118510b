"""The filter AST: what a parsed expression is, and its canonical text.

A filter is a boolean expression over one record's tags and headers (never its key or value:
the broker does not parse payloads). Leaves:

* ``Tag(values)``: the record carries at least one of these tags;
* ``Header(key, values)``: the record has a header ``key`` whose value (bytes) is the UTF-8 of
  one of these strings;
* ``HasHeader(key)``: the record has a header ``key``;

combined with ``Not``, ``And`` and ``Or``. Nodes are frozen, so a filter can be hashed,
compared and sent to another process. ``text(expr)`` is the canonical form: the parser builds
normalised trees (nested ANDs/ORs flattened, an OR's tag tests merged into one ``Tag``, its
tests of one header key into one ``Header``, double negation removed), so two spellings of the
same test (``tag = 'a' OR tag = 'b'``, ``tag IN ('b', 'a')``, ``tags="a || b"``) have one
text, which is what a consumer group compares (``docs/filters.md``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Tag:
    values: frozenset[str]


@dataclass(frozen=True, slots=True)
class Header:
    key: str
    values: frozenset[str]


@dataclass(frozen=True, slots=True)
class HasHeader:
    key: str


@dataclass(frozen=True, slots=True)
class Not:
    item: Expr


@dataclass(frozen=True, slots=True)
class And:
    items: tuple[Expr, ...]


@dataclass(frozen=True, slots=True)
class Or:
    items: tuple[Expr, ...]


Expr = Tag | Header | HasHeader | Not | And | Or

_BARE_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*\Z")


def negate(e: Expr) -> Expr:
    return e.item if isinstance(e, Not) else Not(e)


def conjunction(items: list[Expr]) -> Expr:
    """``items`` ANDed, nested ANDs flattened."""
    flat: list[Expr] = []
    for e in items:
        flat.extend(e.items if isinstance(e, And) else (e,))
    return flat[0] if len(flat) == 1 else And(tuple(flat))


def disjunction(items: list[Expr]) -> Expr:
    """``items`` ORed: nested ORs flattened, tag tests merged into one ``Tag`` (where the first
    stood), the tests of one header key's values into one ``Header``."""
    flat: list[Expr] = []
    for e in items:
        flat.extend(e.items if isinstance(e, Or) else (e,))
    out: list[Expr] = []
    tag_at: int | None = None
    header_at: dict[str, int] = {}
    for e in flat:
        if isinstance(e, Tag):
            if tag_at is None:
                tag_at = len(out)
                out.append(e)
            else:
                merged = out[tag_at]
                assert isinstance(merged, Tag)
                out[tag_at] = Tag(merged.values | e.values)
        elif isinstance(e, Header):
            at = header_at.get(e.key)
            if at is None:
                header_at[e.key] = len(out)
                out.append(e)
            else:
                merged_h = out[at]
                assert isinstance(merged_h, Header)
                out[at] = Header(e.key, merged_h.values | e.values)
        else:
            out.append(e)
    return out[0] if len(out) == 1 else Or(tuple(out))


def _string(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _key(key: str) -> str:
    return key if _BARE_KEY.match(key) else '"' + key.replace('"', '""') + '"'


def _values(subject: str, values: frozenset[str]) -> str:
    ordered = sorted(values)
    if len(ordered) == 1:
        return f"{subject} = {_string(ordered[0])}"
    return f"{subject} IN ({', '.join(_string(v) for v in ordered)})"


def text(e: Expr) -> str:
    """The canonical text of ``e``; ``parse(text(e))`` gives ``e`` back."""
    if isinstance(e, Tag):
        return _values("tag", e.values)
    if isinstance(e, Header):
        return _values(f"header.{_key(e.key)}", e.values)
    if isinstance(e, HasHeader):
        return f"header.{_key(e.key)} IS NOT NULL"
    if isinstance(e, Not):
        return f"NOT ({text(e.item)})"
    joiner = " AND " if isinstance(e, And) else " OR "
    return joiner.join(f"({text(i)})" if isinstance(i, And | Or) else text(i) for i in e.items)
