"""Data rings: prompt tokens, emitted tokens and logits rows (contract §1).

A ring is written in order and wraps; a write never splits, so a reference
is one contiguous run. `RingRef.generation` counts wraps, and a reference is
good only while its elements are still in the ring: the C side checks it
before and after copying, so a read that raced an overwrite is refused, not
returned torn.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from superfluid.abi import RingId, Status, ffi, lib
from superfluid.abi.records import RingRef
from superfluid.rings.errors import RefError

if TYPE_CHECKING:
    from superfluid.rings.segment import Segment

ELEMENT_DTYPE = {
    RingId.PROMPT: np.dtype("<u4"),
    RingId.TOKENS: np.dtype("<u4"),
    RingId.LOGITS: np.dtype("<f4"),
}


def _cref(ref: RingRef) -> Any:
    """The C RingRef, or None when a field does not fit its width."""
    try:
        return ffi.new("RingRef *", tuple(ref))
    except (OverflowError, TypeError, ValueError):
        return None


class DataRing:
    """One data ring of a segment. The writer is one process; any process
    may read."""

    __slots__ = ("_ref_out", "_seg", "_view", "capacity", "dtype", "ring_id")

    def __init__(self, seg: Segment, base_ptr: Any, nbytes: int, geometry: tuple[int, int] | None = None):
        """`geometry`: (ring_id, capacity) known from elsewhere, used and
        written over the shared header (see SlotQueue)."""
        self._seg = seg
        self._view = ffi.new("RingView *")
        if geometry is None:
            ok = lib.sf_ring_attach(self._view, base_ptr, nbytes) == 0
        else:
            ok = lib.sf_ring_attach_as(self._view, base_ptr, nbytes, *geometry) == 0
        if not ok:
            raise ValueError("data ring header does not fit its region")
        self.ring_id = RingId(self._view.ring_id)
        self.dtype = ELEMENT_DTYPE[self.ring_id]
        self.capacity = int(self._view.capacity)
        self._ref_out = ffi.new("RingRef *")

    def _live(self) -> None:
        if self._seg.closed:
            from superfluid.rings.errors import SegmentClosed

            raise SegmentClosed("segment is closed")

    @property
    def head(self) -> int:
        """Elements written so far, skipped tails included."""
        self._live()
        return int(lib.sf_load_acquire_u64(ffi.addressof(self._view.r, "head")))

    def next_start(self) -> int:
        """Where the next write begins, in elements: the reservation when a
        writer died mid-write (sf_ring_begin goes on from there), else the head."""
        self._live()
        r = self._view.r
        return int(max(lib.sf_load_acquire_u64(ffi.addressof(r, "head")),
                       lib.sf_load_acquire_u64(ffi.addressof(r, "reserve"))))

    def start_at(self, position: int) -> None:
        """Go on as a ring that stood at `position` (next_start): for a ring
        no one else uses yet (a replay's, continuing a worker's)."""
        self._live()
        self._view.r.reserve = position
        lib.sf_store_release_u64(ffi.addressof(self._view.r, "head"), position)

    def span_bytes(self, start: int, end: int) -> bytes | None:
        """The bytes at element positions [start, end) (next_start's
        numbering; skipped tails included), or None once the ring no longer
        holds them all. For the ring's one writer: nothing writes meanwhile."""
        self._live()
        cap, n = self.capacity, end - start
        if n <= 0:
            return b""
        if n > cap:
            return None
        buf = ffi.buffer(self._view.data, cap * 4)
        a = start % cap
        if a + n <= cap:
            return bytes(buf[a * 4:(a + n) * 4])
        return bytes(buf[a * 4:]) + bytes(buf[:(n - (cap - a)) * 4])

    def write(self, values: npt.ArrayLike) -> RingRef:
        """Append `values` (one contiguous run) and return its reference."""
        self._live()
        arr = np.ascontiguousarray(values, dtype=self.dtype)
        if arr.ndim != 1:
            arr = arr.reshape(-1)
        out = self._ref_out
        st = lib.sf_ring_write(self._view, ffi.from_buffer(arr), arr.size, out)
        if st != Status.OK:
            raise RefError(st, None, f"{arr.size} elements do not fit a ring of {self.capacity}")
        return RingRef(out.ring_id, out.generation, out.offset, out.len)

    def check(self, ref: RingRef) -> Status:
        """OK, RejectBounds or RejectBadRefGeneration, without copying."""
        self._live()
        cref = _cref(ref)
        return Status.RejectBounds if cref is None else Status(lib.sf_ring_check(self._view, cref))

    def read(self, ref: RingRef) -> np.ndarray:
        """A copy of the referenced elements; RefError when the reference is
        not good (its status says why)."""
        self._live()
        cref = _cref(ref)
        st = Status.RejectBounds if cref is None else lib.sf_ring_check(self._view, cref)
        if st == Status.OK:
            # len is bounded by the capacity once the check passed.
            out = np.empty(int(ref.len), dtype=self.dtype)
            st = lib.sf_ring_read(self._view, cref, ffi.from_buffer(out), out.size)
            if st == Status.OK:
                return out
        raise RefError(st, ref, f"ring {self.ring_id.name} cannot serve this reference")
