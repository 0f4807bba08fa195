"""Reading an op's fields (contract §7): each wrong field is a BadRequest whose
message names it, and never echoes more than a bounded piece of the input."""

from __future__ import annotations

from typing import TypeVar, overload

import numpy as np

from superfluid.abi import ECHO_BYTES, OpStatus

# An op: a decoded msgpack map, or an in-process caller's dict; field names its values' types.
OpMessage = dict[str, object]
_T = TypeVar("_T")
_U32 = (1 << 32) - 1
_U64 = (1 << 64) - 1
MAX_ERROR_BYTES = 256  # a whole error message, whatever it quotes (run_op clips it)


class OpError(Exception):
    def __init__(self, status: OpStatus, message: str):
        super().__init__(message)
        self.status = status


def clip(text: str, limit: int) -> str:
    """text cut to at most `limit` UTF-8 bytes (an ellipsis marks a cut)."""
    b = text.encode("utf-8", "replace")  # (a lone surrogate msgpack could not pack becomes "?")
    if len(b) <= limit:
        return b.decode("utf-8")
    return b[:max(0, limit - 3)].decode("utf-8", "ignore") + "..."


def echo(v: object) -> str:
    """A quote of an input value, at most ECHO_BYTES: a container is named,
    never rendered (its repr alone could be megabytes)."""
    if isinstance(v, (list, tuple, dict, set)):
        return f"a {type(v).__name__} of {len(v)}"
    if isinstance(v, int) and v.bit_length() > 128:  # repr would be slow, or refused
        return f"an int of {v.bit_length()} bits"
    if isinstance(v, (str, bytes, bytearray, memoryview)):
        v = v[:ECHO_BYTES]
    try:
        return clip(repr(v), ECHO_BYTES)
    except Exception:  # an in-process caller's object with a broken repr
        return f"a {type(v).__name__}"


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


@overload
def field(msg: OpMessage, name: str, kind: type[_T]) -> _T: ...
@overload
def field(msg: OpMessage, name: str, kind: tuple[type, ...]) -> object: ...
def field(msg: OpMessage, name: str, kind: type | tuple[type, ...]) -> object:
    if name not in msg:
        raise OpError(OpStatus.BadRequest, f"field {name!r} is missing")
    v = msg[name]
    if not isinstance(v, kind) or (isinstance(v, bool) and kind is not bool):
        raise OpError(OpStatus.BadRequest, f"field {name!r}: expected {_kind_name(kind)}, got {type(v).__name__}")
    return v


def handle(msg: OpMessage) -> int:
    h = field(msg, "handle", int)
    if not 0 < h <= _U64:
        raise OpError(OpStatus.BadRequest, f"field 'handle': {echo(h)} is not a handle")
    return h


def u64(msg: OpMessage, name: str, default: int | None = None) -> int:
    """An unsigned 64-bit field; default when absent (None: required)."""
    if name not in msg and default is not None:
        return default
    v = field(msg, name, int)
    if not 0 <= v <= _U64:
        raise OpError(OpStatus.BadRequest, f"field {name!r}: {echo(v)} is outside 0..{_U64}")
    return v


def flag(msg: OpMessage, name: str, default: bool = False) -> bool:
    return field(msg, name, bool) if name in msg else default


def u64_list(msg: OpMessage, name: str) -> list[int]:
    """A list of distinct unsigned 64-bit integers."""
    v = field(msg, name, list)
    for i, t in enumerate(v):
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t <= _U64:
            raise OpError(OpStatus.BadRequest,
                          f"field {name!r}: [{i}] = {echo(t)} is not an unsigned 64-bit integer")
    if len(set(v)) != len(v):
        seen: set[int] = set()
        for dup in v:
            if dup in seen:
                raise OpError(OpStatus.BadRequest, f"field {name!r}: {dup} appears twice")
            seen.add(dup)
    return v


def u32(msg: OpMessage, name: str, default: int | None = None, lo: int = 0, hi: int = _U32) -> int:
    """An unsigned 32-bit field in lo..hi; default when absent (None: required)."""
    if name not in msg and default is not None:
        return default
    v = field(msg, name, int)
    if not lo <= v <= hi:
        raise OpError(OpStatus.BadRequest, f"field {name!r}: {echo(v)} is outside {lo}..{hi}")
    return v


def tokens(msg: OpMessage, name: str, vocab: int) -> list[int]:
    """A non-empty list of token ids inside the vocabulary."""
    v = field(msg, name, list)
    if not v:
        raise OpError(OpStatus.BadRequest, f"field {name!r}: an empty token list")
    # Passes in C for the common case; the slow path names the bad entry. Types
    # first: numpy would size a string array by its longest entry.
    if all(issubclass(k, (int, np.integer)) and k is not bool for k in set(map(type, v))):
        try:
            arr = np.asarray(v)
            if arr.dtype.kind in "iu" and int(arr.min()) >= 0 and int(arr.max()) < vocab:
                return v
        except (ValueError, TypeError, OverflowError):
            pass
    for i, t in enumerate(v):
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
            raise OpError(OpStatus.BadRequest, f"field {name!r}: [{i}] = {echo(t)} is not a token of the "
                                               f"vocabulary of {vocab}")
    return v
