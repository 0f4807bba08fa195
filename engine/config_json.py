"""What a transformers config.json says, read: the architectures it may name,
their defaults for the fields it leaves out, its dtype names, and its fields
resolved into ModelConfig's (engine/config.py).

Both generations are read: transformers 4 writes `rope_theta` at the top
level with `rope_scaling: {"type" | "rope_type": ...}` and `torch_dtype`;
transformers 5 writes `rope_parameters: {"rope_type", "rope_theta", ...}` and
`dtype`. Errors are ConfigErrors naming the field; one read from
generation_config.json carries GENERATION as its source.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from superfluid.engine.checkpoint import ConfigError, NotRegular, is_int, is_num, read_text
from superfluid.engine.rope_scaling import rope_params

if TYPE_CHECKING:
    from superfluid.engine.config import ModelConfig

# model_type -> the transformers class name written in "architectures"
ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

# Per-architecture defaults of the transformers 5 config classes, for fields a
# config.json may leave out (e.g. Mistral's sliding_window is 4096 when absent).
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, sliding_window=None),
    "mistral": dict(max_position_embeddings=4096 * 32, bos_token_id=1, eos_token_id=2, sliding_window=4096),
    "qwen2": dict(max_position_embeddings=32768, bos_token_id=None, eos_token_id=None, sliding_window=4096),
    "qwen3": dict(max_position_embeddings=32768, bos_token_id=None, eos_token_id=None, sliding_window=4096),
}
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}
GENERATION = "\0generation"  # marks an error in a generation_config.json field
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


def supported() -> str:
    return ", ".join(f"{m} ({c})" for m, c in ARCHITECTURES.items())


def read_json(path: Path) -> dict[str, Any]:
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
            raise ConfigError(f"unsupported architecture {archs[0]!r}; supported: {supported()}",
                              field="architectures")
        if mt is not None and mt != by_class[archs[0]]:
            raise ConfigError(f"model_type {mt!r} disagrees with architectures[0] {archs[0]!r}",
                              field="model_type")
        return by_class[archs[0]]
    if mt is None:
        raise ConfigError(f"missing: neither model_type nor architectures is set; supported: {supported()}",
                          field="model_type")
    if mt not in ARCHITECTURES:
        raise ConfigError(f"unsupported model_type {mt!r}; supported: {supported()}", field="model_type")
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
    if name not in DTYPES:
        raise ConfigError(f"unsupported dtype {v!r}; supported: float32, float16, bfloat16", field=key)
    return DTYPES[name]


def from_hf_dict(cls: type[ModelConfig], d: Mapping[str, Any], gen: Mapping[str, Any]) -> ModelConfig:
    arch = _arch_of(d)
    defaults = DEFAULTS[arch]
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
            raise ConfigError(e.reason, field=e.field, source=GENERATION if src is gen else None) from None

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
