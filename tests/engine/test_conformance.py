"""Every runtime against the interface contract (superfluid.testing.conformance),
and the fake runtime's own extras: fault injection, counters, simulated cost.

To add a runtime, append a RuntimeFactory to RUNTIME_FACTORIES: a zero-arg
callable returning a fresh runtime with small limits (cache what is costly to
load), and lower max_examples/state_steps for a slow one.
"""

from __future__ import annotations

import functools
import time

import numpy as np
import pytest

pytest.register_assert_rewrite("tests.engine.conformance")

from superfluid.abi import Fault  # noqa: E402
from superfluid.engine.fake import FakeRuntime  # noqa: E402
from superfluid.engine.runtime import (  # noqa: E402
    CapacityError,
    FatalError,
    Feed,
    LaneFault,
    OutOfBounds,
    SampleSpec,
    Unsupported,
)
from superfluid.testing import conformance
from superfluid.testing.runtime_harness import RuntimeFactory


def _fake(name: str, **options) -> RuntimeFactory:
    # cheap to make and to step: look harder than a real runtime can afford
    return RuntimeFactory(name, functools.partial(FakeRuntime, **options), max_examples=50, state_steps=50,
                          paged_model=True)


@functools.cache
def _tiny_model(backend: str):
    import tempfile

    from superfluid.engine.config import load_config
    from superfluid.engine.model import Model
    from superfluid.engine.tiny import write_tiny
    from superfluid.engine.weights import load_weights
    from superfluid.kernels.backend import get_backend

    d = write_tiny(tempfile.mkdtemp(prefix="sf-conf-"), arch="llama", seed=3, tokenizer=False, vocab_size=96,
                   hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2, max_position_embeddings=64)
    cfg = load_config(d)
    return Model(cfg, load_weights(d, cfg), get_backend(backend))


def _transformer(name: str, backend: str, examples: int, steps: int, **options) -> RuntimeFactory:
    from superfluid.engine.transformer import TransformerRuntime

    def make():
        return TransformerRuntime(_tiny_model(backend), **options)

    return RuntimeFactory(name, make, max_examples=examples, state_steps=steps, paged_model=True)


@functools.cache
def _tiny_mamba2() -> str:
    import tempfile

    from superfluid.engine.tiny_mamba2 import write_tiny_mamba2

    return str(write_tiny_mamba2(tempfile.mkdtemp(prefix="sf-conf-m2-"), seed=3, vocab_size=96, hidden_size=32,
                                 num_heads=4, state_size=8, num_layers=1, chunk_size=4))


def _mamba2(name: str, backend: str, examples: int, steps: int, **options) -> RuntimeFactory:
    from superfluid.engine.loader import load

    return RuntimeFactory(name, lambda: load(_tiny_mamba2(), backend, **options), max_examples=examples,
                          state_steps=steps)


RUNTIME_FACTORIES: list[RuntimeFactory] = [
    _mamba2("mamba2-torch", "torch", 12, 20, max_seqs=8, max_seq_len=64, max_batch=16),
    _transformer("transformer-torch", "torch", 12, 20, kv_cells=256, page=4, max_seqs=16),
    _transformer("transformer-triton", "triton", 2, 6, kv_cells=128, page=8, max_seqs=8),
    _fake("fake-shared", vocab_size=64, max_seq_len=64, page=4, max_seqs=16, copy_shares_cells=True),
    _fake("fake-private", vocab_size=100, max_seq_len=48, page=8, copy_shares_cells=False),
    _fake("fake-exact", vocab_size=64, max_seq_len=64, page=4, exact_only=True, copy_shares_cells=False),
    _fake("fake-limited", vocab_size=64, max_seq_len=40, page=4, max_seqs=8, cells_total=96,
          copy_shares_cells=True),
    _fake("fake-sampling", vocab_size=97, max_seq_len=64, page=16, cells_total=512, eos_ids=(3, 96),
          engine_sampling=True, engine_draws=True, seed=7),
]


@pytest.mark.parametrize("check", conformance.CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
@pytest.mark.parametrize("factory", RUNTIME_FACTORIES, ids=lambda f: f.name)
def test_runtime_conforms(factory: RuntimeFactory, check) -> None:
    check(factory)


# ------------------------------------------------------------------ the fake's extras


def _fed(rt: FakeRuntime, tokens: list[int]) -> int:
    s = rt.seq_create()
    rt.step([Feed(s, tokens)])
    return s


def test_an_injected_lane_fault_fires_on_the_steps_of_its_sequence_and_changes_nothing():
    rt = FakeRuntime(page=4)
    a, b = _fed(rt, [1, 2]), _fed(rt, [3])
    rt.inject_fault(a, code=Fault.INJECTED, times=2)
    before = rt.mem_counters()
    assert rt.step([Feed(b, [4], True)])  # b alone is not faulted
    for _ in range(2):
        with pytest.raises(LaneFault) as e:
            rt.step([Feed(b, [5]), Feed(a, [6])])
        assert e.value.code == Fault.INJECTED
    assert (rt.seq_len(a), rt.seq_len(b)) == (2, 2)
    assert rt.mem_counters() == before
    rt.step([Feed(a, [6])])  # used up
    assert rt.stats.faults == 2


def test_an_injected_capacity_fault_is_a_capacity_error_that_changes_nothing():
    rt = FakeRuntime(page=4)
    a = _fed(rt, [1])
    rt.inject_capacity_fault()
    with pytest.raises(CapacityError):
        rt.step([Feed(a, [2])])
    assert rt.seq_len(a) == 1
    rt.inject_capacity_fault(on="copy")
    b = rt.seq_create()
    with pytest.raises(CapacityError):
        rt.seq_copy(a, b, 1)
    rt.seq_copy(a, b, 1)
    assert rt.seq_len(b) == 1


@pytest.mark.parametrize("site", ["step", "copy", "truncate", "import", "any"])
def test_an_injected_fatal_error_poisons_the_runtime_until_cleared(site):
    rt = FakeRuntime(page=4)
    a, b = _fed(rt, [1, 2, 3]), rt.seq_create()
    blob = rt.seq_export(a)
    calls = {"step": lambda: rt.step([Feed(a, [1])]), "copy": lambda: rt.seq_copy(a, b, 1),
             "truncate": lambda: rt.seq_truncate(a, 1), "import": lambda: rt.seq_import(b, blob)}
    rt.inject_fatal(on=site)
    with pytest.raises(FatalError):
        calls["step" if site == "any" else site]()
    assert rt.poisoned and rt.seq_len(a) == 3 and rt.seq_len(b) == 0
    with pytest.raises(FatalError):
        rt.seq_create()
    rt.clear_faults()
    rt.step([Feed(a, [4])])
    assert rt.seq_len(a) == 4


def test_exact_only_cuts_and_copies_whole_sequences_only():
    rt = FakeRuntime(page=4, exact_only=True)
    assert not rt.desc.truncate_partial and rt.desc.exact_only
    a, b = _fed(rt, [1, 2, 3, 4, 5]), rt.seq_create()
    for n in (1, 4):
        with pytest.raises(OutOfBounds):
            rt.seq_truncate(a, n)
        with pytest.raises(OutOfBounds):
            rt.seq_copy(a, b, n)
    rt.seq_truncate(a, 5)
    rt.seq_copy(a, b, 5)
    rt.seq_copy(a, b, 0)
    rt.seq_truncate(a, 0)
    assert (rt.seq_len(a), rt.seq_len(b)) == (0, 0)
    assert rt.mem_counters().cells_used == 0


def test_shared_pages_are_copied_on_the_first_write_after_a_truncate():
    rt = FakeRuntime(page=4, copy_shares_cells=True, cells_total=32)
    a = _fed(rt, list(range(8)))
    b = rt.seq_create()
    rt.seq_copy(a, b, 8)
    assert rt.mem_counters().cells_used == 8  # both pages shared
    rt.seq_truncate(b, 6)
    assert rt.mem_counters().cells_used == 8
    row = rt.step([Feed(b, [9], True)])[0]  # b's second page becomes its own
    assert rt.mem_counters().cells_used == 12
    assert rt.seq_tokens(a) == tuple(range(8)) and rt.seq_tokens(b) == (0, 1, 2, 3, 4, 5, 9)
    assert rt.cells_released([a]) == 4 and rt.cells_released([a, b]) == 12
    c = rt.seq_create()
    assert rt.step([Feed(c, [0, 1, 2, 3, 4, 5, 9], True)])[0].tobytes() == row.tobytes()


def test_rows_are_varied_and_eos_is_rare_but_reachable():
    rt = FakeRuntime(vocab_size=64, max_seq_len=5000, eos_rate=0.02)
    s = rt.seq_create()
    row, picked, eos = rt.step([Feed(s, [1], True)])[0], [], 0
    for _ in range(3000):
        t = int(np.argmax(row))
        eos += rt.is_eos(t)
        t = 1 if rt.is_eos(t) else t
        picked.append(t)
        row = rt.step([Feed(s, [t], True)])[0]
    assert 0.005 < eos / 3000 < 0.05
    assert len(set(picked[-200:])) > 20  # greedy does not settle into a loop
    assert rt.vocabulary().specials == {"<eos>": 63} and rt.vocabulary().eos == {63}


def test_step_sampled_without_draws_is_greedy_only():
    rt = FakeRuntime(engine_sampling=True)
    assert rt.desc.engine_sampling and not rt.desc.engine_draws
    a = _fed(rt, [1, 2])
    with pytest.raises(Unsupported):
        rt.step_sampled([Feed(a, [3])], [SampleSpec(temperature=1.0)])
    assert rt.seq_len(a) == 2
    assert FakeRuntime().step_sampled([Feed(a, [3])], [SampleSpec()]) is None


def test_stats_count_the_work_and_the_simulated_cost():
    rt = FakeRuntime(step_cost=0.002, token_cost=1e-5)
    a, b = rt.seq_create(), rt.seq_create()
    t0 = time.perf_counter()
    rt.step([Feed(a, [1, 2, 3], True), Feed(b, [4])])
    spent = time.perf_counter() - t0
    st = rt.stats
    assert (st.steps, st.tokens_fed, st.rows, st.creates) == (1, 4, 1, 2)
    assert st.simulated_ns == int((0.002 + 4e-5) * 1e9)
    assert spent >= 0.002
