"""`superfluid plan`'s workload format (client/workload.py): bad workloads
name their field, the host samplers are the exact functions the docstring
defines (what the Rust and Go planners reproduce), and a run through a
worker kill gives the tokens of a run without one."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import urllib.request

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from superfluid.client import Client, workload as wl
from superfluid.testing.daemon import Serve, start_fake, wait_for
from superfluid.testing.launch import python


@pytest.fixture(scope="module")
def fake_daemon(tmp_path_factory):
    d = start_fake(tmp_path_factory, "wl")
    try:
        yield d.name
    finally:
        d.close()


def f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def perturb_by_hand(row: list[float], position: int) -> int:
    """The docstring's definition, one scalar at a time (Python ints, f32 by struct)."""
    m = (1 << 64) - 1
    best, top = 0, None
    for i, v in enumerate(row):
        z = (((position << 32) + i) & m) + 0x9E3779B97F4A7C15 & m
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        z ^= z >> 31
        s = f32(f32(v) + f32(2.0 * ((z >> 40) / 2.0**24)))
        if top is None or s > top:
            best, top = i, s
    return best


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-30, 30, width=32), min_size=1, max_size=300), st.integers(0, 2**64 - 1))
def test_perturb_is_the_documented_function(row, position):
    assert wl.host_perturb(np.array(row, np.float32), position) == perturb_by_hand(row, position)


def test_perturb_draws_by_position_and_argmax_does_not():
    row = np.random.default_rng(0).normal(size=512).astype(np.float32)
    picks = {wl.host_perturb(row, p) for p in range(40)}
    assert len(picks) > 5  # the negative control: positions matter
    assert {wl.host_argmax(row, p) for p in range(40)} == {int(np.argmax(row))}


@pytest.mark.parametrize("bad, field", [
    ({}, "workload.requests"),
    ({"requests": [{"max_new_tokens": 3}]}, "requests[0].prompt"),
    ({"requests": [{"prompt": [1], "max_new_tokens": 3, "sampling": "beam"}]}, "requests[0].sampling"),
    ({"requests": [{"prompt": [1], "max_new_tokens": 3, "sampling": "host", "host_sampler": "x"}]},
     "requests[0].host_sampler"),
    ({"requests": [{"prompt": [1], "max_new_tokens": 3, "params": {"temp": 1}}]}, "requests[0].params.temp"),
    ({"options": {"budget": 1}, "requests": []}, "options.budget"),
    ({"requests": [{"prompt": [1], "max_new_tokens": 3, "grammar": {"text": "a"}}]}, "requests[0].grammar"),
    ({"requests": [{"prompt": [1], "max_new_tokens": 3, "grammar": {"kind": "choice"}}]},
     "requests[0].grammar.choices"),
    ({"requests": [{"prompt": [1], "max_new_tokens": 3, "sampling": "host",
                    "grammar": {"kind": "regex", "text": "a"}}]},
     "requests[0].grammar"),
])
def test_a_bad_workload_names_its_field(bad, field):
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        wl.load(bad)


WORKLOAD = {"options": {"prefill_token_budget": 16},
            "requests": [{"prompt": list(range(3, 40)), "max_new_tokens": 12},
                         {"prompt": [9, 8, 7], "max_new_tokens": 10, "sampling": "sample",
                          "params": {"temperature": 0.9, "top_k": 40}, "rng_base": 11},
                         {"prompt": [1, 2, 3, 4], "max_new_tokens": 8, "sampling": "host", "host_sampler": "perturb",
                          "rng_base": 3, "stop_at_eos": False}]}


def test_a_worker_kill_changes_no_token(fake_daemon):
    name = fake_daemon
    with Client.connect(name, timeout=60) as c:
        plain = wl.run(c, WORKLOAD, 120)
    with Client.connect(name, timeout=60) as c:
        killed = wl.run(c, {**WORKLOAD, "kill_worker_after_tokens": 9}, 120)
    assert killed["stats"]["killed"] and killed["stats"]["restarts"] >= 1
    assert [r["tokens"] for r in killed["results"]] == [r["tokens"] for r in plain["results"]]
    assert all(len(r["tokens"]) > 0 for r in plain["results"])


def test_the_command_line_prints_the_results(fake_daemon, tmp_path):
    (tmp_path / "w.json").write_text(json.dumps(WORKLOAD))
    r = subprocess.run([*python(), "-m", "superfluid", "plan", "--name", fake_daemon, str(tmp_path / "w.json")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert [x["id"] for x in out["results"]] == [1, 2, 3] and out["stats"]["killed"] is False
    (tmp_path / "bad.json").write_text('{"requests": [{"prompt": [1]}]}')
    r = subprocess.run([*python(), "-m", "superfluid", "plan", "--name", fake_daemon, str(tmp_path / "bad.json")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "requests[0].max_new_tokens" in r.stderr


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "n"],
          "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 999}}}
GRAMMAR_WORKLOAD = {"options": {"decode_grant": 2},
                    "requests": [{"prompt": [123, 34, 5 + i], "max_new_tokens": 48, "sampling": "sample",
                                  "params": {"temperature": 1.0}, "rng_base": 50 + i,
                                  "grammar": {"kind": "json_schema", "text": json.dumps(SCHEMA)}}
                                 for i in range(6)]
                    + [{"prompt": [7, 8, 9], "max_new_tokens": 16, "sampling": "sample", "rng_base": 3,
                        "params": {"temperature": 1.0}, "grammar": {"kind": "choice", "choices": ["alpha", "beta"]}}]}


@pytest.fixture(scope="module")
def tiny_daemon(tmp_path_factory):
    d = Serve(tmp_path_factory.mktemp("wl-tiny"), f"wlt{os.getpid()}", "--restart-backoff", "0.05",
              "--metrics-port", "0")
    try:
        d.wait_log("worker 0 ready (epoch 1")
        d.metrics_port = int(d.log.split("metrics on http://127.0.0.1:")[1].split("/")[0])
        yield d
    finally:
        d.close()


def test_grammar_requests_through_a_daemon_survive_a_worker_kill(tiny_daemon):
    """JSON-schema lanes through `superfluid serve` (the tiny model): valid
    JSON every time, and a kill -9 mid-lane changes no token (re-admitted
    with grammar_replay = generated)."""
    import jsonschema

    with Client.connect(tiny_daemon.name, timeout=120) as c:
        plain = wl.run(c, GRAMMAR_WORKLOAD, 300)
    with Client.connect(tiny_daemon.name, timeout=120) as c:
        killed = wl.run(c, {**GRAMMAR_WORKLOAD, "kill_worker_after_tokens": 20}, 300)
    assert killed["stats"]["killed"] and killed["stats"]["restarts"] >= 1
    assert any(r["admissions"] > 1 for r in killed["results"])  # the kill did cut lanes short
    assert [r["tokens"] for r in killed["results"]] == [r["tokens"] for r in plain["results"]]
    for r in plain["results"][:6]:
        assert r["finish"] == "grammar"
        jsonschema.validate(json.loads(bytes(r["tokens"]).decode()), SCHEMA)
    assert bytes(plain["results"][6]["tokens"]).decode() in ("alpha", "beta")


SPEC_WORKLOAD = {"options": {"decode_grant": 3},
                 "requests": [{"prompt": [40 + i, 41 + i, 42 + i, 40 + i, 41 + i], "max_new_tokens": 40,
                               "stop_at_eos": False} for i in range(3)]
                 + [{"prompt": [9, 8, 7, 9, 8], "max_new_tokens": 30, "sampling": "sample", "rng_base": 5,
                     "params": {"temperature": 0.7, "top_k": 8}, "stop_at_eos": False},
                    {"prompt": [3, 4, 5], "max_new_tokens": 12, "speculate": False}]}


def test_speculation_through_a_daemon_changes_no_token_and_survives_a_worker_kill(tiny_daemon):
    """Prompt lookup through `superfluid serve` (the tiny model): the same
    tokens as without a strategy, with drafts taken, and the same again
    through a kill -9 (the strategy is installed again on the new worker)."""
    strategy = {"max_draft": 6, "ngram_min": 1, "ngram_max": 3}
    with Client.connect(tiny_daemon.name, timeout=120) as c:
        plain = wl.run(c, SPEC_WORKLOAD, 300)
    with Client.connect(tiny_daemon.name, timeout=120) as c:
        spec = wl.run(c, {**SPEC_WORKLOAD, "options": {**SPEC_WORKLOAD["options"], "strategy": strategy}}, 300)
    # The gate's figures and the drafts reach the daemon's metrics (the worker reports them when idle).
    url = f"http://127.0.0.1:{tiny_daemon.metrics_port}/metrics"
    wait_for(lambda: 'superfluid_worker_spec_gate_state{' in urllib.request.urlopen(url, timeout=10).read().decode(),
             "the gate's state in the metrics")
    body = urllib.request.urlopen(url, timeout=10).read().decode()
    accepted = sum(float(line.split()[-1]) for line in body.splitlines()
                   if line.startswith("superfluid_worker_spec_accepted_total{"))
    assert accepted == spec["stats"]["draft_accepted"] > 0
    with Client.connect(tiny_daemon.name, timeout=120) as c:
        killed = wl.run(c, {**SPEC_WORKLOAD, "options": {**SPEC_WORKLOAD["options"], "strategy": strategy},
                            "kill_worker_after_tokens": 50}, 300)
    tokens = [r["tokens"] for r in plain["results"]]
    assert [r["tokens"] for r in spec["results"]] == tokens == [r["tokens"] for r in killed["results"]]
    assert [len(t) for t in tokens] == [40, 40, 40, 30, 12]
    assert plain["stats"]["draft_proposed"] == 0 and spec["stats"]["draft_accepted"] > 0  # drafts were taken
    assert killed["stats"]["killed"] and killed["stats"]["restarts"] >= 1
    assert any(r["admissions"] > 1 for r in killed["results"])


def test_a_bad_strategy_names_its_field():
    with pytest.raises(ValueError, match=r"options\.strategy"):
        wl.load({"options": {"strategy": {"depth": 3}}, "requests": []})
