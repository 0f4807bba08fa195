"""Lanes: one request's stream inside the executor, named by its lane_tag."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from superfluid.abi.records import RingRef, SamplingParams

if TYPE_CHECKING:
    from superfluid.executor.grammar import Matcher
    from superfluid.executor.host_sampling import Bias
    from superfluid.executor.speculation import LaneSpec


@dataclasses.dataclass(slots=True)
class PendingRow:
    """A HOST lane's logits row waiting for the planner's commit."""

    nonce: int
    ref: RingRef


@dataclasses.dataclass(slots=True)
class Lane:
    tag: int
    seq: int  # the runtime sequence holding its cells
    sampling: int  # SF_SAMPLING_*
    params: SamplingParams
    rng_base: int
    prompt: list[int]
    prefill_end: int  # prompt tokens prefill feeds; the rest (decode_replay) decode replays
    prefilled: int = 0  # prompt tokens given to prefill so far
    committed: list[int] = dataclasses.field(default_factory=list)  # prompt so far + sampled tokens
    # Forward-once: the last committed token when it is not yet in the sequence
    # (the sequence holds committed minus this one).
    pending_input: int | None = None
    pending_row: PendingRow | None = None
    finished: bool = False
    rng_counter: int = 0  # sampled and committed tokens: draw position = rng_base + rng_counter
    bias: Bias | None = None  # a registered logit bias
    grammar_handle: int = 0  # the grammar it borrows (Registry.grammars), 0 = none
    grammar: Matcher | None = None  # while it borrows one
    logprobs_top: int | None = None  # alternatives wanted per token (want_logprobs - 1), None = no logprobs
    granted_class: int = 0
    spec: LaneSpec | None = None  # when it was admitted with a strategy it can draft with
    # Fixed for the lane's life, worked out once at admission (the decode loop reads them every round).
    greedy: bool = False
    ignore_eos: bool = False
    engine_ok: bool = False  # the engine may sample it (no host-only step applies)
    session: int = 0  # the planner session that admitted it (Lanes.session then)

    @property
    def position(self) -> int:
        """The draw position of the lane's next sampled token."""
        return (self.rng_base + self.rng_counter) & 0xFFFFFFFFFFFFFFFF

    @property
    def ingested(self) -> int:
        """Tokens in the sequence (committed less the pending one)."""
        return len(self.committed) - (self.pending_input is not None)

    @property
    def generated(self) -> int:
        """Tokens produced so far (sampled or committed; replayed prompt tokens are prompt)."""
        return max(0, len(self.committed) - len(self.prompt))

    @property
    def phase(self) -> str:
        """What the lane waits for: "prefilling" (prompt tokens left for prefill),
        "decoding" (ready to decode, or to be committed), "finished" (its retire)."""
        if self.finished:
            return "finished"
        return "prefilling" if self.prefilled < self.prefill_end else "decoding"

    def drafter(self) -> LaneSpec:
        """The LaneSpec of a lane the caller knows drafts."""
        assert self.spec is not None
        return self.spec

    def matcher(self) -> Matcher:
        """The grammar of a lane the caller knows borrows one."""
        assert self.grammar is not None
        return self.grammar


class FaultedLanes(set[int]):
    """Faulted lanes not yet retired: the set of their tags (what the checks
    read), which also keeps each lane as it was when it faulted (its sequence
    is gone), for LIST_LANES and a retire by session."""

    def __init__(self) -> None:
        super().__init__()
        self.lanes: dict[int, Lane] = {}

    def keep(self, lane: Lane) -> None:
        self.add(lane.tag)
        self.lanes[lane.tag] = lane

    def discard(self, tag: object) -> None:
        super().discard(tag)
        self.lanes.pop(tag, None)  # type: ignore[call-overload]  # set.discard takes any object; so does pop


class Lanes(dict[int, Lane]):
    """The live lanes by tag (the dict itself), and what the executor keeps
    about lanes beside them: the faulted ones, faults op INJECT_FAULT armed,
    the newest fault, and the planner session they are admitted for."""

    def __init__(self) -> None:
        super().__init__()
        self.faulted = FaultedLanes()  # faulted lanes not yet retired: their tags
        self.injected: dict[int, int] = {}  # lane tag -> fault code, fired at its next decode
        self.last_fault: tuple[int, int] | None = None  # (lane, code) of the newest LaneFault
        self.session = 0  # the planner session served now (the worker sets it); lanes record it
