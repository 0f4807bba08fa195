"""A rank's shard of a Llama-family model and its part of the forward pass.

Column-parallel q/k/v and gate/up (each rank its heads and intermediate
features: a column's sum is the same however many columns share the GEMM),
row-parallel o and down (each rank its pieces of the reduction; every rank
gets every piece and adds them in piece order, as TP=1 does: sharding.py),
vocabulary-parallel embedding (a token's row comes whole from the rank that
holds it) and LM head (rows gathered to the leader, which samples). Every
rank keeps the whole residual stream, the same bits on each. The CPU kernels
of kernels/cpu.py, one call an op.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import TYPE_CHECKING

import torch

from superfluid.engine.config import ModelConfig
from superfluid.engine.model import Layer
from superfluid.engine.parallel.group import Group, bits_gather
from superfluid.engine.parallel.sharding import Shard, gather_vocab, vocab_ranges
from superfluid.engine.rope_scaling import rope_cos_sin
from superfluid.kernels.attention import heads_major
from superfluid.kernels.backend import CpuBackend
from superfluid.kernels.cpu import StepLayout
from superfluid.kernels.cpu_stack import Stack

if TYPE_CHECKING:
    from superfluid.kernels.comm import ShmComm

__all__ = ["TpModel", "TpStats"]


@dataclasses.dataclass
class TpStats:
    """Where a rank's steps went (bench tp): seconds in all-gathers, in
    sending the step's inputs (the leader), and steps since reset()."""

    collective_s: float = 0.0
    ship_s: float = 0.0
    steps: int = 0

    def reset(self) -> None:
        self.collective_s = self.ship_s = 0.0
        self.steps = 0


class TpModel:
    """The shard `shard` of the model, run with `group`. The leader's forward
    returns the logits; a follower's returns None. `plain_reduce`: sum the
    pieces with a plain all-reduce instead (a negative control: it changes bits)."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], shard: Shard, group: Group,
                 dtype: torch.dtype = torch.float32, max_seq_len: int | None = None, plain_reduce: bool = False):
        if group.world != shard.world or group.rank != shard.rank:
            raise ValueError(f"a shard of rank {shard.rank}/{shard.world} in a group's rank {group.rank}/{group.world}")
        self.cfg, self.shard, self.group = cfg, shard, group
        self.backend = self.backend_view = CpuBackend()  # type: ignore[no-untyped-call]
        self.heads_major_kv = True
        cpu = self.cpu = self.backend.cpu
        self.device = torch.device("cpu")
        self.dtype = dtype
        self.numeric_class = self.backend.numeric_class(self.device, dtype)
        self.max_seq_len = max_seq_len or cfg.max_position_embeddings
        self.plain_reduce = plain_reduce
        self.stats = TpStats()
        self.n_heads, self.n_kv = len(shard.heads), len(shard.kv_heads)
        self.kv_heads = self.n_kv
        self.parts = shard.parts
        w = {k: v.to(dtype) for k, v in weights.items()}
        self.embed = w["model.embed_tokens.weight"].contiguous()
        self.lm_head = cpu.pack(w.get("lm_head.weight", self.embed))
        self.norm = w["model.norm.weight"].float().contiguous()
        self.vocab = vocab_ranges(cfg.vocab_size, shard.world, shard.parts)
        local = shard.local_parts

        def f32(name: str) -> torch.Tensor | None:
            t = w.get(name)
            return None if t is None else t.float().contiguous()

        def cat(*names: str) -> torch.Tensor | None:
            parts = [w.get(n) for n in names]
            return None if all(p is None for p in parts) else torch.cat([p for p in parts if p is not None])

        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            qkv_w = cat(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight")
            gu_w = cat(m + "gate_proj.weight", m + "up_proj.weight")
            assert qkv_w is not None and gu_w is not None
            self.layers.append(Layer(
                attn_norm=w[p + "input_layernorm.weight"].float().contiguous(),
                qkv=cpu.pack(qkv_w, cat(a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias")),
                qkv_bias=None, q_norm=f32(a + "q_norm.weight"), k_norm=f32(a + "k_norm.weight"),
                o=cpu.pack_parts(w[a + "o_proj.weight"], local, w.get(a + "o_proj.bias")), o_bias=None,
                mlp_norm=w[p + "post_attention_layernorm.weight"].float().contiguous(),
                gate_up=cpu.pack_gate_up(gu_w, cat(m + "gate_proj.bias", m + "up_proj.bias")), gate_up_bias=None,
                down=cpu.pack_parts(w[m + "down_proj.weight"], local, w.get(m + "down_proj.bias")), down_bias=None,
            ))
        cos, sin = rope_cos_sin(cfg, self.max_seq_len)
        self.cos, self.sin = cos.float().contiguous(), sin.float().contiguous()
        self.scale = cfg.head_dim ** -0.5
        # Every layer in one call into C where the group's transport is shared memory.
        self.stack = Stack(self.layers, hidden=cfg.hidden_size, n_heads=self.n_heads, n_kv=self.n_kv,
                               head_dim=cfg.head_dim, inter=len(shard.inter), eps=cfg.rms_norm_eps, scale=self.scale,
                               cos=self.cos, sin=self.sin)

    @functools.cached_property
    def weight_bytes(self) -> int:
        total = self.embed.numel() * self.embed.element_size() + self.lm_head.nbytes + self.norm.numel() * 4
        for L in self.layers:
            total += sum(getattr(L, n).nbytes for n in ("qkv", "o", "gate_up", "down"))
            total += sum(t.numel() * 4 for t in (L.attn_norm, L.mlp_norm, L.q_norm, L.k_norm) if t is not None)
        return int(total)

    # ------------------------------------------------------------ the pass

    @torch.inference_mode()
    def forward_local(self, tokens: torch.Tensor, lay: StepLayout, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      rows: torch.Tensor | None) -> torch.Tensor | None:
        """This rank's part of a step (every rank calls it with the same
        inputs): the logits [rows, vocab] on the leader, None elsewhere."""
        cpu, cfg = self.cpu, self.cfg
        eps = cfg.rms_norm_eps
        self.stats.steps += 1
        x = self._embed(tokens)
        comm = getattr(self.group, "comm", None)
        if (comm is not None and not self.plain_reduce
                and self.shard.local_parts * cfg.hidden_size * 4 <= comm.slot_bytes):
            self._layers_fused(x, lay, k_cache, v_cache, comm)
        else:
            self._layers(x, lay, k_cache, v_cache)
        if rows is not None:
            x = x[rows]
        logits = cpu.linear(cpu.rmsnorm(x, self.norm, eps), self.lm_head)
        return self._gather_vocab(logits)

    def _layers_fused(self, x: torch.Tensor, lay: StepLayout, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      comm: ShmComm) -> None:
        """Every layer in one call into C, the pieces gathered there (sf_forward_tp)."""
        from superfluid.engine.parallel.group import GroupFault
        from superfluid.kernels.comm import CommMismatch, CommTimeout

        views = getattr(self, "_views", None)
        if views is None or views[0] is not k_cache or views[1] is not v_cache:  # made once a pool: the stack
            n_layers = len(self.layers)                                           # checks new views in full
            views = self._views = (k_cache, v_cache, [heads_major(k_cache[i]) for i in range(n_layers)],
                                   [heads_major(v_cache[i]) for i in range(n_layers)])
        try:
            self.stack.forward_tp(x, lay, views[2], views[3], comm, self.group.timeout_s)
        except (CommTimeout, CommMismatch) as e:
            raise GroupFault(str(e)) from e
        self.stats.collective_s += self.stack.comm_s

    def _layers(self, x: torch.Tensor, lay: StepLayout, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """The layers one op at a time, the pieces gathered through the group
        (gloo, or slots too small for a token's pieces): sf_forward_tp's reference."""
        cpu, cfg = self.cpu, self.cfg
        eps = cfg.rms_norm_eps
        for li, L in enumerate(self.layers):
            h = cpu.rmsnorm(x, L.attn_norm, eps)
            qkv = cpu.linear(h, L.qkv)
            a = cpu.attention(qkv, lay, heads_major(k_cache[li]), heads_major(v_cache[li]), n_heads=self.n_heads,
                              n_kv=self.n_kv, head_dim=cfg.head_dim, cos=self.cos, sin=self.sin, q_norm=L.q_norm,
                              k_norm=L.k_norm, eps=eps, scale=self.scale)
            self._reduce(cpu.linear_parts(a, L.o), x, L.o.bias)
            h = cpu.rmsnorm(x, L.mlp_norm, eps)
            self._reduce(cpu.linear_parts(cpu.linear_swiglu(h, L.gate_up), L.down), x, L.down.bias)

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """[world, *t.shape] of every rank's t (bf16 moved as int16 bits)."""
        t0 = time.perf_counter()
        out = bits_gather(self.group, t)
        self.stats.collective_s += time.perf_counter() - t0
        return out

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Each token's embedding row, copied whole from the rank holding it."""
        v = self.shard.vocab
        if self.shard.world == 1:
            out: torch.Tensor = self.cpu.embed(self.embed, tokens)
            return out
        mine = (tokens >= v.start) & (tokens < v.stop)
        x = torch.zeros((tokens.shape[0], self.cfg.hidden_size), dtype=torch.float32)
        if bool(mine.any()):
            x[mine] = self.cpu.embed(self.embed, tokens[mine] - v.start)
        every = self.all_gather(x)  # [world, n, hidden]
        owner = torch.bucketize(tokens, torch.tensor([r.stop for r in self.vocab[:-1]]), right=True)
        return every[owner, torch.arange(tokens.shape[0])].contiguous()

    def _reduce(self, parts: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> None:
        """x += the layer's output: every piece, in piece order (or, with
        plain_reduce, this rank's pieces summed then all-reduced)."""
        if self.shard.world == 1:
            self.cpu.combine(parts, x, bias)
            return
        if self.plain_reduce:
            s = parts.sum(0)
            self.group.all_reduce_plain(s)
            if bias is not None:
                s += bias
            x += s
            return
        every = self.all_gather(parts)  # [world, local pieces, n, hidden]
        self.cpu.combine(every.view(self.parts, *parts.shape[1:]), x, bias)

    def _gather_vocab(self, logits: torch.Tensor) -> torch.Tensor | None:
        """The leader's whole rows from every rank's vocabulary columns."""
        if self.shard.world == 1:
            return logits
        return gather_vocab(logits, self.vocab, self.group.rank, self.all_gather)
