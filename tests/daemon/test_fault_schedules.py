"""Fault schedules and the stall watchdog through a live daemon on the tiny
model, with the reference planner: the worker killed at a lane's 5th token
(op INSTALL_FAULTS), killed at a tick of its first epoch only (serve
--fault-schedule, installed at every start), and stalled mid-decode until
the watchdog (--tick-timeout) restarts it: every request finishes with the
tokens of an uninterrupted run. An idle worker is not a stalled one."""

from __future__ import annotations

import json
import os
import threading
import time

import msgpack
import pytest

from superfluid.abi import OpStatus, Sampling
from superfluid.abi.records import SamplingParams
from superfluid.client import Client
from superfluid.client.planner import Planner
from superfluid.daemon.supervisor import Daemon
from superfluid.engine.tiny import default_model_dir
from superfluid.testing.daemon import live_workers

REQS = [dict(prompt=[(7 * j + i) % 250 for j in range(12 + 5 * i)], max_new_tokens=14,
             sampling=Sampling.GPU_SAMPLE if i % 2 else Sampling.GPU_GREEDY,
             params=SamplingParams(temperature=0.9, top_k=40) if i % 2 else SamplingParams(), rng_base=31 * i)
        for i in range(4)]


def start(name: str, *extra: str, tick_timeout: float = 300.0) -> tuple[Daemon, threading.Thread]:
    d = Daemon(name, ["--model", str(default_model_dir()), "--max-batch", "8", *extra], workers=1,
               fault_injection=True, restart_backoff=0.05, restart_backoff_max=0.2, crash_loop=(100, 60.0),
               handle_signals=False, tick_timeout=tick_timeout)
    d.start()
    t = threading.Thread(target=d.serve_forever, daemon=True)
    t.start()
    return d, t


def stop(d: Daemon, t: threading.Thread) -> None:
    d.stop()
    t.join(30)
    assert not live_workers(d.name)


def run(name: str, before=None) -> tuple[list[list[int]], Planner]:
    with Client.connect(name, 0, timeout=120) as c:
        if before is not None:
            before(c)
        p = Planner(c, prefill_token_budget=64, decode_grant=2)
        ids = [p.submit(r["prompt"], r["max_new_tokens"], r["sampling"], params=r["params"], rng_base=r["rng_base"],
                        stop_at_eos=False) for r in REQS]
        rep = p.run_until_done(240)
        return [rep.results[i].tokens for i in ids], p


@pytest.fixture(scope="module")
def baseline():
    d, t = start(f"fsb{os.getpid()}")
    try:
        want, p = run(d.name)
    finally:
        stop(d, t)
    assert all(len(w) == 14 for w in want) and p.stats.restarts == 0
    return want


def install(rules: list[dict]):
    def go(c: Client) -> None:
        done = c.op("INSTALL_FAULTS", timeout=30, rules=rules)
        assert done.status == OpStatus.OK, msgpack.unpackb(done.payload)
    return go


def test_killed_at_a_lanes_fifth_token(baseline):
    d, t = start(f"fs5{os.getpid()}")
    try:
        got, p = run(d.name, install([{"when": {"token": 5}, "what": {"fatal": "now"}}]))
        exits = d.counters.exits()
    finally:
        stop(d, t)
    assert p.stats.restarts == 1 and exits == {(0, "exit_70"): 1}
    assert got == baseline


def test_a_schedule_file_runs_at_every_start(baseline, tmp_path):
    """Installed in every worker; the rule limited to epoch 1 fires there
    only, and the next worker lists it unfired."""
    f = tmp_path / "faults.json"
    f.write_text(json.dumps({"seed": 1, "rules": [{"when": {"tick": 4, "epoch": 1}, "what": {"fatal": "decode"}}]}))
    d, t = start(f"fsf{os.getpid()}", "--fault-schedule", str(f))
    try:
        got, p = run(d.name)
        with Client.connect(d.name, 0, timeout=60) as c:
            listing = msgpack.unpackb(c.op("LIST_FAULTS", timeout=30).payload)
    finally:
        stop(d, t)
    assert p.stats.restarts == 1 and got == baseline
    assert listing["seed"] == 1 and [r["fired"] for r in listing["rules"]] == [0]


def test_the_watchdog_restarts_a_stalled_worker(baseline):
    d, t = start(f"fsw{os.getpid()}", tick_timeout=1.5)
    try:
        with Client.connect(d.name, 0, timeout=120) as c:
            t_end = time.monotonic() + 2.5
            while time.monotonic() < t_end:  # an idle worker, its planner silent: not a stall,
                c.seg.counters.heartbeat_ns = 1  # whatever the planner writes in the header
                time.sleep(0.01)
        assert d.snapshot()[0]["epoch"] == 1 and not d.counters.exits()
        t0 = time.monotonic()
        got, p = run(d.name, install([{"when": {"tick": 3}, "what": {"stall_ms": 60_000, "during": "decode"}}]))
        took = time.monotonic() - t0
        exits = d.counters.exits()
    finally:
        stop(d, t)
    assert exits == {(0, "stalled"): 1} and p.stats.restarts == 1
    assert took < 30, "the stall was not cut short"
    assert got == baseline
