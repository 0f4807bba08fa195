"""What a decode step must compute and read, and a batch's rates against that.

`bench engine` reports each run beside its roofline: model FLOPs over the
GEMM peak and bytes read over the memory bandwidth. The counts live here so
the main run and the --isa runs (engine_isa.py) derive their figures alike.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

# Per batch, besides tokens/s: our decode's GF/s, a decode step's ms, the floor and peak fractions, and
# the ms of a step outside the kernels' one call (the host's: Python, the step's layout, the token list).
PER_BATCH = ("achieved_gflops", "step_ms", "floor_fraction", "peak_fraction", "host_ms")


def matmul_weights(cfg) -> int:
    """The weights a token multiplies: every layer's q, k, v, o, gate, up and
    down projections and the LM head (not the embedding table: one row per
    token is gathered from it; tied or not, the head is read whole)."""
    per_layer = (cfg.hidden_size * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * cfg.hidden_size
                 + 3 * cfg.hidden_size * cfg.intermediate_size)
    return cfg.num_layers * per_layer + cfg.hidden_size * cfg.vocab_size


def weight_bytes(cfg, dtype: torch.dtype) -> int:
    """The bytes one decode step must read at least: the matmul weights at
    `dtype`, once per step whatever the batch (biases, norms and the KV
    cache left out: small beside them at these contexts)."""
    return matmul_weights(cfg) * torch.empty((), dtype=dtype).element_size()


def decode_flops(cfg, batch: int, prompt_len: int, gen: int) -> float:
    """Model FLOPs of the G-1 decode steps at `batch`: 2 per matmul weight per
    token, plus attention's 4 * layers * heads * head_dim per context cell
    (the s-th step's token sees P + s cells)."""
    context = sum(prompt_len + s for s in range(1, gen))
    return batch * (2.0 * matmul_weights(cfg) * (gen - 1)
                    + 4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context)


def g4(x: float) -> float:
    """`x` to 4 significant digits, as the JSON gives ratios and rates."""
    return float(f"{x:.4g}")


def rates(cfg, prompts: np.ndarray, gen: int, ours: dict[str, Any], peak: float,
          floor_ms: float) -> dict[str, float | None]:
    """One batch's figures from a run of ours: tokens/s, the decode's GF/s, a
    step's ms and how near it came to the memory floor and the GEMM peak."""
    b, p = prompts.shape
    gflops = decode_flops(cfg, b, p, gen) / ours["decode_s"] / 1e9
    step_ms = ours["decode_s"] / max(1, gen - 1) * 1e3
    kernel_s = ours.get("kernel_s")
    return {"prefill_tok_s": round(b * p / ours["prefill_s"], 1),
            "decode_tok_s": round(b * (gen - 1) / ours["decode_s"], 1),
            "achieved_gflops": g4(gflops), "step_ms": g4(step_ms),
            "floor_fraction": g4(floor_ms / step_ms), "peak_fraction": g4(gflops / peak) if peak else None,
            "host_ms": None if kernel_s is None else g4((ours["decode_s"] - kernel_s) / max(1, gen - 1) * 1e3)}
