"""`superfluid bench e2e`: requests end to end, three ways, in one run.

The same workload (greedy requests of mixed prompt and output lengths) goes
(1) through a daemon worker over shared memory, driven by the reference
planner; (2) through the same planner and an executor in this process (what
the process split costs is the difference); (3) through HF transformers
`generate` on the same weights, batched like the planner's lanes, on the
first --hf-requests requests (it is far slower).
Paths (1) and (2) are up at once and take turns, `repeats` runs each (the
order swapped every repeat, so drift in the machine's load hits both alike),
after an untimed warm-up (128 requests: the batch fills, so its shapes are
paid for before the first timed run); every run starts from an empty prefix
cache, and every BLOCK repeats both paths start over in fresh processes (a
process's speed at the same ticks varies a few percent with where its
memory landed). Each path reports its median run; `daemon_to_inproc_paired` is
the median of each repeat's back-to-back ratio (`paired_quartiles` its
spread). Repeats go on past `repeats` (in pairs, up to ~4x) until each path
has `min_seconds` of timed runs (default 40: 512 requests take 2-4 s a run
on 2 cores, and on a shared VM single runs vary by 10-15%, so a median
wants a dozen pairs); `paired_ci90` bootstraps the paired median's 90%
interval; `daemon_to_inproc_total` is all timed runs at once (each path's
tokens over its seconds), steadier than either median. Less noisy than the
ratios, and why they are what they are: `split_cost_us_per_tick`, the time a
tick costs outside the executor's tick through the daemon less in process
(queues, codec, wake-ups), and `tick_time_daemon_to_inproc`, the ticks
themselves. The in-process executor runs under the worker's thread layout
(daemon/worker.py thread_layout). --quick is a smoke test, not a number.
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

from superfluid.daemon.worker import thread_layout


def _workload(n: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, vocab, int(rng.integers(32, 160))).tolist(), int(rng.integers(24, 72)))
            for _ in range(n)]


def _drive(client, reqs, *, budget: int, grant: int) -> dict[str, Any]:
    from superfluid.client.planner import Planner

    client.op("CACHE_CLEAR")  # every run starts from an empty prefix cache (the last run's retires published)
    planner = Planner(client, prefill_token_budget=budget, decode_grant=grant)
    ids = [planner.submit(p, m, stop_at_eos=False) for p, m in reqs]
    t0 = time.perf_counter()
    rep = planner.run_until_done(1800)
    wall = time.perf_counter() - t0
    toks = sum(len(rep.results[i].tokens) for i in ids)
    ttft = sorted(1e3 * rep.results[i].ttft_s for i in ids if rep.results[i].ttft_s is not None)
    ticks = max(1, rep.stats.ticks)
    return {"tok_s": toks / wall, "tokens": toks, "wall_s": wall, "ttft": ttft, "tick_s": rep.stats.tick_s,
            # what a tick costs outside the executor's tick: planning, and across processes the queues
            "outside_us": 1e6 * (wall - rep.stats.tick_s) / ticks,
            "outputs": [rep.results[i].tokens for i in ids]}


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    return round(xs[min(len(xs) - 1, int(np.ceil(q / 100 * len(xs))) - 1)], 2)


def _ci90(paired: list[float], draws: int = 2000) -> list[float]:
    """A 90% bootstrap interval of the paired ratios' median (a fixed seed:
    the same runs give the same interval)."""
    x = np.asarray(paired, dtype=np.float64)
    meds = np.median(x[np.random.default_rng(0).integers(0, len(x), (draws, len(x)))], axis=1)
    return [round(float(q), 3) for q in np.percentile(meds, [5, 95])]


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return sorted(runs, key=lambda r: r["tok_s"])[len(runs) // 2]


def _daemon(model: str, worker_args: list[str], n: int = 0, tag: str = ""):
    """A daemon with one worker (its supervisor on a thread here) and a
    Client to it; close() ends both."""
    from superfluid.client import Client
    from superfluid.daemon.supervisor import Daemon

    name = f"e2e-{os.getpid()}-{n}{tag}"
    d = Daemon(name, ["--model", model, *worker_args], workers=1, handle_signals=False)
    d.start()
    loop = threading.Thread(target=d.serve_forever, daemon=True)
    loop.start()

    def close() -> None:
        d.stop()
        loop.join(60)

    try:
        return Client.connect(name, 0, timeout=300), close
    except BaseException:
        close()
        raise


def _paths(model: str, reqs, *, budget: int, grant: int, repeats: int, warmup: int, worker_args: list[str],
           min_seconds: float = 0.0, record: str | None = None) -> tuple[dict[str, dict[str, Any]], list[float]]:
    """Each path's median run and each repeat's paired daemon/in-process
    ratio (_both), the in-process executor under the worker's thread layout."""
    from superfluid.client.local import LocalClient
    from superfluid.engine import load
    from superfluid.executor import Executor
    from superfluid.kernels import cpu

    # The worker's thread layout here too, so the two paths differ in the process split alone.
    before = (torch.get_num_threads(), cpu._threads_set)
    thread_layout(_layout_args(model, worker_args))
    try:
        backend = _flag(worker_args, "--backend", "torch")
        return _both(model, reqs, budget=budget, grant=grant, repeats=repeats, warmup=warmup,
                     worker_args=worker_args, min_seconds=min_seconds,
                     local=lambda: LocalClient(Executor(load(model, backend))), record=record)
    finally:
        cpu.restore_threads(before)


def _flag(args: list[str], name: str, default: str) -> str:
    return args[args.index(name) + 1] if name in args[:-1] else default


def _layout_args(model: str, worker_args: list[str]) -> argparse.Namespace:
    """What thread_layout reads of a worker's arguments."""
    return argparse.Namespace(fake="--fake" in worker_args, model=model,
                              backend=_flag(worker_args, "--backend", "torch"),
                              threads=int(_flag(worker_args, "--threads", "0")))


def threads_now() -> dict[str, int]:
    from superfluid.kernels import cpu

    return {"torch": torch.get_num_threads(), "kernels": cpu.threads()}


# Repeats (one of each order) a worker process and an in-process executor serve
# before fresh ones take over: how fast a process runs the same ticks varies by
# a few percent with where its memory landed, so each path's runs span several.
BLOCK = 2


def _both(model: str, reqs, *, budget: int, grant: int, repeats: int, warmup: int, worker_args: list[str],
          min_seconds: float, local, record: str | None = None) -> tuple[dict[str, dict[str, Any]], list[float]]:
    """Both paths take turns, the order swapped every repeat, so drift in the
    machine's load hits both alike; every BLOCK repeats a fresh daemon worker
    and a fresh in-process executor (`local()`), each first running `warmup`
    requests untimed. With `record` a third path, a daemon whose worker keeps
    a flight record there (serve --record), takes its turn too (the order
    rotated every repeat)."""
    names = ("inproc", "daemon", "recorded") if record else ("inproc", "daemon")
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    r, least = 0, max(1, repeats)

    def more() -> bool:  # more runs wanted: too few, too little timed, or an extra pair half done
        short = (r - least) % 2 == 1 or min(sum(x["wall_s"] for x in rs) for rs in runs.values()) < min_seconds
        return r < least or (r < cap and short)

    # Extra repeats come in pairs, one of each order, so they do not tip which path goes first.
    cap = least + 2 * (3 * least // 2)
    while more():
        opened = [_daemon(model, worker_args, r)]
        try:
            paths = {"daemon": opened[0][0], "inproc": local()}
            if record:
                opened.append(_daemon(model, [*worker_args, "--record", record], r, "-rec"))
                paths["recorded"] = opened[1][0]
            for c in paths.values():
                _drive(c, reqs[:warmup], budget=budget, grant=grant)
            for _ in range(BLOCK):
                if not more():
                    break
                k = r % len(names)  # two paths: swapped every repeat; three: rotated
                order = names[k:] + names[:k]
                for name in order:
                    runs[name].append(_drive(paths[name], reqs, budget=budget, grant=grant))
                r += 1
        finally:
            for client, close in opened:
                client.close()
                close()
    out = {}
    for name, rs in runs.items():
        med = _median(rs)
        med["same_every_run"] = all(x["outputs"] == rs[0]["outputs"] for x in rs)
        med["runs_tok_s"] = [round(x["tok_s"], 1) for x in rs]
        med["runs_wall_s"] = [round(x["wall_s"], 2) for x in rs]
        med["total_tok_s"] = sum(x["tokens"] for x in rs) / sum(x["wall_s"] for x in rs)
        med["tick_s_median"] = float(np.median([x["tick_s"] for x in rs]))
        med["outside_us_median"] = float(np.median([x["outside_us"] for x in rs]))
        out[name] = med
    paired = [d["tok_s"] / i["tok_s"] for d, i in zip(runs["daemon"], runs["inproc"])]
    out["daemon"]["same_as_inproc"] = all(d["outputs"] == i["outputs"] for d, i in zip(runs["daemon"], runs["inproc"]))
    out["inproc"]["threads"] = threads_now()
    if record:
        out["recorded"]["paired"] = [x["tok_s"] / d["tok_s"] for x, d in zip(runs["recorded"], runs["daemon"])]
        out["recorded"]["same_as_daemon"] = all(x["outputs"] == d["outputs"]
                                                for x, d in zip(runs["recorded"], runs["daemon"]))
    return out, paired


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


def run(*, requests: int = 512, model: str | None = None, budget: int = 512, grant: int = 8, seed: int = 3,
        hf_batch: int = 8, hf_requests: int = 32, repeats: int = 5, warmup: int = 128,
        worker_args: list[str] | None = None, min_seconds: float = 40.0, record: str | None = None) -> dict[str, Any]:
    from superfluid.engine.config import load_config
    from superfluid.engine.tiny import default_model_dir

    model = model or str(default_model_dir())
    reqs = _workload(requests, load_config(model).vocab_size, seed)
    t0 = time.perf_counter()
    load_before = os.getloadavg()
    paths, paired = _paths(model, reqs, budget=budget, grant=grant, repeats=repeats,
                           warmup=min(warmup, requests), worker_args=list(worker_args or []),
                           min_seconds=min_seconds, record=record)
    daemon, inproc = paths["daemon"], paths["inproc"]
    load_after = os.getloadavg()
    hf = _hf(model, reqs[:max(1, min(hf_requests, requests))], hf_batch) if hf_requests else None
    return {
        "tok_s": round(daemon["tok_s"], 1),
        "inproc_tok_s": round(inproc["tok_s"], 1),
        "hf_tok_s": round(hf["tok_s"], 1) if hf else None,
        # The median daemon run over the median in-process run; and the median of each
        # repeat's pair (run back to back, so both saw the same load).
        "daemon_to_inproc": round(daemon["tok_s"] / inproc["tok_s"], 3),
        "daemon_to_inproc_paired": round(float(np.median(paired)), 3),
        "runs_daemon_to_inproc": [round(x, 3) for x in paired],
        "paired_quartiles": [round(float(q), 3) for q in np.percentile(paired, [25, 75])],
        "paired_ci90": _ci90(paired),
        # Every timed run at once: each path's tokens over its seconds (the steadiest of the three).
        "daemon_to_inproc_total": round(daemon["total_tok_s"] / inproc["total_tok_s"], 3),
        # Where the difference comes from, less noisy than the ratio: per tick, the time outside
        # the executor's ticks (the daemon's less the in-process one's: what the split costs), and
        # the ticks themselves (median run, daemon over in-process).
        "outside_us_per_tick": {"daemon": round(daemon["outside_us_median"], 1),
                                "inproc": round(inproc["outside_us_median"], 1)},
        "split_cost_us_per_tick": round(daemon["outside_us_median"] - inproc["outside_us_median"], 1),
        "tick_time_daemon_to_inproc": round(daemon["tick_s_median"] / inproc["tick_s_median"], 3),
        "ttft_ms": {"p50": _pct(daemon["ttft"], 50), "p99": _pct(daemon["ttft"], 99)},
        "inproc_ttft_ms": {"p50": _pct(inproc["ttft"], 50), "p99": _pct(inproc["ttft"], 99)},
        "hf_ttft_ms": {"p50": _pct(hf["ttft"], 50), "p99": _pct(hf["ttft"], 99)} if hf else None,
        "same_tokens_daemon_vs_inproc": daemon["same_as_inproc"],
        # Both paths' (the worker's own layout: daemon/worker.py thread_layout); HF runs at torch's count.
        "threads": inproc["threads"], "hf_threads": torch.get_num_threads(),
        "same_tokens_every_run": daemon["same_every_run"] and inproc["same_every_run"],
        "runs_tok_s": {"daemon": daemon["runs_tok_s"], "inproc": inproc["runs_tok_s"]},
        "runs_wall_s": {"daemon": daemon["runs_wall_s"], "inproc": inproc["runs_wall_s"]},
        "workload": {"requests": requests, "tokens": daemon["tokens"], "prefill_token_budget": budget,
                     "decode_grant": grant, "repeats": len(paired), "min_seconds": min_seconds,
                     "warmup_requests": min(warmup, requests),
                     "hf_requests": min(hf_requests, requests), "hf_batch": hf_batch, "model": model,
                     "sampling": "greedy", "worker_args": list(worker_args or [])},
        "loadavg_before": [round(x, 2) for x in load_before], "loadavg_after": [round(x, 2) for x in load_after],
        "python": platform.python_version(), "cpu_count": os.cpu_count(),
        "wall_s": round(time.perf_counter() - t0, 1),
        "recorded": _recorded(paths["recorded"], daemon, record) if record else None,
    }


def _recorded(rec: dict[str, Any], daemon: dict[str, Any], record: str) -> dict[str, Any]:
    """The daemon path again with its worker's flight recorder on (serve
    --record): its speed over the plain daemon's, paired run by run."""
    held = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(record) for f in fs)
    return {
        "tok_s": round(rec["tok_s"], 1),
        "recorded_to_daemon": round(rec["tok_s"] / daemon["tok_s"], 3),
        "recorded_to_daemon_paired": round(float(np.median(rec["paired"])), 3),
        "runs_recorded_to_daemon": [round(x, 3) for x in rec["paired"]],
        "paired_ci90": _ci90(rec["paired"]),
        "recorded_to_daemon_total": round(rec["total_tok_s"] / daemon["total_tok_s"], 3),
        "tick_time_recorded_to_daemon": round(rec["tick_s_median"] / daemon["tick_s_median"], 3),
        "runs_tok_s": rec["runs_tok_s"], "same_tokens_as_daemon": rec["same_as_daemon"],
        "record_dir": record, "record_bytes_held": held,
    }


def _main(args: argparse.Namespace) -> int:
    if args.quick:
        args.requests, args.repeats, args.hf_requests = args.requests or 8, args.repeats or 1, 4
        args.min_seconds = 0.0 if args.min_seconds is None else args.min_seconds
    res = run(requests=args.requests or 512, model=args.model, repeats=args.repeats or 5,
              min_seconds=40.0 if args.min_seconds is None else args.min_seconds,
              hf_requests=args.hf_requests, worker_args=args.worker_args.split() if args.worker_args else None,
              record=os.path.abspath(args.record) if args.record else None)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        hf = (f"HF generate {res['hf_tok_s']} tok/s ({res['workload']['hf_requests']} requests); "
              if res["hf_tok_s"] else "")
        print(f"daemon {res['tok_s']} tok/s, in-process {res['inproc_tok_s']} tok/s (ratio of medians "
              f"{res['daemon_to_inproc']}, all runs {res['daemon_to_inproc_total']}, "
              f"paired {res['runs_daemon_to_inproc']}), {hf}"
              f"TTFT p50 {res['ttft_ms']['p50']} ms, p99 {res['ttft_ms']['p99']} ms; "
              f"{res['workload']['tokens']} tokens a run, runs {res['runs_wall_s']} s; "
              f"load {res['loadavg_before']} -> {res['loadavg_after']}")
        if res["recorded"]:
            rec = res["recorded"]
            print(f"with --record: {rec['tok_s']} tok/s, recorded/daemon paired {rec['recorded_to_daemon_paired']} "
                  f"(90% CI {rec['paired_ci90']}, all runs {rec['recorded_to_daemon_total']}, runs "
                  f"{rec['runs_recorded_to_daemon']}); {rec['record_bytes_held']} bytes of record held")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("e2e", help="requests through the daemon vs in-process vs HF generate",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the result as JSON only")
    p.add_argument("--requests", type=int, default=None, help="requests a run (default 512; --quick: 8)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per path (default 5; --quick: 1)")
    p.add_argument("--min-seconds", type=float, default=None,
                   help="more runs (in pairs, up to 4x --repeats) until each path has this long timed "
                        "(default 40; --quick: 0)")
    p.add_argument("--hf-requests", type=int, default=32,
                   help="the first N requests also go through HF generate (default 32, 0 = skip HF)")
    p.add_argument("--quick", action="store_true", help="a few requests, one run each: a smoke test, not a number")
    p.add_argument("--worker-args", help="extra worker options for the daemon, e.g. '--threads 1'")
    p.add_argument("--model", help="checkpoint directory (default: the embedded tiny model)")
    p.add_argument("--record", metavar="DIR",
                   help="also run the daemon path with its worker's flight recorder on (serve --record DIR), "
                        "and report what it costs (docs/recorder.md)")
    p.set_defaults(func=_main)
