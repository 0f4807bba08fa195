"""The header is the single source of truth: it compiles on its own (its
static asserts run), every field is documented, and what Python sees is what
the compiler laid out."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from superfluid import abi
from superfluid.abi import ffi, lib, record_dtype
from superfluid.abi.records import CLASSES, RECORD_NAMES, fields_of

HEADER = abi.HEADER_PATH


def _compile(compiler: str, args: list[str], src: str, tmp_path) -> subprocess.CompletedProcess:
    path = tmp_path / ("t.cpp" if compiler.endswith("++") else "t.c")
    path.write_text(src)
    return subprocess.run([compiler, *args, "-I", str(tmp_path.parent), "-I", abi.os.path.dirname(HEADER),
                           "-fsyntax-only", str(path)], capture_output=True, text=True)


@pytest.mark.parametrize("compiler,std", [("gcc", "-std=c11"), ("g++", "-std=c++11")])
def test_header_compiles_alone_with_its_static_asserts(compiler, std, tmp_path):
    if shutil.which(compiler) is None:
        pytest.skip(f"{compiler} not installed")
    r = _compile(compiler, [std, "-Wall", "-Wextra", "-Wpadded", "-Werror"], '#include "superfluid.h"\n', tmp_path)
    assert r.returncode == 0, r.stderr


def test_a_wrong_size_assert_would_fail_to_compile(tmp_path):
    # Negative control: the asserts are live, not decoration.
    if shutil.which("gcc") is None:
        pytest.skip("gcc not installed")
    src = '#include "superfluid.h"\nSF_STATIC_ASSERT(sizeof(TickPlan) == 96, "wrong on purpose");\n'
    r = _compile("gcc", ["-std=c11"], src, tmp_path)
    assert r.returncode != 0 and "wrong on purpose" in r.stderr


def test_every_field_has_a_comment():
    text = Path(HEADER).read_text(encoding="utf-8")
    undocumented = []
    for body_name, body in re.findall(r"typedef struct (\w+) \{(.*?)\n\}", text, re.S):
        for line in body.splitlines():
            s = line.strip()
            if not s or s.startswith(("/*", "*")) or "_pad" in s or "_reserved" in s:
                continue
            if s.endswith(";") and "/*" not in line:
                undocumented.append(f"{body_name}: {s}")
    assert not undocumented, undocumented


@pytest.mark.parametrize("name", RECORD_NAMES)
def test_numpy_dtype_matches_the_compiled_layout(name):
    dt = record_dtype(name)
    assert dt.itemsize == ffi.sizeof(name)
    ct = ffi.typeof(name)
    for fname, field in ct.fields:
        if fname in dt.names:
            assert dt.fields[fname][1] == field.offset, fname
    assert list(CLASSES[name]._fields) == [f for f, _ in fields_of(name)]


@pytest.mark.parametrize("name", RECORD_NAMES)
def test_records_are_multiples_of_eight_bytes(name):
    # The same layout on every target: no tail padding left to the compiler.
    assert ffi.sizeof(name) % 8 == 0


def test_hot_fields_sit_on_their_own_cache_lines():
    line = lib.SF_CACHE_LINE
    off = {f: ffi.offsetof("SegmentHeader", f) for f in ("worker_epoch", "yield_requested", "latency_wanted",
                                                          "session_id", "runtime")}
    assert sorted(v // line for v in off.values()) == [1, 2, 3, 4, 5]
    assert ffi.offsetof("Queue", "tail") - ffi.offsetof("Queue", "head") == line
    assert ffi.offsetof("Queue", "consumer_sleeping") == 2 * line


def test_enums_come_from_the_header():
    assert abi.Status.OK == 0 and abi.Status.RejectBadRefGeneration == lib.SF_STATUS_RejectBadRefGeneration
    spec_statuses = ["OK", "RejectIllegalCombination", "RejectBudget", "RejectBounds", "RejectUnknownLane",
                     "RejectHostRules", "RejectStaleNonce", "RejectStaleSeed", "RejectBadRefGeneration", "NeedsReplan",
                     "Fatal", "StaleSession"]
    assert [s.name for s in abi.Status] == spec_statuses
    assert [s.name for s in abi.Sampling] == ["GPU_GREEDY", "GPU_SAMPLE", "HOST"]
    assert {f.name for f in abi.Finish} == {"NONE", "EOS", "LENGTH", "GRAMMAR"}
    assert abi.Sampling.GPU_GREEDY < abi.Sampling.GPU_SAMPLE < abi.Sampling.HOST
    assert abi.PlanFlag.DRAIN | abi.PlanFlag.PARTIAL_EMITS == abi.PLAN_FLAGS_ALL
    assert len({int(s) for s in abi.Status}) == len(abi.Status)


def test_magic_spells_the_segment_tag():
    assert abi.MAGIC.to_bytes(8, "little") == b"SFLUIDV1"


def test_lane_logprob_holds_max_top_logprobs():
    dt = record_dtype("LaneLogprob")
    assert dt["top_ids"].shape == (abi.MAX_TOP_LOGPROBS,)
    assert dt["top_logprobs"].base == np.dtype("<f4")


@pytest.mark.parametrize("fn,enum", [("sf_status_name", "Status"), ("sf_opst_name", "OpStatus"),
                                     ("sf_worker_state_name", "WorkerState"), ("sf_msg_kind_name", "MsgKind"),
                                     ("sf_op_name", "OpKind")])
def test_every_constant_has_its_name_in_c(fn, enum):
    # The names other languages print come from sf_ring.c: one per constant of the header.
    names = getattr(lib, fn)
    for e in getattr(abi, enum):
        assert ffi.string(names(int(e))).decode() == e.name
    assert ffi.string(names(12345)) == b"unknown"  # negative control
