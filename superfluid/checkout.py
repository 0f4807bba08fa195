"""A checkout's root on sys.path (`python -c ...` or `python -m ...` started
there without -P) makes its top-level folders importable by their bare names,
and they would shadow installed packages of those names (transformers imports
Hugging Face's `kernels`). Each folder's __init__ calls `not_ours` when it is
imported by its bare name: the installed package of that name takes its place,
or the import fails as if the folder were not there."""

from __future__ import annotations

import importlib.util
import os
import sys
from importlib.machinery import PathFinder


def not_ours(name: str, init_file: str) -> None:
    """Put the package `name` found anywhere but the checkout holding
    init_file's folder in sys.modules[name] (importlib returns what is there
    once the shadowing __init__ has run), else raise ModuleNotFoundError."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(init_file)))
    elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
    spec = None
    for finder in sys.meta_path:
        if finder is PathFinder:
            spec = PathFinder.find_spec(name, elsewhere)
        elif (find := getattr(finder, "find_spec", None)) is not None:
            spec = find(name, None)
        if spec is not None:
            break
    if spec is None:
        raise ModuleNotFoundError(f"No module named {name!r} (the checkout's {name}/ is superfluid.{name})",
                                  name=name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    if spec.loader is None:  # a namespace package: nothing to run
        return
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
