"""`superfluid bench ring` smoke tests: tiny runs, the result's shape, and
nothing left behind (no segment file, no server process). No timing
thresholds: this machine's speed is not what is tested."""

from __future__ import annotations

import json
import os

import pytest

from superfluid.bench import ring, ring_worker
from superfluid.cli import main
from superfluid.rings.naming import shm_dir

TINY = dict(rounds=200, warmup=20, blocks=2, seconds=0.05, codec_rounds=50, worker_rounds=30, rust=False)
WORKER_KEYS = ("worker_rt_python_p50_us", "worker_rt_python_p99_us", "worker_tick_wall_p50_us",
               "worker_rt_rust_p50_us", "worker_rt_rust_p99_us", "worker_rt_rust_mean_us",
               "worker_tick_wall_rust_p50_us", "worker_rust_skipped", "worker_rounds")


def _bench_segments() -> list[str]:
    return [f for f in os.listdir(shm_dir()) if f.startswith("superfluid.bench-")]


def _bench_children() -> list[int]:
    """Children of this process that are benchmark servers."""
    me = str(os.getpid())
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = f.read().rsplit(")", 1)[1].split()[1]
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if ppid == me and (b"superfluid.bench.ring" in cmd or b"serve\0--fake\0--name\0bench-w" in cmd):
            out.append(int(pid))
    return out


def _check_result(r: dict) -> None:
    for key in ("shm_rtt_us", "unix_socket_rtt_us", "pipe_rtt_us"):
        assert set(r[key]) == {"p50", "p99"}, key
        assert 0 < r[key]["p50"] <= r[key]["p99"], key
    assert r["shm_msgs_per_s"] > 0
    assert r["shm_msgs"] > 0
    assert r["n_round_trips"] == TINY["rounds"]
    assert r["ratio_shm_to_unix_p50"] > 0
    assert set(r["raw_rtt_us"]) == set(ring.TRANSPORTS)
    assert all(v["p50"] > 0 for v in r["raw_rtt_us"].values())
    assert r["codec_us"]["total"] > 0
    assert r["cpu_count"] >= 1
    assert set(WORKER_KEYS) <= set(r)
    if r["worker_rounds"]:
        assert 0 < r["worker_tick_wall_p50_us"] < r["worker_rt_python_p50_us"] <= r["worker_rt_python_p99_us"]


def test_run_result_and_cleanup():
    r = ring.run(**TINY)
    _check_result(json.loads(json.dumps(r)))
    assert _bench_segments() == []
    assert _bench_children() == []


def test_cli_json(capsys):
    assert main(["bench", "ring", "--json", "--rounds", "200", "--warmup", "20", "--blocks", "2",
                 "--seconds", "0.05", "--worker-rounds", "30", "--no-rust"]) == 0
    _check_result(json.loads(capsys.readouterr().out))
    assert _bench_segments() == []
    assert _bench_children() == []


def test_cleanup_on_error(monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(ring, "_interleaved", boom)
    with pytest.raises(RuntimeError, match="boom"):
        ring.run(**TINY)
    assert _bench_segments() == []
    assert _bench_children() == []


def test_no_worker_rows_when_asked_for_none():
    r = ring.run(**{**TINY, "worker_rounds": 0})
    assert r["worker_rounds"] == 0 and r["worker_rt_python_p50_us"] is None and r["worker_rust_skipped"]
    assert _bench_segments() == [] and _bench_children() == []


def test_the_rust_row_through_a_real_worker():
    binary, why = ring_worker.rust_binary()
    if binary is None:
        pytest.skip(f"no Rust bench: {why}")
    r = ring_worker.run(50, 10, rust=True)
    assert r["worker_rust_skipped"] is None and r["worker_rounds"] == 50
    assert 0 < r["worker_tick_wall_rust_p50_us"] < r["worker_rt_rust_p50_us"] <= r["worker_rt_rust_p99_us"]
    assert r["worker_rt_rust_mean_us"] > 0
    assert _bench_segments() == [] and _bench_children() == []


def test_the_rust_row_says_why_it_is_missing(monkeypatch):
    monkeypatch.setattr(ring_worker, "CRATE", ring_worker.CRATE / "no-such-crate")
    monkeypatch.setenv("PATH", "/nonexistent")
    binary, why = ring_worker.rust_binary()
    assert binary is None and why
