"""Seeded tiny Mamba2 checkpoints in HF's Mamba2ForCausalLM layout (config.json + model.safetensors).

Built by transformers itself (so the layout is exactly what HF writes and reads), then the
parameters are redrawn from one seed at scales that keep activations O(1) and make every
parameter matter: per-head decays spread over a range where the state neither vanishes
within a few tokens nor is constant, norm weights and D away from their 1/1 defaults.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

__all__ = ["write_tiny_mamba2"]


def write_tiny_mamba2(path: str | Path, seed: int = 0, *, vocab_size: int = 320, hidden_size: int = 64,
                      state_size: int = 16, num_heads: int = 8, n_groups: int = 1, num_layers: int = 2,
                      expand: int = 2, conv_kernel: int = 4, chunk_size: int = 16,
                      tie_word_embeddings: bool = False, bos_token_id: int | None = 1,
                      eos_token_id: int | list[int] | None = 2, pad_token_id: int | None = 0) -> Path:
    """Write the checkpoint into `path` and return it. The special ids go to
    config.json as given (engine.tiny.write_tiny(arch="mamba2") puts them
    after the 256 byte tokens and adds a tokenizer)."""
    import transformers  # only the writer needs it
    from transformers.utils import logging as hf_logging

    if (expand * hidden_size) % num_heads:
        raise ValueError("expand*hidden_size must be a multiple of num_heads")
    cfg = transformers.Mamba2Config(
        vocab_size=vocab_size, hidden_size=hidden_size, state_size=state_size, num_heads=num_heads,
        head_dim=expand * hidden_size // num_heads, n_groups=n_groups, expand=expand,
        num_hidden_layers=num_layers, conv_kernel=conv_kernel, chunk_size=chunk_size,
        tie_word_embeddings=tie_word_embeddings, pad_token_id=pad_token_id, bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
    )
    torch.manual_seed(seed)
    model = transformers.Mamba2ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, std=1.0):
        return torch.randn(*shape, generator=g) * std

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                # A = -exp(A_log) in [-2, -0.1]: decays from fast to slow across heads.
                p.copy_(torch.log(torch.empty(p.shape).uniform_(0.1, 2.0, generator=g)))
            elif name.endswith("dt_bias"):
                # softplus(dt_bias) around 0.05..0.5 (inverse softplus of a uniform draw).
                dt = torch.empty(p.shape).uniform_(0.05, 0.5, generator=g)
                p.copy_(dt + torch.log(-torch.expm1(-dt)))
            elif name.endswith(".D"):
                p.copy_(1.0 + randn(*p.shape, std=0.5))
            elif name.endswith(("norm.weight", "norm_f.weight")):
                p.copy_(1.0 + randn(*p.shape, std=0.1))
            elif name.endswith("embeddings.weight"):
                # Untied: unit-scale rows (the first RMSNorm rescales them anyway). Tied, the same
                # matrix is the head, whose logits over unit-RMS hidden states want std 1/sqrt(h).
                p.copy_(randn(*p.shape, std=hidden_size ** -0.5 if tie_word_embeddings else 1.0))
            elif p.dim() >= 2:
                # Linear/conv weights: std 1/sqrt(fan_in) keeps outputs ~unit scale.
                p.copy_(randn(*p.shape, std=1.0 / math.sqrt(p[0].numel())))
            else:  # biases
                p.copy_(randn(*p.shape, std=0.1))
        if tie_word_embeddings:
            model.tie_weights()
    out = Path(path)
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a one-shard "Writing model shards" bar says nothing
    try:
        model.save_pretrained(out, safe_serialization=True)
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    return out
