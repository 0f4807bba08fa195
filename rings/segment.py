"""A worker's shared-memory segment (contract §1).

One file under /dev/shm per worker, mode 0600, owned by the daemon's user:
a SegmentHeader, four slot queues (plan, event, op, stream) and three data
rings (prompt, tokens, logits). The daemon creates it and unlinks it on a
clean shutdown; the worker and the planner open it and check the owner,
mode, magic, ABI version and geometry before trusting a byte of it.

A planner can write every byte of it. So the worker opens it with the
geometry the daemon told it (`config`), not the one the header says, and
the daemon `repair()`s the header before every worker start.
"""

from __future__ import annotations

import itertools
import mmap
import os
import stat
import time
from typing import Any

from superfluid.abi import ABI_VERSION, CACHE_LINE, MAGIC, Connect, WorkerState, ffi, lib
from superfluid.abi.records import RuntimeDesc
from superfluid.rings.data import DataRing
from superfluid.rings.errors import SegmentClosed, SegmentError
from superfluid.rings.layout import (
    HEADER_BYTES,
    QUEUE_HEADER_BYTES,
    QUEUES,
    RING_HEADER_BYTES,
    RINGS,
    SegmentConfig,
    line_up,
    plan_layout,
)
from superfluid.rings.naming import segment_path
from superfluid.rings.queue import SlotQueue


def state_name(state: int) -> str:
    """SF_WORKER_* name of a state, or the number when it is none."""
    try:
        return WorkerState(state).name
    except ValueError:
        return str(int(state))


_STATES = {int(s): s for s in WorkerState}
_load_u64, _load_u32 = lib.sf_load_acquire_u64, lib.sf_load_acquire_u32


class Segment:
    """A mapped segment. Use Segment.create (the daemon) or Segment.open."""

    def __init__(self, path: str, fd: int, mm: mmap.mmap, owner: bool, config: SegmentConfig | None = None):
        self.path = path
        self._fd = fd
        self._mm = mm
        self._owner = owner
        self.config = config  # the geometry to use whatever the header says (None: the header's)
        self.made_as: tuple[str, int] | None = None  # (name, index) when this process made it
        self._base = ffi.from_buffer(mm)
        self.header = ffi.cast("SegmentHeader *", self._base)
        # The words a planner reads every plan (epoch, state): addressed once.
        self._epoch_p = ffi.addressof(self.header, "worker_epoch")
        self._state_p = ffi.addressof(self.header, "worker_state")
        self.size = len(mm)
        self.closed = False
        self._attach()

    # ---------------------------------------------------------- lifecycle

    @classmethod
    def create(cls, name: str, index: int = 0, config: SegmentConfig | None = None, *,
               replace: bool = False) -> Segment:
        """Make a fresh segment file (mode 0600). `replace`: remove a stale
        segment of ours with the same name first (a daemon restarted after a
        crash); a segment of another user is never touched."""
        cfg = config or SegmentConfig()
        cfg.check()
        path = segment_path(name, index)
        if replace and os.path.lexists(path):
            st = os.lstat(path)
            if st.st_uid != os.geteuid() or not stat.S_ISREG(st.st_mode):
                raise SegmentError(f"{path}: exists and is not a segment of uid {os.geteuid()}; not replacing it")
            os.unlink(path)
        offsets, size = plan_layout(cfg)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            raise SegmentError(f"{path}: a segment of this name exists (another daemon, or a stale one)") from None
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, size)
            # Every page now: a file system (tmpfs) that fills later must not
            # SIGBUS a worker or planner when it first touches one.
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            os.close(fd)
            os.unlink(path)
            raise SegmentError(f"{path}: cannot make a segment of {size} bytes: {e.strerror}") from None
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        try:
            return cls._init(path, fd, mm, name, index, cfg, offsets, size)
        except BaseException:
            os.unlink(path)  # never leave a half-made segment under this name
            raise

    @classmethod
    def _init(cls, path: str, fd: int, mm: mmap.mmap, name: str, index: int, cfg: SegmentConfig,
              offsets: dict[str, int], size: int) -> Segment:
        try:
            cls._fill(mm, name, index, cfg, offsets, size)
        except BaseException:
            mm.close()
            os.close(fd)
            raise
        seg = cls(path, fd, mm, owner=True, config=cfg)  # on failure it unmaps and closes itself
        seg.made_as = (name, index)
        return seg

    @staticmethod
    def _fill(mm: mmap.mmap, name: str, index: int, cfg: SegmentConfig, offsets: dict[str, int],
              size: int) -> None:
        base = ffi.from_buffer(mm)
        h = ffi.cast("SegmentHeader *", base)
        for q in QUEUES:
            lib.sf_queue_init(base + offsets[f"{q}_queue"], getattr(cfg, f"{q}_slots"),
                              getattr(cfg, f"{q}_slot_bytes"))
        for r, rid, cap in RINGS:
            lib.sf_ring_init(base + offsets[f"{r}_ring"], int(rid), getattr(cfg, cap))
        for k, v in offsets.items():
            setattr(h.layout, k, v)
        h.abi_version = ABI_VERSION
        h.header_bytes = HEADER_BYTES
        h.segment_bytes = size
        h.owner_uid = os.geteuid()
        h.worker_index = index
        ffi.memmove(h.name, name.encode(), len(name))
        h.daemon_pid = os.getpid()
        h.worker_state = WorkerState.EMPTY
        # Magic last: a segment is not one until everything else is in place.
        lib.sf_store_release_u64(ffi.addressof(h, "magic"), MAGIC)
        ffi.release(base)

    @classmethod
    def open(cls, name: str, index: int = 0) -> Segment:
        """Map an existing segment after checking its owner, mode, magic,
        ABI version, geometry, and that it is the segment of `name`, `index`."""
        seg = cls.open_path(segment_path(name, index))
        h = seg.header
        if ffi.string(h.name).decode(errors="replace") != name or h.worker_index != index:
            got = (ffi.string(h.name).decode(errors="replace"), int(h.worker_index))
            seg.close()
            raise SegmentError(f"{seg.path}: the segment of {got[0]!r} worker {got[1]}, not of {name!r} "
                               f"worker {index}")
        return seg

    @classmethod
    def open_path(cls, path: str, config: SegmentConfig | None = None) -> Segment:
        """`config`: the geometry the daemon made it with (the worker's way):
        queues and rings are attached with it and the header's copy of it is
        rewritten; None trusts the header's (after checking it)."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise SegmentError(f"{path}: no such segment (is the daemon running?)") from None
        except OSError as e:
            raise SegmentError(f"{path}: cannot open: {e.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise SegmentError(f"{path}: not a regular file")
            if st.st_uid != os.geteuid():
                raise SegmentError(f"{path}: owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})")
            if st.st_mode & 0o077:
                raise SegmentError(f"{path}: mode {stat.S_IMODE(st.st_mode):04o}, expected 0600")
            if st.st_size < HEADER_BYTES:
                raise SegmentError(f"{path}: {st.st_size} bytes, shorter than a segment header")
            mm = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, mm, owner=False, config=config)  # on failure it unmaps and closes itself

    def _attach(self) -> None:
        h = self.header
        try:
            if self.config is not None:
                # Told the geometry: write it, never read it back (a planner may
                # be scribbling on it this very moment).
                offsets, size = plan_layout(self.config)
                if size != self.size:
                    raise SegmentError(f"{self.path}: {self.size} bytes, but its config makes {size}")
                self._trusted_identity()
                for k, v in offsets.items():
                    setattr(h.layout, k, v)
            else:
                self._check_identity()
                offsets = {f"{n}_{w}": int(getattr(h.layout, f"{n}_{w}"))
                           for n, w in [(q, "queue") for q in QUEUES] + [(r, "ring") for r, _, _ in RINGS]}
            self._offsets = offsets
            self.queues = {q: self._queue(q) for q in QUEUES}
            self.rings = {r: self._ring(r) for r, _, _ in RINGS}
            if self.config is None:
                self._check_layout()
        except BaseException:
            self._drop()
            raise
        self.plan_queue: SlotQueue = self.queues["plan"]
        self.event_queue: SlotQueue = self.queues["event"]
        self.op_queue: SlotQueue = self.queues["op"]
        self.stream_queue: SlotQueue = self.queues["stream"]
        self.prompt_ring: DataRing = self.rings["prompt"]
        self.token_ring: DataRing = self.rings["token"]
        self.logits_ring: DataRing = self.rings["logits"]
        self.rings_by_id = {r.ring_id: r for r in self.rings.values()}

    def _check_identity(self) -> None:
        """sf_segment_check, with a message that says what was found."""
        h = self.header
        code = lib.sf_segment_check(h, self.size)
        if code == Connect.OK:
            return
        if code == Connect.MAGIC:
            magic = lib.sf_load_acquire_u64(ffi.addressof(h, "magic"))
            raise SegmentError(f"{self.path}: magic {magic:#018x}, expected {MAGIC:#018x} (not a segment)")
        if code == Connect.ABI:
            if h.abi_version != ABI_VERSION:
                raise SegmentError(f"{self.path}: ABI version {h.abi_version}, this build speaks {ABI_VERSION}")
            raise SegmentError(f"{self.path}: header of {h.header_bytes} bytes, expected {HEADER_BYTES}")
        if code == Connect.SIZE:
            raise SegmentError(f"{self.path}: header says {h.segment_bytes} bytes, the file has {self.size}")
        if code == Connect.OWNER:
            raise SegmentError(f"{self.path}: made by uid {h.owner_uid}, not by this user")
        raise SegmentError(f"{self.path}: not a segment (check {Connect(code).name})")

    def _trusted_identity(self) -> None:
        """The worker knows what the segment is (the daemon said: a file of
        this user, mode 0600, of the size its config makes): it rewrites line
        0 rather than refusing a header a planner scribbled on."""
        h = self.header
        h.abi_version = ABI_VERSION
        h.header_bytes = HEADER_BYTES
        h.segment_bytes = self.size
        h.owner_uid = os.geteuid()
        lib.sf_store_release_u64(ffi.addressof(h, "magic"), MAGIC)

    def _check_layout(self) -> None:
        """Regions apart, packed as the daemon lays them out (each starts at
        the cache line after the last; a scribbled slot count or capacity
        shows as a gap), and each ring the one its place says. Impossible
        queue counters are not a reason to refuse a segment: the worker
        resets them and says so (a QueueReset on the event queue)."""
        spans = []
        for q, sq in self.queues.items():
            off = self._offsets[f"{q}_queue"]
            spans.append((off, off + lib.sf_queue_bytes(sq.n_slots, sq.slot_bytes), f"{q}_queue"))
        for (r, rid, _), ring in zip(RINGS, self.rings.values()):
            if ring.ring_id != rid:
                raise SegmentError(f"{self.path}: the {r} ring says it is ring {ring.ring_id}, expected {int(rid)}")
            off = self._offsets[f"{r}_ring"]
            spans.append((off, off + lib.sf_ring_bytes(ring.capacity), f"{r}_ring"))
        spans.sort()
        for (_, end, a), (start, _, b) in itertools.pairwise(spans):
            if end > start:
                raise SegmentError(f"{self.path}: layout.{a} overlaps layout.{b}")
        ends = [line_up(HEADER_BYTES)] + [line_up(end) for _, end, _ in spans]
        for (start, _, a), want in zip(spans, ends):
            if start != want:
                raise SegmentError(f"{self.path}: layout.{a} starts at {start}, not at {want} where the region "
                                   "before it ends (a slot count or capacity that is not the daemon's)")
        if ends[-1] != self.size:
            raise SegmentError(f"{self.path}: the regions end at {ends[-1]}, the segment at {self.size}")

    def _offset(self, name: str, what: str) -> int:
        off = self._offsets[f"{name}_{what}"]
        minimum = QUEUE_HEADER_BYTES if what == "queue" else RING_HEADER_BYTES
        if off % CACHE_LINE or off < HEADER_BYTES or off > self.size - minimum:
            raise SegmentError(f"{self.path}: layout.{name}_{what} = {off} is outside the segment")
        return off

    def _queue(self, name: str) -> SlotQueue:
        off, cfg = self._offset(name, "queue"), self.config
        geo = None if cfg is None else (getattr(cfg, f"{name}_slots"), getattr(cfg, f"{name}_slot_bytes"))
        try:
            return SlotQueue(self, self._base + off, self.size - off, name, geo)
        except ValueError as e:
            raise SegmentError(f"{self.path}: {e}") from None

    def _ring(self, name: str) -> DataRing:
        off, cfg = self._offset(name, "ring"), self.config
        geo = None if cfg is None else next((int(rid), getattr(cfg, cap)) for r, rid, cap in RINGS if r == name)
        try:
            return DataRing(self, self._base + off, self.size - off, geo)
        except ValueError as e:
            raise SegmentError(f"{self.path}: {e}") from None

    def _drop(self) -> None:
        ffi.release(self._base)
        self._mm.close()
        os.close(self._fd)

    def close(self) -> None:
        """Unmap. Queues and rings of this segment refuse use afterwards."""
        if self.closed:
            return
        self.closed = True
        self.header = None
        for q in getattr(self, "queues", {}).values():
            q.invalidate()
        self._drop()

    def unlink(self) -> None:
        """Remove the segment's name (the daemon, on a clean shutdown)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _live(self) -> Any:
        if self.closed:
            raise SegmentClosed(f"{self.path}: closed")
        return self.header

    # ------------------------------------------------------ header fields

    def _u32(self, field: str) -> int:
        return int(lib.sf_load_acquire_u32(ffi.addressof(self._live(), field)))

    def _set_u32(self, field: str, v: int) -> None:
        lib.sf_store_release_u32(ffi.addressof(self._live(), field), v)

    @property
    def name(self) -> str:
        return bytes(ffi.string(self._live().name)).decode()

    @property
    def index(self) -> int:
        return int(self._live().worker_index)

    @property
    def epoch(self) -> int:
        if self.closed:
            self._live()
        return int(_load_u64(self._epoch_p))

    @property
    def worker_state(self) -> WorkerState | int:
        if self.closed:
            self._live()
        v: int = _load_u32(self._state_p)
        # A value no daemon or worker writes comes back as the int: a planner
        # scribbled (readers must not choke on it).
        return _STATES.get(v, v)

    def set_worker_state(self, state: int) -> None:
        lib.sf_set_worker_state(self._live(), int(state))  # wakes sf_wait_ready sleepers
        self.wake_all()

    def set_epoch(self, epoch: int) -> None:
        lib.sf_store_release_u64(ffi.addressof(self._live(), "worker_epoch"), epoch)

    def bump_epoch(self, state: int = WorkerState.STARTING) -> int:
        """A new worker generation (the daemon, before (re)starting a
        worker). Waiters on the old epoch wake and see PeerGone."""
        h = self._live()
        epoch = int(lib.sf_fetch_add_u64(ffi.addressof(h, "worker_epoch"), 1)) + 1
        self.set_worker_state(state)
        return epoch

    @property
    def yield_requested(self) -> bool:
        return bool(self._u32("yield_requested"))

    @yield_requested.setter
    def yield_requested(self, v: bool) -> None:
        self._set_u32("yield_requested", int(bool(v)))

    @property
    def latency_wanted(self) -> bool:
        return bool(self._u32("latency_wanted"))

    @latency_wanted.setter
    def latency_wanted(self, v: bool) -> None:
        self._set_u32("latency_wanted", int(bool(v)))

    @property
    def stop_requested(self) -> bool:
        return bool(self._u32("stop_requested"))

    def request_stop(self, stop: bool = True) -> None:
        """The daemon's report that it is shutting down (planner waits with
        watch_stop see it). Workers do not read it: their stop comes over
        the daemon's pipe."""
        self._set_u32("stop_requested", int(stop))
        self.wake_all()

    @property
    def session_id(self) -> int:
        """The connected planner's session (0: none began one)."""
        return int(lib.sf_load_acquire_u64(ffi.addressof(self._live(), "session_id")))

    def begin_session(self) -> int:
        """A new session (sf_session_begin): its id, never 0."""
        return int(lib.sf_session_begin(self._live()))

    def wake_all(self) -> None:
        """Wake every sleeper on every queue (they re-check epoch and state)."""
        for q in self.queues.values():
            q.wake_all()

    def repair(self, *, fault_injection: bool = False) -> list[str]:
        """The daemon, before a worker start: see rings/repair.py."""
        from superfluid.rings.repair import repair

        return repair(self, fault_injection=fault_injection)

    @property
    def runtime(self) -> RuntimeDesc:
        r = self._live().runtime
        return RuntimeDesc(ffi.string(r.runtime_id, len(r.runtime_id)), r.vocab_size, r.max_batch, r.max_seq_len,
                           r.max_seqs, r.page, r.prefill_step_tokens, r.flags)

    @runtime.setter
    def runtime(self, desc: RuntimeDesc) -> None:
        r = self._live().runtime
        rid = desc.runtime_id.encode() if isinstance(desc.runtime_id, str) else bytes(desc.runtime_id)
        if len(rid) > len(r.runtime_id):
            raise SegmentError(f"RuntimeDesc.runtime_id: at most {len(r.runtime_id)} bytes")
        ffi.memmove(r.runtime_id, rid.ljust(len(r.runtime_id), b"\0"), len(r.runtime_id))
        for f in RuntimeDesc._fields[1:]:
            setattr(r, f, getattr(desc, f))

    @property
    def counters(self) -> Any:
        """The worker's live counters (a cffi view: read or write fields)."""
        return self._live().counters

    def describe(self) -> dict[str, Any]:
        h = self._live()
        return {
            "path": self.path, "name": self.name, "index": self.index, "epoch": self.epoch,
            "state": state_name(self.worker_state), "worker_pid": h.worker_pid, "daemon_pid": h.daemon_pid,
            "restarts": h.restarts, "last_exit_status": h.last_exit_status,
            "state_age_s": max(0.0, (lib.sf_monotonic_ns() - h.state_changed_ns) / 1e9) if h.state_changed_ns else None,
            "bytes": self.size, "time": time.time(),
        }
