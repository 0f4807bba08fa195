"""engine.tiny: seeded checkpoints transformers reads as we do, the
byte-level tokenizer, and the cached default model."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st
from safetensors.torch import load_file

from superfluid.engine import tiny
from superfluid.engine.checkpoint import ConfigError
from superfluid.engine.config import load_config
from superfluid.engine.rope_scaling import rope_inv_freq
from superfluid.engine.tiny import SPECIAL_TOKENS, TINY, default_model_dir, tiny_config, tiny_tensors, write_tiny
from superfluid.engine.weights import expected_shapes, load_weights

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402


def tensors_of(d: Path) -> dict[str, torch.Tensor]:
    return load_weights(d, load_config(d))


def assert_config_matches_hf(d: Path) -> None:
    """transformers' reading of the written config.json is ours."""
    cfg, hc = load_config(d), AutoConfig.from_pretrained(d)
    assert hc.model_type == cfg.arch and hc.architectures == [tiny.ARCHITECTURES[cfg.arch]]
    theirs = (hc.vocab_size, hc.hidden_size, hc.intermediate_size, hc.num_hidden_layers,
              hc.num_attention_heads, hc.num_key_value_heads)
    assert theirs == (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads,
                      cfg.num_kv_heads)
    assert (getattr(hc, "head_dim", None) or hc.hidden_size // hc.num_attention_heads) == cfg.head_dim
    assert hc.rms_norm_eps == cfg.rms_norm_eps and hc.max_position_embeddings == cfg.max_position_embeddings
    assert hc.tie_word_embeddings == cfg.tie_word_embeddings and hc.dtype == cfg.dtype
    rp = dict(hc.rope_parameters)
    assert rp.pop("rope_theta") == cfg.rope_theta
    rtype = rp.pop("rope_type")
    assert (None if rtype == "default" else {"rope_type": rtype, **rp}) == cfg.rope_scaling
    if cfg.arch != "llama":
        assert hc.sliding_window == cfg.sliding_window
    if cfg.arch in ("qwen2", "qwen3"):
        assert tuple(hc.layer_types) == cfg.layer_types


ARCH_CASES = [
    dict(arch="llama"),
    dict(arch="llama", rope_scaling="llama3", tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
    dict(arch="mistral"),
    dict(arch="mistral", sliding_window=32),
    dict(arch="qwen2"),
    dict(arch="qwen2", sliding_window=8, rope_theta=1e6),
    dict(arch="qwen3"),
    dict(arch="qwen3", head_dim=8, dtype="bfloat16", rope_scaling="linear"),
]


@pytest.mark.parametrize("kw", ARCH_CASES, ids=lambda kw: "-".join(f"{v}" for v in kw.values()))
def test_transformers_loads_it_as_written(tmp_path, kw):
    d = write_tiny(tmp_path / "m", **kw)
    assert_config_matches_hf(d)
    model, info = AutoModelForCausalLM.from_pretrained(d, output_loading_info=True)
    assert not any(info.values()), info
    w = tensors_of(d)
    assert all(torch.equal(t, w[n]) for n, t in model.state_dict().items())
    # the rope the model runs is ours
    ours = rope_inv_freq(load_config(d))
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, ours, rtol=0, atol=1e-7)


def test_arch_specific_tensors_and_fields(tmp_path):
    q2 = tensors_of(write_tiny(tmp_path / "q2", arch="qwen2"))
    for p in "qkv":
        b = q2[f"model.layers.1.self_attn.{p}_proj.bias"]
        assert b.abs().min() > 0 and b.std() > 0.01  # random, not zero
    assert "model.layers.0.self_attn.o_proj.bias" not in q2

    d = write_tiny(tmp_path / "q3", arch="qwen3", head_dim=32)
    raw = json.loads((d / "config.json").read_text())
    assert raw["head_dim"] == 32  # explicit: Qwen3Config would default it to 128
    q3 = tensors_of(d)
    assert q3["model.layers.0.self_attn.q_norm.weight"].shape == (32,)
    a = "model.layers.0.self_attn."
    assert not torch.equal(q3[a + "q_norm.weight"], q3[a + "k_norm.weight"])

    for window in (None, 64):
        raw = json.loads((write_tiny(tmp_path / f"m{window}", arch="mistral", sliding_window=window)
                          / "config.json").read_text())
        assert "sliding_window" in raw and raw["sliding_window"] == window  # null written: absent means 4096

    raw = json.loads((write_tiny(tmp_path / "l3", rope_scaling="llama3") / "config.json").read_text())
    assert raw["rope_parameters"] == {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 128}


def test_eos_ids_split_between_config_and_generation_config(tmp_path):
    d = write_tiny(tmp_path / "d")
    assert json.loads((d / "config.json").read_text())["eos_token_id"] == 257
    assert json.loads((d / "generation_config.json").read_text())["eos_token_id"] == [257, 259]
    cfg = load_config(d)
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.pad_token_id) == (256, (257, 259), 258)


def test_deterministic_from_seed(tmp_path):
    a = load_file(write_tiny(tmp_path / "a", seed=7) / "model.safetensors")
    b = load_file(write_tiny(tmp_path / "b", seed=7) / "model.safetensors")
    c = load_file(write_tiny(tmp_path / "c", seed=8) / "model.safetensors")
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not any(torch.equal(a[n], c[n]) for n in a)
    raw = [(tmp_path / x / "model.safetensors").read_bytes() for x in "ab"]
    assert raw[0] == raw[1]


def test_weight_scales():
    w = tiny_tensors(tiny_config(**TINY), seed=0)
    for n, t in w.items():
        if n.endswith("norm.weight"):
            assert not torch.equal(t, torch.ones_like(t)) and (t - 1).abs().max() < 0.6, n
        elif n.endswith("_proj.weight") or n == "lm_head.weight":
            assert abs(t.std().item() * t.shape[1] ** 0.5 - 1) < 0.15, n


def test_activations_stay_order_one(tmp_path):
    d = write_tiny(tmp_path / "d", num_layers=8, arch="qwen3")
    model = AutoModelForCausalLM.from_pretrained(d)
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    rms = [h.pow(2).mean().sqrt().item() for h in out.hidden_states]
    assert all(0.3 < r < 10 for r in rms), rms
    logits = out.logits
    assert torch.isfinite(logits).all() and 0.3 < logits.std().item() < 5
    top2 = logits.topk(2, dim=-1).values
    assert (top2[..., 0] - top2[..., 1]).median() > 1e-2  # greedy is not a coin toss


def test_overrides(tmp_path):
    with pytest.raises(TypeError, match="no_such_field"):
        write_tiny(tmp_path / "a", no_such_field=1)
    with pytest.raises(ConfigError, match="mistral requires attention_bias=False"):
        write_tiny(tmp_path / "b", arch="mistral", attention_bias=True)
    with pytest.raises(ValueError, match="arch"):
        write_tiny(tmp_path / "c", arch="gpt2")
    d = write_tiny(tmp_path / "d", rms_norm_eps=1e-5, eos_token_ids=(3,), bos_token_id=None)
    cfg = load_config(d)
    assert cfg.rms_norm_eps == 1e-5 and cfg.eos_token_ids == (3,) and cfg.bos_token_id is None


def test_refuses_a_non_empty_directory(tmp_path):
    (tmp_path / "x").write_text("mine")
    with pytest.raises(FileExistsError):
        write_tiny(tmp_path)
    assert (tmp_path / "x").read_text() == "mine"


def test_small_vocabulary(tmp_path):
    with pytest.raises(ValueError, match="vocab_size >= 260"):
        write_tiny(tmp_path / "a", vocab_size=100)
    d = write_tiny(tmp_path / "b", vocab_size=100, tokenizer=False)
    assert not (d / "tokenizer.json").exists()
    cfg = load_config(d)
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.pad_token_id) == (96, (97, 99), 98)
    _, info = AutoModelForCausalLM.from_pretrained(d, output_loading_info=True)
    assert not any(info.values())


# ------------------------------------------------------------------ tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    tokenizers = pytest.importorskip("tokenizers")
    d = write_tiny(tmp_path_factory.mktemp("tok") / "m")
    return tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))


@settings(max_examples=100)
# valid UTF-8 text ("<" left out: it could spell a special token)
@given(st.text(st.characters(exclude_characters="<", exclude_categories=("Cs",)), max_size=40))
def test_tokenizer_round_trips_bytes(tok, text):
    ids = tok.encode(text).ids
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_tokenizer_specials(tok, tmp_path):
    assert tok.get_vocab_size() == 256 + len(SPECIAL_TOKENS)
    assert [tok.token_to_id(s) for s in SPECIAL_TOKENS] == [256, 257, 258, 259]
    assert tok.encode("<|bos|>hi<|eot|>").ids == [256, 104, 105, 259]
    assert tok.decode([256, 104, 105, 257]) == "hi"
    assert tok.decode([256, 104, 105, 257], skip_special_tokens=False) == "<|bos|>hi<|eos|>"


def test_auto_tokenizer_loads_it(tmp_path):
    pytest.importorskip("tokenizers")
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(write_tiny(tmp_path / "m"))
    assert (t.bos_token_id, t.eos_token_id, t.pad_token_id) == (256, 257, 258)
    assert t("héllo").input_ids == list("héllo".encode())


# ------------------------------------------------------------------ default model


def test_default_model_dir_written_once(tmp_path, monkeypatch):
    monkeypatch.setenv("SUPERFLUID_CACHE", str(tmp_path))
    d = default_model_dir()
    assert d.parent == tmp_path and d.name.startswith("tiny-")
    stamp = (d / "model.safetensors").stat().st_mtime_ns
    assert default_model_dir() == d and (d / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [d.name]  # no temp dir left
    cfg = load_config(d)
    assert cfg.arch == "llama" and cfg.hidden_size == TINY["hidden_size"]
    ref = tensors_of(write_tiny(tmp_path / "ref", **tiny._DEFAULT_PARAMS["llama"]))
    w = load_weights(d, cfg)
    assert all(torch.equal(w[n], ref[n]) for n in w)


def test_default_model_dir_races(tmp_path, monkeypatch):
    monkeypatch.setenv("SUPERFLUID_CACHE", str(tmp_path / "cache"))
    results: list[Path] = []
    errors: list[BaseException] = []

    def run():
        try:
            results.append(default_model_dir())
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [results[0].name]
    assert set(tensors_of(results[0])) == set(expected_shapes(tiny_config(**TINY))) | {"lm_head.weight"}


# ------------------------------------------------------------------ mamba2


def test_mamba2_through_write_tiny(tmp_path):
    """arch="mamba2": write_tiny_mamba2's weights, the transformer tiny
    model's tokenizer and special ids, and a directory HF and our loader read."""
    from superfluid.engine import load
    from superfluid.engine.tiny_mamba2 import write_tiny_mamba2

    d = write_tiny(tmp_path / "m", arch="mamba2", seed=5)
    raw = json.loads((d / "config.json").read_text())
    assert raw["model_type"] == "mamba2" and raw["vocab_size"] == tiny.TINY_MAMBA2["vocab_size"]
    assert (raw["bos_token_id"], raw["eos_token_id"], raw["pad_token_id"]) == (256, [257, 259], 258)
    llama = write_tiny(tmp_path / "l")
    assert (d / "tokenizer.json").read_bytes() == (llama / "tokenizer.json").read_bytes()
    assert json.loads((d / "tokenizer_config.json").read_text())["eos_token"] == "<|eos|>"
    # the weights are write_tiny_mamba2's for the seed, whatever the special ids
    ours = load_file(d / "model.safetensors")
    ref = load_file(write_tiny_mamba2(tmp_path / "ref", seed=5) / "model.safetensors")
    assert set(ours) == set(ref) and all(torch.equal(ours[n], ref[n]) for n in ours)
    other = load_file(write_tiny(tmp_path / "o", arch="mamba2", seed=6) / "model.safetensors")
    assert not any(torch.equal(ours[n], other[n]) for n in ours if ours[n].numel() > 1)

    rt = load(d)
    assert rt.desc.exact_only and rt.vocabulary().eos == {257, 259}
    assert rt.vocabulary().specials == {s: 256 + i for i, s in enumerate(SPECIAL_TOKENS)}
    assert rt.tokenizer_json == (d / "tokenizer.json").read_text()
    _, info = AutoModelForCausalLM.from_pretrained(d, output_loading_info=True)
    assert not any(info.values()), info


def test_mamba2_a_grammar_compiles_against_its_tokenizer(tmp_path):
    pytest.importorskip("llguidance")
    from superfluid.engine import load
    from superfluid.executor import Executor

    ex = Executor(load(write_tiny(tmp_path / "m", arch="mamba2", seed=1)))
    done = ex.op({"op": "REGISTER_GRAMMAR", "op_id": 1, "kind": "regex", "text": "[ab]{3}"})
    assert done.status == 0 and done.handle


def test_mamba2_parameters(tmp_path):
    d = write_tiny(tmp_path / "a", arch="mamba2", vocab_size=100, tokenizer=False, num_layers=1, n_groups=2)
    raw = json.loads((d / "config.json").read_text())
    assert (raw["num_hidden_layers"], raw["n_groups"]) == (1, 2) and not (d / "tokenizer.json").exists()
    assert (raw["bos_token_id"], raw["eos_token_id"], raw["pad_token_id"]) == (96, [97, 99], 98)
    with pytest.raises(ValueError, match="vocab_size >= 260"):
        write_tiny(tmp_path / "b", arch="mamba2", vocab_size=100)
    with pytest.raises(TypeError, match="intermediate_size"):
        write_tiny(tmp_path / "c", arch="mamba2", intermediate_size=128)  # a transformer's parameter
    with pytest.raises(TypeError, match="eos_token_id"):
        write_tiny(tmp_path / "d", arch="mamba2", eos_token_id=3)
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "x").write_text("mine")
    with pytest.raises(FileExistsError):
        write_tiny(tmp_path / "e", arch="mamba2")


def test_default_mamba2_model_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SUPERFLUID_CACHE", str(tmp_path))
    d = default_model_dir("mamba2")
    assert default_model_dir("mamba2") == d != default_model_dir()
    assert json.loads((d / "config.json").read_text())["model_type"] == "mamba2"
    assert (d / "tokenizer.json").exists()
    ref = load_file(write_tiny(tmp_path / "ref", **tiny._DEFAULT_PARAMS["mamba2"]) / "model.safetensors")
    got = load_file(d / "model.safetensors")
    assert all(torch.equal(got[n], ref[n]) for n in ref)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([d.name, default_model_dir().name, "ref"])
    with pytest.raises(ValueError, match="embedded"):
        default_model_dir("gpt2")
