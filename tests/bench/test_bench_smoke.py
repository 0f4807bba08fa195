"""Smoke tests of `superfluid bench tick|engine|e2e` at tiny sizes: they run,
give the documented JSON keys with sane values, and leave nothing behind.
No timing thresholds: this machine's speed is not what is tested."""

from __future__ import annotations

import json
import os

import pytest

from superfluid.bench import e2e, engine, tick
from superfluid.cli import main


def test_bench_tick_keys():
    res = tick.run(lanes=(1, 16), rounds=2, ticks=3)
    assert set(res["us_per_lane_round"]) == {"1", "16"}
    assert all(v > 0 for v in res["us_per_lane_round"].values())
    assert res["mixed"]["us_per_lane_round"] > 0


def test_bench_engine_keys(tmp_path, monkeypatch):
    monkeypatch.setenv("SUPERFLUID_CACHE", str(tmp_path))
    res = engine.run(batches=(1, 3), prompt_len=8, gen=3, small=False)
    for key in ("decode_tok_s", "hf_decode_tok_s", "prefill_tok_s", "hf_prefill_tok_s"):
        assert set(res[key]) == {"1", "3"} and all(v > 0 for v in res[key].values()), key
    assert set(res["invariance_tax_by_batch"]) == {"1", "3"}
    assert res["invariance_tax"] is not None and res["peak_rss_mb"] > 0
    # same weights, greedy, fp32: our tokens are HF's but for a rare near-tie
    agree = res["models"]["tiny"]["greedy_agreement"]
    assert min(agree.values()) >= 0.5, agree


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
