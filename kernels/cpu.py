"""The torch backend's CPU kernels (kernels/sf_*.c through cffi), on torch tensors.

Each is batch invariant by construction (sf_cpu.c's header says how): a
row's bits never depend on the rows beside it, the thread count or the
ISA. Weights are packed once, at load, into panels of PANEL output
features [panels, in, PANEL] so a GEMM streams them in order; activations
stay float32 whatever the weights' dtype (float32 or bfloat16).
"""

from __future__ import annotations

import torch

from superfluid.kernels.cpu_pack import PANEL, Packed, pack, pack_gate_up, pack_parts  # noqa: F401 (cpu.*)
from superfluid.kernels.cpu_step import StepLayout, step_layout  # noqa: F401 (callers know them as cpu.*)
from superfluid.kernels.isa import (  # the path and class API, re-exported: callers know it as cpu.*
    BF16_CLASSES as BF16_CLASSES,
    BF16_ENV as BF16_ENV,
    ENV_ERROR as ENV_ERROR,
    FEATURE_NAMES as FEATURE_NAMES,
    ISA_ENV as ISA_ENV,
    ISA_LEVELS as ISA_LEVELS,
    ISA_NAMES as ISA_NAMES,
    best_isa as best_isa,
    bf16_class as bf16_class,
    check_env as check_env,
    configure_from_env as configure_from_env,
    features as features,
    force_isa as force_isa,
    isa as isa,
    numeric_class as numeric_class,
    parse_isa as parse_isa,
    set_bf16_class as set_bf16_class,
)

try:
    from superfluid.kernels._cpu import ffi, lib
except ImportError:  # pragma: no cover - a build without the extension
    ffi = lib = None


def available() -> bool:
    return lib is not None


_threads_set: int | None = None


def set_threads(n: int | None) -> None:
    """Threads the kernels use (None: follow torch.get_num_threads()). Apart
    from torch's own, so torch can stay at one thread: its OpenMP threads
    spin after each region and take a core from the kernels' helpers."""
    global _threads_set
    if n is not None and n < 1:
        raise ValueError(f"threads must be >= 1, got {n}")
    _threads_set = n


def threads() -> int:
    return _threads_set or torch.get_num_threads()


def park() -> None:
    """Nothing to run until further notice: the kernels' helper threads
    sleep now instead of spinning ~0.5 ms for a next job (a worker between
    ticks: the spin took the core its planner needed). The next kernel
    wakes them."""
    if lib is not None:
        lib.sf_pool_park()


def pass_bytes(n: int | None) -> None:
    """The activation bytes one pass of the one-call stack's layers may keep
    (None: the default, 8 MiB): a big prefill goes through the layers in
    passes of tokens that fit the cache, with the same bits. Tests set a
    small budget to run many passes."""
    if lib is not None:
        lib.sf_cpu_pass_bytes(n or 0)


def own_threads(n: int | None = None) -> tuple[int, int | None]:
    """The thread layout of a process that serves from these kernels: they
    run on `n` threads (default: torch's count now), torch's own ops on one.
    At torch's default the two pools fight: torch's OpenMP threads spin after
    every region of the small ops between kernels, taking a core from the
    kernels' helpers and from the planner; on 2 cores the tiny model's
    ticks in bench e2e ran 1.5x slower. Returns the layout before, for
    restore_threads."""
    before = (torch.get_num_threads(), _threads_set)
    set_threads(n or before[0])
    torch.set_num_threads(1)
    return before


def restore_threads(before: tuple[int, int | None]) -> None:
    """Undo own_threads."""
    torch.set_num_threads(before[0])
    set_threads(before[1])


_threads = threads


def _f(t: torch.Tensor | None):
    return ffi.NULL if t is None else ffi.cast("float *", t.data_ptr())


def _i64(t: torch.Tensor):
    return ffi.cast("int64_t *", t.data_ptr())


def _v(t: torch.Tensor):
    return ffi.cast("void *", t.data_ptr())


def _profiled(fn):
    """Shows the kernel in torch.profiler tables (bench engine --profile) as
    sf::<name>; nothing is added when no profiler runs."""
    import functools

    label = f"sf::{fn.__name__}"

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if torch.autograd._profiler_enabled():
            with torch.profiler.record_function(label):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper


def _rows(t: torch.Tensor, width: int, what: str) -> torch.Tensor:
    """t as float32 rows of `width` with unit stride (the C side's only layout)."""
    if t.dim() != 2 or t.shape[1] != width:
        raise ValueError(f"{what}: expected rows of {width}, got shape {tuple(t.shape)}")
    if t.dtype != torch.float32 or t.stride(-1) != 1 or t.device.type != "cpu":
        t = t.to("cpu", torch.float32).contiguous()
    return t


def _vec(t: torch.Tensor | None, n: int, what: str) -> torch.Tensor | None:
    if t is not None and (t.dtype != torch.float32 or t.shape != (n,) or not t.is_contiguous()):
        raise ValueError(f"{what}: expected a contiguous float32 vector of {n}")
    return t


def _check(rc: int, what: str) -> None:
    if rc == lib.SF_ERR_PATH:
        raise RuntimeError(f"{what}: weights of the bf16-amx class run only on the amx-bf16 path; this process "
                           f"runs {isa()!r}")
    if rc != 0:
        raise RuntimeError(f"{what} failed (rc {rc}): out of memory or bad arguments")


def _not_paired(p: Packed, what: str) -> None:
    if p.swiglu:  # its outputs would come out in (gate, up) panel order
        raise ValueError(f"{what}: a gate_up packed in (gate, up) pairs goes through linear_swiglu")


@_profiled
def linear(x: torch.Tensor, p: Packed, out: torch.Tensor | None = None, residual: bool = False) -> torch.Tensor:
    """x [n, in] float32 -> [n, out] float32 (y = x W.T + b). With residual,
    `out` holds x' and gets x' + (x W.T + b), rounded as torch would."""
    if p.parts != 1:
        raise ValueError("linear: a weight packed in pieces goes through linear_parts and combine")
    _not_paired(p, "linear")
    x = _rows(x, p.inp, "linear: x")
    n = x.shape[0]
    if out is None:
        out = x.new_empty((n, p.out))
    elif (out.dtype != torch.float32 or out.dim() != 2 or out.shape != (n, p.out) or out.stride(-1) != 1
          or out.device.type != "cpu"):
        raise ValueError(f"linear: out must be float32 [{n}, {p.out}] with unit stride")
    _check(lib.sf_linear(_f(x), x.stride(0), n, p.inp, _v(p.w), p.wtype, p.out,
                         _f(p.bias), _f(out), out.stride(0), int(residual), _threads()), "sf_linear")
    return out


@_profiled
def linear_parts(x: torch.Tensor, p: Packed) -> torch.Tensor:
    """x [n, in] float32 -> [p.parts, n, out]: piece i is x[:, i k:(i + 1) k]
    times its piece of the weight (k = in / parts), summed from zero; no bias."""
    _not_paired(p, "linear_parts")
    x = _rows(x, p.inp, "linear_parts: x")
    n = x.shape[0]
    y = x.new_empty((p.parts, n, p.out))
    _check(lib.sf_linear_parts(_f(x), x.stride(0), n, p.inp // p.parts, p.parts, _v(p.w),
                               p.wtype, p.out, _f(y), _threads()), "sf_linear_parts")
    return y


def linear_parts_add(x: torch.Tensor, p: Packed, out: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """out += combine(linear_parts(x, p), bias) in one call: the same bits;
    from a few hundred tokens the pieces are folded in cache, never written
    whole (the stack's o and down)."""
    _not_paired(p, "linear_parts_add")
    x = _rows(x, p.inp, "linear_parts_add: x")
    n = x.shape[0]
    if out.dtype != torch.float32 or out.shape != (n, p.out) or out.stride(-1) != 1 or out.device.type != "cpu":
        raise ValueError(f"linear_parts_add: out must be float32 [{n}, {p.out}] with unit stride")
    _vec(bias, p.out, "linear_parts_add: bias")
    if out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
        raise ValueError("linear_parts_add: out shares x's memory (tasks add into out while others read x)")
    scratch = x.new_empty((p.parts, n, p.out))
    _check(lib.sf_linear_parts_add(_f(x), x.stride(0), n, p.inp // p.parts, p.parts, _v(p.w), p.wtype, p.out,
                                   _f(scratch), _f(bias), _f(out), out.stride(0), _threads()), "sf_linear_parts_add")
    return out


@_profiled
def combine(parts: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """out += ((parts[0] + parts[1]) + ...) + bias, pieces added in order: the
    same bits whichever ranks computed which pieces."""
    if parts.dtype != torch.float32 or parts.dim() != 3 or not parts.is_contiguous() or parts.device.type != "cpu":
        raise ValueError("combine: parts must be contiguous float32 [pieces, n, out] on the CPU")
    g, n, width = parts.shape
    if out.dtype != torch.float32 or out.shape != (n, width) or out.stride(-1) != 1 or out.device.type != "cpu":
        raise ValueError(f"combine: out must be float32 [{n}, {width}] with unit stride")
    _vec(bias, width, "combine: bias")
    _check(lib.sf_combine(_f(parts), g, n, width, _f(bias), _f(out), out.stride(0), _threads()), "sf_combine")
    return out


@_profiled
def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    d = x.shape[-1]
    rows = _rows(x.reshape(-1, d), d, "rmsnorm: x")
    _vec(w, d, "rmsnorm: w")
    y = torch.empty(rows.shape, dtype=torch.float32)
    _check(lib.sf_rmsnorm(_f(rows), rows.stride(0), rows.shape[0], d, _f(w), eps, _f(y), d, _threads()),
           "sf_rmsnorm")
    return y.view(x.shape)


@_profiled
def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gu [n, 2 * inter] (gate first) -> [n, inter]."""
    if gu.dim() != 2 or gu.shape[1] % 2:
        raise ValueError(f"silu_mul: expected [n, 2 * inter], got shape {tuple(gu.shape)}")
    gu = _rows(gu, gu.shape[1], "silu_mul: gu")
    n, inter = gu.shape[0], gu.shape[1] // 2
    out = gu.new_empty((n, inter))
    _check(lib.sf_silu_mul(_f(gu), gu.stride(0), n, inter, _f(out), inter, _threads()), "sf_silu_mul")
    return out


@_profiled
def linear_swiglu(x: torch.Tensor, p: Packed) -> torch.Tensor:
    """silu(gate) * up of x's gate_up projection (p from pack_gate_up) ->
    [n, inter]: in one call where p is paired, else linear then silu_mul;
    the same bits either way."""
    if not p.swiglu:
        return silu_mul(linear(x, p))
    x = _rows(x, p.inp, "linear_swiglu: x")
    n, inter = x.shape[0], p.out // 2
    out = x.new_empty((n, inter))
    _check(lib.sf_linear_swiglu(_f(x), x.stride(0), n, p.inp, _v(p.w), p.wtype, inter, _f(p.bias), _f(out), inter,
                                _threads()), "sf_linear_swiglu")
    return out


@_profiled
def greedy(rows: torch.Tensor) -> tuple[list[int], list[bool]]:
    """Per row of float32 [B, V]: the first maximum (a NaN ranked as -inf, as
    sampling's greedy does) and whether the row is not finite (a NaN, or a
    max of +-inf)."""
    if rows.dim() != 2 or rows.shape[1] == 0:
        raise ValueError(f"greedy: expected rows [B, V>0], got shape {tuple(rows.shape)}")
    rows = _rows(rows, rows.shape[1], "greedy: rows")
    b = rows.shape[0]
    tok = ffi.new("int64_t[]", b)
    bad = ffi.new("uint8_t[]", b)
    _check(lib.sf_greedy(_f(rows), rows.stride(0), b, rows.shape[1], tok, bad), "sf_greedy")
    return list(tok), [bool(x) for x in bad]


@_profiled
def embed(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    ids = ids.to(torch.int64).contiguous()
    if table.dtype not in (torch.float32, torch.bfloat16) or table.dim() != 2 or not table.is_contiguous():
        raise ValueError("embed: the table must be a contiguous float32/bfloat16 matrix")
    n, d = ids.shape[0], table.shape[1]
    out = torch.empty((n, d), dtype=torch.float32)
    rc = lib.sf_embed(_v(table), int(table.dtype == torch.bfloat16), d, table.shape[0], _i64(ids), n, _f(out))
    if rc == -3:  # (checked in C: two torch reductions cost more than the gather at batch 1)
        raise IndexError("embed: a token outside the table")
    _check(rc, "sf_embed")
    return out


@_profiled
def _check_pools(layout: StepLayout, k_pool: torch.Tensor, v_pool: torch.Tensor, n_kv: int, head_dim: int,
                 cos: torch.Tensor, sin: torch.Tensor) -> None:
    """What the C side trusts: pools of one dtype and shape [kv, blocks,
    page, head_dim], contiguous; every position in the rope tables, every
    cell and block id in the pool."""
    shape = k_pool.shape
    if (k_pool.dtype not in (torch.float32, torch.bfloat16) or v_pool.dtype != k_pool.dtype
            or v_pool.shape != shape or len(shape) != 4 or shape[0] != n_kv or shape[3] != head_dim
            or shape[2] != layout.page or not (k_pool.is_contiguous() and v_pool.is_contiguous())):
        raise ValueError("attention: K and V pools must be contiguous float32/bfloat16 [kv, blocks, page, head_dim]")
    for t in (cos, sin):
        if t.dtype != torch.float32 or not t.is_contiguous() or t.dim() != 2 or t.shape[1] != head_dim // 2:
            raise ValueError(f"attention: rope tables must be contiguous float32 [positions, {head_dim // 2}]")
    check_bounds(layout, shape[1], shape[2], cos.shape[0])


def check_bounds(layout: StepLayout, blocks: int, page: int, rope_len: int) -> None:
    """Every position in the rope tables, every cell and block id in a pool
    of `blocks` blocks of `page` cells (what sf_attention indexes unchecked)."""
    if not layout.n:
        return
    top = layout.bounds or (int(layout.positions.max()), int(layout.cells.max()), int(layout.tables.max()))
    if top[0] >= rope_len or top[1] >= blocks * page or top[2] >= blocks:
        raise ValueError("attention: a position past the rope tables or a cell outside the pool")


def attention(qkv: torch.Tensor, layout: StepLayout, k_pool: torch.Tensor, v_pool: torch.Tensor, *, n_heads: int,
              n_kv: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor, q_norm: torch.Tensor | None,
              k_norm: torch.Tensor | None, eps: float, scale: float) -> torch.Tensor:
    """qkv [n, (heads + 2 kv) head_dim] (rotated in place; K/V stored into
    the layer's pool, heads-major [kv, blocks, page, head_dim]) -> the
    attention output [n, heads * head_dim]."""
    n = qkv.shape[0]
    width = (n_heads + 2 * n_kv) * head_dim
    if qkv.dtype != torch.float32 or qkv.dim() != 2 or qkv.shape[1] != width or qkv.stride(-1) != 1:
        raise ValueError(f"attention: qkv must be float32 rows of {width} with unit stride")
    if n != layout.n:
        raise ValueError(f"attention: {n} rows of qkv for a layout of {layout.n} tokens")
    _check_pools(layout, k_pool, v_pool, n_kv, head_dim, cos, sin)
    for t in (q_norm, k_norm):
        _vec(t, head_dim, "attention: q/k norm")
    out = qkv.new_empty((n, n_heads * head_dim))
    head_stride = k_pool.stride(0)
    pos, cells, feed_of, tables, _ = layout.pointers(ffi)
    _check(lib.sf_attention(_f(qkv), qkv.stride(0), n, n_heads, n_kv, head_dim, pos, cells, feed_of, tables,
                            layout.width, _f(cos), _f(sin),
                            _f(q_norm), _f(k_norm), eps, _v(k_pool), _v(v_pool),
                            int(k_pool.dtype == torch.bfloat16), head_stride, layout.page, scale, _f(out),
                            out.stride(0), _threads()), "sf_attention")
    return out

