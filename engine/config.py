"""Model configuration for the Llama family (Llama, Mistral, Qwen2, Qwen3).

`load_config(dir)` reads a Hugging Face `config.json` (+ `generation_config.json`)
into a frozen `ModelConfig` that states everything the forward pass needs,
already resolved per architecture: which projections carry a bias, whether
q/k are normed, the head size, the sliding window of each layer, the rope
parameters. Defaults for absent optional fields are those of the matching
transformers config class, so a checkpoint means the same here as there.

Both config.json generations are read: transformers 4 writes `rope_theta` at
the top level with `rope_scaling: {"type" | "rope_type": ...}` and
`torch_dtype`; transformers 5 writes `rope_parameters: {"rope_type",
"rope_theta", ...}` and `dtype`. What the rope parameters mean is
engine/rope_scaling.py's; ConfigError is engine/checkpoint.py's.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from superfluid.engine.checkpoint import ConfigError, NotRegular, is_int, is_num, read_text
from superfluid.engine.rope_scaling import normalize_rope, rope_params

__all__ = [
    "ARCHITECTURES",
    "ModelConfig",
    "load_config",
]

# model_type -> the transformers class name written in "architectures"
ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

# Per-architecture defaults of the transformers 5 config classes, for fields a
# config.json may leave out (e.g. Mistral's sliding_window is 4096 when absent).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, sliding_window=None),
    "mistral": dict(max_position_embeddings=4096 * 32, bos_token_id=1, eos_token_id=2, sliding_window=4096),
    "qwen2": dict(max_position_embeddings=32768, bos_token_id=None, eos_token_id=None, sliding_window=4096),
    "qwen3": dict(max_position_embeddings=32768, bos_token_id=None, eos_token_id=None, sliding_window=4096),
}
_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}
_GENERATION = "\0generation"  # marks an error in a generation_config.json field
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


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
            raise ConfigError(f"unsupported architecture {self.arch!r}; supported: {_supported()}",
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
        if self.dtype not in _DTYPES.values():
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
            return _from_dict(cls, d, generation or {})
        except ConfigError as e:
            where = generation_source if e.source == _GENERATION else source
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
    d = _read_json(cfg_file)
    gen = _read_json(gen_file) if gen_file.is_file() else {}
    return ModelConfig.from_dict(d, gen, source=str(cfg_file), generation_source=str(gen_file))


# ------------------------------------------------------------------ parsing


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



def _supported() -> str:
    return ", ".join(f"{m} ({c})" for m, c in ARCHITECTURES.items())


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        d = json.loads(read_text(path))
    except FileNotFoundError:
        raise ConfigError("file not found", source=str(path)) from None
    except NotRegular:
        raise ConfigError("not a regular file (a FIFO, a device or a directory)", source=str(path)) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"not valid JSON ({e})", source=str(path)) from None
    if not isinstance(d, dict):
        raise ConfigError("must hold a JSON object", source=str(path))
    return d


def _arch_of(d: Mapping[str, Any]) -> str:
    mt = d.get("model_type")
    archs = d.get("architectures")
    if archs is not None:
        if not isinstance(archs, list) or not archs:
            raise ConfigError(f"must be a non-empty list, got {archs!r}", field="architectures")
        by_class = {c: m for m, c in ARCHITECTURES.items()}
        if archs[0] not in by_class:
            raise ConfigError(f"unsupported architecture {archs[0]!r}; supported: {_supported()}",
                              field="architectures")
        if mt is not None and mt != by_class[archs[0]]:
            raise ConfigError(f"model_type {mt!r} disagrees with architectures[0] {archs[0]!r}",
                              field="model_type")
        return by_class[archs[0]]
    if mt is None:
        raise ConfigError(f"missing: neither model_type nor architectures is set; supported: {_supported()}",
                          field="model_type")
    if mt not in ARCHITECTURES:
        raise ConfigError(f"unsupported model_type {mt!r}; supported: {_supported()}", field="model_type")
    return str(mt)


def _get(d: Mapping[str, Any], key: str, kind: str, default: Any = ..., *, nullable: bool = False) -> Any:
    if key not in d or (d[key] is None and not nullable and default is not ...):
        if default is ...:
            raise ConfigError("missing required field", field=key)
        return default
    v = d[key]
    if v is None and nullable:
        return None
    ok: dict[str, Callable[[Any], bool]] = {"int": is_int, "num": is_num,
                                            "bool": lambda x: isinstance(x, bool),
                                            "str": lambda x: isinstance(x, str)}
    if not ok[kind](v):
        want = {"int": "an integer", "num": "a number", "bool": "true or false", "str": "a string"}[kind]
        raise ConfigError(f"must be {want}, got {v!r}", field=key)
    return v


def _token_ids(v: Any, field: str) -> list[int]:
    if v is None:
        return []
    vs = v if isinstance(v, list) else [v]
    if not all(is_int(x) and x >= 0 for x in vs):
        raise ConfigError(f"must be a token id or a list of them, got {v!r}", field=field)
    return vs


def _parse_dtype(d: Mapping[str, Any]) -> torch.dtype:
    key = "dtype" if d.get("dtype") is not None else "torch_dtype"
    v = d.get(key)
    if v is None or v == "auto":
        return torch.float32
    name = str(v).removeprefix("torch.")
    if name not in _DTYPES:
        raise ConfigError(f"unsupported dtype {v!r}; supported: float32, float16, bfloat16", field=key)
    return _DTYPES[name]


def _from_dict(cls: type[ModelConfig], d: Mapping[str, Any], gen: Mapping[str, Any]) -> ModelConfig:
    arch = _arch_of(d)
    defaults = _DEFAULTS[arch]
    act = _get(d, "hidden_act", "str", "silu")
    if act not in ("silu", "swish"):  # transformers maps both to SiLU
        raise ConfigError(f"unsupported activation {act!r}; only 'silu' is supported", field="hidden_act")

    hidden = _get(d, "hidden_size", "int")
    heads = _get(d, "num_attention_heads", "int")
    kv_heads = _get(d, "num_key_value_heads", "int", heads)
    if is_int(heads) and is_int(kv_heads) and kv_heads > 0 and heads % kv_heads:
        raise ConfigError(f"num_attention_heads ({heads}) is not divisible by num_key_value_heads "
                          f"({kv_heads})", field="num_key_value_heads")
    # Qwen3Config's head_dim defaults to 128; the others derive it from the width.
    head_dim = _get(d, "head_dim", "int", 128 if arch == "qwen3" else (hidden // heads if heads > 0 else 0))
    num_layers = _get(d, "num_hidden_layers", "int")
    max_pos = _get(d, "max_position_embeddings", "int", defaults["max_position_embeddings"])
    theta, scaling = rope_params(d, max_pos)

    attention_bias = _get(d, "attention_bias", "bool", False)
    mlp_bias = _get(d, "mlp_bias", "bool", False)
    if arch == "llama":  # LlamaAttention: attention_bias on q, k, v and o
        qkv_bias, o_bias = attention_bias, attention_bias
    elif arch == "qwen3":
        qkv_bias, o_bias, mlp_bias = attention_bias, attention_bias, False
    elif arch == "qwen2":  # Qwen2Attention hard-codes bias=True on q/k/v only
        qkv_bias, o_bias, mlp_bias = True, False, False
    else:  # MistralAttention: no biases at all
        qkv_bias, o_bias, mlp_bias = False, False, False

    window = _get(d, "sliding_window", "int", defaults["sliding_window"], nullable=True)
    layer_types: tuple[str, ...] = ()
    if arch == "llama":
        window = None
    elif arch == "mistral":  # MistralModel slides every layer when a window is set
        layer_types = (SLIDING_ATTENTION if window is not None else FULL_ATTENTION,) * num_layers
    else:  # Qwen2/3: the window only with use_sliding_window, on layers >= max_window_layers
        if not _get(d, "use_sliding_window", "bool", False):
            window = None
        lt = d.get("layer_types")
        if lt is not None:
            if not isinstance(lt, list):
                raise ConfigError(f"must be a list, got {lt!r}", field="layer_types")
            layer_types = tuple(lt)
        else:
            mwl = _get(d, "max_window_layers", "int", 28)
            layer_types = tuple(SLIDING_ATTENTION if window is not None and i >= mwl else FULL_ATTENTION
                                for i in range(num_layers))

    vocab = _get(d, "vocab_size", "int")
    if vocab <= 0:
        raise ConfigError(f"must be a positive integer, got {vocab!r}", field="vocab_size")

    def ids_of(src: Mapping[str, Any], key: str, default: Any = None) -> list[int]:
        try:
            ids = _token_ids(src.get(key, default), key)
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise ConfigError(f"token id {bad[0]} is outside the vocabulary (vocab_size {vocab})",
                                  field=key)
            return ids
        except ConfigError as e:
            raise ConfigError(e.reason, field=e.field, source=_GENERATION if src is gen else None) from None

    eos: list[int] = []
    for t in ids_of(d, "eos_token_id", defaults["eos_token_id"]) + ids_of(gen, "eos_token_id"):
        if t not in eos:
            eos.append(t)

    def special(key: str, default: int | None) -> int | None:
        ids = ids_of(d, key, default) or ids_of(gen, key)  # config.json's null falls back
        return ids[0] if ids else None

    return cls(
        arch=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=_get(d, "intermediate_size", "int"),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(_get(d, "rms_norm_eps", "num", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=max_pos,
        sliding_window=window,
        tie_word_embeddings=_get(d, "tie_word_embeddings", "bool", False),
        attention_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=mlp_bias,
        qk_norm=arch == "qwen3",
        dtype=_parse_dtype(d),
        eos_token_ids=tuple(eos),
        bos_token_id=special("bos_token_id", defaults["bos_token_id"]),
        pad_token_id=special("pad_token_id", None),
        layer_types=layer_types,
    )
