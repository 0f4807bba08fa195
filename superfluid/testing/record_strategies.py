"""Hypothesis strategies for every ABI record, derived from the compiled
layout (field widths from the numpy dtypes), so a field added to the header
is covered without touching the tests."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from superfluid.abi import record_dtype
from superfluid.abi.records import CLASSES, LAYOUTS


def _scalar(dt: np.dtype):
    if dt.kind == "u":
        return st.integers(0, (1 << (8 * dt.itemsize)) - 1)
    if dt.kind == "i":
        bits = 8 * dt.itemsize
        return st.integers(-(1 << (bits - 1)), (1 << (bits - 1)) - 1)
    if dt.kind == "f":
        return st.floats(width=8 * dt.itemsize, allow_nan=False)
    raise TypeError(dt)


def record(name: str, max_items: int = 4):
    """Any value of record `name` (spans hold up to max_items records)."""
    dt = record_dtype(name)
    parts = []
    for f in LAYOUTS[name]:
        fdt = dt.fields[f.name][0]
        if f.kind == "scalar":
            parts.append(_scalar(fdt))
        elif f.kind == "struct":
            parts.append(st.deferred(lambda sub=f.sub: record(sub, max_items)))
        elif f.kind == "array":
            parts.append(st.tuples(*[_scalar(fdt.base)] * f.length))
        elif f.kind == "chars":
            parts.append(st.binary(max_size=f.length).map(lambda b: b.rstrip(b"\0")))
        elif f.sub is bytes:
            parts.append(st.binary(max_size=64))
        else:
            parts.append(st.lists(st.deferred(lambda sub=f.sub: record(sub, 2)), max_size=max_items).map(tuple))
    return st.tuples(*parts).map(CLASSES[name]._make)
