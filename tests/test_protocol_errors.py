"""Wire error codes (storage/errors.py: ``for_code``, ``from_wire``) as the protocol uses them.

An agent sends ``type(exc).code``; the client rebuilds an exception with ``from_wire``. For
every class in storage.errors that must give an instance of a class with the same code and the
same ``retriable`` flag (the client's retry decision), with the message the agent sent. Several
classes may share a code (a family, e.g. InvalidRequestError / MalformedFrameError); the
client then gets the family's root, so the shared code must mean the same retry decision.
"""

from __future__ import annotations

import inspect
import struct

import pytest

import storage.errors as errors_module
from storage.errors import StrataError, for_code, from_wire
from storage.protocol import encode_error_response, parse_response

ERROR_CLASSES: list[type[StrataError]] = [
    cls
    for _, cls in inspect.getmembers(errors_module, inspect.isclass)
    if issubclass(cls, StrataError) and cls.__module__ == errors_module.__name__
]

# Bugs in storage/errors.py (not this suite's to fix). Each entry is an xfail(strict=True), so
# the test starts failing as soon as the bug is fixed and the entry must be removed.
RETRIABLE_LOST_ON_THE_WIRE: dict[str, str] = {}


def _params(names_to_reasons: dict[str, str]) -> list[object]:
    return [
        pytest.param(
            cls,
            id=cls.__name__,
            marks=[pytest.mark.xfail(reason=names_to_reasons[cls.__name__], strict=True)]
            if cls.__name__ in names_to_reasons
            else [],
        )
        for cls in ERROR_CLASSES
    ]


def test_the_tree_is_found() -> None:
    names = {c.__name__ for c in ERROR_CLASSES}
    assert {"StrataError", "NotLeaderError", "MalformedFrameError", "FrameTooLargeError"} <= names


@pytest.mark.parametrize("cls", _params(RETRIABLE_LOST_ON_THE_WIRE))
def test_code_round_trips_with_its_retriable_flag(cls: type[StrataError]) -> None:
    err = from_wire(cls.code, "the agent's words")
    assert isinstance(err, StrataError)
    assert err.code == cls.code
    assert type(err).code == cls.code
    assert str(err) == "the agent's words"
    assert err.retriable == cls.retriable


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda c: c.__name__)
def test_code_fits_the_int16_error_field(cls: type[StrataError]) -> None:
    assert -(2**15) <= cls.code < 2**15
    assert cls.code != 0  # 0 means "no error" on the wire


def test_a_shared_code_belongs_to_one_family_and_decodes_to_its_root() -> None:
    by_code: dict[int, list[type[StrataError]]] = {}
    for cls in ERROR_CLASSES:
        by_code.setdefault(cls.code, []).append(cls)
    for code, classes in by_code.items():
        root = for_code(code)
        assert root in classes, code
        assert all(issubclass(c, root) for c in classes), (code, classes)


@pytest.mark.parametrize("code", [0, 4, 999, -2, 2**15 - 1, -(2**15)])
def test_unknown_codes_give_a_strata_error_with_the_code(code: int) -> None:
    err = from_wire(code, "from a newer agent")
    assert type(err) is StrataError
    assert err.code == code
    assert str(err) == "from a newer agent"
    assert not err.retriable
    assert StrataError.code == -1  # the instance attribute did not leak into the class
    assert str(from_wire(code)) == f"StrataError (error code {code})"


@pytest.mark.parametrize("cls", _params(RETRIABLE_LOST_ON_THE_WIRE))
def test_error_response_frame_carries_the_typed_error(cls: type[StrataError]) -> None:
    frame = b"".join(encode_error_response(3, cls.code, f"{cls.__name__} happened"))
    (size,) = struct.unpack_from("<i", frame)
    assert size == len(frame) - 4
    err = parse_response(frame[4:]).error()
    assert err is not None
    assert type(err).code == cls.code
    assert err.retriable == cls.retriable
    assert str(err) == f"{cls.__name__} happened"


# from_wire builds the instance without calling __init__; errors.py says StrataError holds
# class-level defaults "so that an error rebuilt from a wire code has every attribute its class
# promises". Attributes set in __init__ and without such a default are missing.
PROMISED_ATTRIBUTES = {
    "NotLeaderError": ("leader_id", "leader_epoch"),
    "CorruptBatchError": ("reason", "position"),
    "OffsetOutOfRangeError": ("offset", "log_start", "log_end"),
    "BatchTooLargeError": ("size", "limit"),
    "CorruptSegmentError": ("path", "position"),
}
ATTRIBUTES_MISSING: dict[str, str] = {}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(
            n,
            marks=[pytest.mark.xfail(reason=ATTRIBUTES_MISSING[n], strict=True)]
            if n in ATTRIBUTES_MISSING
            else [],
        )
        for n in PROMISED_ATTRIBUTES
    ],
)
def test_rebuilt_errors_have_the_attributes_their_class_promises(name: str) -> None:
    cls = getattr(errors_module, name)
    err = from_wire(cls.code, "x")
    assert type(err) is cls
    for attr in PROMISED_ATTRIBUTES[name]:
        assert hasattr(err, attr), attr
