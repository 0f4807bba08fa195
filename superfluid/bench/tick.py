"""`superfluid bench tick`: what the executor itself costs per lane-round.

On the fake runtime (greedy engine sampling, no EOS), N lanes are admitted
and prefilled, then ticks decode every lane for R rounds. Every call into
the runtime is timed and subtracted, so what is left is the executor's own
work (checks, bookkeeping, sampling decisions, events), divided by lanes x
rounds. A mixed tick adds prompts being prefilled beside the decoding lanes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from typing import Any

import numpy as np

from superfluid.client import PlanBuilder
from superfluid.engine.fake import FakeRuntime
from superfluid.executor import Executor

LANES = (1, 16, 64, 256)


class _Timed:
    """A runtime whose every call is timed (the time is not the executor's)."""

    def __init__(self, rt):
        self._rt = rt
        self.desc = rt.desc
        self.ns = 0

    def __getattr__(self, name: str):
        f = getattr(self._rt, name)
        if not callable(f):
            return f

        def timed(*a, **k):
            t = time.perf_counter_ns()
            try:
                return f(*a, **k)
            finally:
                self.ns += time.perf_counter_ns() - t

        setattr(self, name, timed)
        return timed


def _executor(max_batch: int) -> tuple[Executor, _Timed]:
    fake = FakeRuntime(vocab_size=512, max_seq_len=1 << 16, max_batch=max_batch, page=16, engine_sampling=True,
                       eos_rate=0.0)
    rt = _Timed(fake)
    return Executor(rt), rt


def _measure(lanes: int, rounds: int, ticks: int, mixed: int = 0, prompt: int = 256) -> dict[str, float]:
    ex, rt = _executor(max(256, lanes))
    seq = 1
    b = PlanBuilder(seq, prefill_token_budget=1 << 30)
    for t in range(1, lanes + 1):
        b.admit(t, ex.rings.prompt.write(np.arange(8) + t)).prefill(t, 0, 8)
    assert ex.tick(b.build()).ok
    per_tick = []
    next_tag = lanes + 1
    for i in range(ticks + 3):
        seq += 1
        b = PlanBuilder(seq, prefill_token_budget=1 << 30, max_decode_lanes=lanes)
        for t in range(1, lanes + 1):
            b.decode(t, rounds)
        fresh = []
        for _ in range(mixed):  # prompts prefilled beside the decodes, retired next tick
            b.admit(next_tag, ex.rings.prompt.write(np.arange(prompt) % 500)).prefill(next_tag, 0, prompt)
            fresh.append(next_tag)
            next_tag += 1
        rt.ns = 0
        t0 = time.perf_counter_ns()
        r = ex.tick(b.build())
        wall = time.perf_counter_ns() - t0
        if not r.ok:
            raise RuntimeError(f"bench plan rejected: {r.message}")
        if i >= 3:  # warm-up ticks are not counted
            per_tick.append((wall - rt.ns) / 1e3)
        if fresh:
            seq += 1
            b = PlanBuilder(seq)
            for t in fresh:
                b.retire(t)
            assert ex.tick(b.build()).ok
    lane_rounds = lanes * rounds
    med = statistics.median(per_tick)
    return {"us_per_lane_round": round(med / lane_rounds, 3), "tick_overhead_us_p50": round(med, 1),
            "tick_overhead_us_p90": round(sorted(per_tick)[int(0.9 * (len(per_tick) - 1))], 1)}


def run(*, lanes: tuple[int, ...] = LANES, rounds: int = 8, ticks: int = 30) -> dict[str, Any]:
    t0 = time.perf_counter()
    by_lanes = {str(n): _measure(n, rounds, ticks) for n in lanes}
    mixed = _measure(64, rounds, ticks, mixed=4)
    return {
        "us_per_lane_round": {k: v["us_per_lane_round"] for k, v in by_lanes.items()},
        "tick_overhead_us_p50": {k: v["tick_overhead_us_p50"] for k, v in by_lanes.items()},
        "tick_overhead_us_p90": {k: v["tick_overhead_us_p90"] for k, v in by_lanes.items()},
        "mixed": {"decode_lanes": 64, "prefill_lanes": 4, "prompt_tokens": 256, **mixed},
        "workload": {"rounds_per_tick": rounds, "ticks": ticks, "runtime": "fake (engine greedy sampling)"},
        "python": platform.python_version(), "cpu_count": os.cpu_count(),
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def _main(args: argparse.Namespace) -> int:
    res = run(rounds=args.rounds, ticks=args.ticks)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        for k, v in res["us_per_lane_round"].items():
            print(f"{k:>4} lanes: {v:6.2f} µs per lane-round (tick overhead p50 {res['tick_overhead_us_p50'][k]} µs)")
        m = res["mixed"]
        print(f"mixed (64 decoding + 4x256-token prefills): {m['us_per_lane_round']} µs per lane-round")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tick", help="executor overhead per lane-round on the fake runtime", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the result as JSON only")
    p.add_argument("--rounds", type=int, default=8, help="decode rounds per tick (default 8)")
    p.add_argument("--ticks", type=int, default=30, help="measured ticks per lane count (default 30)")
    p.set_defaults(func=_main)
