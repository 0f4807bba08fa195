"""The data rings and planner flags as a tick sees them.

`TickRings` is the interface; `LocalRings` is the C ring code over private
memory, for the in-process Executor (tests, embedders). A worker's segment
is daemon/segment_rings.py's SegmentRings: the same generation rules
either way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import numpy as np

from superfluid.abi import RingId, ffi, lib
from superfluid.abi.records import RingRef
from superfluid.rings.data import DataRing

if TYPE_CHECKING:
    from superfluid.rings.segment import Segment


class TickRings:
    """What a tick reads and writes besides the plan."""

    prompt: DataRing
    tokens: DataRing
    logits: DataRing

    def read_prompt(self, ref: RingRef) -> np.ndarray:
        """The prompt's tokens; RefError (with its status) when the reference
        is not good or names another ring."""
        return self.prompt.read(ref)

    def write_tokens(self, tokens: np.ndarray) -> RingRef:
        return self.tokens.write(tokens)

    def write_logits(self, row: np.ndarray) -> RingRef:
        return self.logits.write(row)

    def yield_requested(self) -> bool:
        return False

    def latency_wanted(self) -> bool:
        return False


class _Memory:
    """Owner of private ring memory (what DataRing asks of a segment: `closed`)."""

    closed = False

    def __init__(self, nbytes: int):
        self.buf = bytearray(nbytes)
        self.base = ffi.from_buffer(self.buf)


def _local_ring(ring_id: RingId, capacity: int) -> DataRing:
    mem = _Memory(lib.sf_ring_bytes(capacity))
    lib.sf_ring_init(mem.base, int(ring_id), capacity)
    return DataRing(cast("Segment", mem), mem.base, len(mem.buf))  # the ring holds mem: its memory lives as long


class LocalRings(TickRings):
    """Rings in this process's memory; the flags are plain attributes."""

    def __init__(self, prompt_tokens: int = 1 << 20, emit_tokens: int = 1 << 20, logits_floats: int = 1 << 22):
        self.prompt = _local_ring(RingId.PROMPT, prompt_tokens)
        self.tokens = _local_ring(RingId.TOKENS, emit_tokens)
        self.logits = _local_ring(RingId.LOGITS, logits_floats)
        self.yield_flag = False
        self.latency_flag = False

    def yield_requested(self) -> bool:
        return self.yield_flag

    def latency_wanted(self) -> bool:
        return self.latency_flag
