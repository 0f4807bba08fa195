"""The `superfluid` command line.

Each subcommand lives in its own module, which exposes
`register(subparsers)`: it adds its parser and sets `func(args) -> int` as
the parser's default. Adding a subcommand is one line in COMMANDS.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

import superfluid

COMMANDS: tuple[str, ...] = (
    "superfluid.bench",
    "superfluid.client.workload",
    "superfluid.daemon.replay",
    "superfluid.daemon.serve",
    "superfluid.daemon.status",
    "superfluid.demo",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="superfluid", description="A tick-based LLM executor behind a C ABI over shared memory.")
    parser.add_argument("--version", action="version", version=f"superfluid {superfluid.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
