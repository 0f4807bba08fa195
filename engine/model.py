"""The Llama-family forward pass over a ragged step and the paged KV pool.

All tokens of all feeds of a step go through the linear layers as one batch;
attention takes each token over its own sequence's cells (kernels/attention.py).
The ops come from a backend (kernels/backend.py). On the CPU kernels'
backend projections are fused (q/k/v into one matrix, gate/up into
another), the weights packed once here, at load, and every layer of a step
runs in one call into C (_forward_stack). On the torch and Triton backends the
layers run in blocks of fixed shapes (engine/blocked.py), so that a tensor-
parallel group of any degree computes the very same GEMMs.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from superfluid.engine.blocked import BlockedModel
from superfluid.engine.config import ModelConfig
from superfluid.engine.kv import KVPool
from superfluid.engine.parallel.sharding import Shard, reduction_parts
from superfluid.engine.rope_scaling import rope_cos_sin
from superfluid.kernels.attention import AttnBatch, heads_major
from superfluid.kernels.backend import Backend
from superfluid.kernels.cpu_stack import Stack, in_huge_pages

_LINEARS = ("qkv", "o", "gate_up", "down")
_ROW_PARALLEL = ("o", "down")


@dataclasses.dataclass
class Layer:
    attn_norm: torch.Tensor
    qkv: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # Qwen3: RMSNorm over head_dim of each head
    k_norm: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    mlp_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate, hidden], gate first
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


class Model:
    """Weights laid out for the forward pass, and the forward pass."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], backend: Backend,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 max_seq_len: int | None = None):
        self.cfg = cfg
        self.backend = backend
        self.device = torch.device(device)
        self.dtype = dtype
        # The weights are packed (or blocked) for this class below: it is fixed for the model's life.
        self.numeric_class = backend.numeric_class(self.device, dtype)
        self.max_seq_len = max_seq_len or cfg.max_position_embeddings
        cos, sin = rope_cos_sin(cfg, self.max_seq_len)
        self.cos = cos.to(self.device)
        self.sin = sin.to(self.device)
        self.scale = cfg.head_dim ** -0.5
        self.parts = reduction_parts(cfg)
        self.stack = None
        self._pools: tuple | None = None  # the KV pool and its per-layer heads-major views (_forward_stack)
        self.blocked: BlockedModel | None = None
        if not backend.fused_cpu:
            # Fixed-shape blocks: the bits of every tensor-parallel degree (engine/blocked.py);
            # without invariance (measuring its cost) one block a layer, the plain GEMMs.
            shard = Shard.plan(cfg, 1, 0)
            if not backend.invariant:
                shard = dataclasses.replace(shard, parts=1)
            self.blocked = BlockedModel(cfg, weights, shard, backend, self.device, dtype, self.cos, self.sin)
            self.layers = self.blocked.layers
            return
        w = {k: v.to(device=self.device, dtype=dtype) for k, v in weights.items()}

        def opt(name: str) -> torch.Tensor | None:
            return w.get(name)

        def cat(*names: str) -> torch.Tensor | None:
            parts = [w.get(n) for n in names]
            if all(p is None for p in parts):
                return None
            return torch.cat([p for p in parts]).contiguous()

        self.embed = w["model.embed_tokens.weight"]
        self.norm = w["model.norm.weight"]
        self.lm_head = w.get("lm_head.weight", self.embed)
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            self.layers.append(Layer(
                attn_norm=w[p + "input_layernorm.weight"],
                qkv=cat(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
                qkv_bias=cat(a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"),
                q_norm=opt(a + "q_norm.weight"), k_norm=opt(a + "k_norm.weight"),
                o=w[a + "o_proj.weight"], o_bias=opt(a + "o_proj.bias"),
                mlp_norm=w[p + "post_attention_layernorm.weight"],
                gate_up=cat(m + "gate_proj.weight", m + "up_proj.weight"),
                gate_up_bias=cat(m + "gate_proj.bias", m + "up_proj.bias"),
                down=w[m + "down_proj.weight"], down_bias=opt(m + "down_proj.bias"),
            ))
        self._pack(backend.cpu)

    def _pack(self, cpu) -> None:
        """Weights as the C kernels take them: linears packed (their dtype
        kept: float32 or bfloat16), norms float32, the embedding table as
        is (rows are widened as they are gathered)."""
        self.cos, self.sin = self.cos.float().contiguous(), self.sin.float().contiguous()
        self.norm = self.norm.float()
        cls = self.numeric_class  # the class DESCRIBE states is the one the weights are packed in
        self.lm_head = cpu.pack(self.lm_head, numeric=cls)
        for layer in self.layers:
            for name in _LINEARS:
                w, b = getattr(layer, name), getattr(layer, name + "_bias")
                # o and down reduce in fixed pieces at every TP degree (engine/parallel/sharding.py).
                setattr(layer, name, cpu.pack_parts(w, self.parts, b, numeric=cls) if name in _ROW_PARALLEL
                        else cpu.pack_gate_up(w, b, numeric=cls) if name == "gate_up" else cpu.pack(w, b, numeric=cls))
                setattr(layer, name + "_bias", None)
            for name in ("attn_norm", "mlp_norm", "q_norm", "k_norm"):
                t = getattr(layer, name)
                if t is not None:
                    setattr(layer, name, t.float().contiguous())
        self.huge_pages = in_huge_pages([getattr(L, n) for L in self.layers for n in _LINEARS] + [self.lm_head])
        cfg = self.cfg
        self.stack = Stack(self.layers, hidden=cfg.hidden_size, n_heads=cfg.num_heads, n_kv=cfg.num_kv_heads,
                               head_dim=cfg.head_dim, inter=cfg.intermediate_size, eps=cfg.rms_norm_eps,
                               scale=self.scale, cos=self.cos, sin=self.sin)
        self.stack.set_head(self.embed.contiguous(), self.norm.contiguous(), self.lm_head)

    def close(self) -> None:
        """Nothing to release but memory (a tensor-parallel leader stops its group)."""

    def kv_pool(self, n_blocks: int, page: int) -> KVPool:
        """The KV pool this model's forward pass reads and writes."""
        return KVPool(self.cfg.num_layers, self.cfg.num_kv_heads, self.cfg.head_dim, n_blocks, page,
                      dtype=self.dtype, device=self.device, heads_major=self.backend.heads_major_kv)

    @functools.cached_property
    def weight_bytes(self) -> int:
        if self.blocked is not None:
            return self.blocked.weight_bytes
        seen = {id(self.embed): self.embed, id(self.lm_head): self.lm_head, id(self.norm): self.norm}
        for layer in self.layers:
            for f in dataclasses.fields(layer):
                t = getattr(layer, f.name)
                if t is not None:
                    seen[id(t)] = t
        return sum(t.nbytes if hasattr(t, "out") else t.numel() * t.element_size() for t in seen.values())

    def forward(self, tokens: torch.Tensor | None, batch: AttnBatch, k_cache: torch.Tensor, v_cache: torch.Tensor,
                rows: torch.Tensor | None, picks: list[Any] | None = None) -> torch.Tensor:
        """tokens [n] of the step (None where takes_ids: the layout's); the
        pool's K/V [layers, blocks, page, kv_heads, head_dim]; `rows`: token
        indices whose logits are wanted (None: every token). Returns logits
        [len(rows), vocab] (float32). `picks`, a list, gets each row's greedy
        token and non-finite flag (two lists) where the forward can give them
        on the way; it stays empty elsewhere."""
        if self.stack is not None:  # the C kernels only, no autograd anywhere: no inference_mode to enter
            return self._forward_stack(tokens, batch, k_cache, v_cache, rows, picks)
        with torch.inference_mode():
            if self.blocked is None:
                return self._forward_cpu(tokens, batch, k_cache, v_cache, rows)
            assert tokens is not None
            out = self.blocked.forward(tokens, batch, k_cache, v_cache, rows)
            assert out is not None
            return out

    @property
    def takes_ids(self) -> bool:
        """Whether forward reads a step's token ids from its CPU layout
        (cpu.step_layout(..., ids)) and needs no tokens tensor."""
        return self.stack is not None

    def _forward_stack(self, tokens: torch.Tensor | None, lay, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       rows: torch.Tensor | None, picks: list[Any] | None) -> torch.Tensor:
        """The layer stack's forward: one call into C a step, from the ids
        (tokens None: the layout's) to the logits (and greedy picks)."""
        pools = self._pools
        if pools is None or pools[0] is not k_cache or pools[1] is not v_cache:  # the views, made once a pool
            n_layers = len(self.layers)
            ks = [heads_major(k_cache[i]) for i in range(n_layers)]
            vs = [heads_major(v_cache[i]) for i in range(n_layers)]
            if ks[0].data_ptr() != k_cache[0].data_ptr():  # a copy: the step's K/V would be written into it
                raise ValueError("the CPU kernels need a heads-major KV pool")
            self._pools = pools = (k_cache, v_cache, ks, vs)
        if rows is not None and rows.shape[0] == lay.n:
            rows = None  # as many rows as tokens: every row, in order
        x = None if tokens is None else self.backend.cpu.embed(self.embed, tokens)
        return self.stack.forward_head(x, lay, pools[2], pools[3], rows, picks)

    def _forward_cpu(self, tokens: torch.Tensor | None, lay, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     rows: torch.Tensor | None) -> torch.Tensor:
        """The CPU kernels one call at a time (the stack's reference):
        float32 activations whatever the weights' dtype; `lay` a
        kernels.cpu.StepLayout (tokens None: its ids); the residual adds
        fused into the o and down GEMMs."""
        cpu, eps = self.backend.cpu, self.cfg.rms_norm_eps
        x = cpu.embed(self.embed, lay.ids if tokens is None else tokens)
        self._layers_cpu(x, lay, k_cache, v_cache)
        if rows is not None and rows.shape[0] != x.shape[0]:  # as many rows as tokens: every row, in order
            x = x[rows]
        return cpu.linear(cpu.rmsnorm(x, self.norm, eps), self.lm_head)

    def _layers_cpu(self, x: torch.Tensor, lay, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """The layers one kernel call at a time: what sf_forward does in C,
        kept as its reference (tests compare the two bitwise)."""
        cpu, cfg = self.backend.cpu, self.cfg
        eps = cfg.rms_norm_eps
        for li, layer in enumerate(self.layers):
            h = cpu.rmsnorm(x, layer.attn_norm, eps)
            qkv = cpu.linear(h, layer.qkv)
            a = cpu.attention(qkv, lay, heads_major(k_cache[li]), heads_major(v_cache[li]), n_heads=cfg.num_heads,
                              n_kv=cfg.num_kv_heads, head_dim=cfg.head_dim, cos=self.cos, sin=self.sin,
                              q_norm=layer.q_norm, k_norm=layer.k_norm, eps=eps, scale=self.scale)
            cpu.combine(cpu.linear_parts(a, layer.o), x, layer.o.bias)
            h = cpu.rmsnorm(x, layer.mlp_norm, eps)
            cpu.combine(cpu.linear_parts(cpu.linear_swiglu(h, layer.gate_up), layer.down), x, layer.down.bias)
