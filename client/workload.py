"""`superfluid plan`: run a workload (JSON) through the reference Planner
against a live daemon and print what came back (JSON).

The Rust and Go planners (client/rust, client/go) read the same workload
and print the same results, so any two can be compared token for token on
one daemon. The format:

    {"options": {"prefill_token_budget": 512, "prefill_chunk": null,
                 "decode_grant": 4, "max_lanes": null, "use_leases": true,
                 "strategy": null | {"max_draft": 8, "ngram_min": 1, "ngram_max": 4}},
     "requests": [{"prompt": [5, 6, 7], "max_new_tokens": 12,
                   "sampling": "greedy" | "sample" | "host",
                   "host_sampler": "argmax" | "perturb",      (host only)
                   "params": {"temperature": 0.9, "top_k": 50, "top_p": 0.9,
                              "min_p": 0, "repeat_penalty": 0,
                              "presence_penalty": 0, "freq_penalty": 0},
                   "rng_base": 0, "stop_at_eos": true, "publish": true,
                   "grammar": {"kind": "json_schema" | "regex" | "lark" | "gbnf",
                               "text": "..."} | {"kind": "choice",
                               "choices": ["a", "b"]},                 (not with host)
                   "speculate": true}],           (with the options' strategy)
     "kill_worker_after_tokens": null}

Every key but "prompt" and "max_new_tokens" may be left out (the values
above are the defaults; params default to all off). kill_worker_after_tokens
N: once the requests hold N tokens, SIGKILL the worker (a fault-injection
run: the daemon restarts it and the planner recovers).

Results: {"results": [{"id": 1, "tokens": [...], "finish": "eos" |
"grammar" | "length" | "max_tokens" | "unservable" | "fault", "admissions": 1}, ...] (in request
order), "stats": {"ticks", "restarts", "seeded_tokens", "leases", "tokens",
"killed", "draft_proposed", "draft_accepted"}}. A strategy is prompt lookup
(client.strategies.Strategy): drafting never changes a token, so results
with and without it are equal.

Host samplers are defined exactly, so every language draws the same token:
argmax is the first index of the largest value; perturb is the argmax of
row[i] + PERTURB_SCALE * u(position, i) in float32, where u is the top 24
bits of splitmix64(position * 2^32 + i) over 2^24 (the sum is one correctly
rounded float32 add, the same everywhere).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from typing import Any

import numpy as np

from superfluid.client.builder import sampling_params
from superfluid.client.client import Client
from superfluid.client.planner import GPU_GREEDY, GPU_SAMPLE, HOST, Planner
from superfluid.client.strategies import Strategy

PERTURB_SCALE = np.float32(2.0)
_M64 = (1 << 64) - 1
_SAMPLING = {"greedy": GPU_GREEDY, "sample": GPU_SAMPLE, "host": HOST}
_PARAMS = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "presence_penalty", "freq_penalty")
_OPTIONS = {"prefill_token_budget": 512, "prefill_chunk": None, "decode_grant": 4, "max_lanes": None,
            "use_leases": True, "strategy": None}
_STRATEGY = ("max_draft", "ngram_min", "ngram_max")


def _splitmix64(x: np.ndarray) -> np.ndarray:
    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def host_argmax(row: np.ndarray, position: int) -> int:
    return int(np.argmax(row))


def host_perturb(row: np.ndarray, position: int) -> int:
    i = np.arange(len(row), dtype=np.uint64)
    with np.errstate(over="ignore"):
        bits = _splitmix64(np.uint64((position << 32) & _M64) + i) >> np.uint64(40)
    u = bits.astype(np.float32) / np.float32(1 << 24)  # exact: 24-bit integers, a power of two
    return int(np.argmax(row.astype(np.float32) + PERTURB_SCALE * u))


HOST_SAMPLERS = {"argmax": host_argmax, "perturb": host_perturb}


def _field(d: dict, key: str, where: str, default: Any = ...) -> Any:
    if key not in d:
        if default is ...:
            raise ValueError(f"{where}.{key} is missing")
        return default
    return d[key]


def load(workload: dict) -> tuple[dict, list[dict]]:
    """The options and the requests as Planner.submit's arguments; a bad
    workload is a ValueError naming the field."""
    if not isinstance(workload, dict):
        raise ValueError("a workload is a JSON object")
    opts = dict(_OPTIONS)
    for k, v in (workload.get("options") or {}).items():
        if k not in _OPTIONS:
            raise ValueError(f"options.{k}: not an option ({', '.join(_OPTIONS)})")
        opts[k] = v
    if opts["strategy"] is not None:
        st = opts["strategy"]
        if not isinstance(st, dict) or set(st) - set(_STRATEGY):
            raise ValueError(f"options.strategy: an object of {', '.join(_STRATEGY)}")
        opts["strategy"] = Strategy(**{k: int(v) for k, v in st.items()})
    reqs = []
    for n, r in enumerate(_field(workload, "requests", "workload")):
        where = f"requests[{n}]"
        sampling = _field(r, "sampling", where, "greedy")
        if sampling not in _SAMPLING:
            raise ValueError(f"{where}.sampling = {sampling!r}: one of {', '.join(_SAMPLING)}")
        params = r.get("params") or {}
        unknown = set(params) - set(_PARAMS)
        if unknown:
            raise ValueError(f"{where}.params.{sorted(unknown)[0]}: not a sampling parameter")
        host = None
        if sampling == "host":
            name = _field(r, "host_sampler", where, "argmax")
            if name not in HOST_SAMPLERS:
                raise ValueError(f"{where}.host_sampler = {name!r}: one of {', '.join(HOST_SAMPLERS)}")
            host = HOST_SAMPLERS[name]
        grammar = None
        g = r.get("grammar")
        if g is not None:
            if not isinstance(g, dict) or "kind" not in g:
                raise ValueError(f"{where}.grammar: an object with kind and text (or choices)")
            grammar = (g["kind"], _field(g, "choices" if g["kind"] == "choice" else "text", f"{where}.grammar"))
            if sampling == "host":
                raise ValueError(f"{where}.grammar: not with host sampling")
        reqs.append(dict(prompt_tokens=[int(t) for t in _field(r, "prompt", where)],
                         max_new_tokens=int(_field(r, "max_new_tokens", where)), sampling=_SAMPLING[sampling],
                         params=sampling_params(**{k: params[k] for k in params}),
                         rng_base=int(r.get("rng_base", 0)) & _M64, publish=bool(r.get("publish", True)),
                         host_sampler=host, stop_at_eos=bool(r.get("stop_at_eos", True)), grammar=grammar,
                         speculate=bool(r.get("speculate", True))))
    return opts, reqs


def run(client: Client, workload: dict, timeout: float = 300.0) -> dict:
    """Run `workload` on a connected client; the results (module docstring)."""
    opts, reqs = load(workload)
    kill_at = workload.get("kill_worker_after_tokens")
    planner = Planner(client, reconnect_timeout=timeout, **opts)
    ids = [planner.submit(**r) for r in reqs]
    killed = False
    deadline = time.monotonic() + timeout
    while planner.busy():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the workload is still running after {timeout}s")
        planner.step(planner.tick_timeout)
        pid = int(client.seg.header.worker_pid)  # 0 while the daemon starts one: kill(0) would hit our group
        if kill_at is not None and not killed and pid > 0 and \
                sum(len(r.generated) for r in planner.requests.values()) >= kill_at:
            os.kill(pid, signal.SIGKILL)
            killed = True
    rep = planner.report()
    s = rep.stats
    return {"results": [{"id": i, "tokens": rep.results[i].tokens, "finish": rep.results[i].finish,
                         "admissions": rep.results[i].admissions} for i in ids],
            "stats": {"ticks": s.ticks, "restarts": s.restarts, "seeded_tokens": s.seeded_tokens, "leases": s.leases,
                      "tokens": s.tokens, "killed": killed, "draft_proposed": s.draft_proposed,
                      "draft_accepted": s.draft_accepted}}


def main(args: argparse.Namespace) -> int:
    try:
        with open(args.workload) if args.workload != "-" else sys.stdin as f:
            workload = json.load(f)
        load(workload)
    except (OSError, ValueError) as e:
        print(f"superfluid plan: {args.workload}: {e}", file=sys.stderr)
        return 2
    with Client.connect(args.name, args.worker, timeout=args.timeout) as client:
        out = run(client, workload, args.timeout)
    print(json.dumps(out))
    return 0


def register(sub) -> None:
    p = sub.add_parser("plan", help="run a workload (JSON) through the reference planner", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("workload", help="the workload's JSON file ('-': stdin)")
    p.add_argument("--name", default="superfluid", help="the daemon's --name")
    p.add_argument("--worker", type=int, default=0, help="the worker's index")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds for the whole workload")
    p.set_defaults(func=main)

