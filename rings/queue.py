"""SPSC slot queues over shared memory (contract §1).

Fixed slots addressed by ever-growing u64 head/tail counters: the producer
reserves the slot at `head`, fills it, publishes (head + 1, release); the
consumer peeks the slot at `tail`, reads it, releases (tail + 1). A full
queue is back-pressure. Waits spin briefly, then sleep on a futex over the
counter the peer moves, in slices, checking the segment's worker epoch and
state between slices so a dead peer never blocks anyone for good.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from superfluid.abi import WaitResult, codec, ffi, lib
from superfluid.rings.errors import PeerGone, SegmentClosed, StopRequested

if TYPE_CHECKING:
    from superfluid.rings.segment import Segment

# How long a waiter spins before it sleeps: a futex wake costs tens of µs on
# a VM, more than a Python peer's turnaround, so the common answer should
# arrive while spinning.
DEFAULT_SPIN_NS = 200_000
# A wait counts at most this many budgets towards the typical one, so an idle
# spell is forgotten within a few quick answers.
_LONG_WAIT_BUDGETS = 4

# The C calls of the hot paths, typed as superfluid.h declares them (a view is a cffi pointer).
_Wait = Callable[[Any, Any, int, int, int, int], int]  # (view, header, epoch, watch_stop, timeout_ns, spin_ns)
_reserve_at: Callable[[Any], int] = lib.sf_queue_reserve_at
_peek_at: Callable[[Any], int] = lib.sf_queue_peek_at
_wait_reserve: _Wait = lib.sf_queue_wait_reserve
_wait_peek: _Wait = lib.sf_queue_wait_peek
_publish: Callable[[Any], int] = lib.sf_queue_publish
_now_ns: Callable[[], int] = lib.sf_monotonic_ns
_release: Callable[[Any], int] = lib.sf_queue_release
_TIMEOUT, _GONE = -int(WaitResult.TIMEOUT), -int(WaitResult.GONE)
# A long wait returns to Python this often, so signal handlers (Ctrl-C) run.
_SIGNAL_SLICE_S = 0.1


class QueueTimeout(TimeoutError):
    """Nothing to read, or no room to write, within the timeout."""


class SpinBudget:
    """How long a wait spins before it sleeps, from how long this queue's
    recent waits took: the whole budget while they typically end within
    about it (twice it: an answer near the budget is caught most of the
    time), none once they typically do not. A wait spun through a peer's
    long answer (a tick of milliseconds) is a core taken from that peer on a
    small machine; a short one (an empty tick) is answered while spinning."""

    __slots__ = ("budget_ns", "typical_ns")

    def __init__(self, budget_ns: int = DEFAULT_SPIN_NS):
        self.budget_ns = budget_ns
        self.typical_ns = 0  # a running mean (1/8 per wait) of recent waits, each capped

    def spin_ns(self) -> int:
        return self.budget_ns if self.typical_ns <= 2 * self.budget_ns else 0

    def waited(self, ns: int) -> None:
        ns = min(ns, _LONG_WAIT_BUDGETS * self.budget_ns)
        self.typical_ns += (ns - self.typical_ns) >> 3


class SlotQueue:
    """One direction of traffic: plans, events, ops or stream records.

    Slots are memoryviews over the mapping, valid until the next
    publish/release of that side; reserve/peek hand them out, publish/release
    give them back."""

    __slots__ = ("_seg", "_slots", "_view", "n_slots", "name", "slot_bytes", "spin")

    def __init__(self, seg: Segment, base_ptr: Any, nbytes: int, name: str, geometry: tuple[int, int] | None = None):
        """`geometry`: (n_slots, slot_bytes) known from elsewhere (the worker,
        told by the daemon): used, and written over the shared header, so what
        a planner writes there cannot move an index."""
        self._seg = seg
        self.name = name
        self._view = ffi.new("QueueView *")
        if geometry is None:
            ok = lib.sf_queue_attach(self._view, base_ptr, nbytes) == 0
        else:
            ok = lib.sf_queue_attach_as(self._view, base_ptr, nbytes, *geometry) == 0
        if not ok:
            raise ValueError(f"{name} queue header does not fit its region")
        self.n_slots = int(self._view.n_slots)
        self.slot_bytes = sb = int(self._view.slot_bytes)
        base = self._view.slots
        self._slots = [memoryview(ffi.buffer(base + i * sb, sb)) for i in range(self.n_slots)]
        self.spin = SpinBudget()  # for waits that name no spin_ns of their own

    # ---------------------------------------------------------- primitives

    def _closed(self) -> SegmentClosed:
        return SegmentClosed(f"{self.name} queue: segment is closed")

    def try_reserve(self) -> memoryview | None:
        """The next free slot to fill, or None when the queue is full."""
        if self._seg.closed:
            raise self._closed()
        i = _reserve_at(self._view)
        return None if i < 0 else self._slots[i]

    def publish(self) -> None:
        if self._seg.closed:
            raise self._closed()
        if _publish(self._view) != 0:
            raise RuntimeError(f"{self.name} queue: publish with the queue full (nothing was reserved)")

    def try_peek(self) -> memoryview | None:
        """The oldest unread slot, or None when the queue is empty."""
        if self._seg.closed:
            raise self._closed()
        i = _peek_at(self._view)
        return None if i < 0 else self._slots[i]

    def release(self) -> None:
        if self._seg.closed:
            raise self._closed()
        if _release(self._view) != 0:
            raise RuntimeError(f"{self.name} queue: release with the queue empty (nothing was peeked)")

    def try_publish(self) -> bool:
        """publish, for a side that cannot trust its peer: False (nothing
        moved) when the queue turned full since the reserve, because the
        peer moved its counter back."""
        if self._seg.closed:
            raise self._closed()
        return _publish(self._view) == 0

    def try_release(self) -> bool:
        """release, likewise: False when the peer took its message back."""
        if self._seg.closed:
            raise self._closed()
        return _release(self._view) == 0

    def __len__(self) -> int:
        if self._seg.closed:
            raise self._closed()
        return int(lib.sf_queue_len(self._view))

    @property
    def head(self) -> int:
        if self._seg.closed:
            raise self._closed()
        return int(lib.sf_load_acquire_u64(ffi.addressof(self._view.q, "head")))

    @property
    def tail(self) -> int:
        if self._seg.closed:
            raise self._closed()
        return int(lib.sf_load_acquire_u64(ffi.addressof(self._view.q, "tail")))

    def invalidate(self) -> None:
        """Release the slot views (the segment is being unmapped): a slot still
        held then raises on use instead of touching unmapped memory."""
        for m in self._slots:
            try:
                m.release()
            except BufferError:
                pass  # a slice of it is still exported: nothing more we can do

    def wake_all(self) -> None:
        if self._seg.closed:
            raise self._closed()
        lib.sf_queue_wake_all(self._view)

    def heads_up(self) -> None:
        """Producer: a message is due soon. A consumer asleep in a wait wakes
        and spins for it (SF_HEADS_UP_SPIN_NS), instead of paying a wake-up
        from sleep after the publish."""
        if self._seg.closed:
            raise self._closed()
        lib.sf_queue_heads_up(self._view)

    def sane(self) -> bool:
        """False when the counters are impossible (head - tail > n_slots, or
        tail past head): only a corrupting peer makes them so."""
        if self._seg.closed:
            raise self._closed()
        return bool(lib.sf_queue_sane(self._view))

    def reset(self) -> int:
        """tail := head: the queue is empty; returns that counter."""
        if self._seg.closed:
            raise self._closed()
        return int(lib.sf_queue_reset(self._view))

    def discard_unread(self) -> int:
        """Drop every published, unread message (tail := head); how many.
        Only for whoever stands in for a consumer that is gone (the daemon,
        between a dead worker and its replacement)."""
        if self._seg.closed:
            raise self._closed()
        q = self._view.q
        head = lib.sf_load_acquire_u64(ffi.addressof(q, "head"))
        tail = lib.sf_load_acquire_u64(ffi.addressof(q, "tail"))
        lib.sf_store_release_u64(ffi.addressof(q, "tail"), head)
        self.wake_all()
        return int(head - tail)

    # --------------------------------------------------------------- waits

    def _waited(self, fn: _Wait, timeout: float | None, epoch: int | None, watch_stop: bool,
                spin_ns: int | None) -> memoryview:
        if self._seg.closed:
            raise self._closed()
        if timeout is not None and timeout != timeout:
            raise ValueError(f"{self.name} queue: timeout is NaN")
        if spin_ns is None:
            start = _now_ns()
            try:
                return self._waited(fn, timeout, epoch, watch_stop, self.spin.spin_ns())
            finally:
                self.spin.waited(_now_ns() - start)
        # None or inf: no deadline; negative: do not wait.
        deadline = None if timeout is None or timeout == float("inf") else time.monotonic() + max(0.0, timeout)
        hdr = ffi.NULL if epoch is None else self._seg.header
        while True:
            left = _SIGNAL_SLICE_S if deadline is None else min(_SIGNAL_SLICE_S, deadline - time.monotonic())
            i = fn(self._view, hdr, epoch or 0, int(watch_stop), max(0, int(left * 1e9)), spin_ns)
            if i != _TIMEOUT or (deadline is not None and time.monotonic() >= deadline):
                break
            if self._seg.closed:  # another thread closed it while we waited
                raise self._closed()
            spin_ns = 0  # spun once already
        if i >= 0:
            return self._slots[i]
        if i == _TIMEOUT:
            what = "no room" if fn is _wait_reserve else "nothing"
            raise QueueTimeout(f"{self.name} queue: {what} within {timeout}s")
        if i == _GONE:
            raise PeerGone(self._seg.epoch, self._seg.worker_state, epoch)
        raise StopRequested(f"{self.name} queue: the daemon asked the worker to stop")

    def peek_within(self, timeout_ns: int, spin_ns: int | None = None) -> memoryview | None:
        """The oldest unread slot, waiting at most `timeout_ns` (spinning
        `spin_ns` first; None: as the queue's SpinBudget says); None when
        none came. One C call, no peer checks: for a consumer that waits in
        short slices and looks around between them itself (the worker)."""
        if self._seg.closed:
            raise self._closed()
        if spin_ns is not None:
            i = _wait_peek(self._view, ffi.NULL, 0, 0, timeout_ns, spin_ns)
        else:
            start = _now_ns()
            i = _wait_peek(self._view, ffi.NULL, 0, 0, timeout_ns, self.spin.spin_ns())
            self.spin.waited(_now_ns() - start)
        return self._slots[i] if i >= 0 else None

    def peek(self, timeout: float | None = None, *, epoch: int | None = None, watch_stop: bool = False,
             spin_ns: int | None = None) -> memoryview:
        """The oldest unread slot, waiting for one. `epoch`: the worker epoch
        the caller talks to; PeerGone when it changes or the worker is down
        (None: no peer checks). StopRequested when `watch_stop` and the
        daemon asked for a stop. QueueTimeout when `timeout` passes.
        `spin_ns`: spin that long before sleeping (None: the SpinBudget's)."""
        return self._waited(_wait_peek, timeout, epoch, watch_stop, spin_ns)

    def reserve(self, timeout: float | None = None, *, epoch: int | None = None, watch_stop: bool = False,
                spin_ns: int | None = None) -> memoryview:
        """The next free slot, waiting while the queue is full; as peek."""
        return self._waited(_wait_reserve, timeout, epoch, watch_stop, spin_ns)

    def wait_readable(self, timeout: float | None = None, *, epoch: int | None = None,
                      watch_stop: bool = False, spin_ns: int | None = None) -> None:
        """Return once a slot can be read; raises as peek."""
        self.peek(timeout, epoch=epoch, watch_stop=watch_stop, spin_ns=spin_ns)

    def wait_writable(self, timeout: float | None = None, *, epoch: int | None = None,
                      watch_stop: bool = False, spin_ns: int | None = None) -> None:
        """Return once a slot can be reserved; raises as peek."""
        self.reserve(timeout, epoch=epoch, watch_stop=watch_stop, spin_ns=spin_ns)

    # ------------------------------------------------------------ messages

    def send(self, name: str, record: Any, *, kind: int | None = None, timeout: float | None = None,
             epoch: int | None = None, session: int = 0) -> int:
        """Encode a record (TickPlan, TickEvents, ...) straight into the next
        slot and publish it; waits while the queue is full. Returns bytes."""
        n = codec.encode_into(self.reserve(timeout, epoch=epoch), name, record, kind, session)
        _publish(self._view)
        return n

    def send_bytes(self, kind: int, payload: bytes, *, timeout: float | None = None,
                   epoch: int | None = None, session: int = 0) -> None:
        """A raw message (e.g. an op's msgpack body): MsgHeader + payload."""
        if codec.MSG_HEADER_BYTES + len(payload) > self.slot_bytes:
            raise codec.EncodeError(
                f"{self.name} queue: {len(payload)} bytes do not fit a {self.slot_bytes}-byte slot")
        codec.write_raw(self.reserve(timeout, epoch=epoch), kind, payload, session)
        _publish(self._view)

    def recv(self, name: str, *, kind: int | None = None, timeout: float | None = None,
             epoch: int | None = None, watch_stop: bool = False) -> Any:
        """Wait for, decode and release the next message. A message that does
        not decode is released too, and its CodecError raised."""
        slot = self.peek(timeout, epoch=epoch, watch_stop=watch_stop)
        try:
            return codec.decode(slot, name, kind)
        finally:
            _release(self._view)

    def recv_raw(self, *, timeout: float | None = None, epoch: int | None = None,
                 watch_stop: bool = False) -> tuple[int, bytes]:
        """(kind, a copy of the whole message) of the next message."""
        slot = self.peek(timeout, epoch=epoch, watch_stop=watch_stop)
        try:
            return codec.copy_message(slot)
        finally:
            _release(self._view)
