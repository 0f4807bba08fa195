"""Plain-data Python records, one per struct of superfluid.h.

Every class is made from the compiled header (field names, nesting, array
lengths), so there is no second hand-written copy to drift (header_types.pyi,
generated from these classes, states them for a type checker). Records are
immutable named tuples; a Span field holds the decoded list (or bytes for
message and payload spans) rather than the raw {offset, count}.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from superfluid.abi import ffi, lib

# What each span points at: a record type, or bytes.
SPAN_ITEMS: dict[tuple[str, str], str | type] = {
    ("TickPlan", "admits"): "LaneAdmit",
    ("TickPlan", "prefills"): "LanePrefill",
    ("TickPlan", "decodes"): "LaneDecode",
    ("TickPlan", "commits"): "LaneCommit",
    ("TickPlan", "retires"): "LaneRetire",
    ("TickEvents", "admit_results"): "AdmitResult",
    ("TickEvents", "emits"): "LaneEmit",
    ("TickEvents", "faults"): "LaneFault",
    ("ShedReport", "entries"): "ShedEntry",
    ("TickEvents", "op_completions"): "OpCompletion",
    ("TickEvents", "logprobs"): "LaneLogprob",
    ("TickEvents", "message"): bytes,
    ("OpCompletion", "payload"): bytes,
    ("OpEvents", "op_completions"): "OpCompletion",
}

RECORD_NAMES = (
    "RingRef", "Span", "MsgHeader", "SamplingParams", "LaneAdmit", "LanePrefill", "LaneDecode",
    "LaneCommit", "LaneRetire", "TickPlan", "AdmitResult", "SpecStats", "LaneEmit", "LaneFault",
    "ShedEntry", "ShedReport", "OpCompletion", "TickTimings", "TickMemCounters", "LaneLogprob",
    "TickEvents", "OpEvents", "QueueReset", "PartialEmit", "WorkerNotice", "RuntimeDesc",
)

# Top-level records: the message kind that carries each one.
TOP_LEVEL = {
    "TickPlan": lib.SF_MSG_PLAN,
    "TickEvents": lib.SF_MSG_EVENTS,
    "OpEvents": lib.SF_MSG_OP_EVENTS,
    "PartialEmit": lib.SF_MSG_PARTIAL,
    "WorkerNotice": lib.SF_MSG_WORKER,
    "QueueReset": lib.SF_MSG_RESET,
}


def is_hidden(field_name: str) -> bool:
    """Padding and reserved fields: in the layout, never in a record."""
    return field_name.startswith("_pad") or field_name.startswith("_reserved")


def fields_of(name: str) -> list[tuple[str, Any]]:
    """(field name, cffi field) of struct `name`, padding left out."""
    return [(f, fld) for f, fld in ffi.typeof(name).fields if not is_hidden(f)]


class _Field:
    """How one field converts between the numpy tuple and the record."""

    __slots__ = ("kind", "length", "name", "sub")

    def __init__(self, name: str, kind: str, sub: str | type | None = None, length: int = 0):
        self.name = name
        self.kind = kind  # "scalar" | "struct" | "array" | "chars" | "span"
        self.sub = sub
        self.length = length


def _layout(name: str) -> list[_Field]:
    out = []
    for fname, fld in fields_of(name):
        t = fld.type
        if (name, fname) in SPAN_ITEMS:
            out.append(_Field(fname, "span", SPAN_ITEMS[(name, fname)]))
        elif t.kind == "struct":
            out.append(_Field(fname, "struct", t.cname.removeprefix("struct ")))
        elif t.kind == "array" and t.item.cname == "char":
            out.append(_Field(fname, "chars", None, t.length))
        elif t.kind == "array":
            out.append(_Field(fname, "array", None, t.length))
        else:
            out.append(_Field(fname, "scalar"))
    return out


LAYOUTS: dict[str, list[_Field]] = {}
CLASSES: dict[str, type] = {}


def _default(f: _Field) -> Any:
    if f.kind == "struct":
        assert isinstance(f.sub, str)
        return CLASSES[f.sub]()
    if f.kind == "array":
        return (0,) * f.length
    if f.kind == "chars":
        return b""
    if f.kind == "span":
        return b"" if f.sub is bytes else ()
    return 0


def _make_class(name: str) -> type:
    layout = _layout(name)
    for f in layout:
        if f.kind == "struct" and isinstance(f.sub, str) and f.sub not in CLASSES:
            CLASSES[f.sub] = _make_class(f.sub)
    LAYOUTS[name] = layout
    # Made from the header at run time; header_types.pyi states each class for a type checker.
    names, defaults = [f.name for f in layout], [_default(f) for f in layout]
    cls: type = collections.namedtuple(name, names, defaults=defaults)  # type: ignore[misc]
    cls.__doc__ = f"Record {name} of superfluid.h (fields: {', '.join(f.name for f in layout)})."
    cls.__module__ = __name__
    return cls


for _n in RECORD_NAMES:
    if _n not in CLASSES:
        CLASSES[_n] = _make_class(_n)

if TYPE_CHECKING:  # the same classes, stated for a type checker (abi/gen_types.py)
    from superfluid.abi.header_types import (
        AdmitResult as AdmitResult,
        LaneAdmit as LaneAdmit,
        LaneCommit as LaneCommit,
        LaneDecode as LaneDecode,
        LaneEmit as LaneEmit,
        LaneFault as LaneFault,
        LaneLogprob as LaneLogprob,
        LanePrefill as LanePrefill,
        LaneRetire as LaneRetire,
        MsgHeader as MsgHeader,
        OpCompletion as OpCompletion,
        OpEvents as OpEvents,
        PartialEmit as PartialEmit,
        QueueReset as QueueReset,
        RingRef as RingRef,
        RuntimeDesc as RuntimeDesc,
        SamplingParams as SamplingParams,
        ShedEntry as ShedEntry,
        ShedReport as ShedReport,
        Span as Span,
        SpecStats as SpecStats,
        TickEvents as TickEvents,
        TickMemCounters as TickMemCounters,
        TickPlan as TickPlan,
        TickTimings as TickTimings,
        WorkerNotice as WorkerNotice,
    )
else:
    RingRef = CLASSES["RingRef"]
    Span = CLASSES["Span"]
    MsgHeader = CLASSES["MsgHeader"]
    SamplingParams = CLASSES["SamplingParams"]
    LaneAdmit = CLASSES["LaneAdmit"]
    LanePrefill = CLASSES["LanePrefill"]
    LaneDecode = CLASSES["LaneDecode"]
    LaneCommit = CLASSES["LaneCommit"]
    LaneRetire = CLASSES["LaneRetire"]
    TickPlan = CLASSES["TickPlan"]
    AdmitResult = CLASSES["AdmitResult"]
    SpecStats = CLASSES["SpecStats"]
    LaneEmit = CLASSES["LaneEmit"]
    LaneFault = CLASSES["LaneFault"]
    ShedEntry = CLASSES["ShedEntry"]
    ShedReport = CLASSES["ShedReport"]
    OpCompletion = CLASSES["OpCompletion"]
    TickTimings = CLASSES["TickTimings"]
    TickMemCounters = CLASSES["TickMemCounters"]
    LaneLogprob = CLASSES["LaneLogprob"]
    TickEvents = CLASSES["TickEvents"]
    OpEvents = CLASSES["OpEvents"]
    QueueReset = CLASSES["QueueReset"]
    PartialEmit = CLASSES["PartialEmit"]
    WorkerNotice = CLASSES["WorkerNotice"]
    RuntimeDesc = CLASSES["RuntimeDesc"]

NO_REF = RingRef()

__all__ = ["SPAN_ITEMS", "RECORD_NAMES", "TOP_LEVEL", "LAYOUTS", "CLASSES", "NO_REF", "fields_of"] + list(
    RECORD_NAMES
)

Converter = Callable[[tuple[Any, ...]], Any]
