"""`LocalClient`: the planner's view of an executor in this process.

The same calls the reference planner makes of a `Client`, answered by an
in-process `Executor` instead of a worker across shared memory: the
baseline `bench e2e` compares the daemon path against, and a way to run the
planner in tests without a process.
"""

from __future__ import annotations

import itertools
from typing import Any

import msgpack
import numpy as np

from superfluid.abi.records import LaneCommit, LaneEmit, OpCompletion, PartialEmit, RingRef, TickEvents, TickPlan
from superfluid.client.builder import PlanBuilder
from superfluid.client.describe import Parallel, parallel_of
from superfluid.executor import Executor


class LocalClient:
    def __init__(self, executor: Executor):
        self.ex = executor
        self._next_seq = 1
        self._lane_tags = itertools.count(1)
        self._describe: dict[str, Any] | None = None
        self._op_ids = itertools.count(1)
        self._partials: list[PartialEmit] = []
        executor.partial_sink = lambda seq, tag, tok, idx: self._partials.append(PartialEmit(seq, tag, tok, idx))

    def op(self, name: str, timeout: float | None = None, **fields: Any) -> OpCompletion:
        """Run op `name` (contract §7) at once: no tick is running in between."""
        return self.ex.op({"op": name, "op_id": next(self._op_ids), **fields})

    def partial_emits(self) -> list[PartialEmit]:
        """Tokens as they were sampled, for plans with PARTIAL_EMITS."""
        out, self._partials = self._partials, []
        return out

    def describe(self, timeout: float | None = None) -> dict[str, Any]:
        if self._describe is None:
            body = msgpack.unpackb(self.ex.op({"op": "DESCRIBE", "op_id": 0}).payload, raw=False,
                                   strict_map_key=False)
            parallel_of(body)
            self._describe = body
        return self._describe

    def parallel(self, timeout: float | None = None) -> Parallel:
        """DESCRIBE's `parallel`: the worker's tp degree and node count."""
        return parallel_of(self.describe(timeout))

    def new_lane_tag(self) -> int:
        return next(self._lane_tags)

    def take_orphans(self) -> set[int]:
        return set()  # one process: no plan outlives its executor

    def reconnect(self, timeout: float | None = None) -> int:
        raise RuntimeError("an in-process executor does not restart")

    def tick(self, plan: TickPlan | PlanBuilder, timeout: float | None = None) -> TickEvents:
        record = plan.build() if isinstance(plan, PlanBuilder) else plan
        if not record.plan_seq:
            record = record._replace(plan_seq=self._next_seq)
        self._next_seq = record.plan_seq + 1
        return self.ex.tick(record).events

    def write_prompt(self, tokens) -> RingRef:
        return self.ex.rings.prompt.write(np.asarray(tokens, dtype=np.uint32))

    def tokens(self, emit: LaneEmit) -> list[int]:
        return self.ex.rings.tokens.read(emit.token_ref).tolist() if emit.n_tokens else []

    def logits_row(self, emit: LaneEmit) -> np.ndarray:
        return self.ex.rings.logits.read(emit.logits_row)

    @staticmethod
    def commit(emit: LaneEmit, token_id: int) -> LaneCommit:
        return LaneCommit(emit.lane_tag, int(token_id), emit.logits_nonce)
