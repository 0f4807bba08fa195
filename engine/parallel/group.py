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

import torch
import torch.distributed as dist

__all__ = ["GlooGroup", "Group", "GroupFault", "ShmGroup", "SoloGroup", "init_gloo"]

_LEN = struct.Struct("<q")


class GroupFault(RuntimeError):
    """A collective did not complete: a rank died, stopped or left."""


class Group:
    """rank/world, and the collectives every rank calls in the same order."""

    rank: int = 0
    world: int = 1
    transport: str = "solo"

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


def init_gloo(init_method: str, world: int, rank: int, timeout_s: float) -> None:
    """torch.distributed's default group over gloo (once a process)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=init_method, world_size=world, rank=rank,
                                timeout=datetime.timedelta(seconds=timeout_s))


class GlooGroup(Group):
    """Collectives through torch.distributed's gloo: a group for the step's
    collectives with the group's timeout, and one with a long timeout on
    which followers wait for the leader's next message."""

    transport = "gloo"

    def __init__(self, timeout_s: float, idle_timeout_s: float = 7 * 86400):
        if not dist.is_initialized():
            raise GroupFault("torch.distributed is not initialized (init_gloo first)")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.timeout_s = timeout_s
        self._steps = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self._idle = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=idle_timeout_s))

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        out = t.new_empty((self.world,) + tuple(t.shape))
        try:
            dist.all_gather(list(out.unbind(0)), t, group=self._steps)
        except RuntimeError as e:
            raise GroupFault(f"gloo all_gather: {e}") from e
        return out

    def broadcast(self, data: bytes | None, wait_s: float | None = None,
                  alive: Callable[[], bool] | None = None) -> bytes:
        # The length on the long-timeout group (a follower may wait there
        # between steps), the bytes on the step group.
        n = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        try:
            dist.broadcast(n, src=0, group=self._idle)
            buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if data is not None and len(data)
                   else torch.empty(int(n.item()), dtype=torch.uint8))
            if int(n.item()):
                dist.broadcast(buf, src=0, group=self._steps)
        except RuntimeError as e:
            raise GroupFault(f"gloo broadcast: {e}") from e
        return data if data is not None else buf.numpy().tobytes()

    def all_reduce_plain(self, t: torch.Tensor) -> None:
        try:
            dist.all_reduce(t, group=self._steps)
        except RuntimeError as e:
            raise GroupFault(f"gloo all_reduce: {e}") from e

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class ShmGroup(Group):
    """Collectives through a shared-memory segment of this machine
    (kernels/comm.py); tensors larger than its slots go in several rounds.
    gloo stays up beside it for the plain all-reduce."""

    transport = "shm"

    def __init__(self, comm, timeout_s: float):
        self.comm = comm
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
            except CommTimeout as e:
                if data is not None or wait_s is None or alive is None or not alive():
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
        try:
            dist.all_reduce(t)
        except RuntimeError as e:
            raise GroupFault(f"gloo all_reduce: {e}") from e

    def close(self) -> None:
        self.comm.close()
        if dist.is_initialized():
            dist.destroy_process_group()
