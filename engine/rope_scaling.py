"""RoPE scaling: a config.json's rope parameters normalized, and the inverse
frequencies and cos/sin tables they give (kernels/rope.py applies them).

Types: plain rope, "linear" (every frequency divided by `factor`) and
"llama3" (Llama 3.1's: long wavelengths slowed by `factor`, short ones kept,
the band between interpolated).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from superfluid.engine.checkpoint import ConfigError, is_num

if TYPE_CHECKING:
    from superfluid.engine.config import ModelConfig

ROPE_TYPES = ("default", "llama3", "linear")


def rope_params(d: Mapping[str, Any], max_pos: int) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, normalized scaling) with transformers' precedence: a truthy
    rope_scaling replaces rope_parameters; rope_theta inside the dict beats
    the top-level one, which beats 10000."""
    field = "rope_scaling" if d.get("rope_scaling") else "rope_parameters"
    rp = d.get(field)
    if rp is not None and not isinstance(rp, Mapping):
        raise ConfigError(f"must be an object, got {rp!r}", field=field)
    rp = dict(rp or {})
    if any(isinstance(v, Mapping) for v in rp.values()):
        raise ConfigError("per-layer-type rope parameters are not supported", field=field)
    theta = rp.pop("rope_theta", None)
    if theta is None:
        theta = d.get("rope_theta")
    if theta is None:
        theta = 10000.0
    if not is_num(theta):
        raise ConfigError(f"must be a number, got {theta!r}", field="rope_theta")
    prf = rp.pop("partial_rotary_factor", d.get("partial_rotary_factor"))
    if prf is not None and prf != 1.0:
        raise ConfigError(f"partial rotary embeddings are not supported (got {prf!r})",
                          field="partial_rotary_factor")
    try:
        return float(theta), normalize_rope(rp, max_pos)
    except ConfigError as e:
        raise ConfigError(e.reason, field=field) from None


def normalize_rope(rp: Mapping[str, Any] | None, max_pos: int) -> dict[str, Any] | None:
    """None for plain rope, else {"rope_type", <that type's parameters>}.
    Accepts "rope_type" (transformers >= 4.45) or the older "type"."""
    if not rp:
        return None
    rp = dict(rp)
    rtype = rp.get("rope_type", rp.get("type", "default"))
    if rtype not in ROPE_TYPES:
        supported = ", ".join(map(repr, ROPE_TYPES))
        raise ConfigError(f"unsupported rope type {rtype!r}; supported: None, {supported}",
                          field="rope_scaling")
    if rtype == "default":
        return None

    def num(key: str, default: Any = ...) -> float:
        v = rp.get(key, default)
        if v is ...:
            raise ConfigError(f"{rtype} rope needs {key!r}", field="rope_scaling")
        if not is_num(v) or not math.isfinite(v):
            raise ConfigError(f"{rtype} rope {key!r} must be a number, got {v!r}", field="rope_scaling")
        return float(v)

    factor = float(num("factor"))
    if factor <= 0:
        raise ConfigError(f"{rtype} rope factor must be > 0, got {factor}", field="rope_scaling")
    if rtype == "linear":
        return {"rope_type": "linear", "factor": factor}
    low, high = float(num("low_freq_factor")), float(num("high_freq_factor"))
    # transformers falls back to max_position_embeddings for the pretraining length
    old_ctx = num("original_max_position_embeddings", max_pos)
    if not (0 < low < high) or old_ctx <= 0 or old_ctx != int(old_ctx):
        raise ConfigError(f"llama3 rope needs 0 < low_freq_factor < high_freq_factor and an integer "
                          f"original_max_position_embeddings > 0, got {low}, {high}, {old_ctx}",
                          field="rope_scaling")
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
            "original_max_position_embeddings": int(old_ctx)}


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """The rope inverse frequencies (float32, head_dim/2), scaling applied.

    Computed in float64 and rounded once, so each frequency is the correctly
    rounded value, the same on every machine (float32 `pow` kernels differ in
    the last bits between CPU and GPU). transformers computes in float32; the
    two agree within 1e-7 (a few ulp; every frequency is <= 1)."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    rs = cfg.rope_scaling
    if rs is None:
        pass
    elif rs["rope_type"] == "linear":
        inv = inv / rs["factor"]
    elif rs["rope_type"] == "llama3":
        # Llama 3.1: long wavelengths slow down by `factor`, short ones stay,
        # the band between is interpolated (transformers _compute_llama3_parameters).
        factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old_ctx = rs["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    else:  # unreachable: normalize_rope admits only ROPE_TYPES
        raise ConfigError(f"unsupported rope type {rs['rope_type']!r}", field="rope_scaling")
    return inv.to(torch.float32)


def rope_cos_sin(cfg: ModelConfig, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position * inv_freq for positions 0..max_len-1, each
    float32 [max_len, head_dim/2] (half the head: rotate-half applies each
    column to dims j and j + head_dim/2).

    The angles are taken in float64 from the float32 frequencies: in float32,
    position * freq loses up to half an ulp of the angle (~2e-3 rad at
    position 32k); this way every entry is the correctly rounded cos/sin of
    the exact angle, at any position."""
    if max_len < 0:
        raise ValueError(f"max_len must be >= 0, got {max_len}")
    pos = torch.arange(max_len, dtype=torch.float64)
    angles = torch.outer(pos, rope_inv_freq(cfg).to(torch.float64))
    return angles.cos().to(torch.float32), angles.sin().to(torch.float32)
