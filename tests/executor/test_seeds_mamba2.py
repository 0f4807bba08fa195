"""Checkpoints that serve (issue 15, contract §6) on the Mamba2 runtime, whose
state cannot be cut back: a prompt of >= 128 tokens is checkpointed one
token short of its end, a LEASE_SEED for the next turn of the conversation
finds the checkpoint (or, once the lane retired publishing, its settled
entry), the next turn prefills only its new tokens, and its tokens equal a
fresh prefill's bitwise, greedy and sampled, through a copy, a takeover, an
export and import, and the reference planner's chat. Negative controls: a
checkpoint under another prompt's key changes the tokens; a published entry
left unsettled does too."""

from __future__ import annotations

import msgpack
import pytest

from superfluid.abi import Determinism, OpStatus, Sampling
from superfluid.client.builder import PlanBuilder, sampling_params
from superfluid.engine import load
from superfluid.engine.tiny_mamba2 import write_tiny_mamba2
from superfluid.executor.executor import Executor
from superfluid.executor.tick import CHECKPOINT_MIN_TOKENS
from superfluid.testing.executor import BIG_BUDGET, emit_of, emitted, leased_chat, put, small_rings
from superfluid.testing.invariants import check_invariants

SPI = int(Determinism.SEED_PATH_INVARIANT)
SAMPLE = int(Sampling.GPU_SAMPLE)
VOCAB = 160
SYSTEM = [(i * 37 + 11) % (VOCAB - 3) + 3 for i in range(140)]  # >= 128: checkpointed one short
assert len(SYSTEM) >= CHECKPOINT_MIN_TOKENS


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # Chunks of 16: the 139-token checkpoint ends inside a chunk, so seeding it recomputes the
    # partial chunk from its boundary (the runtime's canonical state is what is exact).
    return write_tiny_mamba2(tmp_path_factory.mktemp("m2-seeds"), seed=21, vocab_size=VOCAB, num_layers=2,
                             chunk_size=16)


def runtime(model_dir, **kw):
    return load(model_dir, "torch", max_batch=4, max_seqs=kw.pop("max_seqs", 8), **kw)


class Run:
    def __init__(self, rt, **kw):
        self.ex = Executor(rt, small_rings(), **kw)
        self.seq = 0
        self.tag = 0
        self.prefilled: list[int] = []  # prompt tokens each request's plan prefilled

    def plan(self) -> PlanBuilder:
        self.seq += 1
        return PlanBuilder(self.seq, prefill_token_budget=BIG_BUDGET)

    def op(self, **msg):
        return self.ex.op({"op_id": 1, **msg})

    def request(self, prompt, *, seed=None, n=8, sampling=SAMPLE, publish=True) -> list[int]:
        """The tokens; each one's logprob (its bits: a token can survive a rounding that
        its logprob shows) in self.logprobs."""
        self.tag += 1
        value = seed.value if seed else 0
        b = self.plan().admit(self.tag, put(self.ex, prompt), sampling=sampling, rng_counter_base=77,
                              params=sampling_params(temperature=0.8, top_k=40, ignore_eos=True),
                              seed_handle=seed.handle if seed else 0, determinism_class=SPI, want_logprobs=1)
        if value < len(prompt):
            b.prefill(self.tag, value, len(prompt) - value)
        r = self.ex.tick(b.decode(self.tag, n).build())
        assert r.ok, r.message
        self.prefilled.append(len(prompt) - value)
        toks = emitted(self.ex, emit_of(r, self.tag))
        self.logprobs = [lp.logprob for lp in r.events.logprobs if lp.lane_tag == self.tag]
        assert len(self.logprobs) == n
        assert self.ex.tick(self.plan().retire(self.tag, publish_to_cache=publish).build()).ok
        check_invariants(self.ex)
        return toks

    def lease(self, tokens):
        done = self.op(op="LEASE_SEED", tokens=list(tokens), ttl_ticks=4)
        assert done.status == int(OpStatus.OK), done
        return done


def oracle(model_dir, prompt, **kw) -> tuple[list[int], list[float]]:
    """A fresh run's tokens and logprobs."""
    rt = runtime(model_dir)
    try:
        r = Run(rt)
        return r.request(prompt, **kw), r.logprobs
    finally:
        rt.close()


@pytest.mark.parametrize("sampling", [0, SAMPLE])
def test_the_next_turn_seeds_from_the_checkpoint_and_equals_a_fresh_prefill(model_dir, sampling):
    rt = runtime(model_dir)
    try:
        r = Run(rt)
        answer = r.request(SYSTEM, sampling=sampling, publish=False)  # retired unpublished: the checkpoint stays
        (cp,) = list(r.ex.cache)
        assert cp.checkpoint and cp.tokens == tuple(SYSTEM[:-1]) and rt.seq_len(cp.seq) == len(SYSTEM) - 1
        turn2 = SYSTEM + answer + [5, 6, 7]
        seed = r.lease(turn2)
        assert seed.value == len(SYSTEM) - 1  # a checkpoint's exact length
        got = r.request(turn2, seed=seed, sampling=sampling)
        assert r.prefilled[-1] == len(turn2) - len(SYSTEM) + 1  # only the new tokens (and the held-back one)
        assert (got, r.logprobs) == oracle(model_dir, turn2, sampling=sampling)
        # The resent prompt seeds from the checkpoint too.
        again = r.lease(SYSTEM)
        assert again.value == len(SYSTEM) - 1
        got = r.request(SYSTEM, seed=again, sampling=sampling)
        assert (got, r.logprobs) == oracle(model_dir, SYSTEM, sampling=sampling)
    finally:
        rt.close()


@pytest.mark.parametrize("settle", [True, False])
def test_a_published_lane_seeds_the_next_turn(model_dir, settle, monkeypatch):
    """The lane retired publishing: its entry holds prompt + answer, settled
    (the decoded tail redone the prefill way); the next turn, one token more,
    decodes from it at once. Unsettled (the control) it decodes differently."""
    rt = runtime(model_dir)
    if not settle:
        monkeypatch.setattr(type(rt), "seq_settle", lambda self, seq: None)
    try:
        r = Run(rt)
        answer = r.request(SYSTEM)
        turn2 = SYSTEM + answer + [9]
        seed = r.lease(turn2)
        assert seed.value == len(turn2) - 1  # the published entry: longer than the checkpoint
        got = r.request(turn2, seed=seed)
        assert r.prefilled[-1] == 1
        assert ((got, r.logprobs) == oracle(model_dir, turn2)) == settle
    finally:
        rt.close()


def test_a_checkpoint_under_another_prompts_key_changes_the_tokens(model_dir):
    rt = runtime(model_dir)
    try:
        r = Run(rt)
        other = [(t + 50) % (VOCAB - 3) + 3 for t in SYSTEM]
        r.request(other, publish=False)
        (cp,) = list(r.ex.cache)
        r.ex.cache.remove(cp)  # re-keyed under SYSTEM: a lie the executor cannot see
        r.ex.cache.insert(cp.seq, tuple(SYSTEM[:-1]), len(SYSTEM), cp.bytes, 0, checkpoint=True)
        turn2 = SYSTEM + [5, 6]
        got = r.request(turn2, seed=r.lease(turn2))
        assert got != oracle(model_dir, turn2)[0]
    finally:
        rt.close()


def test_export_and_import_of_a_checkpoint_on_another_executor(model_dir):
    turn2 = SYSTEM + [5, 6, 7]
    want = oracle(model_dir, turn2)
    a_rt, b_rt = runtime(model_dir), runtime(model_dir)
    try:
        a, b = Run(a_rt), Run(b_rt)
        a.request(SYSTEM, publish=False)
        blob = msgpack.unpackb(a.op(op="EXPORT_ENTRY", handle=a.lease(turn2).handle).payload)["blob"]
        imp = b.op(op="IMPORT_STATE", tokens=SYSTEM[:-1], blob=blob, ttl_ticks=3)
        assert imp.status == int(OpStatus.OK) and imp.value == len(SYSTEM) - 1, imp
        got = b.request(turn2, seed=imp)
        assert (got, b.logprobs) == want
    finally:
        a_rt.close()
        b_rt.close()


def test_planner_chat_with_leases_gives_the_tokens_it_gives_without(model_dir):
    """Two conversations over one long system prompt, three turns each."""
    plain, s0 = leased_chat(lambda: runtime(model_dir), SYSTEM, 2, use_leases=False, budget=512)
    leased, s1 = leased_chat(lambda: runtime(model_dir), SYSTEM, 2, use_leases=True, budget=512)
    assert leased == plain
    assert s0.seeded_tokens == 0 and s1.seeded_tokens >= 2 * 2 * len(SYSTEM), s1
