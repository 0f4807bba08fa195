"""Grammar masks on the engine's sampling path (contract §5): step_sampled with
TokenMasks gives, bitwise, the host sampler's token (executor.host_sampling.pick with
the same mask) for the same row, params and position, on the torch and Triton
backends; with a negative control (the mask changes tokens). The masks come
from real grammars over the tiny model's tokenizer, and every masked token is
one the grammar accepts. Also: the runtime exposes its tokenizer.json, the fake
applies masks too, and a malformed mask changes nothing."""

from __future__ import annotations

import json

import numpy as np
import pytest

from superfluid.abi import Sampling
from superfluid.client.builder import sampling_params
from superfluid.engine import Feed, OutOfBounds, SampleSpec, TokenMasks, load
from superfluid.engine.fake import FakeRuntime
from superfluid.engine.tiny import write_tiny
from superfluid.executor import host_sampling as hs
from superfluid.executor.grammar import GrammarRegistry
from superfluid.kernels import sampling as ks

SAMPLE = int(Sampling.GPU_SAMPLE)
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string", "maxLength": 4}},
          "required": ["n", "s"]}
PARAMS = [sampling_params(temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in
          [(1.0, 0, 0.0, 0.0), (0.7, 40, 0.9, 0.0), (0.0, 0, 0.0, 0.0), (1.5, 0, 0.0, 0.05),
           (1.0, 3, 0.0, 0.0), (0.9, 0, 0.5, 0.0)]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("tiny-mask"), seed=21)


def _spec(p, position: int) -> SampleSpec:
    return SampleSpec(p.temperature, p.top_k, p.top_p, p.min_p, position)


def _run(rt, rounds: int, *, masked: bool = True):
    """Lanes in pairs of sequences with the same prompt: one gives rows (step),
    the other samples (step_sampled). Even lanes are masked by a grammar.
    Returns [(engine token, host token with the mask, host token without)]."""
    reg = GrammarRegistry(rt.tokenizer_json, rt.desc.vocab_size, rt.vocabulary().eos)
    grammars = [reg.compile("json_schema", json.dumps(SCHEMA)), reg.compile("regex", "[a-z]+=[0-9]{1,3};"),
                reg.compile("choice", ["alpha", "beta", "gamma"])]
    rng = np.random.default_rng(0)
    n = len(PARAMS)
    prompts = [rng.integers(0, 256, 3 + i).tolist() for i in range(n)]
    rows_seq = [rt.seq_create() for _ in range(n)]
    samp_seq = [rt.seq_create() for _ in range(n)]
    for seqs in (rows_seq, samp_seq):
        rt.step([Feed(s, p[:-1]) for s, p in zip(seqs, prompts)])
    matchers = {i: grammars[(i // 2) % len(grammars)].matcher() for i in range(0, n, 2)}
    feed = [p[-1] for p in prompts]
    out = []
    for r in range(rounds):
        live = [i for i in range(n) if i not in matchers or not matchers[i].is_complete()]
        order = sorted(matchers)
        bits = reg.bitmask(len(order))
        assert reg.fill([(matchers[i], j) for j, i in enumerate(order)], bits) == []
        positions = [1000 * r + 7 * i + 3 for i in range(n)]
        rows = rt.step([Feed(rows_seq[i], [feed[i]], True) for i in live])
        masks = None
        if masked:
            idx = [live.index(i) for i in order if i in live]
            masks = TokenMasks(bits[[order.index(i) for i in order if i in live]], idx)
        toks = rt.step_sampled([Feed(samp_seq[i], [feed[i]]) for i in live],
                               [_spec(PARAMS[i], positions[i]) for i in live], masks)
        for i, row, tok in zip(live, rows, toks):
            mask = bits[order.index(i)] if i in matchers else None
            with_mask = hs.pick(row, SAMPLE, PARAMS[i], positions[i], mask=mask)[0]
            without = hs.pick(row, SAMPLE, PARAMS[i], positions[i])[0]
            out.append((i, tok, with_mask, without))
            if masked and i in matchers:
                assert matchers[i].accept(tok), (i, tok)
            feed[i] = tok
    return out


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_engine_and_host_give_the_same_token_under_a_mask(model_dir, backend):
    if backend == "triton" and ks.triton is None:
        pytest.skip("triton is not installed")
    rt = load(model_dir, backend, kv_cells=512, max_batch=8)
    got = _run(rt, 6 if backend == "torch" else 3)
    assert all(tok == host for _, tok, host, _ in got), got
    # negative control: on masked lanes the mask decided some tokens
    assert any(host != free for i, _, host, free in got if i % 2 == 0)
    # unmasked lanes: the mask-free draw
    assert all(host == free for i, _, host, free in got if i % 2 == 1)


def test_negative_control_without_masks_the_engine_leaves_the_grammar(model_dir):
    rt = load(model_dir, "torch", kv_cells=512, max_batch=8)
    got = _run(rt, 6, masked=False)
    assert all(tok == free for _, tok, _, free in got)
    assert any(tok != host for i, tok, host, _ in got if i % 2 == 0)


def test_the_runtime_exposes_its_tokenizer(model_dir, tmp_path):
    rt = load(model_dir, "torch", kv_cells=64)
    assert json.loads(rt.tokenizer_json)["model"]["type"] == "BPE"
    bare = write_tiny(tmp_path / "bare", seed=21, tokenizer=False)
    assert load(bare, "torch", kv_cells=64).tokenizer_json is None
    assert FakeRuntime(vocab_size=64).tokenizer_json is None


def test_a_malformed_mask_changes_nothing(model_dir):
    rt = load(model_dir, "torch", kv_cells=64, max_batch=4)
    s = rt.seq_create()
    rt.step([Feed(s, [1, 2, 3])])
    W = (rt.desc.vocab_size + 31) // 32
    for bad in (TokenMasks(np.zeros((1, W), np.int64), [0]), TokenMasks(np.zeros((1, W - 1), np.int32), [0]),
                TokenMasks(np.zeros((2, W), np.int32), None), TokenMasks(np.zeros((1, W), np.int32), [1]),
                TokenMasks(np.zeros((2, W), np.int32), [0, 0]), TokenMasks([[0] * W], [0])):
        with pytest.raises(OutOfBounds):
            rt.step_sampled([Feed(s, [4])], [SampleSpec()], bad)
        assert rt.seq_len(s) == 3


def test_the_fake_applies_masks_too():
    rt = FakeRuntime(vocab_size=64, engine_sampling=True, engine_draws=True)
    seqs = [rt.seq_create() for _ in range(3)]
    allowed = [7, 40, 63]
    bits = np.zeros((3, 2), dtype=np.int32)
    for j, t in enumerate(allowed):
        bits[j, t // 32] = np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    specs = [SampleSpec(), SampleSpec(1.0, rng_position=5), SampleSpec(0.5, rng_position=9)]
    toks = rt.step_sampled([Feed(s, [1]) for s in seqs], specs, TokenMasks(bits[[2, 0]], [0, 2]))
    assert toks[0] == 63 and toks[2] == 7
