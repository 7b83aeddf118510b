"""Names users give things (topics), checked the same way by the SDK, the agents and the admin
API. Pure: no I/O, no third-party imports, so the SDK can check a name before any round trip."""

from __future__ import annotations

import re
from typing import Any

from storage.errors import InvalidTopicError

_TOPIC_NAME = re.compile(r"[a-zA-Z0-9._-]{1,249}")


def validate_topic_name(name: Any) -> str:
    """Kafka's rule: 1-249 of ``[a-zA-Z0-9._-]``, and not ``.`` or ``..``."""
    if not isinstance(name, str) or not _TOPIC_NAME.fullmatch(name) or name in {".", ".."}:
        raise InvalidTopicError(
            f"invalid topic name {name!r}: use 1-249 characters of [a-zA-Z0-9._-], not '.' or '..'"
        )
    return name
