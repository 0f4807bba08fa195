"""`bench engine --isa`: our decode again on named paths of the C kernels.

One machine can then show what each path (scalar, avx2, avx512, ...) is worth
and that paths of one numeric class give the same tokens. The timed run is
engine.py's, passed in: this module forces the path around it and reports.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from superfluid.bench.roofline import PER_BATCH, rates


def isa_key(name: str) -> str:
    """The kernels' own name for the path `name` spells (an alias, any case);
    a name they do not know as given, for its entry's error."""
    from superfluid.kernels import cpu

    try:
        return cpu.ISA_NAMES[cpu.parse_isa(name)]
    except ValueError:
        return name


def isa_runs(names: list[str], path: Path, prompts: dict[int, np.ndarray], gen: int,
             main_tokens: dict[int, np.ndarray], *, ours: Callable[[np.ndarray], dict[str, Any]], peak: float,
             floor_ms: float, log: Callable[[str], None]) -> dict[str, dict[str, Any]]:
    """Our decode again on each named path of the C kernels, as a process
    started with SUPERFLUID_ISA=NAME runs: the path forced before the load
    (weights are packed for it, bf16 in the class it implies unless pinned)
    and the path before it restored after. `ours(prompts)` is our timed run
    of one batch of the checkpoint at `path`, loaded on the path in force.
    A path this CPU lacks, or a name we do not know, is that entry's error."""
    from superfluid.engine.config import load_config
    from superfluid.kernels import cpu

    cfg = load_config(path)
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        key = isa_key(name)
        if not cpu.available():
            out[key] = {"error": "the C kernels are not built"}
            continue
        before = cpu.isa()
        try:
            cpu.force_isa(cpu.parse_isa(name))
        except ValueError as e:
            out[key] = {"error": str(e)}
            log(f"isa {key}: {e}")
            continue
        try:
            entry: dict[str, Any] = {k: {} for k in ("decode_tok_s", "prefill_tok_s", *PER_BATCH,
                                                     "tokens_equal_main")}
            for b, batch in prompts.items():
                run = ours(batch)
                entry["isa"], entry["numeric_class"] = run["isa"], run["numeric_class"]
                for k, v in rates(cfg, batch, gen, run, peak, floor_ms).items():
                    entry[k][str(b)] = v
                entry["tokens_equal_main"][str(b)] = bool(np.array_equal(run["tokens"], main_tokens[b]))
                log(f"isa {key} ({entry['numeric_class']}) batch {b}: decode {entry['decode_tok_s'][str(b)]} "
                    f"tok/s, floor fraction {entry['floor_fraction'][str(b)]}, "
                    f"tokens equal the main run's: {entry['tokens_equal_main'][str(b)]}")
        finally:
            cpu.force_isa(None if before == cpu.best_isa() else before)
        out[key] = entry
    return out


def isa_names() -> list[str]:
    """The paths --isa takes, for its help."""
    from superfluid.kernels import cpu

    return list(cpu.ISA_NAMES.values())


def isa_list(text: str) -> list[str]:
    """--isa's names, checked here: a typo fails before the run, not after."""
    from superfluid.kernels import cpu

    names = [n for n in text.split(",") if n.strip()]
    for n in names:
        try:
            cpu.parse_isa(n)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return names
