"""A deterministic fake runtime (contract §8) for executor tests and the tick benchmark.

A sequence is the list of tokens it holds, one cell each. The row of a token
is a pure function of its sequence's history (engine/fake_rows.py), so batch
invariance and chunking invariance hold bitwise by construction.

Cells live in a paged pool of `page`-cell blocks with reference counts
(engine/blocks.py, as the KV pool's): `cells_used` counts whole blocks. With
`copy_shares_cells`, a copy shares the source's full blocks and copies its
partial one; a sequence about to write into a partial block someone else
still holds (left by a truncate) first copies it (copy-on-write, one block).

`exact_only` models a recurrent runtime, whose state cannot be cut back:
- seq_truncate(seq, n) only to n == 0 (a reset) or n == len (no-op); any other
  n is OutOfBounds (desc.truncate_partial is False);
- seq_copy(src, dst, n) only of n == len(src) (or n == 0, an empty dst);
  any other n is OutOfBounds;
- export/import move whole sequences, as everywhere;
- a decode feed (Feed.decode, one token) takes "the one-token update": its
  position hashes differently from a prefill's, and so do the rows after it,
  until a prefill feed recomputes the sequence's decoded positions as prefill
  would have (as a recurrent runtime redoes them from its last chunk
  boundary). Rows thus tell which way each position was fed, so a test sees
  an executor that feeds a position one way on a first run and another on a
  replay or after a seed.
The executor lives with this: it keys cache entries by their exact length,
checkpoints a prompt one token short of its end, copies whole entries, takes
an entry over only when it ends where the seed does, and resets a failed
import with truncate(seq, 0).

Fault injection (inject_fault, inject_capacity_fault, inject_fatal) is
engine/fake_faults.py's.

Not modelled: max_batch is stated in desc but not enforced (the executor
chunks decode rounds by it; a prefill step may carry more feeds); an empty
sequence holds no cells.
"""

from __future__ import annotations

import importlib
import operator
from collections.abc import Iterable, Sequence
from types import ModuleType
from typing import Literal

import numpy as np

from superfluid.engine.blocks import BlockPool
from superfluid.engine.fake_faults import FaultInjection
from superfluid.engine.fake_rows import FakeModel, FakeSeq
from superfluid.engine.fake_stats import FakeStats, spend
from superfluid.engine.runtime import (
    NONFINITE,
    CapacityError,
    Feed,
    MemCounters,
    OutOfBounds,
    Runtime,
    RuntimeDescription,
    SampleSpec,
    TokenMasks,
    UnknownSequence,
    Unsupported,
    Vocabulary,
    check_masks,
    row_finite,
)


def _host_sampling() -> ModuleType | None:
    """superfluid.kernels.reference_sampler if it is there (the fake also runs without the kernels)."""
    try:
        mod = importlib.import_module("superfluid.kernels.reference_sampler")
    except ImportError:
        return None
    return mod if callable(getattr(mod, "sample", None)) else None


class FakeRuntime(FaultInjection, Runtime):
    """See the module docstring. Sizes are in cells; `cells_total` is rounded
    down to whole pages (0 = unlimited)."""

    def __init__(
        self,
        *,
        vocab_size: int = 64,
        max_seq_len: int = 256,
        max_batch: int = 64,
        max_seqs: int = 0,
        page: int = 16,
        cells_total: int = 0,
        copy_shares_cells: bool | None = None,  # None: share unless exact_only
        exact_only: bool = False,
        takeover_preferred: bool = False,
        verify_batches: bool = True,
        prefill_step_tokens: int = 0,
        eos_ids: Iterable[int] | None = None,
        eos_rate: float = 0.02,
        engine_sampling: bool = False,
        engine_draws: bool = False,
        step_cost: float = 0.0,
        token_cost: float = 0.0,
        cost_mode: Literal["spin", "sleep"] = "spin",
        bytes_per_cell: int = 128,
        seed: int = 0,
    ):
        if vocab_size < 2 or max_seq_len < 1 or page < 1 or max_batch < 1:
            raise ValueError("vocab_size >= 2, max_seq_len, page and max_batch >= 1")
        eos = tuple(sorted(set(eos_ids))) if eos_ids is not None else (vocab_size - 1,)
        if not eos or not all(0 <= e < vocab_size for e in eos):
            raise ValueError(f"eos_ids must be non-empty ids below {vocab_size}")
        if 0 < cells_total < page:
            raise ValueError(f"cells_total {cells_total} is less than a page ({page})")
        if cost_mode not in ("spin", "sleep"):
            raise ValueError("cost_mode is 'spin' or 'sleep'")
        if copy_shares_cells is None:
            copy_shares_cells = not exact_only  # a recurrent state has no pages to share
        self._sampling = _host_sampling() if engine_sampling and engine_draws else None
        self.desc = RuntimeDescription(
            runtime_id="fake", numeric_class="fake",
            vocab_size=vocab_size,
            max_seq_len=max_seq_len,
            max_batch=max_batch,
            max_seqs=max_seqs,
            page=page,
            truncate_partial=not exact_only,
            copy_shares_cells=copy_shares_cells,
            takeover_preferred=takeover_preferred,
            prefill_step_tokens=prefill_step_tokens,
            engine_sampling=engine_sampling,
            engine_draws=self._sampling is not None,
            verify_batches=verify_batches,
            exact_only=exact_only,
        )
        self._page = page
        self._blocks_total = cells_total // page  # 0 = unlimited
        self._bytes_per_cell = bytes_per_cell
        self._eos = eos
        self._eos_set = frozenset(eos)
        self._model = FakeModel(seed, vocab_size, eos, eos_rate)
        self._step_cost = step_cost
        self._token_cost = token_cost
        self._cost_mode = cost_mode

        self._seqs: dict[int, FakeSeq] = {}
        self._next_seq = 1  # ids are never reused, so a stale id stays unknown
        self._pool = self._new_pool()
        self._init_faults()
        self._closed = False
        self.stats = FakeStats()

    # ------------------------------------------------------------ introspection

    def seq_tokens(self, seq: int) -> tuple[int, ...]:
        """The tokens a sequence holds (tests check forward-once with it)."""
        return tuple(self._get(seq).tokens)

    def live_seqs(self) -> list[int]:
        return sorted(self._seqs)

    def reset_stats(self) -> None:
        self.stats = FakeStats()

    # ------------------------------------------------------------ the pool

    def _get(self, seq: int) -> FakeSeq:
        s = self._seqs.get(seq)
        if s is None:
            raise UnknownSequence(f"no live sequence {seq}")
        return s

    def _new_pool(self) -> BlockPool:
        return BlockPool(self._blocks_total or None, self._page, trash=False)

    # ------------------------------------------------------------ sequences

    def seq_create(self) -> int:
        self._alive()
        if self.desc.max_seqs and len(self._seqs) >= self.desc.max_seqs:
            raise CapacityError(f"{self.desc.max_seqs} sequences live")
        self._injected("create")
        seq = self._next_seq
        self._next_seq += 1
        self._seqs[seq] = FakeSeq([], [], [])
        self.stats.creates += 1
        return seq

    def seq_len(self, seq: int) -> int:
        return len(self._get(seq).tokens)

    def seq_free(self, seq: int) -> None:
        self._alive()
        s = self._get(seq)
        self._injected("free")
        del self._seqs[seq]
        self._pool.decref(s.blocks)
        self._lane_faults.pop(seq, None)
        self.stats.frees += 1

    def seq_truncate(self, seq: int, n: int) -> None:
        self._alive()
        s = self._get(seq)
        size = len(s.tokens)
        if not 0 <= n <= size:
            raise OutOfBounds(f"truncate to {n} of a sequence of {size}")
        if self.desc.exact_only and n not in (0, size):
            raise OutOfBounds(f"exact_only: truncate only to 0 or {size}, not {n}")
        self._injected("truncate")
        self._truncate_blocks(s, n)
        self.stats.truncates += 1

    def seq_settle(self, seq: int) -> None:
        self._alive()
        s = self._get(seq)
        if s.decoded:
            self._model.rechain(s, len(s.tokens) - s.decoded)

    def seq_copy(self, src: int, dst: int, n: int) -> None:
        self._alive()
        s, d = self._get(src), self._get(dst)
        size = len(s.tokens)
        if not 0 <= n <= size:
            raise OutOfBounds(f"copy of {n} cells from a sequence of {size}")
        if self.desc.exact_only and n not in (0, size):
            raise OutOfBounds(f"exact_only: copy only a whole sequence ({size}), not {n}")
        self._injected("copy")
        if src == dst:  # dst holds the first n cells of itself: a truncate
            self._truncate_blocks(d, n)
            self.stats.copies += 1
            return
        share = self.desc.copy_shares_cells
        fresh = self._pool.blocks_for(n) - (n // self._page if share else 0)
        # dst's own blocks that nobody else holds come back first (src holds the ones it shares).
        if not self._pool.fits(fresh - self._pool.released_by([d])):
            raise CapacityError(f"copy of {n} cells needs {fresh} blocks")
        self._pool.decref(d.blocks)
        blocks = self._pool.prefix(s, n, share)
        d.tokens, d.chain, d.blocks = s.tokens[:n], s.chain[:n], blocks
        d.decoded = max(0, n - (size - s.decoded))
        self.stats.copies += 1

    def _truncate_blocks(self, s: FakeSeq, n: int) -> None:
        self._pool.cut(s, n)
        s.decoded = max(0, n - (len(s.tokens) - s.decoded))
        del s.tokens[n:], s.chain[n:]

    # ------------------------------------------------------------ steps

    def _check_feeds(self, feeds: Sequence[Feed]) -> list[tuple[FakeSeq, list[int]]]:
        """Every check of a step, before anything moves; the feeds resolved."""
        vocab, limit = self.desc.vocab_size, self.desc.max_seq_len
        seen: set[int] = set()
        out: list[tuple[FakeSeq, list[int]]] = []
        for f in feeds:
            s = self._get(f.seq)
            if f.seq in seen:
                raise OutOfBounds(f"sequence {f.seq} fed twice in one step")
            seen.add(f.seq)
            try:
                toks = [operator.index(t) for t in f.tokens]
            except TypeError as e:
                raise OutOfBounds(f"sequence {f.seq}: tokens must be ints") from e
            if not toks:
                raise OutOfBounds(f"sequence {f.seq}: an empty feed")
            if min(toks) < 0 or max(toks) >= vocab:
                raise OutOfBounds(f"sequence {f.seq}: a token outside [0, {vocab})")
            if len(s.tokens) + len(toks) > limit:
                raise OutOfBounds(f"sequence {f.seq}: {len(s.tokens)} + {len(toks)} cells > {limit}")
            out.append((s, toks))
        return out

    def _advance(self, feeds: Sequence[Feed]) -> list[tuple[FakeSeq, int]]:
        """Check, inject, reserve and append: the shared body of every step.
        Returns each feed's sequence and the length it had before."""
        self._alive()
        self.stats.step_calls += 1
        resolved = self._check_feeds(feeds)
        self._injected("step", [f.seq for f in feeds])
        need = 0
        for s, toks in resolved:
            need += self._pool.grow_cost(s, len(toks))
        if not self._pool.fits(need):
            raise CapacityError(f"step needs {need} more blocks")
        n_tokens = sum(len(t) for _, t in resolved)
        spend(self.stats, self._step_cost + self._token_cost * n_tokens, self._cost_mode)
        out: list[tuple[FakeSeq, int]] = []
        modes = self.desc.exact_only
        for (s, toks), f in zip(resolved, feeds):
            start = len(s.tokens)
            self._pool.grow(s, len(toks))
            decode = modes and f.decode and len(toks) == 1
            if modes and not decode and s.decoded:
                self._model.rechain(s, start - s.decoded)  # prefill redoes what decode fed
            self._model.append(s, toks, decode)
            out.append((s, start))
        self.stats.steps += 1
        self.stats.tokens_fed += n_tokens
        return out

    def step(self, feeds: Sequence[Feed]) -> list[np.ndarray]:
        if not feeds:
            return []
        done = self._advance(feeds)
        rows = [self._model.row(s.chain[-1], len(s.tokens)) for (s, _), f in zip(done, feeds) if f.wants_row]
        self.stats.rows += len(rows)
        return rows

    def step_rows(self, feeds: Sequence[Feed]) -> list[np.ndarray] | None:
        if not feeds:
            return []
        done = self._advance(feeds)
        out = [np.stack([self._model.row(s.chain[i], i + 1) for i in range(start, len(s.tokens))])
               for s, start in done]
        self.stats.rows += sum(len(r) for r in out)
        return out

    def step_sampled(self, feeds: Sequence[Feed], specs: Sequence[SampleSpec],
                     masks: TokenMasks | None = None) -> list[int] | None:
        if not self.desc.engine_sampling:
            return None
        if len(specs) != len(feeds):
            raise OutOfBounds(f"{len(specs)} sample specs for {len(feeds)} feeds")
        if not self.desc.engine_draws and any(sp.temperature > 0 for sp in specs):
            raise Unsupported("this fake samples greedily only (engine_draws is off)")
        if not feeds:
            return []
        masks = check_masks(masks, len(feeds), self.desc.vocab_size)
        mask_of = {} if masks is None else dict(zip(masks.rows, masks.bits))
        done = self._advance(feeds)
        out = []
        for i, ((s, _), sp, f) in enumerate(zip(done, specs, feeds)):
            row = self._model.row(s.chain[-1], len(s.tokens))
            if f.seq in self.nan_rows:
                row = np.full_like(row, np.nan)
            if not row_finite(row):
                out.append(NONFINITE)
                continue
            if i in mask_of:
                from superfluid.kernels.bitmask import apply_bitmask_row

                apply_bitmask_row(row, mask_of[i])
            if sp.temperature > 0 and self._sampling is not None:
                tok = self._sampling.sample(row, sp.temperature, sp.top_k, sp.top_p, sp.min_p,
                                            sp.rng_position)
            else:
                tok = np.argmax(row)  # the lowest id on ties, as contract §5 wants
            out.append(int(tok))
        self.stats.sampled += len(out)
        return out

    # ------------------------------------------------------------ export / import

    def seq_export(self, seq: int) -> bytes:
        self._alive()
        s = self._get(seq)
        self._injected("export")
        self.stats.exports += 1
        return self._model.pack(s.tokens, s.decoded)

    def export_bytes_max(self) -> int:
        return self._model.blob_bytes_max(self.desc.max_seq_len)

    def seq_import(self, seq: int, data: bytes) -> int:
        self._alive()
        s = self._get(seq)
        if s.tokens:
            raise OutOfBounds(f"import into sequence {seq}, which holds {len(s.tokens)} cells")
        toks, decoded = self._model.parse(data, self.desc.max_seq_len)
        self._injected("import")
        need = self._pool.blocks_for(len(toks))
        if not self._pool.fits(need):
            raise CapacityError(f"import of {len(toks)} cells")
        s.tokens = toks
        self._model.rechain(s, 0, decoded)
        s.blocks = self._pool.alloc(need)
        self.stats.imports += 1
        return len(toks)

    # ------------------------------------------------------------ counters

    def cell_bytes(self) -> int:
        return self._bytes_per_cell

    def mem_counters(self) -> MemCounters:
        used = self._pool.n_used * self._page
        return MemCounters(self._blocks_total * self._page, used, used * self._bytes_per_cell, len(self._seqs))

    def cells_released(self, seqs: Sequence[int]) -> int:
        return self._page * self._pool.released_by([self._get(seq) for seq in set(seqs)])

    def vocabulary(self) -> Vocabulary:
        specials = {"<eos>": self._eos[0]}
        specials.update({f"<eos{i}>": e for i, e in enumerate(self._eos[1:], 1)})
        return Vocabulary(self.desc.vocab_size, self._eos_set, specials)

    def is_eos(self, token: int) -> bool:
        return token in self._eos_set

    def close(self) -> None:
        self._seqs.clear()
        self._pool = self._new_pool()
        self._closed = True

    def __repr__(self) -> str:
        m = self.mem_counters()
        return f"FakeRuntime(seqs={m.seqs}, cells={m.cells_used}/{m.cells_total or 'inf'}, {self.desc})"
