"""Drafting lanes on the tiny real model (paged transformer) decode bitwise
the tokens they decode without drafts: greedy and sampled, batched
verification across lanes, overshoot, on the torch backend (hypothesis over
prompts, params and draft settings) and on the Triton backend (one short
case; the interpreter where there is no GPU). The drafts are taken where the
model's greedy continuation repeats itself."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from superfluid.abi import Determinism
from superfluid.client.builder import sampling_params
from superfluid.engine import load
from superfluid.engine.tiny import write_tiny
from superfluid.executor.executor import Executor
from superfluid.testing.executor import GREEDY, SAMPLE, small_rings
from superfluid.testing.speculation import Driver, Req, clock, install

SPI = int(Determinism.SEED_PATH_INVARIANT)
# A prompt whose greedy continuation (seed 13) repeats 3-grams of itself soon.
REPEATS = [5, 17, 200, 3, 99, 42, 7, 5, 17, 200]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-spec")
    write_tiny(d, arch="llama", seed=13, tokenizer=False)
    return d


@pytest.fixture(scope="module")
def one_layer_dir(tmp_path_factory):
    """Smaller still, for the Triton interpreter."""
    d = tmp_path_factory.mktemp("tiny-spec-1")
    write_tiny(d, arch="llama", seed=13, tokenizer=False, num_layers=1, hidden_size=32, intermediate_size=64,
               num_heads=2, num_kv_heads=1)
    return d


def decode(model_dir, reqs: dict[int, Req], grants: list[tuple[int, int]], *, backend: str = "torch",
           drafting: bool = True) -> Driver:
    rt = load(model_dir, backend, kv_cells=1024, max_batch=4)
    ex = Executor(rt, small_rings(), clock=clock())
    install(ex, 1, max_draft=6, ngram_min=1, ngram_max=3)
    install(ex, 2, max_draft=3, ngram_min=2, ngram_max=4)
    ex.registry.spec_gate.force = drafting
    d = Driver(ex)
    d.admit({t: r if drafting else Req(r.prompt, r.sampling, r.params, r.base, 0) for t, r in reqs.items()},
            determinism=SPI)
    for n, over in grants:
        d.decode({t: (n, over) for t in reqs})
    return d


PARAMS = st.sampled_from([
    (GREEDY, sampling_params(ignore_eos=True)),
    (SAMPLE, sampling_params(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05, ignore_eos=True)),
    (SAMPLE, sampling_params(temperature=1.2, repeat_penalty=1.3, presence_penalty=0.4, ignore_eos=True)),
])


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_torch_drafting_lanes_decode_the_plain_lanes_tokens(model_dir, data):
    reqs = {}
    for tag in (1, 2):
        pattern = data.draw(st.lists(st.integers(4, 319), min_size=2, max_size=5))
        sampling, params = data.draw(PARAMS)
        reqs[tag] = Req(pattern * 3, sampling, params, base=data.draw(st.integers(0, 1 << 30)),
                        slot=data.draw(st.sampled_from([1, 2])))
    grants = [(data.draw(st.integers(2, 8)), data.draw(st.sampled_from([0, 4]))) for _ in range(3)]
    spec = decode(model_dir, reqs, grants)
    plain = decode(model_dir, reqs, [(len(spec.out[1]) + len(spec.out[2]), 0)], drafting=False)
    for tag in reqs:
        assert spec.out[tag] == plain.out[tag][:len(spec.out[tag])], tag


def test_torch_drafts_are_taken_and_the_lane_keeps_its_class(model_dir):
    reqs = {1: Req(REPEATS, slot=1)}
    spec = decode(model_dir, reqs, [(8, 4)] * 5)
    plain = decode(model_dir, reqs, [(len(spec.out[1]), 0)], drafting=False)
    assert spec.out[1] == plain.out[1]
    assert sum(s[1] for s in spec.spec[1]) > 0
    assert spec.ex.lanes[1].granted_class == SPI


def test_triton_drafting_lane_decodes_the_plain_lanes_tokens(one_layer_dir):
    pytest.importorskip("triton")
    reqs = {1: Req(REPEATS, SAMPLE, sampling_params(temperature=0.8, top_k=40, ignore_eos=True), 5, slot=1)}
    spec = decode(one_layer_dir, reqs, [(5, 2)], backend="triton")
    plain = decode(one_layer_dir, reqs, [(len(spec.out[1]), 0)], backend="triton", drafting=False)
    assert spec.out[1] == plain.out[1]
    assert spec.spec[1][0][0] > 0
