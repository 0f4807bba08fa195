"""Records to slot bytes and back: MsgHeader, the record, then its arena.

A slot holds `MsgHeader {kind, record_bytes, arena_bytes, session}`, the top-level
record right after it, and the arena from the next 8-byte boundary. Spans
inside the record (and inside arena records) are `{offset, count}` into the
arena. Decoding trusts nothing: sizes, kinds and every span are checked and a
failure is a CodecError carrying the status (RejectBounds) and the field.

Speed: encode_into and decode go through `superfluid.abi._codec`
(abi/sf_codec.c), which walks the same layouts in C. Where it meets anything
it does not take (a value out of range, a span that breaks a rule, a type it
does not know) it answers None and the Python path below runs, so errors and
rarer inputs are this module's; tests/abi/test_codec_native.py checks the two
give the same bytes and records. The Python path packs each record with its
packer (packers.py).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

from superfluid.abi import ABI_VERSION, ffi

# CODECS, CodecError, EncodeError and align are part of this module's API (explicit re-exports).
from superfluid.abi.packers import (
    CODECS as CODECS,
    CodecError as CodecError,
    EncodeError as EncodeError,
    RecordCodec,
    align as align,
    bounds_error,
    diagnose,
    native_decode,
    native_encode_into,
)
from superfluid.abi.records import TOP_LEVEL

# A slot message as read (a slot is a memoryview; bytes from elsewhere), and one to write into.
Message = bytes | bytearray | memoryview
WritableMessage = bytearray | memoryview

_HDR = struct.Struct("<IIQQ")
_HDR3 = struct.Struct("<IIQ")  # the header less its session
_SESSION = struct.Struct("<Q")
_SESSION_AT = _HDR3.size
SESSION_OFFSET = _SESSION_AT  # where MsgHeader.session lies in a slot message
MSG_HEADER_BYTES = _HDR.size
assert ffi.sizeof("MsgHeader") == MSG_HEADER_BYTES


def arena_offset(record_bytes: int) -> int:
    """Where the arena starts in a slot, for a record of this many bytes."""
    return MSG_HEADER_BYTES + align(record_bytes)


# ------------------------------------------------------------------ encode


def _flatten(c: RecordCodec, record: Any) -> tuple[tuple[Any, ...], bytearray]:
    arena = bytearray()
    try:
        return c.flatten(record, arena, c.name), arena
    except EncodeError as e:
        raise diagnose(c, record, e) from None
    except (IndexError, TypeError, AttributeError, struct.error, OverflowError) as e:
        raise diagnose(c, record, e) from None


def encode_into(buf: WritableMessage, name: str, record: Any, kind: int | None = None, session: int = 0) -> int:
    """Write `record` (struct `name`) with its arena into the writable buffer
    `buf`, from offset 0, stamped with `session`. Returns the bytes written."""
    c = CODECS[name]
    k = c.kind if kind is None else kind
    if c.index >= 0 and k is not None:
        n = native_encode_into(buf, c.index, record, k, session)
        if n is not None:
            return n
    return encode_into_py(buf, name, record, kind, session)


def encode_into_py(buf: WritableMessage, name: str, record: Any, kind: int | None = None, session: int = 0) -> int:
    """encode_into without the C fast path (what it falls back to)."""
    c = CODECS[name]
    flat, arena = _flatten(c, record)
    start = c.message.size
    total = start + len(arena)
    if total > len(buf):
        raise EncodeError(f"{name}: message needs {total} bytes, the slot has {len(buf)}")
    try:
        c.message.pack_into(buf, 0, TOP_LEVEL[name] if kind is None else kind, c.size, len(arena), session, *flat)
    except (struct.error, OverflowError) as e:
        raise diagnose(c, record, e) from None
    if arena:
        buf[start:total] = arena
    return total


def encode(name: str, record: Any, kind: int | None = None, session: int = 0) -> bytes:
    """`record` as the bytes of a slot message."""
    c = CODECS[name]
    flat, arena = _flatten(c, record)
    try:
        head = c.message.pack(TOP_LEVEL[name] if kind is None else kind, c.size, len(arena), session, *flat)
    except (struct.error, OverflowError) as e:
        raise diagnose(c, record, e) from None
    return head + arena


def pack_record(name: str, record: Any) -> bytes:
    """One record (no spans) as its C bytes, padding zeroed."""
    c = CODECS[name]
    flat, arena = _flatten(c, record)
    if arena:
        raise EncodeError(f"{name}: holds spans; encode it as a message")
    try:
        return c.struct.pack(*flat)
    except (struct.error, OverflowError) as e:
        raise diagnose(c, record, e) from None


def unpack_record(name: str, data: Message) -> Any:
    """The record of C bytes written by pack_record (or by C)."""
    c = CODECS[name]
    if len(data) < c.size:
        raise bounds_error(name, f"{len(data)} bytes, shorter than {name} ({c.size})")
    return c.unflatten(c.struct.unpack_from(data, 0), memoryview(b""), name)


# ------------------------------------------------------------------ decode


def read_header(buf: Message) -> tuple[int, int, int]:
    """(kind, record_bytes, arena_bytes) of a slot message."""
    if len(buf) < MSG_HEADER_BYTES:
        raise bounds_error("MsgHeader", f"{len(buf)} bytes, shorter than a message header")
    return _HDR3.unpack_from(buf, 0)


def session_of(buf: Message) -> int:
    """MsgHeader.session of a slot message (0 when the slot is too short)."""
    if len(buf) < MSG_HEADER_BYTES:
        return 0
    session: int = _SESSION.unpack_from(buf, _SESSION_AT)[0]
    return session


def set_session(buf: WritableMessage, session: int) -> None:
    """Stamp MsgHeader.session of a message already in `buf`."""
    _SESSION.pack_into(buf, _SESSION_AT, session)


def decode(buf: Message, name: str, kind: int | None = None) -> Any:
    """The record `name` of a slot message, with every span read."""
    c = CODECS[name]
    k = c.kind if kind is None else kind
    if c.index >= 0 and k is not None:
        rec = native_decode(buf, c.index, k)
        if rec is not None:
            return rec
    return decode_py(buf, name, kind)


def fast_decoder(name: str) -> Callable[[Message], Any]:
    """buf -> the record `name` of a well-formed message of its kind, or
    None for anything else (another kind, a malformed one: decode says
    what): the C path alone, for a reader's common message."""
    c = CODECS[name]
    if c.index < 0 or c.kind is None:
        def slow(buf: Message) -> Any:
            try:
                return decode_py(buf, name)
            except CodecError:
                return None
        return slow
    index, kind = c.index, c.kind
    return lambda buf: native_decode(buf, index, kind)


def decode_py(buf: Message, name: str, kind: int | None = None) -> Any:
    """decode without the C fast path (what it falls back to, and what
    raises the CodecError naming the field)."""
    mv = buf if isinstance(buf, memoryview) else memoryview(buf)
    if mv.itemsize != 1:
        mv = mv.cast("B")
    got_kind, record_bytes, arena_bytes = read_header(mv)
    c = CODECS[name]
    want_kind = TOP_LEVEL[name] if kind is None else kind
    if got_kind != want_kind:
        raise bounds_error("MsgHeader.kind", f"message kind {got_kind}, expected {want_kind}")
    if record_bytes != c.size:
        raise bounds_error("MsgHeader.record_bytes",
                           f"{record_bytes}, but {name} is {c.size} bytes in ABI v{ABI_VERSION}")
    start = c.message.size
    if len(mv) < start:
        raise bounds_error(name, f"message of {len(mv)} bytes is shorter than {name}")
    if arena_bytes > len(mv) - start:
        raise bounds_error("MsgHeader.arena_bytes", f"{arena_bytes} bytes overrun the slot ({len(mv) - start} left)")
    t = c.struct.unpack_from(mv, MSG_HEADER_BYTES)
    if c.has_struct_size and t[0] != c.size:
        raise bounds_error(f"{name}.struct_size", f"{t[0]}, but {name} is {c.size} bytes in ABI v{ABI_VERSION}")
    return c.unflatten(t, mv[start:start + arena_bytes], name)


def write_raw(buf: WritableMessage, kind: int, payload: bytes, session: int = 0) -> int:
    """A message with no record: MsgHeader {kind, 0, len(payload), session} +
    payload (the arena starts right after the header)."""
    total = MSG_HEADER_BYTES + len(payload)
    if total > len(buf):
        raise EncodeError(f"raw message needs {total} bytes, the slot has {len(buf)}")
    _HDR.pack_into(buf, 0, kind, 0, len(payload), session)
    buf[MSG_HEADER_BYTES:total] = payload
    return total


def copy_message(buf: Message) -> tuple[int, bytes]:
    """(kind, bytes of the whole message) copied out of a slot, its lengths
    checked against the slot."""
    kind, record_bytes, arena_bytes = read_header(buf)
    start = arena_offset(record_bytes) if record_bytes else MSG_HEADER_BYTES
    if start > len(buf) or arena_bytes > len(buf) - start:
        raise bounds_error("MsgHeader", f"record {record_bytes} + arena {arena_bytes} bytes overrun the slot")
    return kind, bytes(buf[:start + arena_bytes])


def raw_payload(buf: Message) -> bytes:
    """The payload of a raw message written by write_raw."""
    _kind, record_bytes, arena_bytes = read_header(buf)
    if record_bytes != 0 or arena_bytes > len(buf) - MSG_HEADER_BYTES:
        raise bounds_error("MsgHeader", f"not a raw message (record {record_bytes}, payload {arena_bytes} bytes)")
    return bytes(buf[MSG_HEADER_BYTES:MSG_HEADER_BYTES + arena_bytes])
