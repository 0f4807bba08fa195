"""The amx-bf16 path's code where the CPU has no AMX: a test build of the
kernels whose tile instructions are C (kernels/sf_amx_emu.h, which aborts
where the hardware would fault) runs the ISA-path, kernel and numeric-class
suites in a child process. That checks everything of the path but the
hardware's own rounding (its tile shapes, strides, tails and
reconfigurations, the packing, the dispatch, the class's refusals); on a
machine with AMX the suites run on the real tiles and this is skipped. The
build offers its tiles only to a process that sets SUPERFLUID_AMX_EMULATED=1."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from superfluid.kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.available(), reason="the CPU kernels are not built")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SUITES = ["tests/kernels/test_isa_paths.py", "tests/kernels/test_cpu_kernels.py",
          "tests/engine/test_numeric_class.py"]

BUILD = """
import sys
sys.path.insert(0, {kernels!r})
import _build_cpu
print(_build_cpu.make_builder(amx_emulated=True).compile(tmpdir={tmp!r}))
"""

# The child imports the emulated build under the extension's name before
# anything imports the real one.
CHILD = """
import importlib.util, sys
name = "superfluid.kernels._cpu"
spec = importlib.util.spec_from_file_location(name, {so!r})
mod = importlib.util.module_from_spec(spec)
sys.modules[name] = mod
spec.loader.exec_module(mod)
from superfluid.kernels import cpu
print("PATH", cpu.best_isa(), ",".join(cpu.features()), flush=True)
import pytest
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-rs", *{suites!r}]))
"""


def test_the_amx_path_passes_the_kernel_suites_on_emulated_tiles(tmp_path):
    if cpu.ISA_LEVELS.get(cpu.best_isa(), 0) < cpu.ISA_LEVELS["avx512-bf16"]:
        pytest.skip("this CPU lacks avx512_bf16 (cpuid): the emulated tiles sit on the avx512-bf16 path")
    if "amx-verified" in cpu.features():
        pytest.skip("this CPU runs AMX's tiles: the suites run on the real ones")
    built = subprocess.run([sys.executable, "-P", "-c", BUILD.format(kernels=os.path.join(ROOT, "kernels"),
                                                                     tmp=str(tmp_path))],
                           cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    so = built.stdout.strip().splitlines()[-1]
    # Not asked for (SUPERFLUID_AMX_EMULATED unset), the build offers no tiles: such a build never
    # serves a worker bf16-amx rows by mistake.
    env = {k: v for k, v in os.environ.items() if k != "SUPERFLUID_AMX_EMULATED"}
    plain = subprocess.run([sys.executable, "-P", "-c", CHILD.format(so=so, suites=["--co", SUITES[0]])],
                           cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    line = next((ln.split() for ln in plain.stdout.splitlines() if ln.startswith("PATH ")), None)
    assert line and line[1] == "avx512-bf16" and "amx" not in line[2], plain.stdout[-2000:] + plain.stderr[-2000:]
    run = subprocess.run([sys.executable, "-P", "-c", CHILD.format(so=so, suites=SUITES)], cwd=ROOT,
                         capture_output=True, text=True, timeout=900, env=dict(env, SUPERFLUID_AMX_EMULATED="1"))
    out = run.stdout + run.stderr
    path = next((line.split() for line in out.splitlines() if line.startswith("PATH ")), None)
    assert path and path[1] == "amx-bf16" and {"amx-emulated", "amx-verified"} <= set(path[2].split(",")), out[-3000:]
    assert run.returncode == 0, out[-6000:]
    assert " passed" in out and "amx-bf16 path cannot run here" not in out, out[-3000:]


def test_the_shipped_build_has_no_emulated_tiles():
    assert "amx-emulated" not in cpu.features()
