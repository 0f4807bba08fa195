"""A tensor-parallel group's two collectives: the leader's message to every
rank (one a step), and an all-gather (a few a layer).

Over torch.distributed (gloo: the reference, and the path across machines)
or, within one machine, over a shared-memory segment (kernels/comm.py),
which costs microseconds where gloo costs a fraction of a millisecond for
the small tensors of a decode step. Either moves bytes: the same inputs give
the same bits on both. Every wait is bounded: a rank that dies or stops is
a GroupFault on the others within `timeout_s`; only a follower waiting for
the next message waits longer, in slices, while `alive()` says the leader is.
"""

from __future__ import annotations

import datetime
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from superfluid.kernels.comm import ShmComm

__all__ = ["GlooGroup", "GlooLink", "Group", "GroupFault", "NcclGroup", "ShmGroup", "SoloGroup", "bits_gather"]

_LEN = struct.Struct("<q")


IDLE_TIMEOUT = datetime.timedelta(days=7)  # a follower's wait for the next step (it checks its leader)


class GroupFault(RuntimeError):
    """A collective did not complete: a rank died, stopped or left."""


class Group:
    """rank/world, and the collectives every rank calls in the same order."""

    rank: int = 0
    world: int = 1
    transport: str = "solo"
    link: GlooLink  # the gloo groups beside the transport (barriers, the plain all-reduce)

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """[world, *t.shape]: every rank's t, in rank order, bitwise."""
        raise NotImplementedError

    def broadcast(self, data: bytes | None, wait_s: float | None = None,
                  alive: Callable[[], bool] | None = None) -> bytes:
        """The leader's bytes on every rank (the leader passes them, the others
        None). A follower may wait up to `wait_s` at a time, for as long as
        `alive()` holds; everything else waits at most the group's timeout."""
        raise NotImplementedError

    def all_reduce_plain(self, t: torch.Tensor) -> None:
        """A plain sum all-reduce in place: the order a library picks (only
        for showing that the pieces' fixed order is what keeps the bits)."""
        raise NotImplementedError

    def close(self) -> None:
        pass


def bits_gather(group: Group, t: torch.Tensor) -> torch.Tensor:
    """group.all_gather(t), a bfloat16 tensor moved as its int16 bits (not
    every library reduces or gathers bfloat16)."""
    if t.dtype == torch.bfloat16:
        return group.all_gather(t.contiguous().view(torch.int16)).view(torch.bfloat16)
    return group.all_gather(t)


class SoloGroup(Group):
    """A group of one: nothing to move."""

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        return t.unsqueeze(0)

    def broadcast(self, data: bytes | None, wait_s: float | None = None,
                  alive: Callable[[], bool] | None = None) -> bytes:
        assert data is not None
        return data

    def all_reduce_plain(self, t: torch.Tensor) -> None:
        pass


class GlooLink:
    """Process groups of torch.distributed's gloo for one TP group, made from
    a store of their own (not torch.distributed's default group: a process
    may lead several groups, a test several runtimes): `idle` (long timeout:
    a follower waits there between steps) and `steps` (the group's timeout).
    init_method: file://PATH or tcp://HOST:PORT (the leader listens)."""

    def __init__(self, init_method: str, world: int, rank: int, timeout_s: float, load_timeout_s: float):
        load = datetime.timedelta(seconds=load_timeout_s)
        if init_method.startswith("file://"):
            self.store: dist.Store = dist.FileStore(init_method[len("file://"):], world)
        elif init_method.startswith("tcp://"):
            host, _, port = init_method[len("tcp://"):].rpartition(":")
            self.store = dist.TCPStore(host, int(port), world, is_master=rank == 0, timeout=load)
        else:
            raise ValueError(f"init method {init_method!r}: expected file://PATH or tcp://HOST:PORT")
        self.rank, self.world = rank, world
        try:  # joining is bounded by the load timeout; barrier() then sets the groups' own
            self.idle = dist.ProcessGroupGloo(dist.PrefixStore("idle", self.store), rank, world, load)
            self.steps = dist.ProcessGroupGloo(dist.PrefixStore("steps", self.store), rank, world, load)
        except RuntimeError as e:
            raise GroupFault(f"joining the group as rank {rank} of {world}: {e}") from e
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.load_timeout = load

    def barrier(self, digest: bytes = b"") -> None:
        """Every rank got here (within the load timeout) with the same `digest`
        (of what it loaded and how: GroupFault naming the ranks that differ);
        then the step timeout holds, and a follower may wait a week between steps."""
        mine = torch.frombuffer(bytearray(digest.ljust(32, b"\0")[:32]), dtype=torch.uint8)
        try:
            every = self.all_gather(mine)
        except GroupFault as e:
            raise GroupFault(f"gloo barrier: {e}") from e
        differ = [r for r in range(self.world) if not torch.equal(every[r], every[0])]
        if differ:
            raise GroupFault(f"tp rank(s) {differ} loaded another checkpoint or options than rank 0, "
                             f"or runs in another numeric class (every rank must be given the same --model and "
                             f"runtime options, and SUPERFLUID_ISA / SUPERFLUID_BF16_CLASS giving one class)")
        self.steps.set_timeout(self.timeout)
        self.idle.set_timeout(IDLE_TIMEOUT)

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        out = t.new_empty((self.world,) + tuple(t.shape))
        try:
            self.steps.allgather([list(out.unbind(0))], [t]).wait()
        except RuntimeError as e:
            raise GroupFault(f"gloo all_gather: {e}") from e
        return out

    def broadcast(self, t: torch.Tensor, idle: bool = False) -> None:
        try:
            (self.idle if idle else self.steps).broadcast(t, 0).wait()
        except RuntimeError as e:
            raise GroupFault(f"gloo broadcast: {e}") from e

    def all_reduce(self, t: torch.Tensor) -> None:
        try:
            self.steps.allreduce([t]).wait()
        except RuntimeError as e:
            raise GroupFault(f"gloo all_reduce: {e}") from e

    def close(self) -> None:
        for pg in (self.steps, self.idle):
            try:
                pg.shutdown()
            except (RuntimeError, AttributeError):
                pass


class GlooGroup(Group):
    """Every collective through gloo (the reference path, and the one across machines)."""

    transport = "gloo"

    def __init__(self, link: GlooLink):
        self.link = link
        self.rank, self.world = link.rank, link.world

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        return self.link.all_gather(t)

    def broadcast(self, data: bytes | None, wait_s: float | None = None,
                  alive: Callable[[], bool] | None = None) -> bytes:
        # The length on the long-timeout group (a follower waits there between steps), the bytes on the other.
        n = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        self.link.broadcast(n, idle=True)
        size = int(n.item())
        if data is not None:
            if size:
                self.link.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            return data
        buf = torch.empty(size, dtype=torch.uint8)
        if size:
            self.link.broadcast(buf)
        return buf.numpy().tobytes()

    def all_reduce_plain(self, t: torch.Tensor) -> None:
        self.link.all_reduce(t)

    def close(self) -> None:
        self.link.close()


class ShmGroup(Group):
    """Collectives through a shared-memory segment of this machine
    (kernels/comm.py); tensors larger than its slots go in several rounds.
    gloo stays up beside it for the plain all-reduce."""

    transport = "shm"

    def __init__(self, comm: ShmComm, link: GlooLink, timeout_s: float):
        self.comm, self.link = comm, link
        self.rank, self.world = comm.rank, comm.world
        self.timeout_s = timeout_s

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        from superfluid.kernels.comm import CommTimeout

        t = t.contiguous()
        out = t.new_empty((self.world,) + tuple(t.shape))
        flat, flat_out = t.view(-1).view(torch.uint8), out.view(self.world, -1).view(torch.uint8)
        step = self.comm.slot_bytes
        try:
            if flat.numel() <= step:
                self.comm.all_gather(flat, flat_out, self.timeout_s)
                return out
            for at in range(0, flat.numel(), step):
                piece = flat[at:at + step]
                got = piece.new_empty((self.world, piece.numel()))
                self.comm.all_gather(piece, got, self.timeout_s)
                flat_out[:, at:at + step] = got
        except CommTimeout as e:
            raise GroupFault(str(e)) from e
        return out

    def broadcast(self, data: bytes | None, wait_s: float | None = None,
                  alive: Callable[[], bool] | None = None) -> bytes:
        from superfluid.kernels.comm import CommTimeout

        step = self.comm.slot_bytes - _LEN.size
        first = None if data is None else _LEN.pack(len(data)) + data[:step]
        while True:
            try:
                got = self.comm.broadcast(first, wait_s or self.timeout_s)
                break
            except CommTimeout as e:  # retryable: nothing was sent, the same call may be made again
                if data is not None or wait_s is None or alive is None or not e.retryable or not alive():
                    raise GroupFault(str(e)) from e
        (n,) = _LEN.unpack_from(got)
        parts = [got[_LEN.size:]]
        at = len(parts[0])
        try:
            while at < n:
                piece = self.comm.broadcast(None if data is None else data[at:at + self.comm.slot_bytes],
                                            self.timeout_s)
                parts.append(piece)
                at += len(piece)
        except CommTimeout as e:
            raise GroupFault(str(e)) from e
        return data if data is not None else b"".join(parts)

    def all_reduce_plain(self, t: torch.Tensor) -> None:
        self.link.all_reduce(t)

    def close(self) -> None:
        self.comm.close()
        self.link.close()


class NcclGroup(Group):
    """The all-gathers through NCCL between the ranks' GPUs (the tensors
    stay on them); the leader's message and the barriers through gloo. A
    collective past the timeout is NCCL's watchdog's: it aborts the rank's
    process, and the group restarts as for any rank that died."""

    transport = "nccl"

    def __init__(self, link: GlooLink, device: torch.device, timeout_s: float):
        self.link, self.gloo = link, GlooGroup(link)
        self.rank, self.world = link.rank, link.world
        self.device = device
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = datetime.timedelta(seconds=timeout_s)
        try:
            self.pg = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", link.store), self.rank, self.world, opts)
        except RuntimeError as e:
            raise GroupFault(f"joining NCCL as rank {self.rank} of {self.world}: {e}") from e

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        out = t.new_empty((self.world,) + tuple(t.shape))
        try:
            self.pg.allgather([list(out.unbind(0))], [t]).wait()
        except RuntimeError as e:
            raise GroupFault(f"nccl all_gather: {e}") from e
        return out

    def broadcast(self, data: bytes | None, wait_s: float | None = None,
                  alive: Callable[[], bool] | None = None) -> bytes:
        return self.gloo.broadcast(data, wait_s, alive)

    def all_reduce_plain(self, t: torch.Tensor) -> None:
        try:
            self.pg.allreduce([t]).wait()
        except RuntimeError as e:
            raise GroupFault(f"nccl all_reduce: {e}") from e

    def close(self) -> None:
        try:
            self.pg.shutdown()
        except (RuntimeError, AttributeError):
            pass
        self.link.close()
