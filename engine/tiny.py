"""Tiny checkpoints built locally from a seed: Llama-family and Mamba2.

`write_tiny` writes a directory transformers' AutoModelForCausalLM loads as
is: config.json, generation_config.json, model.safetensors (or shards and an
index) and a byte-level tokenizer. Nothing is downloaded. arch="mamba2"
hands the weights to engine/tiny_mamba2.py and writes the same tokenizer.
`default_model_dir` is the demo's embedded model (llama, or mamba2): written
once into a cache directory, reused.

The weights are random but scaled so activations stay O(1) through the
layers (projections N(0, 1/fan_in), embeddings N(0, 1)): HF's N(0, 0.02)
init gives near-uniform logits, whose near-ties make greedy outputs of two
correct implementations disagree.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from .config import ModelConfig
from .config_json import ARCHITECTURES
from .weights import INDEX_FILE, expected_shapes

__all__ = ["MAMBA2", "SMALL", "SPECIAL_TOKENS", "TINY", "TINY_MAMBA2", "default_model_dir", "tiny_config",
           "tiny_tensors", "write_tiny", "write_tiny_transformer"]

TINY: dict[str, Any] = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                            num_kv_heads=2, max_position_embeddings=512)
# ~58M parameters (32.8M of them embedding + lm_head).
SMALL: dict[str, Any] = dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_layers=8,
                             num_heads=8, num_kv_heads=4, max_position_embeddings=2048)

MAMBA2 = "mamba2"
# write_tiny(arch="mamba2")'s defaults (write_tiny_mamba2's parameters): ~0.1M parameters, a
# sequence's recurrent state 40448 bytes (canonical + live, 2 layers).
TINY_MAMBA2: dict[str, Any] = dict(vocab_size=320, hidden_size=64, state_size=16, num_heads=8, n_groups=1,
                                   num_layers=2, expand=2, conv_kernel=4, chunk_size=16)
MAMBA2_MAX_LEN = 1 << 16  # tokenizer_config's model_max_length: the Mamba2 runtime's default max_seq_len

# After the 256 byte tokens. <|eot|> is an end of turn: an eos only
# generation_config.json lists, as Llama 3 instruct checkpoints do.
SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|eot|>")
_BOS, _EOS, _PAD, _EOT = range(4)

# Bump when what write_tiny writes for given parameters changes: it is part
# of the default model's cache key.
_FORMAT = 1
_DEFAULT_PARAMS: dict[str, dict[str, Any]] = {
    "llama": dict(arch="llama", seed=0, **TINY),
    MAMBA2: dict(arch=MAMBA2, seed=0, **TINY_MAMBA2),
}
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def tiny_config(*, arch: str = "llama", vocab_size: int = TINY["vocab_size"],
                hidden_size: int = TINY["hidden_size"], intermediate_size: int = TINY["intermediate_size"],
                num_layers: int = TINY["num_layers"], num_heads: int = TINY["num_heads"],
                num_kv_heads: int = TINY["num_kv_heads"], head_dim: int | None = None,
                max_position_embeddings: int = TINY["max_position_embeddings"], rope_theta: float = 10000.0,
                rope_scaling: str | Mapping[str, Any] | None = None, sliding_window: int | None = None,
                tie_word_embeddings: bool = False, dtype: str | torch.dtype = "float32",
                **overrides: Any) -> ModelConfig:
    """The ModelConfig write_tiny writes (overrides: other ModelConfig fields,
    e.g. attention_bias=True or mlp_bias=True for llama)."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported arch {arch!r}; supported: {', '.join(ARCHITECTURES)}")
    if vocab_size < len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be >= {len(SPECIAL_TOKENS)} (the special tokens), "
                         f"got {vocab_size}")
    specials = _special_ids(vocab_size)
    if isinstance(rope_scaling, str):
        rope_scaling = _rope_preset(rope_scaling, max_position_embeddings)
    unknown = set(overrides) - {f.name for f in dataclasses.fields(ModelConfig)}
    if unknown:
        raise TypeError(f"unknown ModelConfig fields: {', '.join(sorted(unknown))}")
    attention_bias = overrides.pop("attention_bias", arch == "qwen2")
    fields: dict[str, Any] = dict(
        arch=arch, vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim if head_dim is not None else hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings, rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        sliding_window=sliding_window, tie_word_embeddings=tie_word_embeddings, dtype=_dtype(dtype),
        attention_bias=attention_bias,
        o_bias=attention_bias and arch in ("llama", "qwen3"),  # one flag biases q/k/v and o there
        qk_norm=arch == "qwen3",
        bos_token_id=specials[_BOS], eos_token_ids=(specials[_EOS], specials[_EOT]),
        pad_token_id=specials[_PAD],
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def tiny_tensors(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded weights for every tensor `cfg` implies, by HF name, in cfg.dtype.
    Drawn in float32 in a fixed order, so one seed gives the same values (up
    to rounding) in every dtype."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in expected_shapes(cfg).items():
        noise = torch.randn(shape, generator=g, dtype=torch.float32)
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * noise  # not all ones, so a forward pass that skips a norm weight shows
        elif name.endswith(".bias"):
            t = 0.1 * noise
        elif name == "model.embed_tokens.weight":
            t = noise
        else:  # projections and lm_head: unit-variance outputs from unit-variance inputs
            t = noise / shape[1] ** 0.5
        out[name] = t.to(cfg.dtype).contiguous()
    return out


def write_tiny(path: str | os.PathLike[str], *, arch: str = "llama", seed: int = 0, **params: Any) -> Path:
    """Write a seeded checkpoint into `path` (created; must be empty) and return it.

    arch: a Llama-family one (ARCHITECTURES; params: write_tiny_transformer's)
    or "mamba2" (params: write_tiny_mamba2's, TINY_MAMBA2 by default). Both
    write the same byte-level tokenizer unless tokenizer=False.
    """
    if arch == MAMBA2:
        return _write_mamba2(path, seed=seed, **params)
    return write_tiny_transformer(path, arch=arch, seed=seed, **params)


def write_tiny_transformer(path: str | os.PathLike[str], *, arch: str = "llama", seed: int = 0,
                           vocab_size: int = TINY["vocab_size"], hidden_size: int = TINY["hidden_size"],
                           intermediate_size: int = TINY["intermediate_size"], num_layers: int = TINY["num_layers"],
                           num_heads: int = TINY["num_heads"], num_kv_heads: int = TINY["num_kv_heads"],
                           head_dim: int | None = None,
                           max_position_embeddings: int = TINY["max_position_embeddings"],
                           rope_theta: float = 10000.0, rope_scaling: str | Mapping[str, Any] | None = None,
                           sliding_window: int | None = None, tie_word_embeddings: bool = False,
                           dtype: str | torch.dtype = "float32", shards: int = 1, tokenizer: bool = True,
                           **overrides: Any) -> Path:
    """A Llama-family checkpoint (write_tiny's arch other than mamba2).

    rope_scaling: None, a rope dict ({"rope_type": "llama3", ...}) or the
    presets "llama3" / "linear". sliding_window: every layer's window (mistral,
    qwen2, qwen3). shards > 1 splits the tensors over that many files with a
    model.safetensors.index.json. tokenizer: also write a byte-level
    tokenizer.json (ids 0..255 are the bytes, SPECIAL_TOKENS follow), which
    needs vocab_size >= 260. Special ids: bos 256, eos 257, pad 258; eos ids
    in generation_config.json are (257, 259) — config.json lists only 257.
    With a vocabulary under 260 and no tokenizer they are its last four ids.
    """
    cfg = tiny_config(arch=arch, vocab_size=vocab_size, hidden_size=hidden_size,
                      intermediate_size=intermediate_size, num_layers=num_layers, num_heads=num_heads,
                      num_kv_heads=num_kv_heads, head_dim=head_dim,
                      max_position_embeddings=max_position_embeddings,
                      rope_theta=rope_theta, rope_scaling=rope_scaling, sliding_window=sliding_window,
                      tie_word_embeddings=tie_word_embeddings, dtype=dtype, **overrides)
    _check_tokenizer_vocab(tokenizer, vocab_size)
    hf = cfg.to_hf_dict()
    if ModelConfig.from_dict(hf) != cfg:  # e.g. a layer_types override the arch cannot express
        raise ValueError(f"this {arch} config cannot be written as a config.json meaning the same")
    tensors = tiny_tensors(cfg, seed)
    if not 1 <= shards <= len(tensors):
        raise ValueError(f"shards must be in 1..{len(tensors)}, got {shards}")

    out = _empty_dir(path)
    hf["eos_token_id"] = cfg.eos_token_ids[0] if cfg.eos_token_ids else None  # the rest: generation_config
    _write_json(out / "config.json", hf)
    _write_json(out / "generation_config.json", cfg.generation_dict())
    _write_safetensors(out, tensors, shards)
    if tokenizer:
        _write_tokenizer(out, cfg.max_position_embeddings)
    return out


def _write_mamba2(path: str | os.PathLike[str], *, seed: int, tokenizer: bool = True, **params: Any) -> Path:
    """write_tiny_mamba2 with the transformer tiny model's special ids and
    tokenizer: bos 256, eos 257 and 259 (<|eot|>; both in config.json, the
    one file the Mamba2 loader reads), pad 258 — or, with a vocabulary under
    260 and no tokenizer, its last four ids."""
    from .tiny_mamba2 import write_tiny_mamba2

    params = {**TINY_MAMBA2, **params}
    specials = {"bos_token_id", "eos_token_id", "pad_token_id"} & set(params)
    if specials:
        raise TypeError(f"write_tiny(arch='mamba2') sets the special ids itself: {', '.join(sorted(specials))}")
    vocab_size = params["vocab_size"]
    if vocab_size < len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be >= {len(SPECIAL_TOKENS)} (the special tokens), got {vocab_size}")
    _check_tokenizer_vocab(tokenizer, vocab_size)
    ids = _special_ids(vocab_size)
    out = _empty_dir(path)
    write_tiny_mamba2(out, seed, bos_token_id=ids[_BOS], eos_token_id=[ids[_EOS], ids[_EOT]],
                      pad_token_id=ids[_PAD], **params)
    if tokenizer:
        _write_tokenizer(out, MAMBA2_MAX_LEN)
    return out


def default_model_dir(arch: str = "llama") -> Path:
    """The demo's embedded model: a TINY llama (arch "mamba2": a TINY_MAMBA2
    Mamba2) written once from seed 0 into $SUPERFLUID_CACHE (default
    ~/.cache/superfluid) as tiny-<hash of its parameters>, then reused.
    Written in a temporary directory renamed into place, so a reader never
    sees half a checkpoint and racing writers agree."""
    if arch not in _DEFAULT_PARAMS:
        raise ValueError(f"no embedded {arch!r} model; embedded: {', '.join(_DEFAULT_PARAMS)}")
    params = _DEFAULT_PARAMS[arch]
    key = json.dumps({"format": _FORMAT, **params}, sort_keys=True)
    root = Path(os.environ.get("SUPERFLUID_CACHE") or Path.home() / ".cache" / "superfluid")
    final = root / f"tiny-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=root))
    try:
        write_tiny(tmp, **params)
        try:
            tmp.rename(final)
        except OSError:
            if not final.is_dir():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# ------------------------------------------------------------------ helpers


def _special_ids(vocab_size: int) -> list[int]:
    n = len(SPECIAL_TOKENS)
    first = 256 if vocab_size >= 256 + n else vocab_size - n
    return list(range(first, first + n))


def _check_tokenizer_vocab(tokenizer: bool, vocab_size: int) -> None:
    if tokenizer and vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"a byte-level tokenizer needs vocab_size >= {256 + len(SPECIAL_TOKENS)}, "
                         f"got {vocab_size}")


def _empty_dir(path: str | os.PathLike[str]) -> Path:
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise FileExistsError(f"{out}: not empty")
    return out


def _rope_preset(name: str, max_pos: int) -> dict[str, Any]:
    if name == "linear":
        return {"rope_type": "linear", "factor": 2.0}
    if name == "llama3":
        # Llama 3.1's factors; a pretraining length of max_pos/4 puts the head
        # dims of a tiny model in all three bands (kept, interpolated, scaled).
        return {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": max(1, max_pos // 4)}
    raise ValueError(f"unknown rope_scaling preset {name!r}; use 'llama3', 'linear' or a dict")


def _dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def _write_json(p: Path, obj: Any) -> None:
    p.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_safetensors(out: Path, tensors: dict[str, torch.Tensor], shards: int) -> None:
    meta = {"format": "pt"}  # transformers expects it
    if shards == 1:
        save_file(tensors, out / "model.safetensors", metadata=meta)
        return
    names = list(tensors)
    weight_map: dict[str, str] = {}
    for k in range(shards):  # contiguous runs of nearly equal tensor counts
        part = names[k * len(names) // shards:(k + 1) * len(names) // shards]
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, out / fname, metadata=meta)
        weight_map |= dict.fromkeys(part, fname)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    _write_json(out / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which the ByteLevel
    pre-tokenizer and decoder of `tokenizers` use."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def _write_tokenizer(out: Path, model_max_length: int) -> None:
    # A BPE with no merges over the byte alphabet: token id == byte value.
    # Written as JSON so writing needs no `tokenizers` install.
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    b2u = _bytes_to_unicode()
    tok: dict[str, Any] = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": 256 + i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i, s in enumerate(SPECIAL_TOKENS)],
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": None,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": {b2u[b]: b for b in range(256)}, "merges": []},
    }
    _write_json(out / "tokenizer.json", tok)
    # Lets transformers' AutoTokenizer load the directory too.
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[_BOS], "eos_token": SPECIAL_TOKENS[_EOS],
        "pad_token": SPECIAL_TOKENS[_PAD],
        "model_max_length": model_max_length, "clean_up_tokenization_spaces": False,
    })
