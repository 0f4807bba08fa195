"""The reference Planner with a speculation strategy (client/strategies.py):
it installs the strategy, admits requests with its slot, grants overshoot
never past a request's max_new_tokens, and its requests' tokens equal those
of a Planner without one (greedy and sampled); drafts were really taken (the
negative control: they were proposed and accepted, not skipped). A runtime
that cannot verify drafts refuses the strategy when the Planner is made."""

from __future__ import annotations

import pytest

from superfluid.abi import Sampling
from superfluid.client.builder import sampling_params
from superfluid.client.local import LocalClient
from superfluid.client.planner import Planner
from superfluid.client.strategies import Strategy, StrategyRefused
from superfluid.engine.fake import FakeRuntime
from superfluid.executor import Executor
from superfluid.testing.speculation import Cycler


def serve(strategy, *, grant: int = 3, force: bool | None = True):
    ex = Executor(Cycler(period=6, vocab_size=48, max_seq_len=512, page=8, eos_rate=0.02))
    ex.registry.spec_gate.force = force
    planner = Planner(LocalClient(ex), decode_grant=grant, strategy=strategy, use_leases=False)
    ids = [planner.submit([1, 2, 3, 4, 5, 0, 1, 2], 40, stop_at_eos=False),
           planner.submit([7, 9, 11, 2, 3], 33, Sampling.GPU_SAMPLE, params=sampling_params(0.8, top_k=5),
                          rng_base=99),
           planner.submit([4, 4, 4, 4], 17, speculate=False),
           planner.submit([5, 6, 7, 8, 9, 10], 25, Sampling.GPU_SAMPLE, params=sampling_params(1.0), rng_base=7,
                          stop_at_eos=False)]
    rep = planner.run_until_done(120)
    return [rep.results[i] for i in ids], rep.stats, planner


def test_drafted_tokens_equal_plain_ones_and_no_request_runs_past_its_tokens():
    plain, s0, _ = serve(None)
    drafted, s1, planner = serve(Strategy(max_draft=6, ngram_min=1, ngram_max=3))
    assert [r.tokens for r in drafted] == [r.tokens for r in plain]
    assert [r.finish for r in drafted] == [r.finish for r in plain]
    assert s0.draft_proposed == 0 and s1.draft_proposed > 0 and s1.draft_accepted > 0
    assert len(drafted[0].tokens) == 40 and len(drafted[3].tokens) == 25  # overshoot never past max_new_tokens
    assert s1.ticks < s0.ticks  # verified drafts ran past the grant: fewer ticks for the same tokens
    assert planner.strategies.installs == 1 and planner.strategies.cert_id == 1


def test_the_gate_stopping_drafts_changes_no_token():
    plain, _, _ = serve(None)
    never, s, _ = serve(Strategy(), force=False)
    assert [r.tokens for r in never] == [r.tokens for r in plain] and s.draft_proposed == 0


def test_a_runtime_that_cannot_verify_refuses_the_strategy():
    ex = Executor(FakeRuntime(vocab_size=32, exact_only=True))
    with pytest.raises(StrategyRefused, match="Unsupported"):
        Planner(LocalClient(ex), strategy=Strategy())
    ex = Executor(FakeRuntime(vocab_size=32))
    with pytest.raises(StrategyRefused, match="max_draft"):
        Planner(LocalClient(ex), strategy=Strategy(max_draft=0))
