"""A runtime that fails when told to: the engine's side of fault schedules.

FaultRuntime wraps any Runtime (transformer, Mamba2, fake) for a worker with
fault injection. The executor's schedule (executor/faults.py) says what its
rules armed; here it happens at the runtime's own boundary, as a real
failure would: a fatal error or a capacity failure raised by a step before
it changes anything, a stall or a slowdown spent inside the step, NaN rows
handed to the sampler. Sequence ids only: the engine knows no lanes.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from superfluid.engine.runtime import (
    CapacityError,
    FatalError,
    Feed,
    MemCounters,
    Runtime,
    SampleSpec,
    TokenMasks,
    Vocabulary,
)

__all__ = ["PHASES", "Armed", "FaultRuntime", "InjectedCapacity", "InjectedFatal"]

PHASES = ("prefill", "decode")


class InjectedFatal(FatalError):
    """A fatal error a fault schedule asked for."""


class InjectedCapacity(CapacityError):
    """A capacity failure a fault schedule asked for (its lanes' faults say injected)."""


@dataclasses.dataclass
class Armed:
    """What the next step of a phase does first: "fatal", "capacity" or "stall" (ms)."""

    kind: str
    ms: int = 0
    why: str = ""


class FaultRuntime(Runtime):
    """`inner` with the failures the executor arms. `phase` is the tick's
    ("prefill", "decode", or None between them: a retire's step is neither);
    `fired(kind)` is told of each injection that happens."""

    def __init__(self, inner: Runtime, fired: Callable[[str], None] | None = None):
        self.inner = inner
        self.desc = inner.desc
        self.phase: str | None = None
        self.armed: dict[str, list[Armed]] = {p: [] for p in PHASES}
        self.nan_seqs: set[int] = set()
        self.poisoned: set[int] = set()  # sequences given a NaN row, until the executor faults their lanes
        self.slow_ms = 0
        self.slow_until = 0  # the last tick the slowdown lasts
        self.tick = 0
        self.fired = fired or (lambda kind: None)
        self.sleep: Callable[[float], None] = time.sleep  # a replay passes the stalls by (timings are not compared)
        self.poison_sink: Callable[[int], None] | None = None  # told of each sequence given a NaN row

    def clear(self) -> None:
        for p in PHASES:
            self.armed[p].clear()
        self.nan_seqs.clear()
        self.poisoned.clear()
        self.slow_ms = self.slow_until = 0

    def __getattr__(self, name: str) -> Any:  # what the inner runtime has beyond the interface
        return getattr(self.inner, name)

    # ------------------------------------------------------------ the steps

    def _before(self) -> None:
        """What is armed for this phase, in order; then the slowdown."""
        if self.phase is None:
            return
        armed = self.armed[self.phase]
        while armed:
            a = armed.pop(0)
            self.fired(a.kind)
            if a.kind == "stall":
                self.sleep(a.ms / 1e3)
            elif a.kind == "fatal":
                raise InjectedFatal(f"injected fatal error during {self.phase} ({a.why})")
            else:
                raise InjectedCapacity(f"injected capacity failure during {self.phase} ({a.why})")
        if self.slow_ms and self.tick <= self.slow_until:
            self.sleep(self.slow_ms / 1e3)

    def _poisoned(self, feeds: Sequence[Feed]) -> frozenset[int]:
        """This step's sequences whose next row is to be NaN (taken: once each)."""
        if not self.nan_seqs:
            return frozenset()
        hit = frozenset(f.seq for f in feeds if f.seq in self.nan_seqs and f.wants_row)
        self.nan_seqs -= hit
        self.poisoned |= hit
        for seq in hit:
            self.fired("nan")
            if self.poison_sink is not None:
                self.poison_sink(seq)
        return hit

    def disarm(self, seq: int) -> None:
        """The sequence leaves its lane (a retire; its cells may live on in the cache)."""
        self.nan_seqs.discard(seq)
        self.poisoned.discard(seq)

    def arm(self, phase: str, armed: Armed) -> bool:
        """Arm a failure for the next step of `phase`; False when one of its kind waits there already."""
        if any(a.kind == armed.kind for a in self.armed[phase]):
            return False
        self.armed[phase].append(armed)
        return True

    def step(self, feeds: Sequence[Feed]) -> list[np.ndarray]:
        self._before()
        nan = self._poisoned(feeds)
        rows = self.inner.step(feeds)
        if nan:
            wanting = [f for f in feeds if f.wants_row]
            rows = [np.full_like(r, np.nan) if f.seq in nan else r for r, f in zip(rows, wanting)]
        return rows

    def step_rows(self, feeds: Sequence[Feed]) -> list[np.ndarray] | None:
        if self.inner.step_rows([]) is None:
            return None
        self._before()
        nan = self._poisoned(feeds)
        rows = self.inner.step_rows(feeds)
        if nan and rows is not None:
            rows = [np.full_like(r, np.nan) if f.seq in nan else r for r, f in zip(rows, feeds)]
        return rows

    def step_sampled(self, feeds: Sequence[Feed], specs: Sequence[SampleSpec],
                     masks: TokenMasks | None = None) -> list[int] | None:
        if not self.desc.engine_sampling:
            return None
        self._before()
        nan = self._poisoned(feeds)
        self.inner.nan_rows = nan
        try:
            return self.inner.step_sampled(feeds, specs, masks)
        finally:
            self.inner.nan_rows = frozenset()

    # ------------------------------------------------------ the rest, as is

    def seq_create(self) -> int:
        return self.inner.seq_create()

    def seq_copy(self, src: int, dst: int, n: int) -> None:
        self.inner.seq_copy(src, dst, n)

    def seq_truncate(self, seq: int, n: int) -> None:
        self.inner.seq_truncate(seq, n)

    def seq_settle(self, seq: int) -> None:
        self.inner.seq_settle(seq)

    def seq_free(self, seq: int) -> None:
        self.disarm(seq)
        self.inner.seq_free(seq)

    def seq_len(self, seq: int) -> int:
        return self.inner.seq_len(seq)

    @property
    def tokenizer_json(self) -> str | None:
        return self.inner.tokenizer_json

    def seq_export(self, seq: int) -> bytes:
        return self.inner.seq_export(seq)

    def seq_import(self, seq: int, data: bytes) -> int:
        return self.inner.seq_import(seq, data)

    def export_bytes_max(self) -> int:
        return self.inner.export_bytes_max()

    def mem_counters(self) -> MemCounters:
        return self.inner.mem_counters()

    def cells_released(self, seqs: Sequence[int]) -> int:
        return self.inner.cells_released(seqs)

    def vocabulary(self) -> Vocabulary:
        return self.inner.vocabulary()

    def is_eos(self, token: int) -> bool:
        return self.inner.is_eos(token)

    def cell_bytes(self) -> int:
        return self.inner.cell_bytes()

    def idle(self) -> None:
        self.inner.idle()

    def close(self) -> None:
        self.inner.close()
