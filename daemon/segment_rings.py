"""A worker's segment as the rings and planner flags a tick sees (executor/tick_rings.py's TickRings)."""

from __future__ import annotations

from superfluid.abi import ffi, lib
from superfluid.executor import TickRings


class SegmentRings(TickRings):
    def __init__(self, segment):
        self.segment = segment
        self.prompt = segment.prompt_ring
        self.tokens = segment.token_ring
        self.logits = segment.logits_ring
        h = segment.header
        self._yield = ffi.addressof(h, "yield_requested")
        self._latency = ffi.addressof(h, "latency_wanted")

    def yield_requested(self) -> bool:
        return bool(lib.sf_load_acquire_u32(self._yield))

    def latency_wanted(self) -> bool:
        return bool(lib.sf_load_acquire_u32(self._latency))
