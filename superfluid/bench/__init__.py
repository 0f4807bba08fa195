"""`superfluid bench <name>`: benchmarks, one module each.

Each module in BENCHES exposes `register(subparsers)` like the top-level
commands do. Every bench takes `--save DIR` (results.py): its result as
files that documentation quotes.
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
    "superfluid.bench.tp",
)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("bench", help="run a benchmark", description="Run a benchmark.")
    bench_sub = p.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for name in BENCHES:
        importlib.import_module(name).register(bench_sub)
    from superfluid.bench.results import saving

    for name, bp in {n: p for n, p in bench_sub.choices.items() if n == p.prog.split()[-1]}.items():
        bp.add_argument("--save", metavar="DIR", help=f"also write DIR/{name}.json (the result and what it ran "
                                                         f"on) and DIR/{name}.md (a table of it); implies --json")
        bp.set_defaults(func=saving(name, bp.get_default("func")))
