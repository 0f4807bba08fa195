"""What a Tick's phases share (tick.py, admit.py, decode.py, replay.py,
speculation_decode.py): each phase derives from TickState, so each sees the
attributes Tick and RetirePhase set and the methods one phase calls on
another, each defined once, on the phase that owns it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

    from superfluid.abi.records import AdmitResult, LaneFault as LaneFaultRecord, LaneLogprob, ShedEntry, TickPlan
    from superfluid.engine.runtime import Feed, Runtime, RuntimeFailure
    from superfluid.executor.check import Verdict
    from superfluid.executor.decode import DecodeRound
    from superfluid.executor.executor import Executor
    from superfluid.executor.lanes import Lane
    from superfluid.executor.speculation import Strategy


class TickState:
    """Declarations only: RetirePhase.__init__ and Tick.__init__ set these."""

    # RetirePhase (tick.py): also op RETIRE_LANES's, without a plan.
    ex: Executor
    rt: Runtime
    shed: list[ShedEntry]
    now: int
    evictions: int
    bytes_evicted: int
    # Tick (tick.py)
    plan: TickPlan
    verdict: Verdict
    admit_results: list[AdmitResult]
    faults: list[LaneFaultRecord]
    faulted_now: set[int]
    chunks_dropped: int
    logprobs: list[LaneLogprob]
    rows: dict[int, np.ndarray]
    out_tokens: dict[int, list[int]]
    finishes: dict[int, int]
    partial: bool
    yielded: bool
    cells_after: dict[int, int]
    # Drafting (speculation_decode.py)
    spec_over: dict[int, int]
    spec_stats: dict[int, list[int]]
    spec_rows: dict[int, tuple[np.ndarray, list[int]]]
    spec_decisions: dict[Strategy, bool]
    spec_lanes: int
    spec_free_rows: int

    if TYPE_CHECKING:
        # RetirePhase (tick.py)
        def free(self, seq: int, during: str) -> None: ...
        def _shed_entry(self, tag: int, reason: int, nbytes: int, tokens: int) -> None: ...

        # Tick (tick.py)
        def fault(self, tag: int, code: int, detail: int = 0) -> None: ...
        def step(self, feeds: list[Feed], tags: list[int], during: str) -> list[np.ndarray] | None: ...
        def step_failed(self, e: RuntimeFailure, tags: list[int], during: str,
                        remaining: dict[int, int] | None = None) -> None: ...

        # DecodePhase (decode.py)
        def _finish(self, lane: Lane, code: int, remaining: dict[int, int]) -> None: ...
        def _host_pick(self, lane: Lane, row: np.ndarray, mask: np.ndarray | None = None) -> int: ...
        def _step_chunk(self, chunk: list[tuple[int, int]], r: DecodeRound) -> None: ...

        # FaultPhase (fault_phase.py)
        def numeric_fault(self, lane: Lane, remaining: dict[int, int]) -> None: ...
        def token_rules(self, lane: Lane, remaining: dict[int, int]) -> bool: ...

        # ReplayPhase (replay.py)
        def _replay(self, replaying: list[int], remaining: dict[int, int]) -> None: ...

        # SpecPhase (speculation_decode.py)
        def _spec_begin(self, remaining: dict[int, int]) -> None: ...
        def _spec_end(self, seconds: float, replayed: bool) -> None: ...
        def _drafts(self, round_: list[tuple[int, int]], remaining: dict[int, int]) -> dict[int, list[int]]: ...
        def _verify_chunk(self, chunk: list[tuple[int, int]], drafts: dict[int, list[int]],
                          r: DecodeRound) -> None: ...
        def _take_verified(self, lane: Lane, rows: np.ndarray, draft: list[int], remaining: dict[int, int],
                           eos: frozenset[int], max_len: int) -> int | None: ...
