"""`superfluid serve` on a tiny Mamba2 checkpoint: the exact_only runtime
behind the real daemon, driven by the reference planner over shared memory.

Greedy, sampled and host-sampled tokens equal the in-process executor's on
the same checkpoint and options; a next turn over a prompt of >= 128 tokens
leases what the first turn left (its published entry, or the checkpoint one
token short of its prompt) and decodes what a fresh executor decodes; a
worker killed with SIGKILL mid-prefill or mid-decode recovers bitwise (the
re-admitted lanes replay their tokens as decode feeds). Runtime options that
mean nothing to a state pool are refused before any worker starts."""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from superfluid.abi import Sampling
from superfluid.abi.records import SamplingParams
from superfluid.client import Client
from superfluid.client.local import LocalClient
from superfluid.client.planner import Planner
from superfluid.daemon.status import read_status
from superfluid.daemon.worker import add_runtime_args, runtime_options
from superfluid.engine import load
from superfluid.engine.mamba2_state import StatePool
from superfluid.engine.tiny import write_tiny
from superfluid.executor import Executor
from superfluid.kernels.reference_sampler import sample
from superfluid.rings.naming import shm_dir
from superfluid.testing.daemon import live_workers
from superfluid.testing.launch import python

SLOTS = 24
MAX_BATCH = 16
SAMPLED = SamplingParams(temperature=0.9, top_k=50, top_p=0.9)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_tiny(tmp_path_factory.mktemp("m2serve") / "m", arch="mamba2", seed=4)


@pytest.fixture(scope="module")
def state_bytes(model) -> int:
    rt = load(model)
    return SLOTS * StatePool.slot_bytes(rt.cfg) + 100  # a remainder short of a slot is not one


@pytest.fixture(scope="module")
def daemon(model, state_bytes, tmp_path_factory):
    name = f"m2serve{os.getpid()}"
    log = tmp_path_factory.mktemp("m2log") / "serve.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [*python(), "-m", "superfluid", "serve", "--name", name, "--model", str(model),
             "--state-bytes", str(state_bytes), "--max-batch", str(MAX_BATCH), "--restart-backoff", "0.05",
             "--restart-backoff-max", "0.2", "--crash-loop", "100/60"],
            stdout=f, stderr=f, env=dict(os.environ))
    try:
        yield name, proc, log
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()
        assert not [f for f in os.listdir(shm_dir()) if f.startswith(f"superfluid.{name}.")], "segments left"
        assert not live_workers(name), "worker processes left"


def in_process(model, state_bytes) -> LocalClient:
    """The same runtime and options as the daemon's worker, in this process."""
    return LocalClient(Executor(load(model, "torch", state_bytes=state_bytes, max_batch=MAX_BATCH)))


def host_sampler(params: SamplingParams):
    def pick(row, position: int) -> int:
        return sample(row, params.temperature, params.top_k, params.top_p, params.min_p, position)

    return pick


def workload(seed: int, n: int = 6) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        mode = (Sampling.GPU_GREEDY, Sampling.GPU_SAMPLE, Sampling.HOST)[i % 3]
        # Lengths across chunk boundaries (16), one past the checkpoint threshold (128).
        length = 140 if i == 0 else rng.randrange(5, 70)
        out.append(dict(prompt=[rng.randrange(256) for _ in range(length)], max_new_tokens=rng.randrange(10, 30),
                        sampling=mode, params=SamplingParams() if mode == Sampling.GPU_GREEDY else SAMPLED,
                        rng_base=31 * (i + 1)))
    return out


def submit(planner: Planner, reqs: list[dict]) -> list[int]:
    return [planner.submit(r["prompt"], r["max_new_tokens"], r["sampling"], params=r["params"],
                           rng_base=r["rng_base"], stop_at_eos=False,
                           host_sampler=host_sampler(r["params"]) if r["sampling"] == Sampling.HOST else None)
            for r in reqs]


def run(client, reqs: list[dict], *, budget: int = 64, grant: int = 4, kill=None) -> tuple[list[list[int]], object]:
    """Every request's tokens and the planner's stats; kill(planner) runs between ticks."""
    p = Planner(client, prefill_token_budget=budget, decode_grant=grant)
    ids = submit(p, reqs)
    deadline = time.monotonic() + 120
    while p.busy():
        assert time.monotonic() < deadline, "requests never finished"
        p.step(60)
        if kill is not None:
            kill(p)
    rep = p.report()
    return [rep.results[i].tokens for i in ids], p.stats


def worker_pid(name: str) -> int:
    return read_status(name)["workers"][0]["pid"]


@pytest.fixture(scope="module")
def baseline(model, state_bytes):
    reqs = workload(3)
    want, _ = run(in_process(model, state_bytes), reqs)
    assert all(want)
    return reqs, want


def test_options_a_state_pool_cannot_honour_are_refused_up_front(model, tmp_path):
    p = argparse.ArgumentParser()
    add_runtime_args(p)
    opts = runtime_options(p.parse_args([]), str(model))
    assert opts["state_bytes"] is None and "kv_cells" not in opts and "dtype" not in opts  # fp32, 64 slots
    assert runtime_options(p.parse_args(["--dtype", "fp32", "--state-bytes", "1000000"]), str(model))[
        "state_bytes"] == 1000000
    for argv, field in ((["--dtype", "bf16"], "--dtype bf16"), (["--kv-cells", "4096"], "--kv-cells"),
                        (["--page", "32"], "--page"), (["--state-bytes", "1000"], "--state-bytes 1000")):
        with pytest.raises(ValueError, match=field):
            runtime_options(p.parse_args(argv), str(model))
    # serve says it once and exits 2, starting no worker to crash-loop
    r = subprocess.run([*python(), "-m", "superfluid", "serve", "--name", f"m2bad{os.getpid()}", "--model",
                        str(model), "--dtype", "bf16"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--dtype bf16: the Mamba2 runtime computes in float32 only" in r.stderr, r.stderr


def test_tokens_equal_the_in_process_executor(daemon, baseline, state_bytes):
    name, _, _ = daemon
    reqs, want = baseline
    with Client.connect(name, 0, timeout=120) as c:
        rt = c.describe()["runtime"]
        assert rt["exact_only"] and rt["max_seqs"] == SLOTS  # --state-bytes reached the runtime
        got, stats = run(c, reqs)
    assert stats.restarts == 0
    for r, g, w in zip(reqs, got, want):
        assert g == w, f"a {Sampling(r['sampling']).name} lane of {len(r['prompt'])} prompt tokens diverged"


def test_next_turn_leases_what_the_first_left(daemon, model, state_bytes):
    """Turn 1 (140 prompt tokens) publishes its lane and was checkpointed one
    token short of its prompt. The next turn (prompt + answer + more) leases
    the published entry; a sibling (the same prompt, another tail) leases the
    checkpoint. Both decode what a fresh executor decodes."""
    name, _, _ = daemon
    rng = random.Random(9)
    first = dict(prompt=[rng.randrange(256) for _ in range(140)], max_new_tokens=12, sampling=Sampling.GPU_GREEDY,
                 params=SamplingParams(), rng_base=1)
    def turns(client, leases: bool) -> tuple[list[list[int]], object]:
        # One planner for both turns: it leases only what it has had published.
        p = Planner(client, prefill_token_budget=512, decode_grant=4, use_leases=leases)
        (a,) = submit(p, [first])
        answer = p.run_until_done(120).results[a].tokens
        nxt = [dict(first, prompt=first["prompt"] + answer + [7, 8, 9], sampling=Sampling.GPU_SAMPLE,
                    params=SAMPLED, rng_base=2, max_new_tokens=16),
               dict(first, prompt=first["prompt"] + [200, 201], max_new_tokens=16, rng_base=3)]
        ids = submit(p, nxt)
        rep = p.run_until_done(120)
        return [answer] + [rep.results[i].tokens for i in ids], p.stats

    with Client.connect(name, 0, timeout=120) as c:
        got, stats = turns(c, leases=True)
    # each lease covers at least the first prompt less its last token
    assert stats.leases == 2 and stats.seeded_tokens >= 2 * 139, stats
    want, fresh = turns(in_process(model, state_bytes), leases=False)
    assert fresh.seeded_tokens == 0 and got == want


@pytest.mark.parametrize("moment", ["mid-prefill", "mid-decode"])
def test_kill_minus_nine_recovers_bitwise(daemon, baseline, moment):
    name, _, log = daemon
    reqs, want = baseline
    killed = []

    def kill(p: Planner) -> None:
        if killed:
            return
        lanes = list(p.lanes.values())
        prefilling = any(ln.prefilled < ln.prefill_end for ln in lanes)
        decoding = any(ln.request.generated for ln in lanes)
        if (moment == "mid-prefill" and prefilling) or (moment == "mid-decode" and decoding and not prefilling):
            pid = worker_pid(name)
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    with Client.connect(name, 0, timeout=120) as c:
        got, stats = run(c, reqs, budget=48, kill=kill)
    assert killed and stats.restarts == 1, (killed, stats)
    assert f"(pid {killed[0]}, epoch" in log.read_text() and worker_pid(name) != killed[0]
    for r, g, w in zip(reqs, got, want):
        assert g == w, f"{moment}: a {Sampling(r['sampling']).name} lane diverged after the restart"
