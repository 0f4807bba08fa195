"""`superfluid bench grammar`: what grammar masking costs a decode step at vocab 32k.

The model: SMALL's shape (engine.tiny: hidden 512, 8 layers, vocabulary
32000), seeded, with bench/bpe.py's locally trained 32k byte-level BPE as its
tokenizer.json (nothing is downloaded), on the torch backend on the CPU.
The grammar: a 25-property JSON schema (strings, bounded integers and
numbers, enums, patterns, an array, a nullable field).

For each batch B (1, 8, 32): B plain lanes and B grammar lanes, prefilled
with the same prompts. Each measured round times a plain decode step
(step_sampled over the plain lanes, no masks) and a grammar round on the
grammar lanes: the registry's fill of the B matchers' masks in one call (as
a decode round fills them), step_sampled with that bitmask, and every matcher accepting its lane's
token (a completed document starts a fresh matcher). The two alternate, the
order swapped every round, so drift in the machine's load hits both alike.
Inside the masked step the mask's application (kernels.sampling's _mask and
apply_bitmask_torch) is timed by wrapping them. The matchers start staggered
(each walked a random number of tokens into a document), as a server's lanes
are. Medians over --repeats rounds, after warm-up rounds.

  mask_us[B]    fill + application + accept, per round (B tokens)
  step_us[B]    the plain decode step
  mask_share[B] mask_us / the grammar round (fill + masked step + accept),
                the median of the rounds' ratios
  compile_ms    the schema's compile (llguidance), median of --repeats; the
                tokenizer's one-time build is tokenizer_ms
  valid         the share of --requests sampled requests (temperature 1) through
                the Planner and an in-process Executor under the schema whose
                output (decoded with `tokenizers`) parses and validates (jsonschema)

The top-level numbers are for sampled lanes (temperature 1, the valid
requests'); "greedy" has the same per-batch keys for greedy lanes, whose
decode step skips the sampler's float64 work, so masking is a larger share.
A fill right after a forward costs ~2.5x one on warm caches (the forward's
weights evict llguidance's token tables): the rounds measure it as a server
pays it. fill_threads: llguidance's pool (one thread: the fill runs in the
caller's). --quick is a smoke test (a 2-layer model, few rounds), not a number.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from superfluid.bench import system

BATCHES = (1, 8, 32)
PROMPT = 16  # prompt tokens a lane
_FORMAT = 1  # bump when what model_dir writes changes

SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False,
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "name": {"type": "string", "maxLength": 16},
        "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org|net)$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "active": {"type": "boolean"},
        "score": {"type": "number", "minimum": 0, "maximum": 100, "multipleOf": 0.25},
        "role": {"enum": ["admin", "editor", "viewer", "guest"]},
        "country": {"type": "string", "pattern": "^[A-Z]{2}$"},
        "created": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "verified": {"type": "boolean"},
        "level": {"type": "integer", "minimum": 1, "maximum": 10},
        "bio": {"type": "string", "maxLength": 24},
        "plan": {"enum": ["free", "pro", "team"]},
        "balance": {"type": "number", "minimum": -1000, "maximum": 1000, "multipleOf": 0.5},
        "city": {"type": "string", "maxLength": 12},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        "phone": {"type": "string", "pattern": "^\\+[0-9]{1,3} [0-9]{6,10}$"},
        "lang": {"enum": ["en", "de", "fr", "es", "ja"]},
        "admin": {"type": "boolean"},
        "logins": {"type": "integer", "minimum": 0, "maximum": 1000000},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "nickname": {"type": ["string", "null"], "maxLength": 10},
        "theme": {"enum": ["light", "dark"]},
        "notes": {"type": "string", "maxLength": 20},
    },
}
SCHEMA["required"] = list(SCHEMA["properties"])


def model_params(quick: bool = False) -> dict[str, Any]:
    from superfluid.engine.tiny import SMALL

    return dict(arch="llama", seed=0, **{**SMALL, "num_layers": 2 if quick else SMALL["num_layers"]})


def model_dir(params: dict[str, Any]) -> Path:
    """write_tiny's checkpoint for params with the 32k BPE as its tokenizer.json,
    written once into the cache (renamed into place: readers never see half of it)."""
    from superfluid.bench.bpe import bpe_tokenizer_json
    from superfluid.bench.engine import _cache_root
    from superfluid.engine.tiny import write_tiny

    key = json.dumps({"format": _FORMAT, "bpe": params["vocab_size"], **params}, sort_keys=True)
    out = _cache_root() / f"bench-grammar-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if (out / "config.json").exists():
        return out
    tok = bpe_tokenizer_json(params["vocab_size"])
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        write_tiny(tmp, **params)
        (tmp / "tokenizer.json").write_text(tok, encoding="utf-8")
        os.replace(tmp, out)
    except OSError:
        if not (out / "config.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


class _Clock:
    """Wraps functions of a module, summing their time while `on`."""

    def __init__(self, module, names: tuple[str, ...]):
        self.module, self.names, self.ns, self.on = module, names, 0, False

    @contextlib.contextmanager
    def installed(self):
        saved = {n: getattr(self.module, n) for n in self.names}

        def wrap(f):
            def timed(*a, **k):
                if not self.on:
                    return f(*a, **k)
                t0 = time.perf_counter_ns()
                try:
                    return f(*a, **k)
                finally:
                    self.ns += time.perf_counter_ns() - t0
            return timed

        for n, f in saved.items():
            setattr(self.module, n, wrap(f))
        try:
            yield self
        finally:
            for n, f in saved.items():
                setattr(self.module, n, f)


def _walk(grammar, reg, rng: np.random.Generator, n: int):
    """A fresh matcher walked n tokens into a document (uniform over what its
    mask allows; fewer if the document completes first)."""
    from superfluid.kernels.reference_sampler import mask_allowed

    m = grammar.matcher()
    row = reg.bitmask(1)
    for _ in range(n):
        reg.fill([(m, 0)], row)
        if m.is_complete():
            break
        ok = np.flatnonzero(mask_allowed(row[0], reg.vocab_size))
        if not m.accept(int(rng.choice(ok))):
            raise RuntimeError("a walk's token was refused")
    return m


def _us(ns: list[int]) -> float:
    return round(statistics.median(ns) / 1e3, 1)


def _measure(rt, reg, grammar, B: int, *, temperature: float, repeats: int, warmup: int, stagger: int,
             clock: _Clock, rng: np.random.Generator) -> dict[str, Any]:
    from superfluid.engine import Feed, SampleSpec, TokenMasks

    V = rt.desc.vocab_size
    plain = [rt.seq_create() for _ in range(B)]
    lanes = [rt.seq_create() for _ in range(B)]
    prompts = [rng.integers(0, 256, PROMPT).tolist() for _ in range(B)]
    try:
        rt.step([Feed(s, p, False) for s, p in zip(plain + lanes, prompts + prompts)])
        matchers = [_walk(grammar, reg, rng, int(rng.integers(0, stagger + 1))) for _ in range(B)]
        tok_plain = tok_lane = [int(rng.integers(0, 256)) for _ in range(B)]
        t = {k: [] for k in ("step", "fill", "masked_step", "apply", "accept", "round")}
        allowed: list[int] = []
        documents = 0
        pos = 0
        for r in range(warmup + repeats):
            pos += 1
            specs = [SampleSpec(temperature, 0, 0.0, 0.0, pos * 64 + j) for j in range(B)]
            sample: dict[str, int] = {}
            for which in (("plain", "grammar") if r % 2 else ("grammar", "plain")):
                if which == "plain":
                    t0 = time.perf_counter_ns()
                    tok_plain = rt.step_sampled([Feed(s, [x], True) for s, x in zip(plain, tok_plain)], specs)
                    sample["step"] = time.perf_counter_ns() - t0
                    continue
                clock.ns = 0
                t0 = time.perf_counter_ns()
                bits = reg.bitmask(B, fill=False)
                bad = reg.fill([(m, j) for j, m in enumerate(matchers)], bits)
                t1 = time.perf_counter_ns()
                clock.on = True
                try:
                    tok_lane = rt.step_sampled([Feed(s, [x], True) for s, x in zip(lanes, tok_lane)], specs,
                                               TokenMasks(bits))
                finally:
                    clock.on = False
                t2 = time.perf_counter_ns()
                ok = [m.accept(x) for m, x in zip(matchers, tok_lane)]
                t3 = time.perf_counter_ns()
                if bad or not all(ok):
                    raise RuntimeError(f"batch {B}: a matcher in error or a refused token (round {r})")
                sample.update(fill=t1 - t0, masked_step=t2 - t1, apply=clock.ns, accept=t3 - t2, round=t3 - t0)
                if r >= warmup:
                    allowed += np.unpackbits(bits.view(np.uint8), axis=1, count=V,
                                             bitorder="little").sum(1).tolist()
                for j, m in enumerate(matchers):
                    if m.is_complete():  # the grammar allowed only EOS; the next document begins
                        matchers[j] = grammar.matcher()
                        documents += 1
            if r >= warmup:
                for k, v in sample.items():
                    t[k].append(v)
    finally:
        for s in plain + lanes:
            rt.seq_free(s)
    mask = [f + a + c for f, a, c in zip(t["fill"], t["apply"], t["accept"])]
    med = {k: _us(v) for k, v in t.items()}
    med["mask"] = _us(mask)
    med["share"] = round(statistics.median(m / rd for m, rd in zip(mask, t["round"])), 4)
    med["allowed_tokens_p50"] = int(statistics.median(allowed)) if allowed else 0
    med["allowed_tokens_mean"] = round(statistics.fmean(allowed), 1) if allowed else 0.0
    med["documents_completed"] = documents
    return med


def _valid(model: Path, n: int, max_new: int, seed: int) -> dict[str, Any]:
    """n sampled requests under SCHEMA through the Planner and an in-process
    Executor: the share whose decoded output parses and validates."""
    import jsonschema
    from tokenizers import Tokenizer

    from superfluid.abi import Sampling
    from superfluid.bench.bpe import bpe_tokenizer_json
    from superfluid.client.builder import sampling_params
    from superfluid.client.local import LocalClient
    from superfluid.client.planner import Planner
    from superfluid.engine import load
    from superfluid.executor import Executor
    from superfluid.executor.tick_rings import LocalRings

    rt = load(model, "torch", device="cpu", kv_cells=max(1 << 14, 2 * n * (PROMPT + max_new + 32)),
              max_batch=max(1, n))
    ex = Executor(rt, LocalRings(prompt_tokens=1 << 16, emit_tokens=1 << 18, logits_floats=1 << 16))
    planner = Planner(LocalClient(ex))
    rng = np.random.default_rng(seed)
    grammar = ("json_schema", json.dumps(SCHEMA))
    ids = [planner.submit(rng.integers(0, 256, PROMPT).tolist(), max_new, Sampling.GPU_SAMPLE,
                          params=sampling_params(1.0), rng_base=(seed << 32) + 4096 * i, grammar=grammar)
           for i in range(n)]
    t0 = time.perf_counter()
    rep = planner.run_until_done(1800)
    wall = time.perf_counter() - t0
    tok = Tokenizer.from_str(bpe_tokenizer_json(rt.desc.vocab_size))
    ok, finishes, lengths, example = 0, {}, [], None
    for i in ids:
        r = rep.results[i]
        finishes[r.finish] = finishes.get(r.finish, 0) + 1
        lengths.append(len(r.tokens))
        try:
            doc = json.loads(tok.decode(r.tokens))
            jsonschema.validate(doc, SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            continue
        ok += 1
        example = example or doc
    return {"valid": round(ok / n, 4) if n else None, "requests": n, "valid_requests": ok, "finish": finishes,
            "tokens_p50": int(statistics.median(lengths)) if lengths else 0, "wall_s": round(wall, 1),
            "tok_s": round(sum(lengths) / wall, 1) if wall > 0 else None, "example": example}


def run(*, batches: tuple[int, ...] = BATCHES, repeats: int = 20, warmup: int = 3, requests: int = 16,
        max_new: int = 512, stagger: int = 150, quick: bool = False, greedy: bool = True,
        threads: int | None = None, fill_threads: int | None = None, seed: int = 0,
        model: str | None = None) -> dict[str, Any]:
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _run(batches, repeats, warmup, requests, max_new, stagger, quick, greedy, fill_threads, seed, model)
    finally:
        torch.set_num_threads(before)


def _run(batches, repeats, warmup, requests, max_new, stagger, quick, greedy, fill_threads, seed,
         model) -> dict[str, Any]:
    from superfluid.engine import load
    from superfluid.executor.grammar import GrammarRegistry
    from superfluid.kernels import sampling as ks

    t_start = time.perf_counter()
    meter = system.LoadMeter()
    params = model_params(quick)
    path = Path(model) if model else model_dir(params)
    lanes = 2 * max(batches)  # plain and grammar lanes of the largest batch, in one step at the prefill
    rt = load(path, "torch", device="cpu", max_batch=lanes,
              kv_cells=max(1 << 14, lanes * (PROMPT + warmup + repeats + 32)))
    if rt.tokenizer_json is None:
        raise RuntimeError(f"{path}: no tokenizer.json, so no grammars")
    reg = GrammarRegistry.for_runtime(rt, threads=fill_threads)
    text = json.dumps(SCHEMA)
    t0 = time.perf_counter()
    _ = reg.tokenizer
    tokenizer_ms = (time.perf_counter() - t0) * 1e3
    compiles, grammar = [], None
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter_ns()
        grammar = reg.compile("json_schema", text)
        compiles.append(time.perf_counter_ns() - t0)
    rng = np.random.default_rng(seed)
    clock = _Clock(ks, ("_mask", "apply_bitmask_torch"))
    blocks: dict[str, dict[str, Any]] = {}
    with clock.installed():
        for name, temp in (("sampled", 1.0), ("greedy", 0.0))[:2 if greedy else 1]:
            blocks[name] = {str(B): _measure(rt, reg, grammar, B, temperature=temp, repeats=repeats,
                                             warmup=warmup, stagger=stagger, clock=clock, rng=rng)
                            for B in batches}
    del rt
    checked = _valid(path, requests, max_new, seed) if requests else None

    def per_batch(block: dict[str, Any], key: str) -> dict[str, Any]:
        return {b: v[key] for b, v in block.items()}

    from superfluid.engine.config import load_config

    cfg = load_config(str(path))
    s = blocks["sampled"]
    res: dict[str, Any] = {
        "mask_share": per_batch(s, "share"), "mask_us": per_batch(s, "mask"), "step_us": per_batch(s, "step"),
        "compile_ms": round(statistics.median(compiles) / 1e6, 3),
        "valid": checked["valid"] if checked else None, "vocab": cfg.vocab_size,
        "meets_mask_share_5pct_b32": s["32"]["share"] <= 0.05 if "32" in s else None,
        "breakdown_us": {b: {k: v[k] for k in ("fill", "apply", "accept", "masked_step", "round")}
                         for b, v in s.items()},
        "masked_step_minus_step_us": {b: round(v["masked_step"] - v["step"], 1) for b, v in s.items()},
        "allowed_tokens_p50": per_batch(s, "allowed_tokens_p50"),
        "allowed_tokens_mean": per_batch(s, "allowed_tokens_mean"),
        "documents_completed": per_batch(s, "documents_completed"),
        "tokenizer_ms": round(tokenizer_ms, 1), "fill_threads": reg.threads,
    }
    if "greedy" in blocks:
        g = blocks["greedy"]
        res["greedy"] = {"mask_share": per_batch(g, "share"), "mask_us": per_batch(g, "mask"),
                         "step_us": per_batch(g, "step"),
                         "breakdown_us": {b: {k: v[k] for k in ("fill", "apply", "accept", "masked_step", "round")}
                                          for b, v in g.items()}}
    if checked:
        res["valid_detail"] = checked
    res["model"] = {"path": str(path), "hidden_size": cfg.hidden_size, "num_layers": cfg.num_layers,
                    "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size,
                    "backend": "torch (cpu)", "dtype": "float32"}
    res["workload"] = {"batches": list(batches), "prompt_tokens": PROMPT, "stagger_tokens_max": stagger,
                       "warmup_rounds": warmup, "schema_properties": len(SCHEMA["properties"]),
                       "valid_requests": requests, "valid_max_new_tokens": max_new, "quick": quick}
    res["repeats"] = repeats
    return system.finish(res, meter, t_start)


def _main(args: argparse.Namespace) -> int:
    kw: dict[str, Any] = dict(threads=args.threads, fill_threads=args.fill_threads, model=args.model,
                              greedy=not args.no_greedy)
    if args.quick:
        kw.update(quick=True, repeats=3, warmup=1, requests=2, stagger=20, batches=(1, 8))
    for name in ("repeats", "requests", "batches"):
        if getattr(args, name) is not None:
            kw[name] = tuple(args.batches) if name == "batches" else getattr(args, name)
    res = run(**kw)
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    print(f"vocab {res['vocab']}, compile {res['compile_ms']} ms per schema, valid {res['valid']}")
    for b, share in res["mask_share"].items():
        print(f"B{b:>3}: masking {res['mask_us'][b]:>9.1f} us of a {res['breakdown_us'][b]['round']:>10.1f} us "
              f"round ({100 * share:.2f}%); plain step {res['step_us'][b]:.1f} us")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("grammar", help="grammar masking's share of a decode step at vocab 32k",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the result as JSON only")
    p.add_argument("--quick", action="store_true", help="a smoke test: a 2-layer model, few rounds")
    p.add_argument("--repeats", type=int, default=None, help="measured rounds per batch (default 20)")
    p.add_argument("--requests", type=int, default=None, help="sampled requests checked for validity (default 16)")
    p.add_argument("--batches", type=int, nargs="+", default=None, help="default 1 8 32")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--fill-threads", type=int, default=None,
                   help="llguidance's mask-fill threads (default: 80%% of the CPUs; 1: in the caller's thread)")
    p.add_argument("--no-greedy", action="store_true", help="skip the greedy lanes' block")
    p.add_argument("--model", help="checkpoint directory with a tokenizer.json (default: SMALL at vocab 32k)")
    p.set_defaults(func=_main)
