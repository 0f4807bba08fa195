"""Each record's bytes: a precompiled `struct.Struct` per record (its C
layout, padding included, read from cffi) and a generated pair of
functions that turn the flat field tuple into the nested record and back,
so a message is one pack_into / unpack_from plus one call per non-empty
span; spans placed into and read out of the arena, every one checked. The
same layouts, as a schema, set up `superfluid.abi._codec` (abi/sf_codec.c),
the C path codec.py tries first.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from itertools import chain
from typing import Any

from superfluid.abi import ARENA_ALIGN, Status, ffi
from superfluid.abi.records import CLASSES, LAYOUTS, TOP_LEVEL, is_hidden

try:
    from superfluid.abi import _codec as _native
except ImportError:  # an install that did not build it: the Python path alone, slower
    _native = None


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


def bounds_error(field: str, message: str) -> CodecError:
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
        pad = align(self.size) - self.size
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
                    raise EncodeError(f"[{i}]: {diagnose(item, items[i], e)}") from None
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
        raise bounds_error(f"{parent}.{fname}", f"span offset {off} is not a multiple of {ARENA_ALIGN}")
    if off > n:
        raise bounds_error(f"{parent}.{fname}", f"span offset {off} is past the arena ({n} bytes)")
    if item is None:
        if count > n - off:
            raise bounds_error(f"{parent}.{fname}", f"span of {count} bytes at {off} overruns the arena ({n} bytes)")
        return bytes(arena[off:off + count])
    if count > (n - off) // item.size:
        raise bounds_error(f"{parent}.{fname}",
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
    native_encode_into, native_decode = _native.encode_into, _native.decode
else:
    native_encode_into = native_decode = None


def diagnose(c: RecordCodec, record: Any, err: Exception) -> EncodeError:
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

