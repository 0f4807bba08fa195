"""How tests and the tools they drive start Python: `python -P`.

Without -P, `python -m X` and `python -c ...` put the working directory first
on sys.path; started from a checkout, the repository's top-level folders
(kernels/, engine/, ...) would then shadow installed packages of those names
(transformers imports Hugging Face's `kernels`). The project's own modules are
reached as `superfluid.*` through the install, never through the root."""

from __future__ import annotations

import sys


def python(*args: str) -> list[str]:
    """The argv of this interpreter, safe path, running `args`."""
    return [sys.executable, "-P", *args]
