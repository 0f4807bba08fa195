"""A shared-memory collective for the ranks of one tensor-parallel group on
one node: all_gather of a small tensor and a broadcast from rank 0, the fast
path beside torch.distributed's gloo (sf_comm.c says how, and why it cannot
race).

Rank 0 creates the segment (a file under /dev/shm, a path no other group
uses), ranks 1.. attach to it. Every call is a collective: every rank makes
the same calls in the same order. Every wait is bounded by the call's
timeout_s; a peer that does not arrive (dead, stopped, or out of step)
raises CommTimeout on the others, naming it; where this rank had already
sent its part the communicator is unusable after it (close it), else
(CommTimeout.retryable) the same call may be made again. One thread at a
time per ShmComm. The C side waits without the GIL (cffi releases it
around every call).
"""

from __future__ import annotations

import math
import os
from typing import Any, NoReturn

import torch

try:
    from superfluid.kernels._cpu import ffi, lib
except ImportError:  # pragma: no cover - a build without the extension
    ffi = lib = None

MAX_WORLD = 64


class CommTimeout(RuntimeError):
    """A peer did not arrive within the bound (dead, stopped, or out of step).

    ranks: the ranks waited for. retryable: this rank had sent nothing yet
    (a broadcast, or an all_gather still waiting for the call before to be
    read), so the same call may be made again, e.g. by a follower waiting
    in broadcast for the next step with a short bound and a liveness check
    between tries; otherwise the communicator is unusable now."""

    def __init__(self, message: str, ranks: list[int], retryable: bool) -> None:
        super().__init__(message)
        self.ranks = ranks
        self.retryable = retryable


class CommMismatch(RuntimeError):
    """A peer made another call than this rank (another kind or size): the
    ranks are out of step."""


def _check_timeout(timeout_s: float) -> float:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise ValueError(f"timeout_s must be a number of seconds, got {timeout_s!r}")
    if not (math.isfinite(timeout_s) and timeout_s >= 0):  # no waiting forever
        raise ValueError(f"timeout_s must be finite and >= 0, got {timeout_s!r}")
    return float(timeout_s)


def _check_int(name: str, value: object, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{name} must be an int in [{lo}, {hi}], got {value!r}")
    return value


def _lib() -> Any:
    if lib is None:
        raise RuntimeError("superfluid.kernels._cpu is not built (make setup)")
    return lib


def _ranks(mask: int) -> list[int]:
    return [r for r in range(MAX_WORLD) if mask >> r & 1]


class ShmComm:
    """One rank's end of a group's segment (create: rank 0; attach: the others)."""

    rank: int
    world: int
    slot_bytes: int

    def __init__(self, path: str, seg: Any, seg_bytes: int, world: int, rank: int, slot_bytes: int) -> None:
        self.path = path
        self.rank, self.world, self.slot_bytes = rank, world, slot_bytes
        self._seg: Any = seg
        self._seg_bytes = seg_bytes
        self._seq = 0  # calls made: the next is _seq + 1, on every rank alike
        self._broken: str | None = None
        self._missing = ffi.new("uint64_t *")
        self._got = ffi.new("int64_t *")
        self._scratch: Any = None  # a follower's broadcast buffer, made at its first broadcast

    @staticmethod
    def segment_bytes(world: int, slot_bytes: int) -> int:
        world = _check_int("world", world, 1, MAX_WORLD)
        slot_bytes = _check_int("slot_bytes", slot_bytes, 1, 1 << 40)
        return int(_lib().sf_comm_segment_bytes(world, slot_bytes))

    @classmethod
    def create(cls, path: str, world: int, slot_bytes: int) -> ShmComm:
        """Rank 0: make the file (O_EXCL: an existing one, e.g. a crashed
        run's, is an error), size it with fallocate (a full /dev/shm fails
        here, not as SIGBUS later; tmpfs pages come zeroed), map it."""
        size = cls.segment_bytes(world, slot_bytes)
        seg = ffi.new("void **")
        if _lib().sf_comm_create(os.fsencode(path), world, slot_bytes, seg) != 0:
            e = ffi.errno
            raise OSError(e, f"cannot create a {size}-byte comm segment: {os.strerror(e)}", path)
        return cls(path, seg[0], size, world, 0, slot_bytes)

    @classmethod
    def attach(cls, path: str, world: int, rank: int, slot_bytes: int, timeout_s: float) -> ShmComm:
        """Ranks >= 1: wait (up to timeout_s) for rank 0's file and header,
        then check that it is a group of this world and slot_bytes."""
        size = cls.segment_bytes(world, slot_bytes)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank < world:
            raise ValueError(f"rank must be an int in [1, world={world}) to attach (rank 0 creates), got {rank!r}")
        timeout_s = _check_timeout(timeout_s)
        seg, seg_bytes = ffi.new("void **"), ffi.new("int64_t *")
        rc = _lib().sf_comm_attach(os.fsencode(path), timeout_s, seg, seg_bytes)
        if rc == lib.SF_COMM_TIMEOUT:
            raise CommTimeout(f"rank {rank}: rank 0 did not make {path} ready within {timeout_s} s", [0], True)
        if rc == lib.SF_COMM_BAD_HEADER:
            raise ValueError(f"{path} is not a comm segment of this version (magic/version/size)")
        if rc != 0:
            e = ffi.errno
            raise OSError(e, f"cannot attach to a comm segment: {os.strerror(e)}", path)
        hdr = ffi.new("uint64_t[4]")
        lib.sf_comm_header(seg[0], hdr)
        for name, want, have in (("world", world, hdr[2]), ("slot_bytes", slot_bytes, hdr[3])):
            if want != have:
                lib.sf_comm_unmap(seg[0], seg_bytes[0])
                raise ValueError(f"{name}={want} but the segment at {path} was made with {name}={have}")
        assert seg_bytes[0] == size, (seg_bytes[0], size)
        return cls(path, seg[0], size, world, rank, slot_bytes)

    def _begin(self) -> int:
        if self._seg is None:
            raise RuntimeError(f"rank {self.rank}: the comm at {self.path} is closed")
        if self._broken:
            raise RuntimeError(f"rank {self.rank}: the comm at {self.path} is unusable after: {self._broken}")
        return self._seq + 1

    def _end(self, rc: int, what: str, seq: int, timeout_s: float) -> None:
        """Count call seq as made, unless it timed out having sent nothing."""
        if rc == lib.SF_COMM_TIMEOUT:
            ranks = _ranks(self._missing[0])
            raise CommTimeout(f"rank {self.rank}: rank(s) {ranks} did not arrive within {timeout_s} s at call {seq} "
                              f"({what}; nothing sent: the call may be made again)", ranks, True)
        self._seq = seq
        if rc == 0:
            return
        ranks = _ranks(self._missing[0])
        err: Exception
        if rc == lib.SF_COMM_TIMEOUT_SENT:
            err = CommTimeout(f"rank {self.rank}: rank(s) {ranks} did not arrive within {timeout_s} s "
                              f"at call {seq} ({what})", ranks, False)
        elif rc == lib.SF_COMM_MISMATCH:
            err = CommMismatch(f"rank {self.rank}: rank(s) {ranks} made another call than {what} "
                               f"(kind or size) at call {seq}")
        else:  # arguments are checked here first
            err = RuntimeError(f"rank {self.rank}: sf_comm {what} returned {rc}")
        self._broken = str(err)
        raise err

    def _refuse(self, src: object, out: object) -> NoReturn:
        for name, t in (("src", src), ("out", out)):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.device.type != "cpu":
                raise ValueError(f"{name} must be a CPU tensor, got device {t.device}")
            if t.layout != torch.strided or not t.is_contiguous():
                raise ValueError(f"{name} must be a contiguous dense tensor")
            if t.is_conj() or t.is_neg():  # a lazy view: its memory is not its values
                raise ValueError(f"{name} has a lazy conj/neg bit: resolve_conj()/resolve_neg() it first")
        assert isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor)
        if src.nbytes > self.slot_bytes:
            raise ValueError(f"src has {src.nbytes} bytes, more than slot_bytes={self.slot_bytes}")
        if out.dtype != src.dtype:
            raise ValueError(f"out must have src's dtype {src.dtype}, got {out.dtype}")
        raise ValueError(f"out must have shape {[self.world, *src.shape]}, got {list(out.shape)}")

    def all_gather(self, src: torch.Tensor, out: torch.Tensor, timeout_s: float) -> None:
        """src: contiguous CPU tensor (any dtype) of <= slot_bytes bytes; out:
        contiguous, same dtype, shape [world, *src.shape]; out[r] = rank r's
        src, bitwise. src may be out[rank] (gather in place)."""
        seq = self._begin()
        timeout_s = _check_timeout(timeout_s)
        # One pass over the usual case (this is per layer); the checks one by one only to say what is wrong.
        if not (isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor) and src.is_cpu and out.is_cpu
                and src.layout == torch.strided and out.layout == torch.strided and src.is_contiguous()
                and out.is_contiguous() and not (src.is_conj() or src.is_neg() or out.is_conj() or out.is_neg())
                and src.nbytes <= self.slot_bytes and out.dtype == src.dtype
                and out.shape[:1] == (self.world,) and out.shape[1:] == src.shape):
            self._refuse(src, out)
        nbytes = src.nbytes
        rc = lib.sf_comm_all_gather(self._seg, self.world, self.rank, seq, ffi.cast("void *", src.data_ptr()),
                                    nbytes, ffi.cast("void *", out.data_ptr()), timeout_s, self._missing)
        self._end(rc, "all_gather", seq, timeout_s)

    def c_calls(self, timeout_s: float) -> Any:
        """An sf_tp_comm for C code that makes this comm's calls itself
        (sf_forward_tp), each with timeout_s; give it back to c_calls_done."""
        seq = self._begin()
        return ffi.new("sf_tp_comm *", dict(seg=self._seg, world=self.world, rank=self.rank, seq=seq - 1,
                                             timeout_s=_check_timeout(timeout_s)))

    def c_calls_done(self, state: Any, rc: int, what: str) -> None:
        """Count the calls the C code made; its failure (rc != 0) as this
        comm's: the C code stopped between calls, so the comm is spent."""
        self._seq = state.seq
        if rc == 0:
            return
        ranks = _ranks(state.missing)
        err: Exception
        if rc in (lib.SF_COMM_TIMEOUT, lib.SF_COMM_TIMEOUT_SENT):
            err = CommTimeout(f"rank {self.rank}: rank(s) {ranks} did not arrive within {state.timeout_s} s "
                              f"at call {state.seq} ({what})", ranks, False)
        elif rc == lib.SF_COMM_MISMATCH:
            err = CommMismatch(f"rank {self.rank}: rank(s) {ranks} made another call than {what}'s at call "
                               f"{state.seq}")
        else:
            err = RuntimeError(f"rank {self.rank}: {what} returned {rc} at call {state.seq}")
        self._broken = str(err)
        raise err

    def broadcast(self, data: bytes | None, timeout_s: float) -> bytes:
        """Rank 0 passes the bytes (<= slot_bytes), the others None; every
        rank returns rank 0's bytes."""
        seq = self._begin()
        timeout_s = _check_timeout(timeout_s)
        if self.rank == 0:
            if not isinstance(data, (bytes, bytearray, memoryview)):
                raise ValueError(f"data must be bytes on rank 0, got {type(data).__name__}")
            sent = bytes(data)
            if len(sent) > self.slot_bytes:
                raise ValueError(f"data has {len(sent)} bytes, more than slot_bytes={self.slot_bytes}")
            src, nbytes, out, cap = sent, len(sent), ffi.NULL, 0
        else:
            if data is not None:
                raise ValueError(f"data must be None on rank {self.rank} (only rank 0 sends)")
            if self._scratch is None:
                self._scratch = ffi.new("char[]", self.slot_bytes)
            src, nbytes, out, cap = ffi.NULL, 0, self._scratch, self.slot_bytes
        rc = lib.sf_comm_broadcast(self._seg, self.world, self.rank, seq, src, nbytes, out, cap, self._got,
                                   timeout_s, self._missing)
        self._end(rc, "broadcast", seq, timeout_s)
        if self.rank == 0:
            return sent
        got: bytes = ffi.buffer(self._scratch, self._got[0])[:]
        return got

    def close(self) -> None:
        """Unmap; the creator also unlinks the file. Idempotent."""
        if self._seg is not None:
            seg, self._seg = self._seg, None
            lib.sf_comm_unmap(seg, self._seg_bytes)
            if self.rank == 0:
                try:
                    os.unlink(self.path)
                except FileNotFoundError:
                    pass

    def __enter__(self) -> ShmComm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
