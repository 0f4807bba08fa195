"""The counter-based generator behind every draw (contract §5).

A draw's uniform is a pure function of its position: u = splitmix64(position)
>> 11, scaled by 2^-53 into [0, 1). There is no key beyond the position; the
planner gives each lane its own stream through `rng_counter_base`.

Three implementations that agree bit for bit: pure Python ints (the
definition), numpy uint64 (the host sampler, vectorized) and torch int64 (the
device sampler; torch has no full uint64 arithmetic, so it works in two's
complement, where wrapping add and multiply give the same low 64 bits).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch


MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
TWO_NEG_53 = 2.0**-53


def splitmix64(x: int) -> int:
    """The splitmix64 output for state `x` (the state advanced by GOLDEN, then mixed)."""
    z = (x + GOLDEN) & MASK64
    z = ((z ^ (z >> 30)) * MIX1) & MASK64
    z = ((z ^ (z >> 27)) * MIX2) & MASK64
    return z ^ (z >> 31)


def uniform(position: int) -> float:
    """The uniform in [0, 1) for a draw at `position` (taken mod 2^64)."""
    return (splitmix64(position & MASK64) >> 11) * TWO_NEG_53


def uniform_np(positions: np.ndarray) -> np.ndarray:
    """uniform() over an array of positions (any integer dtype; cast to uint64 mod 2^64)."""
    z = np.asarray(positions).astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps, which is the point
        z += np.uint64(GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(MIX1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(MIX2)
    z ^= z >> np.uint64(31)
    # (z >> 11) < 2^53 converts to float64 exactly; the scale is a power of two.
    return (z >> np.uint64(11)).astype(np.float64) * TWO_NEG_53


def _as_int64(c: int) -> int:
    """A u64 constant as the int64 with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


def position_to_int64(position: int) -> int:
    """A u64 position as the int64 torch holds it (same bits)."""
    return _as_int64(position & MASK64)


def _srl(z: torch.Tensor, s: int) -> torch.Tensor:
    # torch's >> on int64 is arithmetic; masking off the copied sign bits makes it logical.
    return (z >> s) & ((1 << (64 - s)) - 1)


def uniform_torch(positions: torch.Tensor) -> torch.Tensor:
    """uniform() over an int64 tensor of positions (u64 values in two's complement), on its device."""
    import torch  # here, not at the top: the host sampler (and a fake worker) needs no torch
    z = positions.to(torch.int64) + _as_int64(GOLDEN)
    z = (z ^ _srl(z, 30)) * _as_int64(MIX1)
    z = (z ^ _srl(z, 27)) * _as_int64(MIX2)
    z = z ^ _srl(z, 31)
    return _srl(z, 11).to(torch.float64) * TWO_NEG_53
