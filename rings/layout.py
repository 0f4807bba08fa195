"""A segment's geometry: how many slots and elements each queue and ring
has (SegmentConfig) and where each lies in the file (plan_layout): a
SegmentHeader, then the four queues and the three rings, each from the
cache line after the one before."""

from __future__ import annotations

import dataclasses
import json

from superfluid.abi import CACHE_LINE, RingId, ffi, lib
from superfluid.rings.errors import SegmentError

HEADER_BYTES = ffi.sizeof("SegmentHeader")
QUEUE_HEADER_BYTES = ffi.sizeof("Queue")
RING_HEADER_BYTES = ffi.sizeof("DataRing")
QUEUES = ("plan", "event", "op", "stream")
# (name, ring id, the SegmentConfig field of its capacity)
RINGS = (("prompt", RingId.PROMPT, "prompt_tokens"), ("token", RingId.TOKENS, "emit_tokens"),
         ("logits", RingId.LOGITS, "logits_floats"))


@dataclasses.dataclass(frozen=True)
class SegmentConfig:
    """Sizes of a segment's queues and rings."""

    plan_slots: int = 8
    plan_slot_bytes: int = 256 << 10
    event_slots: int = 8
    event_slot_bytes: int = 1 << 20
    op_slots: int = 64
    op_slot_bytes: int = 64 << 10
    stream_slots: int = 4096
    stream_slot_bytes: int = 64
    prompt_tokens: int = 1 << 20
    emit_tokens: int = 1 << 20
    logits_floats: int = 1 << 22

    def check(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or v <= 0:
                raise SegmentError(f"SegmentConfig.{f.name} = {v!r}: must be a positive int")
            if v > _MAX_SIZE:  # byte sizes computed from it must not wrap
                raise SegmentError(f"SegmentConfig.{f.name} = {v}: above the limit of {_MAX_SIZE}")
        for q in QUEUES:
            n, b = getattr(self, f"{q}_slots"), getattr(self, f"{q}_slot_bytes")
            if n & (n - 1):
                raise SegmentError(f"SegmentConfig.{q}_slots = {n}: must be a power of two")
            if b % CACHE_LINE or b >= 1 << 32:
                raise SegmentError(f"SegmentConfig.{q}_slot_bytes = {b}: a multiple of {CACHE_LINE} below 4 GiB")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> SegmentConfig:
        try:
            raw = json.loads(text)
            cfg = cls(**raw)
        except (ValueError, TypeError) as e:
            raise SegmentError(f"segment config {text[:80]!r}: {e}") from None
        cfg.check()
        return cfg


_MAX_SIZE = 1 << 36  # slots, slot bytes or ring elements: far above any real segment


def line_up(n: int) -> int:
    """n rounded up to a whole cache line."""
    return (n + CACHE_LINE - 1) // CACHE_LINE * CACHE_LINE


def plan_layout(cfg: SegmentConfig) -> tuple[dict[str, int], int]:
    """Each region's offset (SegmentLayout's field names) and the file's size."""
    at = line_up(HEADER_BYTES)
    offsets: dict[str, int] = {}
    for q in QUEUES:
        offsets[f"{q}_queue"] = at
        at = line_up(at + lib.sf_queue_bytes(getattr(cfg, f"{q}_slots"), getattr(cfg, f"{q}_slot_bytes")))
    for r, _, cap in RINGS:
        offsets[f"{r}_ring"] = at
        at = line_up(at + lib.sf_ring_bytes(getattr(cfg, cap)))
    return offsets, at


def segment_bytes(cfg: SegmentConfig) -> int:
    """The size of a segment file made with `cfg`."""
    cfg.check()
    return plan_layout(cfg)[1]

