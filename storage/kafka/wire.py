"""Kafka's wire types and a schema language for its messages: sans-IO, big-endian.

Kafka describes every request and response as a list of fields, each present in a range of
versions, some nullable in a range of versions; from a message's *flexible* version on
(KIP-482) strings, bytes and arrays carry unsigned-varint lengths ("compact", length + 1,
0 = null) and every struct ends with a tagged-field section. :class:`Schema` is that
description; ``Schema.codec(version)`` compiles it once per version into a decoder and an
encoder (closures over precompiled ``struct.Struct``\\s), so a request costs one pass and no
per-field interpretation::

    int8 / int16 / int32 / int64 / bool     fixed width, big-endian
    uuid                                    16 bytes
    string    int16 length (-1 null)        compact: uvarint length + 1 (0 null)
    bytes     int32 length (-1 null)        compact: uvarint length + 1 (0 null)
    records   as bytes; decodes to a zero-copy memoryview (record batches)
    [T]       int32 count (-1 null)         compact: uvarint count + 1 (0 null)
    tagged    (flexible only) uvarint count, then per field uvarint tag, uvarint size, bytes

Values are plain dicts keyed by the fields' snake_case names; a field missing from a dict
being encoded takes its default. Tagged fields of requests are skipped on decode (none of
the versions served needs one) and none are written.

Decoding is defensive: every length is checked against what is left, an array count must
fit the remaining bytes at the element's minimum size, and any violation raises
:class:`~storage.errors.MalformedFrameError` (Kafka's INVALID_REQUEST), never
``struct.error`` or ``IndexError``. Functions return ``(value, new_position)``.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from storage.errors import MalformedFrameError

Decoder = Callable[[memoryview, int], tuple[Any, int]]
Encoder = Callable[[Any, list[Any]], None]

_I8 = struct.Struct(">b")
_I16 = struct.Struct(">h")
_I32 = struct.Struct(">i")
_I64 = struct.Struct(">q")
_F64 = struct.Struct(">d")


# ---- varints (also used by the record format) ---------------------------------------------
def read_uvarint(buf: Any, pos: int) -> tuple[int, int]:
    """An unsigned LEB128 varint of at most 5 bytes (a uint32)."""
    result = 0
    shift = 0
    end = len(buf)
    while True:
        if pos >= end:
            raise MalformedFrameError("frame ends inside a varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 28:
            raise MalformedFrameError("varint longer than 5 bytes")


def write_uvarint(value: int) -> bytes:
    if value < 0x80:
        return bytes((value,))
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def read_varint(buf: Any, pos: int, *, long: bool = False) -> tuple[int, int]:
    """A zigzag-encoded signed varint (int32, or int64 with ``long``)."""
    result = 0
    shift = 0
    end = len(buf)
    limit = 63 if long else 28
    while True:
        if pos >= end:
            raise MalformedFrameError("frame ends inside a varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return (result >> 1) ^ -(result & 1), pos
        shift += 7
        if shift > limit:
            raise MalformedFrameError("varint too long")


def write_varint(value: int) -> bytes:
    return write_uvarint((value << 1) ^ (value >> 63))


def _fixed(s: struct.Struct, what: str) -> tuple[Decoder, Encoder, int]:
    size = s.size
    unpack_from = s.unpack_from
    pack = s.pack

    def decode(buf: memoryview, pos: int) -> tuple[Any, int]:
        end = pos + size
        if end > len(buf):
            raise MalformedFrameError(f"frame ends inside an {what}")
        return unpack_from(buf, pos)[0], end

    def encode(value: Any, out: list[Any]) -> None:
        try:
            out.append(pack(value))
        except struct.error as exc:
            raise ValueError(f"{what} field cannot hold {value!r}: {exc}") from None

    return decode, encode, size


# ---- types ---------------------------------------------------------------------------------
class Type:
    """A wire type; ``coder(flexible, nullable)`` gives (decode, encode, min_size)."""

    name = "?"

    def coder(self, flexible: bool, nullable: bool) -> tuple[Decoder, Encoder, int]:
        raise NotImplementedError

    def default(self) -> Any:
        return None


class _Int(Type):
    def __init__(self, name: str, s: struct.Struct) -> None:
        self.name = name
        self.s = s

    def coder(self, flexible: bool, nullable: bool) -> tuple[Decoder, Encoder, int]:
        return _fixed(self.s, self.name)

    def default(self) -> Any:
        return 0


class _Bool(Type):
    name = "bool"

    def coder(self, flexible: bool, nullable: bool) -> tuple[Decoder, Encoder, int]:
        dec, _, size = _fixed(_I8, "bool")

        def decode(buf: memoryview, pos: int) -> tuple[bool, int]:
            v, pos = dec(buf, pos)
            return bool(v), pos

        def encode(value: Any, out: list[Any]) -> None:
            out.append(b"\x01" if value else b"\x00")

        return decode, encode, size

    def default(self) -> Any:
        return False


class _Uuid(Type):
    name = "uuid"

    def coder(self, flexible: bool, nullable: bool) -> tuple[Decoder, Encoder, int]:
        def decode(buf: memoryview, pos: int) -> tuple[bytes, int]:
            if pos + 16 > len(buf):
                raise MalformedFrameError("frame ends inside a uuid")
            return bytes(buf[pos : pos + 16]), pos + 16

        def encode(value: Any, out: list[Any]) -> None:
            out.append(bytes(value) if value else bytes(16))

        return decode, encode, 16

    def default(self) -> Any:
        return bytes(16)


def _length_coder(flexible: bool, nullable: bool, wide: bool, what: str) -> tuple[Any, Any]:
    """(read_length, write_length) for strings (int16), bytes/arrays (int32), or compact."""
    if flexible:

        def read(buf: memoryview, pos: int) -> tuple[int, int]:
            n, pos = read_uvarint(buf, pos)
            return n - 1, pos

        def write(n: int, out: list[Any]) -> None:
            out.append(write_uvarint(n + 1))

    else:
        s = _I32 if wide else _I16
        dec, enc, _ = _fixed(s, what)

        def read(buf: memoryview, pos: int) -> tuple[int, int]:
            n, pos = dec(buf, pos)
            return int(n), pos

        def write(n: int, out: list[Any]) -> None:
            enc(n, out)

    return read, write


class _String(Type):
    name = "string"

    def coder(self, flexible: bool, nullable: bool) -> tuple[Decoder, Encoder, int]:
        read, write = _length_coder(flexible, nullable, False, "string length")

        def decode(buf: memoryview, pos: int) -> tuple[str | None, int]:
            n, pos = read(buf, pos)
            if n < 0:
                if n == -1 and nullable:
                    return None, pos
                raise MalformedFrameError(f"string of length {n}")
            end = pos + n
            if end > len(buf):
                raise MalformedFrameError(f"string of {n} bytes does not fit the frame")
            try:
                return str(buf[pos:end], "utf-8"), end
            except UnicodeDecodeError:
                raise MalformedFrameError("string field is not valid UTF-8") from None

        def encode(value: Any, out: list[Any]) -> None:
            if value is None:
                if not nullable:
                    raise ValueError("null in a non-nullable string field")
                write(-1, out)
                return
            data = value.encode()
            if not flexible and len(data) > 32767:
                raise ValueError("string field longer than 32767 bytes")
            write(len(data), out)
            out.append(data)

        return decode, encode, 1 if flexible else 2

    def default(self) -> Any:
        return ""


class _Bytes(Type):
    name = "bytes"

    def coder(self, flexible: bool, nullable: bool) -> tuple[Decoder, Encoder, int]:
        read, write = _length_coder(flexible, nullable, True, "bytes length")

        def decode(buf: memoryview, pos: int) -> tuple[memoryview | None, int]:
            n, pos = read(buf, pos)
            if n < 0:
                if n == -1 and nullable:
                    return None, pos
                raise MalformedFrameError(f"bytes field of length {n}")
            end = pos + n
            if end > len(buf):
                raise MalformedFrameError(f"bytes field of {n} bytes does not fit the frame")
            return buf[pos:end], end

        def encode(value: Any, out: list[Any]) -> None:
            """A bytes-like value, or a list of them sent back to back as one field."""
            if value is None:
                if not nullable:
                    raise ValueError("null in a non-nullable bytes field")
                write(-1, out)
                return
            if isinstance(value, list):
                write(sum(memoryview(v).nbytes for v in value), out)
                out.extend(value)
                return
            write(memoryview(value).nbytes, out)
            out.append(value)

        return decode, encode, 1 if flexible else 4

    def default(self) -> Any:
        return b""


INT8: Type = _Int("int8", _I8)
INT16: Type = _Int("int16", _I16)
INT32: Type = _Int("int32", _I32)
INT64: Type = _Int("int64", _I64)
FLOAT64: Type = _Int("float64", _F64)
BOOL: Type = _Bool()
UUID: Type = _Uuid()
STRING: Type = _String()
BYTES: Type = _Bytes()
RECORDS: Type = _Bytes()


class Array(Type):
    name = "array"

    def __init__(self, item: Type | Schema) -> None:
        self.item = item

    def coder(self, flexible: bool, nullable: bool) -> tuple[Decoder, Encoder, int]:
        raise TypeError("arrays are compiled by Schema.codec (they need the version)")

    def compile(self, version: int, flexible: bool, nullable: bool) -> tuple[Decoder, Encoder]:
        if isinstance(self.item, Schema):
            item_dec, item_enc, item_min = self.item.compile(version, flexible)
        else:
            item_dec, item_enc, item_min = self.item.coder(flexible, False)
        read, write = _length_coder(flexible, nullable, True, "array length")
        item_min = max(item_min, 1)

        def decode(buf: memoryview, pos: int) -> tuple[list[Any] | None, int]:
            n, pos = read(buf, pos)
            if n < 0:
                if n == -1 and nullable:
                    return None, pos
                raise MalformedFrameError(f"array of length {n}")
            if n * item_min > len(buf) - pos:
                raise MalformedFrameError(f"array of {n} elements does not fit the frame")
            out = []
            for _ in range(n):
                v, pos = item_dec(buf, pos)
                out.append(v)
            return out, pos

        def encode(value: Any, out: list[Any]) -> None:
            if value is None:
                if not nullable:
                    raise ValueError("null in a non-nullable array field")
                write(-1, out)
                return
            write(len(value), out)
            for v in value:
                item_enc(v, out)

        return decode, encode

    def default(self) -> Any:
        return []


def versions(spec: str | None) -> tuple[int, int] | None:
    """``"3+"`` -> (3, inf); ``"1-4"`` -> (1, 4); ``"2"`` -> (2, 2); None -> None."""
    if spec is None:
        return None
    if spec.endswith("+"):
        return int(spec[:-1]), 1 << 15
    lo, _, hi = spec.partition("-")
    return int(lo), int(hi or lo)


@dataclass(frozen=True, slots=True)
class Field:
    name: str
    type: Type | Schema | Array
    present: tuple[int, int]
    nullable: tuple[int, int] | None
    default: Any

    def in_version(self, v: int) -> bool:
        return self.present[0] <= v <= self.present[1]

    def nullable_in(self, v: int) -> bool:
        return self.nullable is not None and self.nullable[0] <= v <= self.nullable[1]


def F(
    name: str,
    type_: Type | Schema | Array,
    present: str = "0+",
    *,
    nullable: str | None = None,
    default: Any = ...,
) -> Field:
    """A field: its name, type, the versions it is in and those in which it may be null."""
    pv = versions(present)
    assert pv is not None
    if default is ...:
        default = type_.default() if isinstance(type_, Type) else None
    return Field(name, type_, pv, versions(nullable), default)


@dataclass(eq=False)
class Schema:
    """A struct: fields in wire order. ``flexible`` is the first flexible version of the
    message it belongs to (None: never), set on the top-level schema only."""

    name: str
    fields: Sequence[Field]
    flexible: int | None = None
    _cache: dict[tuple[int, bool], tuple[Decoder, Encoder, int]] = field(
        default_factory=dict, repr=False
    )

    def default(self) -> Any:
        return {}

    def is_flexible(self, version: int) -> bool:
        return self.flexible is not None and version >= self.flexible

    def codec(self, version: int) -> tuple[Decoder, Encoder]:
        dec, enc, _ = self.compile(version, self.is_flexible(version))
        return dec, enc

    def compile(self, version: int, flexible: bool) -> tuple[Decoder, Encoder, int]:
        key = (version, flexible)
        got = self._cache.get(key)
        if got is not None:
            return got
        parts: list[tuple[str, Decoder, Encoder, Any]] = []
        absent: dict[str, Any] = {}  # fields not in this version decode to their default
        min_size = 0
        for f in self.fields:
            if not f.in_version(version):
                absent[f.name] = (
                    {} if isinstance(f.type, Schema) and f.default is None else f.default
                )
                continue
            nullable = f.nullable_in(version)
            if isinstance(f.type, Schema):
                dec, enc, size = f.type.compile(version, flexible)
            elif isinstance(f.type, Array):
                dec, enc = f.type.compile(version, flexible, nullable)
                size = 1 if flexible else 4
            else:
                dec, enc, size = f.type.coder(flexible, nullable)
            min_size += size
            default = f.default
            if isinstance(f.type, Schema) and default is None:
                default = {}
            parts.append((f.name, dec, enc, default))
        if flexible:
            min_size += 1
        names = tuple(p[0] for p in parts)
        decoders = tuple(p[1] for p in parts)
        encoders = tuple((p[0], p[2], p[3]) for p in parts)

        def decode(buf: memoryview, pos: int) -> tuple[dict[str, Any], int]:
            values = []
            for d in decoders:
                v, pos = d(buf, pos)
                values.append(v)
            if flexible:
                pos = skip_tagged_fields(buf, pos)
            out = dict(absent)
            out.update(zip(names, values, strict=True))
            return out, pos

        def encode(value: Any, out: list[Any]) -> None:
            get = value.get
            for name, e, default in encoders:
                v = get(name, default)
                e(v, out)
            if flexible:
                out.append(b"\x00")

        result = (decode, encode, min_size)
        self._cache[key] = result
        return result

    def decode(self, buf: Any, version: int, pos: int = 0, *, exact: bool = True) -> Any:
        view = buf if isinstance(buf, memoryview) else memoryview(buf)
        dec, _ = self.codec(version)
        value, end = dec(view, pos)
        if exact and end != len(view):
            raise MalformedFrameError(f"{len(view) - end} unexpected bytes after {self.name}")
        return value

    def encode(self, value: dict[str, Any], version: int) -> list[Any]:
        out: list[Any] = []
        _, enc = self.codec(version)
        enc(value, out)
        return out


def skip_tagged_fields(buf: memoryview, pos: int) -> int:
    count, pos = read_uvarint(buf, pos)
    for _ in range(count):
        _tag, pos = read_uvarint(buf, pos)
        size, pos = read_uvarint(buf, pos)
        pos += size
        if pos > len(buf):
            raise MalformedFrameError("tagged field runs past the frame")
    return pos


def encoded(parts: list[Any]) -> bytes:
    return b"".join(bytes(p) if not isinstance(p, bytes) else p for p in parts)
