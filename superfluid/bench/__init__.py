"""`superfluid bench <name>`: benchmarks, one module each.

Each module in BENCHES exposes `register(subparsers)` like the top-level
commands do.
"""

from __future__ import annotations

import argparse
import importlib

BENCHES: tuple[str, ...] = (
    "superfluid.bench.ring",
    "superfluid.bench.engine",
    "superfluid.bench.tick",
    "superfluid.bench.e2e",
    "superfluid.bench.prefix",
    "superfluid.bench.grammar",
    "superfluid.bench.speculation",
)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("bench", help="run a benchmark", description="Run a benchmark.")
    bench_sub = p.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for name in BENCHES:
        importlib.import_module(name).register(bench_sub)
