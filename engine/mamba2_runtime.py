"""The Mamba2 runtime (contract §8): an exact_only runtime over a pool of state slots.

A sequence holds one slot (engine/mamba2_state.py): its canonical state at
its last chunk boundary b, the tokens since b, and its live state after its
last token. Chunks sit at fixed absolute positions (multiples of the chunk
length L), so a sequence's rows do not depend on how its prompt was cut into
feeds nor on what else shares a step:

- a prefill feed (any feed not marked decode) recomputes from b: the tokens
  since b plus the new ones, as whole padded chunks; b advances over every
  chunk it completes; live becomes the end state of that computation;
- a decode feed (Feed.decode, one token) takes the recurrent update from the
  live state. Its token joins the tokens since b; when they fill a chunk, the
  same step computes that chunk from b in chunk mode and b advances, so a
  later prefill never recomputes more than L-1 old tokens. A prefill after
  decodes thus gives exactly what a fresh prefill of all the tokens gives.

Cuts: truncate to 0 or to the length (desc.truncate_partial is False); with
partial_truncate=True also to any n >= b (the tokens past n are dropped and
live is rebuilt from b when next needed); copy only whole sequences (or 0).
seq_settle drops a live state that decode feeds made, so that what follows
continues as from a fresh prefill (the executor settles what it publishes).
Cells are tokens, as on the fake exact_only runtime: a
slot can hold a sequence up to max_seq_len, so cells_total is slots x
max_seq_len and the real limit, one slot a sequence, is desc.max_seqs.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np
import torch

from superfluid.engine.mamba2 import Mamba2Config
from superfluid.engine.mamba2_forward import ChunkJob, DecodeJob, Mamba2Forward
from superfluid.engine.mamba2_state import SeqState, StatePool, fingerprint
from superfluid.engine.runtime import (
    CapacityError,
    FatalError,
    Feed,
    LaneFault,
    MemCounters,
    OutOfBounds,
    Runtime,
    RuntimeDescription,
    UnknownSequence,
    Vocabulary,
)
from superfluid.kernels.backend import library_class, machine


def kernels_for(backend: str) -> ModuleType:
    if backend == "torch":
        from superfluid.kernels import ssd
        return ssd
    if backend == "triton":
        from superfluid.kernels import ssd_triton
        return ssd_triton
    raise ValueError(f"backend {backend!r}: expected 'torch' or 'triton'")


DEFAULT_SLOTS = 64  # state slots when neither state_bytes nor max_seqs sizes the pool


class Mamba2Runtime(Runtime):
    PAGE = 16  # the unit cells are counted in (a sequence holds no pages; see the module docstring)

    def __init__(self, cfg: Mamba2Config, weights: dict[str, torch.Tensor], *, backend: str = "torch",
                 device: str | torch.device = "cpu", state_bytes: int | None = None, max_batch: int = 64,
                 max_seqs: int = 0, prefill_step_tokens: int = 512, max_seq_len: int = 1 << 16,
                 chunk_size: int | None = None, partial_truncate: bool = False, eos: Sequence[int] = (),
                 specials: dict[str, int] | None = None,
                 tokenizer_json: str | None = None, runtime_id: str | None = None):
        self.cfg = cfg
        self.L = chunk_size or cfg.chunk_size
        # Cuts below the length but at or past the last chunk boundary are exact too (the state
        # there is rebuilt from the boundary); False keeps to exact_only's 0-or-length.
        self._partial_truncate = partial_truncate
        dev = torch.device(device)
        self.fwd = Mamba2Forward(cfg, weights, kernels_for(backend), dev, self.L)
        slot = StatePool.slot_bytes(cfg)
        if state_bytes is None:
            slots = max_seqs or DEFAULT_SLOTS
        else:
            slots = int(state_bytes) // slot
            if slots < 1:
                raise ValueError(f"state_bytes {state_bytes} is less than one sequence's state "
                                 f"({slot} bytes)")
        self.pool = StatePool(cfg, slots, dev)
        self.seqs: dict[int, SeqState] = {}
        self._next_id = 1
        self._fp = fingerprint(cfg, self.L, weights)
        self.desc = RuntimeDescription(
            runtime_id=runtime_id or f"mamba2-{backend}", vocab_size=cfg.vocab_size, max_seq_len=max_seq_len,
            max_batch=max_batch, max_seqs=min(max_seqs or slots, slots), page=self.PAGE,
            truncate_partial=False,
            copy_shares_cells=False, takeover_preferred=False, prefill_step_tokens=prefill_step_tokens,
            engine_sampling=False, engine_draws=False, verify_batches=False, exact_only=True,
            # the scan is torch's or Triton's on every path: no promise across machines
            numeric_class=library_class(f"mamba2-{backend}", dev, torch.float32, machine(dev)),
            isa=machine(dev))
        self._vocab = Vocabulary(cfg.vocab_size, frozenset(int(e) for e in eos), dict(specials or {}))
        self._tokenizer_json = tokenizer_json
        pages = -(-max_seq_len // self.PAGE)
        self._cells_per_slot = pages * self.PAGE
        self._cell_bytes = max(1, slot // self._cells_per_slot)

    # --------------------------------------------------------- sequences

    def _seq(self, seq: int) -> SeqState:
        s = self.seqs.get(seq)
        if s is None:
            raise UnknownSequence(f"no sequence {seq}")
        return s

    def seq_create(self) -> int:
        if len(self.seqs) >= self.desc.max_seqs:
            raise CapacityError(f"{len(self.seqs)} sequences live, each holds one of {self.desc.max_seqs} "
                                "state slots")
        sid = self._next_id
        self.seqs[sid] = SeqState(self.pool.take())
        self._next_id += 1
        return sid

    def seq_free(self, seq: int) -> None:
        s = self._seq(seq)
        del self.seqs[seq]
        self.pool.give_back(s.slot)

    def seq_len(self, seq: int) -> int:
        return self._seq(seq).length

    def seq_copy(self, src: int, dst: int, n: int) -> None:
        s, d = self._seq(src), self._seq(dst)
        n = _count(n, "copy")
        if n not in (0, s.length):
            raise OutOfBounds(f"exact_only: copy only a whole sequence ({s.length}) or 0, not {n}")
        if src == dst:  # dst holds the first n cells of itself
            self.seq_truncate(src, n)
            return
        if n == 0:
            self._reset(d)
            return
        self.pool.copy(s.slot, d.slot)
        d.boundary, d.since, d.live_valid = s.boundary, list(s.since), s.live_valid

    def seq_truncate(self, seq: int, n: int) -> None:
        s = self._seq(seq)
        n = _count(n, "truncate")
        if not 0 <= n <= s.length:
            raise OutOfBounds(f"truncate to {n} cells of a sequence of {s.length}")
        if n == s.length:
            return
        if n == 0:
            self._reset(s)
            return
        if not self._partial_truncate:
            raise OutOfBounds(f"exact_only: truncate only to 0 or {s.length}, not {n}")
        if n < s.boundary:
            raise OutOfBounds(f"exact_only: truncate to 0, to the length ({s.length}) or to at least the "
                              f"last chunk boundary ({s.boundary}), not {n}: the state before it is gone")
        del s.since[n - s.boundary:]
        s.live_valid = False  # rebuilt from the boundary when next needed

    def seq_settle(self, seq: int) -> None:
        s = self._seq(seq)
        if s.length:
            # Decode feeds may have made it (even where b is the length: a decode that fills a
            # chunk moves b); rebuilt from b, the prefill way, when next needed.
            s.live_valid = False

    def _reset(self, s: SeqState) -> None:
        self.pool.reset(s.slot)
        s.boundary, s.since, s.live_valid = 0, [], True

    # -------------------------------------------------------------- steps

    def _check(self, feeds: Sequence[Feed]) -> list[tuple[SeqState, list[int], bool]]:
        if len(feeds) > self.desc.max_batch:
            raise OutOfBounds(f"{len(feeds)} feeds in one step, max_batch is {self.desc.max_batch}")
        out, seen, vocab = [], set(), self.cfg.vocab_size
        for f in feeds:
            s = self._seq(f.seq)
            if f.seq in seen:
                raise OutOfBounds(f"sequence {f.seq} fed twice in one step")
            seen.add(f.seq)
            try:
                toks = [operator.index(t) for t in f.tokens]
            except TypeError:
                raise OutOfBounds(f"a token of sequence {f.seq} is not an integer") from None
            if not toks:
                raise OutOfBounds(f"an empty feed for sequence {f.seq}")
            if min(toks) < 0 or max(toks) >= vocab:
                raise OutOfBounds(f"a token of sequence {f.seq} is outside the vocabulary of {vocab}")
            if s.length + len(toks) > self.desc.max_seq_len:
                raise OutOfBounds(f"sequence {f.seq} would hold {s.length + len(toks)} cells, "
                                  f"max_seq_len is {self.desc.max_seq_len}")
            decode = bool(f.decode)
            if decode and len(toks) != 1:
                raise OutOfBounds(f"a decode feed for sequence {f.seq} has {len(toks)} tokens, not 1")
            out.append((s, toks, decode))
        return out

    def step(self, feeds: Sequence[Feed]) -> list[np.ndarray]:
        if not feeds:
            return []
        resolved = self._check(feeds)
        chunk_jobs: list[ChunkJob] = []
        decode_jobs: list[DecodeJob] = []
        rows: list[tuple[str, int]] = []
        plan = []  # per feed: (kind, index of its job, index of its chunk-advance job or None)
        for (s, toks, decode), f in zip(resolved, feeds):
            if not decode:
                chunk_jobs.append(ChunkJob(s.slot, s.since + toks))
                plan.append(("c", len(chunk_jobs) - 1, None))
                if f.wants_row:
                    rows.append(("c", len(chunk_jobs) - 1))
                continue
            if s.live_valid:
                source: str | int = "live"
            elif not s.since:
                source = "canon"
            else:  # the live state was cut: rebuild it from b first, in the same step
                chunk_jobs.append(ChunkJob(s.slot, list(s.since)))
                source = len(chunk_jobs) - 1
            advance = None
            if len(s.since) + 1 == self.L:  # this token completes a chunk: compute it canonically
                chunk_jobs.append(ChunkJob(s.slot, s.since + toks))
                advance = len(chunk_jobs) - 1
            decode_jobs.append(DecodeJob(s.slot, toks[0], source))
            plan.append(("d", len(decode_jobs) - 1, advance))
            if f.wants_row:
                rows.append(("d", len(decode_jobs) - 1))
        try:
            out = self.fwd(chunk_jobs, decode_jobs, rows, self.pool)
            logits = out.logits.cpu().numpy() if out.logits is not None else None
        except torch.cuda.OutOfMemoryError as e:
            raise CapacityError(f"device memory: {e}") from e
        except (CapacityError, LaneFault):
            raise
        except Exception as e:
            raise FatalError(f"forward pass failed: {e!r}") from e
        self._commit(resolved, plan, chunk_jobs, out)
        return [logits[i] for i in range(len(rows))]

    def _commit(self, resolved, plan, chunk_jobs: list[ChunkJob], out) -> None:
        """Every state the step computed into the pool, then the lengths: nothing
        before here changed anything."""
        full = {}  # chunk job -> its row in out.boundary
        for j, job in enumerate(chunk_jobs):
            if len(job.tokens) >= self.L:
                full[j] = len(full)
        canon_slots, canon_rows, live = [], [], ([], [], [])  # live: slots, ("e"|"d", row)
        for (s, _toks, _), (kind, i, advance) in zip(resolved, plan):
            if kind == "c":
                if i in full:
                    canon_slots.append(s.slot)
                    canon_rows.append(full[i])
                live[0].append(s.slot)
                live[1].append(i)
                live[2].append(False)
            else:
                if advance is not None:
                    canon_slots.append(s.slot)
                    canon_rows.append(full[advance])
                live[0].append(s.slot)
                live[1].append(i)
                live[2].append(True)
        pool = self.pool
        dev = pool.canon_conv.device
        idx = lambda v: torch.tensor(v, dtype=torch.long, device=dev)  # noqa: E731

        def write(conv, ssm, slots, src, rows):
            # rows None where they are src's own rows in order (a plain decode round).
            r = None if rows == list(range(src[0].shape[1])) else idx(rows)
            pool.write(conv, idx(slots), src[0], r)
            pool.write(ssm, idx(slots), src[1], r)

        if canon_slots:
            write(pool.canon_conv, pool.canon_ssm, canon_slots, out.boundary, canon_rows)
        for from_decode in (False, True):
            pick = [k for k, d in enumerate(live[2]) if d == from_decode]
            if pick:
                write(pool.live_conv, pool.live_ssm, [live[0][k] for k in pick],
                      out.decoded if from_decode else out.end, [live[1][k] for k in pick])
        for (s, toks, _), (kind, _i, advance) in zip(resolved, plan):
            if kind == "c":
                allt = s.since + toks
                done = len(allt) // self.L * self.L
                s.boundary += done
                s.since = allt[done:]
            else:
                s.since.append(toks[0])
                if advance is not None:
                    s.boundary += self.L
                    s.since = []
            s.live_valid = True

    @property
    def tokenizer_json(self) -> str | None:
        return self._tokenizer_json

    # ---------------------------------------------------- export / import

    def seq_export(self, seq: int) -> bytes:
        return self.pool.export(self._seq(seq), self._fp)

    def export_bytes_max(self) -> int:
        return self.pool.export_bytes_max(self.L)

    def seq_import(self, seq: int, data: bytes) -> int:
        s = self._seq(seq)
        if s.length:
            raise OutOfBounds(f"import into sequence {seq}, which holds {s.length} cells")
        boundary, since, live_valid, states = self.pool.parse(data, self._fp, self.L, self.cfg.vocab_size,
                                                               self.desc.max_seq_len)
        self.pool.load(s.slot, states)
        s.boundary, s.since, s.live_valid = boundary, since, live_valid
        return s.length

    # ----------------------------------------------------------- counters

    def _cells(self, s: SeqState) -> int:
        return -(-s.length // self.PAGE) * self.PAGE

    def mem_counters(self) -> MemCounters:
        return MemCounters(cells_total=self.pool.slots * self._cells_per_slot,
                           cells_used=sum(self._cells(s) for s in self.seqs.values()),
                           allocated_bytes=self.pool.allocated_bytes, seqs=len(self.seqs))

    def cell_bytes(self) -> int:
        return self._cell_bytes

    def cells_released(self, seqs: Sequence[int]) -> int:
        return sum(self._cells(self._seq(s)) for s in dict.fromkeys(seqs))

    def vocabulary(self) -> Vocabulary:
        return self._vocab

    def is_eos(self, token: int) -> bool:
        return token in self._vocab.eos

    def close(self) -> None:
        self.seqs.clear()


def _count(n: Any, what: str) -> int:
    try:
        return operator.index(n)
    except TypeError:
        raise OutOfBounds(f"{what}: a cell count must be an integer, not {type(n).__name__}") from None
