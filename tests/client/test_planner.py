"""The reference planner against real worker processes: a mixed workload
(greedy, sampled, HOST with a callback) gives every request exactly the
tokens it gets alone and the tokens an independent decode of the fake model
gives; chunked prefill under a small budget, shed chunks, memory pressure
(NeedsReplan), a faulted lane, and a worker killed mid-run, all bitwise."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from superfluid.abi import OpStatus
from superfluid.client import GPU_GREEDY, GPU_SAMPLE, HOST, Planner, sampling_params
from superfluid.engine import Feed
from superfluid.engine.fake import FakeRuntime
from superfluid.testing.daemon import FAKE_WORKER

EOS = 511  # the fake runtime's: vocab_size - 1


def _splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & (2**64 - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return z ^ (z >> 31)


def host_draw(row: np.ndarray, position: int) -> int:
    """A planner-side sampler: softmax at temperature 0.7, keyed by position only."""
    u = (_splitmix64(position) >> 11) / 2.0**53
    z = row.astype(np.float64) / 0.7
    c = np.cumsum(np.exp(z - z.max()))
    return int(min(np.searchsorted(c, u * c[-1], side="right"), len(row) - 1))


def host_argmax(row: np.ndarray, position: int) -> int:
    return int(np.argmax(row))


def prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, EOS, n).tolist()


# Each request as Planner.submit's arguments.
MIXED = [
    dict(prompt_tokens=prompt(1, 5), max_new_tokens=24),
    dict(prompt_tokens=prompt(2, 37), max_new_tokens=16, stop_at_eos=False, publish=False),
    dict(prompt_tokens=prompt(3, 12), max_new_tokens=20, sampling=GPU_SAMPLE,
         params=sampling_params(0.9, top_p=0.95), rng_base=1000),
    dict(prompt_tokens=prompt(4, 3), max_new_tokens=20, sampling=GPU_SAMPLE,
         params=sampling_params(1.2, top_k=20), rng_base=77, stop_at_eos=False),
    dict(prompt_tokens=prompt(5, 20), max_new_tokens=10, sampling=HOST, host_sampler=host_draw, rng_base=5),
    dict(prompt_tokens=prompt(6, 9), max_new_tokens=8, sampling=HOST, host_sampler=host_argmax,
         stop_at_eos=False),
    dict(prompt_tokens=prompt(7, 64), max_new_tokens=6, sampling=GPU_SAMPLE, params=sampling_params(0.8),
         rng_base=2**40),
]


def oracle(spec: dict) -> tuple[list[int], str]:
    """The request decoded directly on an in-process fake runtime built as
    the worker builds its own: one feed at a time, no executor, no planner."""
    from superfluid.kernels import reference_sampler as reference

    rt = FakeRuntime(vocab_size=512, max_seq_len=512, max_batch=16, page=4, engine_sampling=True,
                     engine_draws=True, prefill_step_tokens=512)
    seq = rt.seq_create()
    sampling = spec.get("sampling", GPU_GREEDY)
    params = spec.get("params") or sampling_params()
    base = spec.get("rng_base", 0)
    row = rt.step([Feed(seq, spec["prompt_tokens"], True)])[0]
    out: list[int] = []
    while True:
        pos = base + len(out)
        if sampling == HOST:
            tok = spec["host_sampler"](row, pos)
        elif sampling == GPU_SAMPLE:
            p = params
            tok = reference.sample(row, p.temperature, p.top_k, p.top_p, p.min_p, pos)
        else:
            tok = int(np.argmax(row))
        out.append(int(tok))
        if spec.get("stop_at_eos", True) and tok == EOS:
            return out, "eos"
        if len(out) >= spec["max_new_tokens"]:
            return out, "max_tokens"
        row = rt.step([Feed(seq, [int(tok)], True)])[0]


def run(client, specs: list[dict], timeout: float = 60.0, **planner_kw):
    p = Planner(client, **planner_kw)
    ids = [p.submit(**s) for s in specs]
    report = p.run_until_done(timeout)
    return [report.results[i] for i in ids], report.stats


def assert_exact(results, specs) -> None:
    for i, (r, spec) in enumerate(zip(results, specs)):
        tokens, finish = oracle(spec)
        assert (r.tokens, r.finish) == (tokens, finish), f"request {i}"


def test_mixed_workload_matches_solo_runs_and_the_model(fake_worker):
    with fake_worker.connect() as c:
        mixed, stats = run(c, MIXED, prefill_token_budget=32, decode_grant=4)
        assert_exact(mixed, MIXED)
        for spec, r in zip(MIXED, mixed):
            (solo,), _ = run(c, [spec], prefill_token_budget=4096, decode_grant=16)
            assert solo.tokens == r.tokens and solo.finish == r.finish
        assert stats.ticks > 0 and stats.replans == 0 and stats.restarts == 0 and stats.faults == 0
        assert stats.tokens == sum(len(r.tokens) for r in mixed) and stats.tokens_per_s > 0
        assert 0 < stats.ttft_p50_s <= stats.ttft_p99_s
        for r in mixed:
            assert r.admissions == 1 and len(r.token_times) == len(r.tokens)
            assert r.ttft_s is not None and r.latency_s >= r.ttft_s
            assert r.token_times == sorted(r.token_times)
        # Everything retired: the worker holds no lane of ours.
        assert c.seg.counters.live_lanes == 0


def test_chunked_prefill_under_a_small_budget(fake_worker):
    specs = [dict(prompt_tokens=prompt(11, 100), max_new_tokens=5, stop_at_eos=False),
             dict(prompt_tokens=prompt(12, 30), max_new_tokens=5, sampling=HOST, host_sampler=host_draw),
             dict(prompt_tokens=prompt(13, 7), max_new_tokens=5)]
    with fake_worker.connect() as c:
        results, stats = run(c, specs, prefill_token_budget=8, decode_grant=2)
        assert_exact(results, specs)
        assert stats.ticks >= (100 + 30 + 7) // 8 and stats.prefill_chunks_shed == 0
        # Offer 12 a tick against a budget of 8: the executor sheds the rest and
        # the planner resumes each lane where the executor got to.
        results, stats = run(c, specs, prefill_token_budget=8, prefill_chunk=12, decode_grant=2)
        assert_exact(results, specs)
        assert stats.prefill_chunks_shed > 0 and stats.prefill_tokens_shed > 0


def test_a_faulted_lane_is_readmitted_where_it_was(fake_worker):
    specs = MIXED[:6]
    with fake_worker.connect() as c:
        p = Planner(c, prefill_token_budget=64, decode_grant=2)
        ids = [p.submit(**s) for s in specs]
        victims = {ids[2], ids[4]}  # a sampled lane and a HOST lane
        for _ in range(200):
            p.step()
            lanes = {ln.request.id: ln for ln in p.lanes.values() if not ln.retiring}
            if all(v in lanes and len(lanes[v].request.generated) >= 3 for v in victims):
                break
        else:
            pytest.fail("the victims never got three tokens each")
        for v in victims:
            done = c.op("INJECT_FAULT", lane_tag=lanes[v].tag)
            assert done.status == OpStatus.OK, done
        report = p.run_until_done(60)
        assert report.stats.faults == 2
        assert {i for i in ids if report.results[i].admissions == 2} == victims
        assert_exact([report.results[i] for i in ids], specs)
        assert c.seg.counters.live_lanes == 0


def test_memory_pressure_replans_evicts_and_preempts(start_worker):
    # 64 cells in pages of 4: two or three of these requests fit at once, and
    # what they publish to the prefix cache has to be evicted for the next.
    w = start_worker(*FAKE_WORKER, "--kv-cells", "64")
    specs = [dict(prompt_tokens=prompt(20 + i, 10 + 3 * i), max_new_tokens=12, stop_at_eos=False,
                  sampling=[GPU_GREEDY, GPU_SAMPLE, HOST][i % 3], params=sampling_params(0.9), rng_base=i,
                  host_sampler=host_draw) for i in range(6)]
    # Never fits: refused outright (80 > 64 cells), or once it runs short alone (budget 64).
    big = dict(prompt_tokens=prompt(29, 80), max_new_tokens=4)
    with w.connect() as c:
        results, stats = run(c, specs[:3] + [big] + specs[3:], prefill_token_budget=64, decode_grant=4)
        assert (results[3].finish, results[3].tokens) == ("unservable", [])
        del results[3]
        assert_exact(results, specs)
        assert stats.replans > 0 and stats.evictions > 0 and stats.preemptions > 0
        (alone,), _ = run(c, [big], prefill_token_budget=128)
        assert alone.finish == "unservable"
        assert c.seg.counters.live_lanes == 0


def test_a_worker_killed_mid_run_changes_no_token(start_worker):
    """kill -9 with lanes in prefill, in decode and holding host rows; the
    planner reconnects to the replacement and re-admits each lane with
    prompt + generated and decode_replay: every token equals an
    uninterrupted run's."""
    w = start_worker(*FAKE_WORKER, "--fake-step-cost", "0.002")
    specs = [dict(s, stop_at_eos=False) for s in MIXED]
    specs.append(dict(prompt_tokens=prompt(30, 150), max_new_tokens=4, stop_at_eos=False))  # still prefilling
    with w.connect() as c:
        p = Planner(c, prefill_token_budget=16, decode_grant=2)
        ids = [p.submit(**s) for s in specs]
        at_kill: dict[int, int] = {}
        old = c.epoch

        def killer() -> None:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                reqs = p.requests
                if all(len(reqs[i].generated) >= 3 for i in (ids[4], ids[5])):
                    at_kill.update({i: len(reqs[i].generated) for i in ids})
                    w.restart()
                    return
                time.sleep(0.001)

        t = threading.Thread(target=killer)
        t.start()
        try:
            report = p.run_until_done(60)
        finally:
            t.join()
        assert at_kill, "the run ended before the kill"
        assert report.stats.restarts == 1 and c.epoch == old + 1
        assert_exact([report.results[i] for i in ids], specs)
        # Lanes went on from the middle: some had tokens and were far from done
        # (a tick the old worker answered before dying may still land: +2 at most).
        resumed = [i for i in ids if 0 < at_kill[i] <= specs[ids.index(i)]["max_new_tokens"] - 4]
        assert resumed and all(report.results[i].admissions == 2 for i in resumed)
        assert any(at_kill[i] == 0 for i in ids)  # and one was re-admitted from scratch
        assert c.seg.counters.live_lanes == 0


@pytest.mark.slow
def test_the_tiny_model_batched_equals_solo_and_survives_a_restart(start_worker):
    """The embedded tiny transformer (torch): the engine's batch invariance
    seen from the planner, across a restart too."""
    w = start_worker("--page", "16", "--max-batch", "8", "--kv-cells", "2048")
    specs = [dict(prompt_tokens=prompt(40, 11), max_new_tokens=8, stop_at_eos=False),
             dict(prompt_tokens=prompt(41, 23), max_new_tokens=8, sampling=GPU_SAMPLE,
                  params=sampling_params(0.9, top_p=0.9), rng_base=3, stop_at_eos=False),
             dict(prompt_tokens=prompt(42, 5), max_new_tokens=6, sampling=HOST, host_sampler=host_draw,
                  stop_at_eos=False)]
    for s in specs:
        s["prompt_tokens"] = [t % 320 for t in s["prompt_tokens"]]  # the tiny model's vocabulary
    with w.connect() as c:
        solo = [run(c, [s], prefill_token_budget=512, decode_grant=8)[0][0] for s in specs]
        batched, _ = run(c, specs, prefill_token_budget=8, decode_grant=3)
        assert [r.tokens for r in batched] == [r.tokens for r in solo]
        # Kill once every lane has tokens; recovery replays them on the fresh worker.
        p = Planner(c, prefill_token_budget=8, decode_grant=2)
        ids = [p.submit(**s) for s in specs]
        while not all(len(p.requests[i].generated) >= 2 for i in ids):
            p.step()
        w.restart()
        report = p.run_until_done(120)
        assert report.stats.restarts == 1
        assert [report.results[i].tokens for i in ids] == [r.tokens for r in solo]
