"""engine/mamba2.py's logits equal HF Mamba2ForCausalLM's (fp32, CPU, its torch path) within 1e-4:
after a prompt, after decode steps, and after resuming from a saved state; a wrong state is far
off; a checkpoint that disagrees with its config is refused naming the tensor."""

from __future__ import annotations

import json

import pytest
import torch

from superfluid.engine.mamba2 import Mamba2Model, Mamba2State, WeightError
from superfluid.engine.tiny_mamba2 import write_tiny_mamba2
from superfluid.testing.checkpoints import rewrite_checkpoint

transformers = pytest.importorskip("transformers")

TOL = 1e-4
VOCAB = 320


def _tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


# Untied with one group; tied with two groups (B/C shared by half the heads each, grouped norm).
@pytest.fixture(scope="module", params=[dict(tie_word_embeddings=False, n_groups=1),
                                        dict(tie_word_embeddings=True, n_groups=2)],
                ids=["untied-g1", "tied-g2"])
def pair(request, tmp_path_factory):
    d = write_tiny_mamba2(tmp_path_factory.mktemp("mamba2"), seed=3, vocab_size=VOCAB, **request.param)
    hf = transformers.Mamba2ForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    return Mamba2Model.load(d), hf


def _hf_prefill(hf, toks):
    with torch.no_grad():
        out = hf(toks[None], use_cache=True)
    return out.logits[0], out.cache


def test_prompt_logits(pair):
    ours, hf = pair
    toks = _tokens(40, 1)  # 40 tokens: two full chunks of 16 and a padded one
    ref, _ = _hf_prefill(hf, toks)
    got, state = ours.forward(toks)
    assert got.dtype == torch.float32 and got.shape == (40, VOCAB)
    assert (got - ref).abs().max().item() < TOL
    cfg = ours.cfg
    assert [tuple(c.shape) for c in state.conv] == [(cfg.conv_dim, cfg.conv_kernel)] * cfg.num_layers
    assert [tuple(s.shape) for s in state.ssm] == [(cfg.num_heads, cfg.head_dim, cfg.state_size)] * cfg.num_layers
    assert all(t.dtype == torch.float32 for t in state.conv + state.ssm)


def test_decode_steps(pair):
    ours, hf = pair
    toks, steps = _tokens(40, 2), _tokens(8, 3)
    _, cache = _hf_prefill(hf, toks)
    _, state = ours.forward(toks)
    for t in steps:  # HF's single-token path against our recurrent update, step by step
        with torch.no_grad():
            out = hf(t.view(1, 1), cache=cache, use_cache=True)
        cache = out.cache
        got, state = ours.forward(t.view(1), state)
        assert (got[0] - out.logits[0, -1]).abs().max().item() < TOL
    # Our state equals HF's cache after the same 48 tokens.
    for l in range(ours.cfg.num_layers):
        assert torch.allclose(state.conv[l], cache.layers[l].conv_states[0][0], atol=TOL)
        assert torch.allclose(state.ssm[l], cache.layers[l].recurrent_states[0][0], atol=TOL)


def test_resume_equals_one_feed(pair):
    ours, _ = pair
    toks = _tokens(40, 4)
    whole, end_whole = ours.forward(toks)
    _, mid = ours.forward(toks[:30])
    saved = mid.clone()
    rest, end_rest = ours.forward(toks[30:], mid)  # chunked scan from a non-zero initial state
    assert (rest - whole[30:]).abs().max().item() < TOL
    for a, b in zip(end_rest.ssm + end_rest.conv, end_whole.ssm + end_whole.conv):
        assert (a - b).abs().max().item() < TOL
    # forward never mutates the state it is given: resuming the saved copy gives the same rows.
    again, _ = ours.forward(toks[30:], saved)
    assert torch.equal(again, rest)
    # ... and token by token from the same state (the recurrent path throughout).
    state = saved
    for i, t in enumerate(toks[30:]):
        row, state = ours.forward(t.view(1), state)
        assert (row[0] - whole[30 + i]).abs().max().item() < TOL


def test_wrong_state_is_far_off(pair):
    ours, _ = pair
    toks = _tokens(40, 5)
    whole, _ = ours.forward(toks)
    _, other = ours.forward(_tokens(30, 6))
    for state in (None, Mamba2State.zeros(ours.cfg), other):  # fresh, zeros, another prompt's
        got, _ = ours.forward(toks[30:], state)
        assert (got - whole[30:]).abs().max().item() > 100 * TOL
    # The SSM state alone matters too (the conv state alone only reaches back K-1 tokens).
    _, mid = ours.forward(toks[:30])
    bad = mid.clone()
    bad.ssm = [torch.zeros_like(s) for s in bad.ssm]
    got, _ = ours.forward(toks[30:], bad)
    assert (got - whole[30:]).abs().max().item() > 100 * TOL


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_mamba2(tmp_path_factory.mktemp("bad"), seed=1, vocab_size=VOCAB, num_layers=1)


def test_missing_tensor_is_named(ckpt, tmp_path):
    name = "backbone.layers.0.mixer.A_log"
    d = rewrite_checkpoint(ckpt, tmp_path / "m", lambda t: t.pop(name))
    with pytest.raises(WeightError, match=f"missing tensor '{name}'"):
        Mamba2Model.load(d)


def test_wrong_shape_is_named(ckpt, tmp_path):
    name = "backbone.layers.0.mixer.conv1d.weight"
    d = rewrite_checkpoint(ckpt, tmp_path / "s", lambda t: t.__setitem__(name, t[name][..., :3].contiguous()))
    with pytest.raises(WeightError, match=rf"'{name}' has shape \(160, 1, 3\).*\(160, 1, 4\)"):
        Mamba2Model.load(d)


def test_unexpected_tensor_and_bad_config(ckpt, tmp_path):
    extra = "backbone.layers.7.norm.weight"
    d = rewrite_checkpoint(ckpt, tmp_path / "u", lambda t: t.__setitem__(extra, torch.ones(64)))
    with pytest.raises(WeightError, match=r"unexpected tensor.*layers\.7\.norm\.weight"):
        Mamba2Model.load(d)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["num_heads"] = 7  # 7 * 16 != 2 * 64
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightError, match="num_heads"):
        Mamba2Model.load(tmp_path / "c")
