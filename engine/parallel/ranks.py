"""The leader and its followers: who tells whom what, and the follower's loop.

The leader (rank 0) is the runtime the executor drives: it keeps every block
table and length; a follower keeps none, only its heads' K/V tensors. What
the leader's pool does to its tensors (zeroing fresh blocks' values, copying
a block, writing imported cells) is queued as ops and sent, in order, with
the next step's inputs in one message (wire.py); reading cells for an
export is a round trip. A follower that fails at anything exits: the
leader's next collective then fails (GroupFault) and the whole group is
restarted, so no rank ever runs on state that differs from the leader's.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from superfluid.engine.kv import KVPool, SeqState
from superfluid.engine.parallel.group import GroupFault
from superfluid.engine.parallel.tp_model import TpModel
from superfluid.engine.parallel.tp_torch import TpTorchModel
from superfluid.engine.parallel.wire import Op, decode, encode
from superfluid.engine.runtime import FatalError
from superfluid.kernels.cpu import StepLayout

__all__ = ["LeaderModel", "LeaderPool", "RankModel", "follow"]

RankModel = TpModel | TpTorchModel  # the C kernels' shard, or the torch/Triton backend's


def _u(t: torch.Tensor) -> np.ndarray:
    """A tensor's bytes as an array the wire carries (bf16 as uint16)."""
    t = t.contiguous()
    return t.view(torch.uint16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def _t(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    t = torch.from_numpy(a.copy())
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t


class LeaderModel:
    """TpModel on the leader, as engine/model.py's Model looks to the runtime:
    its forward first sends the step (and the queued pool ops) to every rank."""

    def __init__(self, tp: RankModel, close_group: Callable[[], None] | None = None):
        self.tp = tp
        self.cfg, self.backend, self.device, self.dtype = tp.cfg, tp.backend_view, tp.device, tp.dtype
        self.numeric_class = tp.numeric_class
        self.max_seq_len = tp.max_seq_len
        self.group = tp.group
        self.outbox: list[Op] = []
        self.stats = tp.stats
        self._close_group = close_group
        self.pool: LeaderPool | None = None

    @property
    def weight_bytes(self) -> int:
        return self.tp.weight_bytes

    def kv_pool(self, n_blocks: int, page: int) -> LeaderPool:
        self.pool = LeaderPool(self, self.cfg.num_layers, self.tp.n_kv, self.cfg.head_dim, n_blocks, page,
                               dtype=self.dtype, device=self.device, heads_major=self.tp.heads_major_kv)
        return self.pool

    def send(self, *ops: Op) -> None:
        """The queued ops, then `ops`, to every follower, in one message."""
        t0 = time.perf_counter()
        msg = encode(self.outbox + list(ops))
        self.outbox = []
        try:
            self.group.broadcast(msg)
        except GroupFault as e:
            raise FatalError(f"tensor-parallel group: {e}") from e
        self.stats.ship_s += time.perf_counter() - t0

    def forward(self, tokens: torch.Tensor, lay: StepLayout, k_cache: torch.Tensor, v_cache: torch.Tensor,
                rows: torch.Tensor | None, picks: list[Any] | None = None) -> torch.Tensor:
        """Model.forward's (no greedy picks on the way: `picks` stays empty)."""
        arrays = {"tokens": tokens.cpu().numpy(), "positions": lay.positions.numpy(), "cells": lay.cells.numpy(),
                  "feed_of": lay.feed_of.numpy(), "tables": lay.tables.numpy()}
        if rows is not None:
            arrays["rows"] = rows.cpu().numpy()
        self.send(Op("step", {"page": lay.page}, arrays))
        try:
            out = self.tp.forward_local(tokens, lay, k_cache, v_cache, rows)
        except GroupFault as e:
            raise FatalError(f"tensor-parallel group: {e}") from e
        assert out is not None
        return out

    def close(self) -> None:
        """Stop the followers (they exit on the stop op) and leave the group. Idempotent."""
        if self._close_group is None:
            return
        try:
            self.send(Op("stop"))
        except FatalError:
            pass
        close, self._close_group = self._close_group, None
        close()


class LeaderPool(KVPool):
    """The leader's pool: its own heads' tensors, and every change to them
    queued for the followers', whose heads the same block ids address."""

    def __init__(self, leader: LeaderModel, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.leader = leader

    def alloc(self, n: int) -> list[int]:
        out = super().alloc(n)
        if out:
            self.leader.outbox.append(Op("zero", arrays={"blocks": np.array(out, dtype=np.int64)}))
        return out

    def copy_block(self, src: int, dst: int) -> None:
        super().copy_block(src, dst)
        self.leader.outbox.append(Op("copy", {"src": src, "dst": dst}))

    def read_cells(self, seq: SeqState) -> tuple[torch.Tensor, torch.Tensor]:
        """Every KV head's cells (an export is the same at every degree)."""
        b, o = self._where(seq, 0, seq.length)
        self.leader.send(Op("read", arrays={"blocks": b.numpy(), "offsets": o.numpy()}))
        try:
            return gather_heads(self, self.leader.tp, b, o)
        except GroupFault as e:
            raise FatalError(f"tensor-parallel group: {e}") from e

    def write_cells(self, seq: SeqState, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: every KV head's cells; this rank keeps its own, the followers theirs."""
        b, o = self._where(seq, start, start + k.shape[1])
        k, v = k.to(self.k.dtype), v.to(self.v.dtype)
        heads = self.leader.tp.shard.kv_heads
        b, o = b.to(self.k.device), o.to(self.k.device)
        self.k[:, b, o] = k[:, :, heads.start:heads.stop].to(self.k.device)
        self.v[:, b, o] = v[:, :, heads.start:heads.stop].to(self.v.device)
        self.leader.outbox.append(Op("write", arrays={"blocks": b.cpu().numpy(), "offsets": o.cpu().numpy(),
                                                      "k": _u(k.cpu()), "v": _u(v.cpu())}))


def gather_heads(pool: KVPool, tp: RankModel, b: torch.Tensor, o: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's heads' cells at blocks b, offsets o, gathered: on the
    leader [layers, n, kv_heads, head_dim] K and V; a replicated head is taken
    from the first rank holding it."""
    b, o = b.to(pool.k.device), o.to(pool.k.device)
    mine = torch.stack([pool.k[:, b, o], pool.v[:, b, o]]).contiguous()  # [2, layers, n, local kv, hd]
    every = tp.all_gather(mine)
    from superfluid.engine.parallel.sharding import Shard

    cfg = tp.cfg
    owner: dict[int, tuple[int, int]] = {}
    for r in range(tp.shard.world):
        heads = Shard.plan(cfg, tp.shard.world, r).kv_heads
        for i, h in enumerate(heads):
            owner.setdefault(h, (r, i))
    full = torch.stack([every[owner[h][0], :, :, :, owner[h][1]] for h in range(cfg.num_kv_heads)], 3)
    return full[0], full[1]


def apply(op: Op, tp: RankModel, pool: KVPool) -> bool:
    """A follower does what the leader's op says; False on stop."""
    a = op.arrays
    if op.kind == "stop":
        return False
    if op.kind == "zero":
        pool.v.index_fill_(1, torch.from_numpy(a["blocks"].copy()).to(pool.v.device), 0)
    elif op.kind == "copy":
        KVPool.copy_block(pool, op.ints["src"], op.ints["dst"])
    elif op.kind == "write":
        dev = pool.k.device
        b, o = torch.from_numpy(a["blocks"].copy()).to(dev), torch.from_numpy(a["offsets"].copy()).to(dev)
        heads = tp.shard.kv_heads
        pool.k[:, b, o] = _t(a["k"], pool.k.dtype)[:, :, heads.start:heads.stop].to(dev)
        pool.v[:, b, o] = _t(a["v"], pool.v.dtype)[:, :, heads.start:heads.stop].to(dev)
    elif op.kind == "read":
        gather_heads(pool, tp, torch.from_numpy(a["blocks"].copy()), torch.from_numpy(a["offsets"].copy()))
    elif op.kind == "step":
        t = {k: torch.from_numpy(v.copy()) for k, v in a.items()}
        lay = StepLayout(t["positions"], t["cells"], t["feed_of"], t["tables"], op.ints["page"])
        tp.forward_local(t["tokens"], lay, pool.k, pool.v, t.get("rows"))
    else:
        raise ValueError(f"unknown op {op.kind!r}")
    return True


def follow(tp: RankModel, n_blocks: int, page: int, leader_alive: Callable[[], bool],
           poll_s: float = 1.0) -> None:
    """A follower's life: apply the leader's messages until it says stop.
    Raises (and so the process exits) on anything else it cannot do."""
    pool = KVPool(tp.cfg.num_layers, tp.n_kv, tp.cfg.head_dim, n_blocks, page, dtype=tp.dtype, device=tp.device,
                  heads_major=tp.heads_major_kv)
    while True:
        msg = tp.group.broadcast(None, wait_s=poll_s, alive=leader_alive)
        for op in decode(msg):
            if not apply(op, tp, pool):
                return


def pid_alive(pid: int) -> Callable[[], bool]:
    """Whether process `pid` still runs (and is not a zombie)."""
    def alive() -> bool:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
            return state not in (b"Z", b"X")
        except (OSError, IndexError):
            return os.getppid() == pid  # no /proc: at least our parent
    return alive
