"""The Go planner package (client/go): its copies of the ABI up to date with
abi/, and `go test ./...` against live daemons (fake runtime and tiny model),
offline, with every test run and none skipped."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from superfluid.abi import gen_go

GO_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "client", "go")
CODEC = "/usr/share/gocode/src/github.com/ugorji/go/codec"
# Top-level tests and subtests of `go test -v ./...` (each prints one "--- PASS").
EXPECTED_PASSES = 37


def test_the_go_copies_match_abi():
    assert gen_go.main(["--check"]) == 0


@pytest.mark.timeout(900)
def test_go_test_against_live_daemons(tmp_path):
    go = shutil.which("go")
    if go is None:
        pytest.skip("go is not installed: the Go package is not built here (.ci/run installs golang-go)")
    assert os.path.isdir(CODEC), f"{CODEC} is missing: install golang-github-ugorji-go-codec-dev (.ci/run does)"
    # Offline: no proxy, no checksum database, nothing but the Debian sources go.mod names.
    env = dict(os.environ, SUPERFLUID_PYTHON=sys.executable, GOCACHE=str(tmp_path / "cache"),
               GOPATH=str(tmp_path / "gopath"), GOPROXY="off", GOSUMDB="off", GOFLAGS="", GOTOOLCHAIN="local",
               CGO_ENABLED="1")
    vet = subprocess.run([go, "vet", "./..."], cwd=GO_DIR, env=env, capture_output=True, text=True, timeout=600)
    assert vet.returncode == 0, vet.stdout[-4000:] + vet.stderr[-4000:]  # layout_gen.go's asserts included
    r = subprocess.run([go, "test", "-v", "-count=1", "-timeout", "800s", "./..."], cwd=GO_DIR, env=env,
                       capture_output=True, text=True, timeout=850)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    skipped = re.findall(r"^\s*--- SKIP: .*$", r.stdout, re.M)
    assert not skipped, skipped
    passed = re.findall(r"^\s*--- PASS: ", r.stdout, re.M)
    assert len(passed) == EXPECTED_PASSES, r.stdout[-6000:]
