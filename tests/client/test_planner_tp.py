"""The reference Planner against a tensor-parallel worker: `superfluid serve
--tp 2` (two rank processes) gives a workload of greedy, sampled and
host-sampled lanes the very tokens `--tp 1` gives, and DESCRIBE says which
degree each daemon runs. (The Rust and Go planners' tests do the same:
client/rust/tests/planner.rs, client/go/workload/workload_test.go.)"""

from __future__ import annotations

import os
import signal

import pytest

from superfluid.client import Client, workload as wl
from superfluid.client.planner import GPU_GREEDY, GPU_SAMPLE, HOST
from superfluid.kernels import cpu
from superfluid.testing.daemon import WAIT_S, Serve

pytestmark = pytest.mark.skipif(not cpu.available(), reason="tensor parallelism runs on the CPU kernels")

_SAMPLED = {"temperature": 0.9, "top_k": 50, "top_p": 0.9}
# Greedy, sampled (two seeds), host argmax and perturb; one prompt longer than a prefill chunk.
WORKLOAD = {
    "options": {"prefill_token_budget": 48, "decode_grant": 3},
    "requests": [
        {"prompt": [(7 * j + 3) % 250 for j in range(5)], "max_new_tokens": 16},
        {"prompt": [(11 * j + 1) % 250 for j in range(70)], "max_new_tokens": 10, "stop_at_eos": False},
        {"prompt": [(5 * j + 9) % 250 for j in range(12)], "max_new_tokens": 14, "sampling": "sample",
         "params": _SAMPLED, "rng_base": 1000},
        {"prompt": [(3 * j + 2) % 250 for j in range(4)], "max_new_tokens": 12, "sampling": "sample",
         "params": {"temperature": 1.2, "min_p": 0.05}, "rng_base": 77, "stop_at_eos": False},
        {"prompt": [(13 * j + 4) % 250 for j in range(20)], "max_new_tokens": 10, "sampling": "host",
         "host_sampler": "perturb", "rng_base": 5},
        {"prompt": [(17 * j + 6) % 250 for j in range(9)], "max_new_tokens": 8, "sampling": "host",
         "host_sampler": "argmax", "stop_at_eos": False},
    ],
}


def _stop(d: Serve) -> None:
    """SIGTERM (the daemon stops its ranks and removes its files), then close()."""
    try:
        if d.proc.poll() is None:
            d.proc.send_signal(signal.SIGTERM)
            d.proc.wait(WAIT_S)
    finally:
        d.close()


def _tp2_and_tp1(tmp_path, tag: str, workload: dict) -> tuple[dict, dict]:
    # Both load at once; one thread a rank (two ranks on a two-core box).
    two = Serve(tmp_path, f"{tag}2{os.getpid()}", "--tp", "2", "--threads", "1", "--tp-timeout", "60")
    one = Serve(tmp_path, f"{tag}1{os.getpid()}", "--threads", "1")
    got: dict = {}
    want: dict = {}
    try:
        for d, out in ((two, got), (one, want)):
            with Client.connect(d.name, 0, timeout=120) as c:
                p = c.parallel(timeout=120)
                out.update(wl.run(c, workload, timeout=300), parallel=(p.tp, p.nnodes))
            _stop(d)  # its ranks leave the cores to the next run
    finally:
        for d in (two, one):
            _stop(d)
    assert (got["parallel"], want["parallel"]) == ((2, 1), (1, 1))
    assert all(r["tokens"] for r in want["results"]), want
    return got, want


def test_a_tp2_worker_gives_the_planner_the_tokens_of_a_tp1_worker(tmp_path):
    assert {r["sampling"] for r in wl.load(WORKLOAD)[1]} == {GPU_GREEDY, GPU_SAMPLE, HOST}
    got, want = _tp2_and_tp1(tmp_path, "pltp", WORKLOAD)
    assert got["results"] == want["results"]


def test_the_same_on_the_torch_ops(tmp_path, monkeypatch):
    """The daemon's ranks on the torch backend's reference ops (the path a
    GPU takes, engine/blocked.py): each rank process makes the same choice."""
    monkeypatch.setenv("SUPERFLUID_CPU_KERNELS", "0")
    small = dict(WORKLOAD, requests=WORKLOAD["requests"][:3] + WORKLOAD["requests"][4:5])
    got, want = _tp2_and_tp1(tmp_path, "pltt", small)
    assert got["results"] == want["results"]
