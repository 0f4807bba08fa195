"""The reference planner's state (client/planner.py): a Request is what the
user asked and what came back; a Lane is a request's current admission on the
worker, named by a lane tag that is never reused; a Report is what a run gives
back."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from superfluid.abi import Sampling
from superfluid.abi.records import LaneCommit, SamplingParams
from superfluid.client.builder import PlanBuilder
from superfluid.client.grammars import GrammarSpec
from superfluid.client.seeding import Seed

# A host sampler picks a token from a logits row; `position` is the draw's
# rng position (rng_base + tokens sampled so far), the same key the engine uses.
HostSampler = Callable[[np.ndarray, int], int]


@dataclasses.dataclass(eq=False)
class Request:
    """What the user asked, and what came back so far."""

    id: int
    prompt: list[int]
    max_new_tokens: int
    sampling: Sampling
    params: SamplingParams
    rng_base: int
    publish: bool
    host_sampler: HostSampler | None
    stop_at_eos: bool
    submitted_at: float
    generated: list[int] = dataclasses.field(default_factory=list)
    token_times: list[float] = dataclasses.field(default_factory=list)
    # "eos", "grammar", "length" (max_seq_len), "max_tokens", "unservable" (memory), "fault" (Planner._absorb_faults)
    finish: str | None = None
    finished_at: float | None = None
    admissions: int = 0  # > 1: re-admitted after a restart, a fault or a preemption
    faults: int = 0  # its lanes' faults in a row (no token between), not counting injected or OOM ones
    grammar: GrammarSpec | None = None  # its output is constrained to this
    speculate: bool = False  # admitted with the planner's strategy (drafting never changes its tokens)
    seed: Seed | None = None  # a lease for its next admission
    no_seed: bool = False  # its lease went stale: admit it without one this time

    @property
    def done(self) -> bool:
        return self.finish is not None


@dataclasses.dataclass(eq=False)
class Lane:
    """One admission of a request on the worker."""

    tag: int
    request: Request
    prefill_end: int  # prompt tokens prefill feeds; the generated tail is replayed by decode
    replay_left: int  # generated tokens decode has still to replay
    prefilled: int = 0  # prompt tokens the executor has taken
    commit: LaneCommit | None = None  # HOST: the sampled token the next plan commits
    retiring: bool = False  # finished: the next plan retires it


@dataclasses.dataclass
class RequestResult:
    id: int
    tokens: list[int]
    finish: str | None
    ttft_s: float | None  # submit to first token
    latency_s: float | None  # submit to finish
    token_times: list[float]  # clock() when each token reached the planner
    admissions: int


@dataclasses.dataclass
class PlannerStats:
    ticks: int = 0  # plans applied
    replans: int = 0  # NeedsReplan answers
    tokens: int = 0
    wall_s: float = 0.0
    tick_s: float = 0.0  # of it, inside the plans the worker applied (their TickTimings.wall_ns)
    tokens_per_s: float = 0.0
    ttft_p50_s: float | None = None
    ttft_p99_s: float | None = None
    prefill_chunks_shed: int = 0
    prefill_tokens_shed: int = 0
    evictions: int = 0
    bytes_evicted: int = 0
    faults: int = 0
    preemptions: int = 0
    restarts: int = 0  # WorkerRestarted seen (each followed by a reconnect)
    seeded_tokens: int = 0  # prompt tokens admissions took from seed leases (cache hits)
    leases: int = 0  # LEASE_SEED asked and granted
    draft_proposed: int = 0  # draft tokens the worker verified (LaneEmit.spec)
    draft_accepted: int = 0  # of them, the tokens taken


@dataclasses.dataclass
class Report:
    results: dict[int, RequestResult]
    stats: PlannerStats


@dataclasses.dataclass
class Draft:
    """A plan and what it means to the planner; applied only once accepted
    (a refused plan changed nothing, on either side)."""

    builder: PlanBuilder
    admits: list[Lane] = dataclasses.field(default_factory=list)
    prefills: dict[int, int] = dataclasses.field(default_factory=dict)  # tag -> tokens offered
    reached: dict[int, int] = dataclasses.field(default_factory=dict)  # tag -> prefilled after, by the budget
    decodes: dict[int, int] = dataclasses.field(default_factory=dict)  # tag -> tokens granted
    commits: list[int] = dataclasses.field(default_factory=list)
    retires: list[int] = dataclasses.field(default_factory=list)
    published: list[list[int]] = dataclasses.field(default_factory=list)  # tokens of publishing retires
    seeded: dict[int, int] = dataclasses.field(default_factory=dict)  # tag -> tokens its lease covers
