"""The Mamba2 runtime through its interface: load() dispatch and description, rows within 1e-4
of HF Mamba2ForCausalLM (fp32 CPU) after a prompt fed in pieces, after decode steps, and after
resuming from a copied or exported/imported state; the state pool's limits, cuts, blobs and
counters, each refusal changing nothing."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from superfluid.engine import CapacityError, Feed, OutOfBounds, UnknownSequence, load
from superfluid.engine.mamba2 import WeightError
from superfluid.engine.mamba2_runtime import Mamba2Runtime
from superfluid.engine.mamba2_state import StatePool
from superfluid.engine.tiny_mamba2 import write_tiny_mamba2
from superfluid.testing.checkpoints import rewrite_checkpoint

transformers = pytest.importorskip("transformers")

TOL = 1e-4
VOCAB = 320


def decode(seq: int, token: int, wants_row: bool = True) -> Feed:
    return Feed(seq, [token], wants_row, decode=True)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=[dict(tie_word_embeddings=False, n_groups=1),
                                        dict(tie_word_embeddings=True, n_groups=2)],
                ids=["untied-g1", "tied-g2"])
def pair(request, tmp_path_factory):
    d = write_tiny_mamba2(tmp_path_factory.mktemp("m2rt"), seed=3, vocab_size=VOCAB, **request.param)
    hf = transformers.Mamba2ForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    return d, load(d, max_seqs=8, partial_truncate=True), hf


@pytest.fixture(autouse=True)
def _free_all(pair):
    """Each test starts from a runtime without sequences."""
    yield
    rt = pair[1]
    for s in list(rt.seqs):
        rt.seq_free(s)


def _hf(hf, prompt: list[int], steps: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """HF's logits for the prompt's tokens, then one row per decode step (its cache path)."""
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        cache, rows = out.cache, []
        for t in steps:
            out = hf(torch.tensor([[t]]), cache=cache, use_cache=True)
            cache = out.cache
            rows.append(out.logits[0, -1])
    return out.logits[0] if not steps else None, rows


def _close(row: np.ndarray, ref: torch.Tensor) -> float:
    return float(np.abs(row.astype(np.float64) - ref.double().numpy()).max())


def test_load_describes_an_exact_only_runtime(pair):
    _d, rt, _ = pair
    assert isinstance(rt, Mamba2Runtime)
    desc = rt.desc
    assert desc.exact_only and not desc.truncate_partial and not desc.copy_shares_cells
    assert (desc.vocab_size, desc.max_seqs, desc.runtime_id) == (VOCAB, 8, "mamba2-torch")
    s = rt.seq_create()
    assert rt.step_rows([Feed(s, [1])]) is None and rt.step_sampled([Feed(s, [1])], []) is None
    assert rt.seq_len(s) == 0  # neither stepped
    assert rt.vocabulary().eos == {2} and rt.is_eos(2) and rt.tokenizer_json is None
    rt.seq_free(s)


def test_prompt_rows_match_hf_however_fed(pair):
    _, rt, hf = pair
    prompt = _tokens(40, 1)  # two full chunks of 16 and a partial one
    ref, _ = _hf(hf, prompt, [])
    for cuts in ([40], [23, 17], [1, 15, 16, 8], [5] * 8):
        s, at = rt.seq_create(), 0
        for n in cuts:
            row = rt.step([Feed(s, prompt[at:at + n], True)])[0]
            at += n
            assert row.dtype == np.float32 and row.shape == (VOCAB,)
            assert _close(row, ref[at - 1]) < TOL, (cuts, at)
        rt.seq_free(s)


def test_decode_rows_match_hf(pair):
    _, rt, hf = pair
    prompt, steps = _tokens(37, 2), _tokens(30, 3)  # the decodes cross the chunk boundary at 48
    _, ref = _hf(hf, prompt, steps)
    s = rt.seq_create()
    rt.step([Feed(s, prompt)])
    for t, r in zip(steps, ref):
        assert _close(rt.step([decode(s, t)])[0], r) < TOL
    assert rt.seq_len(s) == 67
    rt.seq_free(s)


def test_resume_from_a_copy_or_an_import_matches_hf(pair):
    d, rt, hf = pair
    prompt, steps = _tokens(37, 4), _tokens(12, 5)
    _, ref = _hf(hf, prompt, steps)
    src = rt.seq_create()
    rt.step([Feed(src, prompt)])
    for t in steps[:4]:  # live and canonical states now differ
        rt.step([decode(src, t, False)])
    blob = rt.seq_export(src)
    other = load(d, max_seqs=2)  # another worker of the same model
    cp, imp = rt.seq_create(), other.seq_create()
    rt.seq_copy(src, cp, rt.seq_len(src))
    assert other.seq_import(imp, blob) == 41
    for t, r in zip(steps[4:], ref[4:]):
        a = rt.step([decode(src, t), decode(cp, t)])
        b = other.step([decode(imp, t)])[0]
        assert _close(a[0], r) < TOL
        assert np.array_equal(a[0], a[1]) and np.array_equal(a[0], b)  # bitwise the uninterrupted rows
    for s in (src, cp):
        rt.seq_free(s)


def test_state_slots_are_sized_by_state_bytes_and_a_full_pool_changes_nothing(pair):
    d, rt, _ = pair
    slot = StatePool.slot_bytes(rt.cfg)
    with pytest.raises(ValueError, match="less than one sequence's state"):
        load(d, state_bytes=slot - 1)
    small = load(d, state_bytes=2 * slot + slot // 2)
    assert small.desc.max_seqs == 2
    m = small.mem_counters()
    assert m.allocated_bytes == 2 * slot and m.seqs == 0
    a, b = small.seq_create(), small.seq_create()
    small.step([Feed(a, [1, 2, 3])])
    before = (small.mem_counters(), small.seq_export(a), small.seq_export(b))
    with pytest.raises(CapacityError, match="2 state slots"):
        small.seq_create()
    assert (small.mem_counters(), small.seq_export(a), small.seq_export(b)) == before
    small.seq_free(b)
    c = small.seq_create()  # the slot is reused, clean
    assert small.seq_len(c) == 0
    row_c = small.step([Feed(c, [1, 2, 3, 4], True)])[0]
    assert np.array_equal(row_c, small.step([Feed(a, [4], True)])[0])


def test_cells_are_tokens_in_pages_and_the_slots_bound_the_sequences(pair):
    _, rt, _ = pair
    page, m0 = rt.desc.page, rt.mem_counters()
    assert m0.cells_total == rt.desc.max_seqs * (-(-rt.desc.max_seq_len // page) * page)
    a, b = rt.seq_create(), rt.seq_create()
    rt.step([Feed(a, _tokens(20, 6)), Feed(b, [5])])
    m = rt.mem_counters()
    assert (m.cells_used - m0.cells_used, m.seqs - m0.seqs) == (2 * page + page, 2)
    assert rt.cells_released([a]) == 2 * page and rt.cells_released([a, b, a]) == 3 * page
    # A cell's bytes: a slot's spread over the cells it can hold (at least 1).
    per_slot = m.cells_total // rt.desc.max_seqs
    assert rt.cell_bytes() == max(1, StatePool.slot_bytes(rt.cfg) // per_slot)
    rt.seq_free(a)
    rt.seq_free(b)
    assert rt.mem_counters() == m0
    with pytest.raises(UnknownSequence):
        rt.seq_len(a)


def test_truncate_keeps_what_the_state_can_reach(pair):
    _, rt, _ = pair
    prompt = _tokens(40, 7)  # boundary 32 after it
    s, fresh = rt.seq_create(), rt.seq_create()
    rt.step([Feed(s, prompt)])
    for n in (1, 31, 41, -1):
        with pytest.raises(OutOfBounds, match=r"boundary|truncate to"):
            rt.seq_truncate(s, n)
    assert rt.seq_len(s) == 40
    rt.seq_truncate(s, 35)
    assert rt.seq_len(s) == 35
    # The cut sequence continues as a fresh prefill of its 35 tokens does, decode included.
    rt.step([Feed(fresh, prompt[:35])])
    for t in _tokens(4, 8):
        assert np.array_equal(rt.step([decode(s, t)])[0], rt.step([decode(fresh, t)])[0])
    rt.seq_truncate(s, 32)  # to the boundary itself: the canonical state is the live one
    rt.seq_truncate(fresh, 0)
    rt.step([Feed(fresh, prompt[:32])])
    assert np.array_equal(rt.step([decode(s, 9)])[0], rt.step([decode(fresh, 9)])[0])
    rt.seq_truncate(s, 0)
    assert rt.seq_len(s) == 0 and rt.seq_export(s) == rt.seq_export(rt.seq_create())


def test_strict_truncate_keeps_to_zero_or_the_length(pair):
    d = pair[0]
    rt = load(d, max_seqs=1, partial_truncate=False)
    s = rt.seq_create()
    rt.step([Feed(s, _tokens(40, 7))])
    with pytest.raises(OutOfBounds, match="only to 0 or 40"):
        rt.seq_truncate(s, 39)
    rt.seq_truncate(s, 40)
    rt.seq_truncate(s, 0)
    assert rt.seq_len(s) == 0


def test_copy_takes_whole_sequences_only(pair):
    _, rt, _ = pair
    a, b = rt.seq_create(), rt.seq_create()
    rt.step([Feed(a, _tokens(20, 9))])
    for n in (1, 19, 21):
        with pytest.raises(OutOfBounds):
            rt.seq_copy(a, b, n)
    assert rt.seq_len(b) == 0
    rt.seq_copy(a, b, 20)
    assert rt.seq_export(b) == rt.seq_export(a)
    rt.seq_copy(a, b, 0)
    assert rt.seq_len(b) == 0
    rt.seq_copy(a, a, 20)  # itself, whole: nothing changes
    assert rt.seq_len(a) == 20
    with pytest.raises(UnknownSequence):
        rt.seq_copy(a, 10**6, 20)


def test_a_bad_blob_is_refused_naming_why_and_changes_nothing(pair, tmp_path):
    d, rt, _ = pair
    a, b = rt.seq_create(), rt.seq_create()
    rt.step([Feed(a, _tokens(21, 10))])
    blob = rt.seq_export(a)
    flipped = bytearray(blob)
    flipped[-5] ^= 1
    other_chunk = load(d, chunk_size=8, max_seqs=1)  # canonical states cut elsewhere
    for bad, why in ((bytes(flipped), "checksum"), (blob[:-4], "bytes"), (b"SFKV" + blob[4:], "not a Mamba2"),
                     (blob[:10], "shorter"), ("text", "must be bytes")):
        with pytest.raises(OutOfBounds, match=why):
            rt.seq_import(b, bad)
        assert rt.seq_len(b) == 0
    with pytest.raises(OutOfBounds, match="another model"):
        other_chunk.seq_import(other_chunk.seq_create(), blob)
    with pytest.raises(OutOfBounds, match="holds 21"):
        rt.seq_import(a, blob)
    assert rt.seq_export(a) == blob


def test_a_bad_step_is_refused_before_anything_changes(pair):
    _, rt, _ = pair
    a, b = rt.seq_create(), rt.seq_create()
    rt.step([Feed(a, _tokens(10, 11)), Feed(b, _tokens(3, 12))])
    before = (rt.seq_export(a), rt.seq_export(b))
    bad_steps = [
        [Feed(a, [1]), Feed(b, [VOCAB])],                 # outside the vocabulary
        [Feed(a, [1]), Feed(b, [-1])],
        [Feed(a, [1]), Feed(b, [])],                      # empty
        [Feed(a, [1]), Feed(a, [2])],                     # twice
        [Feed(a, [1]), decode(b, 1), Feed(b, [1, 2], decode=True)],
        [Feed(a, [1, 2], decode=True)],                          # a decode feed is one token
        [Feed(a, [1]), Feed(b, [1.5])],                   # not an integer
        [Feed(a, [1] * (rt.desc.max_seq_len - 9))],       # past max_seq_len
    ]
    for feeds in bad_steps:
        with pytest.raises(OutOfBounds):
            rt.step(feeds)
        assert (rt.seq_export(a), rt.seq_export(b)) == before
    with pytest.raises(UnknownSequence):
        rt.step([Feed(a, [1]), Feed(10**6, [1])])
    assert (rt.seq_export(a), rt.seq_export(b)) == before
    assert rt.step([]) == []


def test_load_refuses_a_checkpoint_that_disagrees_with_its_config(pair, tmp_path):
    d = pair[0]
    name = "backbone.layers.1.mixer.dt_bias"
    with pytest.raises(WeightError, match=f"missing tensor '{name}'"):
        load(rewrite_checkpoint(d, tmp_path / "m", lambda t: t.pop(name)))
    with pytest.raises(WeightError, match=rf"'{name}' has shape \(7,\)"):
        load(rewrite_checkpoint(d, tmp_path / "s", lambda t: t.__setitem__(name, t[name][:7].contiguous())))
    cfg = json.loads((d / "config.json").read_text())
    for key, value, why in (("eos_token_id", VOCAB, "eos_token_id"), ("hidden_act", "gelu", "hidden_act")):
        bad = tmp_path / key
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps({**cfg, key: value}))
        (bad / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes())
        with pytest.raises(WeightError, match=why):
            load(bad)
    with pytest.raises(ValueError, match="float32"):
        load(d, dtype="bfloat16")
