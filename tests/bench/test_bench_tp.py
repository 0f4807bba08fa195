"""Smoke test of `superfluid bench tp` at a tiny size: it runs the three ways
(TP=1 at one and two threads, TP=2 at one thread a rank), gives the
documented keys with sane values, and the tokens are identical the three
ways. No timing thresholds: this machine's speed is not what is tested."""

from __future__ import annotations

import json

import pytest

from superfluid.cli import main
from superfluid.kernels import cpu


@pytest.mark.skipif(not cpu.available(), reason="tensor parallelism runs on the CPU kernels")
@pytest.mark.timeout(300)
def test_bench_tp_keys(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SUPERFLUID_CACHE", str(tmp_path))
    assert main(["bench", "tp", "--json", "--batches", "1", "3", "--repeats", "1", "--layers", "1", "--gen", "3",
                 "--prompt-len", "8"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["identical"] is True
    assert set(res["batches"]) == {"1", "3"}
    for row in res["batches"].values():
        assert row["identical"] is True
        for way in ("tp1_t1", "tp2_t1", "tp1_t2"):
            assert row[way]["decode_tok_s"] > 0 and row[way]["prefill_tok_s"] > 0
        two = row["tp2_t1"]
        assert len(two["rss_mb"]) == 2 and all(m > 0 for m in two["rss_mb"])
        assert two["collective_ms_per_step"] > 0 and two["ship_ms_per_step"] > 0
        assert set(row["scaling"]) == {"tp2_vs_tp1_t1", "tp2_vs_tp1_t2", "prefill_tp2_vs_tp1_t1",
                                       "prefill_tp2_vs_tp1_t2"}
    assert set(res["decode_tp2_vs_tp1_t2"]) == {"1", "3"}
    assert set(res["targets"]) == {"tp2_vs_tp1_t1_at_B32_ge_1.6", "tp2_vs_tp1_t2_at_B1_ge_0.9",
                                   "tp2_vs_tp1_t2_at_B32_ge_0.9"}
    assert len(res["load"]["loadavg_before"]) == 3
