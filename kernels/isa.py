"""Which path the CPU kernels run (kernels/sf_pool.c picks the best the CPU
and OS allow, from cpuid and XCR0) and which numeric class bf16 weights are
packed in. One choice per process: SUPERFLUID_ISA forces a lower path,
SUPERFLUID_BF16_CLASS pins the class (docs/engine.md, "ISA paths and
numeric classes")."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

try:
    from superfluid.kernels._cpu import lib
except ImportError:  # pragma: no cover - a build without the extension
    lib = None

if TYPE_CHECKING:
    import torch  # (imported where used: serve's checks read this module without a model)

# The kernels' paths, lowest first (sf_cpu.h's SF_ISA_*).
ISA_NAMES = {0: "scalar", 1: "avx2", 2: "avx512", 3: "avx512-bf16", 4: "amx-bf16"}
ISA_LEVELS = {name: level for level, name in ISA_NAMES.items()}
# What the CPU offers (SF_FEAT_*), whether a kernel uses it or not.
FEATURE_NAMES = {1: "avx2+fma", 2: "avx512f/dq/bw/vl", 4: "avx512-bf16", 8: "amx-bf16", 16: "amx-permitted",
                 32: "amx-verified", 64: "avx512-bf16-differs", 128: "amx-emulated"}
# The bf16 numeric classes (bf16_class); float32 weights have one, "fp32".
BF16_CLASSES = ("bf16-fma", "bf16-dot", "bf16-amx")
WTYPES = {"fp32": 0, "bf16-fma": 1, "bf16-dot": 2, "bf16-amx": 3}  # sf_linear's wtype
ISA_ENV, BF16_ENV = "SUPERFLUID_ISA", "SUPERFLUID_BF16_CLASS"


def isa() -> str:
    """The path the kernels run on here, now."""
    return ISA_NAMES[lib.sf_cpu_isa()] if lib is not None else "unavailable"


def best_isa() -> str:
    """The highest path this CPU (and its OS) allows."""
    return ISA_NAMES[lib.sf_cpu_isa_max()] if lib is not None else "unavailable"


def features() -> list[str]:
    """The CPU's features the kernels look for (cpuid and XCR0)."""
    bits = lib.sf_cpu_features() if lib is not None else 0
    return [name for bit, name in FEATURE_NAMES.items() if bits & bit]


def force_isa(level: int | str | None) -> None:
    """Run on a lower path (a level or a name of ISA_NAMES) until reset with
    None: SUPERFLUID_ISA, `bench engine --isa`, and tests that the paths
    give the same bits. A path above the CPU's is refused."""
    if level is None:
        lib.sf_cpu_force_isa(-1)
        return
    lvl = parse_isa(level) if isinstance(level, str) else level
    if not 0 <= lvl <= lib.sf_cpu_isa_max():
        raise ValueError(f"ISA path {ISA_NAMES.get(lvl, lvl)!r} is above this CPU's best, {best_isa()!r} "
                         f"(its features: {', '.join(features()) or 'none'})")
    if _bf16_class == "bf16-amx" and lvl < ISA_LEVELS["amx-bf16"]:
        raise ValueError(f"ISA path {ISA_NAMES[lvl]!r}: the bf16 class is pinned to bf16-amx, which runs only "
                         f"on the amx-bf16 path")
    lib.sf_cpu_force_isa(lvl)


def parse_isa(name: str) -> int:
    key = name.strip().lower().replace("_", "-")
    key = {"avx2+fma": "avx2", "avx512bf16": "avx512-bf16", "avx512f": "avx512", "amx": "amx-bf16",
           "amxbf16": "amx-bf16"}.get(key, key)
    if key not in ISA_LEVELS:
        raise ValueError(f"unknown ISA path {name!r}; known: {', '.join(ISA_LEVELS)}")
    return ISA_LEVELS[key]


_bf16_class: str | None = None  # None: follow the path (bf16-dot where vdpbf16ps runs)


def bf16_class() -> str:
    """The numeric class bf16 weights packed now get: "bf16-dot" (activations
    rounded to bf16, pairs of products added as vdpbf16ps does),
    "bf16-fma" (activations float32, weights widened, one fma chain) or
    "bf16-amx" (activations rounded to bf16, what AMX's tdpbf16ps computes:
    the amx-bf16 path only). Within a class every path that runs it gives
    the same bits; between classes rows differ."""
    if _bf16_class is not None:
        return _bf16_class
    level = lib.sf_cpu_isa() if lib is not None else 0
    return ("bf16-amx" if level >= ISA_LEVELS["amx-bf16"] else
            "bf16-dot" if level >= ISA_LEVELS["avx512-bf16"] else "bf16-fma")


def set_bf16_class(name: str | None) -> None:
    """Pin the class bf16 weights are packed in from now on (None: follow the
    path). "bf16-dot" runs on any CPU (by fma where vdpbf16ps is missing,
    slower), so workers on different machines can share one class."""
    global _bf16_class
    if name is not None and name not in BF16_CLASSES:
        raise ValueError(f"unknown bf16 numeric class {name!r}; known: {', '.join(BF16_CLASSES)}")
    if name == "bf16-amx" and (lib is None or lib.sf_cpu_isa() < ISA_LEVELS["amx-bf16"]):
        raise ValueError(f"the bf16-amx class runs only on the amx-bf16 path; this process runs {isa()!r}")
    _bf16_class = name


def numeric_class(dtype: torch.dtype) -> str:
    """The numeric class of a model whose linears are `dtype`, on this
    process's kernels: rows agree bitwise between workers of one class."""
    import torch

    return "fp32" if dtype == torch.float32 else bf16_class()


def configure_from_env(env: dict[str, str] | None = None) -> None:
    """SUPERFLUID_ISA (a lower path for the process) and SUPERFLUID_BF16_CLASS;
    ValueError naming the variable when either is not one we know."""
    env = dict(os.environ) if env is None else env
    raw = env.get(ISA_ENV, "").strip()
    if raw and lib is not None:
        try:
            force_isa(parse_isa(raw))
        except ValueError as e:
            raise ValueError(f"{ISA_ENV}={raw}: {e}") from None
    raw = env.get(BF16_ENV, "").strip()
    if raw:
        try:
            set_bf16_class(raw)
        except ValueError as e:
            raise ValueError(f"{BF16_ENV}={raw}: {e}") from None


# SUPERFLUID_ISA and SUPERFLUID_BF16_CLASS hold for the whole process, from
# its first import of the kernels. A bad value is kept here rather than
# raised at import: `serve` refuses with it (exit 2) and a model will not load.
ENV_ERROR: str | None = None
if lib is not None:
    try:
        configure_from_env()
    except ValueError as _e:
        ENV_ERROR = str(_e)


def check_env() -> None:
    """ValueError naming the variable when SUPERFLUID_ISA or
    SUPERFLUID_BF16_CLASS was not one we know."""
    if ENV_ERROR:
        raise ValueError(ENV_ERROR)
