"""Structure-aware mutator for plan slots (the fuzz target: `superfluid.fuzz.plan_target`).

It knows the slot layout through cffi: the MsgHeader fields, the TickPlan
fields and spans, and the records each span points at. `mutate` stacks
mutations on one input; `splice` crosses two.
"""

from __future__ import annotations

import math
import random
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from superfluid.abi import (
    ARENA_ALIGN,
    CacheClass,
    Determinism,
    MsgKind,
    ParamFlag,
    PlanFlag,
    Sampling,
    codec,
    ffi,
)
from superfluid.abi.records import SPAN_ITEMS

# ------------------------------------------------------------------ layout


@dataclass(frozen=True, slots=True)
class Field:
    """One scalar of a record: where it sits and how wide it is."""

    path: str
    offset: int
    width: int
    is_float: bool


def _scalar_fields(name: str, base: int = 0, prefix: str = "") -> tuple[Field, ...]:
    out: list[Field] = []
    for fname, fld in ffi.typeof(name).fields:
        t, off, path = fld.type, base + fld.offset, prefix + fname
        if t.kind == "struct":
            out.extend(_scalar_fields(t.cname.removeprefix("struct "), off, path + "."))
        elif t.kind == "array":
            w = ffi.sizeof(t.item)
            out.extend(Field(f"{path}[{i}]", off + i * w, w, False) for i in range(t.length))
        elif t.kind == "primitive":
            out.append(Field(path, off, ffi.sizeof(t), t.cname in ("float", "double")))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class SpanSlot:
    """A TickPlan span: where its offset and count sit in the slot, and the
    record it lists."""

    name: str
    offset_at: int
    count_at: int
    width: int
    item: str
    item_size: int
    item_fields: tuple[Field, ...]


HDR = codec.MSG_HEADER_BYTES
PLAN_BYTES = ffi.sizeof("TickPlan")
ARENA_START = codec.arena_offset(PLAN_BYTES)
HEADER_FIELDS = {f.path: f for f in _scalar_fields("MsgHeader")}
PLAN_FIELDS = _scalar_fields("TickPlan", HDR)
_SPAN_WIDTH = ffi.sizeof(ffi.typeof("Span").fields[0][1].type)
SPANS = tuple(
    SpanSlot(name=name, item=str(item), item_size=ffi.sizeof(str(item)),
             offset_at=HDR + ffi.offsetof("TickPlan", name) + ffi.offsetof("Span", "offset"),
             count_at=HDR + ffi.offsetof("TickPlan", name) + ffi.offsetof("Span", "count"),
             width=_SPAN_WIDTH, item_fields=_scalar_fields(str(item)))
    for (record, name), item in SPAN_ITEMS.items() if record == "TickPlan"
)
MAX_LEN = 1 << 14  # caps mutated inputs so executions stay fast; counts still reach past it

_INTERESTING = (0, 1, 2, 3, 7, 8, 9, 0x7F, 0x80, 0xFF, 0x100, 0x7FFF, 0x8000, 0xFFFF,
                2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1)
_INTERESTING_FLOATS = (math.nan, -math.nan, math.inf, -math.inf, 0.0, -0.0, 1.0, -1.0, 0.5, 1.5, 2.0,
                       1e-45, -1e-45, 3.4028234663852886e38, -3.4028234663852886e38)
_ENUM_VALUES = tuple(sorted({int(v) for e in (MsgKind, Sampling, Determinism, PlanFlag, CacheClass, ParamFlag)
                             for v in e}))


def _get(buf: bytearray, pos: int, width: int) -> int | None:
    if pos < 0 or pos + width > len(buf):
        return None
    return int.from_bytes(buf[pos:pos + width], "little")


def _put(buf: bytearray, pos: int, width: int, value: int) -> None:
    if pos >= 0 and pos + width <= len(buf):
        buf[pos:pos + width] = (value & ((1 << 8 * width) - 1)).to_bytes(width, "little")


def _put_float(buf: bytearray, pos: int, width: int, value: float) -> None:
    if pos >= 0 and pos + width <= len(buf):
        struct.pack_into("<f" if width == 4 else "<d", buf, pos, value)


def _arena_len(buf: bytearray) -> int:
    """The arena as the header declares it, clipped to the bytes present."""
    declared = _get(buf, HEADER_FIELDS["arena_bytes"].offset, HEADER_FIELDS["arena_bytes"].width) or 0
    return max(0, min(declared, len(buf) - ARENA_START))


def _set_arena_len(buf: bytearray, n: int) -> None:
    f = HEADER_FIELDS["arena_bytes"]
    _put(buf, f.offset, f.width, n)


def _align(n: int) -> int:
    return -(-n // ARENA_ALIGN) * ARENA_ALIGN


def _interesting_int(rng: random.Random, buf: bytearray, width: int) -> int:
    """A boundary value, a layout-derived length, or a small delta of one."""
    arena = _arena_len(buf)
    lengths = (len(buf), arena, HDR, PLAN_BYTES, ARENA_START, *(s.item_size for s in SPANS))
    r = rng.random()
    if r < 0.45:
        v = rng.choice(_INTERESTING)
    elif r < 0.7:
        v = rng.choice(lengths) + rng.choice((-8, -1, 0, 0, 1, 8))
    elif r < 0.85:
        v = rng.choice(_ENUM_VALUES) + rng.choice((0, 0, 1))
    else:
        v = rng.getrandbits(8 * width)
    return v & ((1 << 8 * width) - 1)


# --------------------------------------------------------------- mutations

Mutation = Callable[[bytearray, random.Random, Sequence[bytes]], bytearray]


def _bit_flip(buf: bytearray, rng: random.Random, _: Sequence[bytes]) -> bytearray:
    if buf:
        buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
    return buf


def _set_byte(buf: bytearray, rng: random.Random, _: Sequence[bytes]) -> bytearray:
    if buf:
        buf[rng.randrange(len(buf))] = rng.choice((0, 1, 0x7F, 0x80, 0xFE, 0xFF))
    return buf


def _set_word(buf: bytearray, rng: random.Random, _: Sequence[bytes]) -> bytearray:
    """A u32 or u64 at an aligned offset, where every field of the ABI sits."""
    width = rng.choice((4, 8))
    if len(buf) >= width:
        pos = rng.randrange(len(buf) - width + 1) // width * width
        _put(buf, pos, width, _interesting_int(rng, buf, width))
    return buf


def _header_field(buf: bytearray, rng: random.Random, _: Sequence[bytes]) -> bytearray:
    f = rng.choice(tuple(HEADER_FIELDS.values()))
    if f.path == "kind" and rng.random() < 0.5:
        v = rng.choice(tuple(MsgKind))
    elif f.path == "record_bytes" and rng.random() < 0.5:
        v = PLAN_BYTES + rng.choice((-8, -1, 1, 8, -PLAN_BYTES))
    elif f.path == "arena_bytes" and rng.random() < 0.5:
        v = len(buf) - ARENA_START + rng.choice((-9, -8, -1, 0, 1, 8, 1 << 32, 1 << 63))
    else:
        v = _interesting_int(rng, buf, f.width)
    _put(buf, f.offset, f.width, v)
    return buf


def _plan_field(buf: bytearray, rng: random.Random, _: Sequence[bytes]) -> bytearray:
    f = rng.choice(PLAN_FIELDS)
    _put(buf, f.offset, f.width, _interesting_int(rng, buf, f.width))
    return buf


def _span_field(buf: bytearray, rng: random.Random, _: Sequence[bytes]) -> bytearray:
    """A span's offset or count: misaligned, at or past the arena's end,
    another span's, or a count that overruns or overflows."""
    span = rng.choice(SPANS)
    arena = _arena_len(buf)
    off = _get(buf, span.offset_at, span.width) or 0
    if rng.random() < 0.5:
        other = _get(buf, rng.choice(SPANS).offset_at, span.width) or 0
        v = rng.choice((off + rng.randrange(1, ARENA_ALIGN), arena, _align(arena) + ARENA_ALIGN, arena + 1,
                        2**31, 2**32 - ARENA_ALIGN, other, _interesting_int(rng, buf, span.width)))
        _put(buf, span.offset_at, span.width, v)
    else:
        fits = max(0, arena - off) // span.item_size
        count = _get(buf, span.count_at, span.width) or 0
        v = rng.choice((fits, fits + 1, count + 1, max(0, count - 1), 0, 2**31, 2**32 - 1,
                        (2**32) // span.item_size + 1, _interesting_int(rng, buf, span.width)))
        _put(buf, span.count_at, span.width, v)
    return buf


def _listed(buf: bytearray) -> list[tuple[SpanSlot, int, int]]:
    """(span, absolute position, count) of each non-empty span whose records
    lie inside the declared arena."""
    out = []
    arena = _arena_len(buf)
    for span in SPANS:
        off, count = _get(buf, span.offset_at, span.width), _get(buf, span.count_at, span.width)
        if off is not None and count and off + count * span.item_size <= arena:
            out.append((span, ARENA_START + off, count))
    return out


def _item_field(buf: bytearray, rng: random.Random, _: Sequence[bytes]) -> bytearray:
    """A field of one listed record: enum values off by one, NaN and
    negative params, lane tag 0, and so on."""
    listed = _listed(buf)
    if not listed:
        return _span_field(buf, rng, _)
    span, pos, count = rng.choice(listed)
    f = rng.choice(span.item_fields)
    at = pos + rng.randrange(count) * span.item_size + f.offset
    if f.is_float:
        v = rng.choice(_INTERESTING_FLOATS) if rng.random() < 0.8 else rng.uniform(-4, 4)
        _put_float(buf, at, f.width, v)
    else:
        _put(buf, at, f.width, _interesting_int(rng, buf, f.width))
    return buf


def _duplicate_record(buf: bytearray, rng: random.Random, _: Sequence[bytes]) -> bytearray:
    """Make two records of a list share a lane tag: copy one record (or just
    its tag) over another, or grow the list with a copy at the arena's end."""
    listed = _listed(buf)
    if not listed:
        return _bit_flip(buf, rng, _)
    span, pos, count = rng.choice(listed)
    size = span.item_size
    i = rng.randrange(count)
    record = bytes(buf[pos + i * size:pos + (i + 1) * size])
    if count >= 2 and rng.random() < 0.5:
        j = rng.choice([k for k in range(count) if k != i])
        if rng.random() < 0.5:
            buf[pos + j * size:pos + (j + 1) * size] = record
        else:
            tag = next(f for f in span.item_fields if f.path == "lane_tag")
            buf[pos + j * size + tag.offset:pos + j * size + tag.offset + tag.width] = \
                record[tag.offset:tag.offset + tag.width]
        return buf
    items = bytearray(buf[pos:pos + count * size])
    k = rng.randrange(count + 1)
    items[k * size:k * size] = record
    end = _align(_arena_len(buf))
    del buf[ARENA_START + end:]
    buf.extend(bytes(ARENA_START + end - len(buf)))
    buf.extend(items)
    _put(buf, span.offset_at, span.width, end)
    _put(buf, span.count_at, span.width, count + 1)
    _set_arena_len(buf, end + len(items))
    return buf


def _fresh_records(buf: bytearray, rng: random.Random, _: Sequence[bytes]) -> bytearray:
    """Point a span at new records appended to the arena, each field random
    or a boundary value."""
    if len(buf) < ARENA_START:
        return _extend(buf, rng, _)
    span = rng.choice(SPANS)
    n = rng.randint(1, 4)
    items = bytearray(n * span.item_size)
    for k in range(n):
        for f in span.item_fields:
            at = k * span.item_size + f.offset
            if rng.random() < 0.5:
                continue  # keep zeros: many fields are valid at 0
            if f.is_float:
                _put_float(items, at, f.width, rng.choice(_INTERESTING_FLOATS) if rng.random() < 0.3
                           else rng.uniform(0, 2))
            else:
                _put(items, at, f.width, rng.getrandbits(8 * f.width) if f.path == "lane_tag"
                     else _interesting_int(rng, buf, f.width))
    end = _align(_arena_len(buf))
    del buf[ARENA_START + end:]
    buf.extend(bytes(ARENA_START + end - len(buf)))
    buf.extend(items)
    _put(buf, span.offset_at, span.width, end)
    _put(buf, span.count_at, span.width, n)
    _set_arena_len(buf, end + len(items))
    return buf


def _truncate(buf: bytearray, rng: random.Random, _: Sequence[bytes]) -> bytearray:
    arena_end = ARENA_START + _arena_len(buf)
    cuts = [c for c in (0, HDR - 1, HDR, HDR + PLAN_BYTES - 1, ARENA_START - 1, ARENA_START,
                        arena_end - 1, len(buf) - 1, rng.randrange(len(buf) + 1)) if 0 <= c < len(buf)]
    if cuts:
        del buf[rng.choice(cuts):]
    return buf


def _extend(buf: bytearray, rng: random.Random, _: Sequence[bytes]) -> bytearray:
    buf.extend(rng.randbytes(rng.choice((1, 7, 8, 16, rng.randint(1, 256)))))
    if rng.random() < 0.5:
        _set_arena_len(buf, max(0, len(buf) - ARENA_START))
    return buf


def _fix_arena_len(buf: bytearray, rng: random.Random, _: Sequence[bytes]) -> bytearray:
    """Declare the whole tail as the arena, so earlier mutations get past the
    header check."""
    _set_arena_len(buf, max(0, len(buf) - ARENA_START))
    return buf


def splice(a: bytes, b: bytes, rng: random.Random) -> bytes:
    """Bytes of `a` then bytes of `b`, cut at a random point or at a layout
    boundary (header+record of one, arena of the other), or one span of `b`
    moved into `a`."""
    r = rng.random()
    if r < 0.4:
        return a[:rng.randrange(len(a) + 1)] + b[rng.randrange(len(b) + 1):]
    if r < 0.7:
        out = bytearray(a[:ARENA_START] + b[ARENA_START:])
        if len(b) >= HDR and rng.random() < 0.5:
            f = HEADER_FIELDS["arena_bytes"]
            out[f.offset:f.offset + f.width] = b[f.offset:f.offset + f.width]
        return bytes(out)
    span = rng.choice(SPANS)
    out = bytearray(a)
    lo, hi = min(span.offset_at, span.count_at), max(span.offset_at, span.count_at) + span.width
    if len(b) >= hi and len(out) >= hi:
        out[lo:hi] = b[lo:hi]
    return bytes(out)


def _splice(buf: bytearray, rng: random.Random, others: Sequence[bytes]) -> bytearray:
    if not others:
        return _bit_flip(buf, rng, others)
    other = rng.choice(others)
    a, b = (bytes(buf), other) if rng.random() < 0.5 else (other, bytes(buf))
    return bytearray(splice(a, b, rng))


MUTATIONS: tuple[tuple[Mutation, int], ...] = (
    (_bit_flip, 6),
    (_set_byte, 4),
    (_set_word, 6),
    (_header_field, 4),
    (_plan_field, 6),
    (_span_field, 8),
    (_item_field, 12),
    (_duplicate_record, 6),
    (_fresh_records, 5),
    (_truncate, 3),
    (_extend, 3),
    (_fix_arena_len, 2),
    (_splice, 4),
)
_OPS = tuple(m for m, _ in MUTATIONS)
_WEIGHTS = tuple(w for _, w in MUTATIONS)


def mutate(data: bytes, rng: random.Random, others: Sequence[bytes] = (), *, rounds: int | None = None,
           max_len: int = MAX_LEN) -> bytes:
    """`data` after `rounds` stacked mutations (mostly one or two when not
    given). Deterministic for a given rng state."""
    buf = bytearray(data)
    n = rounds if rounds is not None else 1 + min(int(rng.expovariate(1.0)), 7)
    for op in rng.choices(_OPS, weights=_WEIGHTS, k=n):
        buf = op(buf, rng, others)
    del buf[max_len:]
    return bytes(buf)
