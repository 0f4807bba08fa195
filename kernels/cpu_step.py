"""A step as the CPU kernels read it (StepLayout): each token's position,
the cell its K/V goes to, its feed, the feeds' block tables (never lanes),
and, when the layer stack embeds them itself, the token ids.

A small step (step_layout, up to SMALL_STEP tokens: every decode step) is
built in plain Python into one int64 buffer the C side reads in place, and
its tensors are made only when someone asks. Why: a batch-1 step streams
every weight through the caches, so the Python around it runs cold, where
each torch or numpy call costs tens of microseconds (the numpy layout took
~0.15 ms of a 3 ms step; this one ~0.05)."""

from __future__ import annotations

import array
from typing import Any

import torch

# Tokens up to which step_layout builds the layout in Python (beyond, numpy is faster).
SMALL_STEP = 256


class StepLayout:
    """positions, cells, feed_of int64 [n]; tables int64 [feeds, width]
    (block ids, 0-padded); page; bounds: (max position, max cell, max block
    id) when known (None: _check_pools takes them); ids: int64 [n] or None."""

    __slots__ = ("_buf", "_has_ids", "_t", "bounds", "n", "nf", "page", "width")

    def __init__(self, positions: torch.Tensor, cells: torch.Tensor, feed_of: torch.Tensor, tables: torch.Tensor,
                 page: int, bounds: tuple[int, int, int] | None = None, ids: torch.Tensor | None = None):
        self.page, self.bounds = page, bounds
        self.n, (self.nf, self.width) = int(positions.shape[0]), tuple(tables.shape)
        self._t: tuple[Any, ...] | None = (positions, cells, feed_of, tables, ids)
        self._buf: array.array | None = None
        self._has_ids = ids is not None

    @classmethod
    def _packed(cls, buf: array.array, n: int, nf: int, width: int, page: int, bounds, has_ids: bool) -> StepLayout:
        """buf: positions, cells, feed_of, tables (nf x width), then the ids if has_ids."""
        self = cls.__new__(cls)
        self.page, self.bounds, self.n, self.nf, self.width = page, bounds, n, nf, width
        self._t, self._buf, self._has_ids = None, buf, has_ids
        return self

    def _tensors(self) -> tuple[Any, ...]:
        if self._t is None:
            assert self._buf is not None
            flat = (torch.frombuffer(self._buf, dtype=torch.int64) if len(self._buf)
                    else torch.zeros(0, dtype=torch.int64))
            n, end = self.n, 3 * self.n + self.nf * self.width
            self._t = (flat[:n], flat[n:2 * n], flat[2 * n:3 * n], flat[3 * n:end].view(self.nf, self.width),
                       flat[end:end + n] if self._has_ids else None)
        return self._t

    @property
    def positions(self) -> torch.Tensor:
        return self._tensors()[0]

    @property
    def cells(self) -> torch.Tensor:
        return self._tensors()[1]

    @property
    def feed_of(self) -> torch.Tensor:
        return self._tensors()[2]

    @property
    def tables(self) -> torch.Tensor:
        return self._tensors()[3]

    @property
    def ids(self) -> torch.Tensor | None:
        return self._tensors()[4]

    @property
    def has_ids(self) -> bool:
        return self._has_ids

    def pointers(self, ffi) -> tuple[Any, ...]:
        """C pointers to positions, cells, feed_of, tables and the ids (NULL
        without): into the buffer, or to the tensors (contiguous int64). The
        layout must outlive their use."""
        if self._buf is not None:
            n = self.n
            base = ffi.from_buffer("int64_t[]", self._buf) if len(self._buf) else ffi.NULL
            if base == ffi.NULL:
                return ffi.NULL, ffi.NULL, ffi.NULL, ffi.NULL, ffi.NULL
            tables = base + 3 * n
            return base, base + n, base + 2 * n, tables, (tables + self.nf * self.width if self._has_ids else ffi.NULL)
        out = []
        for t in self._tensors():
            if t is None:
                out.append(ffi.NULL)
                continue
            if t.dtype != torch.int64 or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError("StepLayout: the layout's tensors must be contiguous int64 on the CPU")
            out.append(ffi.cast("int64_t *", t.data_ptr()))
        return tuple(out)


def step_layout(feeds: list[tuple[list[int], int, int]], page: int, ids: list[int] | None = None) -> StepLayout:
    """A step's layout from (block table, cells before, tokens fed) per feed,
    in step order; with `ids` (the step's tokens, feed after feed) carried
    for the stack to embed."""
    n = sum(f[2] for f in feeds)
    if ids is not None and len(ids) != n:
        raise ValueError(f"step_layout: {len(ids)} ids for {n} tokens")
    if n > SMALL_STEP:
        return _numpy_layout(feeds, page, ids)
    nf = len(feeds)
    width = max((len(f[0]) for f in feeds), default=0) or 1
    pos: list[int] = []
    cells: list[int] = []
    feed_of: list[int] = []
    tables: list[int] = []
    for i, (table, start, k) in enumerate(feeds):
        for p in range(start, start + k):
            pos.append(p)
            cells.append(table[p // page] * page + p % page)
        feed_of += [i] * k
        tables += table
        if len(table) < width:
            tables += [0] * (width - len(table))
    bounds = (max(pos), max(cells), max(tables)) if pos else None
    buf = array.array("q", pos)
    buf.extend(cells)
    buf.extend(feed_of)
    buf.extend(tables)
    if ids is not None:
        buf.extend(ids)
    return StepLayout._packed(buf, n, nf, width, page, bounds, ids is not None)


def _numpy_layout(feeds: list[tuple[list[int], int, int]], page: int, ids: list[int] | None) -> StepLayout:
    from superfluid.kernels.attention import token_layout

    _, _, _, table, feed_of, positions, cells = token_layout(feeds, page)
    bounds = (int(positions.max()), int(cells.max()), int(table.max())) if positions.size else None
    return StepLayout(torch.from_numpy(positions), torch.from_numpy(cells), torch.from_numpy(feed_of),
                      torch.from_numpy(table), page, bounds,
                      None if ids is None else torch.tensor(ids, dtype=torch.int64))
