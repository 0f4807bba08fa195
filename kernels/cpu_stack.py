"""Every decoder layer of a step in one call into C (kernels/sf_cpu.c
sf_forward; on a tensor-parallel rank sf_tp.c sf_forward_tp), over the
weights kernels/cpu.py packs: a step at batch 1 costs one Python call
instead of seven a layer."""

from __future__ import annotations

import time
from typing import Any

import torch

from superfluid.kernels.cpu import (
    StepLayout,
    _check,
    _check_pools,
    _f,
    _i64,
    _profiled,
    _threads,
    _v,
    check_bounds,
    ffi,
    lib,
)

# forward_tp gathers a rank's pieces this many bytes at a time (or its comm's slot, if smaller):
# what every rank sends and gets back stays in cache.
TP_CHUNK_BYTES = 512 << 10


def in_huge_pages(packs: list) -> bool:
    """Moves the packed weights into one mapping the kernel may back with
    2 MiB pages (transparent huge pages, madvise): a batch-1 step streams
    every weight, and in 4 KiB pages that walks ~20k pages a step, evicting
    the TLB entries of everything else (~3-5% of a small model's decode step
    here). The weights' tensors hold the mapping (it is never closed: it
    lives as long as they do). False where no such mapping can be had (the
    weights stay where they are)."""
    import mmap

    align = 2 << 20
    sizes = [-(-p.w.numel() * p.w.element_size() // 64) * 64 for p in packs]
    try:
        m = mmap.mmap(-1, sum(sizes) + align, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, ValueError, AttributeError):  # no memory for a second copy now, or no anonymous mmap
        return False
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass  # THP off: ordinary pages, still one mapping
    buf = torch.frombuffer(m, dtype=torch.uint8)
    at = (-buf.data_ptr()) % align
    for p, size in zip(packs, sizes):
        nbytes = p.w.numel() * p.w.element_size()
        w = buf[at:at + nbytes].view(p.w.dtype).view(p.w.shape)
        w.copy_(p.w)
        p.w = w
        at += size
    return True


class Stack:
    """Every decoder layer's weights as sf_forward takes them, built once at
    load; `run` is one call into C a step for all layers (at batch 1 the
    seven calls a layer cost a third of the step in Python)."""

    def __init__(self, layers, *, hidden: int, n_heads: int, n_kv: int, head_dim: int, inter: int, eps: float,
                 scale: float, cos: torch.Tensor, sin: torch.Tensor):
        self.cos, self.sin = cos, sin
        self._keep: list = []
        self.shape = (hidden, n_heads, n_kv, head_dim, inter)
        self.layers = ffi.new("sf_layer[]", len(layers))
        wtypes = {getattr(L, name).wtype for L in layers for name in ("qkv", "o", "gate_up", "down")}
        if len(wtypes) > 1:
            raise ValueError("Stack: every layer's weights must share one dtype and numeric class")
        for c, L in zip(self.layers, layers):
            for name in ("qkv", "o", "gate_up", "down"):
                lin = getattr(L, name)
                setattr(c, name, _v(lin.w))
                setattr(c, name + "_b", _f(lin.bias))
                self._keep += [lin.w, lin.bias]
            for name in ("attn_norm", "mlp_norm", "q_norm", "k_norm"):
                t = getattr(L, name)
                setattr(c, name, _f(t))
                self._keep.append(t)
            c.swiglu = int(L.gate_up.swiglu)
        parts = {(L.o.parts, L.down.parts) for L in layers}
        if len(parts) > 1 or len({p for pair in parts for p in pair}) > 1:
            raise ValueError("Stack: every row-parallel layer must be packed in the same number of pieces")
        self.parts = layers[0].o.parts if layers else 1
        self.model = ffi.new("sf_model *", dict(
            n_layers=len(layers), hidden=hidden, nh=n_heads, nkv=n_kv, hd=head_dim, inter=inter, parts=self.parts,
            wtype=wtypes.pop() if wtypes else 0, eps=eps, scale=scale, cos=_f(cos), sin=_f(sin), layers=self.layers))
        self._pool: tuple | None = None
        self.head = None  # sf_head * (set_head)
        self._scratch_key: tuple[int, bool] | None = None
        self._scratch_bufs: tuple = ()
        self.comm_s = 0.0
        self.kernel_s = 0.0  # seconds in forward_head's call into C, summed (the rest of a step is the host's)

    def _attach(self, k_pools, v_pools) -> None:
        if len(k_pools) != len(self.layers) or len(v_pools) != len(self.layers):
            raise ValueError(f"Stack: {len(self.layers)} layers, {len(k_pools)}/{len(v_pools)} pools")
        k0 = k_pools[0]
        for k, v in zip(k_pools, v_pools):  # all checked before any layer is switched
            if not (k.is_contiguous() and v.is_contiguous()) or k.shape != k0.shape or v.shape != k.shape \
                    or k.dtype != k0.dtype or v.dtype != k0.dtype:
                raise ValueError("Stack: each layer's pool must be contiguous heads-major, all of one shape and dtype")
        for c, k, v in zip(self.layers, k_pools, v_pools):
            c.k_pool, c.v_pool = _v(k), _v(v)
        m = self.model
        m.kv_bf16, m.head_stride, m.page = int(k_pools[0].dtype == torch.bfloat16), k_pools[0].stride(0), \
            k_pools[0].shape[2]

    def _begin(self, x: torch.Tensor | None, layout: StepLayout, k_pools, v_pools, what: str) -> None:
        """What the C side trusts of a step's x, layout and pools; the pools
        attached (checked whole when they change, their bounds each step)."""
        hidden, _, nkv, hd, _ = self.shape
        if x is not None and (x.dtype != torch.float32 or x.dim() != 2 or x.shape != (layout.n, hidden)
                              or not x.is_contiguous()):
            raise ValueError(f"Stack.{what}: x must be contiguous float32 [{layout.n}, {hidden}]")
        held = self._pool
        if held is None or len(held[0]) != len(k_pools) or len(held[1]) != len(v_pools) \
                or not all(a is b for a, b in zip(held[0], k_pools)) \
                or not all(a is b for a, b in zip(held[1], v_pools)):
            # (the tensors held: the same objects are the same pools, no torch call a step to see it)
            self._pool = None  # a refused set leaves no half-trusted one behind
            _check_pools(layout, k_pools[0], v_pools[0], nkv, hd, self.cos, self.sin)
            self._attach(k_pools, v_pools)
            held = (tuple(k_pools), tuple(v_pools), k_pools[0].shape[1], k_pools[0].shape[2])
            self._pool = held
        if layout.page != held[3]:
            raise ValueError(f"Stack.{what}: a layout of page {layout.page} for pools of page {held[3]}")
        check_bounds(layout, held[2], held[3], self.cos.shape[0])

    def _scratch(self, n: int, with_x: bool = False) -> tuple:
        """A step's float32 buffers for the kernels between layers (x when
        with_x, else None; h, qkv, att, gu, act, parts) and their C pointers,
        kept while steps of up to 64 tokens have the same width: decode steps
        allocate nothing, and a long prefill's buffers are not held after it."""
        if self._scratch_key == (n, with_x):
            return self._scratch_bufs
        hidden, nh, nkv, hd, inter = self.shape

        def e(*shape: int) -> torch.Tensor:
            return torch.empty(shape, dtype=torch.float32)  # (never the default dtype: C writes floats)

        bufs = (e(n, hidden) if with_x else None, e(n, max(hidden, nh * hd)), e(n, (nh + 2 * nkv) * hd),
                e(n, nh * hd), e(n, 2 * inter), e(n, inter), e(self.parts, n, hidden))
        out = (bufs, tuple(ffi.NULL if b is None else _f(b) for b in bufs))
        self._scratch_key, self._scratch_bufs = ((n, with_x), out) if n <= 64 else (None, ())
        return out

    @_profiled
    def forward(self, x: torch.Tensor, layout: StepLayout, k_pools, v_pools) -> torch.Tensor:
        """x [n, hidden] float32 (the embeddings) through every layer, in place."""
        self._begin(x, layout, k_pools, v_pools, "forward")
        bufs, (_, h, qkv, att, gu, act, parts) = self._scratch(layout.n)
        pos, cells, feed_of, tables, _ = layout.pointers(ffi)
        _check(lib.sf_forward(self.model, _f(x), layout.n, pos, cells, feed_of, tables, layout.width, h, qkv, att, gu,
                              act, parts, _threads()), "sf_forward")
        del bufs  # (held over the call: a wide step's buffers are not kept)
        return x

    def set_head(self, embed: torch.Tensor, norm: torch.Tensor, head) -> None:
        """What forward_head adds: the embedding table (float32 or bf16
        [rows, hidden], contiguous), the final RMSNorm's weight (float32
        [hidden]) and the LM head (a cpu.Packed of the layers' class)."""
        hidden = self.shape[0]
        if embed.dtype not in (torch.float32, torch.bfloat16) or embed.dim() != 2 or embed.shape[1] != hidden \
                or not embed.is_contiguous():
            raise ValueError(f"Stack.set_head: the embedding must be a contiguous float32/bf16 [rows, {hidden}]")
        if norm.dtype != torch.float32 or norm.shape != (hidden,) or not norm.is_contiguous():
            raise ValueError(f"Stack.set_head: the norm must be a contiguous float32 vector of {hidden}")
        if head.inp != hidden or head.parts != 1 or head.bias is not None or head.wtype != self.model.wtype:
            raise ValueError("Stack.set_head: the LM head must be packed whole, without bias, in the layers' class, "
                             f"with {hidden} inputs")
        self._head_keep = (embed, norm, head, head.w)  # (head.w: what C reads, whatever rebinds it)
        self.vocab = head.out
        self.head = ffi.new("sf_head *", dict(embed=_v(embed), embed_bf16=int(embed.dtype == torch.bfloat16),
                                              embed_rows=embed.shape[0], norm=_f(norm), w=_v(head.w), vocab=head.out))

    @_profiled
    def forward_head(self, x: torch.Tensor | None, layout: StepLayout, k_pools, v_pools,
                     rows: torch.Tensor | None = None, picks: list[Any] | None = None) -> torch.Tensor:
        """A step's logits in one call into C: x [n, hidden] (the embeddings;
        None: the layout's ids, embedded here) through every layer, the final
        norm of the rows wanted (indices into the step's tokens; None: every
        token) and the LM head: float32 [rows, vocab]. With `picks` (a list),
        each row's greedy token and whether it is not finite are appended to
        it as two lists (cpu.greedy's)."""
        if self.head is None:
            raise ValueError("Stack.forward_head: no head (set_head)")
        if x is None and not layout.has_ids:
            raise ValueError("Stack.forward_head: neither embeddings nor the layout's ids")
        self._begin(x, layout, k_pools, v_pools, "forward_head")
        n = layout.n
        if rows is not None:
            rows = rows.to(torch.int64).contiguous()
        nrows = n if rows is None else rows.shape[0]
        logits = torch.empty((nrows, self.vocab), dtype=torch.float32)
        bufs, (xs, h, qkv, att, gu, act, parts) = self._scratch(n, with_x=x is None)
        pos, cells, feed_of, tables, ids = layout.pointers(ffi)
        if x is not None:
            xs, ids = _f(x), ffi.NULL
        tok = ffi.new("int64_t[]", nrows) if picks is not None else ffi.NULL
        bad = ffi.new("uint8_t[]", nrows) if picks is not None else ffi.NULL
        t0 = time.perf_counter()
        rc = lib.sf_forward_head(self.model, self.head, xs, ids, n, pos, cells, feed_of, tables, layout.width, h, qkv,
                                 att, gu, act, parts, ffi.NULL if rows is None else _i64(rows), nrows, _f(logits),
                                 tok, bad, _threads())
        self.kernel_s += time.perf_counter() - t0
        del bufs  # (held over the call: a wide step's buffers are not kept)
        if rc == -3:
            raise IndexError(f"Stack.forward_head: a token outside the embedding or a row outside the step's {n}")
        _check(rc, "sf_forward_head")
        if picks is not None:
            picks += [list(tok), [b != 0 for b in bad]]
        return logits

    @_profiled
    def forward_tp(self, x: torch.Tensor, layout: StepLayout, k_pools, v_pools, comm, timeout_s: float) -> torch.Tensor:
        """forward on a tensor-parallel rank's shard: after each row-parallel
        layer the pieces of every rank are gathered through `comm` (a
        kernels.comm.ShmComm of comm.world ranks) and added in piece order.
        comm's errors (CommTimeout: a rank died or stopped) as its calls';
        self.comm_s: the seconds those gathers took."""
        self._begin(x, layout, k_pools, v_pools, "forward_tp")
        hidden = self.shape[0]
        n = x.shape[0]
        chunk = min(comm.slot_bytes, TP_CHUNK_BYTES)
        rows = max(1, chunk // (self.parts * hidden * 4))
        if self.parts * hidden * 4 > comm.slot_bytes:
            raise ValueError(f"Stack.forward_tp: one token's pieces ({self.parts * hidden * 4} bytes) exceed the "
                             f"comm's slots ({comm.slot_bytes})")
        bufs, (_, h, qkv, att, gu, act, parts) = self._scratch(n)
        stage = x.new_empty((self.parts, min(rows, n), hidden))
        every = x.new_empty((comm.world * self.parts, min(rows, n), hidden))
        pos, cells, feed_of, tables, _ = layout.pointers(ffi)
        state = comm.c_calls(timeout_s)
        state.chunk_bytes = chunk
        rc = lib.sf_forward_tp(self.model, state, _f(x), n, pos, cells, feed_of, tables, layout.width, h, qkv, att, gu,
                               act, parts, _f(stage), _f(every), _threads())
        del bufs  # (held over the call: a wide step's buffers are not kept)
        comm.c_calls_done(state, rc, "sf_forward_tp")
        self.comm_s = float(state.comm_s)
        return x
