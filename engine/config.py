"""Model configuration for the Llama family (Llama, Mistral, Qwen2, Qwen3).

`load_config(dir)` reads a Hugging Face `config.json` (+ `generation_config.json`)
into a frozen `ModelConfig` that states everything the forward pass needs,
already resolved per architecture: which projections carry a bias, whether
q/k are normed, the head size, the sliding window of each layer, the rope
parameters. Defaults for absent optional fields are those of the matching
transformers config class, so a checkpoint means the same here as there.

Reading config.json (both transformers generations) is engine/config_json.py's;
what the rope parameters mean is engine/rope_scaling.py's; ConfigError is
engine/checkpoint.py's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from superfluid.engine.checkpoint import ConfigError, is_int, is_num
from superfluid.engine.config_json import (
    ARCHITECTURES,
    DTYPES,
    FULL_ATTENTION,
    GENERATION,
    SLIDING_ATTENTION,
    from_hf_dict,
    read_json,
    supported,
)
from superfluid.engine.rope_scaling import normalize_rope

__all__ = [
    "ModelConfig",
    "load_config",
]


# Far above any model's depth (the deepest have a few hundred layers), far below
# what a per-layer list of this length costs to build.
MAX_LAYERS = 1 << 16


# ------------------------------------------------------------------ the config


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """What the forward pass of a Llama-family model needs, resolved per arch.

    `rope_scaling` is None for plain rope, else a normalized dict with
    "rope_type" ("linear" or "llama3") and that type's parameters.
    `layer_types` holds, per layer, "full_attention" or "sliding_attention"
    (the latter uses `sliding_window`); see `window_of`.
    """

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, Any] | None = dataclasses.field(default=None, hash=False)  # a dict: unhashable
    max_position_embeddings: int = 2048
    sliding_window: int | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v_proj
    o_bias: bool = False  # bias on o_proj
    mlp_bias: bool = False  # bias on gate/up/down_proj
    qk_norm: bool = False  # RMSNorm over head_dim on q and k (Qwen3)
    dtype: torch.dtype = torch.float32
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    layer_types: tuple[str, ...] = ()  # () means sliding_window (if any) on every layer

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ConfigError(f"unsupported architecture {self.arch!r}; supported: {supported()}",
                              field="arch")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            v = getattr(self, name)
            if not is_int(v) or v <= 0:
                raise ConfigError(f"must be a positive integer, got {v!r}", field=name)
        if self.num_layers > MAX_LAYERS:  # before anything is made per layer
            raise ConfigError(f"must be at most {MAX_LAYERS}, got {self.num_layers}", field="num_layers")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads ({self.num_heads}) is not divisible by num_kv_heads "
                              f"({self.num_kv_heads})", field="num_kv_heads")
        if self.head_dim % 2:
            raise ConfigError(f"must be even (rope rotates pairs of dims), got {self.head_dim}",
                              field="head_dim")
        for name in ("rms_norm_eps", "rope_theta"):
            v = getattr(self, name)
            if not (is_num(v) and v > 0 and math.isfinite(v)):
                raise ConfigError(f"must be a positive number, got {v!r}", field=name)
        if self.sliding_window is not None and (not is_int(self.sliding_window) or self.sliding_window <= 0):
            raise ConfigError(f"must be a positive integer or null, got {self.sliding_window!r}",
                              field="sliding_window")
        if self.dtype not in DTYPES.values():
            raise ConfigError(f"unsupported dtype {self.dtype}", field="dtype")
        _check_arch_flags(self)
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        # Out-of-vocabulary ids could never be sampled (and transformers' embedding refuses such a pad).
        for name, ids in (("eos_token_ids", self.eos_token_ids), ("bos_token_id", (self.bos_token_id,)),
                          ("pad_token_id", (self.pad_token_id,))):
            bad = [t for t in ids if t is not None and not (is_int(t) and 0 <= t < self.vocab_size)]
            if bad:
                raise ConfigError(f"token id {bad[0]!r} is outside the vocabulary "
                                  f"(vocab_size {self.vocab_size})", field=name)
        # Normalized here too, so direct construction and from_dict agree.
        rope = normalize_rope(self.rope_scaling, self.max_position_embeddings)
        object.__setattr__(self, "rope_scaling", rope)
        # No layer_types: the window, if any, applies to every layer.
        lt = tuple(self.layer_types) or (
            (FULL_ATTENTION if self.sliding_window is None else SLIDING_ATTENTION,) * self.num_layers)
        if len(lt) != self.num_layers or any(t not in (FULL_ATTENTION, SLIDING_ATTENTION) for t in lt):
            raise ConfigError(f"must list {self.num_layers} of {FULL_ATTENTION!r}/{SLIDING_ATTENTION!r}, "
                              f"got {lt}", field="layer_types")
        if self.sliding_window is None:
            lt = (FULL_ATTENTION,) * self.num_layers  # a sliding layer without a window attends to everything
        object.__setattr__(self, "layer_types", lt)

    # -------------------------------------------------------------- derived

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def kv_groups(self) -> int:
        """Query heads per kv head (GQA)."""
        return self.num_heads // self.num_kv_heads

    def window_of(self, layer: int) -> int | None:
        """The sliding window of `layer`, None for full attention. A window
        w lets position p see keys p-w+1 .. p (transformers' convention)."""
        return self.sliding_window if self.layer_types[layer] == SLIDING_ATTENTION else None

    # -------------------------------------------------------------- dicts

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], generation: Mapping[str, Any] | None = None, *,
                  source: str = "<config dict>", generation_source: str = "<generation config dict>",
                  ) -> ModelConfig:
        """A config from a config.json dict (and a generation_config.json dict,
        whose eos ids are merged after config.json's). Errors name `source`,
        or `generation_source` for a field read from `generation`."""
        try:
            return from_hf_dict(cls, d, generation or {})
        except ConfigError as e:
            where = generation_source if e.source == GENERATION else source
            raise ConfigError(e.reason, field=e.field, source=where) from None

    def to_hf_dict(self) -> dict[str, Any]:
        """A transformers 5 style config.json dict that reads back to this config."""
        eos = list(self.eos_token_ids)
        rope = {"rope_type": "default", "rope_theta": self.rope_theta, **(self.rope_scaling or {})}
        d: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.arch]],
            "model_type": self.arch,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_parameters": rope,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else eos or None,
            "pad_token_id": self.pad_token_id,
            "dtype": _dtype_name(self.dtype),
        }
        if self.arch == "llama":
            d.update(attention_bias=self.attention_bias, mlp_bias=self.mlp_bias)
        elif self.arch == "qwen3":
            d["attention_bias"] = self.attention_bias
        if self.arch == "mistral":
            d["sliding_window"] = self.sliding_window  # written even when None: absent means 4096
        elif self.arch in ("qwen2", "qwen3"):
            sliding = self.sliding_window is not None
            d.update(use_sliding_window=sliding, sliding_window=self.sliding_window,
                     max_window_layers=self.num_layers, layer_types=list(self.layer_types))
        return d

    def generation_dict(self) -> dict[str, Any]:
        """generation_config.json: every eos id, bos and pad."""
        eos = list(self.eos_token_ids)
        return {"bos_token_id": self.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else eos or None,
                "pad_token_id": self.pad_token_id}


def load_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a checkpoint directory (or of a config.json path)."""
    p = Path(path)
    cfg_file = p / "config.json" if p.is_dir() else p
    gen_file = cfg_file.with_name("generation_config.json")
    d = read_json(cfg_file)
    gen = read_json(gen_file) if gen_file.is_file() else {}
    return ModelConfig.from_dict(d, gen, source=str(cfg_file), generation_source=str(gen_file))


# ------------------------------------------------------------------ checks


def _check_arch_flags(c: ModelConfig) -> None:
    """The flags each architecture's transformers modeling code allows: a
    config outside them could not be written as a config.json meaning it."""
    want: dict[str, Any] = {"qk_norm": c.arch == "qwen3"}
    if c.arch in ("llama", "qwen3"):  # one attention_bias flag covers q/k/v and o_proj
        want["o_bias"] = c.attention_bias
    if c.arch == "qwen2":
        want.update(attention_bias=True, o_bias=False)
    if c.arch == "mistral":
        want.update(attention_bias=False, o_bias=False)
    if c.arch != "llama":
        want["mlp_bias"] = False
    if c.arch == "llama" and c.sliding_window is not None:
        want["sliding_window"] = None
    if c.arch == "mistral" and c.layer_types and len(set(c.layer_types)) > 1:
        raise ConfigError("mistral slides every layer or none", field="layer_types")
    for name, v in want.items():
        if getattr(c, name) != v:
            raise ConfigError(f"{c.arch} requires {name}={v!r}, got {getattr(c, name)!r}", field=name)


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")
