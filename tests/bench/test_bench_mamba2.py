"""Smoke tests of the Mamba2 rows of `superfluid bench engine` and the Mamba2
workload of `superfluid bench prefix` at tiny sizes: the keys are there and
parallel to the transformer's, our logits are HF's within 1e-4, and leased
and unleased runs give the same tokens. No timing thresholds."""

from __future__ import annotations

import json

import numpy as np
import pytest

from superfluid.bench import engine, engine_mamba2
from superfluid.cli import main

pytest.importorskip("transformers")

# The transformer block's per-batch keys that the Mamba2 block has too (no invariance tax: no
# non-invariant path), and the logits check's.
PER_BATCH = ("decode_tok_s", "hf_decode_tok_s", "prefill_tok_s", "hf_prefill_tok_s", "decode_speedup_vs_hf",
             "achieved_gflops", "greedy_agreement", "prefill_speedup_vs_hf", "logits_max_abs_diff")


@pytest.mark.timeout(120)
def test_bench_engine_mamba2_rows_are_hfs_computation(tmp_path, monkeypatch):
    monkeypatch.setenv("SUPERFLUID_CACHE", str(tmp_path))
    # 20-token prompts: a whole chunk of 16 and a padded one; 6 tokens: decode crosses no boundary
    res = engine.run(batches=(1, 3), prompt_len=20, gen=6, small=False, dtype="fp32", threads=1, peak_n=128)
    m2 = res["mamba2"]
    assert m2["arch"] == "mamba2" and m2["dtype"] == "float32" and m2["model"]["name"] == "mamba2-tiny"
    for key in PER_BATCH:
        assert set(m2[key]) == {"1", "3"}, key
    for key in PER_BATCH[:6]:
        assert all(v > 0 for v in m2[key].values()), key
    # the same computation as HF's: logits within 1e-4, so fp32 greedy picks the same tokens
    assert m2["logits_agree"] is True and max(m2["logits_max_abs_diff"].values()) <= engine_mamba2.LOGITS_TOL
    assert m2["logits_checked_steps"] == 5
    assert m2["greedy_agreement"] == {"1": 1.0, "3": 1.0}
    assert m2["params"] > 0 and res["workload"]["mamba2"] is True
    assert "mamba2" not in engine.run(batches=(1,), prompt_len=4, gen=2, small=False, dtype="fp32", threads=1,
                                      peak_n=128, mamba2=False)


def test_logits_diff_counts_a_lane_only_while_its_tokens_are_hfs():
    rows = [np.zeros((2, 4), np.float32) for _ in range(3)]
    hf_rows = [r.copy() for r in rows]
    hf_rows[0][1, 0] = 3e-5  # prefill row, lane 1
    hf_rows[2][1, 0] = 1.0  # lane 1's third row, after its tokens diverged at step 1
    hf_rows[1][0, 2] = 2e-5
    ours = {"logits": rows, "tokens": np.array([[5, 6, 7], [5, 6, 7]])}
    hf = {"logits": hf_rows, "tokens": np.array([[5, 6, 7], [5, 9, 7]])}
    assert engine_mamba2.logits_diff(ours, hf) == pytest.approx(3e-5)
    hf["tokens"] = ours["tokens"]  # the same tokens: lane 1's third row counts
    assert engine_mamba2.logits_diff(ours, hf) == 1.0


@pytest.mark.timeout(120)
def test_bench_prefix_mamba2_leases_give_the_same_tokens(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SUPERFLUID_CACHE", str(tmp_path))
    # a 160-token system prompt: over 128, so the executor checkpoints it and turn 1 leases that
    assert main(["bench", "prefix", "--json", "--conversations", "2", "--turns", "2",
                 "--system-tokens", "160", "--user-tokens", "16", "--answer-tokens", "4",
                 "--ttft-prefix", "160", "--repeats", "1", "--threads", "1"]) == 0
    res = json.loads(capsys.readouterr().out)
    m2 = res["mamba2"]
    assert set(m2) >= set(res) - {"mamba2", "load", "threads", "python", "cpu_count", "wall_s"}
    for key in ("ttft_ms_warm", "ttft_ms_cold", "warm_vs_cold", "tok_s_with_leases", "tok_s_without",
                "hf_tok_s"):
        assert m2[key] > 0, key
    assert m2["workload"]["arch"] == "mamba2" and m2["workload"]["state_slots"] > 0
    # exact: leased and prefilled runs give the same tokens, and HF's (fed the same histories)
    assert m2["tokens_equal"] is True and m2["ttft_tokens_equal"] is True
    assert m2["hf_greedy_agreement"] == 1.0
    # every admit leased (turn 1 the system prompt's checkpoint, turn 2 turn 1's published lane)
    assert m2["with_leases"]["leases"] == 4 and m2["without"]["leases"] == 0
    assert m2["hit_tokens"] >= 2 * 159
    assert m2["with_leases"]["prefilled_tokens"] + m2["hit_tokens"] == m2["without"]["prefilled_tokens"]
    assert m2["with_leases"]["tokens"] == m2["without"]["tokens"] == 2 * 2 * 4
