"""`superfluid demo`, the README's run command, end to end through the CLI:
a daemon on the embedded tiny model, a worker killed mid-run, recovered
outputs bitwise equal to the uninterrupted run, nothing left behind."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from superfluid.testing.launch import python


@pytest.mark.timeout(300)
def test_demo_recovers_bitwise_and_cleans_up(shm_dir):
    r = subprocess.run([*python(), "-m", "superfluid.cli", "demo", "--requests", "6"], capture_output=True,
                       text=True, timeout=280, env={**os.environ, "SUPERFLUID_SHM_DIR": shm_dir})
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    assert "6/6 requests bitwise equal" in out, out
    assert re.search(r"restarts\s+1\b", out), out
    assert "killed by signal 9" in r.stderr, r.stderr  # the daemon's log says what happened
    # both runs made tokens, and the table reports both rates
    rates = re.search(r"tokens/s\s+([\d.]+) \(uninterrupted: ([\d.]+)\)", out)
    assert rates and float(rates[1]) > 0 and float(rates[2]) > 0, out
    assert "OK: daemon stopped, 0 segment(s) left behind" in out, out
    # one class under a JSON schema: every answer valid, one printed parsed
    m = re.search(r"JSON-schema answers\s+(\d+)/(\d+) valid, e\.g\. (\{.*\})", out)
    assert m and m[1] == m[2] != "0" and set(json.loads(m[3])) == {"answer", "confidence", "section"}, out
    assert not [f for f in os.listdir(shm_dir) if f.startswith("superfluid.demo-")]


@pytest.mark.timeout(120)
def test_demo_on_the_embedded_mamba2(shm_dir):
    """--arch mamba2: the same run on the exact_only Mamba2 runtime. Drafting
    cannot apply there (no truncation to any length): skipped, and said so."""
    r = subprocess.run([*python(), "-m", "superfluid.cli", "demo", "--arch", "mamba2", "--requests", "4"],
                       capture_output=True, text=True, timeout=110, env={**os.environ, "SUPERFLUID_SHM_DIR": shm_dir})
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    assert re.search(r"model \S+ \(mamba2, torch\)", out), out
    assert "4/4 requests bitwise equal" in out and re.search(r"restarts\s+1\b", out), out
    assert "killed by signal 9" in r.stderr, r.stderr
    assert re.search(r"speculation\s+skipped: the runtime is exact_only", out), out
    m = re.search(r"JSON-schema answers\s+(\d+)/(\d+) valid", out)
    assert m and m[1] == m[2] == "1", out
    assert "OK: daemon stopped, 0 segment(s) left behind" in out, out
    assert not [f for f in os.listdir(shm_dir) if f.startswith("superfluid.demo-")]
