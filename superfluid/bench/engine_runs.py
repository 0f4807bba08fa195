"""One measured run of our engine and of HF transformers on the same
prompts (bench engine's rows): prefill, then gen - 1 greedy decode steps,
`repeats` rounds, the median round's times. A shared machine's speed
wanders over minutes (here +-20%): HF's rounds run between ours (`between`),
so both see the same moments."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def profile_step(rt, feeds, specs, device: str) -> tuple[str, dict[str, Any]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        rt.step_sampled(feeds, specs)
        sync(device)
    avg = prof.key_averages()
    top = sorted(avg, key=lambda e: -e.self_cpu_time_total)[:25]
    ops = {e.key: {"self_cpu_us": round(e.self_cpu_time_total, 1), "count": e.count} for e in top}
    return avg.table(sort_by="self_cpu_time_total", row_limit=25), ops


def run_ours(path: Path, prompts: np.ndarray, gen: int, invariant: bool, *, dtype: torch.dtype, device: str,
          backend: str, profile: bool = False, repeats: int = 1,
          between: Callable[[], Any] | None = None) -> dict[str, Any]:
    """Our prefill and gen - 1 decode steps, `repeats` times on fresh
    sequences: the median round's times (the machine's noise only slows a
    round), the first round's tokens (every round's must be the same).
    `between`: run after each round, untimed (a baseline's round)."""
    from superfluid.engine import Feed, SampleSpec, load

    b, p = prompts.shape
    rt = load(path, backend, device=device, dtype=dtype, kv_cells=b * (p + gen + 17) + 64 * 16,
              max_batch=max(64, b), invariant=invariant, prefill_step_tokens=0)
    greedy = [SampleSpec()] * b
    # Warm-up. On the GPU at the full batch: kernels compile per shape.
    warm_rows = prompts if device == "cuda" else prompts[:1, :8]
    warm = [rt.seq_create() for _ in warm_rows]
    toks = rt.step_sampled([Feed(s, r.tolist(), True) for s, r in zip(warm, warm_rows)], greedy[:len(warm)])
    for _ in range(2 if device == "cuda" else 0):
        toks = rt.step_sampled([Feed(s, [t], True) for s, t in zip(warm, toks)], greedy[:len(warm)])
    for s in warm:
        rt.seq_free(s)
    stack = getattr(getattr(rt, "model", None), "stack", None)
    rounds: list[tuple[float, float, float | None]] = []
    first: np.ndarray | None = None
    repeats = max(1, repeats)
    for r in range(repeats):
        seqs = [rt.seq_create() for _ in range(b)]
        sync(device)
        t0 = time.perf_counter()
        toks = rt.step_sampled([Feed(s, row.tolist(), True) for s, row in zip(seqs, prompts)], greedy)
        sync(device)
        t1 = time.perf_counter()
        out = [toks]
        kernel0 = stack.kernel_s if stack is not None else 0.0
        for _ in range(gen - 1):
            toks = rt.step_sampled([Feed(s, [t], True) for s, t in zip(seqs, toks)], greedy)
            out.append(toks)
        sync(device)
        t2 = time.perf_counter()
        rounds.append((t1 - t0, t2 - t1, None if stack is None else stack.kernel_s - kernel0))
        got = np.array(out).T
        if first is None:
            first = got
        elif not np.array_equal(got, first):
            raise RuntimeError(f"bench: round {r} of batch {b} decoded other tokens than round 0 (not deterministic)")
        if profile and r == repeats - 1:
            res_profile = profile_step(rt, [Feed(s, [t], True) for s, t in zip(seqs, toks)], greedy, device)
        for s in seqs:
            rt.seq_free(s)
        if between is not None:
            between()
    mid = sorted(rounds, key=lambda x: x[1])[len(rounds) // 2]  # the median decode's round
    res: dict[str, Any] = {"prefill_s": float(np.median([x[0] for x in rounds])), "decode_s": mid[1],
                           "kernel_s": mid[2], "tokens": first, "numeric_class": rt.desc.numeric_class,
                           "isa": rt.desc.isa}
    if profile:
        res["profile"] = res_profile
    rt.close()
    return res


def load_hf(path: Path, dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


class HfRounds:
    """HF's prefill (a forward keeping the last position's logits, as
    generate's) and decode (generate(gen) less generate(1)), one round a
    call; `result` gives the medians."""

    def __init__(self, model, prompts: np.ndarray, gen: int, device: str):
        self.model, self.gen, self.device = model, gen, device
        self.ids = torch.from_numpy(prompts).long().to(device)
        self.mask = torch.ones_like(self.ids)
        self.kw = dict(attention_mask=self.mask, do_sample=False, pad_token_id=0)
        self.prefills: list[float] = []
        self.decodes: list[float] = []
        self.out: torch.Tensor | None = None
        with torch.inference_mode():
            model.generate(self.ids[:, :8], max_new_tokens=2, **{**self.kw, "attention_mask": self.mask[:, :8]})

    def round(self) -> None:
        model, ids, kw, gen = self.model, self.ids, self.kw, self.gen
        with torch.inference_mode():
            sync(self.device)
            t0 = time.perf_counter()
            # The prefill generate runs: logits for the last position only (as ours); a forward
            # with every position's logits does the LM head prompt-length times over (~1.6x here).
            logits = model(ids, attention_mask=self.mask, logits_to_keep=1).logits
            sync(self.device)
            self.prefills.append(time.perf_counter() - t0)
            if logits.shape[1] != 1:  # (a transformers that ignores the option: the comparison would be off)
                raise RuntimeError(f"HF's forward kept {logits.shape[1]} positions' logits, not the last one's")
            # Decode: generate(gen) less generate(1), which is the prefill and its first token. A few
            # short decode steps can drown in the noise of a loaded machine: measure again then.
            for _ in range(3):
                t1 = time.perf_counter()
                model.generate(ids, max_new_tokens=1, **kw)
                sync(self.device)
                t2 = time.perf_counter()
                self.out = model.generate(ids, max_new_tokens=gen, min_new_tokens=gen, **kw).cpu()
                t3 = time.perf_counter()
                if (t3 - t2) - (t2 - t1) > 0:
                    break
            self.decodes.append(max(1e-9, (t3 - t2) - (t2 - t1)))

    def result(self) -> dict[str, Any]:
        if self.out is None:
            self.round()
        assert self.out is not None
        return {"prefill_s": float(np.median(self.prefills)), "decode_s": float(np.median(self.decodes)),
                "tokens": self.out[:, self.ids.shape[1]:].numpy()}
