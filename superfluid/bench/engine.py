"""`superfluid bench engine`: prefill and decode throughput against HF.

For the tiny model and a small one (~58M parameters, both written from a
seed; nothing is downloaded), at each batch size (--batches, default 1 8
32 64): B prompts of P tokens prefilled in one step (which samples each
lane's first token), then G-1 greedy decode steps with engine sampling —
against HF transformers on the same weights and batch in the same process:
a forward over the prompts (prefill) and `generate` (its decode time is
generate(G) less generate(1)). The invariance tax is the small model's
decode run again with batch invariance off (plain GEMMs, plain softmax).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

BATCHES = (1, 8, 32, 64)


def _cache_root() -> Path:
    return Path(os.environ.get("SUPERFLUID_CACHE", Path.home() / ".cache" / "superfluid"))


def checkpoint(name: str, **params: Any) -> Path:
    """A seeded checkpoint written once into the cache and reused."""
    from superfluid.engine.tiny import write_tiny

    key = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:12]
    out = _cache_root() / f"bench-{name}-{key}"
    if (out / "config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        write_tiny(tmp, **params)
        os.replace(tmp, out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "config.json").exists():
            raise
    return out


def _ours(path: Path, prompts: np.ndarray, gen: int, invariant: bool) -> dict[str, Any]:
    from superfluid.engine import Feed, SampleSpec, load

    b, p = prompts.shape
    rt = load(path, "torch", kv_cells=b * (p + gen) + 64 * 16, max_batch=max(64, b), invariant=invariant,
              prefill_step_tokens=0)
    warm = rt.seq_create()
    rt.step_sampled([Feed(warm, prompts[0, :8].tolist(), True)], [SampleSpec()])
    rt.seq_free(warm)
    seqs = [rt.seq_create() for _ in range(b)]
    greedy = [SampleSpec()] * b
    t0 = time.perf_counter()
    toks = rt.step_sampled([Feed(s, row.tolist(), True) for s, row in zip(seqs, prompts)], greedy)
    t1 = time.perf_counter()
    out = [toks]
    for _ in range(gen - 1):
        toks = rt.step_sampled([Feed(s, [t], True) for s, t in zip(seqs, toks)], greedy)
        out.append(toks)
    t2 = time.perf_counter()
    rt.close()
    return {"prefill_s": t1 - t0, "decode_s": t2 - t1, "tokens": np.array(out).T}


def _hf(path: Path, prompts: np.ndarray, gen: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.from_numpy(prompts).long()
    mask = torch.ones_like(ids)
    p = ids.shape[1]
    kw = dict(attention_mask=mask, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids[:1, :8], max_new_tokens=2, **{**kw, "attention_mask": mask[:1, :8]})
        t0 = time.perf_counter()
        model(ids, attention_mask=mask)
        t1 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, **kw)
        t2 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=gen, min_new_tokens=gen, **kw)
        t3 = time.perf_counter()
    # Decode: generate(gen) less generate(1), which is the prefill and its first token.
    return {"prefill_s": t1 - t0, "decode_s": max(1e-9, (t3 - t2) - (t2 - t1)), "tokens": out[:, p:].numpy()}


def _model_rows(name: str, path: Path, batches: tuple[int, ...], prompt_len: int, gen: int, vocab: int,
                tax: bool, log) -> dict[str, Any]:
    res: dict[str, Any] = {k: {} for k in ("decode_tok_s", "hf_decode_tok_s", "prefill_tok_s", "hf_prefill_tok_s",
                                             "greedy_agreement")}
    taxes: dict[str, float] = {}
    rng = np.random.default_rng(0)
    for b in batches:
        prompts = rng.integers(0, vocab, (b, prompt_len))
        ours = _ours(path, prompts, gen, invariant=True)
        hf = _hf(path, prompts, gen)
        key = str(b)
        res["prefill_tok_s"][key] = round(b * prompt_len / ours["prefill_s"], 1)
        res["decode_tok_s"][key] = round(b * (gen - 1) / ours["decode_s"], 1)
        res["hf_prefill_tok_s"][key] = round(b * prompt_len / hf["prefill_s"], 1)
        res["hf_decode_tok_s"][key] = round(b * (gen - 1) / hf["decode_s"], 1)
        # Greedy tokens agree unless a near-tie flips an argmax (fp32, different op order).
        res["greedy_agreement"][key] = round(float((ours["tokens"] == hf["tokens"]).mean()), 4)
        if tax:
            plain = _ours(path, prompts, gen, invariant=False)
            taxes[key] = round(ours["decode_s"] / plain["decode_s"] - 1, 4)
        log(f"{name} batch {b}: decode {res['decode_tok_s'][key]} tok/s (hf {res['hf_decode_tok_s'][key]}), "
            f"prefill {res['prefill_tok_s'][key]} tok/s (hf {res['hf_prefill_tok_s'][key]})"
            + (f", invariance tax {taxes[key]:+.1%}" if tax else ""))
    if tax:
        res["invariance_tax_by_batch"] = taxes
    res["decode_speedup_vs_hf"] = {k: round(res["decode_tok_s"][k] / res["hf_decode_tok_s"][k], 3)
                                   for k in res["decode_tok_s"]}
    return res


def run(*, batches: tuple[int, ...] = BATCHES, prompt_len: int = 128, gen: int = 32, small: bool = True,
        log=lambda s: None) -> dict[str, Any]:
    from superfluid.engine.tiny import SMALL, TINY

    t0 = time.perf_counter()
    models = {"tiny": dict(arch="llama", seed=0, tokenizer=False, **TINY)}
    if small:
        models["small"] = dict(arch="llama", seed=0, tokenizer=False, **SMALL)
    result: dict[str, Any] = {"models": {}}
    for name, params in models.items():
        path = checkpoint(name, **params)
        result["models"][name] = _model_rows(name, path, batches, prompt_len, gen, params["vocab_size"],
                                             tax=(name == "small" or not small), log=log)
    head = result["models"]["small" if small else "tiny"]
    for k in ("decode_tok_s", "hf_decode_tok_s", "prefill_tok_s", "hf_prefill_tok_s", "decode_speedup_vs_hf"):
        result[k] = head[k]
    by_batch = head.get("invariance_tax_by_batch", {})
    result["invariance_tax"] = by_batch.get("32", max(by_batch.values()) if by_batch else None)
    result["invariance_tax_by_batch"] = by_batch
    result["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    result["workload"] = {"prompt_len": prompt_len, "gen": gen, "batches": list(batches), "dtype": "float32",
                          "headline_model": "small" if small else "tiny"}
    result["threads"] = torch.get_num_threads()
    result["python"] = platform.python_version()
    result["torch"] = torch.__version__
    result["cpu_count"] = os.cpu_count()
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    return result


def _main(args: argparse.Namespace) -> int:
    log = (lambda s: None) if args.json else (lambda s: print(s, flush=True))
    res = run(batches=tuple(args.batches), prompt_len=args.prompt_len, gen=args.gen, small=not args.tiny_only,
              log=log)
    print(json.dumps(res, indent=2) if args.json else
          f"invariance tax (batch 32): {res['invariance_tax']}, peak RSS {res['peak_rss_mb']} MB, {res['wall_s']} s")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("engine", help="prefill/decode tokens/s vs HF transformers", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the result as JSON only")
    p.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen", type=int, default=32, help="decode steps (tokens per lane)")
    p.add_argument("--tiny-only", action="store_true", help="skip the small model")
    p.set_defaults(func=_main)
