"""`superfluid bench prefix`: multi-turn chat over a shared system prompt.

N conversations x T turns: every conversation opens with the same system
prompt and a user message; each turn appends the previous answer and a new
user message, so turn k+1's prompt is turn k's prompt and answer plus a few
tokens. The workload goes through the reference planner and an in-process
executor twice, with seed leases (turn k+1 and every conversation's system
prompt come from the prefix cache) and without (every turn prefills its whole
history), and through HF `generate` on the same weights, which recomputes the
history each turn (one batch of the N conversations per turn, fed the same
histories as ours). Greedy, no stop at EOS: each answer is exactly
--answer-tokens long, and the two planner runs must give the same tokens.

TTFT warm vs cold: one request with a 2k-token prefix and a short new
suffix; cold on an executor that has never seen the prefix (no leases),
warm after the prefix was run once and published, leased. p50 of --repeats.

The Mamba2 workload (under "mamba2", the same keys; --no-mamba2 skips it):
the same chat and TTFT requests on a Mamba2 checkpoint of similar cost, on
the exact_only Mamba2 runtime. There a lease covers a checkpoint's or a
published entry's exact length (contract §6): the executor checkpoints every
prompt of >= 128 tokens one token short of its end, and a retired lane
publishes its settled state (prompt and answer). Turn 1 leases the system
prompt's checkpoint, turn k+1 turn k's published lane; the warm TTFT request
leases the prefix's checkpoint (the prefix's published entry holds its
answer token too, so it is no prefix of the request) and prefills the
prefix's last token and the suffix. The runtime is exact: leased and
unleased runs give the same tokens, and the command exits 1 where any
run's do not.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np
import torch

from superfluid.bench import system

# The tiny shape, deeper and wider so prefill (what leases save) outweighs
# the planner's per-tick cost, with room for a 2k prefix plus the turns.
MODEL: dict[str, Any] = dict(arch="llama", seed=0, tokenizer=False, vocab_size=320, hidden_size=128,
                             intermediate_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                             max_position_embeddings=4096)
# Its Mamba2 counterpart: the same vocabulary, width and depth (heads * head_dim = 2 * hidden).
MAMBA2_MODEL: dict[str, Any] = dict(arch="mamba2", seed=0, vocab_size=320, hidden_size=128, state_size=32,
                                    num_heads=8, num_layers=4, chunk_size=64)
_PAGE = 16


def _toks(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(0, 256, n).tolist()  # byte ids: no special token in a prompt


def _executor(model: str, cells: int, max_batch: int, slots: int = 0):
    """kv_cells for a paged runtime; slots: a Mamba2 runtime's state pool, in
    sequences (it ignores kv_cells)."""
    from superfluid.client.local import LocalClient
    from superfluid.engine import load
    from superfluid.executor import Executor
    from superfluid.executor.tick_rings import LocalRings

    rt = load(model, "torch", kv_cells=cells, max_batch=max_batch, **({"max_seqs": slots} if slots else {}))
    rings = LocalRings(prompt_tokens=1 << 20, emit_tokens=1 << 18, logits_floats=1 << 16)
    return LocalClient(Executor(rt, rings))


def _planner(client, *, leases: bool, budget: int, grant: int):
    from superfluid.client.planner import Planner

    return Planner(client, prefill_token_budget=budget, decode_grant=grant, use_leases=leases)


def _warm_up(client, budget: int, grant: int, rng) -> None:
    """Torch's first calls at each shape are slow: not the workload's."""
    p = _planner(client, leases=False, budget=budget, grant=grant)
    for n in (budget + 40, 40):
        p.submit(_toks(rng, n), 4, stop_at_eos=False, publish=False)
    p.run_until_done(600)


def _chat(client, *, leases: bool, system_prompt, users, answer: int, budget: int,
          grant: int) -> dict[str, Any]:
    """Every conversation's turn t in one planner run, turn after turn (turn
    t+1 needs turn t's answer). One planner throughout: its seed book
    remembers what earlier turns published."""
    planner = _planner(client, leases=leases, budget=budget, grant=grant)
    hist = [list(system_prompt) + u[0] for u in users]
    prompts, answers = [], []
    t0 = time.perf_counter()
    # The system prompt alone first, as a server caches it: else turn 1 admits
    # every conversation before any lane has retired and published it.
    planner.submit(system_prompt, 1, stop_at_eos=False)
    planner.run_until_done(600)
    for t in range(len(users[0])):
        ids = [planner.submit(h, answer, stop_at_eos=False) for h in hist]
        rep = planner.run_until_done(1800)
        got = [rep.results[i].tokens for i in ids]
        prompts.append([list(h) for h in hist])
        answers.append(got)
        if any(rep.results[i].finish != "max_tokens" for i in ids):
            raise RuntimeError(f"turn {t}: a request ended early: {[rep.results[i].finish for i in ids]}")
        if t + 1 < len(users[0]):
            hist = [h + a + u[t + 1] for h, a, u in zip(hist, got, users)]
    wall = time.perf_counter() - t0
    s = planner.report().stats
    tokens = sum(len(a) for turn in answers for a in turn)
    asked = len(system_prompt) + sum(len(p) for turn in prompts for p in turn)
    return {"tok_s": tokens / wall, "tokens": tokens, "wall_s": wall, "ticks": s.ticks,
            "seeded_tokens": s.seeded_tokens, "leases": s.leases, "ttft_p50_s": s.ttft_p50_s,
            "prompts": prompts, "answers": answers,
            "prefilled_tokens": asked - s.seeded_tokens}


def _ttft(client, *, leases: bool, prefix, suffixes, budget: int, grant: int) -> tuple[list[float], list]:
    """TTFT (s) of prefix + each suffix, one request at a time. leases: the
    prefix is run and published once first, so each request leases it."""
    planner = _planner(client, leases=leases, budget=budget, grant=grant)
    if leases:
        planner.submit(list(prefix), 1, stop_at_eos=False)
        planner.run_until_done(600)
    ttfts, firsts = [], []
    for suf in suffixes:
        i = planner.submit(list(prefix) + suf, 1, stop_at_eos=False, publish=False)
        r = planner.run_until_done(600).results[i]
        ttfts.append(r.ttft_s)
        firsts.append(r.tokens)
    return ttfts, firsts


def _hf(model: str, prompts, answer: int) -> dict[str, Any]:
    """HF generate per turn over the whole history (all conversations of a
    turn have one length: no padding). No eos (eos_token_id=[]): it runs the
    whole answer and may pick an eos, as ours does with stop_at_eos off
    (min_new_tokens would ban eos instead, and a greedy eos would differ)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()  # Mamba2's "falling back to the PyTorch implementation" notes
    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    outs, toks = [], 0
    with torch.inference_mode():
        m.generate(torch.tensor([prompts[0][0][:32]]), max_new_tokens=2, do_sample=False, pad_token_id=0)
        t0 = time.perf_counter()
        for turn in prompts:
            ids = torch.tensor(turn)
            out = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=answer,
                             do_sample=False, pad_token_id=0, eos_token_id=[])
            outs.append(out[:, ids.shape[1]:].tolist())
            toks += answer * len(turn)
        wall = time.perf_counter() - t0
    return {"tok_s": toks / wall, "wall_s": wall, "answers": outs}


def _side(r: dict[str, Any]) -> dict[str, Any]:
    return {"tokens": r["tokens"], "ticks": r["ticks"], "leases": r["leases"],
            "prefilled_tokens": r["prefilled_tokens"],
            "wall_s": round(r["wall_s"], 3), "ttft_ms_p50": round(1e3 * r["ttft_p50_s"], 3)}


def _agreement(a, b) -> float:
    x, y = np.array(a), np.array(b)
    return round(float((x == y).mean()), 4) if x.shape == y.shape else 0.0


def _p50(xs: list[float]) -> float:
    return round(1e3 * float(np.median(xs)), 3)


def run(*, conversations: int = 4, turns: int = 4, system_tokens: int = 1024, user_tokens: int = 32,
        answer_tokens: int = 16, ttft_prefix: int = 2048, ttft_suffix: int = 16, repeats: int = 5,
        budget: int = 512, grant: int = 8, hf: bool = True, model: str | None = None,
        mamba2: bool = True, mamba2_model: str | None = None, seed: int = 0,
        threads: int | None = None) -> dict[str, Any]:
    """The transformer workload's keys at the top; mamba2: the same workload
    on a Mamba2 checkpoint (mamba2_model, else MAMBA2_MODEL's) under "mamba2"."""
    from superfluid.bench.engine import checkpoint

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)  # ours (the C kernels follow torch's count) and HF's
    t_start = time.perf_counter()
    meter = system.LoadMeter()
    shape = dict(conversations=conversations, turns=turns, system_tokens=system_tokens,
                 user_tokens=user_tokens, answer_tokens=answer_tokens, ttft_prefix=ttft_prefix,
                 ttft_suffix=ttft_suffix, repeats=repeats, budget=budget, grant=grant, hf=hf, seed=seed)
    try:
        res = _workload(model or str(checkpoint("prefix", **MODEL)), **shape)
        if mamba2:
            res["mamba2"] = _workload(mamba2_model or str(checkpoint("prefix-mamba2", **MAMBA2_MODEL)),
                                      exact_only=True, **shape)
        return system.finish(res, meter, t_start)
    finally:
        torch.set_num_threads(before)


def _workload(model: str, *, conversations, turns, system_tokens, user_tokens, answer_tokens, ttft_prefix,
              ttft_suffix, repeats, budget, grant, hf, seed, exact_only: bool = False) -> dict[str, Any]:
    """The chat with leases and without, the TTFT cold and warm, and HF, on
    one checkpoint; every workload draws the same tokens (from `seed`)."""
    rng = np.random.default_rng(seed)
    system_prompt = _toks(rng, system_tokens)
    users = [[_toks(rng, user_tokens) for _ in range(turns)] for _ in range(conversations)]
    longest = system_tokens + turns * (user_tokens + answer_tokens)
    # Live lanes, what they publish and the cache's copies: room for a few histories each.
    cells = max(4 * conversations * (longest + 2 * _PAGE) + 4 * (ttft_prefix + ttft_suffix + 2 * _PAGE),
                4 * (budget + 64))  # and the warm-up's
    max_batch = max(8, conversations)
    # exact_only: a state slot per live lane and per cache entry: each turn's published
    # lane and its prompt's checkpoint, the system prompt's, the TTFT requests', with room.
    slots = 2 * (conversations * turns + repeats + 4) + 2 * max_batch if exact_only else 0

    runs = {}
    for leases in (True, False):
        client = _executor(model, cells, max_batch, slots)
        _warm_up(client, budget, grant, rng)
        runs[leases] = _chat(client, leases=leases, system_prompt=system_prompt, users=users,
                             answer=answer_tokens, budget=budget, grant=grant)
    on, off = runs[True], runs[False]

    prefix = _toks(rng, ttft_prefix)
    suffixes = [_toks(rng, ttft_suffix) for _ in range(repeats + 1)]  # the first: a warm-up
    ttft = {}
    for leases in (False, True):  # each on a fresh executor: cold has never seen the prefix
        client = _executor(model, cells, max_batch, slots)
        _warm_up(client, budget, grant, rng)
        ttft[leases] = _ttft(client, leases=leases, prefix=prefix, suffixes=suffixes, budget=budget,
                             grant=grant)
    cold, warm = _p50(ttft[False][0][1:]), _p50(ttft[True][0][1:])

    res: dict[str, Any] = {
        "ttft_ms_warm": warm, "ttft_ms_cold": cold, "warm_vs_cold": round(cold / warm, 2),
        "tok_s_with_leases": round(on["tok_s"], 1), "tok_s_without": round(off["tok_s"], 1),
        "leases_vs_without": round(on["tok_s"] / off["tok_s"], 2),
        "hit_tokens": on["seeded_tokens"], "hf_tok_s": None,
        "tokens_equal": on["answers"] == off["answers"] and on["prompts"] == off["prompts"],
        "ttft_tokens_equal": ttft[False][1] == ttft[True][1],
        "ttft_ms_runs": {"cold": [round(1e3 * x, 3) for x in ttft[False][0][1:]],
                         "warm": [round(1e3 * x, 3) for x in ttft[True][0][1:]]},
        "with_leases": _side(on), "without": _side(off),
    }
    if hf:
        h = _hf(model, on["prompts"], answer_tokens)
        res["hf_tok_s"] = round(h["tok_s"], 1)
        res["hf_wall_s"] = round(h["wall_s"], 3)
        res["hf_greedy_agreement"] = _agreement(h["answers"], on["answers"])
    res["meets_warm_vs_cold_20"] = res["warm_vs_cold"] >= 20
    res["meets_leases_3x"] = res["leases_vs_without"] >= 3
    res["workload"] = {"conversations": conversations, "turns": turns, "system_tokens": system_tokens,
                       "user_tokens": user_tokens, "answer_tokens": answer_tokens,
                       "ttft_prefix_tokens": ttft_prefix,
                       "ttft_suffix_tokens": ttft_suffix, "repeats": repeats, "prefill_token_budget": budget,
                       "decode_grant": grant, "model": model, "sampling": "greedy",
                       "hf_mode": "one generate per turn, the N conversations batched, full history",
                       **({"arch": "mamba2", "state_slots": slots} if exact_only else {"kv_cells": cells})}
    return res


def _equal(res: dict[str, Any]) -> bool:
    """Every workload's leased and unleased runs gave the same tokens."""
    return all(r["tokens_equal"] and r["ttft_tokens_equal"] for r in (res, res.get("mamba2") or res))


def _main(args: argparse.Namespace) -> int:
    res = run(conversations=args.conversations, turns=args.turns, system_tokens=args.system_tokens,
              user_tokens=args.user_tokens, answer_tokens=args.answer_tokens, ttft_prefix=args.ttft_prefix,
              repeats=args.repeats, hf=not args.no_hf, model=args.model, mamba2=not args.no_mamba2,
              mamba2_model=args.mamba2_model, threads=args.threads)
    if args.json:
        print(json.dumps(res, indent=2))
        return 0 if _equal(res) else 1
    cols = [("transformer", res)] + ([("mamba2", res["mamba2"])] if "mamba2" in res else [])
    rows = [("TTFT p50 cold / warm (ms)", lambda r: f"{r['ttft_ms_cold']} / {r['ttft_ms_warm']}"),
            ("warm vs cold", lambda r: f"{r['warm_vs_cold']}x (20x: {r['meets_warm_vs_cold_20']})"),
            ("tok/s with leases / without", lambda r: f"{r['tok_s_with_leases']} / {r['tok_s_without']}"),
            ("leases vs without", lambda r: f"{r['leases_vs_without']}x (3x: {r['meets_leases_3x']})"),
            ("hit tokens", lambda r: r["hit_tokens"]), ("HF generate tok/s", lambda r: r["hf_tok_s"]),
            ("tokens equal", lambda r: r["tokens_equal"] and r["ttft_tokens_equal"])]
    print(f"{'':<30} " + " ".join(f"{name:<26}" for name, _ in cols))
    for label, cell in rows:
        print(f"{label:<30} " + " ".join(f"{cell(r)!s:<26}" for _, r in cols))
    return 0 if _equal(res) else 1


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prefix", help="multi-turn chat: seed leases vs none vs HF generate",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the result as JSON only")
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--user-tokens", type=int, default=32)
    p.add_argument("--answer-tokens", type=int, default=16)
    p.add_argument("--ttft-prefix", type=int, default=2048, help="shared prefix of the TTFT requests")
    p.add_argument("--repeats", type=int, default=5, help="TTFT requests per side (default 5)")
    p.add_argument("--threads", type=int, default=None, help="torch threads for us and HF (default: torch's)")
    p.add_argument("--no-hf", action="store_true", help="skip HF generate")
    p.add_argument("--model", help="checkpoint directory (default: a seeded 4-layer model, 4k context)")
    p.add_argument("--no-mamba2", action="store_true", help="skip the Mamba2 workload")
    p.add_argument("--mamba2-model", help="Mamba2 checkpoint directory (default: a seeded 4-layer one)")
    p.set_defaults(func=_main)
