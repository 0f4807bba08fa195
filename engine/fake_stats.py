"""What the fake runtime was asked to do, and the simulated cost of its steps."""

from __future__ import annotations

import dataclasses
import time


@dataclasses.dataclass
class FakeStats:
    """What the runtime was asked to do; a benchmark subtracts simulated_ns."""

    step_calls: int = 0  # every step/step_rows/step_sampled call, failed ones too
    steps: int = 0  # steps that ran
    tokens_fed: int = 0
    rows: int = 0  # rows returned (step and step_rows)
    sampled: int = 0  # tokens returned by step_sampled
    creates: int = 0
    copies: int = 0
    truncates: int = 0
    frees: int = 0
    exports: int = 0
    imports: int = 0
    faults: int = 0  # injected failures raised
    simulated_ns: int = 0  # cost asked by step_cost/token_cost


def spend(stats: FakeStats, seconds: float, mode: str) -> None:
    """The simulated cost of a step: a sleep, or a spin a benchmark can subtract."""
    if seconds <= 0:
        return
    ns = int(seconds * 1e9)
    stats.simulated_ns += ns
    if mode == "sleep":
        time.sleep(seconds)
        return
    end = time.perf_counter_ns() + ns
    while time.perf_counter_ns() < end:
        pass
