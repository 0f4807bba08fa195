"""The torch and Triton backends' forward pass, in blocks of fixed shapes.

A GEMM library picks its algorithm (tiling, split-K) by the shape, so a
column of `x @ W.T` may round differently when W has fewer rows: a rank of a
tensor-parallel group, holding a slice of W, would then disagree with TP=1.
So every layer is computed in blocks whose shapes do not depend on the
degree (engine/parallel/sharding.py): q in `parts` blocks of heads, k and v
in blocks of kv_block_heads, the MLP in `parts` pieces (gate, up and down of
one piece of the intermediate features), o and down reduced in those
`parts` pieces summed in piece order, the LM head in vocab_blocks. TP=1 is
one rank holding every block; a rank of a group holds its own and gathers
the pieces (engine/parallel/tp_torch.py). The C kernels' path (kernels/cpu.py)
has its own fixed pieces and does not come here.
"""

from __future__ import annotations

import dataclasses

import torch

from superfluid.engine.config import ModelConfig
from superfluid.engine.parallel.sharding import Shard, kv_block_heads, vocab_blocks
from superfluid.kernels.attention import AttnBatch
from superfluid.kernels.backend import Backend

__all__ = ["BlockedLayer", "BlockedModel", "combine_pieces"]


@dataclasses.dataclass
class BlockedLayer:
    """One layer's weights as this rank's blocks (stacked on dim 0)."""

    attn_norm: torch.Tensor
    q: torch.Tensor  # [q blocks, heads a block * head_dim, hidden]
    q_bias: torch.Tensor | None  # [q blocks, rows]
    k: torch.Tensor  # [kv blocks, kv heads a block * head_dim, hidden]
    k_bias: torch.Tensor | None
    v: torch.Tensor
    v_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: torch.Tensor  # [pieces, hidden, heads a piece * head_dim]
    o_bias: torch.Tensor | None  # [hidden], added once after the pieces
    mlp_norm: torch.Tensor
    gate_up: torch.Tensor  # [pieces, 2 * features a piece, hidden], the piece's gate rows then its up rows
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor  # [pieces, hidden, features a piece]
    down_bias: torch.Tensor | None


def combine_pieces(pieces: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x + (the pieces [P, n, hidden] summed in piece order, then the bias):
    the one order every degree uses."""
    s = pieces[0].clone()
    for p in range(1, pieces.shape[0]):
        s += pieces[p]
    if bias is not None:
        s += bias
    return x + s


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """Rows of t cut into n equal blocks, stacked: [n, rows / n, ...]."""
    return t.reshape(n, t.shape[0] // n, *t.shape[1:]).contiguous()


def _blocks(t: torch.Tensor | None, n: int) -> torch.Tensor | None:
    return None if t is None else _rows(t, n)


class BlockedModel:
    """Shard `shard` of a Llama-family model on a torch or Triton backend,
    computed block by block. `weights`: HF names, the whole tensors (TP=1) or
    this shard's slices as load_weights(shard=) reads them. This class runs
    TP=1; a group's rank overrides the three hooks that move data."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], shard: Shard, backend: Backend,
                 device: torch.device, dtype: torch.dtype, cos: torch.Tensor, sin: torch.Tensor):
        self.cfg, self.shard, self.backend = cfg, shard, backend
        self.device, self.dtype = device, dtype
        self.cos, self.sin = cos, sin
        self.scale = cfg.head_dim ** -0.5
        self.parts = shard.parts
        self.n_heads, self.n_kv = len(shard.heads), len(shard.kv_heads)
        lp = shard.local_parts
        kvb = len(shard.kv_heads) // kv_block_heads(cfg, shard.parts)
        w = {k: v.to(device=device, dtype=dtype) for k, v in weights.items()}
        self.embed = w["model.embed_tokens.weight"]
        self.norm = w["model.norm.weight"]
        self.vocab = shard.vocab
        # This rank's LM head blocks: the vocabulary's fixed blocks within its range.
        head = w.get("lm_head.weight", self.embed)
        self.head_blocks = [head[b.start - shard.vocab.start:b.stop - shard.vocab.start]
                            for b in vocab_blocks(cfg.vocab_size, shard.parts)
                            if len(b) and b.start >= shard.vocab.start and b.stop <= shard.vocab.stop]

        def cols(t: torch.Tensor) -> torch.Tensor:  # [hidden, lp * c] -> [lp, hidden, c]
            return t.reshape(t.shape[0], lp, t.shape[1] // lp).permute(1, 0, 2).contiguous()

        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            gate, up = _rows(w[m + "gate_proj.weight"], lp), _rows(w[m + "up_proj.weight"], lp)
            gb, ub = _blocks(w.get(m + "gate_proj.bias"), lp), _blocks(w.get(m + "up_proj.bias"), lp)
            self.layers.append(BlockedLayer(
                attn_norm=w[p + "input_layernorm.weight"],
                q=_rows(w[a + "q_proj.weight"], lp), q_bias=_blocks(w.get(a + "q_proj.bias"), lp),
                k=_rows(w[a + "k_proj.weight"], kvb), k_bias=_blocks(w.get(a + "k_proj.bias"), kvb),
                v=_rows(w[a + "v_proj.weight"], kvb), v_bias=_blocks(w.get(a + "v_proj.bias"), kvb),
                q_norm=w.get(a + "q_norm.weight"), k_norm=w.get(a + "k_norm.weight"),
                o=cols(w[a + "o_proj.weight"]), o_bias=w.get(a + "o_proj.bias"),
                mlp_norm=w[p + "post_attention_layernorm.weight"],
                gate_up=torch.cat([gate, up], 1).contiguous(),
                gate_up_bias=None if gb is None or ub is None else torch.cat([gb, ub], 1).contiguous(),
                down=cols(w[m + "down_proj.weight"]), down_bias=w.get(m + "down_proj.bias"),
            ))

    @property
    def weight_bytes(self) -> int:
        tensors = [self.embed, self.norm, *self.head_blocks]
        for layer in self.layers:
            tensors += [t for f in dataclasses.fields(layer) if (t := getattr(layer, f.name)) is not None]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}  # a tied head once
        return sum(storages.values())

    # ---------------------------------------------------- what moves data

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed.index_select(0, tokens)

    def all_pieces(self, pieces: torch.Tensor) -> torch.Tensor:
        """Every rank's pieces [parts, n, hidden], in piece order."""
        return pieces

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor | None:
        """The whole rows [rows, vocab] where they are sampled (None elsewhere)."""
        return logits

    # ------------------------------------------------------------- the pass

    def forward(self, tokens: torch.Tensor, batch: AttnBatch, k_cache: torch.Tensor, v_cache: torch.Tensor,
                rows: torch.Tensor | None) -> torch.Tensor | None:
        """This rank's part of a step: the logits [rows, vocab] (float32)
        where they are sampled, None on the other ranks."""
        cfg, be = self.cfg, self.backend
        eps = cfg.rms_norm_eps
        n, hd = tokens.shape[0], cfg.head_dim
        pos = batch.positions
        x = self.embed_tokens(tokens)
        for li, L in enumerate(self.layers):
            h = be.rmsnorm(x, L.attn_norm, eps)
            q = self._column(h, L.q, L.q_bias).view(n, self.n_heads, hd)
            k = self._column(h, L.k, L.k_bias).view(n, self.n_kv, hd)
            v = self._column(h, L.v, L.v_bias).view(n, self.n_kv, hd)
            if L.q_norm is not None:
                assert L.k_norm is not None
                q = be.rmsnorm(q, L.q_norm, eps)
                k = be.rmsnorm(k, L.k_norm, eps)
            q = be.rope(q, self.cos, self.sin, pos)
            k = be.rope(k, self.cos, self.sin, pos)
            be.kv_write(k_cache[li], v_cache[li], batch.cells, k, v)
            att = be.attention(q, k_cache[li], v_cache[li], batch, self.scale, li).reshape(n, self.n_heads * hd)
            width = L.o.shape[2]
            pieces = torch.stack([be.linear(att[:, p * width:(p + 1) * width], L.o[p])
                                  for p in range(L.o.shape[0])])
            x = combine_pieces(self.all_pieces(pieces), x, L.o_bias)
            h = be.rmsnorm(x, L.mlp_norm, eps)
            pieces = torch.stack([be.mlp(h, L.gate_up[p], None if L.gate_up_bias is None else L.gate_up_bias[p],
                                         L.down[p], None) for p in range(L.down.shape[0])])
            x = combine_pieces(self.all_pieces(pieces), x, L.down_bias)
        if rows is not None:
            x = x[rows]
        x = be.rmsnorm(x, self.norm, eps)
        logits = torch.cat([be.linear(x, b) for b in self.head_blocks], 1).float()
        return self.gather_vocab(logits)

    def _column(self, h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """A column-parallel projection, block by block."""
        return torch.cat([self.backend.linear(h, w[i], None if b is None else b[i]) for i in range(w.shape[0])], 1)
