"""`superfluid.engine.load`: a checkpoint directory to a ready runtime."""

from __future__ import annotations

import contextlib
import json
import os

import torch

from superfluid.engine.checkpoint import model_type, raw_config, read_text
from superfluid.engine.config import load_config
from superfluid.engine.model import Model
from superfluid.engine.parallel.sharding import TpError
from superfluid.engine.runtime import Runtime
from superfluid.engine.transformer import TransformerRuntime
from superfluid.engine.weights import load_weights
from superfluid.kernels.backend import get_backend


def _tokenizer(path: str) -> tuple[str | None, dict[str, int]]:
    """tokenizer.json's text (grammars compile against it) and the special
    tokens it names; (None, {}) without one."""
    tok = os.path.join(path, "tokenizer.json")
    if not os.path.exists(tok):
        return None, {}
    text = read_text(tok)
    added = json.loads(text).get("added_tokens", [])
    return text, {t["content"]: int(t["id"]) for t in added if t.get("special")}


def load(path: str | os.PathLike, backend: str = "torch", *, device: str | None = None,
         dtype: torch.dtype | str | None = None, invariant: bool = True, max_seq_len: int | None = None,
         tp: int = 1, tp_options: dict | None = None, **pool_options) -> Runtime:
    """Load a checkpoint (config.json + *.safetensors) into a runtime: a
    Llama-family one into a TransformerRuntime, a Mamba2 one (model_type
    "mamba2") into a Mamba2Runtime. `dtype`: compute dtype (default float32
    on CPU, the checkpoint's on GPU); pool_options go to TransformerRuntime
    (kv_cells, page, max_batch, max_seqs, prefill_step_tokens) or to
    Mamba2Runtime (state_bytes, max_batch, max_seqs, prefill_step_tokens,
    chunk_size). `tp` > 1: the model runs on that many rank processes
    (engine/parallel; tp_options: transport, threads, timeout_s), with the
    bits of tp 1."""
    path = os.fspath(path)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if model_type(path) == "mamba2":
        if tp != 1:
            raise TpError(f"--tp {tp}: the Mamba2 runtime runs on one process (tensor parallelism is for "
                          f"Llama-family models)")
        return _load_mamba2(path, backend, dev, dtype, invariant, max_seq_len, pool_options)
    cfg = load_config(path)
    if tp != 1:
        if not invariant:
            raise TpError(f"--tp {tp}: tensor parallelism keeps the bits of TP=1 only with the invariant kernels")
        from superfluid.engine.parallel.launch import load_tp

        return load_tp(path, tp, backend=backend, device=dev.type, dtype=dtype, max_seq_len=max_seq_len,
                       **(tp_options or {}), **pool_options)
    if dtype is None:
        dtype = torch.float32 if dev.type == "cpu" else cfg.dtype
    weights = load_weights(path, cfg, dtype=dtype)
    limit = cfg.max_position_embeddings
    if cfg.sliding_window:
        # Within the window, sliding-window attention is full attention: stay there.
        limit = min(limit, cfg.sliding_window)
    n = min(max_seq_len or limit, limit)
    with _allocating(f"the weights and RoPE tables (max_seq_len {n})"):
        model = Model(cfg, weights, get_backend(backend, invariant, dev), device=dev, dtype=dtype, max_seq_len=n)
    tokenizer_json, specials = _tokenizer(path)
    pool = ", ".join(f"{k} {v}" for k, v in pool_options.items() if k in ("kv_cells", "page", "max_batch"))
    with _allocating(f"the KV pool ({pool or 'the defaults'})"):
        return TransformerRuntime(model, specials=specials, tokenizer_json=tokenizer_json, **pool_options)


class AllocationError(RuntimeError):
    """An allocation of load() failed: it names what asked for it."""


@contextlib.contextmanager
def _allocating(what: str):
    """An allocator's failure (torch's RuntimeError, MemoryError) as an AllocationError naming `what`."""
    try:
        yield
    except MemoryError as e:
        raise AllocationError(f"{what}: out of memory ({e or 'MemoryError'})") from None
    except RuntimeError as e:
        if isinstance(e, AllocationError) or not _is_allocation(e):
            raise
        raise AllocationError(f"{what}: {e}") from None


def _is_allocation(e: RuntimeError) -> bool:
    text = str(e)
    return isinstance(e, torch.OutOfMemoryError) or "alloc" in text or "out of memory" in text


def _load_mamba2(path: str, backend: str, dev: torch.device, dtype, invariant: bool, max_seq_len: int | None,
                 options: dict) -> Runtime:
    from pathlib import Path

    from superfluid.engine.mamba2 import Mamba2Config, _load_weights
    from superfluid.engine.mamba2_runtime import Mamba2Runtime
    from superfluid.engine.weights import WeightError

    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if dtype not in (None, torch.float32):
        raise ValueError(f"the Mamba2 runtime computes in float32 only, not {dtype}")
    if not invariant:
        raise ValueError("the Mamba2 runtime has no non-invariant path")
    # A paged runtime's pool options mean nothing to a state pool (sized by state_bytes).
    options = {k: v for k, v in options.items() if k not in ("kv_cells", "page")}
    raw = raw_config(path)
    cfg = Mamba2Config.from_dict(raw)
    weights = _load_weights(Path(path), cfg)
    eos = raw.get("eos_token_id")
    eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    if any(not isinstance(e, int) or not 0 <= e < cfg.vocab_size for e in eos):
        raise WeightError(f"{path}: eos_token_id {raw.get('eos_token_id')!r} is outside the vocabulary")
    tokenizer_json, specials = _tokenizer(path)
    if max_seq_len is not None:
        options["max_seq_len"] = max_seq_len
    sizes = ", ".join(f"{k} {v}" for k, v in options.items() if k in ("state_bytes", "max_seqs", "max_batch"))
    with _allocating(f"the state pool ({sizes or 'the defaults'})"):
        return Mamba2Runtime(cfg, weights, backend=backend, device=dev, eos=eos, specials=specials,
                             tokenizer_json=tokenizer_json, **options)
