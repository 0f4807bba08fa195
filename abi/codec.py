"""Records to slot bytes and back: MsgHeader, the record, then its arena.

A slot holds `MsgHeader {kind, record_bytes, arena_bytes}`, the top-level
record right after it, and the arena from the next 8-byte boundary. Spans
inside the record (and inside arena records) are `{offset, count}` into the
arena. Decoding trusts nothing: sizes, kinds and every span are checked and a
failure is a CodecError carrying the status (RejectBounds) and the field.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from superfluid.abi import ARENA_ALIGN, Status, ffi, record_dtype
from superfluid.abi.records import CLASSES, LAYOUTS, TOP_LEVEL

MSG_HEADER_BYTES = ffi.sizeof("MsgHeader")
_MSG_DT = record_dtype("MsgHeader")


class CodecError(Exception):
    """A message that cannot be decoded: `status` says which reject, `field`
    names where (e.g. "admits[3].prompt"), `message` says why."""

    def __init__(self, status: int, field: str, message: str):
        super().__init__(f"{Status(status).name}: {field}: {message}")
        self.status = Status(status)
        self.field = field
        self.message = message


class EncodeError(ValueError):
    """A record that cannot be written (does not fit its slot, or a value out
    of its field's range)."""


def align(n: int, to: int = ARENA_ALIGN) -> int:
    return (n + to - 1) // to * to


def arena_offset(record_bytes: int) -> int:
    """Where the arena starts in a slot, for a record of this many bytes."""
    return MSG_HEADER_BYTES + align(record_bytes)


# ------------------------------------------------------------------ encode


class _Arena:
    __slots__ = ("buf",)

    def __init__(self) -> None:
        self.buf = bytearray()

    def place(self, data: bytes) -> int:
        if not data:
            return 0
        off = align(len(self.buf))
        self.buf.extend(b"\0" * (off - len(self.buf)))
        self.buf.extend(data)
        return off


def _to_tuple(name: str, rec: Any, arena: _Arena, path: str) -> tuple:
    out = []
    layout = LAYOUTS[name]
    if len(rec) != len(layout):
        raise EncodeError(f"{path}: {name} takes {len(layout)} fields, got {len(rec)}")
    for f, v in zip(layout, rec):
        kind = f.kind
        if kind == "scalar":
            out.append(v)
        elif kind == "struct":
            out.append(_to_tuple(f.sub, v, arena, f"{path}.{f.name}"))
        elif kind == "array":
            v = tuple(v)
            if len(v) > f.length:
                raise EncodeError(f"{path}.{f.name}: at most {f.length} values, got {len(v)}")
            out.append(v + (0,) * (f.length - len(v)))
        elif kind == "chars":
            b = v.encode() if isinstance(v, str) else bytes(v)
            if len(b) > f.length:
                raise EncodeError(f"{path}.{f.name}: at most {f.length} bytes, got {len(b)}")
            out.append(b)
        else:  # span
            if f.sub is bytes:
                b = v.encode() if isinstance(v, str) else bytes(v)
                out.append((arena.place(b), len(b)))
            else:
                items = [_to_tuple(f.sub, it, arena, f"{path}.{f.name}[{i}]") for i, it in enumerate(v)]
                data = np.array(items, dtype=record_dtype(f.sub)).tobytes() if items else b""
                out.append((arena.place(data), len(items)))
    return tuple(out)


def _prepare(name: str, record: Any) -> tuple[int, bytes, bytearray]:
    size = ffi.sizeof(name)
    if LAYOUTS[name][0].name == "struct_size" and record[0] == 0:
        record = record._replace(struct_size=size)
    arena = _Arena()
    try:
        top = _to_tuple(name, record, arena, name)
        rec = np.array([top], dtype=record_dtype(name)).tobytes()
    except EncodeError:
        raise
    except (OverflowError, ValueError, TypeError) as e:
        raise EncodeError(f"{name}: {e}") from e
    return size, rec, arena.buf


def _write(mv: memoryview, kind: int, size: int, rec: bytes, arena: bytearray) -> int:
    start = arena_offset(size)
    total = start + len(arena)
    if total > len(mv):
        raise EncodeError(f"message needs {total} bytes, the slot has {len(mv)}")
    np.frombuffer(mv, dtype=_MSG_DT, count=1, offset=0)[0] = (kind, size, len(arena))
    mv[MSG_HEADER_BYTES:MSG_HEADER_BYTES + size] = rec
    mv[MSG_HEADER_BYTES + size:start] = bytes(start - MSG_HEADER_BYTES - size)
    mv[start:total] = arena
    return total


def encode_into(buf, name: str, record: Any, kind: int | None = None) -> int:
    """Write `record` (struct `name`) with its arena into the writable buffer
    `buf`, from offset 0. Returns the bytes written."""
    kind = TOP_LEVEL[name] if kind is None else kind
    return _write(memoryview(buf).cast("B"), kind, *_prepare(name, record))


def encode(name: str, record: Any, kind: int | None = None) -> bytes:
    """`record` as the bytes of a slot message."""
    kind = TOP_LEVEL[name] if kind is None else kind
    size, rec, arena = _prepare(name, record)
    buf = bytearray(arena_offset(size) + len(arena))
    _write(memoryview(buf), kind, size, rec, arena)
    return bytes(buf)


# ------------------------------------------------------------------ decode


def _bounds(field: str, message: str) -> CodecError:
    return CodecError(Status.RejectBounds, field, message)


def _from_tuple(name: str, t: tuple, arena: memoryview, path: str) -> Any:
    layout = LAYOUTS[name]
    vals = list(t)
    for i, f in enumerate(layout):
        kind = f.kind
        if kind == "struct":
            vals[i] = _from_tuple(f.sub, vals[i], arena, f"{path}.{f.name}")
        elif kind == "array":
            vals[i] = tuple(vals[i])
        elif kind == "span":
            vals[i] = _read_span(arena, vals[i], f.sub, f"{path}.{f.name}")
    return CLASSES[name]._make(vals)


def _read_span(arena: memoryview, span: tuple, item: str | type, path: str):
    off, count = span
    n = len(arena)
    if off % ARENA_ALIGN:
        raise _bounds(path, f"span offset {off} is not a multiple of {ARENA_ALIGN}")
    if off > n:
        raise _bounds(path, f"span offset {off} is past the arena ({n} bytes)")
    if item is bytes:
        if count > n - off:
            raise _bounds(path, f"span of {count} bytes at {off} overruns the arena ({n} bytes)")
        return bytes(arena[off:off + count])
    dt = record_dtype(item)
    if count > (n - off) // dt.itemsize:
        raise _bounds(path, f"span of {count} {item} at {off} overruns the arena ({n} bytes)")
    if count == 0:
        return ()
    rows = np.frombuffer(arena, dtype=dt, count=count, offset=off).tolist()
    if _FLAT[item]:
        make = CLASSES[item]._make
        return tuple(make(r) for r in rows)
    return tuple(_from_tuple(item, r, arena, f"{path}[{i}]") for i, r in enumerate(rows))


def _flat(name: str) -> bool:
    return all(f.kind == "scalar" for f in LAYOUTS[name])


_FLAT = {name: _flat(name) for name in LAYOUTS}


def read_header(buf) -> tuple[int, int, int]:
    """(kind, record_bytes, arena_bytes) of a slot message."""
    mv = memoryview(buf).cast("B")
    if len(mv) < MSG_HEADER_BYTES:
        raise _bounds("MsgHeader", f"{len(mv)} bytes, shorter than a message header")
    return tuple(np.frombuffer(mv, dtype=_MSG_DT, count=1, offset=0).tolist()[0])


def decode(buf, name: str, kind: int | None = None) -> Any:
    """The record `name` of a slot message, with every span read."""
    mv = memoryview(buf).cast("B")
    got_kind, record_bytes, arena_bytes = read_header(mv)
    want_kind = TOP_LEVEL[name] if kind is None else kind
    if got_kind != want_kind:
        raise CodecError(Status.RejectBounds, "MsgHeader.kind", f"message kind {got_kind}, expected {want_kind}")
    size = ffi.sizeof(name)
    if record_bytes != size:
        raise _bounds("MsgHeader.record_bytes", f"{record_bytes}, but {name} is {size} bytes in ABI v1")
    start = arena_offset(size)
    if len(mv) < start:
        raise _bounds(name, f"message of {len(mv)} bytes is shorter than {name}")
    if arena_bytes > len(mv) - start:
        raise _bounds("MsgHeader.arena_bytes", f"{arena_bytes} bytes overrun the slot ({len(mv) - start} left)")
    t = np.frombuffer(mv, dtype=record_dtype(name), count=1, offset=MSG_HEADER_BYTES).tolist()[0]
    layout = LAYOUTS[name]
    if layout[0].name == "struct_size" and t[0] != size:
        raise _bounds(f"{name}.struct_size", f"{t[0]}, but {name} is {size} bytes in ABI v1")
    return _from_tuple(name, t, mv[start:start + arena_bytes], name)


def write_raw(buf, kind: int, payload: bytes) -> int:
    """A message with no record: MsgHeader {kind, 0, len(payload)} + payload
    (the arena starts right after the header)."""
    mv = memoryview(buf).cast("B")
    total = MSG_HEADER_BYTES + len(payload)
    if total > len(mv):
        raise EncodeError(f"raw message needs {total} bytes, the slot has {len(mv)}")
    np.frombuffer(mv, dtype=_MSG_DT, count=1, offset=0)[0] = (kind, 0, len(payload))
    mv[MSG_HEADER_BYTES:total] = payload
    return total


def copy_message(buf) -> tuple[int, bytes]:
    """(kind, bytes of the whole message) copied out of a slot, its lengths
    checked against the slot."""
    mv = memoryview(buf).cast("B")
    kind, record_bytes, arena_bytes = read_header(mv)
    start = arena_offset(record_bytes) if record_bytes else MSG_HEADER_BYTES
    if start > len(mv) or arena_bytes > len(mv) - start:
        raise _bounds("MsgHeader", f"record {record_bytes} + arena {arena_bytes} bytes overrun the slot")
    return kind, bytes(mv[:start + arena_bytes])


def raw_payload(buf) -> bytes:
    """The payload of a raw message written by write_raw."""
    mv = memoryview(buf).cast("B")
    kind, record_bytes, arena_bytes = read_header(mv)
    if record_bytes != 0 or arena_bytes > len(mv) - MSG_HEADER_BYTES:
        raise _bounds("MsgHeader", f"not a raw message (record {record_bytes}, payload {arena_bytes} bytes)")
    return bytes(mv[MSG_HEADER_BYTES:MSG_HEADER_BYTES + arena_bytes])
