"""The plan codec: a queue slot to a checked TickPlan, events back to a slot.

`decode_plan` is step 1 of contract §3: the message, its struct size and every
span (RejectBounds), enum values and flag bits (RejectIllegalCombination),
numeric ranges (RejectBounds), and duplicate lane tags inside any list
(RejectIllegalCombination). Whatever it returns is plain data the tick can
check against state without re-validating the encoding.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from math import isfinite as _isfinite
from typing import Any

from superfluid.abi import (
    CACHE_CLASSES_ALL,
    MAX_TOP_LOGPROBS,
    PARAM_FLAGS_ALL,
    PLAN_FLAGS_ALL,
    PLAN_SEQ_MAX,
    Determinism,
    Sampling,
    Status,
    codec,
    ffi,
)
from superfluid.abi.codec import Message, WritableMessage
from superfluid.abi.records import (
    LAYOUTS,
    TOP_LEVEL,
    LaneAdmit,
    LanePrefill,
    LaneRetire,
    SamplingParams,
    TickEvents,
    TickPlan,
)

_SAMPLING = frozenset(int(s) for s in Sampling)
_DETERMINISM = frozenset(int(d) for d in Determinism)
U32_MAX = (1 << 32) - 1


class PlanReject(Exception):
    """A plan refused whole. `status` is the contract §3 status, `field` names
    the offending field (e.g. "admits[2].params.top_p")."""

    def __init__(self, status: int, field: str, message: str):
        super().__init__(f"{Status(status).name}: {field}: {message}")
        self.status = Status(status)
        self.field = field
        self.message = message

    @property
    def detail(self) -> str:
        """One line for TickEvents.message."""
        return f"{self.field}: {self.message}"


def _illegal(field: str, message: str) -> PlanReject:
    return PlanReject(Status.RejectIllegalCombination, field, message)


def _bounds(field: str, message: str) -> PlanReject:
    return PlanReject(Status.RejectBounds, field, message)


def _no_duplicates(items: Sequence[Any], field: str) -> None:
    seen: set[int] = set()
    for i, it in enumerate(items):
        tag = it.lane_tag
        if tag in seen:
            raise _illegal(f"{field}[{i}].lane_tag", f"lane {tag} appears twice in {field}")
        seen.add(tag)


def _check_params(p: SamplingParams, field: str) -> None:
    for name in ("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty", "freq_penalty"):
        v = getattr(p, name)
        if not math.isfinite(v):
            raise _bounds(f"{field}.{name}", f"{v} is not finite")
    if p.top_p < 0:
        raise _bounds(f"{field}.top_p", f"{p.top_p} < 0 (0 or >= 1 turns it off)")
    if not 0 <= p.min_p <= 1:
        raise _bounds(f"{field}.min_p", f"{p.min_p} is outside [0, 1]")
    if p.repeat_penalty < 0:
        raise _bounds(f"{field}.repeat_penalty", f"{p.repeat_penalty} < 0 (0 or 1 turns it off)")
    if p.flags & ~PARAM_FLAGS_ALL:
        raise _illegal(f"{field}.flags", f"unknown bits {p.flags & ~PARAM_FLAGS_ALL:#x}")


def check_plan(plan: TickPlan) -> None:
    """The record-level checks of a decoded plan (no executor state)."""
    if plan.plan_seq > PLAN_SEQ_MAX:
        raise _bounds("TickPlan.plan_seq", f"{plan.plan_seq} > SF_PLAN_SEQ_MAX ({PLAN_SEQ_MAX}): the range leaves "
                                           "room to count up")
    if plan.flags & ~PLAN_FLAGS_ALL:
        raise _illegal("TickPlan.flags", f"unknown bits {plan.flags & ~PLAN_FLAGS_ALL:#x}")
    if plan.evictable_cache_classes & ~CACHE_CLASSES_ALL:
        raise _illegal("TickPlan.evictable_cache_classes",
                       f"unknown bits {plan.evictable_cache_classes & ~CACHE_CLASSES_ALL:#x}")
    admits, prefills, retires = plan.admits, plan.prefills, plan.retires
    if not (admits or prefills or retires):
        if len(plan.decodes) < 2 and len(plan.commits) < 2:
            return  # nothing below can fail: the common decode-only tick
    # One pass that only asks whether anything is wrong (this runs every tick, right
    # after the model has been through the caches); the passes that say what and
    # where run only then, in the order the checks are listed.
    for a in admits:
        p = a.params
        # The sum is finite iff each term is: a decoded f32 is below 3.5e38, so six
        # cannot overflow (a larger Python float in process only takes the long way).
        if (not a.lane_tag or a.sampling not in _SAMPLING or a.determinism_class not in _DETERMINISM
                or a.want_logprobs > MAX_TOP_LOGPROBS or p.flags & ~PARAM_FLAGS_ALL or p.top_p < 0
                or not 0 <= p.min_p <= 1 or p.repeat_penalty < 0
                or not _isfinite(p.temperature + p.top_p + p.min_p + p.repeat_penalty + p.presence_penalty
                                 + p.freq_penalty)):
            _check_admits(admits)
            break
    for pf in prefills:
        if pf.token_offset + pf.token_count > U32_MAX:
            _check_prefills(prefills)
    for r in retires:
        if r.publish_to_cache > 1:
            _check_retires(retires)
    for field in ("admits", "prefills", "decodes", "commits", "retires"):
        items = getattr(plan, field)
        if len(items) > 1 and len({it.lane_tag for it in items}) != len(items):
            _no_duplicates(items, field)


def _check_admits(admits: Sequence[LaneAdmit]) -> None:
    for i, a in enumerate(admits):
        f = f"admits[{i}]"
        if a.lane_tag == 0:
            raise _illegal(f"{f}.lane_tag", "lane tag 0 is reserved (it names the cache in shed entries)")
        if a.sampling not in _SAMPLING:
            raise _illegal(f"{f}.sampling", f"{a.sampling} is not a sampling mode (0..{max(_SAMPLING)})")
        if a.determinism_class not in _DETERMINISM:
            raise _illegal(f"{f}.determinism_class", f"{a.determinism_class} is not a determinism class")
        if a.want_logprobs > MAX_TOP_LOGPROBS:
            raise _bounds(f"{f}.want_logprobs", f"{a.want_logprobs} > MAX_TOP_LOGPROBS ({MAX_TOP_LOGPROBS})")
        _check_params(a.params, f"{f}.params")


def _check_prefills(prefills: Sequence[LanePrefill]) -> None:
    for i, p in enumerate(prefills):
        if p.token_offset + p.token_count > U32_MAX:
            raise _bounds(f"prefills[{i}].token_count", "token_offset + token_count overflows u32")


def _check_retires(retires: Sequence[LaneRetire]) -> None:
    for i, r in enumerate(retires):
        if r.publish_to_cache > 1:
            raise _illegal(f"retires[{i}].publish_to_cache", f"{r.publish_to_cache} is not 0 or 1")


def decode_plan(buf: Message, *, in_process: bool = False) -> TickPlan:
    """A checked TickPlan from a slot message; PlanReject otherwise. Across
    processes (the default) the partial-emit function pointer is meaningless
    and is cleared."""
    try:
        plan: TickPlan = codec.decode(buf, "TickPlan")
    except codec.CodecError as e:
        raise PlanReject(e.status, e.field, e.message) from None
    check_plan(plan)
    if not in_process and (plan.on_partial_emit or plan.partial_emit_user):
        plan = plan._replace(on_partial_emit=0, partial_emit_user=0)
    return plan


_PLAN = codec.CODECS["TickPlan"]
_PLAN_KIND = TOP_LEVEL["TickPlan"]
_PLAN_SPANS = tuple(i for i, f in enumerate(LAYOUTS["TickPlan"]) if f.kind == "span")
assert _PLAN.flat is False and len(_PLAN_SPANS) == 5 and tuple(range(8, 13)) == _PLAN_SPANS, _PLAN_SPANS
assert TickPlan._fields[1:4] == ("plan_seq", "flags", "max_decode_lanes") and TickPlan._fields[5] == \
    "evictable_cache_classes"
_PLAN_SPANS_BYTES = len(_PLAN_SPANS) * ffi.sizeof("Span")


# empty_plan's one read of a plan message: the header's kind, record_bytes and
# arena_bytes, then the record's struct_size, plan_seq, flags, max_decode_lanes,
# evictable_cache_classes and its five spans as one run of bytes (all zero in an
# empty plan); what it skips decode_plan does not refuse.
_EMPTY = struct.Struct(f"<IIQ8xQQII4xI16x{_PLAN_SPANS_BYTES}s16x")
_NO_SPANS = bytes(_PLAN_SPANS_BYTES)
assert _EMPTY.size == _PLAN.message.size and codec.MSG_HEADER_BYTES == 24
assert [ffi.offsetof("TickPlan", f) for f in ("plan_seq", "max_decode_lanes", "evictable_cache_classes", "admits",
                                               "on_partial_emit")] == [8, 20, 28, 48, 48 + _PLAN_SPANS_BYTES]


def empty_plan(buf: Message) -> tuple[int, int] | None:
    """(plan_seq, max_decode_lanes) of a slot message that is a TickPlan with
    no lists, no arena and nothing decode_plan would refuse: the executor's
    tick_empty can run it with no decoding. None for anything else, which
    decode_plan then reads (and refuses where it must)."""
    if len(buf) < _EMPTY.size:
        return None
    kind, record_bytes, arena_bytes, size, seq, flags, max_lanes, classes, spans = _EMPTY.unpack_from(buf)
    if (kind != _PLAN_KIND or record_bytes != _PLAN.size or size != _PLAN.size or arena_bytes or spans != _NO_SPANS
            or seq > PLAN_SEQ_MAX or flags & ~PLAN_FLAGS_ALL or classes & ~CACHE_CLASSES_ALL):
        return None
    return seq, max_lanes


def plan_seq_of(buf: Message) -> int:
    """The plan_seq of a slot message, for answering a plan that did not
    decode (0 when even that cannot be read)."""
    try:
        mv = memoryview(buf).cast("B")
        _kind, record_bytes, _ = codec.read_header(mv)
        if record_bytes >= 16 and len(mv) >= codec.MSG_HEADER_BYTES + 16:
            return int.from_bytes(mv[codec.MSG_HEADER_BYTES + 8:codec.MSG_HEADER_BYTES + 16], "little")
    except codec.CodecError:
        pass
    return 0


def reject_events(plan_seq: int, reject: PlanReject, *, epoch: int = 0, **fields: Any) -> TickEvents:
    """The events of a plan that changed nothing."""
    return TickEvents(plan_seq=plan_seq, status=int(reject.status), message=reject.detail.encode(),
                      worker_epoch=epoch, **fields)


def encode_events_into(buf: WritableMessage, events: TickEvents, session: int = 0) -> int:
    return codec.encode_into(buf, "TickEvents", events, session=session)


def _bare_events() -> bytes:
    """The slot message of an OK TickEvents with no lists, no op completions
    and no message: what encode_bare_events_into starts from."""
    buf = bytearray(codec.CODECS["TickEvents"].message.size)
    codec.encode_into(buf, "TickEvents", TickEvents())
    return bytes(buf)


_BARE = _bare_events()
_H = codec.MSG_HEADER_BYTES
_BARE_SEQ, _BARE_WALL, _BARE_MEM, _BARE_EPOCH = (_H + ffi.offsetof("TickEvents", *f) for f in (
    ("plan_seq",), ("timings", "wall_ns"), ("mem",), ("worker_epoch",)))
# Two stores besides the template: MsgHeader.session to plan_seq, and wall_ns
# to worker_epoch (the words between them are the template's, written back).
_BARE_HEAD = struct.Struct("<3Q")  # session, struct_size, plan_seq
_BARE_TAIL = struct.Struct("<11Q")  # wall_ns, 3 other timings, the 6 mem words, worker_epoch
_SESSION_AT = codec.SESSION_OFFSET
_BARE_SIZE = _BARE_HEAD.unpack_from(_BARE, _SESSION_AT)[1]
_BARE_T1, _BARE_T2, _BARE_T3 = _BARE_TAIL.unpack_from(_BARE, _BARE_WALL)[1:4]
assert _BARE_SEQ == _SESSION_AT + 16 and ffi.sizeof("TickMemCounters") == 48
assert _BARE_MEM == _BARE_WALL + 32 and _BARE_EPOCH == _BARE_MEM + 48  # (tests/abi: bytes equal encode_events_into's)


def encode_bare_events_into(buf: WritableMessage, plan_seq: int, wall_ns: int, mem: Sequence[int], epoch: int,
                            session: int) -> None:
    """What encode_events_into writes for an OK TickEvents with no lists, no
    op completions and no message (an empty plan's), at a few stores' cost."""
    buf[:len(_BARE)] = _BARE
    _BARE_HEAD.pack_into(buf, _SESSION_AT, session, _BARE_SIZE, plan_seq)
    a, b, c, d, e, f = mem
    _BARE_TAIL.pack_into(buf, _BARE_WALL, wall_ns, _BARE_T1, _BARE_T2, _BARE_T3, a, b, c, d, e, f, epoch)


def decode_events(buf: Message) -> TickEvents:
    events: TickEvents = codec.decode(buf, "TickEvents")
    return events
