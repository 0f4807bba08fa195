"""What the generators (gen_bindings, gen_go, gen_types) share: write the
files they make from the header, or with --check say which are out of date
(the tests run each with --check)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(module: str, doc: str | None, files: Mapping[str, Callable[[], str]], argv: list[str] | None) -> int:
    """The command line of generator `module`: 0 when every file is as made
    (written now, or with --check already so), 1 when --check found one stale."""
    p = argparse.ArgumentParser(prog=f"python -m {module}", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="exit 1 when a generated file is out of date")
    args = p.parse_args(argv)
    stale = []
    for path, make in files.items():
        text = make()
        try:
            with open(path, encoding="utf-8", newline="") as f:
                if f.read() == text:
                    continue
        except FileNotFoundError:
            pass
        stale.append(os.path.relpath(path, ROOT))
        if not args.check:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8", newline="") as f:
                f.write(text)
    if args.check and stale:
        print(f"out of date (run python -m {module}): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0
