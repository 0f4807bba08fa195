"""Smoke tests of `superfluid bench tick|engine|e2e` at tiny sizes: they run,
give the documented JSON keys with sane values, and leave nothing behind.
No timing thresholds: this machine's speed is not what is tested."""

from __future__ import annotations

import json
import os

import pytest

from superfluid.bench import engine, gpu_check, peers, roofline, tick
from superfluid.cli import main


def test_bench_tick_keys():
    res = tick.run(lanes=(1, 16), rounds=2, ticks=3)
    assert set(res["us_per_lane_round"]) == {"1", "16"}
    assert all(v > 0 for v in res["us_per_lane_round"].values())
    assert res["mixed"]["us_per_lane_round"] > 0


ENGINE_KEYS = ("decode_tok_s", "hf_decode_tok_s", "prefill_tok_s", "hf_prefill_tok_s", "decode_speedup_vs_hf",
               "achieved_gflops", "step_ms", "floor_fraction", "peak_fraction", "greedy_agreement",
               "invariance_tax_by_batch")
ISA_RUN_KEYS = ("decode_tok_s", "prefill_tok_s", "achieved_gflops", "step_ms", "floor_fraction", "peak_fraction")


def _refuse_above(monkeypatch, cpu, level: int) -> None:
    """cpu.force_isa as on a CPU whose best path is `level`."""
    real = cpu.force_isa

    def force_isa(want):
        lvl = cpu.parse_isa(want) if isinstance(want, str) else want
        if lvl is not None and lvl > level:
            raise ValueError(f"ISA path {cpu.ISA_NAMES[lvl]!r} is above this CPU's best, {cpu.ISA_NAMES[level]!r}")
        real(want)

    monkeypatch.setattr(cpu, "force_isa", force_isa)


def test_bench_engine_keys(tmp_path, monkeypatch):
    from superfluid.engine.config import load_config
    from superfluid.kernels import cpu

    monkeypatch.setenv("SUPERFLUID_CACHE", str(tmp_path))
    # --isa: our decode again on avx2, and on a path above the CPU's best (its entry an error, the run
    # goes on). Where this CPU has every path, one is refused as a CPU without avx512-bf16 would.
    best = cpu.parse_isa(cpu.best_isa()) if cpu.available() else 0
    above = cpu.ISA_NAMES[min(best + 1, max(cpu.ISA_NAMES))]
    if cpu.available() and best == max(cpu.ISA_NAMES):
        _refuse_above(monkeypatch, cpu, best - 1)
    isa = ("avx2", above) if cpu.available() and best >= cpu.ISA_LEVELS["avx2"] else ()
    path_before = cpu.isa()
    res = engine.run(batches=(1, 3), prompt_len=8, gen=3, small=False, dtype="both", threads=1, peak_n=128,
                     profile=True, mamba2=False, isa=isa)  # its rows: tests/bench/test_bench_mamba2.py
    assert cpu.isa() == path_before  # the forced paths were reset
    bf16 = res["bf16"]
    tiny = load_config(next(tmp_path.glob("bench-tiny-*")))
    read = res["read_bandwidth"]
    assert read["read_gbs"] > 0 and read["statistic"] == "best" and read["threads"] == 1
    # the faster of two probes: torch.sum and the kernels' four-stream read
    assert read["read_gbs"] == max(read["torch_sum_gbs"], read["kernel_probe_gbs"]) > 0
    for block, dtype in ((res, "float32"), (bf16, "bfloat16")):
        assert block["dtype"] == dtype and block["peak_gflops"] > 0
        for key in ENGINE_KEYS:
            assert set(block[key]) == {"1", "3"}, (dtype, key)
        for key in ENGINE_KEYS[:9]:
            assert all(v > 0 for v in block[key].values()), (dtype, key)
        assert block["invariance_tax"] is not None
        ops = block["profile"]["3"]
        assert ops and all(v["self_cpu_us"] >= 0 and v["count"] >= 1 for v in ops.values()), dtype
        # the memory floor: the tiny's matmul weights at the dtype over the run's read bandwidth
        assert block["read_gbs"] == read["read_gbs"]
        assert block["weight_bytes"] == roofline.matmul_weights(tiny) * (4 if dtype == "float32" else 2)
        assert block["floor_ms"] == pytest.approx(block["weight_bytes"] / block["read_gbs"] / 1e6, rel=1e-3)
        assert block["floor_ms"] > 0
        for b in ("1", "3"):
            # the host's share of a step: outside the one call into C, and part of the step
            assert 0 < block["host_ms"][b] < block["step_ms"][b], (dtype, b)
            assert block["floor_fraction"][b] == pytest.approx(block["floor_ms"] / block["step_ms"][b], rel=1e-2)
            assert block["peak_fraction"][b] == pytest.approx(
                block["achieved_gflops"][b] / block["peak_gflops"], rel=1e-2)
        if not isa:
            assert "isa_runs" not in block
            continue
        runs = block["isa_runs"]
        assert set(runs) == set(isa)
        assert "above this CPU's best" in runs[above]["error"] and set(runs[above]) == {"error"}
        low = runs["avx2"]
        assert low["isa"] == "avx2"
        for key in ISA_RUN_KEYS:
            assert set(low[key]) == {"1", "3"} and all(v > 0 for v in low[key].values()), (dtype, key)
        # one numeric class, one set of bits: a lower path's greedy tokens are the main run's
        if low["numeric_class"] == block["numeric_class"]:
            assert low["tokens_equal_main"] == {"1": True, "3": True}, dtype
        else:
            assert set(low["tokens_equal_main"]) == {"1", "3"}
    if isa:
        assert res["numeric_class"] == "fp32" and bf16["numeric_class"] in cpu.BF16_CLASSES
        assert res["isa_runs"]["avx2"]["numeric_class"] == "fp32"
        # the bf16 class follows the path (unless pinned): avx2 packs bf16-fma
        pinned = os.environ.get(cpu.BF16_ENV)
        assert bf16["isa_runs"]["avx2"]["numeric_class"] == (pinned or "bf16-fma")
    assert res["workload"]["isa"] == list(isa)
    assert res["isa"]["superfluid_best"] == cpu.best_isa()
    assert res["isa"]["superfluid_features"] == cpu.features()
    # same weights, greedy, fp32: our tokens are HF's but for a rare near-tie
    agree = res["models"]["tiny"]["greedy_agreement"]
    assert min(agree.values()) >= 0.5, agree
    assert res["peak_rss_mb"] > 0 and res["threads"] == 1 and res["device"] == "cpu"
    assert res["isa"]["torch_cpu_capability"] and set(res["isa"]["cpu_flags"]) >= {"avx512f", "amx_bf16"}
    load = res["load"]
    assert len(load["loadavg_before"]) == 3 and len(load["loadavg_after"]) == 3
    assert 0 <= load["other_processes_cpu_share"] <= 1
    assert res["workload"]["dtypes"] == ["float32", "bfloat16"]
    assert res["workload"]["repeats"] == 3  # each figure the median of 3 rounds (ours: the same tokens each)


def test_weight_bytes_are_the_checkpoints_matmul_weights(tmp_path):
    """weight_bytes counts what a decode step reads: every projection and the LM head, not the
    embedding table (gathered by row), the norms or biases."""
    import torch
    from safetensors.torch import load_file

    from superfluid.engine.config import load_config
    from superfluid.engine.tiny import write_tiny

    ckpt = write_tiny(tmp_path / "ckpt", arch="llama", seed=0, tokenizer=False)
    tensors = load_file(ckpt / "model.safetensors")
    head = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])
    n = head.numel() + sum(t.numel() for k, t in tensors.items() if k.endswith("proj.weight"))
    cfg = load_config(ckpt)
    assert roofline.matmul_weights(cfg) == n
    assert roofline.weight_bytes(cfg, torch.float32) == 4 * n and roofline.weight_bytes(cfg, torch.bfloat16) == 2 * n


def test_bench_engine_isa_names_are_checked_before_the_run(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "engine", "--isa", "avx2,sse9"])
    assert "unknown ISA path 'sse9'" in capsys.readouterr().err


def test_bench_peers_absent_are_reported_not_raised(monkeypatch):
    monkeypatch.setattr(peers, "_MODULES", {"ghost": ("no_such_module_superfluid",)})
    out = peers.run_peers(["ghost", "nope"], None, None, {}, {}, 3, 1, lambda s: None)
    assert out["ghost"] == {"installed": False, "greedy_agreement": None, "decode_tok_s": {}, "error": None}
    assert not out["nope"]["installed"] and "unknown peer" in out["nope"]["error"]


def _fake_vllm(monkeypatch, answers):
    """A stand-in `vllm` whose LLM answers each greedy prompt (a tuple of
    token ids) with answers[prompt], and logs every generate call."""
    import sys
    import types

    calls = []

    class SamplingParams:
        def __init__(self, *, max_tokens, logprobs=None, **kw):
            self.n, self.logprobs = max_tokens, logprobs

    class LLM:
        def __init__(self, **kw):
            pass

        def generate(self, reqs, sp, use_tqdm=False):
            calls.append((len(reqs), sp.n))
            outs = []
            for r in reqs:
                toks = answers[tuple(r["prompt_token_ids"])][:sp.n]
                # every step a tie between its pick and the token after it
                lps = [{t: types.SimpleNamespace(logprob=-1.0), t + 1: types.SimpleNamespace(logprob=-1.0)}
                       for t in toks] if sp.logprobs else None
                out = types.SimpleNamespace(token_ids=toks, logprobs=lps)
                outs.append(types.SimpleNamespace(outputs=[out]))
            return outs

    class CPUAttentionBackend:
        @staticmethod
        def get_supported_head_sizes():
            return [32, 64]

    mods = {name: types.ModuleType(name) for name in
            ("vllm", "vllm.inputs", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.backends",
             "vllm.v1.attention.backends.cpu_attn")}
    mods["vllm"].LLM, mods["vllm"].SamplingParams = LLM, SamplingParams
    mods["vllm.inputs"].TokensPrompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}
    mods["vllm.v1.attention.backends.cpu_attn"].CPUAttentionBackend = CPUAttentionBackend
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    for var in ("VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_KVCACHE_SPACE", "VLLM_LOGGING_STREAM",
                "VLLM_CPU_OMP_THREADS_BIND"):
        monkeypatch.setenv(var, "")  # recorded, so what the peer sets is undone after the test
        monkeypatch.delenv(var)
    return calls


def test_bench_vllm_peer_times_only_batches_whose_greedy_tokens_are_ours(monkeypatch):
    import numpy as np
    import torch

    prompts = {1: np.array([[3, 4]]), 2: np.array([[5, 6], [7, 8]])}
    ours = {1: np.array([[10, 11, 12]]), 2: np.array([[20, 21, 22], [30, 31, 32]])}
    answers = {(3, 4): [10, 11, 12], (5, 6): [20, 21, 22], (7, 8): [30, 30, 32]}
    calls = _fake_vllm(monkeypatch, answers)
    res = peers._vllm_run(None, torch.float32, prompts, ours, 3, os.cpu_count(), 64)
    assert res["greedy_agreement"] == {"1": 1.0, "2": 0.8333}
    assert set(res["decode_tok_s"]) == {"1"} and res["decode_tok_s"]["1"] > 0
    assert res["mismatch"] == {"2": "lane 1 step 1: 30, ours 31 (1 of 2 lanes differ); "
                                    "its logprob of ours is 0.0000 below its own"}
    # batch 1: checked, then timed (generate(1), generate(3)); batch 2: checked only
    assert calls == [(1, 3), (1, 1), (1, 3), (2, 3)]
    assert os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert os.environ["VLLM_LOGGING_STREAM"] == "ext://sys.stderr"
    with pytest.raises(ValueError, match="head_dim"):
        peers._vllm_run(None, torch.float32, prompts, ours, 3, os.cpu_count(), 16)


def test_first_mismatch_says_where_and_how_near_a_tie():
    import numpy as np

    ours = np.array([[1, 2, 3], [4, 5, 6]])
    assert peers._first_mismatch(ours, ours) is None
    theirs = np.array([[1, 2, 3], [4, 9, 7]])
    lp = {9: -1.25, 5: -1.5}
    assert peers._first_mismatch(theirs, ours, lambda lane, step: lp) == (
        "lane 1 step 1: 9, ours 5 (1 of 2 lanes differ); its logprob of ours is 0.2500 below its own")
    assert peers._first_mismatch(theirs, ours, lambda lane, step: {9: -1.0}).endswith("not in its top 1")
    assert peers._agreement(np.zeros((2, 2)), ours) == 0.0  # a short answer agrees nowhere


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
    assert main(["bench", "e2e", "--json", "--quick", "--requests", "4", "--repeats", "2", "--min-seconds", "0.5"]) == 0
    res = json.loads(capsys.readouterr().out)
    for key in ("tok_s", "inproc_tok_s", "hf_tok_s", "daemon_to_inproc", "daemon_to_inproc_paired"):
        assert res[key] > 0, key
    assert res["ttft_ms"]["p50"] > 0 and res["ttft_ms"]["p99"] >= res["ttft_ms"]["p50"]
    assert res["same_tokens_daemon_vs_inproc"] is True and res["same_tokens_every_run"] is True
    # at least two timed runs a path, taking turns (the warm-up is apart and not counted), more in
    # pairs until each path has 0.5 s of them, at most 4x two
    n = len(res["runs_daemon_to_inproc"])
    assert len(res["runs_tok_s"]["daemon"]) == len(res["runs_tok_s"]["inproc"]) == n == res["workload"]["repeats"]
    walls = res["runs_wall_s"]
    assert 2 <= n <= 8 and n % 2 == 0 and (n == 8 or min(sum(walls["daemon"]), sum(walls["inproc"])) >= 0.5 - 0.01 * n)
    assert n == 2 or min(sum(walls["daemon"][:-2]), sum(walls["inproc"][:-2])) < 0.5 + 0.01 * n  # no pair too many
    assert res["workload"]["requests"] == 4 and res["workload"]["hf_requests"] == 4
    assert len(res["loadavg_before"]) == len(res["loadavg_after"]) == 3
    q1, q3 = res["paired_quartiles"]
    assert q1 <= res["daemon_to_inproc_paired"] <= q3
    # (every run the same tokens: a path's seconds are the sum of tokens / tok_s)
    secs = {k: sum(1 / x for x in v) for k, v in res["runs_tok_s"].items()}
    assert res["daemon_to_inproc_total"] == pytest.approx(secs["inproc"] / secs["daemon"], rel=0.005)
    lo, hi = res["paired_ci90"]
    runs = res["runs_daemon_to_inproc"]
    assert min(runs) <= lo <= res["daemon_to_inproc_paired"] <= hi <= max(runs)
    # every run's ticks took time, and both paths spent some outside them (the planner's turn)
    assert res["outside_us_per_tick"]["daemon"] > 0 and res["outside_us_per_tick"]["inproc"] > 0
    split = res["outside_us_per_tick"]["daemon"] - res["outside_us_per_tick"]["inproc"]
    assert abs(res["split_cost_us_per_tick"] - split) <= 0.11  # (each rounded to 0.1)
    assert res["tick_time_daemon_to_inproc"] > 0
    # both paths under the worker's thread layout: our kernels take the threads, torch one
    assert res["threads"]["torch"] == 1 and res["threads"]["kernels"] >= 1
    assert not os.listdir(shm_dir)


@pytest.mark.timeout(300)
def test_bench_e2e_with_the_recorder(shm_dir, tmp_path, capsys):
    """--record: a third path, the daemon with its flight recorder on; same tokens, its cost
    reported, and its record replays identical."""
    rec = tmp_path / "rec"
    assert main(["bench", "e2e", "--json", "--requests", "6", "--repeats", "1", "--min-seconds", "0",
                 "--hf-requests", "0", "--record", str(rec)]) == 0
    res = json.loads(capsys.readouterr().out)["recorded"]
    assert res["tok_s"] > 0 and res["recorded_to_daemon_paired"] > 0 and res["same_tokens_as_daemon"] is True
    assert len(res["runs_recorded_to_daemon"]) == 1 and res["record_bytes_held"] > 0
    assert main(["replay", str(rec), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["identical"] is True
    assert not os.listdir(shm_dir)


@pytest.mark.timeout(120)
def test_bench_prefix_keys(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SUPERFLUID_CACHE", str(tmp_path))
    assert main(["bench", "prefix", "--json", "--conversations", "2", "--turns", "2", "--system-tokens", "64",
                 "--user-tokens", "16", "--answer-tokens", "4", "--ttft-prefix", "64", "--repeats", "1",
                 "--no-mamba2"]) == 0
    res = json.loads(capsys.readouterr().out)
    for key in ("ttft_ms_warm", "ttft_ms_cold", "warm_vs_cold", "tok_s_with_leases", "tok_s_without",
                "hf_tok_s"):
        assert res[key] > 0, key
    # leased and prefilled runs give the same tokens; the leased one prefills only what is new
    assert res["tokens_equal"] is True and res["ttft_tokens_equal"] is True
    assert res["with_leases"]["leases"] == 4 and res["without"]["leases"] == 0
    assert res["hit_tokens"] > 0
    assert res["with_leases"]["prefilled_tokens"] + res["hit_tokens"] == res["without"]["prefilled_tokens"]
    assert res["with_leases"]["tokens"] == res["without"]["tokens"] == 2 * 2 * 4
    assert isinstance(res["meets_warm_vs_cold_20"], bool) and isinstance(res["meets_leases_3x"], bool)
    assert 0 <= res["hf_greedy_agreement"] <= 1 and len(res["load"]["loadavg_after"]) == 3
