"""Smoke test of `superfluid bench grammar --quick`: it runs, gives the
documented JSON keys with sane values, and every checked output validates.
No timing thresholds: this machine's speed is not what is tested."""

from __future__ import annotations

import json

import pytest

from superfluid.bench import grammar
from superfluid.cli import main


@pytest.mark.timeout(300)
def test_bench_grammar_quick_keys(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SUPERFLUID_CACHE", str(tmp_path))  # the 32k BPE is trained here (~8 s)
    assert main(["bench", "grammar", "--json", "--quick", "--repeats", "2", "--batches", "1", "4",
                 "--requests", "2"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["vocab"] == 32000 and res["repeats"] == 2
    for key in ("mask_share", "mask_us", "step_us"):
        assert set(res[key]) == {"1", "4"}, key
        assert set(res["greedy"][key]) == {"1", "4"}, key
    for b in ("1", "4"):
        assert 0 < res["mask_share"][b] < 1 and res["mask_us"][b] > 0 and res["step_us"][b] > 0
        parts = res["breakdown_us"][b]
        assert parts["fill"] > 0 and parts["apply"] > 0 and parts["accept"] > 0
        assert parts["round"] >= parts["masked_step"]
    assert res["compile_ms"] > 0 and res["tokenizer_ms"] > 0
    # every output parses and validates against the 25-property schema
    assert res["valid"] == 1.0, res["valid_detail"]
    detail = res["valid_detail"]
    assert detail["requests"] == 2 and detail["finish"] == {"grammar": 2}
    assert set(detail["example"]) == set(grammar.SCHEMA["properties"])
    assert len(grammar.SCHEMA["properties"]) == 25 and res["workload"]["schema_properties"] == 25
    load = res["load"]
    assert len(load["loadavg_before"]) == 3 and len(load["loadavg_after"]) == 3
