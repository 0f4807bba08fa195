"""Reading an op's fields (SPEC §7): each wrong field is a BadRequest whose
message names it, and never echoes more than a bounded piece of the input."""

from __future__ import annotations

from typing import Any

import numpy as np

from superfluid.abi import OpStatus

_U32 = (1 << 32) - 1


class OpError(Exception):
    def __init__(self, status: OpStatus, message: str):
        super().__init__(message)
        self.status = status


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def field(msg: dict, name: str, kind: type | tuple[type, ...]) -> Any:
    if name not in msg:
        raise OpError(OpStatus.BadRequest, f"field {name!r} is missing")
    v = msg[name]
    if not isinstance(v, kind) or isinstance(v, bool) and kind is not bool:
        raise OpError(OpStatus.BadRequest, f"field {name!r}: expected {_kind_name(kind)}, got {type(v).__name__}")
    return v


def handle(msg: dict) -> int:
    h = field(msg, "handle", int)
    if h <= 0:
        raise OpError(OpStatus.BadRequest, f"field 'handle': {h} is not a handle")
    return h


def u32(msg: dict, name: str, default: int | None = None, lo: int = 0) -> int:
    """An unsigned 32-bit field, at least lo; default when absent (None: required)."""
    if name not in msg and default is not None:
        return default
    v = field(msg, name, int)
    if not lo <= v <= _U32:
        raise OpError(OpStatus.BadRequest, f"field {name!r}: {v} is outside {lo}..{_U32}")
    return v


def tokens(msg: dict, name: str, vocab: int) -> list[int]:
    """A non-empty list of token ids inside the vocabulary."""
    v = field(msg, name, list)
    if not v:
        raise OpError(OpStatus.BadRequest, f"field {name!r}: an empty token list")
    try:  # one pass in C for the common case; the slow path names the bad entry
        arr = np.asarray(v)
        if (arr.dtype.kind in "iu" and arr.ndim == 1 and int(arr.min()) >= 0 and int(arr.max()) < vocab
                and not any(t is True or t is False for t in v)):
            return v
    except (ValueError, TypeError, OverflowError):
        pass
    for i, t in enumerate(v):
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
            shown = repr(t)[:32]
            raise OpError(OpStatus.BadRequest, f"field {name!r}: [{i}] = {shown} is not a token of the "
                                               f"vocabulary of {vocab}")
    return v
