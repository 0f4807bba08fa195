"""SPSC slot queues over shared memory (SPEC §1).

Fixed slots addressed by ever-growing u64 head/tail counters: the producer
reserves the slot at `head`, fills it, publishes (head + 1, release); the
consumer peeks the slot at `tail`, reads it, releases (tail + 1). A full
queue is back-pressure. Waits spin briefly, then sleep on a futex over the
counter the peer moves, in slices, checking the segment's worker epoch and
state between slices so a dead peer never blocks anyone for good.
"""

from __future__ import annotations

from typing import Any

from superfluid.abi import WaitResult, ffi, lib
from superfluid.abi import codec
from superfluid.rings.errors import PeerGone, SegmentClosed, StopRequested

# How long a waiter spins before it sleeps. Long enough to catch a peer
# that answers at once, short against a tick.
DEFAULT_SPIN_NS = 50_000


class QueueTimeout(TimeoutError):
    """Nothing to read, or no room to write, within the timeout."""


class SlotQueue:
    """One direction of traffic: plans, events, ops or stream records."""

    __slots__ = ("_seg", "_view", "name", "n_slots", "slot_bytes", "_slot_cache")

    def __init__(self, seg, base_ptr, nbytes: int, name: str):
        self._seg = seg
        self.name = name
        self._view = ffi.new("QueueView *")
        if lib.sf_queue_attach(self._view, base_ptr, nbytes) != 0:
            raise ValueError(f"{name} queue header does not fit its region")
        self.n_slots = int(self._view.n_slots)
        self.slot_bytes = int(self._view.slot_bytes)
        self._slot_cache: dict[int, memoryview] = {}

    # ---------------------------------------------------------- primitives

    def _buf(self, ptr) -> memoryview:
        key = int(ffi.cast("uintptr_t", ptr))
        mv = self._slot_cache.get(key)
        if mv is None:
            mv = memoryview(ffi.buffer(ptr, self.slot_bytes)).cast("B")
            self._slot_cache[key] = mv
        return mv

    def _live(self) -> None:
        if self._seg.closed:
            raise SegmentClosed(f"{self.name} queue: segment is closed")

    def try_reserve(self) -> memoryview | None:
        """The next free slot to fill, or None when the queue is full."""
        self._live()
        p = lib.sf_queue_try_reserve(self._view)
        return None if p == ffi.NULL else self._buf(p)

    def publish(self) -> None:
        lib.sf_queue_publish(self._view)

    def try_peek(self) -> memoryview | None:
        """The oldest unread slot, or None when the queue is empty."""
        self._live()
        p = lib.sf_queue_try_peek(self._view)
        return None if p == ffi.NULL else self._buf(p)

    def release(self) -> None:
        lib.sf_queue_release(self._view)

    def __len__(self) -> int:
        return int(lib.sf_queue_len(self._view))

    @property
    def head(self) -> int:
        return lib.sf_load_acquire_u64(ffi.addressof(self._view.q, "head"))

    @property
    def tail(self) -> int:
        return lib.sf_load_acquire_u64(ffi.addressof(self._view.q, "tail"))

    def wake_all(self) -> None:
        lib.sf_queue_wake_all(self._view)

    # --------------------------------------------------------------- waits

    def _wait(self, fn, timeout: float | None, epoch: int | None, watch_stop: bool, spin_ns: int) -> None:
        self._live()
        seg_ptr = ffi.NULL if epoch is None else self._seg.header
        timeout_ns = -1 if timeout is None else max(0, int(timeout * 1e9))
        r = fn(self._view, seg_ptr, 0 if epoch is None else epoch, int(watch_stop), timeout_ns, spin_ns)
        if r == WaitResult.READY:
            return
        if r == WaitResult.TIMEOUT:
            raise QueueTimeout(f"{self.name} queue: nothing within {timeout}s")
        if r == WaitResult.GONE:
            raise PeerGone(self._seg.epoch, self._seg.worker_state, epoch)
        raise StopRequested(f"{self.name} queue: the daemon asked the worker to stop")

    def wait_readable(self, timeout: float | None = None, *, epoch: int | None = None,
                      watch_stop: bool = False, spin_ns: int = DEFAULT_SPIN_NS) -> None:
        """Return once a slot can be read. `epoch`: the worker epoch the
        caller talks to; PeerGone when it changes or the worker is down
        (None: no peer checks). StopRequested when `watch_stop` and the
        daemon asked for a stop. QueueTimeout when `timeout` passes."""
        self._wait(lib.sf_queue_wait_readable, timeout, epoch, watch_stop, spin_ns)

    def wait_writable(self, timeout: float | None = None, *, epoch: int | None = None,
                      watch_stop: bool = False, spin_ns: int = DEFAULT_SPIN_NS) -> None:
        """Return once a slot can be reserved; as wait_readable otherwise."""
        self._wait(lib.sf_queue_wait_writable, timeout, epoch, watch_stop, spin_ns)

    # ------------------------------------------------------------ messages

    def send(self, name: str, record: Any, *, kind: int | None = None, timeout: float | None = None,
             epoch: int | None = None) -> int:
        """Encode a record (TickPlan, TickEvents, ...) straight into the next
        slot and publish it; waits while the queue is full. Returns bytes."""
        slot = self.try_reserve()
        if slot is None:
            self.wait_writable(timeout, epoch=epoch)
            slot = self.try_reserve()
        n = codec.encode_into(slot, name, record, kind)
        self.publish()
        return n

    def send_bytes(self, kind: int, payload: bytes, *, timeout: float | None = None,
                   epoch: int | None = None) -> None:
        """A raw message (e.g. an op's msgpack body): MsgHeader + payload."""
        if codec.MSG_HEADER_BYTES + len(payload) > self.slot_bytes:
            raise codec.EncodeError(
                f"{self.name} queue: {len(payload)} bytes do not fit a {self.slot_bytes}-byte slot")
        slot = self.try_reserve()
        if slot is None:
            self.wait_writable(timeout, epoch=epoch)
            slot = self.try_reserve()
        codec.write_raw(slot, kind, payload)
        self.publish()

    def recv(self, name: str, *, kind: int | None = None, timeout: float | None = None,
             epoch: int | None = None, watch_stop: bool = False) -> Any:
        """Wait for, decode and release the next message. A message that does
        not decode is released too, and its CodecError raised."""
        slot = self.try_peek()
        if slot is None:
            self.wait_readable(timeout, epoch=epoch, watch_stop=watch_stop)
            slot = self.try_peek()
        try:
            return codec.decode(slot, name, kind)
        finally:
            self.release()

    def recv_raw(self, *, timeout: float | None = None, epoch: int | None = None,
                 watch_stop: bool = False) -> tuple[int, bytes]:
        """(kind, a copy of the whole slot message) of the next message."""
        slot = self.try_peek()
        if slot is None:
            self.wait_readable(timeout, epoch=epoch, watch_stop=watch_stop)
            slot = self.try_peek()
        try:
            return codec.copy_message(slot)
        finally:
            self.release()
