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
give the same bytes and records. The Python path: each record gets a
precompiled `struct.Struct` (its C layout, padding included, read from cffi)
and a generated pair of functions that turn the flat field tuple into the
nested record and back, so a message is one pack_into / unpack_from plus one
call per non-empty span.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from itertools import chain
from typing import Any

from superfluid.abi import ABI_VERSION, ARENA_ALIGN, Status, ffi
from superfluid.abi.records import CLASSES, LAYOUTS, TOP_LEVEL, is_hidden

try:
    from superfluid.abi import _codec as _native
except ImportError:  # an install that did not build it: the Python path alone, slower
    _native = None

_HDR = struct.Struct("<IIQQ")
_HDR3 = struct.Struct("<IIQ")  # the header less its session
_SESSION = struct.Struct("<Q")
_SESSION_AT = _HDR3.size
SESSION_OFFSET = _SESSION_AT  # where MsgHeader.session lies in a slot message
MSG_HEADER_BYTES = _HDR.size
assert ffi.sizeof("MsgHeader") == MSG_HEADER_BYTES


class CodecError(Exception):
    """A message that cannot be decoded: `status` says which reject, `field`
    names where (e.g. "TickPlan.admits"), `message` says why."""

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


def _bounds(field: str, message: str) -> CodecError:
    return CodecError(Status.RejectBounds, field, message)


# ------------------------------------------------------- layout → struct

_PRIM = {"uint8_t": "B", "uint16_t": "H", "uint32_t": "I", "uint64_t": "Q", "int8_t": "b", "int16_t": "h",
         "int32_t": "i", "int64_t": "q", "float": "f", "double": "d"}


def _fmt(name: str) -> tuple[str, list[tuple[str, str]]]:
    """struct format of struct `name` (no byte-order prefix) and the flat
    list of (field path, format code) of its visible fields."""
    ct = ffi.typeof(name)
    out, fields, at = [], [], 0
    for fname, fld in ct.fields:
        size = ffi.sizeof(fld.type)
        if fld.offset > at:
            out.append(f"{fld.offset - at}x")
        at = fld.offset + size
        t = fld.type
        if is_hidden(fname):
            out.append(f"{size}x")
        elif t.kind == "struct":
            sub, subfields = _fmt(t.cname.removeprefix("struct "))
            out.append(sub)
            fields += [(f"{fname}.{p}", c) for p, c in subfields]
        elif t.kind == "array" and t.item.cname == "char":
            out.append(f"{t.length}s")
            fields.append((fname, f"{t.length}s"))
        elif t.kind == "array":
            c = _PRIM[t.item.cname]
            out.append(f"{t.length}{c}")
            fields += [(f"{fname}[{i}]", c) for i in range(t.length)]
        else:
            out.append(_PRIM[t.cname])
            fields.append((fname, _PRIM[t.cname]))
    if ffi.sizeof(ct) > at:
        out.append(f"{ffi.sizeof(ct) - at}x")
    return "".join(out), fields


class RecordCodec:
    """The packer of one record type."""

    def __init__(self, name: str):
        self.name = name
        self.cls = CLASSES[name]
        self.size = ffi.sizeof(name)
        body, self.fields = _fmt(name)
        self.body = body
        self.struct = struct.Struct("<" + body)
        assert self.struct.size == self.size, name
        self.flat = all(f.kind == "scalar" for f in LAYOUTS[name])
        self.has_struct_size = LAYOUTS[name][0].name == "struct_size"
        pad = arena_offset(self.size) - MSG_HEADER_BYTES - self.size
        # The message: header, record and the padding up to the arena, in one pack.
        self.message = struct.Struct("<IIQQ" + body + (f"{pad}x" if pad else ""))
        self._many: dict[int, struct.Struct] = {}
        self.index = -1  # its number in sf_codec.c's schema (-1: no C fast path)
        self.kind = TOP_LEVEL.get(name)  # the message kind that carries it, for top-level records
        self.unflatten: Callable[[tuple, memoryview, str], Any]
        self.flatten: Callable[[Any, bytearray, str], tuple]
        # For records with no span at any depth (every row type but OpCompletion):
        # a span's rows in one frame, not a call (and a field path) per row.
        self.unflatten_rows: Callable[[Any], tuple] | None = None
        self.flatten_rows: Callable[[Any], list] | None = None

    def many(self, n: int) -> struct.Struct:
        s = self._many.get(n)
        if s is None:
            s = struct.Struct("<" + self.body * n)
            if n <= 1024:
                self._many[n] = s
        return s


CODECS: dict[str, RecordCodec] = {}


def _gen(name: str) -> None:
    """Generate flatten/unflatten for `name` (and the records it holds)."""
    c = CODECS[name] = RecordCodec(name)
    env: dict[str, Any] = {"_span": _read_span, "_place": _place, "_arr": _arr, "_chars": _chars,
                           "_NO_SPAN": (0, 0), "_tn": tuple.__new__,
                           "_chain": chain.from_iterable}

    def need(rec: str) -> None:
        for f in LAYOUTS[rec]:
            if f.kind == "span" and f.sub is not bytes and f.sub not in CODECS:
                _gen(f.sub)
            elif f.kind == "struct":
                need(f.sub)

    need(name)

    def unflat(rec: str, idx: int) -> tuple[str, int]:
        env[f"C_{rec}"] = CLASSES[rec]
        parts = []
        for f in LAYOUTS[rec]:
            if f.kind == "scalar":
                parts.append(f"t[{idx}]")
                idx += 1
            elif f.kind == "struct":
                e, idx = unflat(f.sub, idx)
                parts.append(e)
            elif f.kind == "array":
                parts.append(f"t[{idx}:{idx + f.length}]")
                idx += f.length
            elif f.kind == "chars":
                parts.append(f"t[{idx}].rstrip(b'\\0')")
                idx += 1
            else:
                item = "None" if f.sub is bytes else f"K_{f.sub}"
                if f.sub is not bytes:
                    env[item] = CODECS[f.sub]
                empty = "b''" if f.sub is bytes else "()"
                parts.append(f"(_span(a, t[{idx}], t[{idx + 1}], {item}, p, {f.name!r}) "
                             f"if t[{idx}] or t[{idx + 1}] else {empty})")
                idx += 2
        # tuple.__new__ straight from C: a namedtuple's own __new__ is a Python frame.
        return f"_tn(C_{rec}, ({', '.join(parts)},))", idx

    def flat(rec: str, var: str, top: bool) -> list[str]:
        parts = []
        for i, f in enumerate(LAYOUTS[rec]):
            v = f"{var}[{i}]"
            if f.kind == "scalar":
                parts.append(f"({v} or {CODECS[name].size})" if top and i == 0 and f.name == "struct_size" else v)
            elif f.kind == "struct":
                parts += flat(f.sub, v, False)
            elif f.kind == "array":
                parts.append(f"*_arr({v}, {f.length})")
            elif f.kind == "chars":
                parts.append(f"_chars({v}, {f.length})")
            else:
                item = "None" if f.sub is bytes else f"K_{f.sub}"
                parts.append(f"*(_place(a, {v}, {item}) if {v} else _NO_SPAN)")
        return parts

    expr, _ = unflat(name, 0)
    src = (f"def unflatten(t, a, p):\n    return {expr}\n"
           f"def flatten(r, a, p):\n    return ({', '.join(flat(name, 'r', True))},)\n")
    rows = not _has_span(name)
    if rows:
        src += f"def unflatten_rows(ts):\n    return tuple([{expr} for t in ts])\n"
        unpack = _unpacking(name)
        if unpack is not None:  # scalars and structs only: one unpacking a row, no indexing
            target, values = unpack
            src += f"def flatten_rows(rs):\n    return _chain([({values},) for {target} in rs])\n"
        else:
            src += f"def flatten_rows(rs):\n    return _chain([({', '.join(flat(name, 'r', False))},) for r in rs])\n"
    exec(compile(src, f"<codec {name}>", "exec"), env)
    c.unflatten = env["unflatten"]
    c.flatten = env["flatten"]
    if rows:
        c.unflatten_rows = env["unflatten_rows"]
        c.flatten_rows = env["flatten_rows"]


def _unpacking(name: str, names: list[str] | None = None) -> tuple[str, str] | None:
    """(for-target, values) that unpack one row of `name` into its flat
    fields, e.g. ("(v0, (v1, v2), v3)", "v0, v1, v2, v3"); None when it has
    an array or chars field (those need padding and checks)."""
    top = names is None
    names = [] if top else names
    parts = []
    for f in LAYOUTS[name]:
        if f.kind == "scalar":
            names.append(f"v{len(names)}")
            parts.append(names[-1])
        elif f.kind == "struct":
            sub = _unpacking(f.sub, names)
            if sub is None:
                return None
            parts.append(sub[0])
        else:
            return None
    return f"({', '.join(parts)},)", (", ".join(names) if top else "")


def _has_span(name: str) -> bool:
    return any(f.kind == "span" or (f.kind == "struct" and _has_span(f.sub)) for f in LAYOUTS[name])


def _arr(v, length: int) -> tuple:
    v = tuple(v)
    if len(v) > length:
        raise EncodeError(f"at most {length} values, got {len(v)}")
    return v + (0,) * (length - len(v)) if len(v) < length else v


def _chars(v, length: int) -> bytes:
    b = v.encode() if isinstance(v, str) else bytes(v)
    if len(b) > length:
        raise EncodeError(f"at most {length} bytes, got {len(b)}")
    return b


def _place(arena: bytearray, items, item: RecordCodec | None) -> tuple[int, int]:
    if not items:
        return (0, 0)
    if item is None:
        data = items.encode() if isinstance(items, str) else bytes(items)
        n = len(data)
    else:
        n = len(items)
        try:
            flat = None
            if item.flatten_rows is not None:
                try:
                    flat = item.flatten_rows(items)
                except (ValueError, TypeError):
                    pass  # a row of another shape: the row-by-row path below packs it or says what is wrong
            if flat is None:
                flat = chain.from_iterable([item.flatten(it, arena, item.name) for it in items])
            data = item.many(n).pack(*flat)
        except (struct.error, OverflowError) as e:
            rows = [item.flatten(it, arena, item.name) for it in items]
            for i, row in enumerate(rows):
                try:
                    item.struct.pack(*row)
                except (struct.error, OverflowError):
                    raise EncodeError(f"[{i}]: {_diagnose(item, items[i], e)}") from None
            raise EncodeError(f"{item.name}: {e}") from None
    off = align(len(arena))
    if off > len(arena):
        arena.extend(bytes(off - len(arena)))
    arena.extend(data)
    return (off, n)


def _read_span(arena: memoryview, off: int, count: int, item: RecordCodec | None, parent: str, fname: str):
    if count == 0 and off == 0:
        return b"" if item is None else ()
    n = len(arena)
    if off % ARENA_ALIGN:
        raise _bounds(f"{parent}.{fname}", f"span offset {off} is not a multiple of {ARENA_ALIGN}")
    if off > n:
        raise _bounds(f"{parent}.{fname}", f"span offset {off} is past the arena ({n} bytes)")
    if item is None:
        if count > n - off:
            raise _bounds(f"{parent}.{fname}", f"span of {count} bytes at {off} overruns the arena ({n} bytes)")
        return bytes(arena[off:off + count])
    if count > (n - off) // item.size:
        raise _bounds(f"{parent}.{fname}",
                      f"span of {count} {item.name} at {off} overruns the arena ({n} bytes)")
    if count == 0:
        return ()
    rows = item.struct.iter_unpack(arena[off:off + count * item.size])
    if item.flat:
        cls = item.cls
        return tuple([tuple.__new__(cls, r) for r in rows])
    if item.unflatten_rows is not None:
        return item.unflatten_rows(rows)
    return tuple(item.unflatten(t, arena, f"{parent}.{fname}[{i}]") for i, t in enumerate(rows))


for _name in TOP_LEVEL:
    _gen(_name)
for _name in CLASSES:
    if _name not in CODECS:
        _gen(_name)


# ------------------------------------------------------------ the C schema

# Field kinds as sf_codec.c numbers them.
_K_SCALAR, _K_STRUCT, _K_ARRAY, _K_CHARS, _K_BYTES, _K_ROWS = range(6)


def _schema() -> tuple[tuple, dict[str, int]]:
    """Every record's layout for sf_codec.c: (cls, size, has_struct_size,
    fields), each field (kind, offset, struct code, length, record index),
    with the offsets cffi reads from the compiled header."""
    names = sorted(CODECS)
    index = {n: i for i, n in enumerate(names)}
    out = []
    for n in names:
        c = CODECS[n]
        cfields = dict(ffi.typeof(n).fields)
        fields = []
        for f in LAYOUTS[n]:
            cf = cfields[f.name]
            t = cf.type
            if f.kind == "scalar":
                fields.append((_K_SCALAR, cf.offset, _PRIM[t.cname], 0, 0))
            elif f.kind == "struct":
                fields.append((_K_STRUCT, cf.offset, "B", 0, index[f.sub]))
            elif f.kind == "array":
                fields.append((_K_ARRAY, cf.offset, _PRIM[t.item.cname], f.length, 0))
            elif f.kind == "chars":
                fields.append((_K_CHARS, cf.offset, "B", f.length, 0))
            elif f.sub is bytes:
                fields.append((_K_BYTES, cf.offset, "B", 0, 0))
            else:
                fields.append((_K_ROWS, cf.offset, "B", 0, index[f.sub]))
        out.append((c.cls, c.size, c.has_struct_size, tuple(fields)))
    return tuple(out), index


if _native is not None:
    _schema_rows, _index = _schema()
    _native.setup(_schema_rows)
    for _name, _i in _index.items():
        CODECS[_name].index = _i
    _native_encode_into, _native_decode = _native.encode_into, _native.decode


# ------------------------------------------------------------------ encode


def _diagnose(c: RecordCodec, record: Any, err: Exception) -> EncodeError:
    """Which field made the pack fail (the slow path, errors only)."""
    try:
        flat = c.flatten(record, bytearray(), c.name)
    except EncodeError as e:
        return EncodeError(f"{c.name}: {e}")
    except (IndexError, TypeError, AttributeError) as e:
        return EncodeError(f"{c.name}: not a {c.name} record ({e})")
    for (path, code), v in zip(c.fields, flat):
        try:
            struct.pack("<" + code, v)
        except (struct.error, OverflowError, TypeError) as e:
            return EncodeError(f"{c.name}.{path} = {v!r}: {e}")
    return EncodeError(f"{c.name}: {err}")


def _flatten(c: RecordCodec, record: Any) -> tuple[tuple, bytearray]:
    arena = bytearray()
    try:
        return c.flatten(record, arena, c.name), arena
    except EncodeError as e:
        raise _diagnose(c, record, e) from None
    except (IndexError, TypeError, AttributeError, struct.error, OverflowError) as e:
        raise _diagnose(c, record, e) from None


def encode_into(buf, name: str, record: Any, kind: int | None = None, session: int = 0) -> int:
    """Write `record` (struct `name`) with its arena into the writable buffer
    `buf`, from offset 0, stamped with `session`. Returns the bytes written."""
    c = CODECS[name]
    k = c.kind if kind is None else kind
    if c.index >= 0 and k is not None:
        n = _native_encode_into(buf, c.index, record, k, session)
        if n is not None:
            return n
    return encode_into_py(buf, name, record, kind, session)


def encode_into_py(buf, name: str, record: Any, kind: int | None = None, session: int = 0) -> int:
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
        raise _diagnose(c, record, e) from None
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
        raise _diagnose(c, record, e) from None
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
        raise _diagnose(c, record, e) from None


def unpack_record(name: str, data) -> Any:
    """The record of C bytes written by pack_record (or by C)."""
    c = CODECS[name]
    if len(data) < c.size:
        raise _bounds(name, f"{len(data)} bytes, shorter than {name} ({c.size})")
    return c.unflatten(c.struct.unpack_from(data, 0), memoryview(b""), name)


# ------------------------------------------------------------------ decode


def read_header(buf) -> tuple[int, int, int]:
    """(kind, record_bytes, arena_bytes) of a slot message."""
    if len(buf) < MSG_HEADER_BYTES:
        raise _bounds("MsgHeader", f"{len(buf)} bytes, shorter than a message header")
    return _HDR3.unpack_from(buf, 0)


def session_of(buf) -> int:
    """MsgHeader.session of a slot message (0 when the slot is too short)."""
    if len(buf) < MSG_HEADER_BYTES:
        return 0
    return _SESSION.unpack_from(buf, _SESSION_AT)[0]


def set_session(buf, session: int) -> None:
    """Stamp MsgHeader.session of a message already in `buf`."""
    _SESSION.pack_into(buf, _SESSION_AT, session)


def decode(buf, name: str, kind: int | None = None) -> Any:
    """The record `name` of a slot message, with every span read."""
    c = CODECS[name]
    k = c.kind if kind is None else kind
    if c.index >= 0 and k is not None:
        rec = _native_decode(buf, c.index, k)
        if rec is not None:
            return rec
    return decode_py(buf, name, kind)


def fast_decoder(name: str) -> Callable[[Any], Any]:
    """buf -> the record `name` of a well-formed message of its kind, or
    None for anything else (another kind, a malformed one: decode says
    what): the C path alone, for a reader's common message."""
    c = CODECS[name]
    if c.index < 0 or c.kind is None:
        def slow(buf):
            try:
                return decode_py(buf, name)
            except CodecError:
                return None
        return slow
    index, kind = c.index, c.kind
    return lambda buf: _native_decode(buf, index, kind)


def decode_py(buf, name: str, kind: int | None = None) -> Any:
    """decode without the C fast path (what it falls back to, and what
    raises the CodecError naming the field)."""
    mv = buf if isinstance(buf, memoryview) else memoryview(buf)
    if mv.itemsize != 1:
        mv = mv.cast("B")
    got_kind, record_bytes, arena_bytes = read_header(mv)
    c = CODECS[name]
    want_kind = TOP_LEVEL[name] if kind is None else kind
    if got_kind != want_kind:
        raise _bounds("MsgHeader.kind", f"message kind {got_kind}, expected {want_kind}")
    if record_bytes != c.size:
        raise _bounds("MsgHeader.record_bytes", f"{record_bytes}, but {name} is {c.size} bytes in ABI v{ABI_VERSION}")
    start = c.message.size
    if len(mv) < start:
        raise _bounds(name, f"message of {len(mv)} bytes is shorter than {name}")
    if arena_bytes > len(mv) - start:
        raise _bounds("MsgHeader.arena_bytes", f"{arena_bytes} bytes overrun the slot ({len(mv) - start} left)")
    t = c.struct.unpack_from(mv, MSG_HEADER_BYTES)
    if c.has_struct_size and t[0] != c.size:
        raise _bounds(f"{name}.struct_size", f"{t[0]}, but {name} is {c.size} bytes in ABI v{ABI_VERSION}")
    return c.unflatten(t, mv[start:start + arena_bytes], name)


def write_raw(buf, kind: int, payload: bytes, session: int = 0) -> int:
    """A message with no record: MsgHeader {kind, 0, len(payload), session} +
    payload (the arena starts right after the header)."""
    total = MSG_HEADER_BYTES + len(payload)
    if total > len(buf):
        raise EncodeError(f"raw message needs {total} bytes, the slot has {len(buf)}")
    _HDR.pack_into(buf, 0, kind, 0, len(payload), session)
    buf[MSG_HEADER_BYTES:total] = payload
    return total


def copy_message(buf) -> tuple[int, bytes]:
    """(kind, bytes of the whole message) copied out of a slot, its lengths
    checked against the slot."""
    kind, record_bytes, arena_bytes = read_header(buf)
    start = arena_offset(record_bytes) if record_bytes else MSG_HEADER_BYTES
    if start > len(buf) or arena_bytes > len(buf) - start:
        raise _bounds("MsgHeader", f"record {record_bytes} + arena {arena_bytes} bytes overrun the slot")
    return kind, bytes(buf[:start + arena_bytes])


def raw_payload(buf) -> bytes:
    """The payload of a raw message written by write_raw."""
    _kind, record_bytes, arena_bytes = read_header(buf)
    if record_bytes != 0 or arena_bytes > len(buf) - MSG_HEADER_BYTES:
        raise _bounds("MsgHeader", f"not a raw message (record {record_bytes}, payload {arena_bytes} bytes)")
    return bytes(buf[MSG_HEADER_BYTES:MSG_HEADER_BYTES + arena_bytes])
