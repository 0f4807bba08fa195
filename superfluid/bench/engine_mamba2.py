"""`superfluid bench engine`'s Mamba2 rows: our Mamba2 runtime against HF's
Mamba2ForCausalLM on the same seeded weights, measured as bench/engine.py
measures the transformer.

At each batch size B: B prompts of P tokens prefilled in one step (every
feed wants its row; the first token is the row's argmax), then G-1 greedy
decode steps (Feed.decode: the recurrent update), argmax on the host (the
runtime does not sample). HF on CPU runs its torch path (no mamba_ssm or
causal_conv1d kernels): a forward over the prompts (prefill, last row only,
as generate and we compute it) and `generate` (decode = generate(G) less
generate(1)). fp32 only: the runtime computes in float32, and it has no
non-invariant path, so there is no invariance tax to report.

Our logits are checked against HF's while measuring (the timed generate
keeps its logits): the prefill row and the first CHECK_STEPS decode rows of
every lane whose greedy tokens so far are HF's; their max |difference| is
`logits_max_abs_diff` and `logits_agree` says it is within LOGITS_TOL at
every batch, so the speeds compared are of one computation.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

# The write_tiny_mamba2 shapes: TINY's size, and SMALL's hidden size, depth
# and vocabulary (heads * head_dim = 2 * hidden; ~46M parameters, 32.8M of
# them embedding + lm_head, as SMALL's).
TINY: dict[str, Any] = dict(vocab_size=320, hidden_size=64, state_size=16, num_heads=8, num_layers=2,
                            chunk_size=16)
SMALL: dict[str, Any] = dict(vocab_size=32000, hidden_size=512, state_size=64, num_heads=16, num_layers=8,
                             chunk_size=64)
LOGITS_TOL = 1e-4
CHECK_STEPS = 4
_KEYS = ("decode_tok_s", "hf_decode_tok_s", "prefill_tok_s", "hf_prefill_tok_s", "greedy_agreement",
         "achieved_gflops", "logits_max_abs_diff")


def decode_flops(cfg, batch: int, gen: int) -> float:
    """Model FLOPs of the G-1 decode steps at `batch`: 2 per matmul weight per
    token (in_proj, out_proj, lm_head) and per conv tap, plus the state
    update's 5 per state element (dA * h + dt * x * B, then C . h). No
    context term: a step's cost does not grow with the sequence."""
    in_proj = cfg.hidden_size * (2 * cfg.intermediate_size + 2 * cfg.n_groups * cfg.state_size
                                 + cfg.num_heads)
    per_layer = 2.0 * (in_proj + cfg.intermediate_size * cfg.hidden_size + cfg.conv_dim * cfg.conv_kernel) \
        + 5.0 * cfg.num_heads * cfg.head_dim * cfg.state_size
    per_token = cfg.num_layers * per_layer + 2.0 * cfg.hidden_size * cfg.vocab_size
    return batch * (gen - 1) * per_token


def _ours(path: Path, prompts: np.ndarray, gen: int) -> dict[str, Any]:
    from superfluid.engine import Feed, load

    b, _ = prompts.shape
    rt = load(path, "torch", device="cpu", max_seqs=b + 1, max_batch=max(64, b))
    warm = rt.seq_create()  # torch's first calls (a chunk and a decode step) are not the workload's
    row = rt.step([Feed(warm, prompts[0, :8].tolist(), True)])[0]
    rt.step([Feed(warm, [int(np.argmax(row))], True, True)])
    rt.seq_free(warm)
    seqs = [rt.seq_create() for _ in range(b)]
    t0 = time.perf_counter()
    rows = rt.step([Feed(s, r.tolist(), True) for s, r in zip(seqs, prompts)])
    toks = [int(np.argmax(r)) for r in rows]
    t1 = time.perf_counter()
    out, kept = [toks], [np.stack(rows)]
    for step in range(gen - 1):
        rows = rt.step([Feed(s, [t], True, True) for s, t in zip(seqs, toks)])
        toks = [int(np.argmax(r)) for r in rows]
        out.append(toks)
        if step < CHECK_STEPS:
            kept.append(np.stack(rows))
    t2 = time.perf_counter()
    rt.close()
    return {"prefill_s": t1 - t0, "decode_s": t2 - t1, "tokens": np.array(out).T, "logits": kept}


def hf_model(path: Path):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()  # its "falling back to the PyTorch implementation" notes
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _hf(model, prompts: np.ndarray, gen: int) -> dict[str, Any]:
    ids = torch.from_numpy(prompts).long()
    mask = torch.ones_like(ids)
    p = ids.shape[1]
    # No eos: generate runs all G tokens and may pick an eos as we do (min_new_tokens would ban it).
    kw = dict(attention_mask=mask, do_sample=False, pad_token_id=0, eos_token_id=[])
    with torch.inference_mode():
        model.generate(ids[:, :8], max_new_tokens=2, **{**kw, "attention_mask": mask[:, :8]})
        t0 = time.perf_counter()
        model(ids, attention_mask=mask, logits_to_keep=1)
        t1 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, **kw)
        t2 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=gen, output_logits=True,
                             return_dict_in_generate=True, **kw)
        t3 = time.perf_counter()
    logits = [x.float().numpy() for x in out.logits[:CHECK_STEPS + 1]]
    return {"prefill_s": t1 - t0, "decode_s": max(1e-9, (t3 - t2) - (t2 - t1)),
            "tokens": out.sequences[:, p:].numpy(), "logits": logits}


def logits_diff(ours: dict[str, Any], hf: dict[str, Any]) -> float:
    """Max |ours - HF| over the checked rows: step s's row of a lane counts
    while the lane's first s greedy tokens are HF's (after a near-tie flips
    one, the two continue different sequences)."""
    worst = 0.0
    for s, (a, b) in enumerate(zip(ours["logits"], hf["logits"])):
        same = (ours["tokens"][:, :s] == hf["tokens"][:, :s]).all(axis=1)
        if same.any():
            worst = max(worst, float(np.abs(a[same] - b[same]).max()))
    return worst


def rows(path: Path, prompt_sets: dict[int, np.ndarray], prompt_len: int, gen: int, *, log) -> dict[str, Any]:
    """The Mamba2 block: the transformer's keys per batch (no invariance tax)
    plus the logits check."""
    from superfluid.engine.mamba2 import Mamba2Config

    cfg = Mamba2Config.from_dict(json.loads((path / "config.json").read_text()))
    res: dict[str, Any] = {k: {} for k in _KEYS}
    model = hf_model(path)
    params = sum(p.numel() for p in model.parameters())  # a tied head counts once
    for b, prompts in prompt_sets.items():
        ours = _ours(path, prompts, gen)
        hf = _hf(model, prompts, gen)
        key = str(b)
        res["prefill_tok_s"][key] = round(b * prompt_len / ours["prefill_s"], 1)
        res["decode_tok_s"][key] = round(b * (gen - 1) / ours["decode_s"], 1)
        res["hf_prefill_tok_s"][key] = round(b * prompt_len / hf["prefill_s"], 1)
        res["hf_decode_tok_s"][key] = round(b * (gen - 1) / hf["decode_s"], 1)
        res["achieved_gflops"][key] = float(f"{decode_flops(cfg, b, gen) / ours['decode_s'] / 1e9:.4g}")
        res["greedy_agreement"][key] = round(float((ours["tokens"] == hf["tokens"]).mean()), 4)
        res["logits_max_abs_diff"][key] = float(f"{logits_diff(ours, hf):.3g}")
        log(f"mamba2 float32 batch {b}: decode {res['decode_tok_s'][key]} tok/s "
            f"(hf {res['hf_decode_tok_s'][key]}), "
            f"prefill {res['prefill_tok_s'][key]} tok/s (hf {res['hf_prefill_tok_s'][key]}), "
            f"{res['achieved_gflops'][key]} GF/s, logits vs hf {res['logits_max_abs_diff'][key]}")
    del model
    res["decode_speedup_vs_hf"] = {k: round(res["decode_tok_s"][k] / res["hf_decode_tok_s"][k], 3)
                                   for k in res["decode_tok_s"]}
    res["prefill_speedup_vs_hf"] = {k: round(res["prefill_tok_s"][k] / res["hf_prefill_tok_s"][k], 3)
                                    for k in res["prefill_tok_s"]}
    res["logits_agree"] = all(v <= LOGITS_TOL for v in res["logits_max_abs_diff"].values())
    res.update(arch="mamba2", dtype="float32", backend="torch", params=params, logits_tol=LOGITS_TOL,
               logits_checked_steps=min(gen, CHECK_STEPS + 1),
               hf_path="torch (no mamba_ssm / causal_conv1d kernels on CPU)")
    return res
