"""`superfluid bench speculation` (or `spec`): prompt-lookup speculation, where drafts hit and where they miss.

Two workloads, each at batch 1, 8 and 32 (B requests at once), each served
with the strategy and without it in the same run, through the reference
Planner and an in-process Executor (one per workload and side, warmed up
once and kept, as a server keeps its worker: the gate's window carries over):

  hit   outputs that repeat their context: a seeded SMALL-shaped model
        (hidden 512, 8 layers, vocabulary 32000) with tied embeddings, whose
        greedy continuation repeats what it has just said, so lookups of the
        lane's own tokens predict it;
  miss  the same shape untied, with a vocabulary of 64, sampled at
        temperature 1: every n-gram has occurred before, so the proposer
        always drafts, and a draw matches a draft token about one time in 64.

Warm-up serves batches until the gate has left its exploration (drafting
and plain figures both measured) for each batch size. Each repeat then runs
the two sides one after the other, the order swapped every
repeat, so drift in the machine's load hits both alike; a side's figure is
the median over --repeats of tokens generated / wall seconds of
run_until_done (prefill included: it is the same on both sides).

  hit_speedup[B], miss_speedup[B]   tok/s with the strategy / without
  acceptance[B]                     draft tokens taken / proposed (hit)
  miss_acceptance[B]                the same on the miss workload
  identical                         every request's tokens equal on both sides
  gate                              the executor's gate figures at the end of
                                    each workload's run with the strategy
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from superfluid.bench import system

if TYPE_CHECKING:
    from superfluid.executor.executor import Executor

BATCHES = (1, 8, 32)
PROMPT = 64  # prompt tokens a request
MISS_VOCAB = 64


def model_params(workload: str, quick: bool = False) -> dict[str, Any]:
    from superfluid.engine.tiny import SMALL

    shape = {**SMALL, "num_layers": 2 if quick else SMALL["num_layers"]}
    if workload == "miss":
        shape["vocab_size"] = MISS_VOCAB
    return dict(arch="llama", seed=0, tokenizer=False, tie_word_embeddings=workload == "hit", **shape)


def _executor(model: str, max_batch: int, cells: int):
    from superfluid.client.local import LocalClient
    from superfluid.engine import load
    from superfluid.executor import Executor
    from superfluid.executor.tick_rings import LocalRings

    rt = load(model, "torch", kv_cells=cells, max_batch=max_batch)
    ex = Executor(rt, LocalRings(prompt_tokens=1 << 18, emit_tokens=1 << 18, logits_floats=1 << 16))
    return ex, LocalClient(ex)


def _prompts(workload: str, rng: np.random.Generator, n: int, vocab: int) -> list[list[int]]:
    # Below 260 ids the last four are the specials (engine.tiny); none in a prompt.
    lo, hi = (4, vocab) if workload == "hit" else (0, vocab - 4)
    return [rng.integers(lo, hi, PROMPT).tolist() for _ in range(n)]


def _serve(planner, prompts, tokens: int, workload: str, rng_base: int) -> tuple[float, list[list[int]], int, int]:
    """(wall seconds, each request's tokens, drafts proposed, accepted) of one batch."""
    from superfluid.abi import Sampling
    from superfluid.client.builder import sampling_params

    before = (planner.stats.draft_proposed, planner.stats.draft_accepted)
    if workload == "hit":
        ids = [planner.submit(p, tokens, stop_at_eos=False, publish=False) for p in prompts]
    else:
        ids = [planner.submit(p, tokens, Sampling.GPU_SAMPLE, params=sampling_params(1.0), stop_at_eos=False,
                              publish=False, rng_base=rng_base + (j << 20)) for j, p in enumerate(prompts)]
    t0 = time.perf_counter()
    rep = planner.run_until_done(3600)
    wall = time.perf_counter() - t0
    got = [rep.results[i].tokens for i in ids]
    if any(len(t) != tokens for t in got):
        raise RuntimeError(f"a request ended early: {[rep.results[i].finish for i in ids]}")
    return (wall, got, planner.stats.draft_proposed - before[0], planner.stats.draft_accepted - before[1])


_WARMUP_MAX = 12  # warm-up batches at most, while the gate explores


def _settled(ex: Executor, B: int) -> bool:
    from superfluid.executor.speculation_gate import bucket

    for st in ex.registry.spec_gate.snapshot()["strategies"]:
        for w in st["buckets"]:
            if w["lanes"] == bucket(B):
                return w["state"] != "explore"
    return False


def _workload(workload: str, model: str, batches, tokens: int, repeats: int, grant: int, strategy,
              rng: np.random.Generator, vocab: int) -> dict[str, Any]:
    from superfluid.client.planner import Planner

    B_max = max(batches)
    cells = 2 * B_max * (PROMPT + tokens + 64)
    sides = {}
    for on in (True, False):
        ex, client = _executor(model, B_max, cells)
        planner = Planner(client, prefill_token_budget=max(512, B_max * PROMPT), decode_grant=grant,
                          use_leases=False, strategy=strategy if on else None)
        sides[on] = (ex, planner)
        # Torch's first calls at each shape are slow, and the gate explores before it decides
        # (a server pays that once): warm up until each batch's gate has left explore.
        for B in batches:
            for _ in range(_WARMUP_MAX):
                _serve(planner, _prompts(workload, rng, B, vocab), tokens, workload, 1 << 40)
                if not on or _settled(ex, B):
                    break
    out: dict[str, Any] = {"speedup": {}, "tok_s_with": {}, "tok_s_without": {}, "acceptance": {},
                           "proposed": {}, "identical": True}
    for B in batches:
        walls: dict[bool, list[float]] = {True: [], False: []}
        proposed = accepted = 0
        for r in range(repeats):
            prompts = _prompts(workload, rng, B, vocab)
            got = {}
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                wall, got[on], p, a = _serve(sides[on][1], prompts, tokens, workload, r << 32)
                walls[on].append(wall)
                if on:
                    proposed, accepted = proposed + p, accepted + a
            out["identical"] &= got[True] == got[False]
        with_, without = (B * tokens / statistics.median(walls[on]) for on in (True, False))
        key = str(B)
        out["tok_s_with"][key], out["tok_s_without"][key] = round(with_, 1), round(without, 1)
        out["speedup"][key] = round(with_ / without, 3)
        out["acceptance"][key] = round(accepted / proposed, 4) if proposed else None
        out["proposed"][key] = proposed
    out["gate"] = sides[True][0].registry.spec_gate.snapshot()
    return out


def run(*, batches: tuple[int, ...] = BATCHES, tokens: int = 128, repeats: int = 5, grant: int = 8,
        max_draft: int = 8, ngram_min: int = 1, ngram_max: int = 4, quick: bool = False,
        threads: int | None = None, seed: int = 0) -> dict[str, Any]:
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _run(batches, tokens, repeats, grant, max_draft, ngram_min, ngram_max, quick, seed)
    finally:
        torch.set_num_threads(before)


def _run(batches, tokens, repeats, grant, max_draft, ngram_min, ngram_max, quick, seed) -> dict[str, Any]:
    from superfluid.bench.engine import checkpoint
    from superfluid.client.strategies import Strategy

    t_start = time.perf_counter()
    meter = system.LoadMeter()
    strategy = Strategy(max_draft=max_draft, ngram_min=ngram_min, ngram_max=ngram_max)
    rng = np.random.default_rng(seed)
    res: dict[str, Any] = {}
    runs = {}
    for workload in ("hit", "miss"):
        params = model_params(workload, quick)
        model = str(checkpoint(f"spec-{workload}", **params))
        runs[workload] = _workload(workload, model, batches, tokens, repeats, grant, strategy, rng,
                                   params["vocab_size"])
    hit, miss = runs["hit"], runs["miss"]
    res["hit_speedup"], res["miss_speedup"] = hit["speedup"], miss["speedup"]
    res["acceptance"], res["miss_acceptance"] = hit["acceptance"], miss["acceptance"]
    res["identical"] = hit["identical"] and miss["identical"]
    res["meets"] = {
        "hit_speedup_b1_1.8": hit["speedup"].get("1", 0) >= 1.8 if "1" in hit["speedup"] else None,
        "hit_speedup_b8_1.3": hit["speedup"].get("8", 0) >= 1.3 if "8" in hit["speedup"] else None,
        "miss_speedup_0.97": min(miss["speedup"].values()) >= 0.97,
        "identical": res["identical"],
    }
    res["detail"] = runs
    res["workload"] = {"batches": list(batches), "prompt_tokens": PROMPT, "new_tokens": tokens,
                       "decode_grant": grant, "repeats": repeats,
                       "strategy": strategy.fields(), "quick": quick,
                       "models": {w: model_params(w, quick) for w in ("hit", "miss")}}
    return system.finish(res, meter, t_start)


def _main(args: argparse.Namespace) -> int:
    kw: dict[str, Any] = dict(threads=args.threads, max_draft=args.max_draft, ngram_min=args.ngram_min,
                              ngram_max=args.ngram_max, grant=args.grant)
    if args.quick:
        kw.update(quick=True, tokens=24, repeats=1, batches=(1, 4))
    for name in ("tokens", "repeats", "batches"):
        if getattr(args, name) is not None:
            kw[name] = tuple(args.batches) if name == "batches" else getattr(args, name)
    res = run(**kw)
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    print(f"identical: {res['identical']}")
    for b in res["hit_speedup"]:
        print(f"B{b:>3}: hit {res['hit_speedup'][b]:.2f}x (acceptance {res['acceptance'][b]}), "
              f"miss {res['miss_speedup'][b]:.2f}x")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("speculation", aliases=["spec"],
                       help="prompt-lookup speculation: drafts that hit and miss, with and without",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the result as JSON only")
    p.add_argument("--batches", type=int, nargs="+", default=None, help="batch sizes (default 1 8 32)")
    p.add_argument("--tokens", type=int, default=None, help="new tokens a request (default 128)")
    p.add_argument("--repeats", type=int, default=None, help="runs a side and batch (default 5)")
    p.add_argument("--grant", type=int, default=8, help="the planner's decode_grant (default 8)")
    p.add_argument("--max-draft", type=int, default=8)
    p.add_argument("--ngram-min", type=int, default=1)
    p.add_argument("--ngram-max", type=int, default=4)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--quick", action="store_true", help="a smoke test (2 layers, few tokens), not a number")
    p.set_defaults(func=_main)
