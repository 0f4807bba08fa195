"""Fuzz target for the plan decoder, `superfluid.abi.plan_codec.decode_plan`.

A queue slot is written by another process, so the decoder must answer any
bytes with a TickPlan or a PlanReject (contract §1, §3 step 1) and nothing else.
`one_input` checks that, plus a differential property: a decoded plan,
re-encoded and decoded again, is the same plan.

Inputs come from a seed corpus of valid plans (`seed_corpus`) and a
structure-aware mutator (`mutate`) that knows the slot layout through cffi:
the MsgHeader fields, the TickPlan fields and spans, and the records each
span points at. Run it with the built-in loop or under atheris:

    python -m superfluid.fuzz.plan_target --runs 100000 [--seed S] [--corpus DIR]
    python -m superfluid.fuzz.plan_target --atheris [--runs N] [-- libFuzzer flags]
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import itertools
import json
import math
import os
import random
import re
import struct
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from superfluid.abi import (
    ARENA_ALIGN,
    CacheClass,
    Determinism,
    MsgKind,
    ParamFlag,
    PlanFlag,
    RingId,
    Sampling,
    Status,
    codec,
    ffi,
)
from superfluid.abi.plan_codec import PlanReject, decode_plan
from superfluid.abi.records import SPAN_ITEMS, RingRef, TickPlan
from superfluid.client import PlanBuilder, sampling_params

Outcome = TickPlan | PlanReject

# ------------------------------------------------------------------ target


def one_input(data: bytes) -> Outcome:
    """Decode `data` as a plan slot. Returns the plan or the reject; raises on
    anything else (a finding)."""
    try:
        plan = decode_plan(data)
    except PlanReject as reject:
        _check_reject(reject)
        return reject
    _check_round_trip(plan)
    return plan


def fuzz_one_input(data: bytes) -> None:
    """The atheris entry point."""
    one_input(data)


def _check_reject(reject: PlanReject) -> None:
    try:
        status = Status(int(reject.status))
    except (TypeError, ValueError):
        raise AssertionError(f"PlanReject with invalid status {reject.status!r}: {reject}") from None
    if status == Status.OK:
        raise AssertionError(f"PlanReject with status OK: {reject}")


def _check_round_trip(plan: TickPlan) -> None:
    if not isinstance(plan, TickPlan):
        raise AssertionError(f"decode_plan returned {type(plan).__name__}, not TickPlan")
    encoded = codec.encode("TickPlan", plan)
    try:
        again = decode_plan(encoded)
    except PlanReject as reject:
        raise AssertionError(f"a decoded plan, re-encoded, is rejected: {reject}") from reject
    if not same_record(plan, again):
        raise AssertionError(f"round trip changed the plan:\n  {plan}\n  {again}")
    if codec.encode("TickPlan", again) != encoded:
        raise AssertionError("encoding the same plan twice gave different bytes")


def same_record(a: object, b: object) -> bool:
    """Record equality where NaN equals NaN (a NaN that reached a plan must
    still round-trip, and plain == would call that a mismatch)."""
    if a == b:
        return True
    if isinstance(a, float) and isinstance(b, float):
        return math.isnan(a) and math.isnan(b)
    if isinstance(a, tuple) and isinstance(b, tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(same_record, a, b))
    return False


def outcome_key(outcome: Outcome) -> tuple:
    """A coarse signature of an outcome, the built-in loop's novelty signal
    (no coverage there): reject status and field, or the shape of a plan."""
    if isinstance(outcome, PlanReject):
        return (outcome.status.name, re.sub(r"\[\d+\]", "[]", outcome.field))
    lists = (outcome.admits, outcome.prefills, outcome.decodes, outcome.commits, outcome.retires)
    return ("OK", outcome.flags, outcome.evictable_cache_classes, tuple(min(len(x), 3) for x in lists))


# ------------------------------------------------------------ seed corpus


def _prompt(offset: int, length: int, generation: int = 0) -> RingRef:
    return RingRef(ring_id=int(RingId.PROMPT), generation=generation, offset=offset, len=length)


def seed_plans() -> list[TickPlan]:
    """Valid plans covering every list and most fields."""
    plans = [PlanBuilder(1).build()]

    b = PlanBuilder(2, prefill_token_budget=512)
    b.admit(11, _prompt(0, 32))
    plans.append(b.build())

    b = PlanBuilder(3, prefill_token_budget=4096)
    b.admit(21, _prompt(0, 100), sampling=Sampling.GPU_SAMPLE,
            params=sampling_params(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, repeat_penalty=1.1,
                                   presence_penalty=0.5, freq_penalty=-0.25, ignore_eos=True),
            rng_counter_base=1 << 40, determinism_class=Determinism.SEED_PATH_INVARIANT, want_logprobs=5)
    b.admit(22, _prompt(100, 7, generation=3), sampling=Sampling.HOST, decode_replay=2,
            determinism_class=Determinism.DISTRIBUTION_EXACT, want_logprobs=20)
    b.admit(23, _prompt(107, 64), grammar_handle=5, grammar_replay=4, logit_bias_handle=6, seed_handle=7,
            strategy_slot=1, params=sampling_params(temperature=-1.0, top_p=1.0, min_p=1.0))
    b.admit((1 << 64) - 1, _prompt((1 << 64) - 9, 8),
            params=sampling_params(temperature=3.0e38, top_k=2**32 - 1))
    plans.append(b.build())

    b = PlanBuilder(4, prefill_token_budget=256)
    b.prefill(11, 0, 16).prefill(21, 32, 64).prefill(31, 4_000_000_000, 294_967_295)
    plans.append(b.build())

    b = PlanBuilder(5, max_decode_lanes=8)
    b.decode(11).decode(21, max_new_tokens=16, overshoot=4)
    b.decode(22, max_new_tokens=0xFFFF, overshoot=0xFFFF)
    plans.append(b.build())

    b = PlanBuilder(6)
    b.commit(22, 17, 0xDEADBEEF).commit(24, 2**32 - 1, 2**64 - 1)
    plans.append(b.build())

    b = PlanBuilder(7, flags=PlanFlag.DRAIN)
    b.retire(11).retire(21, publish_to_cache=True).retire(22)
    plans.append(b.build())

    b = PlanBuilder(2**63 - 1, flags=PlanFlag.PARTIAL_EMITS, max_decode_lanes=4, prefill_token_budget=128,
                    evictable_cache_classes=CacheClass.RESIDENT_PREFIX_CLASS, max_evict_bytes=1 << 30,
                    protected_quota_bytes=1 << 20)
    b.retire(1, publish_to_cache=True)
    b.commit(2, 5, 99)
    b.admit(3, _prompt(0, 12), sampling=Sampling.HOST)
    b.admit(4, _prompt(12, 40), sampling=Sampling.GPU_SAMPLE,
            params=sampling_params(temperature=1.0, top_k=1))
    b.prefill(3, 0, 12).prefill(4, 0, 40)
    b.decode(2).decode(3).decode(4, max_new_tokens=8)
    # In-process pointers: decode_plan clears them across processes.
    plans.append(b.build()._replace(on_partial_emit=0x7F00_0000_1000, partial_emit_user=0x7F00_0000_2000))
    return plans


def seed_corpus() -> list[bytes]:
    return [codec.encode("TickPlan", p) for p in seed_plans()]


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


# -------------------------------------------------------------- built-in loop


@dataclass(slots=True)
class Summary:
    runs: int = 0
    decoded: int = 0
    rejects: Counter[str] = field(default_factory=Counter)
    elapsed_s: float = 0.0
    corpus: int = 0
    outcomes: int = 0

    def as_dict(self) -> dict[str, object]:
        return {
            "runs": self.runs,
            "decoded": self.decoded,
            "rejects": dict(sorted(self.rejects.items())),
            "elapsed_s": round(self.elapsed_s, 3),
            "exec_per_s": round(self.runs / self.elapsed_s, 1) if self.elapsed_s > 0 else None,
            "corpus": self.corpus,
            "distinct_outcomes": self.outcomes,
        }


def _save(directory: str, data: bytes, prefix: str = "") -> str:
    path = os.path.join(directory, prefix + hashlib.sha1(data).hexdigest())
    if not os.path.exists(path):
        with open(path, "wb") as f:
            f.write(data)
    return path


def load_corpus(directory: str) -> list[bytes]:
    out = []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if os.path.isfile(path) and not name.startswith("crash-"):
            with open(path, "rb") as f:
                out.append(f.read())
    return out


def run_builtin(runs: int, seed: int = 0, corpus_dir: str | None = None, *, pool_cap: int = 512,
                artifact_dir: str | None = None) -> Summary:
    """Mutate from the seeds (and `corpus_dir`), keeping inputs whose outcome
    is new. A finding is written to `artifact_dir` (default: corpus_dir, else
    the current directory) and re-raised."""
    rng = random.Random(seed)
    pool = seed_corpus()
    if corpus_dir:
        os.makedirs(corpus_dir, exist_ok=True)
        pool += load_corpus(corpus_dir)
        for data in pool:
            _save(corpus_dir, data)
    seen: set[tuple] = set()
    for data in pool:
        seen.add(outcome_key(one_input(data)))
    summary = Summary()
    start = time.perf_counter()
    try:
        _loop(runs, rng, pool, seen, summary, corpus_dir, artifact_dir, pool_cap)
    except KeyboardInterrupt:
        if runs:
            raise
        # unbounded: Ctrl-C ends the run; the summary still prints
    summary.elapsed_s = time.perf_counter() - start
    summary.corpus = len(pool)
    summary.outcomes = len(seen)
    return summary


def _loop(runs: int, rng, pool: list, seen: set, summary: Summary, corpus_dir, artifact_dir, pool_cap: int) -> None:
    for _ in (itertools.count() if runs == 0 else range(runs)):  # 0: until interrupted
        data = mutate(rng.choice(pool), rng, pool)
        try:
            outcome = one_input(data)
        except BaseException:
            path = _save(artifact_dir or corpus_dir or os.getcwd(), data, "crash-")
            print(f"finding: input saved to {path}", file=sys.stderr)
            raise
        summary.runs += 1
        if isinstance(outcome, PlanReject):
            summary.rejects[outcome.status.name] += 1
        else:
            summary.decoded += 1
        key = outcome_key(outcome)
        if key not in seen:
            seen.add(key)
            if len(pool) < pool_cap:
                pool.append(data)
            else:
                pool[rng.randrange(len(pool))] = data
            if corpus_dir:
                _save(corpus_dir, data)


# ------------------------------------------------------------------ atheris


_INSTRUMENTED = ("superfluid.abi", "superfluid.engine")


def _instrument_decoder(atheris: Any) -> None:
    """Coverage for the decoder's own modules only: instrument_all() spends
    ~40 s on numpy and the rest, which has no Python branches worth steering."""
    for name, module in list(sys.modules.items()):
        if not name.startswith(_INSTRUMENTED):
            continue
        for obj in list(vars(module).values()):
            if inspect.isclass(obj) and obj.__module__ == name:
                fns = [f for f in vars(obj).values() if inspect.isfunction(f)]
            elif inspect.isfunction(obj) and obj.__module__ == name:
                fns = [obj]
            else:
                continue
            for fn in fns:
                atheris.instrument_func(fn)


def run_atheris(runs: int | None, seed: int | None, corpus_dir: str | None, extra: list[str]) -> None:
    try:
        import atheris  # type: ignore[import-not-found]
    except ImportError:
        sys.exit("--atheris needs the atheris module: pip install atheris "
                 "(or install the extra: pip install 'superfluid[fuzz]')")
    corpus_dir = corpus_dir or tempfile.mkdtemp(prefix="sf-plan-corpus-")
    os.makedirs(corpus_dir, exist_ok=True)
    seeds = seed_corpus()
    for data in seeds:
        _save(corpus_dir, data)

    def custom_mutator(data: bytes, max_size: int, mseed: int) -> bytes:
        rng = random.Random(mseed)
        if rng.random() < 0.2:  # libFuzzer's own byte mutations, with its CMP hints
            return atheris.Mutate(data, max_size)
        return mutate(data, rng, seeds, max_len=min(max_size, MAX_LEN))

    def custom_crossover(a: bytes, b: bytes, max_out_size: int, cseed: int) -> bytes:
        return splice(a, b, random.Random(cseed))[:max_out_size]

    argv = [sys.argv[0], *extra]
    if runs:  # libFuzzer's -runs=0 means none; ours means until interrupted
        argv.append(f"-runs={runs}")
    if seed is not None:
        argv.append(f"-seed={seed}")
    argv.append(corpus_dir)
    _instrument_decoder(atheris)
    atheris.Setup(argv, fuzz_one_input, custom_mutator=custom_mutator, custom_crossover=custom_crossover)
    atheris.Fuzz()


# ---------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m superfluid.fuzz.plan_target",
        description="Fuzz the plan decoder (decode_plan). Arguments after -- go to libFuzzer with --atheris.")
    parser.add_argument("--runs", type=int, default=None,
                        help="inputs to run, 0 = until interrupted (built-in default 10000; atheris default: "
                             "unbounded)")
    parser.add_argument("--seed", type=int, default=None, help="random seed (built-in default 0)")
    parser.add_argument("--atheris", action="store_true", help="run under atheris with the custom mutator")
    parser.add_argument("--corpus", metavar="DIR",
                        help="corpus directory: read as seeds, new inputs written to it")
    args, extra = parser.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    if args.atheris:
        run_atheris(args.runs, args.seed, args.corpus, extra)
        return
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    summary = run_builtin(10_000 if args.runs is None else args.runs, 0 if args.seed is None else args.seed,
                          args.corpus)
    print(json.dumps(summary.as_dict()))


if __name__ == "__main__":
    main()
