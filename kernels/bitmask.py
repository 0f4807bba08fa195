"""The grammar bitmask on numpy logits rows (contract §5: the mask comes first).

A mask row is int32 [ceil(V/32)]: token t is allowed when bit t % 32 of
word t // 32 is set (llguidance's layout). A banned token's logit becomes
-inf; an allowed one keeps its bits (NaN, infinities and -0.0 included).

The one applier for numpy rows: sf_apply_bitmask (kernels/sf_mask.c) where the
CPU kernels are built, the same integer ops on the floats' bits in numpy where
they are not. No torch here: the host sampler (executor/) and the fake runtime
use it without the engine's imports. kernels/reference_sampler.py keeps the
plain algorithm the tests hold this against.
"""

from __future__ import annotations

import math
import threading

import numpy as np

try:
    from superfluid.kernels._cpu import ffi, lib
except ImportError:  # pragma: no cover - a build without the extension
    ffi = lib = None



def native() -> bool:
    """Whether the C kernel (sf_apply_bitmask) is there; else numpy does it."""
    return lib is not None


_NEG_INF_BITS = np.int32(-0x800000)  # float32 -inf's bits (0xff800000) as an int32
_scratch = threading.local()  # each thread's reused buffers


def _buffer(name: str, shape: tuple[int, ...], reuse: bool) -> np.ndarray:
    """An int32 array of `shape`: with reuse, one of this thread's, grown as needed
    and overwritten by the next call (a fresh array page-faults its first touch:
    ~0.5 ms a MB beside torch's allocations, most of a mask's cost at vocab 32k)."""
    n = math.prod(shape)
    if not reuse:
        return np.empty(shape, dtype=np.int32)
    have = getattr(_scratch, name, None)
    if have is None or have.size < n:
        have = np.empty(n, dtype=np.int32)
        setattr(_scratch, name, have)
    return have[:n].reshape(shape)


def apply_bitmask(x: np.ndarray, bits: np.ndarray, rows: list[int] | None = None, out: np.ndarray | None = None,
                  *, reuse: bool = False) -> np.ndarray:
    """float32 x [B, V] with rows `rows` (None: all, in order) at -inf where their masks
    bits [n, ceil(V/32)] have a clear bit, written to `out` (which may be x) and
    returned; out None: a new array (with reuse, this thread's, which the next call
    with reuse overwrites).

    Integer ops on the floats' bits, one thread, the same time at any mask: a
    select (torch.where, np.copyto(where=)) mispredicts a branch a token where
    allowed and banned tokens alternate (3-6x slower at vocab 32k), and
    torch.where's threads wait for a core on a busy machine (B32 in a decode
    step: ~1 ms idle, ~7 ms busy, vs ~2.2 ms for these either way). With the
    CPU kernels built, sf_apply_bitmask does it in one pass (~10x less)."""
    B, V = x.shape
    W = (V + 31) // 32
    if out is None:
        out = _buffer("out", (B, V), reuse).view(np.float32)
    if x.dtype != np.float32 or out.dtype != np.float32 or out.shape != (B, V) or bits.dtype != np.int32 \
            or bits.ndim != 2 or bits.shape[1] != W:
        raise ValueError(f"apply_bitmask: x and out float32 [{B}, {V}], bits int32 [n, {W}]")
    n = bits.shape[0]
    if rows is not None:
        if len(rows) != n or len(set(rows)) != n:
            raise ValueError(f"apply_bitmask: {n} distinct rows for {n} masks, got {rows}")
    elif n != B:
        raise ValueError(f"apply_bitmask: {n} masks for {B} rows and no rows")
    if lib is not None:
        _apply_c(x, bits, rows, out)
        return out
    # keep: -1 where allowed, 0 where banned (the words are little-endian: unpackbits' order)
    u = np.unpackbits(bits.astype("<i4", copy=False).view(np.uint8), axis=1, count=V, bitorder="little")
    keep = _buffer("keep", (n, V), reuse)
    np.subtract(0, u, out=keep, dtype=np.int32)
    xi = x.view(np.int32)
    oi = out.view(np.int32)
    dst = oi
    if rows is not None:
        np.copyto(oi, xi)
        dst = np.take(xi, rows, axis=0, out=_buffer("rows", (n, V), reuse))
        xi = dst
    # x where keep is -1, -inf's bits where it is 0
    np.bitwise_xor(xi, _NEG_INF_BITS, out=dst)
    np.bitwise_and(dst, keep, out=dst)
    np.bitwise_xor(dst, _NEG_INF_BITS, out=dst)
    if rows is not None:
        oi[rows] = dst
    return out


def apply_bitmask_row(row: np.ndarray, bits: np.ndarray) -> None:
    """In place: every token of `row` (contiguous float32 [V]) that the mask row
    bits (integers [ceil(V/32)]) does not allow becomes -inf."""
    bits = np.ascontiguousarray(bits, dtype=np.int32)
    if row.flags.c_contiguous:
        apply_bitmask(row[None], bits[None], None, row[None])
    else:
        dense = np.ascontiguousarray(row)
        apply_bitmask(dense[None], bits[None], None, dense[None])
        row[...] = dense


def _apply_c(x: np.ndarray, bits: np.ndarray, rows: list[int] | None, out: np.ndarray) -> None:
    B, V = x.shape
    x, bits = np.ascontiguousarray(x), np.ascontiguousarray(bits)
    if not out.flags.c_contiguous:
        raise ValueError("apply_bitmask: out must be contiguous")
    n = bits.shape[0]
    r = ffi.NULL
    if rows is not None:
        keep = np.asarray(rows, dtype=np.int64)
        r = ffi.cast("int64_t *", keep.ctypes.data)
    rc = lib.sf_apply_bitmask(ffi.cast("float *", x.ctypes.data), V, B, V, ffi.cast("int32_t *", bits.ctypes.data),
                              bits.shape[1], r, n, ffi.cast("float *", out.ctypes.data), V)
    if rc != 0:
        raise RuntimeError(f"sf_apply_bitmask failed (rc {rc}): out of memory or bad arguments")
