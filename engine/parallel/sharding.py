"""Which part of a Llama-family model each tensor-parallel rank holds.

Attention heads, the MLP's intermediate features and the vocabulary are
split into contiguous ranges, one a rank. The layers that reduce over a
split dimension (o_proj over heads, down_proj over intermediate features)
always reduce in `parts` fixed pieces, at every degree, TP=1 included: a
rank computes its pieces' sums from zero, every rank gets every piece, and
each adds them in piece order (kernels/cpu.py combine). So a row's bits do
not depend on the degree, as long as the degree divides `parts`. KV heads
fewer than the degree are replicated: each rank holds the one its query
heads read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from superfluid.engine.config import ModelConfig

__all__ = ["MAX_PARTS", "MAX_TP", "Shard", "TpError", "gather_vocab", "kv_block_heads", "reduction_parts",
           "vocab_blocks", "vocab_ranges"]

# The pieces a row-parallel layer reduces in: more pieces allow higher degrees
# and cost TP=1 a little (pieces of fewer inputs, one more add each).
MAX_PARTS = 8
MAX_TP = MAX_PARTS
# Vocabulary shards start on a multiple of this (the packed LM head's panel).
_VOCAB_ALIGN = 16


class TpError(ValueError):
    """A degree this model cannot be split into (the message names --tp)."""


def reduction_parts(cfg: ModelConfig) -> int:
    """The pieces o_proj and down_proj reduce in for this model: the most, up to
    MAX_PARTS, that split both the heads and the intermediate features evenly."""
    g = MAX_PARTS
    while cfg.num_heads % g or cfg.intermediate_size % g:
        g //= 2
    return g


def vocab_blocks(vocab: int, parts: int) -> list[range]:
    """The vocabulary in `parts` fixed blocks, aligned, the last ones shorter
    (or empty): the LM head's GEMMs on the torch and Triton backends, the same
    shapes at every degree."""
    per = -(-vocab // parts)
    per = -(-per // _VOCAB_ALIGN) * _VOCAB_ALIGN
    return [range(min(b * per, vocab), min((b + 1) * per, vocab)) for b in range(parts)]


def vocab_ranges(vocab: int, world: int, parts: int = MAX_PARTS) -> list[range]:
    """Contiguous vocabulary ranges, one a rank: each rank's run of
    vocab_blocks (`world` divides `parts`)."""
    blocks = vocab_blocks(vocab, parts)
    per = parts // world
    return [range(blocks[r * per].start, blocks[(r + 1) * per - 1].stop) for r in range(world)]


def kv_block_heads(cfg: ModelConfig, parts: int) -> int:
    """KV heads in one of k_proj's (and v_proj's) fixed blocks: a rank holds
    whole blocks at every degree (a replicated head is one block)."""
    return cfg.num_kv_heads // parts if cfg.num_kv_heads % parts == 0 else 1


@dataclasses.dataclass(frozen=True)
class Shard:
    """Rank `rank` of `world`: its query heads, KV heads, intermediate
    features, vocabulary rows, and its pieces of each row-parallel layer."""

    rank: int
    world: int
    parts: int  # pieces at every degree
    heads: range
    kv_heads: range
    inter: range
    vocab: range

    @property
    def local_parts(self) -> int:
        return self.parts // self.world

    @classmethod
    def plan(cls, cfg: ModelConfig, world: int, rank: int = 0) -> Shard:
        """Rank `rank`'s shard at degree `world`; TpError if the model does not split so."""
        if not 1 <= world <= MAX_TP:
            raise TpError(f"--tp {world}: the degree must be 1..{MAX_TP}")
        if not 0 <= rank < world:
            raise TpError(f"rank {rank} outside a group of {world}")
        nh, nkv, inter = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
        parts = reduction_parts(cfg)
        if parts % world:
            raise TpError(f"--tp {world}: {cfg.arch}'s {nh} attention heads and {inter} intermediate features "
                          f"split evenly into at most {parts} pieces; the degree must divide {parts}")
        per_h = nh // world
        heads = range(rank * per_h, (rank + 1) * per_h)
        if nkv % world == 0:
            per_kv = nkv // world
            kv_heads = range(rank * per_kv, (rank + 1) * per_kv)
        elif world % nkv == 0:
            group = nh // nkv  # query heads a KV head serves; a rank's heads lie within one group
            kv_heads = range(heads.start // group, heads.start // group + 1)
        else:
            raise TpError(f"--tp {world}: {cfg.arch}'s {nkv} KV heads neither split evenly into {world} ranks nor "
                          f"replicate evenly over them")
        per_i = inter // world
        return cls(rank, world, parts, heads, kv_heads, range(rank * per_i, (rank + 1) * per_i),
                   vocab_ranges(cfg.vocab_size, world, parts)[rank])

    def rows_of(self, name: str, cfg: ModelConfig) -> tuple[str, range] | None:
        """How the HF tensor `name` is cut for this rank: ("rows" | "cols", the
        range), or None when every rank holds it whole."""
        hd = cfg.head_dim
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return "rows", self.vocab
        leaf = name.rsplit(".", 2)[-2:]  # e.g. ["q_proj", "weight"]
        proj = leaf[0]
        if proj == "q_proj":
            return "rows", range(self.heads.start * hd, self.heads.stop * hd)
        if proj in ("k_proj", "v_proj"):
            return "rows", range(self.kv_heads.start * hd, self.kv_heads.stop * hd)
        if proj in ("gate_proj", "up_proj"):
            return "rows", self.inter
        if leaf == ["o_proj", "weight"]:
            return "cols", range(self.heads.start * hd, self.heads.stop * hd)
        if leaf == ["down_proj", "weight"]:
            return "cols", self.inter
        return None  # norms, o/down biases (added once, after the pieces)


def gather_vocab(logits: torch.Tensor, ranges: list[range], rank: int,
                 all_gather: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
    """The whole rows [rows, vocab] on rank 0 from every rank's columns of
    its vocabulary range (padded to one width for the all-gather); None elsewhere."""
    width = max(len(r) for r in ranges)
    if logits.shape[1] < width:
        logits = torch.cat([logits, logits.new_zeros((logits.shape[0], width - logits.shape[1]))], 1)
    every = all_gather(logits.contiguous())  # [world, rows, width]
    if rank != 0:
        return None
    return torch.cat([every[r, :, :len(v)] for r, v in enumerate(ranges)], 1)
