"""Planner side: build TickPlans, read TickEvents.

What tests, benchmarks and the Python reference planner use to speak the
ABI, and what a Rust or Go planner's author can read as the example of how
the records are filled.
"""

from __future__ import annotations

from superfluid.abi import Sampling, codec
from superfluid.abi.records import (
    LaneAdmit,
    LaneCommit,
    LaneDecode,
    LanePrefill,
    LaneRetire,
    RingRef,
    SamplingParams,
    TickEvents,
    TickPlan,
)


def sampling_params(temperature: float = 0.0, top_k: int = 0, top_p: float = 0.0, min_p: float = 0.0,
                    repeat_penalty: float = 0.0, presence_penalty: float = 0.0, freq_penalty: float = 0.0,
                    ignore_eos: bool = False) -> SamplingParams:
    """SamplingParams with everything off unless asked (0 = off)."""
    from superfluid.abi import ParamFlag

    return SamplingParams(temperature, top_k, top_p, min_p, repeat_penalty, presence_penalty, freq_penalty,
                          int(ParamFlag.IGNORE_EOS) if ignore_eos else 0)


class PlanBuilder:
    """Accumulates one tick's plan. Lists keep the order they are added in
    (prefills run in that order)."""

    def __init__(self, plan_seq: int, *, flags: int = 0, max_decode_lanes: int | None = None,
                 prefill_token_budget: int = 0, evictable_cache_classes: int = 0, max_evict_bytes: int = 0,
                 protected_quota_bytes: int = 0):
        self.plan_seq = plan_seq
        self.flags = flags
        self.max_decode_lanes = max_decode_lanes
        self.prefill_token_budget = prefill_token_budget
        self.evictable_cache_classes = evictable_cache_classes
        self.max_evict_bytes = max_evict_bytes
        self.protected_quota_bytes = protected_quota_bytes
        self.admits: list[LaneAdmit] = []
        self.prefills: list[LanePrefill] = []
        self.decodes: list[LaneDecode] = []
        self.commits: list[LaneCommit] = []
        self.retires: list[LaneRetire] = []

    def admit(self, lane_tag: int, prompt: RingRef, *, sampling: int = Sampling.GPU_GREEDY,
              params: SamplingParams | None = None, rng_counter_base: int = 0, decode_replay: int = 0,
              strategy_slot: int = 0, grammar_handle: int = 0, grammar_replay: int = 0,
              logit_bias_handle: int = 0, seed_handle: int = 0, determinism_class: int = 0,
              want_logprobs: int = 0) -> PlanBuilder:
        self.admits.append(LaneAdmit(
            lane_tag=lane_tag, prompt=prompt, sampling=int(sampling), decode_replay=decode_replay,
            params=params or SamplingParams(), rng_counter_base=rng_counter_base,
            grammar_handle=grammar_handle, logit_bias_handle=logit_bias_handle, seed_handle=seed_handle,
            strategy_slot=strategy_slot, grammar_replay=grammar_replay, determinism_class=determinism_class,
            want_logprobs=want_logprobs))
        return self

    def prefill(self, lane_tag: int, token_offset: int, token_count: int) -> PlanBuilder:
        self.prefills.append(LanePrefill(lane_tag, token_offset, token_count))
        return self

    def decode(self, lane_tag: int, max_new_tokens: int = 1, overshoot: int = 0) -> PlanBuilder:
        self.decodes.append(LaneDecode(lane_tag, max_new_tokens, overshoot))
        return self

    def commit(self, lane_tag: int, token_id: int, logits_nonce: int) -> PlanBuilder:
        self.commits.append(LaneCommit(lane_tag, token_id, logits_nonce))
        return self

    def retire(self, lane_tag: int, publish_to_cache: bool = False) -> PlanBuilder:
        self.retires.append(LaneRetire(lane_tag, int(publish_to_cache)))
        return self

    def build(self) -> TickPlan:
        """The plan record. max_decode_lanes defaults to the decodes added."""
        mdl = len(self.decodes) if self.max_decode_lanes is None else self.max_decode_lanes
        # Positional: this runs once per tick on the planner's hot path.
        return TickPlan(0, self.plan_seq, int(self.flags), mdl, self.prefill_token_budget,
                        int(self.evictable_cache_classes), self.max_evict_bytes, self.protected_quota_bytes,
                        tuple(self.admits), tuple(self.prefills), tuple(self.decodes), tuple(self.commits),
                        tuple(self.retires), 0, 0)

    def encode(self, session: int = 0) -> bytes:
        return codec.encode("TickPlan", self.build(), session=session)

    def encode_into(self, buf, session: int = 0) -> int:
        """Into a plan-queue slot, stamped with the sender's session."""
        return codec.encode_into(buf, "TickPlan", self.build(), session=session)


def read_events(buf) -> TickEvents:
    """TickEvents of an event-queue message (CodecError if malformed)."""
    return codec.decode(buf, "TickEvents")

