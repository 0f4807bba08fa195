"""A rank's shard on the torch or Triton backend (a GPU, or the torch
reference ops on a CPU): engine/blocked.py's blocks, this rank's share of
them, with the pieces and the vocabulary gathered through the group.

Every rank computes its blocks with the shapes TP=1 uses, so the pieces it
contributes are TP=1's bits; every rank gets every piece and adds them in
piece order (blocked.combine_pieces), as TP=1 does. The embedding is
vocabulary-parallel (a token's row comes whole from its owner), the LM head
too (rows gathered to the leader). Collectives move bytes: over NCCL where
the tensors live on GPUs that each rank has its own of, else through copies
in host memory (gloo, or this machine's shared memory), which is how two
ranks share one GPU.
"""

from __future__ import annotations

import time

import torch

from superfluid.engine.blocked import BlockedModel
from superfluid.engine.config import ModelConfig
from superfluid.engine.parallel.group import Group, bits_gather
from superfluid.engine.parallel.sharding import Shard, gather_vocab, vocab_ranges
from superfluid.engine.parallel.tp_model import TpStats
from superfluid.engine.rope_scaling import rope_cos_sin
from superfluid.kernels.attention import batch_of_layout
from superfluid.kernels.backend import Backend
from superfluid.kernels.cpu import StepLayout, step_layout

__all__ = ["RankBackend", "TpTorchModel"]


class RankBackend:
    """The backend as a tensor-parallel runtime sees it: a step's layout is
    the StepLayout the leader ships (each rank builds its own attention
    batch from it); sampling and idling are the backend's."""

    fused_cpu = False
    dense_kv = False  # no decode mirrors: a follower would need the same ones

    def __init__(self, backend: Backend):
        self.ops = backend
        self.name = backend.name
        self.heads_major_kv = backend.heads_major_kv
        self.numeric_class, self.isa = backend.numeric_class, backend.isa

    def layout(self, feeds, page: int, q_per_kv: int, device) -> StepLayout:  # type: ignore[no-untyped-def]
        return step_layout(feeds, page)

    def sample(self, logits, specs, masks=None, consume: bool = False):  # type: ignore[no-untyped-def]
        return self.ops.sample(logits, specs, masks, consume=consume)

    def idle(self) -> None:
        self.ops.idle()


class TpTorchModel(BlockedModel):
    """The shard `shard` run with `group` on `backend` at `device`; the
    leader's forward_local returns the logits, a follower's None."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], shard: Shard, group: Group,
                 backend: Backend, device: torch.device, dtype: torch.dtype = torch.float32,
                 max_seq_len: int | None = None, plain_reduce: bool = False):
        if group.world != shard.world or group.rank != shard.rank:
            raise ValueError(f"a shard of rank {shard.rank}/{shard.world} in a group's rank {group.rank}/{group.world}")
        self.max_seq_len = max_seq_len or cfg.max_position_embeddings
        cos, sin = rope_cos_sin(cfg, self.max_seq_len)
        super().__init__(cfg, weights, shard, backend, device, dtype, cos.to(device), sin.to(device))
        self.group = group
        self.plain_reduce = plain_reduce
        self.stats = TpStats()
        self.backend_view = RankBackend(backend)
        self.heads_major_kv = backend.heads_major_kv
        self.numeric_class = backend.numeric_class(device, dtype)
        self.vocab_of = vocab_ranges(cfg.vocab_size, shard.world, shard.parts)
        # Host copies for the collectives unless NCCL moves the device's tensors itself.
        self._host = device.type != "cpu" and group.transport != "nccl"

    def forward_local(self, tokens: torch.Tensor, lay: StepLayout, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      rows: torch.Tensor | None) -> torch.Tensor | None:
        """This rank's part of a step (every rank calls it with the same inputs)."""
        self.stats.steps += 1
        dev = self.device
        batch = batch_of_layout(lay.positions.numpy(), lay.cells.numpy(), lay.feed_of.numpy(), lay.tables.numpy(),
                                lay.page, max(1, self.n_heads // self.n_kv), dev)
        with torch.inference_mode():
            return self.forward(tokens.to(dev), batch, k_cache, v_cache, None if rows is None else rows.to(dev))

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """[world, *t.shape] of every rank's t, on this rank's device."""
        t0 = time.perf_counter()
        if self._host:
            out = bits_gather(self.group, t.cpu()).to(self.device)
        else:
            out = bits_gather(self.group, t)
        self.stats.collective_s += time.perf_counter() - t0
        return out

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.shard.world == 1:
            return super().embed_tokens(tokens)
        v = self.shard.vocab
        mine = (tokens >= v.start) & (tokens < v.stop)
        x = torch.zeros((tokens.shape[0], self.cfg.hidden_size), dtype=self.dtype, device=self.device)
        x[mine] = self.embed.index_select(0, tokens[mine] - v.start)
        every = self.all_gather(x)  # [world, n, hidden]
        bounds = torch.tensor([r.stop for r in self.vocab_of[:-1]], device=tokens.device)
        owner = torch.bucketize(tokens, bounds, right=True)
        return every[owner, torch.arange(tokens.shape[0], device=tokens.device)].contiguous()

    def all_pieces(self, pieces: torch.Tensor) -> torch.Tensor:
        if self.shard.world == 1:
            return pieces
        if self.plain_reduce:  # the negative control: the library's sum, then one "piece"
            s = pieces.sum(0)
            if self._host:
                h = s.cpu()
                self.group.all_reduce_plain(h)
                s = h.to(self.device)
            else:
                self.group.all_reduce_plain(s)
            return s.unsqueeze(0)
        every = self.all_gather(pieces)  # [world, local pieces, n, hidden]
        return every.view(self.parts, *pieces.shape[1:])

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor | None:
        if self.shard.world == 1:
            return logits
        return gather_vocab(logits, self.vocab_of, self.group.rank, self.all_gather)
