"""engine.weights: seeded tiny checkpoints load here exactly as transformers
loads them, sharded or not, in any dtype; every mismatch between a
checkpoint and its config is refused naming the tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from superfluid.engine.config import load_config
from superfluid.engine.tiny import SMALL, TINY, tiny_config, write_tiny
from superfluid.engine.weights import INDEX_FILE, WeightError, expected_shapes, load_weights, num_params

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM  # noqa: E402

VARIANTS = {
    "llama": dict(arch="llama"),
    "llama-bias-tied-llama3": dict(arch="llama", attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
                                   rope_scaling="llama3"),
    "mistral": dict(arch="mistral"),
    "mistral-window": dict(arch="mistral", sliding_window=16),
    "qwen2": dict(arch="qwen2"),
    "qwen2-tied-window": dict(arch="qwen2", tie_word_embeddings=True, sliding_window=8),
    "qwen3": dict(arch="qwen3", head_dim=32),
    "qwen3-bias-linear": dict(arch="qwen3", attention_bias=True, rope_scaling="linear"),
}


def hf_load(d: Path):
    model, info = AutoModelForCausalLM.from_pretrained(d, output_loading_info=True)
    return model, info


@pytest.mark.parametrize("name", VARIANTS)
def test_loads_like_transformers(tmp_path, name):
    d = write_tiny(tmp_path / name, **VARIANTS[name])
    model, info = hf_load(d)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert not info["error_msgs"]
    cfg = load_config(d)
    w = load_weights(d, cfg)
    sd = model.state_dict()
    assert list(w) == [n for n in sd]  # same names, same order
    for n, t in w.items():
        assert t.dtype == torch.float32 and torch.equal(t, sd[n]), n
    if cfg.tie_word_embeddings:
        assert w["lm_head.weight"] is w["model.embed_tokens.weight"]
    # the biases and norms a variant implies are really there, and random
    assert any(n.endswith("q_proj.bias") for n in w) == cfg.attention_bias
    assert any(n.endswith("q_norm.weight") for n in w) == cfg.qk_norm


@pytest.mark.parametrize("shards", [2, 3, 7])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_sharded_loads_as_unsharded(tmp_path, shards, arch):
    one = write_tiny(tmp_path / "one", arch=arch)
    many = write_tiny(tmp_path / "many", arch=arch, shards=shards)
    files = sorted(p.name for p in many.glob("*.safetensors"))
    assert files == [f"model-{i:05d}-of-{shards:05d}.safetensors" for i in range(1, shards + 1)]
    index = json.loads((many / INDEX_FILE).read_text())
    assert set(index["weight_map"]) == set(expected_shapes(load_config(many)))
    a, b = load_weights(one, load_config(one)), load_weights(many, load_config(many))
    assert list(a) == list(b) and all(torch.equal(a[n], b[n]) for n in a)
    model, info = hf_load(many)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert all(torch.equal(t, b[n]) for n, t in model.state_dict().items())


def test_one_shard_per_tensor(tmp_path):
    n = len(expected_shapes(tiny_config()))
    d = write_tiny(tmp_path / "d", shards=n)
    assert len(list(d.glob("*.safetensors"))) == n
    assert len(load_weights(d, load_config(d))) == n
    with pytest.raises(ValueError, match="shards"):
        write_tiny(tmp_path / "e", shards=n + 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_checkpoints_load_and_cast(tmp_path, dtype):
    name = str(dtype).removeprefix("torch.")
    d = write_tiny(tmp_path / name, arch="qwen3", dtype=name)
    cfg = load_config(d)
    assert cfg.dtype == dtype
    w = load_weights(d, cfg)
    assert all(t.dtype == dtype for t in w.values())
    model, info = hf_load(d)
    assert model.dtype == dtype and not info["missing_keys"]
    assert all(torch.equal(t, w[n]) for n, t in model.state_dict().items())
    w32 = load_weights(d, cfg, dtype=torch.float32)
    assert all(t.dtype == torch.float32 and torch.equal(t, w[n].float()) for n, t in w32.items())
    # same seed, same values: the half checkpoint is the float32 one rounded
    ref = load_weights(write_tiny(tmp_path / "f32", arch="qwen3"), load_config(tmp_path / "f32"))
    assert all(torch.equal(w[n], ref[n].to(dtype)) for n in w)


def test_float32_checkpoint_cast_down(tmp_path):
    d = write_tiny(tmp_path / "d")
    w = load_weights(d, load_config(d), dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in w.values())


def test_small_preset_size():
    n = num_params(tiny_config(**SMALL))
    assert 50e6 <= n <= 100e6, n
    assert num_params(tiny_config(**TINY)) < 200_000


def test_expected_shapes():
    cfg = tiny_config(arch="qwen3", head_dim=24, num_heads=4, num_kv_heads=2, hidden_size=64,
                      attention_bias=True)
    s = expected_shapes(cfg)
    a = "model.layers.1.self_attn."
    assert s[a + "q_proj.weight"] == (96, 64) and s[a + "k_proj.weight"] == (48, 64)
    assert s[a + "o_proj.weight"] == (64, 96) and s[a + "o_proj.bias"] == (64,)
    assert s[a + "q_norm.weight"] == (24,) and s["lm_head.weight"] == (320, 64)
    assert "lm_head.weight" not in expected_shapes(tiny_config(tie_word_embeddings=True))


# ------------------------------------------------------------------ refusals


@pytest.fixture
def ckpt(tmp_path) -> Path:
    return write_tiny(tmp_path / "ckpt", arch="qwen2")


def rewrite(d: Path, edit) -> None:
    sd = load_file(d / "model.safetensors")
    edit(sd)
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})


def refused(d: Path, *needles: str) -> str:
    with pytest.raises(WeightError) as ei:
        load_weights(d, load_config(d))
    msg = str(ei.value)
    for n in needles:
        assert n in msg, msg
    return msg


def test_missing_tensor(ckpt):
    rewrite(ckpt, lambda sd: sd.pop("model.layers.1.self_attn.k_proj.bias"))
    refused(ckpt, str(ckpt), "missing tensor 'model.layers.1.self_attn.k_proj.bias'")


def test_missing_lm_head_when_untied(ckpt):
    rewrite(ckpt, lambda sd: sd.pop("lm_head.weight"))
    refused(ckpt, "missing tensor 'lm_head.weight'")


def test_wrong_shape(ckpt):
    def edit(sd):
        sd["model.layers.0.mlp.up_proj.weight"] = torch.zeros(127, 64)
    rewrite(ckpt, edit)
    refused(ckpt, "'model.layers.0.mlp.up_proj.weight'", "(127, 64)", "(128, 64)")


def test_unexpected_tensor(ckpt):
    def edit(sd):
        sd["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)  # qwen2 has no o_proj bias
        sd["model.layers.2.input_layernorm.weight"] = torch.ones(64)  # nor a third layer
    rewrite(ckpt, edit)
    refused(ckpt, "unexpected tensors", "'model.layers.0.self_attn.o_proj.bias'",
            "'model.layers.2.input_layernorm.weight'")


def test_rotary_buffers_are_harmless(ckpt):
    def edit(sd):
        sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
        sd["model.rotary_emb.inv_freq"] = torch.ones(8)
    rewrite(ckpt, edit)
    assert "model.rotary_emb.inv_freq" not in load_weights(ckpt, load_config(ckpt))


def test_integer_tensor(ckpt):
    def edit(sd):
        sd["model.norm.weight"] = torch.ones(64, dtype=torch.int32)
    rewrite(ckpt, edit)
    refused(ckpt, "'model.norm.weight'", "int32")


def test_tied_checkpoint_that_also_stores_the_head(tmp_path):
    d = write_tiny(tmp_path / "d", tie_word_embeddings=True)
    rewrite(d, lambda sd: sd.__setitem__("lm_head.weight", sd["model.embed_tokens.weight"].clone()))
    w = load_weights(d, load_config(d))
    assert w["lm_head.weight"] is w["model.embed_tokens.weight"]
    # a different stored head: transformers 5 serves it untied, so do we
    rewrite(d, lambda sd: sd.__setitem__("lm_head.weight", torch.zeros(320, 64)))
    w = load_weights(d, load_config(d))
    assert not w["lm_head.weight"].any()
    model, _ = hf_load(d)
    assert torch.equal(model.lm_head.weight, w["lm_head.weight"])
    rewrite(d, lambda sd: sd.__setitem__("lm_head.weight", torch.zeros(3, 64)))
    refused(d, "'lm_head.weight'", "(3, 64)")


def test_missing_shard(tmp_path):
    d = write_tiny(tmp_path / "d", shards=3)
    (d / "model-00002-of-00003.safetensors").unlink()
    refused(d, INDEX_FILE, "missing shard file model-00002-of-00003.safetensors")


def test_index_lists_a_tensor_its_shard_lacks(tmp_path):
    d = write_tiny(tmp_path / "d", shards=2)
    index = json.loads((d / INDEX_FILE).read_text())
    index["weight_map"]["model.norm.weight"] = "model-00001-of-00002.safetensors"
    (d / INDEX_FILE).write_text(json.dumps(index))
    refused(d, "'model.norm.weight'", "model-00001-of-00002.safetensors")


def test_shard_holds_a_tensor_the_index_does_not_list(tmp_path):
    d = write_tiny(tmp_path / "d", shards=2)
    index = json.loads((d / INDEX_FILE).read_text())
    del index["weight_map"]["model.norm.weight"]
    (d / INDEX_FILE).write_text(json.dumps(index))
    refused(d, "'model.norm.weight'", "not listed")


def test_bad_index(tmp_path):
    d = write_tiny(tmp_path / "d", shards=2)
    (d / INDEX_FILE).write_text("{}")
    refused(d, INDEX_FILE, "not a safetensors index")


def test_no_weights(tmp_path):
    d = write_tiny(tmp_path / "d")
    (d / "model.safetensors").unlink()
    refused(d, "no *.safetensors")
    with pytest.raises(WeightError, match="not a checkpoint directory"):
        load_weights(d / "nope", load_config(d))


def test_unindexed_files_with_the_same_tensor(tmp_path):
    d = write_tiny(tmp_path / "d")
    shutil.copy(d / "model.safetensors", d / "copy.safetensors")
    refused(d, "is in both")


def test_corrupt_file(tmp_path):
    d = write_tiny(tmp_path / "d")
    (d / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00garbage!")
    refused(d, "model.safetensors", "not a readable safetensors file")


def test_config_and_checkpoint_disagree(tmp_path):
    """A checkpoint of one arch read with another's config: the first missing
    tensor is named (qwen3's q_norm), not a shape error deep in the model."""
    d = write_tiny(tmp_path / "d", arch="llama")
    cfg = tiny_config(arch="qwen3")
    with pytest.raises(WeightError, match=r"missing tensor 'model\.layers\.0\.self_attn\.q_norm\.weight'"):
        load_weights(d, cfg)
