"""`superfluid.engine.load`: a checkpoint directory to a ready runtime."""

from __future__ import annotations

import json
import os

import torch

from superfluid.engine.config import load_config
from superfluid.engine.model import Model
from superfluid.engine.transformer import TransformerRuntime
from superfluid.engine.weights import load_weights
from superfluid.kernels.backend import get_backend


def _tokenizer(path: str) -> tuple[str | None, dict[str, int]]:
    """tokenizer.json's text (grammars compile against it) and the special
    tokens it names; (None, {}) without one."""
    tok = os.path.join(path, "tokenizer.json")
    if not os.path.exists(tok):
        return None, {}
    with open(tok, encoding="utf-8") as f:
        text = f.read()
    added = json.loads(text).get("added_tokens", [])
    return text, {t["content"]: int(t["id"]) for t in added if t.get("special")}


def load(path: str | os.PathLike, backend: str = "torch", *, device: str | None = None,
         dtype: torch.dtype | str | None = None, invariant: bool = True, max_seq_len: int | None = None,
         **pool_options) -> TransformerRuntime:
    """Load a Llama-family checkpoint (config.json + *.safetensors) into a
    runtime. `dtype`: compute dtype (default float32 on CPU, the checkpoint's
    on GPU); pool_options go to TransformerRuntime (kv_cells, page,
    max_batch, max_seqs, prefill_step_tokens)."""
    path = os.fspath(path)
    cfg = load_config(path)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if dtype is None:
        dtype = torch.float32 if dev.type == "cpu" else cfg.dtype
    weights = load_weights(path, cfg, dtype=dtype)
    limit = cfg.max_position_embeddings
    if cfg.sliding_window:
        # Within the window, sliding-window attention is full attention: stay there.
        limit = min(limit, cfg.sliding_window)
    model = Model(cfg, weights, get_backend(backend, invariant, dev), device=dev, dtype=dtype,
                  max_seq_len=min(max_seq_len or limit, limit))
    tokenizer_json, specials = _tokenizer(path)
    return TransformerRuntime(model, specials=specials, tokenizer_json=tokenizer_json, **pool_options)
