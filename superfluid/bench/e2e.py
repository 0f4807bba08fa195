"""`superfluid bench e2e`: requests end to end, three ways, in one run.

The same workload (greedy requests of mixed prompt and output lengths) goes
(1) through a daemon worker over shared memory, driven by the reference
planner; (2) through the same planner and an executor in this process (what
the process split costs is the difference); (3) through HF transformers
`generate` on the same weights, batched like the planner's lanes.
Paths (1) and (2) run the workload `repeats` times on one worker each, the
first a warm-up; each reports its median run (a run is well under a second
here, so one run alone is mostly noise).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import threading
import time
from typing import Any

import numpy as np
import torch


def _workload(n: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, vocab, int(rng.integers(32, 160))).tolist(), int(rng.integers(24, 72)))
            for _ in range(n)]


def _drive(client, reqs, *, budget: int, grant: int) -> dict[str, Any]:
    from superfluid.client.planner import Planner

    planner = Planner(client, prefill_token_budget=budget, decode_grant=grant)
    ids = [planner.submit(p, m, stop_at_eos=False) for p, m in reqs]
    t0 = time.perf_counter()
    rep = planner.run_until_done(1800)
    wall = time.perf_counter() - t0
    toks = sum(len(rep.results[i].tokens) for i in ids)
    ttft = sorted(1e3 * rep.results[i].ttft_s for i in ids if rep.results[i].ttft_s is not None)
    return {"tok_s": toks / wall, "tokens": toks, "wall_s": wall, "ttft": ttft,
            "outputs": [rep.results[i].tokens for i in ids]}


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    return round(xs[min(len(xs) - 1, int(np.ceil(q / 100 * len(xs))) - 1)], 2)


def _median_run(client, reqs, *, budget: int, grant: int, repeats: int) -> dict[str, Any]:
    runs = [_drive(client, reqs, budget=budget, grant=grant) for _ in range(max(1, repeats))]
    timed = runs[1:] or runs  # the first run pays the warm-up
    med = sorted(timed, key=lambda r: r["tok_s"])[len(timed) // 2]
    med["same_every_run"] = all(r["outputs"] == runs[0]["outputs"] for r in runs)
    med["runs_tok_s"] = [round(r["tok_s"], 1) for r in timed]
    return med


def _daemon(model: str, reqs, budget: int, grant: int, repeats: int) -> dict[str, Any]:
    from superfluid.client import Client
    from superfluid.daemon.supervisor import Daemon

    name = f"e2e-{os.getpid()}"
    d = Daemon(name, ["--model", model], workers=1, handle_signals=False)
    d.start()
    loop = threading.Thread(target=d.serve_forever, daemon=True)
    loop.start()
    try:
        with Client.connect(name, 0, timeout=300) as c:
            return _median_run(c, reqs, budget=budget, grant=grant, repeats=repeats)
    finally:
        d.stop()
        loop.join(60)


def _inproc(model: str, reqs, budget: int, grant: int, repeats: int) -> dict[str, Any]:
    from superfluid.client.local import LocalClient
    from superfluid.engine import load
    from superfluid.executor import Executor

    return _median_run(LocalClient(Executor(load(model, "torch"))), reqs, budget=budget, grant=grant,
                       repeats=repeats)


def _hf(model: str, reqs, batch: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    toks = 0
    ttft: list[float] = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(reqs), batch):
            group = reqs[i:i + batch]
            width = max(len(p) for p, _ in group)
            ids = torch.zeros((len(group), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for j, (p, _) in enumerate(group):  # left padding, as HF generate wants for batches
                ids[j, width - len(p):] = torch.tensor(p)
                mask[j, width - len(p):] = 1
            start = time.perf_counter()
            new = max(n for _, n in group)
            m.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                       pad_token_id=0)
            # Every request of the batch waits for the whole batch: its first token
            # arrives when the batch's prefill is done, taken as 1/new of the time.
            took = time.perf_counter() - start
            ttft += [1e3 * (start - t0 + took / new)] * len(group)
            toks += sum(n for _, n in group)
    wall = time.perf_counter() - t0
    return {"tok_s": toks / wall, "tokens": toks, "wall_s": wall, "ttft": sorted(ttft)}


def run(*, requests: int = 32, model: str | None = None, budget: int = 512, grant: int = 8, seed: int = 3,
        hf_batch: int = 8, repeats: int = 4) -> dict[str, Any]:
    from superfluid.engine.config import load_config
    from superfluid.engine.tiny import default_model_dir

    model = model or str(default_model_dir())
    reqs = _workload(requests, load_config(model).vocab_size, seed)
    t0 = time.perf_counter()
    inproc = _inproc(model, reqs, budget, grant, repeats)
    daemon = _daemon(model, reqs, budget, grant, repeats)
    hf = _hf(model, reqs, hf_batch)
    return {
        "tok_s": round(daemon["tok_s"], 1),
        "inproc_tok_s": round(inproc["tok_s"], 1),
        "hf_tok_s": round(hf["tok_s"], 1),
        "daemon_to_inproc": round(daemon["tok_s"] / inproc["tok_s"], 3),
        "ttft_ms": {"p50": _pct(daemon["ttft"], 50), "p99": _pct(daemon["ttft"], 99)},
        "inproc_ttft_ms": {"p50": _pct(inproc["ttft"], 50), "p99": _pct(inproc["ttft"], 99)},
        "hf_ttft_ms": {"p50": _pct(hf["ttft"], 50), "p99": _pct(hf["ttft"], 99)},
        "same_tokens_daemon_vs_inproc": daemon["outputs"] == inproc["outputs"],
        "same_tokens_every_run": daemon["same_every_run"] and inproc["same_every_run"],
        "runs_tok_s": {"daemon": daemon["runs_tok_s"], "inproc": inproc["runs_tok_s"]},
        "workload": {"requests": requests, "tokens": daemon["tokens"], "prefill_token_budget": budget,
                     "decode_grant": grant, "hf_batch": hf_batch, "repeats": repeats, "model": model,
                     "sampling": "greedy"},
        "python": platform.python_version(), "cpu_count": os.cpu_count(),
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def _main(args: argparse.Namespace) -> int:
    res = run(requests=args.requests, model=args.model, repeats=args.repeats)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print(f"daemon {res['tok_s']} tok/s, in-process {res['inproc_tok_s']} tok/s "
              f"(ratio {res['daemon_to_inproc']}), HF generate {res['hf_tok_s']} tok/s; "
              f"TTFT p50 {res['ttft_ms']['p50']} ms, p99 {res['ttft_ms']['p99']} ms")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("e2e", help="requests through the daemon vs in-process vs HF generate",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the result as JSON only")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--repeats", type=int, default=4, help="runs per path, the first a warm-up (default 4)")
    p.add_argument("--model", help="checkpoint directory (default: the embedded tiny model)")
    p.set_defaults(func=_main)
