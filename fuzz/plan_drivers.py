"""Drivers of the plan fuzz target: the built-in loop, atheris, and the CLI
that `python -m superfluid.fuzz.plan_target` runs."""

from __future__ import annotations

import argparse
import hashlib
import inspect
import itertools
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from superfluid.abi.plan_codec import PlanReject
from superfluid.fuzz.plan_mutator import MAX_LEN, mutate, splice
from superfluid.fuzz.plan_target import fuzz_one_input, one_input, outcome_key, seed_corpus

# -------------------------------------------------------------- built-in loop


@dataclass(slots=True)
class Summary:
    runs: int = 0
    decoded: int = 0
    rejects: Counter[str] = field(default_factory=Counter)
    elapsed_s: float = 0.0
    corpus: int = 0
    outcomes: int = 0

    def as_dict(self) -> dict[str, object]:
        return {
            "runs": self.runs,
            "decoded": self.decoded,
            "rejects": dict(sorted(self.rejects.items())),
            "elapsed_s": round(self.elapsed_s, 3),
            "exec_per_s": round(self.runs / self.elapsed_s, 1) if self.elapsed_s > 0 else None,
            "corpus": self.corpus,
            "distinct_outcomes": self.outcomes,
        }


def _save(directory: str, data: bytes, prefix: str = "") -> str:
    path = os.path.join(directory, prefix + hashlib.sha1(data).hexdigest())
    if not os.path.exists(path):
        with open(path, "wb") as f:
            f.write(data)
    return path


def load_corpus(directory: str) -> list[bytes]:
    out = []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if os.path.isfile(path) and not name.startswith("crash-"):
            with open(path, "rb") as f:
                out.append(f.read())
    return out


def run_builtin(runs: int, seed: int = 0, corpus_dir: str | None = None, *, pool_cap: int = 512,
                artifact_dir: str | None = None) -> Summary:
    """Mutate from the seeds (and `corpus_dir`), keeping inputs whose outcome
    is new. A finding is written to `artifact_dir` (default: corpus_dir, else
    the current directory) and re-raised."""
    rng = random.Random(seed)
    pool = seed_corpus()
    if corpus_dir:
        os.makedirs(corpus_dir, exist_ok=True)
        pool += load_corpus(corpus_dir)
        for data in pool:
            _save(corpus_dir, data)
    seen: set[tuple] = set()
    for data in pool:
        seen.add(outcome_key(one_input(data)))
    summary = Summary()
    start = time.perf_counter()
    try:
        _loop(runs, rng, pool, seen, summary, corpus_dir, artifact_dir, pool_cap)
    except KeyboardInterrupt:
        if runs:
            raise
        # unbounded: Ctrl-C ends the run; the summary still prints
    summary.elapsed_s = time.perf_counter() - start
    summary.corpus = len(pool)
    summary.outcomes = len(seen)
    return summary


def _loop(runs: int, rng, pool: list, seen: set, summary: Summary, corpus_dir, artifact_dir, pool_cap: int) -> None:
    for _ in (itertools.count() if runs == 0 else range(runs)):  # 0: until interrupted
        data = mutate(rng.choice(pool), rng, pool)
        try:
            outcome = one_input(data)
        except BaseException:
            path = _save(artifact_dir or corpus_dir or os.getcwd(), data, "crash-")
            print(f"finding: input saved to {path}", file=sys.stderr)
            raise
        summary.runs += 1
        if isinstance(outcome, PlanReject):
            summary.rejects[outcome.status.name] += 1
        else:
            summary.decoded += 1
        key = outcome_key(outcome)
        if key not in seen:
            seen.add(key)
            if len(pool) < pool_cap:
                pool.append(data)
            else:
                pool[rng.randrange(len(pool))] = data
            if corpus_dir:
                _save(corpus_dir, data)


# ------------------------------------------------------------------ atheris


_INSTRUMENTED = ("superfluid.abi", "superfluid.engine")


def _instrument_decoder(atheris: Any) -> None:
    """Coverage for the decoder's own modules only: instrument_all() spends
    ~40 s on numpy and the rest, which has no Python branches worth steering."""
    for name, module in list(sys.modules.items()):
        if not name.startswith(_INSTRUMENTED):
            continue
        for obj in list(vars(module).values()):
            if inspect.isclass(obj) and obj.__module__ == name:
                fns = [f for f in vars(obj).values() if inspect.isfunction(f)]
            elif inspect.isfunction(obj) and obj.__module__ == name:
                fns = [obj]
            else:
                continue
            for fn in fns:
                atheris.instrument_func(fn)


def run_atheris(runs: int | None, seed: int | None, corpus_dir: str | None, extra: list[str]) -> None:
    try:
        import atheris  # type: ignore[import-not-found]
    except ImportError:
        sys.exit("--atheris needs the atheris module: pip install atheris "
                 "(or install the extra: pip install 'superfluid[fuzz]')")
    corpus_dir = corpus_dir or tempfile.mkdtemp(prefix="sf-plan-corpus-")
    os.makedirs(corpus_dir, exist_ok=True)
    seeds = seed_corpus()
    for data in seeds:
        _save(corpus_dir, data)

    def custom_mutator(data: bytes, max_size: int, mseed: int) -> bytes:
        rng = random.Random(mseed)
        if rng.random() < 0.2:  # libFuzzer's own byte mutations, with its CMP hints
            return atheris.Mutate(data, max_size)
        return mutate(data, rng, seeds, max_len=min(max_size, MAX_LEN))

    def custom_crossover(a: bytes, b: bytes, max_out_size: int, cseed: int) -> bytes:
        return splice(a, b, random.Random(cseed))[:max_out_size]

    argv = [sys.argv[0], *extra]
    if runs:  # libFuzzer's -runs=0 means none; ours means until interrupted
        argv.append(f"-runs={runs}")
    if seed is not None:
        argv.append(f"-seed={seed}")
    argv.append(corpus_dir)
    _instrument_decoder(atheris)
    atheris.Setup(argv, fuzz_one_input, custom_mutator=custom_mutator, custom_crossover=custom_crossover)
    atheris.Fuzz()


# ---------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m superfluid.fuzz.plan_target",
        description="Fuzz the plan decoder (decode_plan). Arguments after -- go to libFuzzer with --atheris.")
    parser.add_argument("--runs", type=int, default=None,
                        help="inputs to run, 0 = until interrupted (built-in default 10000; atheris default: "
                             "unbounded)")
    parser.add_argument("--seed", type=int, default=None, help="random seed (built-in default 0)")
    parser.add_argument("--atheris", action="store_true", help="run under atheris with the custom mutator")
    parser.add_argument("--corpus", metavar="DIR",
                        help="corpus directory: read as seeds, new inputs written to it")
    args, extra = parser.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    if args.atheris:
        run_atheris(args.runs, args.seed, args.corpus, extra)
        return
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    summary = run_builtin(10_000 if args.runs is None else args.runs, 0 if args.seed is None else args.seed,
                          args.corpus)
    print(json.dumps(summary.as_dict()))

