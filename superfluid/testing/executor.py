"""Executors over the fake runtime for tests, and the small steps every
executor test takes: write a prompt, tick an admit and its prefill, read an
emit's tokens, run conversations through the reference planner."""

from __future__ import annotations

from typing import Any

import numpy as np

from superfluid.abi import Sampling, Status
from superfluid.abi.records import RingRef
from superfluid.client.builder import PlanBuilder, sampling_params
from superfluid.engine.fake import FakeRuntime
from superfluid.executor.executor import Executor, TickResult
from superfluid.executor.tick_rings import LocalRings
from superfluid.rings.layout import SegmentConfig

GREEDY, SAMPLE, HOST = int(Sampling.GPU_GREEDY), int(Sampling.GPU_SAMPLE), int(Sampling.HOST)
BIG_BUDGET = 1 << 20
# A worker's segment for tests: small queues, rings for a few short requests.
WORKER_SEGMENT = SegmentConfig(
    plan_slots=4, plan_slot_bytes=16384, event_slots=4, event_slot_bytes=65536, op_slots=8,
    op_slot_bytes=4096, stream_slots=64, stream_slot_bytes=64, prompt_tokens=4096, emit_tokens=4096,
    logits_floats=1 << 14)

# ---------------------------------------------------------------- building


def fake(**kw: Any) -> FakeRuntime:
    """A small fake runtime: vocab 64, max_seq_len 64, page 4 unless told."""
    opts: dict[str, Any] = dict(vocab_size=64, max_seq_len=64, page=4)
    opts.update(kw)
    return FakeRuntime(**opts)


def small_rings() -> LocalRings:
    """Rings big enough for these tests and cheap to allocate (the default is 24 MiB)."""
    return LocalRings(prompt_tokens=1 << 14, emit_tokens=1 << 14, logits_floats=1 << 16)


def make_executor(rt: FakeRuntime | None = None, *, rings: LocalRings | None = None,
                  **ex_kw: Any) -> Executor:
    return Executor(rt if rt is not None else fake(), rings or small_rings(), **ex_kw)


def put(ex: Executor, tokens) -> RingRef:
    """Write a prompt into the executor's prompt ring; its reference."""
    return ex.rings.prompt.write(np.asarray(list(tokens), dtype=np.uint32))


def emitted(ex: Executor, emit) -> list[int]:
    if emit.n_tokens == 0:
        return []
    return ex.rings.tokens.read(emit.token_ref).tolist()


def emit_of(result: TickResult, tag: int):
    got = [e for e in result.events.emits if e.lane_tag == tag]
    assert len(got) == 1, f"lane {tag}: {len(got)} emits in {result.events.emits}"
    return got[0]


def admit_and_prefill(ex: Executor, seq: int, tag: int, tokens, *, decode: int | None = None,
                      **admit_kw: Any) -> TickResult:
    """One tick: admit `tag` with `tokens`, prefill all of it (and decode)."""
    ref = put(ex, tokens)
    b = PlanBuilder(seq, prefill_token_budget=BIG_BUDGET).admit(tag, ref, **admit_kw)
    b.prefill(tag, 0, len(tokens) - admit_kw.get("decode_replay", 0))
    if decode is not None:
        b.decode(tag, decode)
    r = ex.tick(b.build())
    assert r.status == Status.OK, r.message
    return r


# ---------------------------------------------------------------- snapshot



def leased_chat(make_runtime, system: list[int], conversations: int, *, use_leases: bool,
                budget: int = 256, turns: int = 3):
    """Conversations over one system prompt through the reference planner on
    an in-process executor, `turns` turns each, every turn appending the
    answer and a new question: (every answer, the planner's stats)."""
    from superfluid.client.local import LocalClient
    from superfluid.client.planner import Planner

    rt = make_runtime()
    try:
        planner = Planner(LocalClient(Executor(rt, small_rings())), prefill_token_budget=budget, decode_grant=6,
                          use_leases=use_leases)
        history = {c: list(system) + [100 + c] for c in range(conversations)}
        outs = []
        for turn in range(turns):
            ids = {c: planner.submit(history[c], 6, SAMPLE, params=sampling_params(temperature=0.7, top_k=30),
                                     rng_base=1000 * c + 10 * turn, stop_at_eos=False) for c in range(conversations)}
            rep = planner.run_until_done(200)
            for c, rid in ids.items():
                toks = rep.results[rid].tokens
                outs.append(toks)
                history[c] += toks + [120 + turn]
        return outs, planner.stats
    finally:
        rt.close()
