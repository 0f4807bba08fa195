"""The package as a static checker must see it: a folder of symlinks.

    python -P -m superfluid.testing.typecheck_tree            # (re)makes build/typecheck
    python -P -m superfluid.testing.typecheck_tree --out DIR

The editable install maps `superfluid.X` to the root's folder X
(pyproject.toml's [tool.setuptools.package-dir]) through an import hook that
mypy, pyright and editors do not run. Here that mapping becomes
DIR/superfluid/: a link to each entry of the superfluid/ folder and one per
mapped subpackage (abi -> ../../../abi, ...). mypy's mypy_path and pyright's
extraPaths name build/typecheck, so `superfluid.abi.records` is abi/records.py.
The links are relative, so the tree follows the checkout; made anew each time,
it follows files added or removed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "build" / "typecheck"


def package_dirs(root: Path = ROOT) -> dict[str, Path]:
    """Package name -> its folder, from pyproject.toml."""
    meta = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
    mapping: dict[str, str] = meta["tool"]["setuptools"]["package-dir"]
    return {name: root / folder for name, folder in mapping.items()}


def _link(target: Path, link: Path) -> None:
    link.symlink_to(os.path.relpath(target, link.parent), target_is_directory=target.is_dir())


def build(out: Path = DEFAULT_OUT, root: Path = ROOT) -> Path:
    """Make out/<package>/ for each top-level package of the mapping; returns out."""
    dirs = package_dirs(root)
    tops = sorted(n for n in dirs if "." not in n)
    if out.exists():
        shutil.rmtree(out)
    for top in tops:
        pkg = out / top
        pkg.mkdir(parents=True)
        # A mapped subpackage beats an entry of the same name in the top folder.
        subs = {n.split(".")[1]: d for n, d in dirs.items() if n.count(".") == 1 and n.startswith(top + ".")}
        for entry in sorted(dirs[top].iterdir()):
            if entry.name not in subs and entry.name != "__pycache__":
                _link(entry, pkg / entry.name)
        for name, folder in sorted(subs.items()):
            _link(folder, pkg / name)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    print(build(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
