"""A tiny schema language for the wire protocol: typed fields in, bytes out, and back.

Every request and response body is a dataclass whose ``SCHEMA`` lists its fields in order with
their wire types. Types are little-endian like the record batches::

    int8 / int16 / int32 / int64     fixed width, signed
    string                           int16 length (-1 = null) + UTF-8 bytes
    bytes                            int32 length (-1 = null) + raw bytes (record batches travel
                                     here; decoding returns a zero-copy memoryview)
    array(T)                         int32 count (-1 = null) + count x T
    struct(C)                        the fields of dataclass C, in order

Decoding is sans-IO and defensive: every length is checked against what is left, an array
count must fit in the remaining bytes at the element's minimum size (so a 12-byte frame
cannot make us allocate a billion-element list), and any violation raises
:class:`MalformedFrameError` — never ``struct.error`` or ``IndexError``. Functions return
``(value, new_position)`` as kazoo's serialization does.
"""

from __future__ import annotations

import operator
import struct
from dataclasses import fields, is_dataclass
from typing import Any, ClassVar, Protocol

from storage.errors import MalformedFrameError


class WireType(Protocol):
    min_size: int

    def encode(self, value: Any, out: list[Any]) -> None: ...

    def decode(self, buf: memoryview, pos: int) -> tuple[Any, int]: ...


class _Fixed:
    def __init__(self, fmt: str, name: str) -> None:
        self.s = struct.Struct("<" + fmt)
        self.min_size = self.s.size
        self.name = name

    def encode(self, value: Any, out: list[Any]) -> None:
        try:
            out.append(self.s.pack(value))
        except struct.error as exc:
            raise ValueError(f"{self.name} field cannot hold {value!r}: {exc}") from None

    def decode(self, buf: memoryview, pos: int) -> tuple[Any, int]:
        end = pos + self.min_size
        if end > len(buf):
            raise MalformedFrameError(f"frame ends inside an {self.name}")
        return self.s.unpack_from(buf, pos)[0], end


INT8 = _Fixed("b", "int8")
INT16 = _Fixed("h", "int16")
INT32 = _Fixed("i", "int32")
INT64 = _Fixed("q", "int64")
_LEN16 = struct.Struct("<h")
_LEN32 = struct.Struct("<i")


class _String:
    min_size = 2

    def encode(self, value: str | None, out: list[Any]) -> None:
        if value is None:
            out.append(_LEN16.pack(-1))
            return
        data = value.encode()
        if len(data) > 32767:
            raise ValueError("string field longer than 32767 bytes")
        out.append(_LEN16.pack(len(data)))
        out.append(data)

    def decode(self, buf: memoryview, pos: int) -> tuple[str | None, int]:
        n, pos = INT16.decode(buf, pos)
        if n == -1:
            return None, pos
        if n < 0 or pos + n > len(buf):
            raise MalformedFrameError(f"string of {n} bytes does not fit the frame")
        try:
            return str(buf[pos : pos + n], "utf-8"), pos + n
        except UnicodeDecodeError:
            raise MalformedFrameError("string field is not valid UTF-8") from None


class _Bytes:
    min_size = 4

    def encode(self, value: Any, out: list[Any]) -> None:
        """A bytes-like value, or a list of them sent back to back as one field (no join)."""
        if value is None:
            out.append(_LEN32.pack(-1))
            return
        if isinstance(value, list):
            out.append(_LEN32.pack(sum(memoryview(v).nbytes for v in value)))
            out.extend(value)
            return
        out.append(_LEN32.pack(memoryview(value).nbytes))
        out.append(value)

    def decode(self, buf: memoryview, pos: int) -> tuple[memoryview | None, int]:
        n, pos = INT32.decode(buf, pos)
        if n == -1:
            return None, pos
        if n < 0 or pos + n > len(buf):
            raise MalformedFrameError(f"bytes field of {n} bytes does not fit the frame")
        return buf[pos : pos + n], pos + n


STRING = _String()
BYTES = _Bytes()


class Array:
    min_size = 4

    def __init__(self, item: WireType) -> None:
        self.item = item

    def encode(self, value: list[Any] | None, out: list[Any]) -> None:
        if value is None:
            out.append(_LEN32.pack(-1))
            return
        out.append(_LEN32.pack(len(value)))
        enc = self.item.encode
        for v in value:
            enc(v, out)

    def decode(self, buf: memoryview, pos: int) -> tuple[list[Any] | None, int]:
        n, pos = INT32.decode(buf, pos)
        if n == -1:
            return None, pos
        if n < 0 or n * max(1, self.item.min_size) > len(buf) - pos:
            raise MalformedFrameError(f"array of {n} elements does not fit the frame")
        out = []
        dec = self.item.decode
        for _ in range(n):
            v, pos = dec(buf, pos)
            out.append(v)
        return out, pos


class _FixedRun:
    """Consecutive fixed-width fields of a struct, packed and unpacked by one ``struct`` call
    (a response's fields are otherwise a Python call and a ``bytes`` each)."""

    def __init__(self, fields: list[tuple[str, _Fixed]]) -> None:
        self.fields = fields
        self.s = struct.Struct("<" + "".join(t.s.format[1:] for _, t in fields))
        self.min_size = self.s.size
        self.get = operator.attrgetter(*(n for n, _ in fields))
        self.single = len(fields) == 1

    def encode(self, value: Any, out: list[Any]) -> None:
        got = self.get(value)
        try:
            out.append(self.s.pack(got) if self.single else self.s.pack(*got))
        except struct.error:
            for (_, t), v in zip(self.fields, (got,) if self.single else got, strict=True):
                t.encode(v, [])  # raises the error that names the field's type
            raise

    def decode(self, buf: memoryview, pos: int) -> tuple[tuple[Any, ...], int]:
        end = pos + self.min_size
        if end > len(buf):  # field by field, for the error that names where the frame ends
            at = pos
            for _, t in self.fields:
                _, at = t.decode(buf, at)
        return self.s.unpack_from(buf, pos), end


class Struct:
    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.schema: tuple[tuple[str, WireType], ...] = cls.SCHEMA  # type: ignore[attr-defined]
        self.min_size = sum(t.min_size for _, t in self.schema)
        #: the schema with every run of fixed-width fields as one step
        self.plan: list[tuple[str | None, Any]] = []
        run: list[tuple[str, _Fixed]] = []
        for name, t in self.schema:
            if isinstance(t, _Fixed):
                run.append((name, t))
                continue
            if run:
                self.plan.append((None, _FixedRun(run)))
                run = []
            self.plan.append((name, t))
        if run:
            self.plan.append((None, _FixedRun(run)))

    def encode(self, value: Any, out: list[Any]) -> None:
        for name, t in self.plan:
            if name is None:
                t.encode(value, out)
            else:
                t.encode(getattr(value, name), out)

    def decode(self, buf: memoryview, pos: int) -> tuple[Any, int]:
        values: list[Any] = []
        for name, t in self.plan:
            v, pos = t.decode(buf, pos)
            if name is None:
                values.extend(v)
            else:
                values.append(v)
        return self.cls(*values), pos


class Message:
    """Base of every request/response body: a dataclass with a ``SCHEMA``."""

    SCHEMA: ClassVar[tuple[tuple[str, WireType], ...]] = ()
    _struct: ClassVar[Struct]

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)

    @classmethod
    def wire(cls) -> Struct:
        s: Struct | None = cls.__dict__.get("_struct")
        if s is None:
            assert is_dataclass(cls), cls
            names = tuple(f.name for f in fields(cls))
            if names != tuple(n for n, _ in cls.SCHEMA):
                raise TypeError(
                    f"{cls.__name__}: SCHEMA does not list the dataclass fields in order"
                )
            s = Struct(cls)
            cls._struct = s
        return s

    def encode(self) -> list[Any]:
        out: list[Any] = []
        self.wire().encode(self, out)
        return out

    @classmethod
    def decode(cls, buf: Any, pos: int = 0, *, exact: bool = True) -> Any:
        view = buf if isinstance(buf, memoryview) else memoryview(buf)
        value, end = cls.wire().decode(view, pos)
        if exact and end != len(view):
            raise MalformedFrameError(f"{len(view) - end} unexpected bytes after {cls.__name__}")
        return value


def struct_of(cls: type) -> Struct:
    return cls.wire()  # type: ignore[attr-defined, no-any-return]
