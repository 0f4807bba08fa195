"""`superfluid demo`: the daemon, a mixed workload, a worker killed and recovered.

It starts a daemon on the embedded tiny model (written from a seed; nothing
is downloaded), drives a mixed workload through the reference planner —
shared system prompts, greedy, sampled and host-sampled lanes, and lanes
whose output a JSON schema constrains (llguidance); the greedy lanes draft
by prompt lookup (speculation, which never changes a token) — once
uninterrupted and once with the worker killed (SIGKILL) mid-run, checks that
every request's tokens are the same bitwise, prints a summary, and shuts
everything down.

--arch mamba2 runs it on an embedded tiny Mamba2 model instead. Its runtime
is exact_only (a recurrent state cannot be cut back to any length), so it
cannot verify drafts: the demo installs no strategy there and says so.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import sys
import threading
import time
from typing import Any

from superfluid.abi import Sampling
from superfluid.abi.records import SamplingParams
from superfluid.rings.naming import shm_dir

SYSTEM_PROMPTS = (
    "You are a careful assistant. Answer briefly and cite the spec section. ",
    "System: you summarise log files for an on-call engineer. Keep it short. ",
    "You translate planner traces into plain words for a newcomer to the ABI. ",
)
QUESTIONS = (
    "What does a rejected plan change?", "Why count generations in a ring?", "When does a lane finish?",
    "What is forward-once?", "How does recovery replay tokens?", "Who owns the KV cells?",
    "What is a shed entry?", "Why pad GEMM rows?",
)


# One class of the demo's requests answers in this shape, whatever the model.
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer", "confidence", "section"],
          "properties": {"answer": {"type": "string", "maxLength": 12},
                         "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
                         "section": {"enum": ["3", "4", "5", "6", "9", "10"]}}}


def _valid(tokens: list[int]) -> dict | None:
    """The parsed answer if it is the schema's shape (the checks the schema states)."""
    try:
        v = json.loads(bytes(t for t in tokens if t < 256).decode())
    except ValueError:
        return None
    props = SCHEMA["properties"]
    ok = (isinstance(v, dict) and set(v) == set(SCHEMA["required"]) and isinstance(v["answer"], str)
          and len(v["answer"]) <= props["answer"]["maxLength"] and type(v["confidence"]) is int
          and 0 <= v["confidence"] <= 100 and v["section"] in props["section"]["enum"])
    return v if ok else None


def _tokens(text: str, vocab: int) -> list[int]:
    # The tiny model's tokenizer is byte-level: ids 0..255 are the bytes.
    return [b % vocab for b in text.encode()]


def workload(vocab: int, n: int, seed: int = 7) -> list[dict[str, Any]]:
    """The demo's requests: (system prompt + question) x sampling modes."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = _tokens(SYSTEM_PROMPTS[i % len(SYSTEM_PROMPTS)] + QUESTIONS[rng.randrange(len(QUESTIONS))], vocab)
        json_lane = i % 4 == 3
        mode = Sampling.GPU_SAMPLE if json_lane else (Sampling.GPU_GREEDY, Sampling.GPU_SAMPLE, Sampling.HOST)[i % 3]
        params = SamplingParams() if mode == Sampling.GPU_GREEDY else SamplingParams(
            temperature=0.8, top_k=40, top_p=0.95, min_p=0.02)
        out.append(dict(prompt=prompt, max_new_tokens=96 if json_lane else rng.randrange(24, 64), sampling=mode,
                        params=params, rng_base=1000 * (i + 1),
                        grammar=("json_schema", json.dumps(SCHEMA)) if json_lane else None,
                        speculate=mode == Sampling.GPU_GREEDY and not json_lane))
    return out


def _host_sampler(params: SamplingParams):
    from superfluid.kernels.reference_sampler import sample

    def pick(row, position: int) -> int:
        # The client samples with the same generator the engine uses.
        return sample(row, params.temperature, params.top_k, params.top_p, params.min_p, position)

    return pick


class _Progress:
    def __init__(self, total: int, label: str, out=None):
        out = sys.stderr if out is None else out  # (at call time: whatever stderr is now)
        self.total, self.label, self.out = total, label, out
        self.tty = out.isatty()
        self.last = 0.0

    def show(self, done: int, tokens: int, tok_s: float, restarts: int, final: bool = False) -> None:
        now = time.monotonic()
        if not final and now - self.last < 0.1:
            return
        self.last = now
        width = 30
        filled = int(width * done / max(1, self.total))
        line = (f"{self.label:<14} [{'#' * filled}{'.' * (width - filled)}] {done:>3}/{self.total} requests "
                f"{tokens:>6} tokens {tok_s:7.1f} tok/s  restarts {restarts}")
        if self.tty:
            self.out.write("\r" + line + ("\n" if final else ""))
        elif final:
            self.out.write(line + "\n")
        self.out.flush()


def _drafts(client) -> bool:
    """Whether the worker's runtime can verify drafts: an exact_only one cannot
    truncate a rejected draft away (INSTALL_STRATEGY answers Unsupported)."""
    return not client.describe()["runtime"].get("exact_only", False)


def _run(name: str, reqs: list[dict[str, Any]], label: str, kill_after_tokens: int | None, daemon, *,
         budget: int, grant: int) -> tuple[dict[int, list[int]], Any, list[str], bool]:
    """Each request's tokens, the planner's report, what happened, and whether lanes drafted."""
    from superfluid.client import Client
    from superfluid.client.planner import Planner
    from superfluid.client.strategies import Strategy

    notes: list[str] = []
    with Client.connect(name, 0, timeout=120) as client:
        drafts = _drafts(client)
        planner = Planner(client, prefill_token_budget=budget, decode_grant=grant,
                          strategy=Strategy() if drafts else None)
        ids = []
        for r in reqs:
            host = _host_sampler(r["params"]) if r["sampling"] == Sampling.HOST else None
            ids.append(planner.submit(r["prompt"], r["max_new_tokens"], r["sampling"], params=r["params"],
                                      rng_base=r["rng_base"], host_sampler=host, grammar=r["grammar"],
                                      speculate=r["speculate"] and drafts))
        bar = _Progress(len(ids), label)
        start = time.monotonic()
        killed = False
        while planner.busy():
            planner.step(60)
            rep = planner.report()
            done = sum(1 for x in rep.results.values() if x.finish is not None)
            tokens = sum(len(x.tokens) for x in rep.results.values())
            bar.show(done, tokens, tokens / max(1e-9, time.monotonic() - start), planner.stats.restarts)
            if kill_after_tokens is not None and not killed and tokens >= kill_after_tokens:
                pid = daemon.worker_pid(0)
                os.kill(pid, signal.SIGKILL)
                killed = True
                notes.append(f"killed worker 0 (pid {pid}) with SIGKILL after {tokens} tokens")
        report = planner.report()
        bar.show(len(ids), report.stats.tokens, report.stats.tokens / max(1e-9, time.monotonic() - start),
                 report.stats.restarts, final=True)
        report.stats.wall_s = time.monotonic() - start
        report.stats.tokens_per_s = report.stats.tokens / max(1e-9, report.stats.wall_s)
    return {i: report.results[rid].tokens for i, rid in enumerate(ids)}, report, notes, drafts


def _table(rows: list[tuple[str, str]]) -> str:
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{w}}  {v}" for k, v in rows)


def run(*, requests: int = 24, model: str | None = None, arch: str = "llama", backend: str = "torch",
        seed: int = 7, budget: int = 256, grant: int = 8, out=sys.stdout) -> int:
    from superfluid.daemon.supervisor import Daemon
    from superfluid.daemon.worker import model_vocab
    from superfluid.engine.checkpoint import model_type
    from superfluid.engine.tiny import default_model_dir
    from superfluid.rings.layout import SegmentConfig

    model_dir = model or str(default_model_dir(arch))
    vocab = model_vocab(model_dir)
    name = f"demo-{os.getpid()}"
    print(f"superfluid demo: model {model_dir} ({model_type(model_dir)}, {backend}), {requests} requests, "
          f"daemon '{name}'", file=out)
    cfg = SegmentConfig(logits_floats=max(1 << 20, 2 * 64 * vocab))
    daemon = Daemon(name, ["--model", model_dir, "--backend", backend], workers=1, segment_config=cfg,
                    restart_backoff=0.2, handle_signals=False)
    daemon.start()
    loop = threading.Thread(target=daemon.serve_forever, name="daemon", daemon=True)
    loop.start()
    try:
        reqs = workload(vocab, requests, seed)
        first, base, _, _ = _run(name, reqs, "uninterrupted", None, daemon, budget=budget, grant=grant)
        total = sum(len(t) for t in first.values())
        second, rep, notes, drafts = _run(name, reqs, "with a kill", max(1, total * 2 // 5), daemon,
                                          budget=budget, grant=grant)
    finally:
        daemon.stop()
        loop.join(30)
    for n in notes:
        print(f"  {n}; the daemon restarted it, the planner re-admitted every lane with its replay", file=out)
    same = [i for i in first if first[i] == second[i]]
    s = rep.stats
    by_mode = {m: sum(1 for r in reqs if r["sampling"] == m and not r["grammar"]) for m in Sampling}
    schema_lanes = [i for i, r in enumerate(reqs) if r["grammar"]]
    answers = [_valid(second[i]) for i in schema_lanes]
    print("\nsummary (the run with the kill):", file=out)
    print(_table([
        ("requests", f"{len(reqs)} ({by_mode[Sampling.GPU_GREEDY]} greedy, {by_mode[Sampling.GPU_SAMPLE]} sampled, "
                     f"{by_mode[Sampling.HOST]} host-sampled, {len(schema_lanes)} under a JSON schema; "
                     f"{len(SYSTEM_PROMPTS)} shared system prompts)"),
        ("tokens", f"{s.tokens}"),
        ("tokens/s", f"{s.tokens_per_s:.1f} (uninterrupted: {base.stats.tokens_per_s:.1f})"),
        ("TTFT p50 / p99", f"{1e3 * (s.ttft_p50_s or 0):.1f} ms / {1e3 * (s.ttft_p99_s or 0):.1f} ms"),
        ("cache hit tokens", f"{s.seeded_tokens} prompt tokens seeded by {s.leases} leases, not prefilled "
                             f"(uninterrupted: {base.stats.seeded_tokens})"
                             + ("" if drafts else "; exact_only: a lease takes only a whole entry (a published "
                                "turn, or a >= 128-token prompt's checkpoint), and these prompts share just "
                                "their system prompts")),
        ("sheds", f"{s.prefill_chunks_shed} prefill chunks ({s.prefill_tokens_shed} tokens), {s.evictions} evictions"),
        ("speculation", f"{sum(r['speculate'] for r in reqs)} greedy lanes drafting: {s.draft_accepted} of "
                        f"{s.draft_proposed} draft tokens taken" if drafts else
                        "skipped: the runtime is exact_only, it cannot cut a rejected draft back "
                        "(INSTALL_STRATEGY: Unsupported); greedy lanes decode without drafts"),
        ("restarts", f"{s.restarts}"),
        ("recovered == uninterrupted", f"{len(same)}/{len(first)} requests bitwise equal"),
        ("JSON-schema answers", f"{sum(a is not None for a in answers)}/{len(answers)} valid"
                                + (f", e.g. {json.dumps(answers[0])}" if answers and answers[0] else "")),
    ]), file=out)
    ok = len(same) == len(first) and s.restarts >= 1 and all(a is not None for a in answers)
    leftover = [f for f in os.listdir(shm_dir())
                if f.startswith(f"superfluid.{name}.")]
    print(f"\n{'OK' if ok else 'MISMATCH'}: daemon stopped, {len(leftover)} segment(s) left behind", file=out)
    return 0 if ok and not leftover else 1


def _main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    return run(requests=args.requests, model=args.model, arch=args.arch, backend=args.backend, seed=args.seed)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="daemon + mixed workload + a killed worker, recovered bitwise",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--model", help="checkpoint directory (default: the embedded tiny model of --arch)")
    p.add_argument("--arch", choices=("llama", "mamba2"), default="llama",
                   help="the embedded tiny model: llama (default) or mamba2 (exact_only: no drafting)")
    p.add_argument("--backend", choices=("torch", "triton"), default="torch")
    p.add_argument("--seed", type=int, default=7)
    p.set_defaults(func=_main)
