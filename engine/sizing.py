"""Whether a checkpoint would load, and what loading it would allocate,
without loading it: the config read and checked, every safetensors header
read and every tensor's name, shape and dtype checked (no tensor data), and
the bytes each allocation of load() would take, each with what sets it.

A daemon checks these against the machine before it starts a worker
(daemon/preflight.py), so that a checkpoint or an option that could never
load is refused once, naming itself, instead of crash-looping workers.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from superfluid.engine.checkpoint import model_type, raw_config
from superfluid.engine.config import ModelConfig, load_config
from superfluid.engine.weights import WeightError, check_weights, num_params

# load()'s options that size an allocation (a daemon names them as its flags).
OPTIONS = frozenset({"kv_cells", "page", "max_batch", "max_seqs", "state_bytes", "max_seq_len"})


@dataclasses.dataclass(frozen=True)
class Need:
    """An allocation loading would make."""

    what: str  # "the weights", "the KV pool", ...
    nbytes: int
    set_by: tuple[tuple[str, object], ...]  # (a load() option of OPTIONS, or what else sizes it; its value)
    on_device: bool  # device memory (a GPU); else host memory

    def describe(self, option_name=lambda k: k) -> str:
        """What sizes it: 'kv_cells 16384, page 16' (option_name renames the options)."""
        return ", ".join(f"{option_name(k) if k in OPTIONS else k} {v}" for k, v in self.set_by)


def model_kind(path: str | os.PathLike) -> str:
    """'mamba2' or 'transformer', from config.json's model_type."""
    return "mamba2" if model_type(os.fspath(path)) == "mamba2" else "transformer"


def plan_load(path: str | os.PathLike, backend: str = "torch", *, device: str | None = None,
              dtype: torch.dtype | str | None = None, invariant: bool = True, max_seq_len: int | None = None,
              tp: int = 1, tp_options: dict | None = None, **pool_options) -> list[Need]:
    """load()'s checks without its work: ConfigError or WeightError naming
    the field, file or tensor that is wrong, TpError a degree the model
    cannot be split into; else what it would allocate (at any degree: the
    ranks of one machine hold the model and its pool between them)."""
    from superfluid.engine.parallel.sharding import Shard, TpError

    path = os.fspath(path)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if model_kind(path) == "mamba2":
        if tp != 1:
            raise TpError(f"--tp {tp}: the Mamba2 runtime runs on one process (tensor parallelism is for "
                          f"Llama-family models)")
        return _plan_mamba2(Path(path), dev, pool_options)
    cfg = load_config(path)
    if tp != 1:
        Shard.plan(cfg, tp)
        if not invariant:
            raise TpError(f"--tp {tp}: tensor parallelism keeps the bits of TP=1 only with the invariant kernels")
    check_weights(path, cfg)
    if dtype is None:
        dtype = torch.float32 if dev.type == "cpu" else cfg.dtype
    needs = _plan_transformer(cfg, backend, invariant, dev, dtype, max_seq_len, pool_options,
                              os.path.join(path, "config.json"), mirrors=tp == 1)
    if tp > cfg.num_kv_heads:  # each rank holds its query heads' KV head: the pool tp / kv_heads times over
        times = tp // cfg.num_kv_heads
        needs = [dataclasses.replace(n, nbytes=n.nbytes * times) if n.what == "the KV pool" else n for n in needs]
    return needs


def _elem(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _plan_transformer(cfg: ModelConfig, backend: str, invariant: bool, dev: torch.device, dtype: torch.dtype,
                      max_seq_len: int | None, opts: dict, source: str, mirrors: bool = True) -> list[Need]:
    from superfluid.engine.transformer import DEFAULT_KV_CELLS, DEFAULT_MAX_BATCH, DEFAULT_PAGE
    from superfluid.kernels.backend import get_backend

    gpu = dev.type != "cpu"
    size = _elem(dtype)
    params = num_params(cfg)
    kv_cells, page = opts.get("kv_cells", DEFAULT_KV_CELLS), opts.get("page", DEFAULT_PAGE)
    max_batch = opts.get("max_batch", DEFAULT_MAX_BATCH)
    # KVPool: ceil(kv_cells / page) blocks and the trash block, K and V.
    blocks = -(-kv_cells // page) + 1
    pool = 2 * cfg.num_layers * blocks * page * cfg.num_kv_heads * cfg.head_dim * size
    be = get_backend(backend, invariant, dev)
    if mirrors and be.dense_kv and be.heads_major_kv:
        pool *= 3  # the dense mirrors take up to twice the pool (TransformerRuntime)
    limit, limit_by = cfg.max_position_embeddings, f"{source}: max_position_embeddings"
    if cfg.sliding_window and cfg.sliding_window < limit:
        limit, limit_by = cfg.sliding_window, f"{source}: sliding_window"
    if max_seq_len and max_seq_len < limit:
        limit, limit_by = max_seq_len, "max_seq_len"
    half = cfg.head_dim // 2
    return [
        # The checkpoint's tensors cast, then laid out for the forward pass (fused, packed): twice, at load.
        Need("the weights, while they load", 2 * params * size, (("the checkpoint's parameters", params),),
             gpu),
        Need("the KV pool", pool, (("kv_cells", kv_cells), ("page", page)), gpu),
        # rope_cos_sin: positions and angles in float64, then cos and sin in float32.
        Need("the RoPE tables", limit * (8 + half * 32), ((limit_by, limit),), gpu),
        Need("a step's logits", 2 * max_batch * cfg.vocab_size * 4, (("max_batch", max_batch),), gpu),
    ]


def _plan_mamba2(path: Path, dev: torch.device, opts: dict) -> list[Need]:
    from superfluid.engine.mamba2 import Mamba2Config, check_weights as check_mamba2
    from superfluid.engine.mamba2_runtime import DEFAULT_SLOTS
    from superfluid.engine.mamba2_state import StatePool
    from superfluid.engine.transformer import DEFAULT_MAX_BATCH
    try:
        raw = raw_config(os.fspath(path))
    except (OSError, ValueError) as e:
        raise WeightError(f"{path}: cannot read config.json ({e})") from None
    cfg = Mamba2Config.from_dict(raw)
    check_mamba2(path, cfg)
    gpu = dev.type != "cpu"
    params = sum(_numel(s) for s in cfg.expected_shapes().values())
    slot = StatePool.slot_bytes(cfg)
    state_bytes, max_seqs = opts.get("state_bytes"), opts.get("max_seqs") or 0
    if state_bytes:
        slots, set_by = max(1, state_bytes // slot), (("state_bytes", state_bytes),)
    else:
        slots, set_by = max_seqs or DEFAULT_SLOTS, (("max_seqs", max_seqs or DEFAULT_SLOTS),)
    max_batch = opts.get("max_batch", DEFAULT_MAX_BATCH)
    return [
        Need("the weights, while they load", 2 * params * 4, (("the checkpoint's parameters", params),), gpu),
        Need("the state pool", slots * slot, set_by, gpu),
        Need("a step's logits", 2 * max_batch * cfg.vocab_size * 4, (("max_batch", max_batch),), gpu),
    ]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
