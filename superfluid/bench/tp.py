"""`superfluid bench tp`: tensor parallelism on this machine's cores.

The small model (SMALL: hidden 512, 8 layers, vocabulary 32000, ~58M
parameters), greedy, B requests of --prompt-len tokens then --gen decode
steps, at B = 1, 8 and 32, served three ways in one run:

  tp1_t1   TP=1, the kernels on 1 thread
  tp2_t1   TP=2, 1 thread a rank (two processes)
  tp1_t2   TP=1, 2 threads

Each figure is the median over --repeats (the three ways interleaved in
each repeat, so drift in the machine's load hits all alike):

  prefill_tok_s, decode_tok_s      tokens / wall seconds of those steps
  collective_ms_per_step           tp2: the leader's time in all-gathers a decode step
  ship_ms_per_step                 tp2: the leader's time sending a step's inputs
  rss_mb                           each rank's resident memory after the run (each way runs in a
                                   fresh process, its followers in theirs)
  scaling                          tp2_t1 / tp1_t1 and tp2_t1 / tp1_t2 tok/s (also at the top
                                   level by batch: decode_tp2_vs_tp1_t1, prefill_tp2_vs_tp1_t2, ...)
  identical                        every request's tokens the same three ways
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from superfluid.bench import system

BATCHES = (1, 8, 32)
WAYS = {"tp1_t1": (1, 1), "tp2_t1": (2, 1), "tp1_t2": (1, 2)}


def _rss_mb(pid: int | str = "self") -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def _serve(path: str, tp: int, threads: int, prompts: np.ndarray, gen: int, transport: str) -> dict[str, Any]:
    from superfluid.engine import Feed, SampleSpec, load
    from superfluid.kernels import cpu

    before = cpu.own_threads(threads)
    b, p = prompts.shape
    try:
        opts: dict[str, Any] = dict(kv_cells=b * (p + gen + 17) + 256, max_batch=max(64, b), prefill_step_tokens=0)
        rt = (load(path, tp=tp, tp_options=dict(threads=threads, transport=transport), **opts) if tp > 1
              else load(path, **opts))
        try:
            greedy = [SampleSpec()] * b
            warm = rt.seq_create()
            rt.step_sampled([Feed(warm, prompts[0, :8].tolist(), True)], greedy[:1])
            rt.seq_free(warm)
            stats = getattr(rt.model, "stats", None)
            seqs = [rt.seq_create() for _ in range(b)]
            t0 = time.perf_counter()
            toks = rt.step_sampled([Feed(s, row.tolist(), True) for s, row in zip(seqs, prompts)], greedy)
            t1 = time.perf_counter()
            if stats is not None:
                stats.reset()
            out = [toks]
            for _ in range(gen - 1):
                toks = rt.step_sampled([Feed(s, [t], True) for s, t in zip(seqs, toks)], greedy)
                out.append(toks)
            t2 = time.perf_counter()
            res: dict[str, Any] = {"prefill_tok_s": b * p / (t1 - t0), "decode_tok_s": b * (gen - 1) / (t2 - t1),
                                   "tokens": np.array(out).T.tolist(), "rss_mb": [_rss_mb()]}
            if stats is not None:
                steps = max(1, stats.steps)
                res["collective_ms_per_step"] = 1000 * stats.collective_s / steps
                res["ship_ms_per_step"] = 1000 * stats.ship_s / steps
                res["rss_mb"] += [_rss_mb(f.pid) for f in getattr(rt, "followers", [])]
        finally:
            rt.close()
    finally:
        cpu.restore_threads(before)
    return res


def _isolated(path: str, tp: int, threads: int, prompts: np.ndarray, gen: int, transport: str) -> dict[str, Any]:
    """_serve in a fresh process (spawned), so each way's RSS is its own."""
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_serve, path, tp, threads, prompts, gen, transport).result()


def run(*, batches: tuple[int, ...] = BATCHES, prompt_len: int = 128, gen: int = 32, repeats: int = 3,
        layers: int | None = None, transport: str = "shm",
        log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    from superfluid.bench.engine import checkpoint
    from superfluid.engine.tiny import SMALL

    shape = dict(SMALL, num_layers=layers or SMALL["num_layers"])
    path = str(checkpoint("small" if layers is None else f"small{layers}", arch="llama", seed=0, tokenizer=False,
                          **shape))
    meter = system.LoadMeter()
    t_start = time.perf_counter()
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {"model": shape, "prompt_len": prompt_len, "gen": gen, "repeats": repeats,
                           "transport": transport, "batches": {}}
    identical = True
    for b in batches:
        prompts = rng.integers(4, shape["vocab_size"], size=(b, prompt_len))
        runs: dict[str, list[dict[str, Any]]] = {w: [] for w in WAYS}
        for r in range(repeats):
            order = list(WAYS) if r % 2 == 0 else list(reversed(WAYS))
            for way in order:
                tp, threads = WAYS[way]
                runs[way].append(_isolated(path, tp, threads, prompts, gen, transport))
                log(f"B{b} {way} repeat {r}: decode {runs[way][-1]['decode_tok_s']:.1f} tok/s")
        row: dict[str, Any] = {}
        for way, rs in runs.items():
            fig = {k: round(statistics.median(x[k] for x in rs), 3) for k in rs[0]
                   if k not in ("tokens", "rss_mb")}
            fig["rss_mb"] = rs[-1]["rss_mb"]
            row[way] = fig
        toks = [rs[0]["tokens"] for rs in runs.values()]
        same = all(t == toks[0] for t in toks) and all(x["tokens"] == toks[0] for rs in runs.values() for x in rs)
        identical &= same
        row["identical"] = same
        row["scaling"] = {
            "tp2_vs_tp1_t1": round(row["tp2_t1"]["decode_tok_s"] / row["tp1_t1"]["decode_tok_s"], 3),
            "tp2_vs_tp1_t2": round(row["tp2_t1"]["decode_tok_s"] / row["tp1_t2"]["decode_tok_s"], 3),
            "prefill_tp2_vs_tp1_t1": round(row["tp2_t1"]["prefill_tok_s"] / row["tp1_t1"]["prefill_tok_s"], 3),
            "prefill_tp2_vs_tp1_t2": round(row["tp2_t1"]["prefill_tok_s"] / row["tp1_t2"]["prefill_tok_s"], 3),
        }
        out["batches"][str(b)] = row
    out["identical"] = identical
    for key in ("tp2_vs_tp1_t1", "tp2_vs_tp1_t2", "prefill_tp2_vs_tp1_t1", "prefill_tp2_vs_tp1_t2"):
        name = key if key.startswith("prefill") else "decode_" + key
        out[name] = {b: row["scaling"][key] for b, row in out["batches"].items()}
    out["targets"] = {
        "tp2_vs_tp1_t1_at_B32_ge_1.6": _target(out, "32", "tp2_vs_tp1_t1", 1.6),
        "tp2_vs_tp1_t2_at_B1_ge_0.9": _target(out, "1", "tp2_vs_tp1_t2", 0.9),
        "tp2_vs_tp1_t2_at_B32_ge_0.9": _target(out, "32", "tp2_vs_tp1_t2", 0.9),
    }
    out["isa"] = system.isa()
    return system.finish(out, meter, t_start)


def _target(out: dict[str, Any], b: str, key: str, at_least: float) -> bool | None:
    row = out["batches"].get(b)
    return None if row is None else row["scaling"][key] >= at_least


def _main(args: argparse.Namespace) -> int:
    log = (lambda s: None) if args.json else (lambda s: print(s, flush=True))
    res = run(batches=tuple(args.batches), prompt_len=args.prompt_len, gen=args.gen, repeats=args.repeats,
              layers=args.layers, transport=args.transport, log=log)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        for b, row in res["batches"].items():
            print(f"B{b}: " + ", ".join(f"{w} decode {row[w]['decode_tok_s']:.1f} prefill {row[w]['prefill_tok_s']:.0f}"
                                        for w in WAYS) + f"; scaling {row['scaling']}, identical {row['identical']}")
        print(f"targets {res['targets']}, load {res['load']}, {res['wall_s']} s")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("tp", help="tensor parallelism: TP=2 vs TP=1 at 1 and 2 threads", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the result as JSON only")
    p.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen", type=int, default=32, help="decode steps (tokens per request)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the small model's 8 (quick runs)")
    p.add_argument("--transport", choices=("shm", "gloo"), default="shm")
    p.set_defaults(func=_main)
