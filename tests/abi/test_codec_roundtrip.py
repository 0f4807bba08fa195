"""Every record survives encode → decode unchanged, and a decoder fed a
malformed message refuses it with RejectBounds naming the field."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, strategies as st

from superfluid.abi import Status, codec, ffi, record_dtype
from superfluid.abi.records import (
    CLASSES,
    LAYOUTS,
    RECORD_NAMES,
    TOP_LEVEL,
    LaneAdmit,
    LaneDecode,
    OpCompletion,
    RingRef,
    ShedEntry,
    ShedReport,
    TickEvents,
    TickPlan,
)
from superfluid.testing.record_strategies import record


def _with_size(name, rec):
    if "struct_size" in rec._fields:
        rec = rec._replace(struct_size=ffi.sizeof(name))
    return rec


@pytest.mark.parametrize("name", sorted(TOP_LEVEL))
@given(data=st.data())
def test_top_level_records_round_trip(name, data):
    rec = _with_size(name, data.draw(record(name)))
    assert codec.decode(codec.encode(name, rec), name) == rec


# Records that only travel inside others: round-trip each through its dtype,
# and through a top-level record that holds it.
# (Those holding a span, like ShedReport, are covered inside their top-level record.)
INNER = sorted(n for n in set(RECORD_NAMES) - set(TOP_LEVEL) - {"MsgHeader", "Span"}
               if all(f.kind != "span" for f in LAYOUTS[n]))


@pytest.mark.parametrize("name", INNER)
@given(data=st.data())
def test_inner_records_round_trip_through_their_layout(name, data):
    rec = data.draw(record(name))
    raw = codec.pack_record(name, rec)
    assert len(raw) == ffi.sizeof(name)
    assert codec.unpack_record(name, raw) == rec
    # numpy, reading the same bytes with the dtype of the same layout, agrees.
    assert np.frombuffer(raw, dtype=record_dtype(name))[0].tolist()[0] == rec[0]


def test_padding_is_written_as_zeros():
    from superfluid.abi.records import LaneDecode as D

    raw = codec.pack_record("LaneDecode", D(lane_tag=(1 << 64) - 1, max_new_tokens=0xFFFF, overshoot=0xFFFF))
    assert raw[12:16] == b"\0\0\0\0"


def test_the_encoding_is_the_compilers_layout():
    # Write through the codec, read through cffi: the two agree field by field.
    plan = TickPlan(plan_seq=7, flags=2, max_decode_lanes=3, prefill_token_budget=99, max_evict_bytes=1 << 40,
                    admits=(LaneAdmit(lane_tag=11, prompt=RingRef(1, 2, 3, 4), want_logprobs=5),),
                    decodes=(LaneDecode(11, 6, 1), LaneDecode(12, 1, 0)))
    raw = bytearray(codec.encode("TickPlan", plan))
    base = ffi.from_buffer(raw)
    p = ffi.cast("TickPlan *", base + codec.MSG_HEADER_BYTES)
    assert (p.struct_size, p.plan_seq, p.flags, p.max_decode_lanes) == (ffi.sizeof("TickPlan"), 7, 2, 3)
    assert p.max_evict_bytes == 1 << 40 and p.decodes.count == 2 and p.admits.count == 1
    arena = base + codec.arena_offset(ffi.sizeof("TickPlan"))
    a = ffi.cast("LaneAdmit *", arena + p.admits.offset)
    assert (a.lane_tag, a.prompt.generation, a.prompt.len, a.want_logprobs) == (11, 2, 4, 5)
    d = ffi.cast("LaneDecode *", arena + p.decodes.offset)
    assert [(d[i].lane_tag, d[i].max_new_tokens) for i in range(2)] == [(11, 6), (12, 1)]
    assert p.decodes.offset % 8 == 0 and p.admits.offset % 8 == 0


def test_nested_spans_round_trip():
    ev = TickEvents(plan_seq=3, message=b"why", shed=ShedReport(1, 0, 0, (ShedEntry(5, 2, 1, 0, 9),)),
                    op_completions=(OpCompletion(op_id=1, payload=b"\x81\xa1k\x01"), OpCompletion(op_id=2)))
    ev = _with_size("TickEvents", ev)
    assert codec.decode(codec.encode("TickEvents", ev), "TickEvents") == ev


def test_a_changed_byte_changes_the_record():
    # Negative control for the round trips: decode is not returning a cached value.
    plan = _with_size("TickPlan", TickPlan(plan_seq=1, decodes=(LaneDecode(1, 2, 0),)))
    raw = bytearray(codec.encode("TickPlan", plan))
    raw[codec.MSG_HEADER_BYTES + ffi.offsetof("TickPlan", "plan_seq")] ^= 0x04
    assert codec.decode(raw, "TickPlan").plan_seq == 5


# ------------------------------------------------------------ malformed


def _plan_bytes(**kw) -> bytearray:
    return bytearray(codec.encode("TickPlan", TickPlan(plan_seq=1, decodes=(LaneDecode(1, 1, 0),), **kw)))


def _put(raw: bytearray, at: int, value: int, width: int) -> None:
    raw[at:at + width] = value.to_bytes(width, "little")


def _rec(field: str) -> int:
    return codec.MSG_HEADER_BYTES + ffi.offsetof("TickPlan", field)


def _reject(raw, field_part: str):
    with pytest.raises(codec.CodecError) as e:
        codec.decode(raw, "TickPlan")
    assert e.value.status == Status.RejectBounds
    assert field_part in e.value.field
    return e.value


def test_truncated_message():
    _reject(b"\x01\x00", "MsgHeader")
    _reject(_plan_bytes()[:40], "TickPlan")


def test_wrong_kind():
    raw = _plan_bytes()
    _put(raw, 0, 2, 4)
    _reject(raw, "MsgHeader.kind")


def test_wrong_record_bytes_and_struct_size():
    raw = _plan_bytes()
    _put(raw, 4, ffi.sizeof("TickPlan") - 8, 4)
    _reject(raw, "record_bytes")
    raw = _plan_bytes()
    _put(raw, _rec("struct_size"), ffi.sizeof("TickPlan") + 8, 8)
    _reject(raw, "struct_size")


def test_arena_longer_than_the_slot():
    raw = _plan_bytes()
    _put(raw, 8, len(raw), 8)
    _reject(raw, "arena_bytes")


def test_misaligned_span():
    raw = _plan_bytes()
    _put(raw, _rec("decodes"), 4, 4)
    _reject(raw, "decodes")


def test_span_past_the_arena():
    raw = _plan_bytes()
    _put(raw, _rec("decodes") + 4, 2, 4)
    e = _reject(raw, "decodes")
    assert "overruns" in e.message
    raw = _plan_bytes()
    _put(raw, _rec("decodes"), 1 << 20, 4)
    _reject(raw, "decodes")


def test_count_that_would_overflow_32_bits():
    raw = _plan_bytes()
    _put(raw, _rec("decodes") + 4, (1 << 32) - 1, 4)
    _reject(raw, "decodes")


def test_bytes_span_past_the_arena():
    ev = _with_size("TickEvents", TickEvents(message=b"x" * 16))
    raw = bytearray(codec.encode("TickEvents", ev))
    _put(raw, codec.MSG_HEADER_BYTES + ffi.offsetof("TickEvents", "message") + 4, 17, 4)
    with pytest.raises(codec.CodecError) as e:
        codec.decode(raw, "TickEvents")
    assert e.value.field == "TickEvents.message"


def test_encode_refuses_values_that_do_not_fit():
    with pytest.raises(codec.EncodeError):
        codec.encode("TickPlan", TickPlan(plan_seq=1 << 64))
    with pytest.raises(codec.EncodeError):
        codec.encode("TickPlan", TickPlan(decodes=(LaneDecode(1, 70000, 0),)))
    with pytest.raises(codec.EncodeError, match="slot"):
        codec.encode_into(bytearray(64), "TickPlan", TickPlan())


def test_raw_messages():
    buf = bytearray(64)
    n = codec.write_raw(buf, 3, b"\x80")
    assert codec.raw_payload(buf) == b"\x80" and codec.copy_message(buf) == (3, bytes(buf[:n]))
    with pytest.raises(codec.EncodeError):
        codec.write_raw(bytearray(20), 3, b"12345")
    for name in CLASSES:
        assert CLASSES[name]()  # every record has all-zero defaults
