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
