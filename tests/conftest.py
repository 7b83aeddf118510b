"""Session-wide checks and fixtures shared by every test module."""

from __future__ import annotations

import google_crc32c
import pytest

import storage.crc


@pytest.fixture(scope="session", autouse=True)
def _c_accelerated_crc32c() -> None:
    """Every produce and fetch runs CRC32C; on the pure-Python fallback it is ~1000x slower."""
    assert google_crc32c.implementation == "c", "google-crc32c runs without its C extension"
    assert storage.crc.IMPLEMENTATION == "c", "storage.crc is not on the C implementation"
