"""The executor's state that is neither lanes (lanes.py) nor cache entries
(cache.py) nor seed leases (seeds.py): what ops register, what the worker
counts, and what ops leave for the next tick's events."""

from __future__ import annotations

import dataclasses

from superfluid.abi.records import OpCompletion, ShedEntry
from superfluid.engine.runtime import Runtime
from superfluid.executor.grammar import GrammarRegistry
from superfluid.executor.host_sampling import Bias
from superfluid.executor.speculation import StrategyTable
from superfluid.executor.speculation_gate import SpecGate


class Registry:
    """What ops register under handles (biases, grammars) and slots
    (strategies), with what the decode loop works out once from them."""

    def __init__(self, runtime: Runtime) -> None:
        self.biases: dict[int, Bias] = {}  # by handle
        self.grammars = GrammarRegistry.for_runtime(runtime)  # handles, and the lane borrowing each
        self.strategies = StrategyTable()  # op INSTALL_STRATEGY's slots (speculation.py)
        self.spec_gate = SpecGate(self.strategies)  # whether drafting pays; .snapshot() for metrics and benches
        self.next_handle = 1  # biases and grammars share one handle space
        # Tokens penalties never touch (specials, EOS): read from the vocabulary at the first penalized pick.
        self.penalty_exempt: frozenset[int] | None = None

    def new_handle(self) -> int:
        h = self.next_handle
        self.next_handle += 1
        return h


@dataclasses.dataclass
class Counters:
    """What the executor counts (the worker publishes most of it) and measures."""

    tick_count: int = 0  # accepted plans
    last_plan_seq: int | None = None  # the last accepted plan's plan_seq
    tokens_emitted: int = 0
    seeded_tokens: int = 0  # prompt tokens admits took from seeds instead of prefilling
    rejects: int = 0
    nonce: int = 0  # the last logits row nonce handed out (Executor.fresh_nonce)
    prefill_secs_per_token: float | None = None  # a moving average, for the latency step


@dataclasses.dataclass
class Pending:
    """What ops leave for the next tick's events."""

    completions: list[OpCompletion] = dataclasses.field(default_factory=list)
    shed: list[ShedEntry] = dataclasses.field(default_factory=list)  # evictions made by ops

    def take_completions(self) -> list[OpCompletion]:
        out, self.completions = self.completions, []
        return out
