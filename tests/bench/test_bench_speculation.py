"""Smoke test of `superfluid bench speculation --quick`: it runs, gives the
documented JSON keys with sane values, drafts hit on the hit workload, and
every request's tokens are the same with the strategy and without. No
timing thresholds: this machine's speed is not what is tested."""

from __future__ import annotations

import json

import pytest

from superfluid.cli import main


@pytest.mark.timeout(300)
def test_bench_spec_quick_keys(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SUPERFLUID_CACHE", str(tmp_path))
    assert main(["bench", "speculation", "--json", "--quick"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["identical"] is True and res["meets"]["identical"] is True
    for key in ("hit_speedup", "miss_speedup", "acceptance", "miss_acceptance"):
        assert set(res[key]) == {"1", "4"}, key
    for b in ("1", "4"):
        assert res["hit_speedup"][b] > 0 and res["miss_speedup"][b] > 0
        assert res["acceptance"][b] > 0.5  # the tied model repeats itself: lookups predict it
        assert res["detail"]["hit"]["proposed"][b] > 0
    assert res["workload"]["strategy"]["kind"] == "prompt_lookup"
    assert isinstance(res["detail"]["hit"]["gate"], dict)
    load = res["load"]
    assert len(load["loadavg_before"]) == 3 and len(load["loadavg_after"]) == 3
