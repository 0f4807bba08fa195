"""Putting a segment's header back (contract §10: what a planner writes there is
input, not authority). The daemon repairs all of it before every worker
start; the worker, which knows the geometry from the daemon, puts the
layout and geometry back now and then so a scribble never locks a new
planner out. Each returns what was wrong, one line per field, to log."""

from __future__ import annotations

import functools
import os
from typing import Any

from superfluid.abi import ABI_VERSION, MAGIC, ffi, lib
from superfluid.rings.errors import SegmentError
from superfluid.rings.layout import HEADER_BYTES, QUEUES, RINGS, plan_layout
from superfluid.rings.segment import Segment


def _put(fixed: list[str], obj: Any, field: str, want: object, label: str) -> None:
    got = getattr(obj, field)
    if got != want:
        fixed.append(f"{label} was {got!r}, now {want!r}")
        setattr(obj, field, want)


def repair(seg: Segment, *, fault_injection: bool = False) -> list[str]:
    """Identity, layout, queue and ring geometry, impossible queue counters
    and the stop report, as the daemon made them (`seg.config`)."""
    if seg.config is None:
        raise SegmentError(f"{seg.path}: repair needs the config the segment was made with")
    h = seg.header
    fixed: list[str] = []
    put = functools.partial(_put, fixed)
    put(h, "fault_injection", int(fault_injection), "fault_injection")
    name, index = seg.made_as or (ffi.string(h.name).decode(errors="replace"), int(h.worker_index))
    fixed += repair_identity(seg, name, index, os.getpid())
    fixed += repair_geometry(seg)
    for q in QUEUES:
        sq = seg.queues[q]
        if not sq.sane():
            head, tail = sq.head, sq.tail
            sq.reset()
            fixed.append(f"{q} queue counters head {head} tail {tail}: reset")
    if seg.stop_requested:
        fixed.append("stop_requested was set")
        seg.request_stop(False)
    return fixed


def repair_identity(seg: Segment, name: str, index: int, daemon_pid: int) -> list[str]:
    """Line 0 and the daemon's pid: what a planner checks before it connects
    (the worker puts it back as it knew it at its start)."""
    h = seg.header
    fixed: list[str] = []
    put = functools.partial(_put, fixed)
    put(h, "abi_version", ABI_VERSION, "abi_version")
    put(h, "header_bytes", HEADER_BYTES, "header_bytes")
    put(h, "segment_bytes", seg.size, "segment_bytes")
    put(h, "owner_uid", os.geteuid(), "owner_uid")
    put(h, "daemon_pid", daemon_pid, "daemon_pid")
    if ffi.string(h.name) != name.encode() or h.worker_index != index:
        fixed.append(f"name/index was {ffi.string(h.name)[:40]!r}/{h.worker_index}")
        ffi.memmove(h.name, name.encode().ljust(len(h.name), b"\0"), len(h.name))
        h.worker_index = index
    if lib.sf_load_acquire_u64(ffi.addressof(h, "magic")) != MAGIC:
        fixed.append("magic was wrong")
        lib.sf_store_release_u64(ffi.addressof(h, "magic"), MAGIC)
    return fixed


def repair_geometry(seg: Segment) -> list[str]:
    """The layout and the queue and ring geometry from `seg.config` (nothing
    without one)."""
    cfg = seg.config
    if cfg is None:
        return []
    h = seg.header
    base = ffi.cast("char *", h)
    fixed: list[str] = []
    put = functools.partial(_put, fixed)
    offsets, _ = plan_layout(cfg)
    for k, v in offsets.items():
        put(h.layout, k, v, f"layout.{k}")
    for q in QUEUES:
        raw = ffi.cast("Queue *", base + offsets[f"{q}_queue"])
        put(raw, "n_slots", getattr(cfg, f"{q}_slots"), f"{q} queue n_slots")
        put(raw, "slot_bytes", getattr(cfg, f"{q}_slot_bytes"), f"{q} queue slot_bytes")
    for r, rid, cap in RINGS:
        raw = ffi.cast("DataRing *", base + offsets[f"{r}_ring"])
        put(raw, "ring_id", int(rid), f"{r} ring id")
        put(raw, "elem_bytes", 4, f"{r} ring elem_bytes")
        put(raw, "capacity", getattr(cfg, cap), f"{r} ring capacity")
    return fixed
