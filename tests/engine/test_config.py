"""engine.config: config.json as transformers 5 reads it, every refusal with
the field and the file it names, and rope tables against transformers' own."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, strategies as st

from superfluid.engine.checkpoint import ConfigError
from superfluid.engine.config import ModelConfig, load_config
from superfluid.engine.rope_scaling import rope_cos_sin, rope_inv_freq
from superfluid.engine.weights import expected_shapes

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

_HF_CLASSES = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config",
               "qwen3": "Qwen3Config"}
SMALL_DIMS = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def hf_config(arch: str, **kw: Any):
    return getattr(transformers, _HF_CLASSES[arch])(**{**SMALL_DIMS, **kw})


def write_json(d: Path, name: str, obj: dict) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_text(json.dumps(obj))
    return d


def saved(tmp_path: Path, hc) -> Path:
    d = tmp_path / "ckpt"
    hc.save_pretrained(d)
    return d


def hf_state_shapes(hc) -> dict[str, tuple[int, ...]]:
    """The parameter shapes transformers' model for `hc` has (built on the
    meta device: no memory, no init)."""
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(hc)
    return {k: tuple(v.shape) for k, v in m.state_dict().items()}


def assert_matches_hf(cfg: ModelConfig, hc) -> None:
    """Our reading of a config means what transformers' does."""
    assert cfg.arch == hc.model_type
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads,
            cfg.num_kv_heads) == (hc.vocab_size, hc.hidden_size, hc.intermediate_size, hc.num_hidden_layers,
                                  hc.num_attention_heads, hc.num_key_value_heads)
    assert cfg.head_dim == (getattr(hc, "head_dim", None) or hc.hidden_size // hc.num_attention_heads)
    assert cfg.rms_norm_eps == hc.rms_norm_eps
    assert cfg.max_position_embeddings == hc.max_position_embeddings
    assert cfg.tie_word_embeddings == hc.tie_word_embeddings
    rp = dict(hc.rope_parameters)
    assert cfg.rope_theta == rp.pop("rope_theta")
    rtype = rp.pop("rope_type")
    rp.pop("type", None)
    assert cfg.rope_scaling == (None if rtype == "default" else {"rope_type": rtype, **rp})
    assert cfg.dtype == (hc.dtype or torch.float32)
    hc_eos = hc.eos_token_id if isinstance(hc.eos_token_id, list) else [hc.eos_token_id]
    assert all(e in cfg.eos_token_ids for e in hc_eos if e is not None)
    if cfg.arch == "llama":
        assert cfg.sliding_window is None
    else:
        assert cfg.sliding_window == hc.sliding_window
    if cfg.arch in ("qwen2", "qwen3"):
        windows = [hc.sliding_window if t == "sliding_attention" else None for t in hc.layer_types]
        assert [cfg.window_of(i) for i in range(cfg.num_layers)] == windows
    elif cfg.arch == "mistral":
        assert all(cfg.window_of(i) == hc.sliding_window for i in range(cfg.num_layers))
    # Biases, q/k norms, head sizes: the tensors we expect are the model's parameters.
    ours = expected_shapes(cfg)
    if cfg.tie_word_embeddings:
        ours["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    assert ours == hf_state_shapes(hc)


# ------------------------------------------------------------------ reading configs


@pytest.mark.parametrize("arch,kw", [
    ("llama", {}),
    ("llama", dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=True, head_dim=16)),
    ("llama", dict(rope_parameters={**LLAMA3, "rope_theta": 500000.0}, max_position_embeddings=256)),
    ("llama", dict(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6})),
    ("mistral", {}),
    ("mistral", dict(sliding_window=None)),
    ("mistral", dict(sliding_window=64, head_dim=16)),
    ("qwen2", {}),
    ("qwen2", dict(use_sliding_window=True, sliding_window=32, max_window_layers=1)),
    ("qwen2", dict(tie_word_embeddings=True, rms_norm_eps=1e-5)),
    ("qwen3", {}),
    ("qwen3", dict(head_dim=8, attention_bias=True)),
    ("qwen3", dict(use_sliding_window=True, sliding_window=16, max_window_layers=2)),
])
def test_reads_what_transformers_saves(tmp_path, arch, kw):
    hc = hf_config(arch, **kw)
    d = saved(tmp_path, hc)
    cfg = load_config(d)
    assert_matches_hf(cfg, AutoConfig.from_pretrained(d))
    assert load_config(d / "config.json") == cfg  # a config.json path works too


def test_transformers_5_field_names(tmp_path):
    """What transformers 5.24 writes: rope under rope_parameters (rope_type,
    rope_theta, the type's parameters), the dtype as "dtype"."""
    hc = hf_config("llama", rope_parameters={**LLAMA3, "rope_theta": 500000.0}, max_position_embeddings=256)
    hc.dtype = torch.bfloat16
    d = saved(tmp_path, hc)
    raw = json.loads((d / "config.json").read_text())
    assert raw["rope_parameters"] == {**LLAMA3, "rope_theta": 500000.0}
    assert "rope_theta" not in raw and "rope_scaling" not in raw
    assert raw["dtype"] == "bfloat16" and "torch_dtype" not in raw
    cfg = load_config(d)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling == LLAMA3 and cfg.dtype == torch.bfloat16


@pytest.mark.parametrize("key", ["type", "rope_type"])
def test_transformers_4_field_names(tmp_path, key):
    """transformers 4: top-level rope_theta, rope_scaling with "type" (old) or
    "rope_type", torch_dtype."""
    d = write_json(tmp_path, "config.json", {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", **SMALL_DIMS, "rope_theta": 500000.0,
        "rope_scaling": {key: "linear", "factor": 2.0}, "torch_dtype": "float16"})
    cfg = load_config(d)
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.dtype) == (500000.0, {"rope_type": "linear", "factor": 2.0},
                                                             torch.float16)
    assert_matches_hf(cfg, AutoConfig.from_pretrained(d))


def test_rope_precedence_matches_transformers(tmp_path):
    # A truthy rope_scaling replaces rope_parameters; the theta inside the dict beats the top-level one.
    d = write_json(tmp_path, "config.json", {
        "model_type": "llama", **SMALL_DIMS, "rope_theta": 1234.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 99.0},
        "rope_scaling": {"rope_type": "linear", "factor": 3.0, "rope_theta": 777.0}})
    cfg = load_config(d)
    assert cfg.rope_theta == 777.0 and cfg.rope_scaling == {"rope_type": "linear", "factor": 3.0}
    assert_matches_hf(cfg, AutoConfig.from_pretrained(d))


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_defaults_of_absent_fields_match_transformers(tmp_path, arch):
    """Only the required fields: the rest defaults as the transformers class
    does (Mistral's window 4096, Qwen3's head_dim 128, Llama's bos 1 / eos 2)."""
    d = write_json(tmp_path, "config.json", {"model_type": arch, **SMALL_DIMS})
    cfg = load_config(d)
    assert_matches_hf(cfg, AutoConfig.from_pretrained(d))
    assert cfg.dtype == torch.float32
    expect = {"llama": (None, 8, (2,), 1), "mistral": (4096, 8, (2,), 1), "qwen2": (None, 8, (), None),
              "qwen3": (None, 128, (), None)}[arch]
    assert (cfg.sliding_window, cfg.head_dim, cfg.eos_token_ids, cfg.bos_token_id) == expect


def test_arch_flags():
    base = {**SMALL_DIMS, "attention_bias": True, "mlp_bias": True}
    flags = {arch: ModelConfig.from_dict({"model_type": arch, **base}) for arch in _HF_CLASSES}
    as_tuple = {a: (c.attention_bias, c.o_bias, c.mlp_bias, c.qk_norm) for a, c in flags.items()}
    assert as_tuple == {"llama": (True, True, True, False), "mistral": (False, False, False, False),
                        "qwen2": (True, False, False, False), "qwen3": (True, True, False, True)}
    plain = ModelConfig.from_dict({"model_type": "qwen2", **SMALL_DIMS})
    assert plain.attention_bias and not plain.o_bias  # Qwen2 always biases q/k/v


def test_qwen_sliding_layers():
    cfg = ModelConfig.from_dict({"model_type": "qwen2", **SMALL_DIMS, "use_sliding_window": True,
                                 "sliding_window": 32, "max_window_layers": 1})
    assert [cfg.window_of(i) for i in range(3)] == [None, 32, 32]
    off = ModelConfig.from_dict({"model_type": "qwen2", **SMALL_DIMS, "sliding_window": 32})
    assert off.sliding_window is None and all(off.window_of(i) is None for i in range(3))


# ------------------------------------------------------------------ eos / bos / pad


def test_eos_ids_merge_generation_config(tmp_path):
    d = write_json(tmp_path, "config.json", {"model_type": "llama", **SMALL_DIMS, "eos_token_id": [5, 3],
                                             "bos_token_id": None})
    write_json(d, "generation_config.json", {"eos_token_id": [3, 9, 5, 11, 9], "bos_token_id": 4,
                                             "pad_token_id": 0})
    cfg = load_config(d)
    assert cfg.eos_token_ids == (5, 3, 9, 11)  # config.json's first, order kept, no repeats
    assert cfg.bos_token_id == 4 and cfg.pad_token_id == 0  # config.json's null falls back to generation's


def test_eos_int_and_no_generation_config(tmp_path):
    cfg = load_config(write_json(tmp_path, "config.json", {"model_type": "qwen2", **SMALL_DIMS,
                                                           "eos_token_id": 7}))
    assert cfg.eos_token_ids == (7,) and cfg.bos_token_id is None


# ------------------------------------------------------------------ refusals


def refused(tmp_path: Path, cfg: dict, *needles: str, gen: dict | None = None) -> ConfigError:
    d = write_json(tmp_path, "config.json", cfg)
    if gen is not None:
        write_json(d, "generation_config.json", gen)
    with pytest.raises(ConfigError) as ei:
        load_config(d)
    msg = str(ei.value)
    assert str(d / "config.json") in msg, msg
    for n in needles:
        assert n in msg, msg
    return ei.value


GOOD = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **SMALL_DIMS}


def test_unsupported_architecture(tmp_path):
    e = refused(tmp_path, {**GOOD, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"},
                "'architectures'", "GPT2LMHeadModel", "LlamaForCausalLM", "Qwen3ForCausalLM")
    assert e.field == "architectures"


def test_unsupported_model_type(tmp_path):
    cfg = {k: v for k, v in GOOD.items() if k != "architectures"}
    refused(tmp_path, {**cfg, "model_type": "gemma"}, "'model_type'", "gemma", "llama", "mistral", "qwen2",
            "qwen3")


def test_not_a_causal_lm_head(tmp_path):
    refused(tmp_path, {**GOOD, "architectures": ["LlamaForSequenceClassification"]}, "'architectures'",
            "LlamaForSequenceClassification")


def test_model_type_disagrees_with_architectures(tmp_path):
    refused(tmp_path, {**GOOD, "model_type": "qwen2"}, "'model_type'", "qwen2", "LlamaForCausalLM")


def test_no_architecture_at_all(tmp_path):
    refused(tmp_path, {k: v for k, v in GOOD.items() if k not in ("architectures", "model_type")},
            "'model_type'", "missing")


@pytest.mark.parametrize("act", ["gelu", "relu", "gelu_pytorch_tanh"])
def test_bad_hidden_act(tmp_path, act):
    refused(tmp_path, {**GOOD, "hidden_act": act}, "'hidden_act'", act, "silu")


def test_swish_is_silu():
    assert ModelConfig.from_dict({**GOOD, "hidden_act": "swish"}) == ModelConfig.from_dict(GOOD)


def test_heads_not_divisible(tmp_path):
    refused(tmp_path, {**GOOD, "num_attention_heads": 4, "num_key_value_heads": 3}, "'num_key_value_heads'",
            "not divisible", "4", "3")


@pytest.mark.parametrize("field", ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                   "num_attention_heads"])
def test_missing_required_field(tmp_path, field):
    refused(tmp_path, {k: v for k, v in GOOD.items() if k != field}, f"'{field}'", "missing")


@pytest.mark.parametrize("field,value", [
    ("hidden_size", "64"), ("num_hidden_layers", 2.5), ("num_hidden_layers", True), ("vocab_size", 0),
    ("rms_norm_eps", "x"), ("tie_word_embeddings", 1), ("sliding_window", -1),
])
def test_bad_field_types(tmp_path, field, value):
    cfg = {**GOOD, "model_type": "mistral", "architectures": ["MistralForCausalLM"], field: value}
    refused(tmp_path, cfg, f"'{field}'", repr(value))


@pytest.mark.parametrize("rope", [
    {"rope_type": "yarn", "factor": 4.0}, {"type": "dynamic", "factor": 2.0}, {"rope_type": "longrope"},
])
def test_unsupported_rope_type(tmp_path, rope):
    rtype = rope.get("rope_type", rope.get("type"))
    refused(tmp_path, {**GOOD, "rope_scaling": rope}, "'rope_scaling'", repr(rtype), "llama3", "linear")
    refused(tmp_path, {**GOOD, "rope_parameters": {**rope, "rope_theta": 1e4}}, "'rope_parameters'",
            repr(rtype))


def test_incomplete_rope_parameters(tmp_path):
    llama3 = {k: v for k, v in LLAMA3.items() if k != "low_freq_factor"}
    refused(tmp_path, {**GOOD, "rope_parameters": llama3}, "'rope_parameters'", "low_freq_factor")
    refused(tmp_path, {**GOOD, "rope_scaling": {"type": "linear"}}, "'rope_scaling'", "factor")
    refused(tmp_path, {**GOOD, "partial_rotary_factor": 0.5}, "'partial_rotary_factor'")


def test_llama3_pretraining_length_defaults_like_transformers():
    no_length = {k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"}
    cfg = ModelConfig.from_dict({**GOOD, "max_position_embeddings": 300, "rope_scaling": no_length})
    assert cfg.rope_scaling["original_max_position_embeddings"] == 300


def test_bad_dtype(tmp_path):
    refused(tmp_path, {**GOOD, "torch_dtype": "int8"}, "'torch_dtype'", "int8")
    refused(tmp_path, {**GOOD, "dtype": "float64"}, "'dtype'", "float64")


def test_bad_token_ids(tmp_path):
    refused(tmp_path / "a", {**GOOD, "pad_token_id": 96}, "'pad_token_id'", "96", "vocab_size 96")
    for i, gen in enumerate([{"eos_token_id": "</s>"}, {"eos_token_id": [2, 100]}]):
        d = write_json(tmp_path / f"g{i}", "config.json", GOOD)
        write_json(d, "generation_config.json", gen)
        with pytest.raises(ConfigError) as ei:
            load_config(d)
        assert str(ei.value).startswith(f"{d / 'generation_config.json'}: field 'eos_token_id'")


def test_unreadable_files(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("[1]")
    with pytest.raises(ConfigError, match="JSON object"):
        load_config(tmp_path)


def test_from_dict_names_its_source():
    with pytest.raises(ConfigError, match=r"^my.json: field 'hidden_act'"):
        ModelConfig.from_dict({**GOOD, "hidden_act": "gelu"}, source="my.json")


def test_direct_construction_is_checked():
    kw = dict(arch="llama", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2,
              num_kv_heads=1, head_dim=4)
    assert ModelConfig(**kw).layer_types == ("full_attention",)
    with pytest.raises(ConfigError, match="num_kv_heads"):
        ModelConfig(**{**kw, "num_kv_heads": 3})
    with pytest.raises(ConfigError, match="qwen2 requires attention_bias=True"):
        ModelConfig(**{**kw, "arch": "qwen2"})
    with pytest.raises(ConfigError, match="o_bias"):
        ModelConfig(**{**kw, "attention_bias": True})
    with pytest.raises(ConfigError, match="gpt2"):
        ModelConfig(**{**kw, "arch": "gpt2"})
    with pytest.raises(ConfigError, match="rope"):
        ModelConfig(**{**kw, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})


# ------------------------------------------------------------------ round trip


@st.composite
def model_configs(draw) -> ModelConfig:
    arch = draw(st.sampled_from(sorted(_HF_CLASSES)))
    kv = draw(st.integers(1, 3))
    heads = kv * draw(st.integers(1, 3))
    head_dim = 2 * draw(st.integers(1, 8))
    layers = draw(st.integers(1, 4))
    window = None if arch == "llama" else draw(st.none() | st.integers(1, 4096))
    layer_types: tuple[str, ...] = ()
    if window is not None and arch in ("qwen2", "qwen3"):
        layer_types = tuple(draw(st.lists(st.sampled_from(["full_attention", "sliding_attention"]),
                                          min_size=layers, max_size=layers)))
    bias = draw(st.booleans())
    rope = draw(st.sampled_from([None, {"rope_type": "linear", "factor": 2.5}, LLAMA3]))
    vocab = draw(st.integers(1, 200))
    token = st.integers(0, vocab - 1)
    eos = tuple(draw(st.lists(token, unique=True, max_size=3)))
    return ModelConfig(
        # transformers' LlamaConfig wants hidden_size divisible by the heads, even with head_dim set
        arch=arch, vocab_size=vocab, hidden_size=heads * draw(st.integers(1, 8)),
        intermediate_size=draw(st.integers(1, 64)), num_layers=layers, num_heads=heads, num_kv_heads=kv,
        head_dim=head_dim, rms_norm_eps=draw(st.sampled_from([1e-5, 1e-6])),
        rope_theta=draw(st.sampled_from([10000.0, 5e5, 1e6])), rope_scaling=rope,
        max_position_embeddings=draw(st.integers(65, 4096)), sliding_window=window,
        tie_word_embeddings=draw(st.booleans()),
        attention_bias={"qwen2": True, "mistral": False}.get(arch, bias),
        o_bias=bias and arch in ("llama", "qwen3"),
        mlp_bias=arch == "llama" and draw(st.booleans()), qk_norm=arch == "qwen3",
        dtype=draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16])), eos_token_ids=eos,
        bos_token_id=draw(st.none() | token), pad_token_id=draw(st.none() | token),
        layer_types=layer_types)


@given(model_configs())
def test_hf_dict_round_trip(cfg):
    d = cfg.to_hf_dict()
    assert ModelConfig.from_dict(json.loads(json.dumps(d)), cfg.generation_dict()) == cfg
    hc = AutoConfig.for_model(**d)
    assert_matches_hf(cfg, hc)


def test_hashable_and_frozen():
    cfg = ModelConfig.from_dict({**GOOD, "rope_parameters": LLAMA3})
    assert hash(cfg) == hash(ModelConfig.from_dict({**GOOD, "rope_parameters": LLAMA3}))
    with pytest.raises(AttributeError):
        cfg.hidden_size = 3  # type: ignore[misc]


# ------------------------------------------------------------------ rope vs transformers


ROPES = [None, {"rope_type": "linear", "factor": 4.0}, LLAMA3,
         {**LLAMA3, "factor": 32.0, "original_max_position_embeddings": 8192}]


def hf_rotary(hc):
    return AutoModelForCausalLM.from_config(hc).model.rotary_emb


@pytest.mark.parametrize("rope", ROPES, ids=["default", "linear", "llama3", "llama3-8k"])
@pytest.mark.parametrize("head_dim,theta", [(8, 10000.0), (64, 500000.0), (80, 1e6), (128, 12345.6)])
def test_inv_freq_matches_transformers(rope, head_dim, theta):
    hc = hf_config("llama", head_dim=head_dim, num_hidden_layers=1, max_position_embeddings=16384,
                   rope_parameters={"rope_type": "default", **(rope or {}), "rope_theta": theta})
    cfg = ModelConfig.from_dict(hc.to_dict())
    ours = rope_inv_freq(cfg)
    assert ours.dtype == torch.float32 and ours.shape == (head_dim // 2,)
    rtype = hc.rope_parameters["rope_type"]
    if rtype == "default":
        theirs, scale = hf_rotary(hc).compute_default_rope_parameters(hc)
    else:
        theirs, scale = ROPE_INIT_FUNCTIONS[rtype](hc)
    assert scale == 1.0
    # transformers works in float32 (pow, divide): it may be an ulp off the
    # correctly rounded value ours is; every frequency is <= 1.
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-7)
    ulps = (ours.view(torch.int32) - theirs.view(torch.int32)).abs()
    assert int(ulps.max()) <= 16


@pytest.mark.parametrize("rope", ROPES, ids=["default", "linear", "llama3", "llama3-8k"])
def test_cos_sin_match_transformers(rope):
    n = 256
    hc = hf_config("llama", head_dim=16, num_hidden_layers=1, max_position_embeddings=16384,
                   rope_parameters={"rope_type": "default", **(rope or {}), "rope_theta": 10000.0})
    cfg = ModelConfig.from_dict(hc.to_dict())
    cos, sin = rope_cos_sin(cfg, n)
    assert cos.shape == sin.shape == (n, 8) and cos.dtype == sin.dtype == torch.float32
    # Exactly the float64 angles of our float32 frequencies, rounded once.
    angles = torch.arange(n, dtype=torch.float64)[:, None] * rope_inv_freq(cfg).double()
    assert torch.equal(cos, angles.cos().float()) and torch.equal(sin, angles.sin().float())
    # transformers' forward (float32 angles; cat of two halves): equal up to
    # its float32 rounding of position * freq, which grows with the position.
    rot = hf_rotary(hc)
    x = torch.zeros(1, n, 16)
    hf_cos, hf_sin = rot(x, torch.arange(n)[None])
    assert torch.equal(hf_cos[0, :, :8], hf_cos[0, :, 8:])
    tol = torch.arange(n)[:, None] * 2e-7 + 1e-6
    assert ((hf_cos[0, :, :8] - cos).abs() <= tol).all()
    assert ((hf_sin[0, :, :8] - sin).abs() <= tol).all()


def test_rope_scalings_change_what_they_should():
    base = ModelConfig.from_dict({**GOOD, "head_dim": 64})
    lin = ModelConfig.from_dict({**GOOD, "head_dim": 64, "rope_scaling": {"type": "linear", "factor": 4.0}})
    l3 = ModelConfig.from_dict({**GOOD, "head_dim": 64, "rope_parameters": LLAMA3})
    f, fl, f3 = rope_inv_freq(base), rope_inv_freq(lin), rope_inv_freq(l3)
    torch.testing.assert_close(fl, f / 4.0, rtol=1e-7, atol=0)
    wavelen = 2 * math.pi / f.double()
    assert torch.equal(f3[wavelen < 64 / 4], f[wavelen < 64 / 4])  # short wavelengths kept
    torch.testing.assert_close(f3[wavelen > 64], f[wavelen > 64] / 8.0, rtol=1e-7, atol=0)  # long ones scaled
    assert rope_cos_sin(base, 0)[0].shape == (0, 32)
