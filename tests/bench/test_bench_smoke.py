"""Smoke tests of `superfluid bench tick|engine|e2e` at tiny sizes: they run,
give the documented JSON keys with sane values, and leave nothing behind.
No timing thresholds: this machine's speed is not what is tested."""

from __future__ import annotations

import json
import os

import pytest

from superfluid.bench import e2e, engine, gpu_check, peers, tick
from superfluid.cli import main


def test_bench_tick_keys():
    res = tick.run(lanes=(1, 16), rounds=2, ticks=3)
    assert set(res["us_per_lane_round"]) == {"1", "16"}
    assert all(v > 0 for v in res["us_per_lane_round"].values())
    assert res["mixed"]["us_per_lane_round"] > 0


ENGINE_KEYS = ("decode_tok_s", "hf_decode_tok_s", "prefill_tok_s", "hf_prefill_tok_s", "decode_speedup_vs_hf",
               "achieved_gflops", "greedy_agreement", "invariance_tax_by_batch")


def test_bench_engine_keys(tmp_path, monkeypatch):
    monkeypatch.setenv("SUPERFLUID_CACHE", str(tmp_path))
    res = engine.run(batches=(1, 3), prompt_len=8, gen=3, small=False, dtype="both", threads=1, peak_n=128,
                     profile=True)
    bf16 = res["bf16"]
    for block, dtype in ((res, "float32"), (bf16, "bfloat16")):
        assert block["dtype"] == dtype and block["peak_gflops"] > 0
        for key in ENGINE_KEYS:
            assert set(block[key]) == {"1", "3"}, (dtype, key)
        for key in ENGINE_KEYS[:6]:
            assert all(v > 0 for v in block[key].values()), (dtype, key)
        assert block["invariance_tax"] is not None
        ops = block["profile"]["3"]
        assert ops and all(v["self_cpu_us"] >= 0 and v["count"] >= 1 for v in ops.values()), dtype
    # same weights, greedy, fp32: our tokens are HF's but for a rare near-tie
    agree = res["models"]["tiny"]["greedy_agreement"]
    assert min(agree.values()) >= 0.5, agree
    assert res["peak_rss_mb"] > 0 and res["threads"] == 1 and res["device"] == "cpu"
    assert res["isa"]["torch_cpu_capability"] and set(res["isa"]["cpu_flags"]) >= {"avx512f", "amx_bf16"}
    load = res["load"]
    assert len(load["loadavg_before"]) == 3 and len(load["loadavg_after"]) == 3
    assert 0 <= load["other_processes_cpu_share"] <= 1
    assert res["workload"]["dtypes"] == ["float32", "bfloat16"]


def test_bench_peers_absent_are_reported_not_raised(monkeypatch):
    monkeypatch.setattr(peers, "_MODULES", {"ghost": ("no_such_module_superfluid",)})
    out = peers.run_peers(["ghost", "nope"], None, None, {}, {}, 3, 1, lambda s: None)
    assert out["ghost"] == {"installed": False, "greedy_agreement": None, "decode_tok_s": {}, "error": None}
    assert not out["nope"]["installed"] and "unknown peer" in out["nope"]["error"]


def test_gguf_export_permutes_q_and_k(tmp_path):
    gguf = pytest.importorskip("gguf")
    import numpy as np
    import torch
    from safetensors.torch import load_file

    from superfluid.engine.tiny import TINY, write_tiny

    ckpt = write_tiny(tmp_path / "ckpt", arch="llama", seed=0, tokenizer=False)
    hf = load_file(ckpt / "model.safetensors")
    path = peers.write_gguf(ckpt, tmp_path / "m.gguf", torch.bfloat16)
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    assert len(tensors) == len(hf)
    assert tensors["blk.0.attn_q.weight"].tensor_type == gguf.GGMLQuantizationType.BF16
    assert tensors["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    q = hf["model.layers.0.self_attn.q_proj.weight"].numpy()
    got = gguf.quants.dequantize(tensors["blk.0.attn_q.weight"].data, gguf.GGMLQuantizationType.BF16)
    want = peers.permute_for_rope(q, TINY["num_heads"], TINY["num_heads"])
    np.testing.assert_allclose(got.reshape(q.shape), want, rtol=1e-2, atol=1e-2)
    # llama.cpp's rope rotates pairs (2i, 2i+1); HF's rotates (i, i + d/2): row 1 of a head is HF's row d/2
    d = TINY["hidden_size"] // TINY["num_heads"]
    np.testing.assert_array_equal(want[1], q[d // 2])


def test_gpu_check_without_a_gpu_says_so(tmp_path, monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "gpu-check.json"
    assert gpu_check.main(["--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    assert printed["gpu"] is False and "no CUDA GPU" in printed["reason"]
    assert main(["bench", "engine", "--device", "cuda", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["gpu"] is False


@pytest.mark.timeout(300)
def test_bench_e2e_keys(shm_dir, capsys):
    assert main(["bench", "e2e", "--json", "--requests", "4", "--repeats", "2"]) == 0
    res = json.loads(capsys.readouterr().out)
    for key in ("tok_s", "inproc_tok_s", "hf_tok_s"):
        assert res[key] > 0, key
    assert res["ttft_ms"]["p50"] > 0 and res["ttft_ms"]["p99"] >= res["ttft_ms"]["p50"]
    assert res["same_tokens_daemon_vs_inproc"] is True and res["same_tokens_every_run"] is True
    assert len(res["runs_tok_s"]["daemon"]) == 1  # the warm-up run is not counted
    assert not os.listdir(shm_dir)
