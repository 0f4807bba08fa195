"""The leader's messages to the other ranks: a list of ops, one message a step.

An op is a kind, a few integers and some arrays. The pool's data ops (zero
fresh blocks' values, copy a block, write imported cells, read cells for an
export) queue up on the leader and go with the next step, in order, so a
follower's pool is changed exactly as the leader's was before the forward
pass reads it. Format: a u32 header length, the header (JSON: kinds, ints,
each array's dtype and shape), then the arrays' bytes back to back.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from typing import Any

import numpy as np

__all__ = ["KINDS", "Op", "decode", "encode"]

KINDS = ("zero", "copy", "write", "read", "step", "stop")
_HEAD = struct.Struct("<I")
_DTYPES = ("int64", "int32", "float32", "uint16", "uint8")


@dataclasses.dataclass
class Op:
    kind: str
    ints: dict[str, int] = dataclasses.field(default_factory=dict)
    arrays: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)


def encode(ops: list[Op]) -> bytes:
    head: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for op in ops:
        if op.kind not in KINDS:
            raise ValueError(f"unknown op kind {op.kind!r}")
        arrays = []
        for name, a in op.arrays.items():
            a = np.ascontiguousarray(a)
            if a.dtype.name not in _DTYPES:
                raise ValueError(f"op {op.kind}: array {name} of dtype {a.dtype}")
            arrays.append([name, a.dtype.name, list(a.shape)])
            blobs.append(a.tobytes())
        head.append({"kind": op.kind, "ints": op.ints, "arrays": arrays})
    h = json.dumps(head, separators=(",", ":")).encode()
    return _HEAD.pack(len(h)) + h + b"".join(blobs)


def decode(data: bytes) -> list[Op]:
    (n,) = _HEAD.unpack_from(data)
    head = json.loads(data[_HEAD.size:_HEAD.size + n])
    at = _HEAD.size + n
    view = memoryview(data)
    ops = []
    for entry in head:
        arrays = {}
        for name, dtype, shape in entry["arrays"]:
            if dtype not in _DTYPES:
                raise ValueError(f"op {entry['kind']}: array {name} of dtype {dtype}")
            dt = np.dtype(dtype)
            size = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
            if at + size > len(data):
                raise ValueError(f"op {entry['kind']}: array {name} runs past the message")
            arrays[name] = np.frombuffer(view[at:at + size], dtype=dt).reshape(shape)
            at += size
        ops.append(Op(entry["kind"], {k: int(v) for k, v in entry["ints"].items()}, arrays))
    if at != len(data):
        raise ValueError(f"{len(data) - at} bytes past the last op")
    return ops
