"""The codec's C fast path (abi/sf_codec.c) against its Python path: the same
bytes for every record it encodes, the same record for every message it
decodes, and None (so the Python path raises its error) exactly where the
Python path refuses. The fast path is what every worker and planner runs, so
this is the test that it says nothing the Python codec would not."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from superfluid.abi import codec, ffi, packers
from superfluid.abi.records import (
    CLASSES,
    LAYOUTS,
    TOP_LEVEL,
    LaneAdmit,
    LaneDecode,
    RingRef,
    TickEvents,
    TickPlan,
)
from superfluid.fuzz.plan_mutator import mutate
from superfluid.fuzz.plan_target import seed_corpus
from superfluid.testing.record_strategies import record

native = packers._native
pytestmark = pytest.mark.skipif(native is None, reason="superfluid.abi._codec was not built")

SLOT = 1 << 16
_ERR = object()


def _c_encode(name, rec, session=5, size=SLOT):
    buf = bytearray(b"\xa5" * size)  # not zeros: padding the C path forgot to write would show
    n = native.encode_into(buf, codec.CODECS[name].index, rec, TOP_LEVEL[name], session)
    return None if n is None else bytes(buf[:n])


def _py_encode(name, rec, session=5, size=SLOT):
    buf = bytearray(b"\x5a" * size)
    try:
        n = codec.encode_into_py(buf, name, rec, session=session)
    except (codec.EncodeError, KeyError, TypeError, ValueError):
        return _ERR
    return bytes(buf[:n])


def _c_decode(name, data):
    rec = native.decode(data, codec.CODECS[name].index, TOP_LEVEL[name])
    return _ERR if rec is None else rec  # None: the Python path is to say what is wrong


def _py_decode(name, data):
    try:
        return codec.decode_py(data, name)
    except codec.CodecError:
        return _ERR


def _same(a, b) -> bool:
    """Equal records, NaN equal to NaN (a float field decodes any bits)."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, tuple) and isinstance(b, tuple):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def test_the_fast_path_is_there_and_taken():
    # Negative control for everything below: a build without it would compare Python with Python.
    assert native is not None and all(c.index >= 0 for c in codec.CODECS.values())
    plan = TickPlan(plan_seq=3, decodes=(LaneDecode(1, 2, 0),))
    assert _c_encode("TickPlan", plan) is not None
    assert _c_decode("TickPlan", codec.encode("TickPlan", plan)) == plan._replace(struct_size=ffi.sizeof("TickPlan"))
    assert _c_decode("TickPlan", b"\0" * 8) is _ERR


@pytest.mark.parametrize("name", sorted(TOP_LEVEL))
@settings(max_examples=150)
@given(data=st.data())
def test_same_bytes_and_records_as_the_python_codec(name, data):
    rec = data.draw(record(name))
    if data.draw(st.booleans()) and "struct_size" in rec._fields:
        rec = rec._replace(struct_size=0)  # "this ABI's size", filled in by both
    session = data.draw(st.integers(0, (1 << 64) - 1))
    want = _py_encode(name, rec, session)
    got = _c_encode(name, rec, session)
    if want is _ERR:
        assert got is None  # e.g. a struct_size that is not this ABI's: refused by the decoder, not here
        return
    assert got == want
    assert _same(_c_decode(name, want), _py_decode(name, want))


@pytest.mark.parametrize("name", sorted(TOP_LEVEL))
@settings(max_examples=60)
@given(data=st.data())
def test_a_slot_too_small_is_the_python_codecs_error(name, data):
    rec = data.draw(record(name))
    full = _py_encode(name, rec)
    assert full is not _ERR
    size = data.draw(st.integers(0, len(full) - 1)) if len(full) else 0
    assert _c_encode(name, rec, size=size) is None
    assert _py_encode(name, rec, size=size) is _ERR
    assert _c_encode(name, rec, size=len(full)) == full  # and exactly enough room is enough


def _mutated(seed: int, n: int):
    rng = random.Random(seed)
    corpus = seed_corpus()
    events = [codec.encode("TickEvents", TickEvents(plan_seq=i, message=b"x" * i)) for i in range(3)]
    for _ in range(n):
        base = rng.choice(corpus)
        yield "TickPlan", mutate(base, rng, corpus)
        yield "TickEvents", mutate(rng.choice(events), rng, events)


def test_mutated_messages_decode_alike_or_are_refused_alike():
    decoded = refused = 0
    for name, data in _mutated(7, 4000):
        want, got = _py_decode(name, data), _c_decode(name, data)
        assert _same(got, want), (name, data.hex())
        if want is _ERR:
            refused += 1
        else:
            decoded += 1
    assert decoded > 500 and refused > 500  # both sides of the comparison were exercised


def _bad_values():
    big = 1 << 64
    prompt = RingRef(1, 2, 3, 4)
    yield TickPlan(plan_seq=big)  # past u64
    yield TickPlan(plan_seq=-1)
    yield TickPlan(flags=1.5)  # a float in an integer field
    yield TickPlan(decodes=(LaneDecode(1, 1 << 16, 0),))  # past u16, inside a span
    yield TickPlan(decodes=(LaneDecode(1, "3", 0),))
    yield TickPlan(admits=(LaneAdmit(lane_tag=1, prompt=prompt, params=(1e40,) + (0,) * 7),))  # past f32
    yield TickPlan(decodes=((1, 2),))  # a row too short
    yield TickPlan(decodes=(LaneDecode(1, 2, 0), "x"))
    yield TickPlan(decodes=42)
    yield TickEvents(message="é" * 9)  # str: UTF-8, as the Python path
    yield TickEvents(message=bytearray(b"ab"))  # the Python path's to take
    yield TickEvents(plan_seq=np.uint32(9), status=np.int64(0))  # numpy integers, via __index__
    yield TickEvents(plan_seq=True)
    yield TickPlan(decodes=[LaneDecode(1, 2, 0)])  # a list is a list of rows too
    yield TickPlan(decodes=(LaneDecode(1, 2, 0) + (99,),))  # longer rows: the Python path indexes them
    yield TickPlan(struct_size=None)


@pytest.mark.parametrize("rec", list(_bad_values()), ids=lambda r: type(r).__name__)
def test_odd_and_bad_values_end_as_the_python_codec_ends(rec):
    name = type(rec).__name__
    want = _py_encode(name, rec)
    got = _c_encode(name, rec)
    if want is _ERR:
        assert got is None
        with pytest.raises(codec.EncodeError):
            codec.encode_into(bytearray(SLOT), name, rec)  # the public call still says what is wrong
    else:
        assert got is None or got == want
        buf = bytearray(SLOT)
        assert bytes(buf[:codec.encode_into(buf, name, rec, session=5)]) == want


def test_every_record_the_fast_path_knows_has_its_compiled_layout():
    # The schema handed to C, read back against cffi: offsets and sizes are the compiler's.
    rows, index = packers._schema()
    for name, i in index.items():
        cls, size, _has_ss, fields = rows[i]
        assert cls is CLASSES[name] and size == ffi.sizeof(name)
        assert [f[1] for f in fields] == [ffi.offsetof(name, f.name) for f in LAYOUTS[name]]


def test_a_wrong_call_is_an_error_not_a_fallback():
    # None means "the Python path decides"; a call that is wrong itself must say so instead.
    with pytest.raises(IndexError):
        native.decode(b"\0" * 64, len(codec.CODECS), TOP_LEVEL["TickPlan"])
    with pytest.raises(TypeError):
        native.encode_into(bytearray(64), 0, TickPlan())
