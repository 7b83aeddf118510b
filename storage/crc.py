"""CRC32C (Castagnoli) through google-crc32c's C implementation.

The pure-Python fallback of google-crc32c is ~1000x slower; running on it would silently turn
every produce and fetch into a CPU hog, so importing this module fails loudly instead.
"""

from __future__ import annotations

from typing import Any

import google_crc32c

IMPLEMENTATION: str = google_crc32c.implementation
if IMPLEMENTATION != "c":  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        "google-crc32c is using its pure-Python fallback; install a wheel with the C extension"
    )

_value = google_crc32c.value
_extend = google_crc32c.extend


def crc32c(data: Any, crc: int = 0) -> int:
    """CRC32C of ``data`` (bytes, or any read-only buffer such as a pyarrow Buffer), continuing ``crc``."""
    if type(data) is memoryview:
        # google-crc32c rejects memoryviews; a pyarrow Buffer over it is zero-copy.
        import pyarrow as pa

        data = pa.py_buffer(data)
    return int(_extend(crc, data) if crc else _value(data))


# ---- combining: the CRC of a || b from the CRCs of a and b ------------------------------
# zlib's crc32_combine (1.2.12+: multmodp / x2nmodp) for the Castagnoli polynomial: a few
# dozen 32-bit carry-less multiplications in Python instead of a pass over ``b``'s bytes.
_POLY = 0x82F63B78  # CRC32C, bit-reflected


def _multmodp(a: int, b: int) -> int:
    """a(x) * b(x) modulo the polynomial (bit-reflected 32-bit operands)."""
    if not a:
        return 0  # (the loop below ends at ``a``'s lowest set bit: it needs one)
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
    table = [1 << 30]  # x^1
    for _ in range(31):
        table.append(_multmodp(table[-1], table[-1]))
    return table


_X2N = _x2n_table()  # x^(2^k) modulo the polynomial
_SHIFTS: dict[int, int] = {}  # length -> x^(8 * length): batches often repeat their length


def _shift(length: int) -> int:
    op = _SHIFTS.get(length)
    if op is None:
        op, n, k = 1 << 31, length, 3  # x^0; 8 * length = length * 2^3
        while n:
            if n & 1:
                op = _multmodp(_X2N[k & 31], op)
            n >>= 1
            k += 1
        if len(_SHIFTS) >= 256:
            _SHIFTS.clear()
        _SHIFTS[length] = op
    return op


def crc32c_combine(crc_a: int, crc_b: int, length_b: int) -> int:
    """``crc32c(a + b)`` from ``crc32c(a)``, ``crc32c(b)`` and ``len(b)`` (no pass over the
    bytes: a CRC already computed to check ``b`` is not computed again to cover it)."""
    if length_b < 0:
        raise ValueError(f"a length of {length_b} bytes")
    if length_b == 0:
        return crc_a
    return _multmodp(_shift(length_b), crc_a) ^ crc_b
