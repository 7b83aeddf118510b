"""The filter language's parser: hand-written recursive descent over the characters.

Grammar (``docs/filters.md`` has the user's version; keywords are case-insensitive)::

    filter     := or_expr END
    or_expr    := and_expr ( OR and_expr )*
    and_expr   := not_expr ( AND not_expr )*
    not_expr   := NOT not_expr | primary
    primary    := '(' or_expr ')' | test
    test       := TAG compare | HEADER '.' key ( compare | IS [NOT] NULL )
    compare    := ( '=' | '!=' | '<>' ) string | [NOT] IN '(' string ( ',' string )* ')'
    key        := [A-Za-z_][A-Za-z0-9_.-]*  |  '"' ( any character but '"' | '""' )* '"'
    string     := "'" ( any character but "'" | "''" )* "'"

``tag = 'a'`` means "the record carries tag a" (a record has a list of tags); ``tag != 'a'``
is its negation. ``header.k = 'v'`` means "the record has a header k whose value is the UTF-8
of v"; a record without header k does not match it and does match ``header.k != 'v'``
(negation, not SQL's three-valued logic, so that NOT is always the complement).

RocketMQ's tag expressions have a parser of their own (:func:`parse_tags`): tag names
separated by ``||`` (``"TagA || TagB"``), or ``*`` for every record.

Every mistake raises :class:`~storage.errors.InvalidFilterError` whose ``position`` is the
0-based character index where the parser stopped understanding, and whose message names it.
Expressions are bounded: ``MAX_LENGTH`` characters (which bounds IN lists too) and
``MAX_DEPTH`` nested parentheses or NOTs (the recursion).
"""

from __future__ import annotations

from storage.errors import InvalidFilterError
from storage.filters.expr import (
    Expr,
    HasHeader,
    Header,
    Not,
    Tag,
    conjunction,
    disjunction,
    negate,
)

MAX_LENGTH = 4096
MAX_DEPTH = 32

_KEY_START = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz_")
_KEY_REST = _KEY_START | frozenset("0123456789.-")
_WORD = _KEY_START | frozenset("0123456789")


def _show(source: str, pos: int) -> str:
    return (
        f"{source[:pos]}⟨here⟩{source[pos:]}"
        if len(source) <= 200
        else f"…{source[max(0, pos - 40) : pos]}⟨here⟩{source[pos : pos + 40]}…"
    )


class _Parser:
    def __init__(self, source: str) -> None:
        self.s = source
        self.pos = 0
        self.depth = 0

    # ---- scanning -----------------------------------------------------------------------
    def fail(self, what: str, pos: int | None = None) -> InvalidFilterError:
        at = self.pos if pos is None else pos
        return InvalidFilterError(
            f"{what} at position {at} of the filter: {_show(self.s, at)}", position=at
        )

    def skip_space(self) -> None:
        s, n = self.s, len(self.s)
        while self.pos < n and s[self.pos].isspace():
            self.pos += 1

    def peek_word(self) -> str:
        """The keyword-like word at the position (upper-cased), without consuming it."""
        self.skip_space()
        end = self.pos
        while end < len(self.s) and self.s[end] in _WORD:
            end += 1
        return self.s[self.pos : end].upper()

    def word(self, expected: str) -> bool:
        if self.peek_word() != expected:
            return False
        self.pos += len(expected)
        return True

    def symbol(self, sym: str) -> bool:
        self.skip_space()
        if self.s.startswith(sym, self.pos):
            self.pos += len(sym)
            return True
        return False

    def expect(self, sym: str, what: str) -> None:
        if not self.symbol(sym):
            raise self.fail(f"expected {what}")

    def quoted(self, quote: str, what: str) -> str:
        """A ``quote``d string (a doubled quote inside stands for one); ``what`` names it."""
        self.skip_space()
        start = self.pos
        if not self.s.startswith(quote, self.pos):
            raise self.fail(f"expected {what} in {quote}quotes{quote}")
        out = []
        i = self.pos + 1
        while True:
            j = self.s.find(quote, i)
            if j < 0:
                raise self.fail(f"{what} without its closing {quote}", start)
            out.append(self.s[i:j])
            if self.s.startswith(quote, j + 1):  # a doubled quote stands for one
                out.append(quote)
                i = j + 2
                continue
            self.pos = j + 1
            return "".join(out)

    # ---- grammar ------------------------------------------------------------------------
    def parse(self) -> Expr:
        if len(self.s) > MAX_LENGTH:
            raise self.fail(f"a filter is at most {MAX_LENGTH} characters", MAX_LENGTH)
        self.skip_space()
        if self.pos == len(self.s):
            raise self.fail("expected a test (tag ... or header. ...)")
        e = self.or_expr()
        self.skip_space()
        if self.pos != len(self.s):
            raise self.fail("expected AND, OR or the end of the filter")
        return e

    def nest(self) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise self.fail(f"more than {MAX_DEPTH} nested parentheses or NOTs")

    def or_expr(self) -> Expr:
        items = [self.and_expr()]
        while self.word("OR"):
            items.append(self.and_expr())
        return disjunction(items)

    def and_expr(self) -> Expr:
        items = [self.not_expr()]
        while self.word("AND"):
            items.append(self.not_expr())
        return conjunction(items)

    def not_expr(self) -> Expr:
        if self.word("NOT"):
            self.nest()
            e = negate(self.not_expr())
            self.depth -= 1
            return e
        return self.primary()

    def primary(self) -> Expr:
        if self.symbol("("):
            self.nest()
            inner = self.or_expr()
            self.expect(")", "')'")
            self.depth -= 1
            return inner
        start = self.pos
        word = self.peek_word()
        if word == "TAG":
            self.pos += 3
            positive, values = self.compare()
            e: Expr = Tag(values)
            return e if positive else Not(e)
        if word == "HEADER":
            self.pos += 6
            self.expect(".", "'.' and a header key after 'header'")
            key = self.key()
            if self.word("IS"):
                negated = self.word("NOT")
                if not self.word("NULL"):
                    raise self.fail("expected NULL")
                return HasHeader(key) if negated else Not(HasHeader(key))
            positive, values = self.compare()
            e = Header(key, values)
            return e if positive else Not(e)
        raise self.fail("expected a test (tag ... or header. ...) or '('", start)

    def key(self) -> str:
        if self.s.startswith('"', self.pos):
            return self.quoted('"', "a header key")
        end = self.pos
        if end < len(self.s) and self.s[end] in _KEY_START:
            end += 1
            while end < len(self.s) and self.s[end] in _KEY_REST:
                end += 1
        if end == self.pos:
            raise self.fail('expected a header key (letters, digits, _ . -, or "quoted")')
        key = self.s[self.pos : end]
        self.pos = end
        return key

    def compare(self) -> tuple[bool, frozenset[str]]:
        """(positive, values) of ``= 'v'``, ``!= 'v'``, ``<> 'v'``, ``[NOT] IN (...)``."""
        if self.symbol("!=") or self.symbol("<>"):
            return False, frozenset((self.quoted("'", "a string"),))
        if self.symbol("="):
            return True, frozenset((self.quoted("'", "a string"),))
        positive = not self.word("NOT")
        if not self.word("IN"):
            raise self.fail("expected =, !=, <>, IN or NOT IN" if positive else "expected IN")
        self.expect("(", "'(' after IN")
        values = [self.quoted("'", "a string")]
        while self.symbol(","):
            values.append(self.quoted("'", "a string"))
        self.expect(")", "',' or ')'")
        return positive, frozenset(values)


def parse_expr(source: str) -> Expr:
    """The normalised AST of a filter expression (``InvalidFilterError`` if it does not parse)."""
    if not isinstance(source, str):
        raise InvalidFilterError(f"a filter is a string, not {type(source).__name__}", position=0)
    return _Parser(source).parse()


def parse_tags_expr(source: str) -> Expr | None:
    """RocketMQ's tag expression: ``"TagA || TagB"`` is ``tag IN ('TagA', 'TagB')``; ``"*"``
    (or only spaces) is every record (None). A tag name is anything but ``|`` around it,
    trimmed; an empty one is a mistake."""
    if not isinstance(source, str):
        raise InvalidFilterError(f"tags is a string, not {type(source).__name__}", position=0)
    if len(source) > MAX_LENGTH:
        raise InvalidFilterError(
            f"a tag expression is at most {MAX_LENGTH} characters", position=MAX_LENGTH
        )
    if source.strip() in ("", "*"):
        return None
    names = []
    pos = 0
    for part in source.split("||"):
        name = part.strip()
        if not name or "|" in name or name == "*":
            at = pos + (part.index("|") if "|" in part else len(part) - len(part.lstrip()))
            what = (
                "a lone '|' (tags are separated by '||')"
                if "|" in name
                else ("'*' mixed with tags" if name == "*" else "an empty tag name")
            )
            raise InvalidFilterError(
                f"{what} at position {at} of the tags: {_show(source, at)}", position=at
            )
        names.append(name)
        pos += len(part) + 2
    return Tag(frozenset(names))
