"""Recovery: kill -9 the worker at chosen moments — mid prefill, mid decode,
between ticks, while host lanes wait for their commits — through the real
daemon and the reference planner, on the tiny model. Every lane completes
and its tokens are bitwise those of an uninterrupted run. No segment or
process is left behind."""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest

from superfluid.abi import Sampling, WorkerState
from superfluid.abi.records import SamplingParams
from superfluid.client import Client
from superfluid.client.planner import Planner
from superfluid.daemon.supervisor import Daemon
from superfluid.engine.tiny import default_model_dir
from superfluid.kernels.reference_sampler import sample
from superfluid.rings.naming import shm_dir
from superfluid.testing.daemon import live_workers

TRIALS = 20
PHASES = ("mid-prefill", "mid-decode", "between-ticks", "host-waiting")


def host_sampler(params: SamplingParams):
    def pick(row, position: int) -> int:
        return sample(row, params.temperature, params.top_k, params.top_p, params.min_p, position)

    return pick


def workload(seed: int) -> list[dict]:
    rng = random.Random(seed)
    sampled = SamplingParams(temperature=0.9, top_k=50, top_p=0.9)
    out = []
    for i in range(6):
        mode = (Sampling.GPU_GREEDY, Sampling.GPU_SAMPLE, Sampling.HOST)[i % 3]
        out.append(dict(prompt=[rng.randrange(256) for _ in range(rng.randrange(20, 90))],
                        max_new_tokens=rng.randrange(10, 24), sampling=mode,
                        params=SamplingParams() if mode == Sampling.GPU_GREEDY else sampled, rng_base=97 * (i + 1)))
    return out


def submit_all(planner: Planner, reqs: list[dict]) -> list[int]:
    return [planner.submit(r["prompt"], r["max_new_tokens"], r["sampling"], params=r["params"],
                           rng_base=r["rng_base"], stop_at_eos=False,
                           host_sampler=host_sampler(r["params"]) if r["sampling"] == Sampling.HOST else None)
            for r in reqs]


@pytest.fixture(scope="module")
def daemon():
    name = f"recov{os.getpid()}"
    d = Daemon(name, ["--model", str(default_model_dir()), "--max-batch", "16"], workers=1,
               restart_backoff=0.05, restart_backoff_max=0.2, crash_loop=(1000, 60.0), handle_signals=False)
    d.start()
    loop = threading.Thread(target=d.serve_forever, daemon=True)
    loop.start()
    yield name, d
    d.stop()
    loop.join(30)
    assert not [f for f in os.listdir(shm_dir()) if f.startswith(f"superfluid.{name}.")], "segments left"
    assert not live_workers(name), "worker processes left"


@pytest.fixture(scope="module")
def baseline(daemon):
    name, _ = daemon
    reqs = workload(11)
    with Client.connect(name, 0, timeout=120) as c:
        p = Planner(c, prefill_token_budget=48, decode_grant=3)
        ids = submit_all(p, reqs)
        rep = p.run_until_done(300)
    return reqs, [rep.results[i].tokens for i in ids]


class _Killer:
    """Kills the worker at the trial's moment: a phase and a tick index."""

    def __init__(self, d: Daemon, phase: str, at_tick: int):
        self.d, self.phase, self.at_tick = d, phase, at_tick
        self.ticks = 0
        self.done = False

    def kill(self) -> None:
        pid = self.d.worker_pid(0)
        os.kill(pid, signal.SIGKILL)
        self.done = True

    def wrap(self, client: Client, planner: Planner) -> None:
        submit = client.submit

        def submit_then_maybe_kill(plan, timeout=None):
            seq = submit(plan, timeout)
            self.ticks += 1
            if not self.done and self.ticks >= self.at_tick:
                # The plan is published: the worker is running it while we kill.
                if (self.phase == "mid-prefill" and plan.prefills) or (
                        self.phase == "mid-decode" and plan.decodes and not plan.prefills):
                    self.kill()
            return seq

        client.submit = submit_then_maybe_kill

    def between(self, planner: Planner) -> None:
        if self.done or self.ticks < self.at_tick:
            return
        host_waiting = any(getattr(ln, "commit", None) is not None for ln in planner.lanes.values())
        if self.phase == "between-ticks" or (self.phase == "host-waiting" and host_waiting):
            self.kill()


@pytest.mark.parametrize("trial", range(TRIALS))
def test_kill_minus_nine_and_recover_bitwise(daemon, baseline, trial):
    name, d = daemon
    reqs, want = baseline
    rng = random.Random(1000 + trial)
    phase = PHASES[trial % len(PHASES)]
    # Prefill is over within the first few ticks: a later mid-prefill moment never comes.
    killer = _Killer(d, phase, at_tick=rng.randrange(1, 4 if phase == "mid-prefill" else 12))
    with Client.connect(name, 0, timeout=120) as c:
        p = Planner(c, prefill_token_budget=48, decode_grant=3)
        killer.wrap(c, p)
        ids = submit_all(p, reqs)
        deadline = time.monotonic() + 300
        while p.busy():
            assert time.monotonic() < deadline, "requests never finished"
            p.step(60)
            killer.between(p)
        # Every trial must kill lanes in flight; a kill after the workload would test nothing.
        assert killer.done, f"{phase} at tick {killer.at_tick}: the moment never came in {killer.ticks} ticks"
        rep = p.report()
        got = [rep.results[i].tokens for i in ids]
    assert p.stats.restarts >= 1, f"{phase}: the planner never saw the restart"
    assert len(got) == len(want) and all(want)  # every request, each with tokens to compare
    for r, g, w in zip(reqs, got, want):
        assert g == w, f"{phase} at tick {killer.at_tick}: a {Sampling(r['sampling']).name} lane diverged"
    assert d.snapshot()[0]["state"] in (WorkerState.READY.name, WorkerState.STARTING.name)


def test_leases_die_with_the_worker_and_recovery_needs_none(daemon):
    """Requests over a shared prefix are seeded from what the first one
    published; the worker dies with their leases and its cache mid-decode;
    the planner re-admits from scratch (no lease survives) and every token
    equals the run without a kill."""
    name, d = daemon
    shared = [(7 * i + 3) % 256 for i in range(64)]
    first = dict(prompt=shared + [1, 2], max_new_tokens=8, sampling=Sampling.GPU_GREEDY, params=SamplingParams(),
                 rng_base=5)
    rest = [dict(prompt=shared + [10 + i] * (i + 1), max_new_tokens=20, sampling=Sampling.GPU_SAMPLE,
                 params=SamplingParams(temperature=0.9, top_k=50), rng_base=50 * i) for i in range(3)]

    def run(kill: bool):
        with Client.connect(name, 0, timeout=120) as c:
            p = Planner(c, prefill_token_budget=256, decode_grant=3)
            ids = submit_all(p, [first])
            p.run_until_done(120)
            ids += submit_all(p, rest)
            killed = False
            deadline = time.monotonic() + 300
            while p.busy():
                assert time.monotonic() < deadline
                p.step(60)
                if kill and not killed and p.stats.seeded_tokens and any(
                        lane.request.generated for lane in p.lanes.values()):
                    os.kill(d.worker_pid(0), signal.SIGKILL)
                    killed = True
            rep = p.report()
            return [rep.results[i].tokens for i in ids], p.stats, killed

    want, s0, _ = run(False)
    assert s0.seeded_tokens >= 3 * 64 and s0.restarts == 0, s0
    got, s1, killed = run(True)
    assert killed and s1.restarts == 1
    assert got == want
