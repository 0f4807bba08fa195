"""cffi build of superfluid.h + sf_ring.c into superfluid.abi._native.

The header is the single source of truth: the cdef is the header itself,
less what cffi's parser does not take (include guards, C++ guards, static
asserts). The compiled module checks every struct against the real header,
so the layout Python sees is the compiler's.
"""

from __future__ import annotations

import os
import re

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
HEADER = os.path.join(HERE, "superfluid.h")

_DEFINE_INT = re.compile(r"^#define\s+SF_\w+\s+(0x[0-9a-fA-F]+|\d+)\s*(/\*.*\*/)?\s*$")


def cdef_text(header: str) -> str:
    """The header with preprocessor lines (but integer #defines), C++ blocks
    and static asserts removed."""
    out: list[str] = []
    skipping: list[bool] = []  # one entry per open #if: True when its branch is dropped
    for line in header.splitlines():
        s = line.strip()
        if s.startswith("#if"):
            skipping.append("__cplusplus" in s)
            continue
        if s.startswith("#else"):
            if skipping:
                skipping[-1] = not skipping[-1] if "__cplusplus" not in s else skipping[-1]
            continue
        if s.startswith("#endif"):
            if skipping:
                skipping.pop()
            continue
        if any(skipping):
            continue
        if s.startswith("#"):
            if _DEFINE_INT.match(s):
                out.append(line)
            continue
        if s.startswith("SF_STATIC_ASSERT("):
            continue
        out.append(line)
    return "\n".join(out)


def make_builder() -> FFI:
    ffi = FFI()
    with open(HEADER, encoding="utf-8") as f:
        ffi.cdef(cdef_text(f.read()))
    # setuptools wants paths relative to the project root, where setup.py runs.
    rel = "abi" if os.path.abspath(os.getcwd()) == os.path.dirname(HERE) else HERE
    ffi.set_source(
        "superfluid.abi._native",
        '#include "superfluid.h"\n',
        sources=[os.path.join(rel, "sf_ring.c")],
        include_dirs=[rel],
        extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wno-unused-function"],
    )
    return ffi


ffibuilder = make_builder()

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
