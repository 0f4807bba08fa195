"""Loading a Llama-family checkpoint's safetensors into a flat dict of tensors.

Names are the Hugging Face ones (`model.layers.{i}.self_attn.q_proj.weight`,
...). Everything the config implies must be there with the right shape and
nothing else may be (but buffers older exports carry, such as rotary
`inv_freq`): a checkpoint that disagrees with its config is refused before
any tensor is read, with a message naming the tensor.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from .checkpoint import NotRegular, read_text, regular_file
from .config import ModelConfig

if TYPE_CHECKING:
    from .parallel.sharding import Shard

__all__ = ["INDEX_FILE", "WeightError", "check_weights", "expected_shapes", "load_weights", "num_params"]

INDEX_FILE = "model.safetensors.index.json"
# Non-persistent buffers some exports saved anyway; they are derived from the config.
_HARMLESS = re.compile(r"(model\.)?(layers\.\d+\.self_attn\.)?rotary_emb\.(inv_freq|original_inv_freq)")


class WeightError(ValueError):
    """A checkpoint that does not match its config (or cannot be read)."""


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the config implies, by HF name, in the order of
    transformers' state_dict (embedding, layers, final norm, lm_head). lm_head.weight is listed only
    when untied: a tied checkpoint does not store it."""
    h, q, kv, inter, hd = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    proj = {"q": (q, h), "k": (kv, h), "v": (kv, h), "o": (h, q)}
    mlp = {"gate": (inter, h), "up": (inter, h), "down": (h, inter)}
    for i in range(cfg.num_layers):  # the order of transformers' state_dict
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        for p, shape in proj.items():
            shapes[f"{a}{p}_proj.weight"] = shape
            if cfg.o_bias if p == "o" else cfg.attention_bias:
                shapes[f"{a}{p}_proj.bias"] = shape[:1]
        if cfg.qk_norm:
            shapes |= {a + "q_norm.weight": (hd,), a + "k_norm.weight": (hd,)}
        for p, shape in mlp.items():
            shapes[f"{m}{p}_proj.weight"] = shape
            if cfg.mlp_bias:
                shapes[f"{m}{p}_proj.bias"] = shape[:1]
        shapes |= {f"model.layers.{i}.input_layernorm.weight": (h,),
                   f"model.layers.{i}.post_attention_layernorm.weight": (h,)}
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def num_params(cfg: ModelConfig) -> int:
    """Parameters the checkpoint stores (a tied lm_head counted once)."""
    total = 0
    for shape in expected_shapes(cfg).values():
        n = 1
        for s in shape:
            n *= s
        total += n
    return total


def check_weights(path: str | Path, cfg: ModelConfig) -> dict[str, Path]:
    """Every tensor `cfg` implies, by name, and the file holding it: each
    file's header read and each tensor's name, shape and dtype checked, no
    tensor data read. WeightError names the file and tensor that disagree."""
    d = Path(path)
    if not d.is_dir():
        raise WeightError(f"{d}: not a checkpoint directory")
    files = _tensor_files(d)  # name -> file holding it
    if cfg.num_layers > len(files):  # before a list of every layer's tensors is made
        raise WeightError(f"{d}: the config's num_hidden_layers {cfg.num_layers} is more than the "
                          f"{len(files)} tensors the checkpoint holds")
    expected = expected_shapes(cfg)
    found = set(files)
    to_read = dict(expected)
    if cfg.tie_word_embeddings and "lm_head.weight" in found:
        # Some exports store the tied head too. transformers 5 then ties only
        # when it equals the embedding and otherwise serves the stored one;
        # so do we (the forward pass reads "lm_head.weight" either way).
        to_read["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    missing = [n for n in expected if n not in found]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise WeightError(f"{d}: missing tensor {missing[0]!r}{more}")
    unexpected = sorted(n for n in found if n not in to_read and not _HARMLESS.fullmatch(n))
    if unexpected:
        raise WeightError(f"{d}: unexpected tensor{'s' if len(unexpected) > 1 else ''} "
                          f"{', '.join(map(repr, unexpected[:8]))}{', ...' if len(unexpected) > 8 else ''} "
                          f"(not implied by the {cfg.arch} config)")

    check_headers({name: (files[name], name) for name in to_read}, to_read)
    return {name: files[name] for name in to_read}


def check_headers(where: dict[str, tuple[Path, str]], shapes: dict[str, tuple[int, ...]]) -> None:
    """Each tensor (our name -> (file, its name in the file)) has the shape
    `shapes` says and a float dtype, read from the headers alone."""
    by_file: dict[Path, list[str]] = {}
    for name, (file, _) in where.items():
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in names:
                    view = f.get_slice(where[name][1])
                    shape, dtype = tuple(view.get_shape()), view.get_dtype()
                    if shape != shapes[name]:
                        raise WeightError(f"{file}: tensor {name!r} has shape {shape}, "
                                          f"the config implies {shapes[name]}")
                    if dtype not in FLOAT_DTYPES:
                        raise WeightError(f"{file}: tensor {name!r} has dtype {_dtype_name(dtype)}, "
                                          f"not a float type")
        except WeightError:
            raise
        except OSError as e:  # not the checkpoint's fault: a restart may find it readable
            raise OSError(e.errno, f"{file}: {e.strerror}") from None
        except Exception as e:  # safetensors raises its own types for bad headers
            raise WeightError(f"{file}: not a readable safetensors file ({e})") from None


# safetensors' header dtypes that are floating point.
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})


def _dtype_name(dtype: str) -> str:
    """A header dtype as torch names it: I32 -> int32, U8 -> uint8, BOOL -> bool."""
    kinds = {"I": "int", "U": "uint", "F": "float"}
    if dtype[:1] in kinds and dtype[1:].isdigit():
        return kinds[dtype[0]] + dtype[1:]
    return dtype.lower()


def load_weights(path: str | Path, cfg: ModelConfig, dtype: torch.dtype | None = None,
                 shard: Shard | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors by HF name, checked against `cfg` (check_weights:
    a mismatch is refused before any data is read) and cast to `dtype`
    (default cfg.dtype). Sharded checkpoints are read through
    model.safetensors.index.json when present, else every *.safetensors in
    the directory. With tied embeddings "lm_head.weight" is the very tensor
    of "model.embed_tokens.weight" (unless the checkpoint also stores a
    different head, which transformers 5 then serves untied). With `shard`,
    only a tensor-parallel rank's rows or columns of each are read."""
    dtype = cfg.dtype if dtype is None else dtype
    files = check_weights(path, cfg)
    by_file: dict[Path, list[str]] = {}
    for name, file in files.items():
        by_file.setdefault(file, []).append(name)
    out: dict[str, torch.Tensor] = {}
    for file, names in by_file.items():
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in names:
                    cut = shard.rows_of(name, cfg) if shard is not None else None
                    if cut is None:
                        out[name] = f.get_tensor(name).to(dtype)
                    else:  # only this rank's slice is read
                        view, (axis, r) = f.get_slice(name), cut
                        t = view[r.start:r.stop] if axis == "rows" else view[:, r.start:r.stop]
                        out[name] = t.to(dtype).contiguous()
        except OSError as e:
            raise WeightError(f"{file}: cannot read ({e})") from None
    ordered = {n: out[n] for n in expected_shapes(cfg)}  # one order, whatever the shard layout
    if cfg.tie_word_embeddings:
        head = out.get("lm_head.weight")
        embed = ordered["model.embed_tokens.weight"]
        ordered["lm_head.weight"] = head if head is not None and not torch.equal(head, embed) else embed
    return ordered


def _tensor_files(d: Path) -> dict[str, Path]:
    """Tensor name -> the file that holds it, every listed file checked."""
    index = d / INDEX_FILE
    files: dict[str, Path] = {}
    if index.is_file():
        try:
            weight_map = json.loads(read_text(index))["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (ValueError, KeyError, TypeError) as e:
            raise WeightError(f"{index}: not a safetensors index ({e!r})") from None
        shards = sorted(set(weight_map.values()))
        lost = [s for s in shards if not (d / s).is_file()]
        if lost:
            raise WeightError(f"{index}: missing shard file{'s' if len(lost) > 1 else ''} {', '.join(lost)}")
        keys = {s: _keys(d / s) for s in shards}
        for name, shard in weight_map.items():
            if name not in keys[shard]:
                raise WeightError(f"{index}: tensor {name!r} is listed in {shard} but that file lacks it")
            files[name] = d / shard
        for shard, ks in keys.items():
            extra = sorted(ks - weight_map.keys())
            if extra:
                raise WeightError(f"{d / shard}: unexpected tensor {extra[0]!r}, not listed in {INDEX_FILE}")
        return files
    paths = sorted(d.glob("*.safetensors"))
    if not paths:
        raise WeightError(f"{d}: no *.safetensors file (and no {INDEX_FILE})")
    for p in paths:
        for name in _keys(p):
            if name in files:
                raise WeightError(f"{d}: tensor {name!r} is in both {files[name].name} and {p.name}")
            files[name] = p
    return files


def _keys(p: Path) -> set[str]:
    try:
        regular_file(p)  # safetensors would wait on a FIFO for ever
    except NotRegular as e:
        raise WeightError(str(e)) from None
    except OSError as e:
        raise OSError(e.errno, f"{p}: {e.strerror}") from None
    try:
        with safe_open(p, framework="pt", device="cpu") as f:
            return set(f.keys())
    except OSError as e:  # not the checkpoint's fault: a restart may find it readable
        raise OSError(e.errno, f"{p}: {e.strerror}") from None
    except Exception as e:  # safetensors raises its own error types for bad headers
        raise WeightError(f"{p}: not a readable safetensors file ({e})") from None
